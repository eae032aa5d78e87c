"""The CAD environment: the model writes a CadQuery script, the sandbox builds it and measures
the part against the task's target (docs/cad.md).

    dict(env="ptrain.envs.cad:make", args=dict(n_train=60, n_heldout=20, tools=True))
    dict(env="ptrain.envs.cad:make", args=dict(train="parts.jsonl", heldout="held.jsonl"))

Tasks: the part families (`families.py`, seeded by the run's seed, held-out parameters the
train split never draws), or brought task files (`task_file.py`). Demonstrations: each
training task's reference script as the answer. The verifier takes the answer's last fenced
script (or the whole answer), builds and measures it (`sandbox.cad.build_and_measure`) against
the target and scores it (`reward.score`): a verdict with the reward's components, the
measurement text as feedback and, for people, the render (PNG) and the STEP file written
under the run's work dir. The `cad` tool ({"script": ...}) returns the same build and
measurement text inside an episode (build, read, fix); with `image_observations` (a
vision-language policy's) it also returns the part's render, the four-view PNG the
measurement draws, as an image of the observation (`sandbox.tools.ToolOutput`).

The target: a brought mesh is read from its file; reference code is built once in the sandbox
and cached on the host by the code's hash. It reaches only the measurement's fresh run, never
a run of the model's code (the episode's work dir holds the task's id alone, which the tool
reads from the host side).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import random
import re
import threading

from sandbox import tools as sandbox_tools

from ptrain import rewards
from ptrain.envs import base, synthetic
from ptrain.envs.cad import families, fixes, reward, task_file
from ptrain.envs.verdict import Verdict
from ptrain.tasks import Task

NAME = "cad"
TASK_FILE = ".cad_task"  # in an episode's work dir: the task's id (for the tool)
CACHE_DIR = os.environ.get("PTRAIN_CAD_CACHE",
                           os.path.join(os.path.expanduser("~"), ".cache", "ptrain", "cad"))
SYSTEM = ("Write a CadQuery script that builds the part and leaves it in `result` "
          "(a dict of name -> part for several parts), as ```python ... ```.")


@dataclasses.dataclass(frozen=True)
class Target:
    """A CAD task's verifier: reference code and/or brought meshes ({name: STL path}; when
    given, the target), named checks, the IoU a pass needs."""

    code: str = ""
    mesh: dict = dataclasses.field(default_factory=dict)
    checks: tuple = ()
    pass_iou: float = task_file.PASS_IOU


# ----------------------------------------------------------------------------- tasks

def _task(i, split, prompt, target: Target, tools: bool, **metadata) -> Task:
    tid = f"{split}/{NAME}/{i}" if split else str(i)
    return Task(id=tid, domain=NAME, verifier=target, prompt=f"{prompt}\n{SYSTEM}",
                tools=("cad",) if tools else (), files={TASK_FILE: tid} if tools else {},
                metadata={"reference": target.code, **metadata})


def generated(n: int, seed: int, split: str, tools: bool, names=None) -> list[Task]:
    return [_task(i, split, p["prompt"], Target(p["code"], {}, tuple(p["checks"])), tools,
                  family=p["family"])
            for i, p in enumerate(families.generate(n, seed, split, names))]


def brought(path: str, tools: bool = False) -> list[Task]:
    """A task file's tasks (`task_file.py`)."""
    return [_task(t["id"], "", t["prompt"], Target(t["code"], t["mesh"], tuple(t["checks"]),
                                                   t["pass_iou"]), tools)
            for t in task_file.read(path)]


def answer(code: str) -> str:
    """A script as an answer (the demonstrations' and the oracle's form)."""
    return f"```python\n{code.rstrip()}\n```"


def demonstration(task: Task, tokenizer, fmt, tools=()) -> dict:
    """The SFT record of a task answered with its reference script in one turn; the prompt
    rendered as a rollout renders it (with the `cad` tool's schema where offered)."""
    from ptrain import chat
    record = synthetic.demo_record(dataclasses.replace(task, tools=()),
                                   (answer(task.verifier.code),), tokenizer, fmt)
    record["prompt_ids"] = chat.render_prompt(fmt, tokenizer, prompt=task.prompt,
                                              messages=task.messages, tools=tools)
    return record


def with_fixes(demos, tasks, ctx, tool, share: float, build) -> list[dict]:
    """`demos` (one per task of `tasks`) with a seeded `share` of the tool-offering tasks'
    replaced by a build-read-fix demonstration (`fixes.py`); `build(task, script)` is the
    tool's build and measurement."""
    rng = random.Random(f"{ctx.seed}/cad-fixes")
    chosen = [i for i, t in enumerate(tasks) if t.tools and rng.random() < share]
    wrong = {i: fixes.mistake(tasks[i].verifier.code) for i in chosen}
    with concurrent.futures.ThreadPoolExecutor(4) as threads:
        seen = dict(zip(chosen, threads.map(lambda i: fixes.observation(
            build(tasks[i], wrong[i])), chosen)))
    return [fixes.demonstration(t, ctx.tokenizer, ctx.fmt, tool, wrong[i], seen[i],
                                answer(t.verifier.code)) if i in seen else d
            for i, (t, d) in enumerate(zip(tasks, demos))]


# ----------------------------------------------------------------------------- targets

class Targets:
    """Each task's target meshes ({name: STL bytes}): a brought mesh read from its file,
    reference code built once in the sandbox and kept under `cache_dir` by the code's hash."""

    def __init__(self, cache_dir: str, backend="auto"):
        self.cache_dir, self.backend = cache_dir, backend
        self._memo, self._lock = {}, threading.Lock()

    def __call__(self, v: Target) -> dict:
        if v.mesh:
            return {name: _read(path) for name, path in v.mesh.items()}
        key = hashlib.sha256(v.code.encode()).hexdigest()
        with self._lock:
            if key not in self._memo:
                self._memo[key] = self._load(key) or self._build(key, v.code)
            return self._memo[key]

    def _load(self, key):
        d = os.path.join(self.cache_dir, key)
        if not os.path.isdir(d):
            return None
        return {f[:-4]: _read(os.path.join(d, f)) for f in sorted(os.listdir(d))
                if f.endswith(".stl")} or None

    def _build(self, key, code):
        from sandbox import cad
        result, report, files = cad.build(code, backend=self.backend)
        meshes = {os.path.basename(p)[:-4]: d for p, d in files.items() if p.endswith(".stl")}
        if not (report and report.get("ok")) or not meshes:
            why = (report or {}).get("error") or result.describe()
            raise ValueError(f"a CAD task's reference code does not build ({why}):\n{code}")
        d = os.path.join(self.cache_dir, key)
        tmp = f"{d}.tmp{os.getpid()}.{threading.get_ident()}"
        os.makedirs(tmp, exist_ok=True)
        for name, data in meshes.items():
            with open(os.path.join(tmp, f"{name}.stl"), "wb") as f:
                f.write(data)
        try:
            os.rename(tmp, d)
        except OSError:  # another process cached it first
            pass
        return meshes


def _read(path):
    with open(path, "rb") as f:
        return f.read()


# ----------------------------------------------------------------------------- judging

def judge(script: str, target: dict, checks, *, backend, timeout_s: float, render: bool):
    """One answer's build and measurement (`sandbox.cad.Report`); run on a verifier's pool."""
    from sandbox import cad
    return cad.build_and_measure(script, target, list(checks), render=render, backend=backend,
                                 build_timeout_s=timeout_s)


def verdict(v: Target, report, *, mode: str, artefacts: dict) -> Verdict:
    """A report as a verdict: the gated reward and its components, the measurement text."""
    s = reward.score(report.measurement if report.built else None, mode=mode,
                     pass_iou=v.pass_iou)
    c = s["components"]
    feedback = report.text
    if report.stdout.strip():
        feedback += f"\nThe script printed:\n{report.stdout.strip()[-500:]}"
    if not report.built:
        error = "build_failed"
    elif c["checks"] < 1:
        error = "checks_failed"
    elif not s["passed"]:
        error = "below_iou"
        feedback += f"\nIoU {c['iou']:.3f} is below the {v.pass_iou:g} a pass needs."
    else:
        error = ""
    return Verdict(s["reward"], s["passed"], float(s["passed"]), feedback, error,
                   components=c, artefacts=artefacts)


def write_artefacts(out_dir: str, task_id: str, script: str, report) -> dict:
    """The render (PNG) and the STEP file of a build under out_dir/TASK/, for people."""
    if not out_dir or not report.built:
        return {}
    stem = os.path.join(out_dir, re.sub(r"[^\w.-]+", "_", task_id),
                        hashlib.sha256(script.encode()).hexdigest()[:12])
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    out = {}
    for name, ext, data in (("render", "png", report.png),
                            ("step", "step", report.files.get("out/part.step"))):
        if data:
            with open(f"{stem}.{ext}", "wb") as f:
                f.write(data)
            out[name] = f"{stem}.{ext}"
    return out


# ----------------------------------------------------------------------------- the environment

def make(n_train: int = 60, n_heldout: int = 20, *, train: str = "", heldout: str = "",
         family_names: tuple = (), tools: bool = False, mode: str = "iou",
         backend: str = "auto", build_timeout_s: float = 60.0, cache_dir: str = "",
         artefacts_dir: str = "", artefacts: bool = True,
         fix_demos: float = 0.0, image_observations: bool = False) -> base.Environment:
    """The CAD environment. Tasks: generated from the part families (`family_names`: their
    names, () all), or the task files `train` and `heldout` (both). `tools`: offer the `cad`
    tool (build and measure inside the episode). `mode`: the reward's ("iou" or "pass",
    `reward.score`; rewards.partial_credit does not apply). `backend`: the CAD sandbox's
    (`sandbox.cad.spec`). Targets are cached under `cache_dir` (default $PTRAIN_CAD_CACHE or
    ~/.cache/ptrain/cad); renders and STEP files go under `artefacts_dir` (default the
    environment's directory of the run's work dir, /artefacts); `artefacts=False` renders
    and keeps nothing (each verdict a little cheaper, no files growing with the run).
    `fix_demos`: the share of the tool-offering training tasks whose demonstration first calls
    the tool with one dimension wrong, reads the measurement and then answers (`fixes.py`;
    each such script is built in the sandbox when the tasks are made).
    `image_observations`: the `cad` tool returns the built part's render with its text, for
    a vision-language policy (a text-only one is refused before generation)."""
    if not 0.0 <= fix_demos <= 1.0:
        raise ValueError(f"fix_demos={fix_demos!r}: a share of the training tasks, 0 to 1")
    if mode not in reward.MODES:
        raise ValueError(f"mode={mode!r}: use one of {reward.MODES}")
    if bool(train) != bool(heldout):
        raise ValueError("give both task files, train and heldout, or neither (generated)")
    unknown = sorted(set(family_names) - set(families.FAMILIES))
    if unknown:
        raise ValueError(f"unknown CAD families {unknown}; known: {sorted(families.FAMILIES)}")
    targets = Targets(cache_dir or CACHE_DIR, backend)
    by_id: dict[str, Task] = {}
    state = {"artefacts": artefacts_dir}

    def run_tool(session, args, timeout_s):
        from sandbox import cad
        task = by_id.get(session.read_files().get(TASK_FILE, b"").decode())
        target = targets(task.verifier) if task is not None else None
        report = cad.build_and_measure(args["script"], target,
                                       list(task.verifier.checks) if task else (),
                                       render=image_observations, backend=backend,
                                       build_timeout_s=max(timeout_s, 1.0))
        text = fixes.observation(report)
        if image_observations and report.png:
            return sandbox_tools.ToolOutput(text, (report.png,))
        return text

    tool = base.Tool("cad", "Build a CadQuery script (it sets `result`) and measure the part: "
                     "the build error, or its volume, size and bounding box and how it "
                     "compares with the target.",
                     {"type": "object", "properties": {"script": {"type": "string"}},
                      "required": ["script"], "additionalProperties": False}, run_tool,
                     images=image_observations)

    def tasks(ctx: base.Context) -> base.Splits:
        if train:
            splits = [brought(path, tools) for path in (train, heldout)]
            clash = {t.prompt for t in splits[0]} & {t.prompt for t in splits[1]}
            if clash:
                raise ValueError(f"{heldout}: {len(clash)} held-out prompts are also in {train}")
        else:
            splits = [generated(n, ctx.seed, split, tools, family_names or None)
                      for n, split in ((n_train, "train"), (n_heldout, "heldout"))]
        splits = [[dataclasses.replace(t, domain=ctx.name) for t in s] for s in splits]
        for t in splits[0] + splits[1]:
            by_id[t.id] = t
        state["artefacts"] = state["artefacts"] or os.path.join(ctx.workdir, "artefacts")
        demos = [demonstration(t, ctx.tokenizer, ctx.fmt, (tool,) if t.tools else ())
                 for t in splits[0] if t.verifier.code] if ctx.tokenizer is not None else []
        if demos and fix_demos:
            demos = with_fixes(demos, [t for t in splits[0] if t.verifier.code], ctx, tool,
                               fix_demos, lambda t, script: judge(
                                   script, targets(t.verifier), t.verifier.checks,
                                   backend=backend, timeout_s=build_timeout_s, render=False))
        return base.Splits(splits[0], splits[1], demos)

    def verify(tasks_, answers, *, sessions=None, pool=None,
               config: rewards.RewardConfig = rewards.RewardConfig()) -> list[Verdict]:
        del sessions, config  # judged from the answer alone, with this environment's limits
        scripts = [rewards.extract_code(a, "python") for a in answers]
        pending = [base.submit(pool, judge, s, targets(t.verifier), t.verifier.checks,
                               backend=backend, timeout_s=build_timeout_s, render=artefacts)
                   if s.strip() else None for t, s in zip(tasks_, scripts)]
        out = []
        for t, s, p in zip(tasks_, scripts, pending):
            if p is None:
                out.append(Verdict(0.0, False, 0.0, "No script: answer with a CadQuery script "
                                   "that sets `result`.", "no_script",
                                   components={"build": 0.0, "iou": 0.0, "checks": 0.0}))
                continue
            report = p.result()
            out.append(verdict(t.verifier, report, mode=mode, artefacts=write_artefacts(
                state["artefacts"] if artefacts else "", t.id, s, report)))
        return out

    return base.Environment(name=NAME, tasks=tasks, verify=verify, tools=(tool,),
                            turns=base.TurnPolicy(retries=True), tokenizer=tokenizer)


def tokenizer():
    """A word tokenizer for the generated tasks (the toy config's): the words of the
    families' prompts and scripts, of the measurement text, and every printable character."""
    parts = families.generate(60, 0, "train") + families.generate(12, 0, "heldout")
    text = " ".join(p["prompt"] + " " + p["code"] for p in parts) + " " + SYSTEM + (
        " Built volume area size bbox to body bodies watertight Against the target IoU Chamfer "
        "of the target's diagonal bounding box off by Check failed collide overlap clearance "
        "Build failed The script printed is below the a pass needs script cad name arguments "
        "tool_call result cadquery Workplane")
    return synthetic.WordTokenizer(sorted(set(re.findall(r"[A-Za-z_]+", text))) + [
        chr(i) for i in range(33, 127)] + [" " * n for n in range(1, 9)] + ["\n"])
