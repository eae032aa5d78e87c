"""What RL on executable feedback gains over simpler uses of the same verifier, at equal
verifier calls, on an environment whose feedback carries information the prompt lacks
(`ptrain.envs.hidden_format`: the return format is stated only by the failing test).

One tiny model (the quickstart's), warm-started by SFT on correct first attempts and (with
--retry_demos) retries that answer again without reading the feedback, then per
method, from the same SFT parameters and with the same training budget of verifier calls:

  sft           (a) SFT only: no verifier calls
  rft           (b) rejection-sampling fine-tuning, iterated: per round, sample G answers
                to fresh training tasks, keep the verified passes, fine-tune on every pass
                kept so far (learner.sft on records built from the episodes' tokens)
  grpo          (c) GRPO, one attempt per episode
  grpo_retry    (d) GRPO with retries: attempt 2 sees attempt 1's feedback (the
                environment's turn policy, rollout.max_attempts=2)
  grpo_neutral  (e) as (d), every failure's feedback replaced by "that was wrong, try again"

The budget is --steps GRPO steps of one attempt (steps x prompts x G calls). Every verifier
call is counted by wrapping the environment's verify (`Counted`: answers judged), never
estimated; a GRPO run stops before the step that would start beyond its budget (a retry
step makes 1-2 calls per episode, so (d) and (e) take fewer steps for the same calls), the
RFT rounds split the budget evenly. Held-out evaluation (its own counter) of the same tasks
for every method, two attempts per episode so that the repair rate is measured everywhere:
greedy pass@1 (attempt 1), sampled pass@1 and unbiased pass@k over --samples samples
(`sandbox.terminal.evaluate.pass_at_k`, Chen et al. 2021), pass within two attempts, and the
repair rate P(attempt 2 passes | attempt 1 failed), before training (the SFT model) and at
half and all of the budget. Every method and seed's numbers go to <out>/results.json; the
report is <out>/efficacy.html (self-contained: PNGs inlined) with <out>/*.png.

    python bench/efficacy.py [--seeds 0 1 2 --steps 40 --tasks 100 --samples 8
                              --sft_steps 600 --retry_demos 0.5 --methods sft rft grpo grpo_retry grpo_neutral
                              --out runs/efficacy]

The defaults are the full study; `--steps 4 --tasks 16 --sft_steps 60 --seeds 0` is a
quick look.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import html
import io
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ptrain import chat, closed_loop, jsonl  # noqa: E402
from ptrain import checkpoint as checkpoint_lib  # noqa: E402
from ptrain import learner as learner_lib  # noqa: E402
from ptrain import rollout as rollout_lib  # noqa: E402
from ptrain.envs import hidden_format  # noqa: E402
from sandbox.terminal.evaluate import pass_at_k  # noqa: E402

METHODS = ("sft", "rft", "grpo", "grpo_retry", "grpo_neutral")
LABELS = {"sft": "(a) SFT only", "rft": "(b) rejection-sampling FT", "grpo": "(c) GRPO",
          "grpo_retry": "(d) GRPO + retries, feedback",
          "grpo_neutral": "(e) GRPO + retries, neutral"}
ATTEMPTS = {"sft": 1, "rft": 1, "grpo": 1, "grpo_retry": 2, "grpo_neutral": 2}


# ----------------------------------------------------------------------------- counting

class Counted:
    """A verify function that counts the answers it judges (`calls`) and its batches."""

    def __init__(self, verify):
        self.verify, self.calls, self.batches = verify, 0, 0

    def __call__(self, tasks, answers, **kwargs):
        self.calls += len(answers)
        self.batches += 1
        return self.verify(tasks, answers, **kwargs)


def counted(env):
    """(the environment with a counting verify, its `Counted`)."""
    counter = Counted(env.verify)
    return dataclasses.replace(env, verify=counter), counter


class BudgetSpent(Exception):
    pass


class Budgeted:
    """A producer that refuses to start a batch once `counter.calls` reached `budget`."""

    def __init__(self, inner, counter, budget):
        self.inner, self.counter, self.budget, self.steps = inner, counter, budget, 0

    def generate(self, params, records, key):
        if self.counter.calls >= self.budget:
            raise BudgetSpent
        out = self.inner.generate(params, records, key)
        self.steps += 1
        return out

    def score(self, generated):
        return self.inner.score(generated)


# ----------------------------------------------------------------------------- config

def make_config(args, seed: int, *, attempts: int = 1):
    """The quickstart's tiny model and learner settings on hidden_format."""
    from configs import quickstart
    c = quickstart.get_config("short")
    c.seed = seed
    c.steps = args.steps
    c.tasks.envs = (dict(env="ptrain.envs.hidden_format:make", weight=1.0,
                         args=dict(n_train=args.train_tasks, n_heldout=args.tasks,
                                   retry_demos=args.retry_demos)),)
    c.eval.n = args.tasks
    c.data.update(prompts_per_step=args.prompts, max_prompt_len=24)
    c.sampling.update(num_samples=args.group, max_new_tokens=32)
    c.rollout.update(max_attempts=attempts, max_len=96, attempt_reward="final")
    c.rl.staleness = 0  # retries score during the episode; the same for every method
    c.sft.update(steps=args.sft_steps, max_prompt_len=24,
                 max_completion_len=88 if args.retry_demos else 34,  # two attempts, feedback
                 checkpoint_every=max(args.sft_steps, 1))
    c.checkpoint.update(every=1, keep=1, async_save=False)  # a budget stop keeps its last step
    c.log.update(every=10)
    return c


# ----------------------------------------------------------------------------- evaluation

def evaluate(sampler, params, tasks, *, env, tokenizer, config, samples, seed, examples=0):
    """Held-out numbers with two attempts per episode, every method with the same
    (informative) feedback, so that (d) and (e) differ only in what they trained on:
    greedy and sampled pass@1 of attempt 1, pass@k, pass within two attempts, repair rate."""
    fmt = chat.FORMATS[config.rollout.chat_format]
    out = {}
    for decoding, change in (("greedy", dict(greedy=True, num_samples=1)),
                             ("sample", dict(num_samples=samples))):
        rc = rollout_lib.rollout_config(config, max_attempts=2, **change)
        episodes = rollout_lib.generate(sampler, params, tasks, tokenizer=tokenizer,
                                        key=jax.random.key(seed + 1), config=rc, fmt=fmt,
                                        verify_now=True, envs={env.name: env})
        n = rc.num_samples
        first = [bool(e.verdicts and e.verdicts[0].passed) for e in episodes]
        within = [any(v.passed for v in e.verdicts) for e in episodes]
        failed = [e for e, ok in zip(episodes, first) if not ok]
        repaired = [len(e.verdicts) > 1 and e.verdicts[1].passed for e in failed]
        part = {"pass@1": float(np.mean(first)), "pass_within_2": float(np.mean(within)),
                "repair_rate": float(np.mean(repaired)) if failed else None,
                "failed_first": len(failed)}
        if decoding == "sample":
            part.update(pass_at_ks(first, n))
            one_per_task = list({e.task.id: e for e in reversed(failed)}.values())[::-1]
            part["examples"] = [episode_record(e, tokenizer) for e in one_per_task[:examples]]
        out[decoding] = part
    return out


def pass_at_ks(passed, n: int) -> dict:
    """pass@k for k = 1, 2, 4, ... and n, the mean over tasks of the unbiased estimator
    (`pass_at_k`) from task-major pass flags, n per task."""
    per_task = [sum(passed[i:i + n]) for i in range(0, len(passed), n)]
    return {f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for c in per_task]))
            for k in sorted({1, *[2 ** j for j in range(1, 8) if 2 ** j <= n], n})}


def episode_record(e, tokenizer) -> dict:
    """An episode for people: the prompt, each attempt's answer and its verdict's feedback."""
    return {"prompt": e.task.prompt, "format": e.task.verifier.format,
            "attempts": [{"answer": a, "passed": bool(v.passed), "feedback": v.feedback}
                         for a, v in zip(e.answers, e.verdicts)]}


# ----------------------------------------------------------------------------- methods

class Study:
    """One seed: the tasks, tokenizer, sampler and SFT parameters every method starts from."""

    def __init__(self, args, seed, root):
        self.args, self.seed, self.root = args, seed, root
        # --task_seed: every seed shares one task split and one SFT model (trained once, in
        # <out>/sft); the seed then varies the RL / RFT / evaluation sampling only.
        task_seed = seed if args.task_seed is None else args.task_seed
        base = make_config(args, task_seed)
        self.env = hidden_format.make(n_train=args.train_tasks, n_heldout=args.tasks,
                                      retry_demos=args.retry_demos)
        self.tokenizer = hidden_format.tokenizer()
        os.makedirs(root, exist_ok=True)
        self.train, self.heldout, _ = closed_loop.make_tasks(base, [self.env], self.tokenizer,
                                                             root)
        self.train, self.heldout = self.train[self.env.name], self.heldout[self.env.name]
        self.base = closed_loop.derive_config(base, root, self.tokenizer, demonstrations=True)
        sft_dir = os.path.join(root, "sft") if args.task_seed is None else os.path.join(
            os.path.dirname(root), f"sft_tasks{task_seed}")
        self.sampler = closed_loop.make_sampler(self.base, None, self.tokenizer)
        self.eval_env, self.eval_counter = counted(self.env)
        self._before = None
        t0 = time.perf_counter()
        # On the host: the learner donates the buffers it is given, each method gets a copy.
        self.sft_host = jax.device_get(learner_lib.sft(self.base, sft_dir,
                                                       tokenizer=self.tokenizer))
        self.sft_s = time.perf_counter() - t0

    def sft_params(self):
        return jax.tree.map(jnp.asarray, self.sft_host)

    def config(self, attempts=1, **changes):
        c = make_config(self.args, self.seed, attempts=attempts)
        c = closed_loop.derive_config(c, self.root, self.tokenizer, demonstrations=True)
        c.unlock()
        for key, value in changes.items():
            sect, _, name = key.rpartition(".")
            (c[sect] if sect else c)[name] = value
        c.lock()
        return c

    def evaluate(self, params, calls, examples=0):
        row = evaluate(self.sampler, params, self.heldout, env=self.eval_env,
                       tokenizer=self.tokenizer, config=self.base, samples=self.args.samples,
                       seed=self.seed, examples=examples)
        row["train_calls"] = calls
        return row

    def fractions(self):
        """Where along the budget the held-out evaluation runs."""
        return (0.5, 1.0) if self.args.curve else (1.0,)

    def budget(self):
        a = self.args
        return a.steps * a.prompts * a.group

    # -------------------------------------------------------------- (c), (d), (e)
    def grpo(self, method):
        neutral = method == "grpo_neutral"
        env, counter = counted(dataclasses.replace(
            self.env, verify=hidden_format.verifier(neutral)))
        c = self.config(attempts=ATTEMPTS[method])
        workdir = os.path.join(self.root, method)
        producer = Budgeted(rollout_lib.Tasks(self.sampler, self.tokenizer, c, None,
                                              envs={env.name: env}), counter, 0)
        points, params = [], self.sft_params()
        for fraction in self.fractions():
            producer.budget = int(self.budget() * fraction)
            try:
                params = learner_lib.train(c, workdir, params=self.sft_params(),
                                           producer=producer, tokenizer=self.tokenizer,
                                           prompt_sources=[(self.train, 1.0)])
            except BudgetSpent:  # the last full step's checkpoint holds the parameters
                done = checkpoint_lib.Checkpointer(
                    os.path.join(workdir, "checkpoints")).latest_step()
                params = learner_lib.train(self.config(attempts=ATTEMPTS[method], steps=done),
                                           workdir, params=self.sft_params(), producer=producer,
                                           tokenizer=self.tokenizer,
                                           prompt_sources=[(self.train, 1.0)])
            points.append(self.evaluate(params, counter.calls,
                                        examples=3 if fraction == 1.0 else 0))
            points[-1]["steps"] = producer.steps
        return points

    # -------------------------------------------------------------- (b)
    def rft(self):
        a = self.args
        env, counter = counted(self.env)
        c = self.config(attempts=1)
        rc = rollout_lib.rollout_config(c, max_attempts=1)
        fmt = chat.FORMATS[c.rollout.chat_format]
        per_round = max(1, self.budget() // (a.rft_rounds * a.group))  # tasks per round
        kept, points, params, dropped = [], [], self.sft_params(), 0
        for r in range(a.rft_rounds):
            tasks = [self.train[(r * per_round + i) % len(self.train)] for i in range(per_round)]
            episodes = rollout_lib.generate(self.sampler, params, tasks, tokenizer=self.tokenizer,
                                            key=jax.random.key(1000 * self.seed + r), config=rc,
                                            fmt=fmt, envs={env.name: env}, verify_now=False)
            rollout_lib.verify_episodes(episodes)
            for e in episodes:
                if e.verdicts and e.verdicts[-1].passed:
                    completion = e.tokens[e.prompt_len:]
                    if len(completion) > c.sft.max_completion_len:
                        dropped += 1
                        continue
                    kept.append({"prompt_ids": e.tokens[:e.prompt_len],
                                 "completion_ids": completion,
                                 "completion_mask": e.mask[e.prompt_len:],
                                 "domain": e.task.domain})
            if kept:
                path = os.path.join(self.root, "rft", f"round{r}.jsonl")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                jsonl.write(kept, path)
                params = learner_lib.sft(
                    self.config(**{"sft.sources": (path,), "sft.steps": a.rft_steps,
                                   "sft.checkpoint_every": a.rft_steps}),
                    os.path.join(self.root, "rft", f"sft{r}"), params=params,
                    tokenizer=self.tokenizer)
            if (r + 1) / a.rft_rounds in self.fractions() or r + 1 == a.rft_rounds:
                points.append(self.evaluate(params, counter.calls))
                points[-1].update(kept=len(kept), dropped_too_long=dropped, rounds=r + 1)
        return points

    def before(self):
        """The SFT model's numbers: every method's starting point (measured once)."""
        if self._before is None:
            self._before = self.evaluate(self.sft_params(), 0, examples=3)
        return self._before

    def run(self, method):
        t0 = time.perf_counter()
        before = self.before()
        if method == "sft":
            points = []
        elif method == "rft":
            points = self.rft()
        else:
            points = self.grpo(method)
        return {"method": method, "seed": self.seed, "before": before, "points": points,
                "after": points[-1] if points else before, "wall_s": time.perf_counter() - t0,
                "budget": self.budget()}


# ----------------------------------------------------------------------------- report

def summarize(results):
    """Per method: mean, min and max over seeds of the after-training numbers."""
    rows = {}
    for m in METHODS:
        mine = [r for r in results if r["method"] == m]
        if not mine:
            continue
        row = {}
        for name, get in (
                ("greedy pass@1", lambda r: r["after"]["greedy"]["pass@1"]),
                ("sampled pass@1", lambda r: r["after"]["sample"]["pass@1"]),
                ("pass@k", lambda r: r["after"]["sample"][max(
                    (k for k in r["after"]["sample"] if k.startswith("pass@")),
                    key=lambda k: int(k[5:]))]),
                ("pass within 2 (sampled)", lambda r: r["after"]["sample"]["pass_within_2"]),
                ("repair before", lambda r: r["before"]["sample"]["repair_rate"]),
                ("repair after", lambda r: r["after"]["sample"]["repair_rate"]),
                ("train verifier calls", lambda r: r["after"]["train_calls"])):
            vals = [get(r) for r in mine if get(r) is not None]
            row[name] = (float(np.mean(vals)), float(min(vals)), float(max(vals))) if vals \
                else None
        row["seeds"] = len(mine)
        rows[m] = row
    return rows


def fmt_cell(v, column=""):
    if v is None:
        return "n/a"
    mean, lo, hi = v
    if "calls" in column:
        return f"{mean:.0f}"
    return f"{mean:.2f} [{lo:.2f}, {hi:.2f}]"


def table_markdown(summary) -> str:
    cols = list(next(iter(summary.values())))[:-1]
    lines = ["| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m, row in summary.items():
        lines.append(f"| {LABELS[m]} | " + " | ".join(fmt_cell(row[c], c) for c in cols) + " |")
    return "\n".join(lines)


def plots(results, out):
    """PNGs: pass@1 (and pass within two attempts) against training verifier calls; repair
    rate before and after. Returns {name: png bytes}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pngs = {}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for m in METHODS:
        mine = [r for r in results if r["method"] == m]
        if not mine:
            continue
        for ax, key in zip(axes, ("pass@1", "pass_within_2")):
            xs = [[0] + [p["train_calls"] for p in r["points"]] for r in mine]
            ys = [[r["before"]["sample"][key]] + [p["sample"][key] for p in r["points"]]
                  for r in mine]
            x, y = np.mean(xs, 0), np.mean(ys, 0)
            ax.errorbar(x, y, yerr=[y - np.min(ys, 0), np.max(ys, 0) - y], marker="o",
                        capsize=3, label=LABELS[m])
    for ax, title in zip(axes, ("held-out sampled pass@1 (attempt 1)",
                                "held-out pass within 2 attempts (sampled)")):
        ax.set(xlabel="training verifier calls", ylabel="pass rate", title=title, ylim=(0, 1))
        ax.grid(alpha=.3)
    axes[0].legend(fontsize=8)
    pngs["pass_vs_calls.png"] = _save(fig, out, "pass_vs_calls.png")
    fig, ax = plt.subplots(figsize=(8, 4))
    present = [m for m in METHODS if any(r["method"] == m for r in results)]
    for j, (when, color) in enumerate((("before", "#999"), ("after", "#1f77b4"))):
        vals = [[r[when]["sample"]["repair_rate"] or 0.0 for r in results if r["method"] == m]
                for m in present]
        mean = [np.mean(v) for v in vals]
        ax.bar(np.arange(len(present)) + 0.4 * j - 0.2, mean, 0.4, color=color,
               label=f"{when} training",
               yerr=[[mu - min(v) for mu, v in zip(mean, vals)],
                     [max(v) - mu for mu, v in zip(mean, vals)]], capsize=3)
    ax.set_xticks(range(len(present)), [LABELS[m] for m in present], rotation=15, fontsize=8)
    ax.set(ylabel="P(attempt 2 passes | attempt 1 failed)", ylim=(0, 1),
           title="held-out repair rate (sampled)")
    ax.legend()
    fig.tight_layout()
    pngs["repair_rate.png"] = _save(fig, out, "repair_rate.png")
    return pngs


def _save(fig, out, name) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    data = buf.getvalue()
    with open(os.path.join(out, name), "wb") as f:
        f.write(data)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return data


def report_html(results, summary, pngs, meta) -> str:
    esc = html.escape
    cols = list(next(iter(summary.values())))[:-1]
    table = "<table><tr><th>method</th>" + "".join(f"<th>{esc(c)}</th>" for c in cols) + \
        "<th>seeds</th></tr>" + "".join(
            f"<tr><td>{esc(LABELS[m])}</td>" + "".join(
                f"<td>{esc(fmt_cell(row[c], c))}</td>" for c in cols) +
            f"<td>{row['seeds']}</td></tr>" for m, row in summary.items()) + "</table>"
    images = "".join(f'<p><img alt="{esc(n)}" src="data:image/png;base64,'
                     f'{base64.b64encode(b).decode()}"></p>' for n, b in pngs.items())
    columns = []
    for m in ("grpo_retry", "grpo_neutral", "grpo", "rft"):
        mine = [r for r in results if r["method"] == m]
        if not mine:
            continue
        eps = mine[0]["after"]["sample"].get("examples") or []
        cells = "".join(
            f"<div class=ep><b>{esc(e['prompt'])}</b> (hidden format: {esc(e['format'])})" +
            "".join(f"<pre>attempt {i + 1}: {esc(a['answer'])}</pre><p class="
                    f"{'ok' if a['passed'] else 'bad'}>{esc(a['feedback'])}</p>"
                    for i, a in enumerate(e["attempts"])) + "</div>" for e in eps)
        columns.append(f"<div class=col><h3>{esc(LABELS[m])}, after training (seed "
                       f"{mine[0]['seed']})</h3>{cells or '<p>no failed first attempt</p>'}"
                       "</div>")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>ptrain efficacy</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:auto}} td,th{{border:1px solid #ccc;
padding:3px 6px}} table{{border-collapse:collapse}} .cols{{display:flex;gap:12px}}
.col{{flex:1}} .ep{{border:1px solid #ddd;margin:6px 0;padding:4px}} .ok{{color:green}}
.bad{{color:#a00}} pre{{background:#f6f6f6;margin:2px 0}}</style></head><body>
<h1>Feedback that teaches: held-out results at equal verifier calls</h1>
<p>Environment ptrain.envs.hidden_format (return format stated only by the failing test).
Mean [min, max] over seeds, after training; repair = P(attempt 2 passes | attempt 1 failed),
sampled. {esc(json.dumps(meta))}</p>{table}{images}
<h2>Sample episodes (failed first attempts)</h2><div class=cols>{''.join(columns)}</div>
</body></html>"""


# ----------------------------------------------------------------------------- main

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=40, help="budget: GRPO steps of one attempt")
    p.add_argument("--tasks", type=int, default=100, help="held-out tasks")
    p.add_argument("--train_tasks", type=int, default=2000)
    p.add_argument("--samples", type=int, default=8, help="sampled eval: samples per task (k)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per GRPO step")
    p.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--sft_steps", type=int, default=600)
    p.add_argument("--retry_demos", type=float, default=0.5,
                   help="share of SFT demonstrations that retry after feedback without reading "
                        "it (hidden_format.retry_demonstration); 0: first attempts only")
    p.add_argument("--rft_rounds", type=int, default=4)
    p.add_argument("--rft_steps", type=int, default=40, help="fine-tuning steps per RFT round")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--task_seed", type=int, default=None,
                   help="one task split and SFT model for every seed (default: per seed)")
    p.add_argument("--no_curve", dest="curve", action="store_false",
                   help="evaluate at the full budget only (not also at half)")
    p.add_argument("--out", default="runs/efficacy")
    p.add_argument("--jax_cache", default=os.path.join(ROOT, ".cache", "jax"),
                   help="persistent compilation cache (every method compiles the same programs)")
    args = p.parse_args(argv)
    if args.steps < 2 or args.rft_rounds < 2:
        p.error("--steps and --rft_rounds must be >= 2 (results at half and all the budget)")
    if args.jax_cache and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", args.jax_cache)
    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    t0, load0 = time.perf_counter(), os.getloadavg()
    results = []
    for seed in args.seeds:
        study = Study(args, seed, os.path.join(args.out, f"seed{seed}"))
        print(f"seed {seed}: SFT {args.sft_steps} steps in {study.sft_s:.0f} s", flush=True)
        for method in args.methods:
            results.append(study.run(method))
            r = results[-1]
            print(f"seed {seed} {method}: {r['after']['train_calls']} calls, greedy pass@1 "
                  f"{r['after']['greedy']['pass@1']:.2f}, sampled pass@1 "
                  f"{r['after']['sample']['pass@1']:.2f}, within 2 "
                  f"{r['after']['sample']['pass_within_2']:.2f}, repair "
                  f"{r['before']['sample']['repair_rate']} -> "
                  f"{r['after']['sample']['repair_rate']} ({r['wall_s']:.0f} s)", flush=True)
            jsonl.write(results, os.path.join(args.out, "results.jsonl"))
    meta = {"args": vars(args), "wall_s": round(time.perf_counter() - t0),
            "loadavg_start": load0, "loadavg_end": os.getloadavg(),
            "cpus": os.cpu_count(), "backend": jax.default_backend()}
    summary = summarize(results)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "summary": summary, "results": results}, f, indent=1)
    pngs = plots(results, args.out)
    with open(os.path.join(args.out, "efficacy.html"), "w") as f:
        f.write(report_html(results, summary, pngs, meta))
    print(table_markdown(summary))
    print(json.dumps(meta))
    return {"meta": meta, "summary": summary, "results": results}


if __name__ == "__main__":
    main()
