"""The terminal environment: generated Harbor tasks, or a directory of Harbor /
Terminal-Bench tasks (tasks_dir), run in docker (or bwrap: backend).

    dict(env="ptrain.envs.terminal:make", args=dict(n_train=400, n_heldout=32))

    python -m launch.train --config=configs/terminal_toy.py --workdir=runs/terminal_toy

Its episodes run in the one turn loop (`ptrain.rollout`) beside any other environment's:

  tasks       a training and a held-out split of Harbor task directories under
              <workdir>/tasks/terminal/ (`generated`; no instruction in both), or of
              tasks_dir's tasks (heldout_dir's held out, else a seeded split; no
              demonstrations for them), and the partly wrong SFT demonstrations
  sessions    a `sandbox.terminal.Harness` for the run (warm task containers): each
              episode's session is a clean container with a fresh persistent shell
              (`Harness.episode`), where the `bash` tool runs (`agent.BASH`)
  verify      the task's own tests in a fresh verifier box (`Episode.verify`), as the
              learner's `Verdict` (`verdict`)
  eval_fields the greedy pass rate on the held-out tasks whose path has a folder (where the
              demonstrations are wrong) and the episodes the harness could not run

Episodes take the closed loop's rollout.* caps (max_turns, max_len, max_tool_output_chars,
tool_timeout_s) and sampling settings like every environment's. It has no retries with
feedback (rollout.max_attempts must be 1).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import random
import threading

import numpy as np

from ptrain.envs import base
from ptrain.envs.terminal import agent as terminal_agent
from ptrain.envs.terminal import generated as terminal_tasks
from ptrain.envs.verdict import Verdict

log = logging.getLogger("ptrain")
BACKENDS = ("docker", "bwrap")


@dataclasses.dataclass(frozen=True)
class Listed:
    """A task of a directory (tasks_dir), as the environment keeps its tasks."""
    task_dir: str
    instruction: str
    triggered: bool = False  # (generated tasks: the demonstrations' mistake applies)
    domain: str = "terminal"
    tools = ("bash",)  # what its episodes may call

    @property
    def id(self) -> str:
        """The task's directory name: the same wherever the tasks live."""
        return os.path.basename(os.path.normpath(self.task_dir))

    def to_record(self) -> dict:
        return {"task_dir": self.task_dir, "domain": self.domain}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The environment's args (see `make`)."""
    n_train: int = 400
    n_heldout: int = 32
    bug_rate: float = 0.7
    tasks_dir: str = ""
    heldout_dir: str = ""
    threads: int = 16
    max_idle: int = 64
    image_map: tuple = ()
    system: str = ""
    backend: str = "docker"


def make(**args) -> base.Environment:
    """The terminal environment. Args: n_train, n_heldout (generated tasks: instances per
    split; tasks_dir: at most half of its tasks held out), bug_rate (how often a triggered
    demonstration forgets its folder); tasks_dir (a directory of Harbor / Terminal-Bench
    tasks instead of generated ones; "" generates) and heldout_dir (its held-out tasks; "":
    a seeded split of tasks_dir); threads (episodes verified at once; > 1 also warms
    containers before the first batch); max_idle (warm task containers kept); image_map
    (("FROM=LOCAL", ...) for task images not on this machine); system (the agent's system
    prompt; "": the instruction alone); backend ("docker", or "bwrap": tasks that need only
    files).
"""
    unknown = set(args) - {f.name for f in dataclasses.fields(Settings)}
    if unknown:
        raise ValueError(f"terminal environment: unknown args {sorted(unknown)}; known: "
                         f"{[f.name for f in dataclasses.fields(Settings)]}")
    s = Settings(**{**args, "image_map": tuple(args.get("image_map", ()))})
    for ok, what in (
            (s.threads >= 1 and s.max_idle >= 0, "threads must be >= 1 and max_idle >= 0"),
            (s.backend in BACKENDS, f"backend={s.backend!r} must be one of {BACKENDS}"),
            (not s.heldout_dir or s.tasks_dir, "heldout_dir needs tasks_dir (the training "
             "tasks' directory)")):
        if not ok:
            raise ValueError(f"terminal environment: {what}")
    return base.Environment(
        name="terminal", tasks=lambda ctx: make_tasks(s, ctx), tools=(terminal_agent.BASH,),
        turns=base.TurnPolicy(retries=False), tokenizer=terminal_tasks.tokenizer,
        prompt_ids=lambda task, tokenizer, fmt: terminal_agent.render_prompt(
            fmt, tokenizer, task.instruction, s.system),
        verify=lambda tasks, answers, *, sessions, **_: verify(sessions, s.threads),
        sessions=lambda config, heldout: sessions(s, config, heldout),
        eval_fields=eval_fields)


def make_tasks(s: Settings, ctx: base.Context) -> base.Splits:
    """The training and held-out tasks (`generated.Generated`, or `Listed` from tasks_dir)
    and the SFT demonstration records (generated tasks only, in the training tasks' order)."""
    if s.tasks_dir:
        train, heldout = from_directory(s, ctx.seed)
        demos = []
    else:
        root = os.path.join(ctx.workdir, "tasks", ctx.name)
        heldout = terminal_tasks.generate(root, s.n_heldout, seed=ctx.seed, split="heldout")
        train = terminal_tasks.generate(root, s.n_train, seed=ctx.seed, split="train",
                                        exclude={g.instruction for g in heldout})
        rng = random.Random(f"{ctx.seed}/terminal/demos")
        demos = [terminal_tasks.demo_record(g, ctx.tokenizer, *terminal_tasks.demonstration(
            g, rng, s.bug_rate), system=s.system, domain=ctx.name) for g in train]
    train, heldout = ([dataclasses.replace(x, domain=ctx.name) for x in found]
                      for found in (train, heldout))
    return base.Splits(train, heldout, demos)


def _load(path: str, backend: str, image_map=()) -> list[Listed]:
    """The tasks of a directory (every skipped one named, with why); on bwrap, one that
    needs its Dockerfile's image (after image_map, as launch.eval maps it) is an error here,
    before anything trains."""
    from sandbox import terminal
    loaded = terminal.load_tasks(path)
    if loaded.skipped:
        log.warning("terminal.tasks_dir: %s", loaded.summary())
    if not loaded.tasks:
        raise ValueError(f"terminal: no task loaded from {path}: {loaded.summary()}")
    if backend == "bwrap":
        refused = []
        for task in loaded.tasks:
            try:
                terminal.bwrap.plan(task, image_map=terminal.parse_image_map(list(image_map)))
            except terminal.bwrap.NeedsImage as e:
                refused.append(str(e))
        if refused:
            raise ValueError(f"terminal.backend='bwrap' cannot run {len(refused)} task(s) of "
                             f"{path} (use terminal.backend='docker', or leave them out): "
                             + "; ".join(refused))
    return [Listed(task.path, task.instruction) for task in loaded.tasks]


def from_directory(s: Settings, seed: int) -> tuple[list[Listed], list[Listed]]:
    """(train, heldout) from tasks_dir: heldout_dir's tasks, or a seeded split of tasks_dir
    holding out n_heldout of them (at most half); no instruction in both."""
    tasks = _load(s.tasks_dir, s.backend, s.image_map)
    if s.heldout_dir:
        train, heldout = tasks, _load(s.heldout_dir, s.backend, s.image_map)
    else:
        order = sorted(tasks, key=lambda x: x.task_dir)
        random.Random(f"{seed}/terminal/split").shuffle(order)
        n = min(s.n_heldout, len(order) // 2)
        heldout, train = order[:n], order[n:]
    both = {x.instruction for x in train} & {x.instruction for x in heldout}
    if both:
        raise ValueError(f"terminal: {len(both)} held-out instruction(s) are also training "
                         f"tasks', e.g. {sorted(both)[0][:80]!r}")
    return train, heldout


@contextlib.contextmanager
def sessions(s: Settings, config, heldout):
    """The run's harness (closed on leaving; warm containers started for one batch when
    episodes are verified in threads), giving `open_session(task)`: a `sandbox.terminal.
    Episode` of the task (each task directory loaded once), or an `Unopened` one that scores
    0 where the harness cannot start it."""
    from sandbox import terminal
    with terminal.Harness(image_map=terminal.parse_image_map(list(s.image_map)),
                          max_idle=s.max_idle, backend=s.backend,
                          call_timeout_s=config.rollout.tool_timeout_s) as harness:
        if s.threads > 1 and heldout:
            harness.warm(terminal.load_task(heldout[0].task_dir),
                         min(s.max_idle,
                             config.data.prompts_per_step * config.sampling.num_samples))
        loaded, lock = {}, threading.Lock()

        def open_session(task):
            with lock:
                if task.task_dir not in loaded:
                    loaded[task.task_dir] = terminal.load_task(task.task_dir)
            try:
                return harness.episode(loaded[task.task_dir])
            except Exception as e:  # noqa: BLE001 (no container: this episode scores 0)
                log.warning("terminal: %s could not start: %s", task.task_dir, e)
                return Unopened(f"{type(e).__name__}: {e}")
        yield open_session


class Unopened:
    """The session of an episode whose task container could not start: its commands and its
    verdict say why (reward 0, error type "harness_error")."""

    def __init__(self, error: str):
        self.error = error

    def run(self, command=None, timeout_s=None):
        raise RuntimeError(f"the task's container could not start: {self.error}")

    def verify(self):
        return self.run()

    def close(self):
        pass


def verify(sessions, threads: int = 16) -> list[Verdict]:
    """Each episode's verdict: its task's tests in a fresh verifier box (`Episode.verify`),
    `threads` at once; one the harness could not run scores 0 ("harness_error")."""
    def one(session):
        try:
            return verdict(session.verify())
        except Exception as e:  # noqa: BLE001 (a container that died: reward 0, with why)
            return Verdict(0.0, False, 0.0, f"{type(e).__name__}: {e}", "harness_error")
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, sessions))


def verdict(result) -> Verdict:
    """A task verifier's result (`sandbox.terminal.VerifierResult`: this domain's judge
    report) as the learner's `Verdict`: its reward and pass, the fraction of its tests
    that passed (the reward where no pytest ran), its feedback, and an error type ("" when
    solved; "timeout", "verifier_error" when the tests gave no usable result, else the first
    failing test's status, or "wrong_answer")."""
    tests = result.tests
    ok = sum(s in ("PASSED", "XFAIL") for s in tests.values())
    fraction = ok / len(tests) if tests else float(result.reward)
    if result.passed:
        error_type = ""
    elif result.timed_out:
        error_type = "timeout"
    elif result.error:
        error_type = "verifier_error"
    else:
        bad = [s for s in tests.values() if s in ("FAILED", "ERROR")]
        error_type = bad[0].lower() if bad else "wrong_answer"
    return Verdict(float(result.reward), bool(result.passed), fraction, result.feedback,
                   error_type)


def eval_fields(tasks, episodes) -> dict:
    """More of an eval line: `pass_rate_with_folder` (the tasks whose path has a folder) and
    `errors` (episodes the harness could not run)."""
    n = len(episodes) // max(len(tasks), 1)
    passed = [bool(e.verdicts and e.verdicts[-1].passed) for e in episodes]
    folder = [p for i, p in enumerate(passed) if tasks[i // n].triggered]
    return {"pass_rate_with_folder": float(np.mean(folder)) if folder else None,
            "errors": sum(bool(e.verdicts) and e.verdicts[-1].error_type == "harness_error"
                          for e in episodes)}
