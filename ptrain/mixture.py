"""The RL step's adaptive draw over a mixture's environments (tasks.adaptive enabled: a mode
other than "off", or a task filter): each step's prompts are drawn per environment by
`envs.adaptive.Adaptive`'s probabilities, which follow the verdicts of the steps before.

    draw = AdaptiveDraw([(code_tasks, 1.0), (math_tasks, 2.0)], section=config.tasks.adaptive,
                        batch_size=8, seed=0, lag=config.rl.staleness)
    draw.at(step); records = next(draw)        # this process's block of the step's prompts
    draw.observe(step, episodes)               # the step's (global) Batch: its verdicts
    draw.metrics()                             # tasks/weight/<env>, tasks/skipped

Each source is one environment, named by its records' `domain` (a `ptrain.tasks.Task`'s
attribute or a record's key). Each environment is its own stream: its records in an order
shuffled anew each epoch (a permutation seeded by (seed, its index, the epoch)), read at its
own position. A
step draws the environment of each of the global batch's prompts (`Adaptive.draw`), then the
next record of that environment's stream, passing over the tasks the `TaskFilter` skips (an
environment whose every task is skipped is read as if unfiltered). Every process draws the
whole global batch alike (the sampler's RNG, the positions and the observations are the same
on every process: the observations come from the global batch) and takes its block of
`batch_size` rows (`sharding.row_block`), the contract of `data.prompt_batches`.

Observations. `observe(step, episodes)` records, per environment, the pass rate of each group
of rows (a prompt's samples; a row passes by its meta's `passed`, else by its reward clipped
to [0, 1]) and, per task (`<domain>/<task_id>`), the group's pass rate for the filter. The
draw of the batch of step s applies the observations of steps <= s - 1 - lag (lag:
rl.staleness, the batch of step s being drawn at step s - lag, when those are the ones made),
so that where a draw happens (generation thread, a resumed run's first batches) does not
change what it draws.

Exact resume. `get_state()` is JSON: the positions, the sampler's and the filter's states
(weights' EMAs, counts, the RNG) and the observations not yet applied. A checkpoint saves
`complete(state)`: a state taken when a batch was drawn (the learner's data_state, taken
before the pending batches with staleness) with the observations made since, so that a
resumed run applies them at the same draws as the uninterrupted one.
"""

from __future__ import annotations

import os

import numpy as np

from ptrain import data as data_lib
from ptrain.envs import adaptive as adaptive_lib


def enabled(section) -> bool:
    """Whether a tasks.adaptive section asks for the adaptive draw (None: no section)."""
    return section is not None and (section.mode != "off" or section.filter_patience > 0)


def _domain(record):
    return record.get("domain") if isinstance(record, dict) else getattr(record, "domain", None)


def _task_id(record):
    """The id a row's meta names its task by (`task_id`): a record's `id`, a `Task`'s `id`, a
    terminal task's `name`; None: the task filter does not apply to it."""
    if isinstance(record, dict):
        value = record.get("id", record.get("task_id"))
    else:
        value = getattr(record, "id", None) or getattr(record, "name", None)
    return None if value is None else str(value)


class AdaptiveDraw:
    """The step's prompts drawn per environment (see the module docstring); an iterator of
    this process's blocks with `get_state` / `set_state`, as the learner uses grain's."""

    def __init__(self, sources, *, section, batch_size: int, seed: int, lag: int = 0,
                 on_error: str = "raise", process_index: int = 0, process_count: int = 1):
        specs = [tuple(s) if not isinstance(s, (str, os.PathLike)) else (s, 1.0)
                 for s in sources]
        if not specs:
            raise ValueError("tasks.adaptive: no prompt sources (one per environment)")
        opened = [data_lib.RecordSource(p, on_error=on_error)
                  if isinstance(p, (str, os.PathLike)) else data_lib.InMemory(p, f"source {i}")
                  for i, (p, _) in enumerate(specs)]
        names = []
        for source in opened:
            if len(source) == 0:
                raise ValueError(f"{source.path}: no usable records")
            domains = {_domain(source[j]) for j in range(len(source))}
            if len(domains) != 1 or None in domains:
                raise ValueError(f"tasks.adaptive: each prompt source is one environment, its "
                                 f"records of one `domain`; {source.path} has "
                                 f"{sorted(map(str, domains))}")
            names.append(domains.pop())
        self.adaptive, self.filter = adaptive_lib.from_config(
            names, [float(w) for _, w in specs], section, seed)
        self.names, self._index = tuple(names), {n: i for i, n in enumerate(names)}
        self._sources, self._sizes, self.seed = opened, [len(s) for s in opened], int(seed)
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # env -> (epoch, permutation)
        self.batch_size, self.lag = int(batch_size), int(lag)
        self.process_index, self.process_count = int(process_index), int(process_count)
        self._pos = [0] * len(opened)
        self._pending: dict[int, dict] = {}  # step -> observation, not yet applied
        self._log: dict[int, dict] = {}  # step -> observation, the recent ones (`complete`)
        self._applied = 0  # the observations of steps <= this are applied
        self._step = 1  # the step whose batch the next draw is
        self._probabilities = self.adaptive.probabilities()  # of the last draw

    # ------------------------------------------------------------------ the draw
    def at(self, step: int) -> None:
        """The next draws are the batch of `step`."""
        self._step = int(step)

    def __iter__(self):
        return self

    def __next__(self) -> list:
        self._apply(self._step - 1 - self.lag)
        self._probabilities = self.adaptive.probabilities()
        chosen = self.adaptive.draw(self.batch_size * self.process_count)
        records = [self._take(self._index[name]) for name in chosen]
        start = self.process_index * self.batch_size
        return records[start:start + self.batch_size]

    def _take(self, i: int):
        for _ in range(self._sizes[i]):
            record = self._record(i, self._pos[i])
            self._pos[i] += 1
            if self.filter is None or self._keep(i, record):
                return record
        return record  # every task of the environment is skipped: read as if unfiltered

    def _record(self, i: int, position: int):
        epoch, j = divmod(position, self._sizes[i])
        order = self._orders.get(i)
        if order is None or order[0] != epoch:
            order = self._orders[i] = (epoch, np.random.default_rng(
                [self.seed, i, epoch]).permutation(self._sizes[i]))
        return self._sources[i][int(order[1][j])]

    def _keep(self, i, record) -> bool:
        task = _task_id(record)
        return task is None or self.filter.keep(f"{self.names[i]}/{task}")

    # ------------------------------------------------------------------ observations
    def observe(self, step: int, batches) -> None:
        """The verdicts of step `step`: its global `batch.Batch`, or the Batches of its
        producer calls (group ids unique across them, `batch.Collector.added`); rows' meta
        name their `domain`. Applied at the draws that follow, by the schedule."""
        groups: dict[tuple, list[float]] = {}
        batches = batches if isinstance(batches, (list, tuple)) else [batches]
        rows = [(episodes, i, meta) for episodes in batches for i, meta in enumerate(episodes.meta)]
        for episodes, i, meta in rows:
            domain = meta.get("domain")
            if domain is None:
                continue
            if domain not in self._index:
                raise ValueError(f"tasks.adaptive: a row of step {step} has domain "
                                 f"{domain!r}, not one of the mixture's {list(self.names[:5])}...")
            passed = (float(meta["passed"]) if "passed" in meta
                      else min(max(float(episodes.rewards_b[i]), 0.0), 1.0))
            key = (domain, meta.get("task_id"), int(episodes.group_ids_b[i]))
            groups.setdefault(key, []).append(passed)
        envs: dict[str, list[float]] = {}
        tasks: list[tuple[str, float]] = []
        for (domain, task, _), values in sorted(groups.items(), key=lambda kv: str(kv[0])):
            rate = float(np.mean(values))
            envs.setdefault(domain, []).append(rate)
            if task is not None:
                tasks.append((f"{domain}/{task}", rate))
        self._pending[int(step)] = self._log[int(step)] = {"envs": envs, "tasks": tasks}
        for old in [s for s in self._log if s < step - 2 * (self.lag + 1) - 2]:
            del self._log[old]

    def _apply(self, upto: int) -> None:
        for step in sorted(s for s in self._pending if s <= upto):
            observation = self._pending.pop(step)
            for name, rates in observation["envs"].items():
                self.adaptive.observe(name, rates)
            if self.filter is not None:
                for key, rate in observation["tasks"]:
                    self.filter.observe(key, rate)
            self._applied = step

    def metrics(self) -> dict:
        """The last draw's probability of each environment (tasks/weight/<env>) and the
        tasks the filter skips now (tasks/skipped)."""
        out = {f"tasks/weight/{n}": float(p) for n, p in zip(self.names, self._probabilities)}
        if self.filter is not None:
            out["tasks/skipped"] = len(self.filter.skipped())
        return out

    # ------------------------------------------------------------------ state
    def iterator(self, state=None):
        """This draw, continued from `state` (`get_state`) if given (as `data.Prompts`)."""
        if state is not None:
            self.set_state(state)
        return self

    def get_state(self) -> dict:
        return {"positions": list(self._pos), "adaptive": self.adaptive.state(),
                "filter": None if self.filter is None else self.filter.state(),
                "applied": self._applied,
                "pending": {str(s): o for s, o in sorted(self._pending.items())}}

    def complete(self, state: dict) -> dict:
        """`state` (from `get_state`, taken at a draw) with every observation made since,
        for a checkpoint (see the module docstring)."""
        since = sorted(s for s in self._log if s > state["applied"])
        return {**state, "pending": {str(s): self._log[s] for s in since}}

    def set_state(self, state: dict) -> None:
        if len(state["positions"]) != len(self._pos):
            raise ValueError(f"tasks.adaptive: the checkpoint's draw has "
                             f"{len(state['positions'])} environments, this mixture "
                             f"{len(self._pos)}: resume with the same environments")
        self._pos = [int(p) for p in state["positions"]]
        self.adaptive.load(state["adaptive"])
        if (state["filter"] is None) != (self.filter is None):
            raise ValueError("tasks.adaptive.filter_patience: the checkpoint's run "
                             f"{'had no' if state['filter'] is None else 'had a'} task filter; "
                             "resume with the same setting")
        if self.filter is not None:
            self.filter.load(state["filter"])
        self._applied = int(state["applied"])
        self._pending = {int(s): o for s, o in state["pending"].items()}
        self._log = dict(self._pending)
