"""Rollout throughput: the engine (ptrain/generate/engine.py) against today's static sampler
(ptrain/generate/sampler.py) and Tunix's vanilla sampler, on one model, measured in one run.

Two workloads (bench/rl_bench.py's model and checkpoint, float32):
  long tail   `--requests` prompts (8-32 tokens), each with its own completion length drawn
              from a geometric distribution (mean `--mean-len`, at most `--max-len`). The
              static samplers cannot stop a row early without a stop token, and with one they
              still run until the longest row ends, so they decode max(lengths) steps for the
              whole batch; the engine stops each row at its length. Tokens/s counts the
              requested tokens (sum of lengths) for all three.
  multi-turn  `--episodes` episodes (P prompts x G samples), `--turns` model turns of
              `--turn-tokens` tokens, each but the last followed by a tool call that sleeps
              `--tool-ms` and returns `--obs-tokens` tokens. Today's path is rollout.py's:
              the first turn is one sampler call with G samples per prompt, every later turn
              re-prefills each episode's history, and a turn's tools run (concurrently)
              before the next turn starts. The engine runs each episode on its own.
  producer    the same through the multi-turn producer itself (rollout.generate, greedy, a
              model over the word tokenizer): `--prompts` arithmetic tasks x `--samples`,
              `--turns` attempts of `--turn-tokens` each, a verdict's feedback between (the
              random model always fails). The static sampler re-prefills each history every
              attempt; `sampling.engine`'s EngineSampler keeps each episode in its slot. Both
              produce the same episodes (asserted), so the ratio is of the same work.

`--decode-dtype bfloat16` (sampling.decode_dtype): the engines decode their own bfloat16
copy of the weights (ptrain/generate/decode_weights.py), synced at the start of every timed run as
the learner syncs it once a step; the sync's seconds per run are printed (and are inside
the run's time). The static and Tunix samplers decode the float32 weights as before.

Tunix runs in its own venv (see bench/rl_bench.py's docstring) in a subprocess; without
it, `--no-tunix`. `--rounds` alternates the implementations (a shared machine's load
drifts); the best (min) and typical (median) times are reported, and the ratios round by
round (of each round's medians) with their median and range.

    python bench/rollout_bench.py [--requests 64 --mean-len 64 --max-len 512 --slots 32 64]
"""

import argparse
import concurrent.futures
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
sys.path.insert(0, os.path.join(REPO, "bench"))

import rl_bench  # noqa: E402
from ptrain import hf  # noqa: E402
from ptrain import model as model_lib  # noqa: E402
from ptrain import rollout  # noqa: E402
from ptrain.envs import synthetic  # noqa: E402
from ptrain import tasks as tasks_lib  # noqa: E402
from ptrain.generate import engine as engine_lib  # noqa: E402
from ptrain.generate import engine_sampler  # noqa: E402
from ptrain.generate import sampler as sampler_lib  # noqa: E402

WORDS = synthetic.WordTokenizer.for_tasks()  # the producer workload's tokenizer


def long_tail_workload(args):
    rng = np.random.RandomState(0)
    prompts = [[1] + rng.randint(3, rl_bench.MODEL["vocab_size"], rng.randint(7, 32)).tolist()
               for _ in range(args.requests)]
    lengths = np.minimum(rng.geometric(1.0 / args.mean_len, args.requests), args.max_len)
    return prompts, [int(n) for n in lengths]


def engine_long_tail(model, prompts, lengths, args, slots):
    engine = engine_lib.Engine(model, slots=slots, max_len=32 + args.max_len,
                               max_new_tokens=args.max_len, temperature=1.0,
                               token_buckets=(32, 32 + args.max_len),
                               decode_dtype=args.decode_dtype or None)
    engine.warm_up(_synced(engine, model))
    requests = [engine_lib.Request(p, key=i, max_new_tokens=n)
                for i, (p, n) in enumerate(zip(prompts, lengths))]

    def run():
        engine.reset_metrics()
        trajs = engine.generate(_synced(engine, model), requests)
        assert [len(t.turns[0]) for t in trajs] == lengths
    times = rl_bench._time(run, args.repeats)
    return times, engine.metrics()


def _synced(engine, model):
    """What engine.generate takes: the model, or (with a decode copy) None after a weight
    sync from it, as the learner does once a step."""
    if engine.decode_dtype is None:
        return model
    engine.sync_weights(model)
    return None


def static_long_tail(model, prompts, lengths, args):
    sampler = sampler_lib.Sampler(model, seed=0)

    def run():
        out = sampler.sample(model, prompts, max_new_tokens=max(lengths), temperature=1.0,
                             prompt_len=32)
        assert out.tokens.shape == (len(prompts), max(lengths))
    return rl_bench._time(run, args.repeats)


def tunix_long_tail(model_dir, prompts, lengths, args):
    if not os.path.exists(rl_bench.TUNIX_PYTHON):
        raise SystemExit(f"{rl_bench.TUNIX_PYTHON} is missing: see bench/rl_bench.py, or "
                         "pass --no-tunix")
    work = {"model_dir": model_dir, "model": rl_bench.MODEL, "prompts": prompts,
            "num_samples": 1, "new_tokens": max(lengths), "prompt_len": 32,
            "repeats": args.repeats, "decode_only": True}
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([rl_bench.TUNIX_PYTHON, os.path.join(REPO, "bench",
                                                              "rl_bench_tunix.py"),
                          json.dumps(work)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"Tunix failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["decode_s"]


# ------------------------------------------------------------------------------ multi-turn

def _observation(turn_tokens, n):
    return [3 + (sum(turn_tokens) + i) % 1000 for i in range(n)]


def _tool(turn_tokens, args):
    time.sleep(args.tool_ms / 1e3)
    return _observation(turn_tokens, args.obs_tokens)


def reprefill_multi_turn(model, prompts, args, threads):
    """rollout.py's path: a sampler call per turn over every active episode, the history
    re-prefilled from the second turn on, the turn's tools run before the next turn."""
    sampler = sampler_lib.Sampler(model, seed=0)
    n_len = 32 + args.turns * (args.turn_tokens + args.obs_tokens)
    prompt_len = 1 << (n_len - 1).bit_length()

    def run():
        histories = None
        for turn in range(args.turns):
            if turn == 0:
                out = sampler.sample(model, prompts, num_samples=args.samples,
                                     max_new_tokens=args.turn_tokens, temperature=1.0,
                                     prompt_len=32)
                histories = [list(prompts[i // args.samples]) for i in range(len(out.lengths))]
            else:
                out = sampler.sample(model, histories, max_new_tokens=args.turn_tokens,
                                     temperature=1.0, prompt_len=prompt_len)
            turns = out.completions()
            for h, t in zip(histories, turns):
                h += t
            if turn < args.turns - 1:
                for h, obs in zip(histories, threads.map(lambda t: _tool(t, args), turns)):
                    h += obs
        assert all(len(h) == len(prompts[i // args.samples]) + args.turns * args.turn_tokens
                   + (args.turns - 1) * args.obs_tokens for i, h in enumerate(histories))
    return rl_bench._time(run, args.repeats)


def engine_multi_turn(model, prompts, args, slots):
    n_len = 32 + args.turns * (args.turn_tokens + args.obs_tokens)
    engine = engine_lib.Engine(model, slots=slots, max_len=n_len, max_new_tokens=args.turn_tokens,
                               temperature=1.0, token_buckets=(32, n_len),
                               decode_dtype=args.decode_dtype or None)
    engine.warm_up(_synced(engine, model))

    def on_turn(traj):
        return _tool(traj.turns[-1], args) if len(traj.turns) < args.turns else None

    requests = [engine_lib.Request(p, key=i, num_samples=args.samples, on_turn=on_turn)
                for i, p in enumerate(prompts)]

    def run():
        engine.reset_metrics()
        trajs = engine.generate(_synced(engine, model), requests)
        assert all(len(t.turns) == args.turns for t in trajs)
    times = rl_bench._time(run, args.repeats)
    return times, engine.metrics()


# ----------------------------------------------------------- multi-turn through the producer

def producer_tasks(args):
    """Arithmetic tasks without tools, judged by their answer: a random model fails each
    attempt, so every episode runs `--turns` attempts, verdict feedback between them."""
    rng = np.random.RandomState(2)
    return [tasks_lib.Task(f"p{i}", "arith", tasks_lib.Answer(str(a * b), numeric=True),
                           prompt=f"arith: what is {a} times {b}?\n")
            for i, (a, b) in enumerate(rng.randint(2, 10, (args.prompts, 2)))]


def producer_multi_turn(model, task_list, args, sampler):
    """rollout.generate, the multi-turn producer (rollout.Tasks'), greedily on `sampler`: the
    static sampler re-prefills each episode's history every attempt; an EngineSampler keeps
    each episode in its slot (engine_sampler.run_episodes). Greedy, so both do the same
    work: the same turns, feedback and tokens."""
    config = rollout.RolloutConfig(
        num_samples=args.samples, max_new_tokens=args.turn_tokens, max_turns=1,
        max_attempts=args.turns, max_len=args.turns * (args.turn_tokens + 64), greedy=True,
        stop_token_ids=(synthetic.EOS,))

    def run():
        for engine in getattr(sampler, "engines", {}).values():
            engine.reset_metrics()  # the metrics printed are the last run's
        if getattr(sampler, "weights", None) is not None:
            sampler.sync_weights(model)  # once a step, as the learner's first call does
        episodes = rollout.generate(sampler, model, task_list, tokenizer=WORDS,
                                    key=jax.random.key(0), config=config)
        assert all(e.attempts == args.turns for e in episodes), [e.attempts for e in episodes]
        return episodes
    run()
    for engine in getattr(sampler, "engines", {}).values():
        if engine.decode_dtype is None:  # every shape a run can use (the first run compiled
            engine.warm_up(model)        # some)
        else:
            engine.params = sampler.weights.get(model)
            engine.warm_up()
            engine.params = None
    return rl_bench._time(run, args.repeats), run()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--mean-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--slots", type=int, nargs="+", default=[32])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--obs-tokens", type=int, default=16)
    parser.add_argument("--tool-ms", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-tunix", action="store_true")
    parser.add_argument("--decode-dtype", default="", choices=["", "float32", "bfloat16"],
                        help="the engines' decode copy (sampling.decode_dtype); '' none")
    parser.add_argument("--workloads", nargs="+",
                        default=["long-tail", "multi-turn", "producer"],
                        choices=["long-tail", "multi-turn", "producer"])
    parser.add_argument("--compile-cache", default="",
                        help="a directory for JAX's persistent compilation cache")
    args = parser.parse_args()
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    config = model_lib.ModelConfig(**rl_bench.MODEL, qk_norm=True, family="qwen3",
                                   bos_token_id=1, eos_token_ids=(rl_bench.EOS,))
    prompts, lengths = long_tail_workload(args)
    rng = np.random.RandomState(1)
    mt_prompts = [[1] + rng.randint(3, 2048, rng.randint(8, 32)).tolist()
                  for _ in range(args.prompts)]
    runs, engine_metrics = {}, {}

    def add(name, value):
        runs.setdefault(name, []).append(value)
        print(f"  {name}: {value[0] * 1e3:.0f} ms (median {value[1] * 1e3:.0f})", flush=True)

    threads = concurrent.futures.ThreadPoolExecutor(max_workers=16)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        hf.save(model_lib.init(config, seed=0), config, model_dir)
        model, _ = hf.load(model_dir)
        word_model = model_lib.init(config.replace(vocab_size=WORDS.vocab_size,
                                                   eos_token_ids=(synthetic.EOS,)))
        tasks = producer_tasks(args)
        for r in range(args.rounds):
            if "long-tail" in args.workloads:
                if not args.no_tunix:
                    add("Tunix long tail", tunix_long_tail(model_dir, prompts, lengths, args))
                add("static long tail", static_long_tail(model, prompts, lengths, args))
                for slots in args.slots:
                    t, m = engine_long_tail(model, prompts, lengths, args, slots)
                    add(f"engine long tail, {slots} slots", t)
                    engine_metrics[f"long tail, {slots} slots"] = m
            if "multi-turn" in args.workloads:
                add("re-prefill multi-turn",
                    reprefill_multi_turn(model, mt_prompts, args, threads))
                for slots in args.slots:
                    t, m = engine_multi_turn(model, mt_prompts, args, slots)
                    add(f"engine multi-turn, {slots} slots", t)
                    engine_metrics[f"multi-turn, {slots} slots"] = m
            if "producer" in args.workloads:
                t, want = producer_multi_turn(
                    word_model, tasks, args, sampler_lib.Sampler(word_model,
                                                                 decode=WORDS.decode))
                add("re-prefill producer", t)
                for slots in args.slots:
                    sampler = engine_sampler.EngineSampler(
                        word_model, slots=slots, decode=WORDS.decode,
                        decode_dtype=args.decode_dtype or None)
                    t, got = producer_multi_turn(word_model, tasks, args, sampler)
                    assert [e.tokens for e in got] == [e.tokens for e in want]
                    add(f"engine producer, {slots} slots", t)
                    [engine] = sampler.engines.values()
                    engine_metrics[f"producer, {slots} slots"] = dict(
                        engine.metrics(), **({} if sampler.weights is None else {
                            "weight_sync_s": sampler.weights.sync_s / sampler.weights.syncs}))
            print(f"round {r}: " + ", ".join(f"{k} {v[-1][0] * 1e3:.0f} ms"
                                             for k, v in runs.items()), flush=True)
    best = {k: min(v[0] for v in vs) for k, vs in runs.items()}
    typical = {k: float(np.median([v[1] for v in vs])) for k, vs in runs.items()}
    tokens = sum(lengths)
    episodes = args.prompts * args.samples
    print(f"model: Qwen3-style, {config.n_params / 1e6:.2f}M params, float32, engines' "
          f"decode copy: {args.decode_dtype or 'none'}, "
          f"{jax.default_backend()}; jax {jax.__version__}; {os.cpu_count()} cores; "
          f"{args.rounds} rounds x {args.repeats} repeats")
    if "long-tail" in args.workloads:
        print(f"long tail: {args.requests} requests, lengths geometric mean {args.mean_len} "
              f"(drawn: mean {np.mean(lengths):.1f}, max {max(lengths)}), {tokens} tokens; "
              "tokens/s best / typical:")
        for k in [k for k in runs if "long tail" in k]:
            print(f"  {k:28s} {tokens / best[k]:8.0f} / {tokens / typical[k]:8.0f}  "
                  f"({best[k] * 1e3:.0f} ms)")
    if "multi-turn" in args.workloads:
        print(f"multi-turn: {episodes} episodes ({args.prompts} prompts x {args.samples}), "
              f"{args.turns} turns x {args.turn_tokens} tokens, tools {args.tool_ms:g} ms -> "
              f"{args.obs_tokens} tokens; episodes/s best / typical:")
        for k in [k for k in runs if "multi-turn" in k]:
            print(f"  {k:32s} {episodes / best[k]:8.1f} / {episodes / typical[k]:8.1f}  "
                  f"({best[k] * 1e3:.0f} ms)")
    if "producer" in args.workloads:
        print(f"producer multi-turn (rollout.generate, greedy, the same model over the word "
              f"tokenizer's {WORDS.vocab_size} ids, {word_model.config.n_params / 1e6:.2f}M "
              f"params): {episodes} episodes "
              f"({args.prompts} tasks x {args.samples}), {args.turns} attempts of up to "
              f"{args.turn_tokens} tokens, verdict feedback between; episodes/s best / typical:")
        for k in [k for k in runs if "producer" in k]:
            print(f"  {k:32s} {episodes / best[k]:8.1f} / {episodes / typical[k]:8.1f}  "
                  f"({best[k] * 1e3:.0f} ms)")
    # Each round measures every implementation back to back, so a round's ratio shares
    # its load; the spread over rounds is the ratio's.
    print(f"ratios (round by round, each of medians of {args.repeats}; median [min, max] "
          f"over {args.rounds} rounds):")

    def ratio(base, name):
        per_round = [b[1] / e[1] for b, e in zip(runs[base], runs[name])]
        return (f"{np.median(per_round):.2f}x [{min(per_round):.2f}, {max(per_round):.2f}]"
                f" ({', '.join(f'{x:.2f}' for x in per_round)})")

    for slots in args.slots:
        if "long-tail" in args.workloads:
            name = f"engine long tail, {slots} slots"
            print(f"  {slots} slots: long tail vs static {ratio('static long tail', name)}")
            if not args.no_tunix:
                print(f"  {slots} slots: long tail vs Tunix {ratio('Tunix long tail', name)}")
        if "multi-turn" in args.workloads:
            name = f"engine multi-turn, {slots} slots"
            print(f"  {slots} slots: multi-turn vs re-prefill "
                  f"{ratio('re-prefill multi-turn', name)}")
        if "producer" in args.workloads:
            name = f"engine producer, {slots} slots"
            print(f"  {slots} slots: producer multi-turn (kept slots) vs re-prefill "
                  f"{ratio('re-prefill producer', name)}")
    print("engine metrics (last run of each):")
    for name, m in engine_metrics.items():
        keys = ("tokens_per_s", "slot_occupancy", "bucket_occupancy", "decode_calls",
                "prefill_tokens", "tool_wait_s", "queue_waiting_max", "queue_on_tools_mean",
                "weight_sync_s")
        print(f"  {name}: " + ", ".join(f"{k} {m[k]:.3g}" for k in keys if k in m))


if __name__ == "__main__":
    main()
