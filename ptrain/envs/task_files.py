"""Environments of task files: a training and a held-out file in a format of
`ptrain.tasks.FORMATS` (ptrain's own records, HumanEval, MBPP, APPS, CodeContests, GSM8K,
MATH), judged by their built-in verifiers (`ptrain.rewards`).

    dict(env="ptrain.envs.code:mbpp", args=dict(train="mbpp.jsonl", heldout="mbpp_test.jsonl"))
"""

from __future__ import annotations

import dataclasses
import os

from ptrain import jsonl
from ptrain import rewards
from ptrain import tasks as tasks_lib
from ptrain.envs import base


def make(train, heldout, *, format: str = "ptrain", tools=(),
         name: str = "") -> base.Environment:
    """The tasks of `train` and `heldout`: paths of files in `format`, or (path, format)
    pairs; `tools`: the sandbox tools every task may call (e.g. ("python",)); (): each task's
    own. Named `name`, else after the format ("tasks" for ptrain records)."""
    if format not in tasks_lib.FORMATS:
        raise ValueError(f"format={format!r}: use one of {list(tasks_lib.FORMATS)}")
    name = name or ("tasks" if format == "ptrain" else format)

    def tasks(ctx: base.Context) -> base.Splits:
        found = [tasks_lib.load_entry(
            tuple(path) if isinstance(path, (tuple, list)) else (path, format),
            key=f"environment {ctx.name!r} args.{split}", domain=ctx.name)
            for split, path in (("train", train), ("heldout", heldout))]
        if tools:
            found = [[dataclasses.replace(x, tools=tuple(tools)) for x in f] for f in found]
        return base.Splits(*found)

    return base.Environment(name=name, tasks=tasks, verify=rewards.verify_all,
                            tools=base.sandbox_tools_named(*tasks_lib.TOOLS),
                            opens_session=rewards.needs_session)


def reader(format: str, name: str):
    """make() for one format, named `name` by default."""
    def made(train, heldout, *, tools=(), name: str = name) -> base.Environment:
        return make(train, heldout, format=format, tools=tools, name=name)
    made.__doc__ = f"{format} task files (`ptrain.tasks.from_{format}`) as an environment."
    return made


def parsed(path: str, parse, keys, what: str) -> list[dict]:
    """A brought JSONL task file's records, each of only `keys` (else an error naming
    `what`, e.g. "a CAD task") and `parse(record, "FILE:LINE", the file's directory)` -> a
    dict with an "id"; ids unique, at least one task (the CAD and chart task files)."""
    out, ids = [], set()
    base_dir = os.path.dirname(os.path.abspath(path))
    for where, record in jsonl.records(path):
        unknown = sorted(set(record) - set(keys))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; {what} has {list(keys)}")
        task = parse(record, where, base_dir)
        if task["id"] in ids:
            raise ValueError(f"{where}: task id {task['id']!r} appears more than once")
        ids.add(task["id"])
        out.append(task)
    if not out:
        raise ValueError(f"{path}: no tasks")
    return out
