"""A run's inputs on disk, checked with its config before anything is built: each file a key
names exists and holds a record, each directory exists, and the work dir is a directory (or
not there yet). Every error names the key (or flag) and what to do.

  check(config, workdir)   raises a ValueError for the first input that is not there
"""

from __future__ import annotations

import gzip
import os

TERMINAL = "terminal"  # (ptrain.config.TERMINAL: the terminal domain)


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
                             f"--config.{key} to a directory of tasks")


def check_workdir(workdir) -> None:
    """The work dir is a directory, or nothing yet (it is made)."""
    workdir = os.fspath(workdir)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"--workdir={workdir!r} is a file, not a directory: give a new "
                         "directory (or that of the run to resume)")


def _check_sources(config) -> None:
    """SFT steps need SFT records (the closed loop's generated tasks bring their own), and the
    learner alone needs prompts (the closed loop's come from its tasks)."""
    loop = "tasks" in config
    own_demos = loop and config.tasks.source == "synthetic"
    sc = config.sft
    if sc.steps and not own_demos and not sc.sources and sc.records_fn is None:
        raise ValueError(f"config: sft.steps={sc.steps} but no SFT records: set sft.sources "
                         "(JSONL of prompt/completion, e.g. from launch/sft_data.py) or "
                         "sft.records_fn, or sft.steps=0")
    d = config.data
    if not loop and config.steps and not d.sources and d.records_fn is None:
        raise ValueError(f"config: steps={config.steps} but no prompts: set data.sources "
                         "(JSONL / ArrayRecord files) or data.records_fn")


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
    if "tasks" in config and config.tasks.source == "jsonl":
        for split in ("train", "heldout"):
            out += [(f"tasks.{split}[{i}]", _path(e))
                    for i, e in enumerate(config.tasks[split]) if isinstance(_path(e), str)]
    return out


def _dirs(config):
    if "tasks" not in config or TERMINAL not in config.tasks.domains:
        return []
    return [(f"terminal.{k}", config.terminal[k]) for k in ("tasks_dir", "heldout_dir")
            if config.terminal[k]]


def _check_file(key, path) -> None:
    if not os.path.exists(path):
        raise ValueError(f"config: {key}: {path!r} does not exist{_cwd(path)}; put the file "
                         f"there or set --config.{key.split('[')[0]} to where it is")
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
