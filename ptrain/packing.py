"""Packed documents: token sequences back to back in rows of `seq_len` tokens.

  pack          documents (token ids, loss weight per token) -> tokens, segment ids and
                weights [rows, seq_len], in order, each document whole in one row
  packed_batch  the host batch of `ptrain.step.packed_update` from packed rows: positions
                restart per document, targets are the next token of the same document
  Packer        packed SFT's stream: (prompt, completion) records from a `ptrain.data`
                batch iterator packed into rows step after step; nothing is dropped (a
                record that does not fit waits for the next step) and `get_state()` resumes
                exactly

Segment id 0 is padding; a token attends only to earlier tokens of its own segment
(`ptrain.model`), so a packed document sees what it would see alone.
"""

from __future__ import annotations

import copy

import numpy as np

import long_context

BATCH_KEYS = ("tokens_bt", "positions_bt", "segment_ids_bt", "targets_bt", "loss_mask_bt")


def pack(docs, *, rows: int, seq_len: int):
    """Places documents ((ids, weights) pairs) in order, each whole in the current row or, if
    it does not fit there, at the start of the next. Returns (tokens_bt, segment_ids_bt,
    weights_bt, n): n documents placed (the rest did not fit in `rows` rows)."""
    tokens_bt = np.zeros((rows, seq_len), np.int32)
    seg_bt = np.zeros((rows, seq_len), np.int32)
    weights_bt = np.zeros((rows, seq_len), np.float32)
    row, col, n = 0, 0, 0
    for ids, weights in docs:
        if len(ids) > seq_len:
            raise ValueError(f"a document of {len(ids)} tokens does not fit a packed row of "
                             f"{seq_len}")
        if col + len(ids) > seq_len:
            row, col = row + 1, 0
        if row == rows:
            break
        tokens_bt[row, col:col + len(ids)] = ids
        seg_bt[row, col:col + len(ids)] = seg_bt[row, col - 1] + 1 if col else 1
        weights_bt[row, col:col + len(ids)] = weights
        col, n = col + len(ids), n + 1
    return tokens_bt, seg_bt, weights_bt, n


def packed_batch(tokens_bt, segment_ids_bt, weights_bt=None, *, layout="contiguous", shards=1):
    """The host batch of `step.packed_update` from packed documents (segment id 0: padding).

    Positions restart at each document; the target of a token is the next token of its
    document, and the loss mask is 1 where that target's weight is (default: every token of
    a document is a target, so the mask is 0 at a document's last token and on padding).
    The arrays are then put in `layout` over `shards` sequence shards; positions travel with
    the tokens.
    """
    tokens_bt, seg_bt = np.asarray(tokens_bt, np.int32), np.asarray(segment_ids_bt, np.int32)
    if tokens_bt.shape != seg_bt.shape or tokens_bt.ndim != 2:
        raise ValueError(f"tokens {tokens_bt.shape} and segment ids {seg_bt.shape} must be "
                         "the same [batch, time] shape")
    weights_bt = seg_bt > 0 if weights_bt is None else np.asarray(weights_bt) > 0
    t = tokens_bt.shape[1]
    idx_bt = np.broadcast_to(np.arange(t), tokens_bt.shape)
    new_doc_bt = np.ones(tokens_bt.shape, bool)
    new_doc_bt[:, 1:] = seg_bt[:, 1:] != seg_bt[:, :-1]
    positions_bt = idx_bt - np.maximum.accumulate(np.where(new_doc_bt, idx_bt, 0), axis=1)
    target_bt = np.zeros(tokens_bt.shape, bool)  # the next token is a target of this document
    target_bt[:, :-1] = (seg_bt[:, 1:] == seg_bt[:, :-1]) & weights_bt[:, 1:]
    batch = {"tokens_bt": tokens_bt, "positions_bt": positions_bt.astype(np.int32),
             "segment_ids_bt": seg_bt, "targets_bt": np.roll(tokens_bt, -1, axis=1),
             "loss_mask_bt": ((seg_bt > 0) & target_bt).astype(np.float32)}
    return {k: long_context.reorder(x, layout, shards, axis=1) for k, x in batch.items()}


class Packer:
    """Rows of packed documents drawn from a stream of record batches (`ptrain.data`'s
    `Prompts`), `rows` x `seq_len` tokens a step.

    document(record) -> (ids, weights). A document longer than seq_len is an error, or with
    truncate its first seq_len tokens. The state is that of the record iterator before its
    current batch and how many of that batch's records are packed already, so a run resumed
    from `get_state()` packs the rows the uninterrupted run packed."""

    def __init__(self, records, document, *, rows, seq_len, truncate=False, state=None):
        self._document, self.rows, self.seq_len, self.truncate = (document, rows, seq_len,
                                                                 truncate)
        self._it = records.iterator(None if state is None else state["records"])
        self._before, self._docs, self._used = self._it.get_state(), [], 0
        if state is not None:
            self._docs = [self._encode(r) for r in next(self._it)]
            self._used = state["used"]

    def _encode(self, record):
        ids, weights = self._document(record)
        if not len(ids):
            raise ValueError(f"a record with no tokens (prompt and completion empty): {record}")
        if len(ids) > self.seq_len:
            if not self.truncate:
                raise ValueError(f"a record of {len(ids)} tokens (prompt + completion) is "
                                 f"longer than sft.seq_len={self.seq_len}; raise sft.seq_len, "
                                 "or set sft.truncate=True to train on its first "
                                 f"{self.seq_len} tokens")
            ids, weights = ids[:self.seq_len], weights[:self.seq_len]
        return ids, weights

    def next_rows(self):
        """(tokens_bt, segment_ids_bt, weights_bt, documents placed) of the next step: records
        in order until the next one fits no row (it opens the step after)."""
        self._exhausted = False
        rows = pack(self._stream(), rows=self.rows, seq_len=self.seq_len)
        if self._exhausted:
            raise StopIteration
        return rows

    def _stream(self):
        """The documents from the first unplaced one on: `pack` places each whole or stops
        there, so one counts as placed (`_used`) when `pack` asks for the one after it."""
        while True:
            if self._used == len(self._docs):
                self._before = copy.deepcopy(self._it.get_state())
                try:
                    records = next(self._it)
                except StopIteration:  # (in a generator it would be a RuntimeError)
                    self._exhausted = True
                    return
                self._docs, self._used = [self._encode(r) for r in records], 0
            yield self._docs[self._used]
            self._used += 1

    def get_state(self) -> dict:
        return {"records": self._before, "used": self._used}

