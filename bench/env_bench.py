"""Host time per RL step spent on the environment mixture, for 10 / 100 / 1000 environments at
the same batch size, as a ratio to the learner's step time measured in the same run.

    python bench/env_bench.py [--envs 10 100 1000] [--groups 64] [--samples 8] [--steps 20]

An environment is a parameterised variant of a synthetic domain (`synthetic_tasks`: code,
arith, files; variant i draws its tasks with seed i and is named "<domain>-<i>"), with its
own weight (1 to 7). Per step, on the host, for `groups` tasks of `samples` episodes each:
  draw      the step's tasks by weight: the closed loop's prompt stream (`data.prompt_batches`,
            a grain mixture of one source per environment; its build is reported apart)
  draw_adaptive  the same, drawn instead by the step's adaptive draw (tasks.adaptive on:
            `mixture.AdaptiveDraw`, mode "progress" with a task filter of patience 2: the
            environments by their weights, then each one's next task the filter keeps)
  prompts   each task's prompt ids (`rollout.render_prompt`, chat format "plain")
  rows      the episodes' verdicts into the step's Batch (`rollout.to_batch`, then
            `batch.Collector`: checks, group ids, reward and per-domain metrics)
  metrics   `metrics.MetricsWriter.write` (metrics.jsonl and TensorBoard with the per-domain
            summaries, and the adaptive draw's weights, tasks/weight/<env>)
  observe   the adaptive draw's observation of the step's verdicts (`AdaptiveDraw.observe`,
            applied at its next draw) and its metrics
Two totals: the static draw's (draw + prompts + rows + metrics) and the adaptive draw's
(draw_adaptive + prompts + rows + metrics + observe).
The episodes themselves (tokens, verdicts) are made up before each step and not timed: they
are what generation and the verifiers return; nor are the first WARMUP steps. The learner's
step is `Learner.prepare` + `Learner.update` on such a batch (the quickstart config's model,
on this machine's backend). Times are the minimum over steps (other processes only ever add
time) with the median beside.
"""

import argparse
import dataclasses
import os
import random
import sys
import tempfile
import time

import jax
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from configs import quickstart  # noqa: E402
from ptrain import batch as batch_lib  # noqa: E402
import ml_collections  # noqa: E402

from ptrain import chat, data, learner, metrics, mixture, rewards, rollout  # noqa: E402
from ptrain.envs import synthetic as synthetic_tasks  # noqa: E402
from ptrain.envs import adaptive  # noqa: E402

STAGES = ("draw", "draw_adaptive", "prompts", "rows", "metrics", "observe")
STATIC = ("draw", "prompts", "rows", "metrics")
ADAPTIVE = ("draw_adaptive", "prompts", "rows", "metrics", "observe")
WARMUP = 2  # steps not timed (the prompt stream's threads start, first writes)


def environments(n, tasks_per_env):
    """{name: [Task]} and weights of n variants of the synthetic domains (each variant: its
    domain's tasks under its own name and ids; the tasks' texts are shared, which changes
    nothing timed here, and keeps 1000 x 512 tasks cheap to make)."""
    pools = {d: [g.task for g in synthetic_tasks.generate(d, tasks_per_env, seed=0,
                                                          split="train")]
             for d in synthetic_tasks.DOMAINS}
    envs, weights = {}, []
    for i in range(n):
        domain = synthetic_tasks.DOMAINS[i % len(synthetic_tasks.DOMAINS)]
        name = f"{domain}-{i:04d}"
        envs[name] = [dataclasses.replace(t, domain=name, id=f"{name}/{j}")
                      for j, t in enumerate(pools[domain])]
        weights.append(float(1 + i % 7))
    return envs, weights


def episodes_of(tasks, prompts, samples, rng, length):
    """Made-up episodes of the step's tasks, as generation and verification leave them."""
    out = []
    for g, (task, prompt) in enumerate(zip(tasks, prompts)):
        p = rng.random()  # the task's pass rate
        for _ in range(samples):
            n = rng.randint(4, length)
            passed = rng.random() < p
            completion = [rng.randint(3, 200) for _ in range(n)]
            out.append(rollout.Episode(
                task=task, group_id=g, tokens=list(prompt) + completion,
                mask=[0] * len(prompt) + [1] * n, logp=[0.0] * len(prompt) + [-1.0] * n,
                prompt_len=len(prompt), answers=["x"], turns=1, finish="answered",
                verdicts=[rewards.Verdict(reward=float(passed), passed=passed,
                                          fraction_passed=float(passed),
                                          feedback="" if passed else "wrong answer",
                                          error_type="" if passed else "wrong_answer")]))
    return out


def run_mixture(n, args, config, tokenizer, workdir):
    """{stage: [seconds per step]}, the build times of the grain mixture and of the adaptive
    draw, and the last Batch."""
    c = config
    envs, weights = environments(n, args.tasks_per_env)
    names = list(envs)
    start = time.perf_counter()
    stream = data.prompt_batches([(envs[k], w) for k, w in zip(names, weights)],
                                 batch_size=args.groups, seed=0, process_index=0,
                                 process_count=1).iterator()
    build_s = time.perf_counter() - start
    section = ml_collections.ConfigDict(adaptive.section_defaults())
    section.update(mode="progress", filter_patience=2)
    start = time.perf_counter()
    draw = mixture.AdaptiveDraw([(envs[k], w) for k, w in zip(names, weights)],
                                section=section, batch_size=args.groups, seed=0)
    build_adaptive_s = time.perf_counter() - start
    rng = random.Random(n)
    rc = rollout.rollout_config(c)
    times = {s: [] for s in STAGES}
    weights = draw.metrics()
    fmt = chat.FORMATS[c.rollout.chat_format]
    with metrics.MetricsWriter(workdir, primary=True, progress=False) as writer:
        for step in range(1, WARMUP + args.steps + 1):
            t0 = time.perf_counter()
            tasks = next(stream)
            t1 = time.perf_counter()
            draw.at(step)
            drawn = next(draw)
            t2 = time.perf_counter()
            prompts = [rollout.render_prompt(task, tokenizer, fmt) for task in tasks]
            t3 = time.perf_counter()
            assert len(drawn) == len(tasks) and max(map(len, prompts)) <= c.data.max_prompt_len
            episodes = episodes_of(tasks, prompts, args.samples, rng, c.rollout.max_len)
            t4 = time.perf_counter()
            collector = batch_lib.Collector(c)
            collector.add(rollout.to_batch(episodes, rc, prompt_len=c.data.max_prompt_len,
                                           length=c.rollout.max_len, pad_id=0,
                                           max_len=c.rollout.max_len))
            batch, step_metrics = collector.result()
            t5 = time.perf_counter()
            writer.write(step, {**step_metrics, **weights})
            t6 = time.perf_counter()
            draw.observe(step, batch)
            weights = draw.metrics()
            t7 = time.perf_counter()
            for stage, seconds in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t5 - t4, t6 - t5,
                                               t7 - t6)):
                if step > WARMUP:
                    times[stage].append(seconds)
    return times, (build_s, build_adaptive_s), batch


def learner_step_times(config, batch, repeats):
    lrn = learner.Learner(config)
    params = lrn.initial_params
    opt_state = lrn.init_opt_state(params)
    times = []
    for i in range(repeats + 1):  # the first compiles
        start = time.perf_counter()
        prepared, _ = lrn.prepare(params, batch)
        params, opt_state, m = lrn.update(params, opt_state, prepared)
        jax.block_until_ready((params, m))
        if i:
            times.append(time.perf_counter() - start)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--envs", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--groups", type=int, default=64, help="tasks per step")
    ap.add_argument("--samples", type=int, default=8, help="episodes per task")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tasks-per-env", type=int, default=512,
                    help="below ~512, grain's shuffle of each source costs ~0.5-10 ms per "
                         "record drawn (docs/benchmarks.md)")
    ap.add_argument("--learner-steps", type=int, default=2)
    args = ap.parse_args()
    config = quickstart.get_config().unlock()
    config.data.prompts_per_step, config.sampling.num_samples = args.groups, args.samples
    config.rl.staleness = 0
    tokenizer = synthetic_tasks.WordTokenizer.for_tasks()
    config.model.vocab_size = chat.vocab_len(tokenizer)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.envs:
            results[n] = run_mixture(n, args, config, tokenizer, os.path.join(tmp, str(n)))
    batch = results[args.envs[0]][2]
    step_s = learner_step_times(config, batch, args.learner_steps)
    base = float(np.min(step_s))
    print(f"learner step (prepare + update, {args.groups}x{args.samples} rows, quickstart "
          f"model, {jax.default_backend()}): min {base * 1e3:.1f} ms, median "
          f"{np.median(step_s) * 1e3:.1f} ms")
    print(f"host ms per step, min (median) of {args.steps} steps; ratio: host total / learner "
          "step, min (median); builds: the grain mixture's, the adaptive draw's")
    print(f"{'envs':>6} {'builds':>14} " + " ".join(f"{s:>15}" for s in STAGES)
          + f" {'static total':>15} {'ratio':>16} {'adaptive total':>15} {'ratio':>16}")
    totals = {}
    for n, (times, builds, _) in results.items():
        row = []
        for kind, stages in (("static", STATIC), ("adaptive", ADAPTIVE)):
            total = [sum(times[s][i] for s in stages) for i in range(args.steps)]
            totals[n, kind] = np.array([np.min(total), np.median(total)])
            ratio = totals[n, kind] / [base, np.median(step_s)]
            row.append(f"{np.min(total) * 1e3:6.2f} ({np.median(total) * 1e3:6.2f}) "
                       f"{ratio[0]:7.2%} ({ratio[1]:6.2%})")
        cells = [f"{np.min(times[s]) * 1e3:6.2f} ({np.median(times[s]) * 1e3:6.2f})"
                 for s in STAGES]
        print(f"{n:>6} {builds[0] * 1e3:5.0f}/{builds[1] * 1e3:5.0f}ms "
              + " ".join(f"{c:>15}" for c in cells) + " " + " ".join(row))
    low, high = min(args.envs), max(args.envs)
    for kind in ("static", "adaptive"):
        added = totals[high, kind] - totals[low, kind]
        print(f"{kind} draw: {high} environments add {added[0] / base:.2%} "
              f"({added[1] / np.median(step_s):.2%}) of the learner step over {low}: "
              f"{added[0] * 1e3:.2f} ({added[1] * 1e3:.2f}) ms")


if __name__ == "__main__":
    main()
