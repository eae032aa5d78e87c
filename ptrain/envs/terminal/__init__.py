"""The terminal environment: generated Harbor tasks, or a directory of Harbor /
Terminal-Bench tasks (tasks_dir), run in docker (or bwrap: backend).

    dict(env="ptrain.envs.terminal:make", args=dict(n_train=400, n_heldout=32))

    python -m launch.train --config=configs/terminal_toy.py --workdir=runs/terminal_toy

The environment runs its own episodes (`Environment.producer` / `evaluate`):

  tasks       a training and a held-out split of Harbor task directories under
              <workdir>/tasks/terminal/ (`generated`; no instruction in both), or of
              tasks_dir's tasks (heldout_dir's held out, else a seeded split; no
              demonstrations for them), and the partly wrong SFT demonstrations
  producer    `episodes.TerminalProducer` in a `sandbox.terminal.Harness` (warm task
              containers, the agent's bash calls in each episode's persistent shell, reward
              from the task's own tests); beside other environments the closed loop packs its
              episodes with theirs in one batch (`rollout.mixed.MixedProducer`)
  evaluate    the held-out pass rates (greedy, and sampled with eval.sample), plus the
              greedy rate on the tasks whose path has a folder (where the demonstrations
              are wrong)

Episodes take the closed loop's rollout.max_turns, max_tool_output_chars and tool_timeout_s,
the sampling section's samples and temperature, data.max_prompt_len; the environment's args
hold their own cap (max_len, 0: rollout.max_len; the DAPO overlong penalty measures them
against it, `Batch.max_len_b`) and the harness's settings. It has no retries with feedback
(rollout.max_attempts must be 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import types

import jax
import numpy as np

from ptrain import chat
from ptrain import sharding
from ptrain.envs import base
from ptrain.envs.terminal import agent as terminal_agent
from ptrain.envs.terminal import episodes as terminal_episodes
from ptrain.envs.terminal import generated as terminal_tasks

log = logging.getLogger("ptrain")
BACKENDS = ("docker", "bwrap")


@dataclasses.dataclass(frozen=True)
class Listed:
    """A task of a directory (tasks_dir), as the environment keeps its tasks."""
    task_dir: str
    instruction: str
    triggered: bool = False  # (generated tasks: the demonstrations' mistake applies)
    domain: str = "terminal"

    @property
    def id(self) -> str:
        return self.task_dir

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
    max_len: int = 0
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
    a seeded split of tasks_dir); max_len (tokens after the prompt of an episode; 0:
    rollout.max_len); threads (episodes opened, stepped and verified at once); max_idle
    (warm task containers kept); image_map (("FROM=LOCAL", ...) for task images not on this
    machine); system (the agent's system prompt; "": the instruction alone); backend
    ("docker", or "bwrap": tasks that need only files)."""
    unknown = set(args) - {f.name for f in dataclasses.fields(Settings)}
    if unknown:
        raise ValueError(f"terminal environment: unknown args {sorted(unknown)}; known: "
                         f"{[f.name for f in dataclasses.fields(Settings)]}")
    s = Settings(**{**args, "image_map": tuple(args.get("image_map", ()))})
    for ok, what in (
            (s.threads >= 1 and s.max_idle >= 0, "threads must be >= 1 and max_idle >= 0"),
            (s.backend in BACKENDS, f"backend={s.backend!r} must be one of {BACKENDS}"),
            (not s.heldout_dir or s.tasks_dir, "heldout_dir needs tasks_dir (the training "
             "tasks' directory)"),
            (s.max_len >= 0, "max_len must be >= 0 (0: rollout.max_len)")):
        if not ok:
            raise ValueError(f"terminal environment: {what}")
    return base.Environment(
        name="terminal", tasks=lambda ctx: make_tasks(s, ctx), turns=base.TurnPolicy(
            retries=False), tokenizer=terminal_tasks.tokenizer,
        prompt_ids=lambda task, tokenizer, fmt: terminal_agent.render_prompt(
            fmt, tokenizer, task.instruction, s.system),
        producer=lambda config, sampler, tokenizer, heldout: producer(
            s, config, sampler, tokenizer, heldout),
        evaluate=evaluate)


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


def _load(path: str, backend: str) -> list[Listed]:
    """The tasks of a directory (every skipped one named, with why); on bwrap, one that
    needs its Dockerfile's image is an error here, before anything trains."""
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
                terminal.bwrap.plan(task)
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
    tasks = _load(s.tasks_dir, s.backend)
    if s.heldout_dir:
        train, heldout = tasks, _load(s.heldout_dir, s.backend)
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


def rollout_config(s: Settings, config, **changes) -> terminal_episodes.TerminalRolloutConfig:
    """The closed-loop config's terminal episode settings."""
    r, sampling = config.rollout, config.sampling
    fields = dict(num_samples=sampling.num_samples, max_new_tokens=sampling.max_new_tokens,
                  max_turns=r.max_turns, max_len=s.max_len or r.max_len,
                  max_output_chars=r.max_tool_output_chars, call_timeout_s=r.tool_timeout_s,
                  temperature=sampling.temperature, threads=s.threads, system=s.system)
    fields.update(changes)
    return terminal_episodes.TerminalRolloutConfig(**fields)


@contextlib.contextmanager
def producer(s: Settings, config, sampler, tokenizer, heldout):
    """A `TerminalProducer` in its harness (closed on leaving), warm containers started for
    one batch when it steps episodes in threads."""
    from sandbox import terminal
    rollout = rollout_config(s, config)  # its caps checked before the harness starts
    with terminal.Harness(image_map=terminal.parse_image_map(list(s.image_map)),
                          max_idle=s.max_idle, backend=s.backend,
                          call_timeout_s=config.rollout.tool_timeout_s) as harness:
        out = terminal_episodes.TerminalProducer(
            sampler, tokenizer, harness=harness, fmt=chat.FORMATS[config.rollout.chat_format],
            stop_ids=tuple(config.sampling.stop_token_ids), config=rollout,
            prompt_len=config.data.max_prompt_len, pad_id=tokenizer.pad_token_id)
        try:
            if s.threads > 1 and heldout:
                harness.warm(terminal.load_task(heldout[0].task_dir),
                             min(s.max_idle,
                                 config.data.prompts_per_step * config.sampling.num_samples))
            yield out
        finally:
            out.close()


def evaluate(producer_, params, heldout, *, seed: int, num_samples: int, greedy: bool,
             summarize):
    """An eval line's fields for the held-out tasks: `summarize(episodes, num_samples)` (the
    closed loop's pass@1 / pass@k summary) of `num_samples` episodes per task, plus
    `pass_rate_with_folder` (the tasks whose path has a folder) and `errors` (episodes the
    harness could not run). With many processes each runs its block of the tasks (one
    sampler call over all of them per turn) and the fields are of every process's episodes."""
    c = dataclasses.replace(producer_.config, num_samples=num_samples, greedy=greedy)
    mesh = getattr(producer_.sampler, "mesh", None)
    block, blocks = sharding.row_block(mesh)
    first, end = len(heldout) * block // blocks, len(heldout) * (block + 1) // blocks
    rollouts = producer_.evaluate(params, [g.task_dir for g in heldout[first:end]],
                                  jax.random.key(seed), config=c)
    mine = [(r.verdict, r.tokens.finish if r.tokens is not None else "error",
             terminal_episodes.passed(r), bool(r.error),
             heldout[first + i // num_samples].triggered) for i, r in enumerate(rollouts)]
    rows = [row for part in sharding.gather_blocks(mine, mesh) for row in part]
    episodes = [types.SimpleNamespace(verdicts=[v] if v is not None else [], finish=finish)
                for v, finish, *_ in rows]
    triggered = [passed for _, _, passed, _, folder in rows if folder]
    return {**summarize(episodes, num_samples),
            "pass_rate_with_folder": float(np.mean(triggered)) if triggered else None,
            "errors": sum(error for _, _, _, error, _ in rows)}
