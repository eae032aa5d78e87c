"""The closed loop's "terminal" domain: generated Harbor tasks, or a directory of Harbor /
Terminal-Bench tasks (terminal.tasks_dir), run in docker (or bwrap: terminal.backend).

    python -m launch.train --config=configs/terminal_toy.py --workdir=runs/terminal_toy

With "terminal" in `tasks.domains` (`ptrain.config`), `closed_loop.run` takes its parts here:

  make_tasks  a training and a held-out split of Harbor task directories under
              <workdir>/tasks/terminal/ (`ptrain.terminal_tasks`; no instruction in both),
              or of terminal.tasks_dir's tasks (terminal.heldout_dir's held out, else a
              seeded split; no demonstrations for them),
              the RL records ({"task_dir": ..., "domain": "terminal"}) in
              <workdir>/tasks/terminal.{train,heldout}.jsonl, weighted among the other
              domains' by tasks.weights, and the partly wrong SFT demonstrations
  producer    `terminal_rollout.TerminalProducer` in a `sandbox.terminal.Harness` (warm
              task containers, the agent's bash calls in each episode's persistent shell,
              reward from the task's own tests); beside other domains the closed loop packs
              its episodes with theirs in one batch (`mixed_producer.MixedProducer`)
  evaluate    the held-out pass rates (greedy, and sampled with eval.sample), plus the
              greedy rate on the tasks whose path has a folder (where the demonstrations
              are wrong)

Episodes take the closed loop's rollout.max_turns, max_tool_output_chars and tool_timeout_s,
the sampling section's samples and temperature, data.max_prompt_len; the `terminal` section
holds their own cap (terminal.max_len, 0: rollout.max_len; the DAPO overlong penalty measures
them against it, `Batch.max_len_b`) and the harness's keys.
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
from ptrain import jsonl
from ptrain import sharding
from ptrain import terminal_agent
from ptrain import terminal_rollout
from ptrain import terminal_tasks

DOMAIN = "terminal"
log = logging.getLogger("ptrain")


@dataclasses.dataclass(frozen=True)
class Listed:
    """A task of a directory (terminal.tasks_dir), as the domain keeps its tasks."""
    task_dir: str
    instruction: str
    triggered: bool = False  # (generated tasks: the demonstrations' mistake applies)


def make_tasks(config, tokenizer, workdir, *, train_file: str, heldout_file: str):
    """(train, heldout) task lists (`terminal_tasks.Generated`, or `Listed` from
    terminal.tasks_dir) and the SFT demonstration records (generated tasks only; in the
    training tasks' order: the caller shuffles them with the other domains')."""
    t, root = config.tasks, os.path.join(workdir, "tasks", DOMAIN)
    if config.terminal.tasks_dir:
        train, heldout = from_directory(config)
        demos = []
    else:
        heldout = terminal_tasks.generate(root, t.n_heldout, seed=config.seed,
                                          split="heldout")
        train = terminal_tasks.generate(root, t.n_train, seed=config.seed, split="train",
                                        exclude={g.instruction for g in heldout})
        rng = random.Random(f"{config.seed}/terminal/demos")
        demos = [terminal_tasks.demo_record(g, tokenizer, *terminal_tasks.demonstration(
            g, rng, t.bug_rate), system=config.terminal.system) for g in train]
    for found, path in ((train, train_file), (heldout, heldout_file)):
        jsonl.write([{"task_dir": g.task_dir, "domain": DOMAIN} for g in found], path)
    return train, heldout, demos


def _load(path: str, backend: str, image_map=()) -> list[Listed]:
    """The tasks of a directory (every skipped one named, with why); on bwrap, one that
    needs its Dockerfile's image (after terminal.image_map, as launch.eval maps it) is an
    error here, before anything trains."""
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


def from_directory(config) -> tuple[list[Listed], list[Listed]]:
    """(train, heldout) from terminal.tasks_dir: heldout_dir's tasks, or a seeded split of
    tasks_dir holding out tasks.n_heldout of them (at most half); no instruction in both."""
    d = config.terminal
    tasks = _load(d.tasks_dir, d.backend, d.image_map)
    if d.heldout_dir:
        train, heldout = tasks, _load(d.heldout_dir, d.backend, d.image_map)
    else:
        order = sorted(tasks, key=lambda x: x.task_dir)
        random.Random(f"{config.seed}/terminal/split").shuffle(order)
        n = min(config.tasks.n_heldout, len(order) // 2)
        heldout, train = order[:n], order[n:]
    both = {x.instruction for x in train} & {x.instruction for x in heldout}
    if both:
        raise ValueError(f"terminal: {len(both)} held-out instruction(s) are also training "
                         f"tasks', e.g. {sorted(both)[0][:80]!r}")
    return train, heldout


def prompt_lengths(config, tokenizer, generated) -> dict[str, int]:
    """Each task's prompt length in tokens, by task directory."""
    fmt = chat.FORMATS[config.rollout.chat_format]
    return {g.task_dir: len(terminal_agent.render_prompt(fmt, tokenizer, g.instruction,
                                                         config.terminal.system))
            for g in generated}


def rollout_config(config, **changes) -> terminal_rollout.TerminalRolloutConfig:
    """The closed-loop config's terminal episode settings."""
    r, s = config.rollout, config.sampling
    fields = dict(num_samples=s.num_samples, max_new_tokens=s.max_new_tokens,
                  max_turns=r.max_turns, max_len=config.terminal.max_len or r.max_len,
                  max_output_chars=r.max_tool_output_chars, call_timeout_s=r.tool_timeout_s,
                  temperature=s.temperature, threads=config.terminal.threads,
                  system=config.terminal.system)
    fields.update(changes)
    return terminal_rollout.TerminalRolloutConfig(**fields)


@contextlib.contextmanager
def producer(config, sampler, tokenizer, heldout):
    """A `TerminalProducer` in its harness (closed on leaving), warm containers started for
    one batch when it steps episodes in threads."""
    from sandbox import terminal
    t = config.terminal
    with terminal.Harness(image_map=terminal.parse_image_map(list(t.image_map)),
                          max_idle=t.max_idle, backend=t.backend,
                          call_timeout_s=config.rollout.tool_timeout_s) as harness:
        out = terminal_rollout.TerminalProducer(
            sampler, tokenizer, harness=harness, fmt=chat.FORMATS[config.rollout.chat_format],
            stop_ids=tuple(config.sampling.stop_token_ids), config=rollout_config(config),
            prompt_len=config.data.max_prompt_len, pad_id=tokenizer.pad_token_id)
        try:
            if t.threads > 1 and heldout:
                harness.warm(terminal.load_task(heldout[0].task_dir),
                             min(t.max_idle,
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
             terminal_rollout.passed(r), bool(r.error),
             heldout[first + i // num_samples].triggered) for i, r in enumerate(rollouts)]
    rows = [row for part in sharding.gather_blocks(mine, mesh) for row in part]
    episodes = [types.SimpleNamespace(verdicts=[v] if v is not None else [], finish=finish)
                for v, finish, *_ in rows]
    triggered = [passed for _, _, passed, _, folder in rows if folder]
    return {**summarize(episodes, num_samples),
            "pass_rate_with_folder": float(np.mean(triggered)) if triggered else None,
            "errors": sum(error for _, _, _, error, _ in rows)}
