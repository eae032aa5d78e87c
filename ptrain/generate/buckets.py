"""Padding sizes shared by the engine and its interruption: lengths and row counts are rounded
up to a few buckets, so the prefill and decode programs compile once per bucket, not per shape."""

from __future__ import annotations

import collections
from typing import Sequence


def buckets(top: int, bottom: int = 1) -> tuple[int, ...]:
    """Powers of two from `bottom` up to and including `top` (which need not be one)."""
    out, b = [], bottom
    while b < top:
        out.append(b)
        b *= 2
    return tuple(out) + (top,)


def bucket(x: int, sizes: Sequence[int]) -> int:
    for s in sizes:
        if x <= s:
            return s
    raise ValueError(f"{x} is larger than the largest bucket {sizes[-1]}")


def prefill_chunks(items, length_of, token_buckets, prefill_buckets):
    """(t, r, chunk): items grouped by their length bucket t, in chunks of at most the largest
    prefill bucket, each padded to r rows (a bucket too), so prefills reuse compiled shapes."""
    by_len = collections.defaultdict(list)
    for item in items:
        by_len[bucket(length_of(item), token_buckets)].append(item)
    for t, group in sorted(by_len.items()):
        for start in range(0, len(group), prefill_buckets[-1]):
            chunk = group[start:start + prefill_buckets[-1]]
            yield t, bucket(len(chunk), prefill_buckets), chunk
