"""RL step time and decode throughput: ptrain against Tunix, and ptrain's sampler against
Hugging Face transformers' generate, on one tiny Qwen3-style model, measured in one run.

All three load the same checkpoint (written here by ptrain.hf.save) and run the same
workload: P prompts of up to `prompt_len` tokens, G samples each, `new_tokens` new tokens,
float32, on CPU. An RL step is GRPO: generation, rewards (the fraction of tokens equal to
one target token), log-probs and one optimizer update (AdamW, no KL). Its time is the
interval between consecutive steps' reward calls, after `warmup` steps, for both frameworks.

Tunix runs in its own environment, in a subprocess (bench/rl_bench_tunix.py):

    python -m pip install uv && cd bench && python -m uv venv .venv-tunix \
        && python -m uv pip install --python .venv-tunix/bin/python google-tunix && cd ..
    python bench/rl_bench.py [--prompts 8 --samples 8 --prompt-len 32 --new-tokens 64]
    python bench/rl_bench.py --modes static engine engine-k1 engine-k1-remat   # see MODES
    python bench/rl_bench.py --lora [--modes engine-k1-remat]  # LoRA (rank 8, all
        # projections, KL on) against full fine-tuning in one of MODES, time and peak state
        # memory, beside Tunix's LoRA GRPO (qwix, the same rank, alpha, targets and KL)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ptrain import hf  # noqa: E402
from ptrain import learner  # noqa: E402
from ptrain import model as model_lib  # noqa: E402
from ptrain.generate import sampler as sampler_lib  # noqa: E402

TUNIX_PYTHON = os.path.join(REPO, "bench", ".venv-tunix", "bin", "python")
MODEL = dict(vocab_size=2048, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384,
             head_dim=32, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=True)
TARGET, EOS = 7, 2


def _stats(times):
    """(min, median): other processes on a shared machine only ever add time, so the
    minimum is the cleaner estimate; the median shows the spread."""
    return [float(np.min(times)), float(np.median(times))]


def _time(fn, repeats):
    fn()  # compilation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return _stats(times)


def ptrain_decode(model_dir, prompts, args):
    model, _ = hf.load(model_dir)
    sampler = sampler_lib.Sampler(model, seed=0)

    def generate():
        out = sampler.sample(model, prompts, num_samples=args.samples,
                             max_new_tokens=args.new_tokens, temperature=1.0,
                             prompt_len=args.prompt_len)
        assert (out.lengths == args.new_tokens).all()

    greedy = sampler.sample(model, prompts, max_new_tokens=16, greedy=True,
                            prompt_len=args.prompt_len).tokens
    return _time(generate, args.repeats), greedy


def transformers_decode(model_dir, prompts, args):
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = np.zeros((len(prompts), args.prompt_len), np.int64)
    mask = np.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, args.prompt_len - len(p):], mask[i, args.prompt_len - len(p):] = p, 1
    ids, mask = torch.tensor(ids), torch.tensor(mask)

    def generate(**kwargs):
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=mask, pad_token_id=0,
                                  eos_token_id=EOS, **kwargs)

    def sample():
        out = generate(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                       max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                       num_return_sequences=args.samples)
        assert out.shape == (len(prompts) * args.samples, args.prompt_len + args.new_tokens)

    greedy = generate(do_sample=False, max_new_tokens=16, min_new_tokens=16)
    return _time(sample, args.repeats), greedy[:, args.prompt_len:].numpy(), torch


_K1 = {"sampling.engine": True, "rl.staleness": 1, "rl.tis_cap": 2.0}
MODES = {  # ptrain's RL step: the sampler and how far generation runs ahead of the learner
    "static": {},
    "engine": {"sampling.engine": True},
    "engine-remat": {"sampling.engine": True, "model.remat": "full"},  # on-policy (k = 0)
    "engine-k1": _K1,
    # (on CPU recomputing a layer's activations is cheaper than saving them from the scan)
    "engine-k1-remat": {**_K1, "model.remat": "full"},
}
_KL = {"kl.coef": 0.01}  # (--lora: with a reference policy, which LoRA does not copy)
LORA_MODES = {"full": _KL, "lora": {**_KL, "lora.rank": 8, "lora.alpha": 16.0}}


def tunix_lora_work() -> dict:
    """rl_bench_tunix.py's LoRA workload: qwix adapters with ptrain's `--lora` rank, alpha and
    targets (Tunix's Qwen3 modules carry the HF projection names), KL coefficient as beta."""
    m = LORA_MODES["lora"]
    targets = learner.defaults().lora.targets
    return {"beta": m["kl.coef"], "lora": {
        "rank": m["lora.rank"], "alpha": m["lora.alpha"],
        "module_path": ".*/(" + "|".join(targets) + ")"}}


def ptrain_rl(model_dir, prompts, args, workdir, mode="static", lora_mode=None):
    """Seconds per GRPO step of ptrain.learner.train, from the intervals between reward calls;
    `mode` one of MODES (with staleness 1 a step's interval is the loop's throughput: batch
    t+1 is generated while batch t trains, with truncated importance weights), and on top of
    it `lora_mode` one of LORA_MODES."""
    rows = args.prompts * args.samples
    stamps, calls = [], [0]

    def reward(record, completion_ids, completion_text):
        if calls[0] % rows == 0:
            stamps.append(time.perf_counter())
        calls[0] += 1
        return sum(t == TARGET for t in completion_ids) / max(len(completion_ids), 1)

    c = learner.defaults()
    c.steps = args.warmup + args.steps + 1
    c.hf_model = model_dir
    c.data.records_fn = lambda seed: [{"prompt_ids": p} for p in prompts]
    c.data.prompts_per_step, c.data.max_prompt_len = args.prompts, args.prompt_len
    c.reward_fn = reward
    c.sampling.num_samples, c.sampling.max_new_tokens = args.samples, args.new_tokens
    c.sampling.stop_token_ids = (EOS,)
    c.rl.clip_low = c.rl.clip_high = 0.2
    c.optim.lr, c.optim.schedule = args.lr, "constant"
    c.log.rollouts_every = 0
    c.checkpoint.every = 10**6
    c.sampling.engine_slots = rows
    c.update_from_flattened_dict({**MODES[mode], **LORA_MODES.get(lora_mode, {})})
    learner.train(c, workdir)
    intervals = np.diff(stamps)[args.warmup:]
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    timed = records[args.warmup + 1:]
    split = {k: float(np.min([r[k] for r in timed])) for k in ("time/rollout_s",
                                                               "time/update_s")}
    return _stats(intervals), len(intervals), split


def tunix(model_dir, prompts, args, **extra):
    """Tunix's decode and GRPO step (`extra`: more of the workload, as rl_bench_tunix.py reads
    it), and its version."""
    if not os.path.exists(TUNIX_PYTHON):
        raise SystemExit(f"{TUNIX_PYTHON} is missing; create it as the module docstring says")
    work = {"model_dir": model_dir, "model": MODEL, "prompts": prompts,
            "num_samples": args.samples, "new_tokens": args.new_tokens,
            "prompt_len": args.prompt_len, "repeats": args.repeats, "warmup": args.warmup,
            "steps": args.steps, "lr": args.lr, "target": TARGET,
            "prompts_per_step": args.prompts, **extra}
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([TUNIX_PYTHON, os.path.join(REPO, "bench", "rl_bench_tunix.py"),
                          json.dumps(work)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"Tunix failed:\n{out.stderr[-3000:]}")
    version = subprocess.run([TUNIX_PYTHON, "-c", "import importlib.metadata as m; "
                              "print(m.version('google-tunix'))"], capture_output=True,
                             text=True, env=env).stdout.strip()
    return json.loads(out.stdout.strip().splitlines()[-1]), version


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternate the frameworks this many times (a shared machine's "
                             "load drifts; each is timed in every round)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--modes", nargs="+", default=["static"], choices=list(MODES),
                        help="ptrain's RL step: static sampler, rollout engine, engine with "
                             "rl.staleness=1 (-remat: and model.remat=full)")
    parser.add_argument("--lora", action="store_true",
                        help="ptrain's GRPO step with LoRA against full fine-tuning, and "
                             "Tunix's with qwix LoRA")
    args = parser.parse_args()
    if args.lora and len(args.modes) > 1:
        parser.error("--lora takes one of --modes (both ptrain runs use it)")
    if args.lora:
        return lora_main(args)

    rng = np.random.RandomState(0)
    prompts = [[1] + rng.randint(3, MODEL["vocab_size"], rng.randint(8, args.prompt_len))
               .tolist() for _ in range(args.prompts)]
    config = model_lib.ModelConfig(**MODEL, qk_norm=True, family="qwen3", bos_token_id=1,
                                   eos_token_ids=(EOS,))
    runs = {"ptrain decode": [], "Tunix decode": [], "transformers decode": [],
            **{f"ptrain RL {m}": [] for m in args.modes}, "Tunix RL": []}
    splits = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        hf.save(model_lib.init(config, seed=0), config, model_dir)
        for r in range(args.rounds):
            t_tunix, tunix_version = tunix(model_dir, prompts, args)
            t_ours, greedy_ours = ptrain_decode(model_dir, prompts, args)
            t_hf, greedy_hf, torch = transformers_decode(model_dir, prompts, args)
            for m in args.modes:
                rl_ours, n_timed, splits[m] = ptrain_rl(model_dir, prompts, args,
                                                        os.path.join(tmp, f"run{r}-{m}"), m)
                runs[f"ptrain RL {m}"].append(rl_ours)
            for key, value in (("ptrain decode", t_ours), ("Tunix decode", t_tunix["decode_s"]),
                               ("transformers decode", t_hf),
                               ("Tunix RL", t_tunix["rl_step_s"])):
                runs[key].append(value)
            steps = ", ".join(
                f"{m} {runs[f'ptrain RL {m}'][-1][0] * 1e3:.0f} ms (rollout "
                f"{splits[m]['time/rollout_s'] * 1e3:.0f}, update "
                f"{splits[m]['time/update_s'] * 1e3:.0f})" for m in args.modes)
            print(f"round {r}: RL step ptrain {steps}, Tunix "
                  f"{t_tunix['rl_step_s'][0] * 1e3:.0f} ms; decode ptrain "
                  f"{t_ours[0] * 1e3:.0f} ms, Tunix {t_tunix['decode_s'][0] * 1e3:.0f} ms, "
                  f"transformers {t_hf[0] * 1e3:.0f} ms", flush=True)
    # best: the minimum over rounds; typical: the median of the rounds' medians
    best = {k: min(v[0] for v in vs) for k, vs in runs.items()}
    typical = {k: float(np.median([v[1] for v in vs])) for k, vs in runs.items()}

    n = args.prompts * args.samples * args.new_tokens
    print(f"model: Qwen3-style, {config.n_params / 1e6:.2f}M params, float32; "
          f"{args.prompts} prompts x {args.samples} samples, prompts <= {args.prompt_len} "
          f"tokens, {args.new_tokens} new tokens; jax {jax.__version__}, Tunix {tunix_version}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"{os.cpu_count()} cores; {args.rounds} rounds")
    print(f"greedy tokens, ptrain == transformers: {np.array_equal(greedy_ours, greedy_hf)}")
    print("decode tokens/s (sampling, temperature 1), best / typical:")
    for name in ("ptrain", "Tunix", "transformers"):
        key = f"{name} decode"
        print(f"  {name:13s} {n / best[key]:9.0f} / {n / typical[key]:6.0f}  "
              f"({best[key] * 1e3:.0f} ms)")
    print(f"  ratio ptrain / Tunix: {best['Tunix decode'] / best['ptrain decode']:.2f}x, "
          f"ptrain / transformers: "
          f"{best['transformers decode'] / best['ptrain decode']:.2f}x (best times)")
    print(f"RL step (GRPO: generate + rewards + log-probs + update), best / typical, "
          f"{n_timed} steps a round:")
    for key in [f"ptrain RL {m}" for m in args.modes] + ["Tunix RL"]:
        print(f"  {key[:-3] if key == 'Tunix RL' else key[10:]:15s} "
              f"{best[key] * 1e3:7.0f} / {typical[key] * 1e3:5.0f} ms")
    for m in args.modes:
        key = f"ptrain RL {m}"
        per_round = [t[1] / o[1] for t, o in zip(runs["Tunix RL"], runs[key])]
        print(f"  ratio Tunix / ptrain {m}: {best['Tunix RL'] / best[key]:.2f}x (best), "
              f"{typical['Tunix RL'] / typical[key]:.2f}x (typical); per round (medians) "
              + ", ".join(f"{x:.2f}x" for x in per_round))


def _state_bytes(mode, model_dir, args) -> dict:
    """The learner state a device holds through a step: parameters, optimizer state and
    reference policy (the plan's accounting, `ptrain.plan.compile_rl_step`, one device)."""
    from ptrain import plan
    c = learner.defaults()
    c.hf_model = model_dir
    c.data.prompts_per_step, c.data.max_prompt_len = args.prompts, args.prompt_len
    c.sampling.num_samples, c.sampling.max_new_tokens = args.samples, args.new_tokens
    c.update_from_flattened_dict(LORA_MODES[mode])
    r = plan.compile_rl_step(c, {"fsdp": 1})
    return {k: r[k] for k in ("params_bytes", "trainable_bytes", "opt_state_bytes",
                              "reference_bytes", "step_peak")}


def lora_decode(model_dir, prompts, args) -> dict:
    """Sampling seconds of the LoRA model decoded unmerged (base + adapters) and merged
    (`lora.merged`: the adapters folded into a LoRA-free copy), and one merge's seconds."""
    from flax import nnx

    from ptrain import lora
    base, c = hf.load(model_dir)
    lc = c.replace(lora_rank=8, lora_alpha=16.0, lora_targets=tuple(lora.TARGETS.values()))
    graphdef, state = lora.attach(nnx.state(base), lc, seed=0)
    merge = jax.jit(lambda s: lora.merged(s, lc)[0])
    models = {"unmerged": nnx.merge(graphdef, state),
              "merged": nnx.merge(nnx.graphdef(base), merge(state))}
    out = {}
    for name, model in models.items():
        sampler = sampler_lib.Sampler(model, seed=0)
        out[name] = _time(lambda: sampler.sample(  # noqa: B023
            model, prompts, num_samples=args.samples, max_new_tokens=args.new_tokens,  # noqa: B023
            temperature=1.0, prompt_len=args.prompt_len), args.repeats)
    out["merge"] = _time(lambda: jax.block_until_ready(merge(state)), args.repeats)
    return out


def lora_main(args):
    """GRPO steps with LoRA and with full fine-tuning, and Tunix's with qwix LoRA, alternated
    `rounds` times."""
    rng = np.random.RandomState(0)
    prompts = [[1] + rng.randint(3, MODEL["vocab_size"], rng.randint(8, args.prompt_len))
               .tolist() for _ in range(args.prompts)]
    config = model_lib.ModelConfig(**MODEL, qk_norm=True, family="qwen3", bos_token_id=1,
                                   eos_token_ids=(EOS,))
    runs = {m: [] for m in (*LORA_MODES, "Tunix lora")}
    splits = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        hf.save(model_lib.init(config, seed=0), config, model_dir)
        for r in range(args.rounds):
            t_tunix, tunix_version = tunix(model_dir, prompts, args, **tunix_lora_work())
            runs["Tunix lora"].append(t_tunix["rl_step_s"])
            for m in LORA_MODES:
                t, n_timed, splits[m] = ptrain_rl(model_dir, prompts, args,
                                                  os.path.join(tmp, f"run{r}-{m}"),
                                                  args.modes[0], m)
                runs[m].append(t)
            print(f"round {r}: " + ", ".join(
                f"{m} {runs[m][-1][0] * 1e3:.0f} ms (update {splits[m]['time/update_s'] * 1e3:.0f})"
                for m in LORA_MODES) + f", Tunix lora {runs['Tunix lora'][-1][0] * 1e3:.0f} ms",
                flush=True)
        memory = {m: _state_bytes(m, model_dir, args) for m in LORA_MODES}
        decode = lora_decode(model_dir, prompts, args)
    best = {m: min(v[0] for v in vs) for m, vs in runs.items()}
    typical = {m: float(np.median([v[1] for v in vs])) for m, vs in runs.items()}
    print(f"model: Qwen3-style, {config.n_params / 1e6:.2f}M params, float32; "
          f"{args.prompts} prompts x {args.samples} samples, {args.new_tokens} new tokens, "
          f"KL 0.01; ptrain mode {args.modes[0]}; jax {jax.__version__}, Tunix "
          f"{tunix_version}; {os.cpu_count()} cores; {args.rounds} rounds, {n_timed} steps each")
    for m in LORA_MODES:
        mem = memory[m]
        print(f"  {m:5s} step {best[m] * 1e3:6.0f} / {typical[m] * 1e3:.0f} ms (best / "
              f"typical; last round's update {splits[m]['time/update_s'] * 1e3:.0f} ms); "
              f"state MiB: params "
              f"{mem['params_bytes'] / 2**20:.2f} (trainable {mem['trainable_bytes'] / 2**20:.2f}), "
              f"optimizer {mem['opt_state_bytes'] / 2**20:.2f}, reference "
              f"{mem['reference_bytes'] / 2**20:.2f}; plan step peak "
              f"{mem['step_peak'] / 2**20:.2f}")
    print(f"  Tunix lora step {best['Tunix lora'] * 1e3:6.0f} / "
          f"{typical['Tunix lora'] * 1e3:.0f} ms (qwix, rank 8, the same targets, beta 0.01)")
    print(f"  decode ({args.prompts * args.samples * args.new_tokens} tokens): unmerged "
          f"{decode['unmerged'][0] * 1e3:.0f} ms, merged {decode['merged'][0] * 1e3:.0f} ms "
          f"(ratio {decode['unmerged'][0] / decode['merged'][0]:.2f}x); one merge "
          f"{decode['merge'][0] * 1e3:.1f} ms")
    print(f"  ratio full / lora step time: {best['full'] / best['lora']:.2f}x; state "
          f"(params + optimizer + reference) full / lora: "
          f"{sum(memory['full'][k] for k in ('params_bytes', 'opt_state_bytes', 'reference_bytes')) / sum(memory['lora'][k] for k in ('params_bytes', 'opt_state_bytes', 'reference_bytes')):.2f}x")
    per_round = [t[1] / o[1] for t, o in zip(runs["Tunix lora"], runs["lora"])]
    print(f"  ratio Tunix lora / ptrain lora step time: "
          f"{best['Tunix lora'] / best['lora']:.2f}x (best), "
          f"{typical['Tunix lora'] / typical['lora']:.2f}x (typical); per round (medians) "
          + ", ".join(f"{x:.2f}x" for x in per_round))


if __name__ == "__main__":
    main()
