"""Prompt datasets on grain: JSONL or ArrayRecord files (or records in memory, such as the
closed loop's `ptrain.tasks.Task`s), weighted mixtures, per-host shards.

Each record of a file is a JSON object (an ArrayRecord record holds one JSON object as UTF-8 bytes).
Files are checked once when opened: a record that is not a JSON object, or lacks a required
key, is reported as `file:line` (`file:record N` for ArrayRecord) and either raises (the
default) or is skipped, counted and logged (`on_error="skip"`); the count is in
`Prompts.metrics()`. Blank lines in JSONL are not records.

The stream is deterministic given the seed: each source is shuffled (reshuffled every epoch)
and repeated, the sources are interleaved by weight and grouped into global batches of
`n x batch_size` records, of which host `i` of `n` takes the i-th slice of `batch_size`: the
rows the mesh puts on its devices (`sharding.local_rows`), so n hosts together see the batches
one host would, in the same order (and a run on n hosts matches one on one host). The iterator's state is a
small JSON-able dict (`get_state` / `set_state`) from which iteration resumes exactly.
"""

import dataclasses
import json
import logging
import os
import threading

import grain
import numpy as np

ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")
# Prompts are small and consumed a batch per RL step: a short read-ahead is plenty.
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=2)


_OPEN_LOCK = threading.Lock()


class RecordSource:
    """Random access to the well-formed JSON-object records of one file (a grain data source)."""

    def __init__(self, path, *, on_error="raise", required_keys=()):
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error={on_error!r}; use 'raise' or 'skip'")
        self.path, self.required_keys = os.fspath(path), tuple(required_keys)
        self.malformed = []  # "file:line: reason", one per skipped record
        self._array_record = self.path.endswith(ARRAY_RECORD_SUFFIXES)
        self._reader = None
        spans = self._scan(on_error)
        self._spans = np.asarray(spans, np.int64).reshape(-1, 2)

    def _scan(self, on_error):
        """Parses every record once; returns (offset, length) per good JSONL line, or
        (record index, 0) per good ArrayRecord record."""
        spans = []
        for where, span, raw in self._raw_records():
            problem = self._problem(raw)
            if problem is None:
                spans.append(span)
                continue
            message = f"{self.path}:{where}: {problem}"
            if on_error == "raise":
                raise ValueError(f"{message}. Fix the record, or pass on_error='skip' to count, "
                                 "log and skip malformed records.")
            logging.warning("skipping malformed record %s", message)
            self.malformed.append(message)
        return spans

    def _raw_records(self):
        if self._array_record:
            source = grain.sources.ArrayRecordDataSource([self.path])
            for i in range(len(source)):
                yield f"record {i}", (i, 0), source[i]
            return
        offset = 0
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield f"{lineno}", (offset, len(line)), line
                offset += len(line)

    def _problem(self, raw):
        try:
            record = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return f"not valid JSON ({e})"
        if not isinstance(record, dict):
            return f"a JSON {type(record).__name__}, not an object"
        missing = [k for k in self.required_keys if k not in record]
        return f"missing required keys {missing}" if missing else None

    def __len__(self):
        return len(self._spans)

    def __getitem__(self, index):
        start, length = (int(x) for x in self._spans[index])
        if self._reader is None:
            with _OPEN_LOCK:  # grain reads in threads: one reader (a second would close the
                if self._reader is None:  # first's fd under a thread still using it)
                    self._reader = (grain.sources.ArrayRecordDataSource([self.path])
                                    if self._array_record else open(self.path, "rb"))
        if self._array_record:
            return json.loads(self._reader[start])
        return json.loads(os.pread(self._reader.fileno(), length, start))  # thread-safe

    def __getstate__(self):  # the reader is reopened where it is needed
        return {**self.__dict__, "_reader": None}

    def __repr__(self):
        return f"RecordSource({self.path!r}, {len(self)} records, {len(self.malformed)} bad)"


class InMemory:
    """Records already in memory (dicts, or objects such as `ptrain.tasks.Task`), served as
    they are (a grain data source, in `RecordSource`'s place: nothing to parse or skip)."""

    def __init__(self, records, name):
        self.records, self.path, self.malformed = list(records), name, []

    def __len__(self):
        return len(self.records)

    def __getitem__(self, index):
        return self.records[index]

    def __repr__(self):
        return f"InMemory({self.path!r}, {len(self)} records)"


@dataclasses.dataclass(frozen=True)
class Prompts:
    """A prompt stream: `dataset` yields lists of `batch_size` records (this host's share)."""

    dataset: grain.MapDataset
    sources: tuple
    weights: tuple

    @property
    def num_malformed(self):
        return sum(len(s.malformed) for s in self.sources)

    def metrics(self):
        return {"data/records": sum(len(s) for s in self.sources),
                "data/malformed": self.num_malformed}

    def iterator(self, state=None):
        """A grain iterator over batches; `state` (from `get_state()`) resumes exactly."""
        it = iter(self.dataset.to_iter_dataset(READ_OPTIONS))
        if state is not None:
            it.set_state(state)
        return it


def prompt_batches(sources, *, batch_size, seed, num_epochs=None, shuffle=True,
                   on_error="raise", required_keys=(), process_index=None, process_count=None):
    """Builds the prompt stream of this host (`batch_size`: its share of a global batch).

    sources: paths, or (path, weight) pairs, or (records, weight) pairs with `records` a list
      in memory (served as they are: dicts, or e.g. `ptrain.tasks.Task`s); weights are
      relative sampling rates. A list in memory streams exactly as the file written from it
      would (the same shuffles, mixture and iterator state).
    num_epochs: None repeats forever; k stops when a source runs out after k passes.
    process_index / process_count: this host's shard (default: jax.process_index/count).
    Returns `Prompts`.
    """
    specs = [(s, 1.0) if isinstance(s, (str, os.PathLike)) else tuple(s) for s in sources]
    if not specs:
        raise ValueError("no prompt sources given")
    if any(w <= 0 for _, w in specs):
        raise ValueError(f"mixture weights must be positive; got {[w for _, w in specs]}")
    if process_index is None or process_count is None:
        import jax  # only for the default shard
        process_index, process_count = jax.process_index(), jax.process_count()
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, {process_count})")
    opened = tuple(RecordSource(p, on_error=on_error, required_keys=required_keys)
                   if isinstance(p, (str, os.PathLike)) else InMemory(p, f"source {i}")
                   for i, (p, _) in enumerate(specs))
    parts = []
    for i, source in enumerate(opened):
        if len(source) == 0:
            raise ValueError(f"{source.path}: no usable records")
        ds = grain.MapDataset.source(source)
        if shuffle:
            ds = ds.shuffle(seed=seed + i)
        parts.append(ds.repeat(num_epochs))
    weights = tuple(float(w) for _, w in specs)
    ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)
    # Slices of batch_size, host i taking slice i of every global batch of n slices: each host
    # reads only its own records. Whole global batches only, so every host has as many.
    ds = ds.batch(batch_size, drop_remainder=True, batch_fn=list)
    if process_count > 1:
        if num_epochs is not None:
            ds = ds[:len(ds) // process_count * process_count]
        ds = ds[process_index::process_count]
    return Prompts(dataset=ds, sources=opened, weights=weights)


def record_ids(record, ids_key, text_key, tokenizer=None) -> list[int]:
    """Token ids of a record's field: `ids_key` (ids), or `text_key` encoded by `tokenizer`."""
    if ids_key in record:
        return [int(t) for t in record[ids_key]]
    if tokenizer is None or text_key not in record:
        raise ValueError(f"record {short(record)} has no {ids_key!r}; give token ids, or "
                         f"{text_key!r} text and config.tokenizer")
    return list(tokenizer.encode(record[text_key]))


def short(record, n=80) -> str:
    """A record as JSON, cut to about n characters (for error messages)."""
    text = json.dumps(record, default=str)
    return text if len(text) <= n else text[:n] + "...}"
