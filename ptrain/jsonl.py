"""The one JSONL reader and writer: one JSON object per line, gzip when the name ends .gz.

Metrics, rollouts, evaluations, task files and SFT records all go through here; a line that
is not a JSON object is an error that names its file and line.
"""

from __future__ import annotations

import gzip
import json
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
    """Writes the records atomically (a temp file renamed into place); returns how many."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    n, tmp = 0, path + ".tmp"
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def append(rows: Iterable[dict], path: str) -> None:
    """Appends the records to a log that grows, like eval.jsonl: the file is rewritten whole
    and renamed into place (`write`), so a crash mid-write never tears a finished line."""
    write(read(path) + list(rows), path)
