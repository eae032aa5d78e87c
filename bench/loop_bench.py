"""The closed loop's RL step: generation, sandbox scoring and the update overlapped vs
serial, against the ideal overlapped step max(generate, score, update), all measured in one
run.

The quickstart's model, tasks, sandbox pool and `rollout.Tasks` producer are built as
`closed_loop.run` builds them. The policy is the config's fresh initialisation, or with
`--sft_steps N` the quickstart's SFT warm start cut to N steps: a policy that makes tool
calls (multi-turn arith episodes) and shorter answers, closer to the quickstart's RL phase.
`learner.train` runs with rl.staleness=0 (serial: generate, score, update) and with each
k of `--staleness` (batch t+k generated at step t in a thread while update t runs, every
batch scored in another thread as soon as it is generated: `ptrain.lookahead`), interleaved
`--repeats` times so that other load on the machine hits all. Per-step times
come from <workdir>/metrics.jsonl (time/step_s, time/rollout_s, time/update_s); the parts
(producer.generate, producer.score) are timed by wrapping the producer. The ideal step takes
its parts from the serial runs, where they do not compete. "busy cores" is the whole
machine's CPU use during each run (other processes included): it tells a saturated machine,
on which overlapping cannot gain. Per run, the first `--warmup` steps (compilation) and the
last k steps (which have no batch t+k to generate) are left out.

    python bench/loop_bench.py [--steps 8 --warmup 2 --repeats 3 --sft_steps 0 --workers 2
                                --staleness 0 1 2 4 --engine --decode_dtype bfloat16]

`--engine` samples through the rollout engine (sampling.engine=True); `--decode_dtype
bfloat16` with it decodes the engine's bfloat16 copy of the weights, synced once a step:
the median per-step sync (time/weight_sync_s) and the engine's tokens/s are printed per mode.

`--processes N` measures the multi-process path instead: the learner's RL step (GRPO on
grpo_toy's task, the default single-turn producer, configs/grpo_toy.py with a larger model
and batch) in N processes x 8/N CPU devices joined by `jax.distributed` on a loopback
coordinator (gloo collectives, tests/multiprocess.py) against 1 process x 8 devices, the same
mesh (fsdp over all 8) and the same programs, run one after the other `--repeats` times; it
prints the median step time of each (time/step_s after `--warmup` steps) and their ratio
(the overhead of many processes: host gathers, agreed control flow, cross-process
collectives):

    python bench/loop_bench.py --processes 2 [--steps 8 --warmup 2 --repeats 2]
"""

import argparse
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import sandbox  # noqa: E402
from configs import quickstart  # noqa: E402
from ptrain import closed_loop  # noqa: E402
from ptrain import learner as learner_lib  # noqa: E402
from ptrain import metrics as metrics_lib  # noqa: E402
from ptrain import rollout  # noqa: E402
from ptrain import sharding  # noqa: E402


class TimedProducer:
    """A producer (rollout.Tasks) that records how long each generate and score call took."""

    def __init__(self, producer):
        self.producer, self.times = producer, {"generate": [], "score": []}

    def _timed(self, name, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.times[name].append(time.perf_counter() - start)
        return out

    def generate(self, params, records, key):
        return self._timed("generate", self.producer.generate, params, records, key)

    def score(self, episodes):
        return self._timed("score", self.producer.score, episodes)


def learner_config(config, **changes):
    """A copy of the config with dotted-key changes."""
    lcfg = ml_collections.ConfigDict(config.to_dict())
    lcfg.update_from_flattened_dict(changes)
    return lcfg


def run_once(config, params, producer, staleness, steps, root, sources):
    """learner.train for `steps` steps from `params` (None: a fresh model); returns the
    metrics.jsonl lines and the producer's call times."""
    lcfg = learner_config(config, **{"steps": steps, "rl.staleness": staleness,
                                     "checkpoint.every": steps, "log.rollouts_every": 0})
    workdir = tempfile.mkdtemp(dir=root)
    timed = TimedProducer(producer)
    if params is not None:  # train donates them
        params = jax.tree.map(jnp.copy, params)
    learner_lib.train(lcfg, workdir, params=params, producer=timed,
                      tokenizer=producer.tokenizer, prompt_sources=sources)
    return metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")), timed.times


def processes_program(workdir, steps):
    """One layout's run of `--processes` (called in every process): grpo_toy's RL step with
    a larger model and batch for `steps` steps; returns process 0's metrics (else None)."""
    from configs import grpo_toy
    c = grpo_toy.get_config()
    c.update_from_flattened_dict({"steps": steps, "checkpoint.every": steps,
                                  "log.rollouts_every": 0, "model.d_model": 128,
                                  "model.d_ff": 256, "data.prompts_per_step": 16,
                                  "sampling.num_samples": 8, "sampling.max_new_tokens": 16,
                                  "rl.microbatch_size": 32})
    metrics_lib.MetricsWriter.plot = lambda self: None
    learner_lib.train(c, workdir, mesh=sharding.make_mesh(fsdp=-1))
    if jax.process_index():
        return None
    return metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))


def processes_main(args):
    """`--processes N`: see the module docstring."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import multiprocess  # the tests' launcher: N workers, a loopback coordinator
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(REPO, "bench"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    n = args.processes
    if 8 % n:
        raise SystemExit(f"--processes {n} must divide the 8 devices")
    total = args.warmup + args.steps
    steps = {1: [], n: []}
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="loop_bench_mp_") as root:
        cache = os.path.join(root, "xla_cache")  # each layout compiles once, then loads
        for r in range(args.repeats):
            for procs in (1, n):
                workdir = os.path.join(root, f"{procs}x{8 // procs}_{r}")
                out = multiprocess.run("loop_bench:processes_program", n=procs,
                                       devices=8 // procs, timeout=3600, cache_dir=cache,
                                       args={"workdir": workdir, "steps": total})
                steps[procs] += [m["time/step_s"] for m in out[0][args.warmup:]]
    one, many = float(np.median(steps[1])), float(np.median(steps[n]))
    print(f"RL step (grpo_toy task, d_model 128, 16 prompts x 8 samples, 16 new tokens, fsdp "
          f"over 8 CPU devices), jax {jax.__version__}; medians of {args.repeats} x "
          f"{args.steps} steps per layout, {time.perf_counter() - start:.0f} s; load average "
          f"{load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"1 process x 8 devices: {one:.3f} s/step")
    print(f"{n} processes x {8 // n} devices: {many:.3f} s/step")
    print(f"{n} x {8 // n} / 1 x 8: {many / one:.2f}x (the multi-process overhead)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed RL steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out (compilation)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, interleaved")
    parser.add_argument("--sft_steps", type=int, default=0,
                        help="SFT warm-start steps before RL (0: a fresh model)")
    parser.add_argument("--workers", type=int, default=0,
                        help="sandbox pool workers (0: the quickstart's)")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4],
                        help="rl.staleness values to run (0, the serial baseline, always)")
    parser.add_argument("--engine", action="store_true", help="sampling.engine=True")
    parser.add_argument("--decode_dtype", default="", choices=["", "float32", "bfloat16"],
                        help="sampling.decode_dtype (with --engine)")
    parser.add_argument("--processes", type=int, default=0,
                        help="N > 1: the RL step in N processes x 8/N devices against 1 x 8 "
                             "(see the module docstring)")
    args = parser.parse_args()
    if args.processes > 1:
        return processes_main(args)
    modes = sorted({0, *args.staleness})

    with tempfile.TemporaryDirectory(prefix="loop_bench_") as root:
        config = quickstart.get_config("short")
        config.sampling.update(engine=args.engine, decode_dtype=args.decode_dtype)
        if args.workers:
            config.sandbox.workers = args.workers
        envs = closed_loop.environments(config)
        tokenizer = closed_loop.make_tokenizer(config, envs)
        train, _, demos = closed_loop.make_tasks(config, envs, tokenizer, root)
        config = closed_loop.derive_config(config, root, tokenizer, demonstrations=demos)
        sources = closed_loop.prompt_sources(config, train)
        mesh = sharding.mesh_from_config(config.mesh)
        sampler = closed_loop.make_sampler(config, mesh, tokenizer)
        backend = sandbox.backends.pick_backend(config.sandbox.backend)
        params = None
        if args.sft_steps:
            params = learner_lib.sft(learner_config(config, **{"sft.steps": args.sft_steps}),
                                     os.path.join(root, "sft"), tokenizer=tokenizer)
        timed = slice(args.warmup, args.warmup + args.steps)
        # With staleness k, step s trains batch s and generates batch s + k (step 1 makes
        # k + 1): the generate calls of the timed steps are k further on.
        generated = {k: slice(args.warmup + k, args.warmup + k + args.steps) for k in modes}
        lines, parts, busy = ({k: [] for k in modes}, {k: {} for k in modes},
                              {k: [] for k in modes})
        load = os.getloadavg()[0]
        start = time.perf_counter()
        with sandbox.Pool(config.sandbox.workers, backend=config.sandbox.backend) as pool:
            producer = rollout.Tasks(sampler, tokenizer, config, pool,
                                     envs={env.name: env for env in envs})
            for _ in range(args.repeats):
                for s in modes:
                    total = args.warmup + args.steps + s  # + the last s steps, left out
                    cpu0, t0 = _busy_s(), time.perf_counter()
                    run, times = run_once(config, params, producer, s, total, root, sources)
                    busy[s].append((_busy_s() - cpu0) / (time.perf_counter() - t0))
                    lines[s] += run[timed]
                    parts[s].setdefault("generate", []).extend(times["generate"][generated[s]])
                    parts[s].setdefault("score", []).extend(times["score"][timed])

    def median(s, key):
        values = parts[s][key] if key in parts[s] else [r[f"time/{key}_s"] for r in lines[s]]
        return float(np.median(values))

    ideal = max(median(0, "generate"), median(0, "score"), median(0, "update"))
    serial = median(0, "step")
    c = config
    print(f"quickstart RL step: {c.data.prompts_per_step} prompts x {c.sampling.num_samples} "
          f"samples, {c.sampling.max_new_tokens} new tokens/turn, {c.sandbox.workers} sandbox "
          f"workers ({backend.name}), jax {jax.__version__} on {jax.devices()[0].platform}, "
          f"policy after {args.sft_steps} SFT steps; medians of {args.repeats} x {args.steps} "
          f"steps per mode, {time.perf_counter() - start:.0f} s; load average "
          f"{load:.1f} -> {os.getloadavg()[0]:.1f}")
    keys = ("step", "rollout", "update", "generate", "score")
    print(f"{'seconds':<30}" + "".join(f"{k:>9}" for k in keys) + f"{'busy cores':>11}")
    for s in modes:
        name = "serial (rl.staleness=0)" if s == 0 else f"rl.staleness={s}"
        print(f"{name:<30}" + "".join(f"{median(s, k):9.3f}" for k in keys)
              + f"{np.median(busy[s]):11.2f}")
    print(f"{'ideal max(gen, score, upd)':<30}{ideal:9.3f}  (parts from the serial runs)")
    for s in modes:  # sampling.engine: the weight sync a step and the decode rate
        if lines[s] and "time/weight_sync_s" in lines[s][0]:
            sync = np.median([r["time/weight_sync_s"] for r in lines[s]])
            rate = np.median([r.get("engine/tokens_per_s", np.nan) for r in lines[s]])
            print(f"rl.staleness={s}: weight sync {sync * 1e3:.1f} ms/step "
                  f"({sync / median(s, 'step'):.1%} of the step; decode copy "
                  f"{c.sampling.decode_dtype or 'none'}), engine {rate:.0f} tokens/s")
    for s in modes[1:]:
        print(f"rl.staleness={s}: serial / it {serial / median(s, 'step'):.2f}x (speed-up), "
              f"it / ideal {median(s, 'step') / ideal:.2f}x (target <= 1.15x)")


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy (all processes, all cores), or nan off
    Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
