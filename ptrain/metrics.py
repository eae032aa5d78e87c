"""Run logs in a work dir: TensorBoard events, metrics.jsonl, rollouts.jsonl, PNG curves.

Layout: `<workdir>/metrics.jsonl` (one {"step", key: value} line per step),
`<workdir>/rollouts.jsonl` (one line per sample), `<workdir>/tb/` (TensorBoard) and
`<workdir>/plots/<key>.png`.

Per-domain metrics (`batch.domain_metrics`: reward/<domain>/mean, episode/<domain>/<field>)
go to metrics.jsonl as they are, and to TensorBoard in one group, `domain/<domain>/<field>`
(field "reward" for the mean reward), with per-step summaries across the step's domains that
stay readable at hundreds of them: `domains/count` (domains in the step), `domains/seen` (in
the run so far), and for reward and passed `domains/<field>/{mean,min,max}`, the best and
worst TOP_K (`domains/<field>/best_1`..., `worst_1`...; `domains/<field>/ranking`, a text,
names them) and a histogram `domains/<field>` of the per-domain values. `write_eval`
writes eval.jsonl lines to <workdir>/tb/eval/ summarised the same way. The adaptive draw's
per-environment weights (`tasks/weight/<env>`, `ptrain.mixture`) go to metrics.jsonl as they
are and to TensorBoard as the same summaries only (`tasks/weight/{mean,min,max,best_1...}`,
the histogram `tasks/weight`, its ranking). The default `plot()` leaves per-domain keys out
(one PNG each).

`write_run_record` keeps the config a run was started with
(`<workdir>/config.json`, overrides applied) and every command line that started it
(`<workdir>/command.txt`); `read_run_config` reads the config back. Progress with ETA
(`ptrain.progress`): a bar on stderr when it is a terminal, else a log line now and then.

Resuming: open the writer with `start_step` = the restored checkpoint's step. Lines logged
after that step by the crashed run are removed from both JSONL files (a torn last line is
removed with a warning), and TensorBoard is told to purge its events past that step, so the
resumed run appends without duplicates.
"""

import datetime
import json
import os
import re
import shlex
import sys
import time

import numpy as np

from ptrain import jsonl
from ptrain import progress as progress_lib
from ptrain.jsonl import read as read_jsonl


def _import_tensorboardx():
    """tensorboardX, imported without torch where torch is not loaded yet: tensorboardX
    imports it only to accept torch tensors (ptrain logs floats), and that import costs
    seconds of CPU in every process that writes metrics (each launch.train start). Called
    when a writer opens, not at import: tensorboardX itself (with boto3) is ~0.3 s."""
    if "torch" in sys.modules:
        import tensorboardX
        return tensorboardX
    sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
    try:
        import tensorboardX
    finally:
        del sys.modules["torch"]  # a later `import torch` loads it as usual
    return tensorboardX


def _figure(figsize):
    """(a matplotlib Figure, a function that writes it as PNG). matplotlib is imported here,
    when a plot is drawn, not with this module: it was ~1 s of every process start that
    logs (`import ptrain.learner`: 6.9 -> 5.7 CPU-s, user + sys)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize)
    return fig, lambda path: FigureCanvasAgg(fig).print_png(path)


ROLLOUT_KEYS = ("prompt", "completion", "reward")  # also: feedback, domain, anything else
DEFAULT_PLOT_PATTERN = re.compile(r"reward|kl|entropy|length")
# The per-domain keys of `batch.domain_metrics`.
DOMAIN_KEY = re.compile(
    r"^(?:reward/(?P<reward>.+)/mean|episode/(?P<domain>.+)/(?P<field>[^/]+))$")
WEIGHT_PREFIX = "tasks/weight/"  # the adaptive draw's weight of each environment
TOP_K = 5  # best and worst domains named per step
SUMMARISED = ("reward", "passed", "pass_rate")  # the per-domain fields summarised across domains


def split_domain_key(key: str) -> tuple[str, str] | None:
    """(domain, field) of a per-domain metric key, else None: reward/<d>/mean -> (d,
    "reward"), episode/<d>/<field> -> (d, field)."""
    m = DOMAIN_KEY.match(key)
    if m is None:
        return None
    return (m["reward"], "reward") if m["reward"] is not None else (m["domain"], m["field"])


def domain_summary(values: dict[str, float], k: int = TOP_K) -> tuple[dict, list]:
    """Across domains ({domain: value}): ({"mean", "min", "max", "best_1".., "worst_1"..}
    scalars, [(rank, domain, value)] of the best k then the worst k), best first, ties by
    name."""
    ranked = sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))
    array = np.asarray([v for _, v in ranked])
    k = min(k, len(ranked))
    scalars = {"mean": float(array.mean()), "min": float(array.min()), "max": float(array.max())}
    named = []
    for i in range(k):
        scalars[f"best_{i + 1}"] = ranked[i][1]
        scalars[f"worst_{i + 1}"] = ranked[-1 - i][1]
        named.append((f"best {i + 1}", *ranked[i]))
    named += [(f"worst {i + 1}", *ranked[-1 - i]) for i in range(k)]
    return scalars, named


def _write_summaries(tb, prefix, values, step):
    """`domain_summary` of {domain: value} as <prefix>/<stat> scalars, the histogram <prefix>
    and the text <prefix>/ranking."""
    scalars, named = domain_summary(values)
    for stat, value in scalars.items():
        tb.add_scalar(f"{prefix}/{stat}", value, global_step=step)
    tb.add_histogram(prefix, np.asarray(list(values.values()), dtype=np.float64),
                     global_step=step)
    rows = "\n".join(f"| {rank} | {domain} | {value:.4g} |" for rank, domain, value in named)
    tb.add_text(f"{prefix}/ranking", f"| rank | domain | value |\n|---|---|---|\n{rows}",
                global_step=step)


CONFIG_FILE, COMMAND_FILE = "config.json", "command.txt"


def write_run_record(workdir, config, argv) -> None:
    """`<workdir>/config.json`: the config as the run resolved it (file and overrides; values
    JSON cannot hold, such as functions, written as their repr); `<workdir>/command.txt`: the
    command line, one line per start (a resumed run adds one)."""
    os.makedirs(workdir, exist_ok=True)
    file = os.path.join(workdir, CONFIG_FILE)
    with open(file + ".tmp", "w") as f:
        f.write(config.to_json_best_effort(indent=2) + "\n")
    os.replace(file + ".tmp", file)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    with open(os.path.join(workdir, COMMAND_FILE), "a") as f:
        f.write(f"# {started}\n{shlex.join(argv)}\n")


def read_run_config(workdir):
    """The ConfigDict `write_run_record` kept (JSON lists read back as tuples)."""
    import ml_collections
    file = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(file):
        raise FileNotFoundError(f"no {CONFIG_FILE} in {workdir!r}: launch/train.py writes it at "
                                "the start of a run; is this the --workdir of a run?")
    with open(file) as f:
        raw = json.load(f)

    def tuples(x):
        if isinstance(x, dict):
            return {k: tuples(v) for k, v in x.items()}
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x
    return ml_collections.ConfigDict(tuples(raw))


def _scalar(key, value):
    """A number, or a 1-D vector of numbers (e.g. `moe/load`: the load per expert) as a list."""
    array = np.asarray(value)
    if array.ndim > 1 or array.size < 1 or not np.issubdtype(array.dtype, np.number):
        raise ValueError(f"metric {key!r} must be a number or a 1-D vector of numbers; got "
                         f"{type(value).__name__} of shape {array.shape}")
    if array.ndim == 1:
        return [float(x) for x in array]
    return float(array.reshape(()))


class MetricsWriter:
    """Writes one work dir's logs; see the module docstring."""

    def __init__(self, workdir, *, total_steps=None, start_step=0, progress=None,
                 primary=None, desc="step"):
        """primary: whether this process writes (default: JAX process 0 of many, so that N
        processes logging the same globally reduced metrics write one set of files); the
        others check what they are given and write nothing. progress: the bar's
        `ptrain.progress.Progress` bar argument (None: a bar on a terminal, else log lines);
        desc names it ("rl", "sft")."""
        self.workdir = os.fspath(workdir)
        if primary is None:
            import jax  # only to learn which process this is
            primary = jax.process_index() == 0
        self.primary = bool(primary)
        self._step = start_step
        self.metrics_path = os.path.join(self.workdir, "metrics.jsonl")
        self.rollouts_path = os.path.join(self.workdir, "rollouts.jsonl")
        if not self.primary:
            return
        os.makedirs(self.workdir, exist_ok=True)
        for path in (self.metrics_path, self.rollouts_path):
            jsonl.truncate(path, start_step)
        self._tb = _import_tensorboardx().SummaryWriter(
            os.path.join(self.workdir, "tb"), purge_step=start_step + 1 if start_step else None)
        # The domains logged so far (`domains/seen`), those of the kept lines on a resume.
        self._domains = {split[0] for row in read_jsonl(self.metrics_path) for key in row
                         if (split := split_domain_key(key)) is not None}
        self._bar = progress_lib.Progress(total_steps, desc=desc, unit="step",
                                          initial=start_step, bar=progress)
        self._step = start_step

    def write(self, step, metrics):
        """Logs a dict of metrics for `step` (numbers, numpy or JAX scalars); a 1-D vector
        (one value per expert, per layer) is a list in metrics.jsonl and a TensorBoard
        histogram of its values."""
        values = {k: _scalar(k, v) for k, v in metrics.items()}
        if not self.primary:
            return
        jsonl.append([{"step": int(step), **values}], self.metrics_path)
        by_field: dict[str, dict[str, float]] = {}  # field -> {domain: value}
        weights: dict[str, float] = {}  # environment -> the adaptive draw's weight
        for key, value in values.items():
            split = None if isinstance(value, list) else split_domain_key(key)
            if isinstance(value, list):
                self._tb.add_histogram(key, np.asarray(value), global_step=int(step))
            elif split is not None:
                self._tb.add_scalar(f"domain/{split[0]}/{split[1]}", value,
                                    global_step=int(step))
                by_field.setdefault(split[1], {})[split[0]] = value
            elif key.startswith(WEIGHT_PREFIX):
                weights[key[len(WEIGHT_PREFIX):]] = value
            else:
                self._tb.add_scalar(key, value, global_step=int(step))
        if weights:
            _write_summaries(self._tb, WEIGHT_PREFIX.rstrip("/"), weights, int(step))
        if by_field:
            self._write_domain_summaries(by_field, int(step))
        self._step = int(step)
        self._bar.advance_to(self._step, **{
            k: v for k, v in values.items() if not isinstance(v, list)
            and (k == "sft/loss" or (k.startswith("reward/") and k.endswith("mean")))})

    def _write_domain_summaries(self, by_field, step):
        domains = {d for values in by_field.values() for d in values}
        self._domains |= domains
        self._tb.add_scalar("domains/count", len(domains), global_step=step)
        self._tb.add_scalar("domains/seen", len(self._domains), global_step=step)
        for field in SUMMARISED:
            if field in by_field:
                _write_summaries(self._tb, f"domains/{field}", by_field[field], step)

    def write_rollouts(self, step, samples):
        """Appends samples: dicts with prompt, completion, reward (and feedback, domain, ...)."""
        records = []
        for i, sample in enumerate(samples):
            missing = [k for k in ROLLOUT_KEYS if k not in sample]
            if missing:
                raise ValueError(f"rollout sample {i} of step {step} lacks {missing}")
            records.append({"step": int(step), "feedback": None, "domain": None, **sample})
        if not self.primary:
            return
        jsonl.append(records, self.rollouts_path, default=_to_json)

    def plot(self, keys=None):
        """Draws `<workdir>/plots/<key>.png` per key (default: reward, KL, entropy and length
        metrics); returns the paths."""
        if not self.primary:
            return []
        records = read_jsonl(self.metrics_path)
        logged = sorted({k for r in records for k, v in r.items() if not isinstance(v, list)}
                        - {"step"})
        if keys is None:  # per-domain keys: in TensorBoard and `plot_rewards`, not one PNG each
            keys = [k for k in logged
                    if DEFAULT_PLOT_PATTERN.search(k) and split_domain_key(k) is None]
        unknown = sorted(set(keys) - set(logged))
        if unknown:
            raise ValueError(f"no metric named {unknown} in {self.metrics_path}")
        os.makedirs(os.path.join(self.workdir, "plots"), exist_ok=True)
        paths = []
        for key in keys:
            points = [(r["step"], r[key]) for r in records if key in r]
            fig, save = _figure((6, 3.5))
            ax = fig.add_subplot()
            ax.plot(*zip(*points), marker="." if len(points) < 50 else None)
            ax.set(xlabel="step", title=key)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            path = os.path.join(self.workdir, "plots", re.sub(r"[^\w.-]", "_", key) + ".png")
            save(path)
            paths.append(path)
        return paths

    def close(self):
        if not self.primary:
            return
        self._bar.close()
        self._tb.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


EVAL_LABELS = ("stage", "step", "domain", "decoding", "split")  # an eval line's non-metrics


def write_eval(workdir, lines) -> None:
    """eval.jsonl lines (`closed_loop.evaluate`: stage, step, domain, decoding, pass_rate,
    pass@k, ...) to TensorBoard, <workdir>/tb/eval/ (a run beside the training's): per domain
    `eval_domain/<domain>/<stage>_<decoding>/<key>`, and across the domains of each (stage,
    step, decoding) `eval/<stage>_<decoding>/count` and the summaries of pass_rate
    (`eval/<stage>_<decoding>/pass_rate/...`, as `MetricsWriter.write`'s). One writer per
    run's lines: call it where the lines are appended to eval.jsonl."""
    groups: dict[tuple, dict[str, dict[str, float]]] = {}
    tb = _import_tensorboardx().SummaryWriter(  # a file of its own (names are per second)
        os.path.join(os.fspath(workdir), "tb", "eval"), filename_suffix=f".{time.time_ns()}")
    try:
        for line in lines:
            run, step = f"{line['stage']}_{line['decoding']}", int(line["step"])
            for key, value in line.items():
                if key in EVAL_LABELS or isinstance(value, (dict, list, str, bool)) or \
                        value is None:
                    continue
                tb.add_scalar(f"eval_domain/{line['domain']}/{run}/{key}", value,
                              global_step=step)
                if key in SUMMARISED:
                    groups.setdefault((run, step), {}).setdefault(key, {})[line["domain"]] = \
                        float(value)
        for (run, step), by_field in groups.items():
            domains = {d for values in by_field.values() for d in values}
            tb.add_scalar(f"eval/{run}/count", len(domains), global_step=step)
            for field, values in by_field.items():
                _write_summaries(tb, f"eval/{run}/{field}", values, step)
    finally:
        tb.close()


def _to_json(value):
    """numpy / JAX scalars and arrays in rollout samples."""
    array = np.asarray(value)
    return array.item() if array.ndim == 0 else array.tolist()


def plot_rewards(workdir, domains) -> str:
    """<workdir>/reward_curve.png: RL reward per domain (metrics.jsonl) and the held-out
    greedy pass rates of each stage's latest evaluation: the brought model (hf_model), after
    SFT, after RL (eval.jsonl)."""
    rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    evals = read_jsonl(os.path.join(workdir, "eval.jsonl"))
    fig, save = _figure((11, 4))
    ax, bx = fig.subplots(1, 2)
    for domain in domains:
        key = f"reward/{domain}/mean"
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            steps, values = zip(*points)
            window = max(1, len(values) // 20)
            smooth = np.convolve(values, np.ones(window) / window, mode="valid")
            ax.plot(steps[window - 1:], smooth, label=domain)
    ax.set(xlabel="RL step", ylabel="mean reward", title="training reward", ylim=(-0.02, 1.02))
    if ax.lines:  # (a run without RL steps has none)
        ax.legend()
    greedy = [e for e in evals if e["decoding"] == "greedy"]
    stages = [s for s in ("base", "sft", "rl") if any(e["stage"] == s for e in greedy)]
    width = 0.8 / max(1, len(stages))
    for j, stage in enumerate(stages):
        values = [max(((e["step"], e["pass_rate"]) for e in greedy  # the latest step's
                       if e["stage"] == stage and e["domain"] == d), default=(0, 0.0))[1]
                  for d in domains]
        bx.bar(np.arange(len(domains)) + (j - (len(stages) - 1) / 2) * width, values, width,
               label="brought model" if stage == "base" else f"after {stage}")
    bx.set(xticks=range(len(domains)), xticklabels=domains, ylim=(0, 1),
           ylabel="held-out pass rate (greedy)", title="held-out evaluation")
    if stages:
        bx.legend()
    fig.tight_layout()
    path = os.path.join(workdir, "reward_curve.png")
    save(path)
    return path
