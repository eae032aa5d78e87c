"""The one JSONL reader and writer of ptrain: one JSON object per line, gzip when the name
ends .gz (reading).

Metrics, rollouts, evaluations, task files, SFT records and code_eval's results all go
through here; a line that is not a JSON object is an error that names its file and line,
except a torn last line of a log that a crash cut short, which `truncate` removes.
bench/same_run.py reads through here too. sandbox/ and long_context/ import nothing of
ptrain (docs/architecture.md, "The house"), so sandbox/terminal/evaluate.py keeps its own
results.jsonl lines and long_context/niah.py its own niah.jsonl.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Iterable, Iterator


def records(path: str) -> Iterator[tuple[str, dict]]:
    """(where, record) per non-empty line ("file:line", the object)."""
    path = os.fspath(path)
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: a JSON {type(record).__name__}, not an object")
            yield where, record


def read(path: str) -> list[dict]:
    """The records of a JSONL file (none if it does not exist)."""
    if not os.path.exists(path):
        return []
    return [record for _, record in records(path)]


def write(rows: Iterable[dict], path: str) -> int:
    """Writes the records atomically (a temp file of this process renamed into place:
    processes writing the same file do not collide); returns how many."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    n, tmp = 0, f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def append(rows: Iterable[dict], path: str, *, default=None) -> None:
    """Appends the records to a log that grows (metrics, rollouts, eval.jsonl, results),
    written and closed at once, so a reader (or a crash) sees whole lines. default: for
    values json cannot encode (as json.dumps's)."""
    text = "".join(json.dumps(row, default=default) + "\n" for row in rows)
    with open(path, "a") as f:
        f.write(text)


def truncate(path: str, max_step: int) -> int:
    """Drops the records of a log whose "step" is > max_step (a resumed run rewrites them)
    and a torn last line; returns how many lines were dropped."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = f.read().splitlines()
    kept = []
    for lineno, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):  # the crash cut the last write short
                logging.warning("%s:%d: removing a torn last line", path, lineno)
                continue
            raise ValueError(f"{path}:{lineno}: not valid JSON; fix or remove the line") from None
        if record["step"] <= max_step:
            kept.append(line)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)
