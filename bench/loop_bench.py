"""The closed loop's RL step: sandbox scoring overlapped with generation vs serial, against
the ideal overlapped step max(generate, score + update), all measured in one run.

The quickstart's model, tasks, sandbox pool and `TaskProducer` are built as
`closed_loop.run` builds them. The policy is the config's fresh initialisation, or with
`--sft_steps N` the quickstart's SFT warm start cut to N steps: a policy that makes tool
calls (multi-turn arith episodes) and shorter answers, closer to the quickstart's RL phase.
`learner.train` runs with rl.staleness=0 (serial: generate, score, update) and with
rl.staleness=1 (batch t scored in a thread while batch t+1 is generated), the two
interleaved `--repeats` times so that other load on the machine hits both. Per-step times
come from <workdir>/metrics.jsonl (time/step_s, time/rollout_s, time/update_s); the parts
(producer.generate, producer.score) are timed inside the serial runs by wrapping the
producer. Per run, the first `--warmup` steps (compilation) and the last step (which has no
batch t+1 to generate) are left out.

    python bench/loop_bench.py [--steps 8 --warmup 2 --repeats 2 --sft_steps 0]
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
from flax import nnx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import sandbox  # noqa: E402
from configs import quickstart  # noqa: E402
from ptrain import closed_loop  # noqa: E402
from ptrain import learner as learner_lib  # noqa: E402
from ptrain import metrics as metrics_lib  # noqa: E402
from ptrain import model as model_lib  # noqa: E402
from ptrain import sampler as sampler_lib  # noqa: E402
from ptrain import sharding  # noqa: E402


class TimedProducer:
    """A TaskProducer that records how long each generate and score call took."""

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
    """The learner's part of the config, with dotted-key changes."""
    lcfg = ml_collections.ConfigDict(closed_loop.learner_part(config).to_dict())
    lcfg.update_from_flattened_dict(changes)
    return lcfg


def run_once(config, params, producer, staleness, steps, root):
    """learner.train for `steps` steps from `params` (None: a fresh model); returns the
    metrics.jsonl lines and the producer's call times."""
    lcfg = learner_config(config, **{"steps": steps, "rl.staleness": staleness,
                                     "checkpoint.every": steps, "log.rollouts_every": 0})
    workdir = tempfile.mkdtemp(dir=root)
    timed = TimedProducer(producer)
    if params is not None:  # train donates them
        params = jax.tree.map(jnp.copy, params)
    learner_lib.train(lcfg, workdir, params=params, producer=timed,
                      tokenizer=producer.tokenizer)
    return metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl")), timed.times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed RL steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out (compilation)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved")
    parser.add_argument("--sft_steps", type=int, default=0,
                        help="SFT warm-start steps before RL (0: a fresh model)")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="loop_bench_")
    config = quickstart.get_config("short")
    tokenizer = closed_loop._tokenizer(config)
    config = closed_loop.resolve(config, root, tokenizer)
    closed_loop.make_tasks(config, tokenizer, root)
    lcfg = closed_loop.learner_part(config)
    mesh = sharding.mesh_from_config(lcfg.mesh)
    abstract_model = nnx.eval_shape(lambda: model_lib.Transformer(
        learner_lib.model_config(lcfg), rngs=nnx.Rngs(0), mesh=mesh))
    sampler = sampler_lib.Sampler(abstract_model, seed=config.seed,
                                  pad_id=tokenizer.pad_token_id or 0, decode=tokenizer.decode)
    backend = sandbox.backends.resolve(config.sandbox.backend)
    params = None
    if args.sft_steps:
        params = learner_lib.sft(learner_config(config, **{"sft.steps": args.sft_steps}),
                                 os.path.join(root, "sft"), tokenizer=tokenizer)
    total = args.warmup + args.steps + 1  # + the last step, left out
    timed = slice(args.warmup, args.warmup + args.steps)
    steps = {0: [], 1: []}  # staleness -> per-step metrics lines
    parts = {"generate": [], "score": [], "update": []}  # from the serial runs
    start = time.perf_counter()
    with sandbox.Pool(config.sandbox.workers, backend=config.sandbox.backend) as pool:
        producer = closed_loop.TaskProducer(sampler, tokenizer, config, pool)
        for _ in range(args.repeats):
            for staleness in (0, 1):
                lines, times = run_once(config, params, producer, staleness, total, root)
                steps[staleness] += lines[timed]
                if staleness == 0:  # one generate and one score per step, in order
                    parts["generate"] += times["generate"][timed]
                    parts["score"] += times["score"][timed]
                    parts["update"] += [r["time/update_s"] for r in lines[timed]]

    med = {k: float(np.median(v)) for k, v in parts.items()}
    col = {(s, k): float(np.median([r[f"time/{k}_s"] for r in steps[s]]))
           for s in (0, 1) for k in ("step", "rollout", "update")}
    serial, overlapped = col[0, "step"], col[1, "step"]
    ideal = max(med["generate"], med["score"] + med["update"])
    c = config
    print(f"quickstart RL step: {c.data.prompts_per_step} prompts x {c.sampling.num_samples} "
          f"samples, {c.sampling.max_new_tokens} new tokens/turn, {c.sandbox.workers} sandbox "
          f"workers ({backend.name}), jax {jax.__version__} on "
          f"{jax.devices()[0].platform}; policy after {args.sft_steps} SFT steps; "
          f"{args.repeats} x {args.steps} steps per mode "
          f"(medians), {time.perf_counter() - start:.0f} s in all")
    print(f"parts (serial runs): generate {med['generate']:.3f} s, score {med['score']:.3f} s, "
          f"update {med['update']:.3f} s")
    print(f"{'seconds':<30} {'step':>7} {'rollout':>8} {'update':>7}")
    for s, name in ((0, "serial (rl.staleness=0)"), (1, "overlapped (rl.staleness=1)")):
        print(f"{name:<30} {col[s, 'step']:7.3f} {col[s, 'rollout']:8.3f} "
              f"{col[s, 'update']:7.3f}")
    print(f"{'ideal: max(gen, score + upd)':<30} {ideal:7.3f}")
    print(f"overlapped / serial: {overlapped / serial:.2f}x")
    print(f"overlapped / ideal:  {overlapped / ideal:.2f}x  (target <= 1.15x)")


if __name__ == "__main__":
    main()
