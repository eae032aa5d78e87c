"""A run's inputs on disk, checked with its config before anything is built: each file a key
names exists and holds a record, each directory exists, and the work dir is a directory (or
not there yet). Every error names the key (or flag) and what to do.

  check(config, workdir)   raises a ValueError for the first input that is not there
"""

from __future__ import annotations

import gzip
import os

# The args of an environment entry (tasks.envs[i].args) that name files or directories: the
# built-in environments' (task files: train / heldout; terminal: tasks_dir / heldout_dir).
FILE_ARGS = ("train", "heldout")
DIR_ARGS = ("tasks_dir", "heldout_dir")


def check(config, workdir) -> None:
    """The work dir, then hf_model / tokenizer, then the task, prompt and SFT files."""
    check_workdir(workdir)
    for key in ("hf_model", "tokenizer"):
        path = config.get(key)
        if path and not os.path.isdir(path):
            raise ValueError(f"config: {key}={path!r} is not a directory{_cwd(path)}; set "
                             f"{key} to a local Hugging Face directory (config.json, "
                             "tokenizer files)")
    _check_sources(config)
    for key, path in _files(config):
        _check_file(key, path)
    for key, path in _dirs(config):
        if not os.path.isdir(path):
            raise ValueError(f"config: {key}={path!r} is not a directory{_cwd(path)}; set "
                             f"{_flag(key)} to a directory of tasks")


def check_workdir(workdir) -> None:
    """The work dir is a directory, or nothing yet (it is made)."""
    workdir = os.fspath(workdir)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir={workdir!r} is a file, not a directory: give a new "
                         "directory (or that of the run to resume)")


def _check_sources(config) -> None:
    """SFT steps need SFT records (in the closed loop its environments may bring
    demonstrations: checked when their tasks are made), and the learner alone needs prompts
    (the closed loop's come from its environments)."""
    loop = "tasks" in config
    sc = config.sft
    if sc.steps and not loop and not sc.sources and sc.records_fn is None:
        raise ValueError(f"config: sft.steps={sc.steps} but no SFT records: set sft.sources "
                         "(JSONL of prompt/completion, e.g. from launch/sft_data.py) or "
                         "sft.records_fn, or sft.steps=0")
    d = config.data
    if not loop and config.steps and not d.sources and d.records_fn is None:
        raise ValueError(f"config: steps={config.steps} but no prompts: set data.sources "
                         "(JSONL / ArrayRecord files) or data.records_fn")


def _flag(key) -> str:
    """Where a key is set: --config.KEY, or an environment's args in tasks.envs."""
    return ("the environment's args in --config.tasks.envs (or the config file)"
            if key.startswith("tasks.envs[") else f"--config.{key.split('[')[0]}")


def _cwd(path) -> str:
    return "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"


def _path(entry):
    """A source entry's path: a path, or (path, weight) / (path, format)."""
    return entry[0] if isinstance(entry, (tuple, list)) else entry


def _files(config):
    """(key, path) of each file the config names."""
    out = [(f"data.sources[{i}]", _path(e)) for i, e in enumerate(config.data.sources)
           if isinstance(_path(e), str)]
    if config.sft.steps:
        out += [(f"sft.sources[{i}]", _path(e)) for i, e in enumerate(config.sft.sources)
                if isinstance(_path(e), str)]
    return out + _env_args(config, FILE_ARGS)


def _dirs(config):
    return _env_args(config, DIR_ARGS)


def _env_args(config, names):
    """(key, path) of each environment entry's arg in `names` that names a path."""
    if "tasks" not in config:
        return []
    out = []
    for i, entry in enumerate(config.tasks.envs):
        args = (entry.get("args") or {}) if hasattr(entry, "get") else {}
        for name in names:
            path = _path(args.get(name)) if args.get(name) else None
            if isinstance(path, str):
                out.append((f"tasks.envs[{i}].args.{name}", path))
    return out


def _check_file(key, path) -> None:
    if not os.path.exists(path):
        raise ValueError(f"config: {key}: {path!r} does not exist{_cwd(path)}; put the file "
                         f"there or set {_flag(key)} to where it is")
    if os.path.isdir(path):
        raise ValueError(f"config: {key}: {path!r} is a directory; give a file")
    if os.path.getsize(path) == 0 or (_is_text(path) and not _has_line(path)):
        raise ValueError(f"config: {key}: {path!r} is empty (no record); give a file with "
                         "at least one")


def _is_text(path) -> bool:
    return path.endswith((".jsonl", ".jsonl.gz", ".json", ".gz"))


def _has_line(path) -> bool:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return any(line.strip() for line in f)
