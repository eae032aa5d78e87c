"""M-RoPE positions of a token sequence with images (Qwen2-VL's `get_rope_index`).

Text tokens count up by one in all three components (temporal, height, width). An image's
run of placeholder tokens (one per merged patch, t x h/2 x w/2 of them, row-major) starts at
the position p that follows the text before it: token (f, i, j) gets (p + f, p + i, p + j),
and the text after the image continues at p + max(t, h/2, w/2). So a sequence of t tokens
ends at a position below t, and decoding continues from the last position + 1: token k
(0-based in the sequence) of the continuation has position k + delta in all three, with
delta = (last position + 1) - length, the "rope delta" (0 for text alone, negative with
images).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ptrain.vision.config import VisionConfig
from ptrain.vision.layout import check_grids


def image_runs(tokens: Sequence[int], image_token_id: int, grids_thw, config: VisionConfig):
    """[(start, grid)] of each image's placeholder run; raises when the placeholders do not
    match the images (their count, or a run split by other tokens)."""
    tokens = np.asarray(tokens)
    grids = check_grids(grids_thw, config)
    is_image = tokens == image_token_id
    want = [int(t * h * w) // config.merge_unit for t, h, w in grids]
    if int(is_image.sum()) != sum(want):
        raise ValueError(f"the prompt has {int(is_image.sum())} image placeholder tokens "
                         f"(id {image_token_id}); its {len(grids)} image(s) need "
                         f"{want} = {sum(want)}")
    runs, k = [], 0
    starts = np.flatnonzero(is_image)
    for grid, n in zip(grids, want):
        start = int(starts[k])
        if not is_image[start:start + n].all():
            raise ValueError(f"image placeholder run at token {start} is shorter than the "
                             f"{n} tokens its image (grid {grid.tolist()}) needs")
        runs.append((start, grid))
        k += n
    return runs


def mrope_positions(tokens: Sequence[int], image_token_id: int, grids_thw,
                    config: VisionConfig) -> tuple[np.ndarray, int]:
    """(positions int32 [3, len(tokens)], rope delta) of one sequence."""
    t = len(tokens)
    out = np.zeros((3, t), np.int64)
    m = config.spatial_merge_size
    pos = cursor = 0
    for start, (gt, gh, gw) in image_runs(tokens, image_token_id, grids_thw, config):
        n_text = start - cursor
        out[:, cursor:start] = pos + np.arange(n_text)
        pos += n_text
        f, i, j = np.meshgrid(np.arange(gt), np.arange(gh // m), np.arange(gw // m),
                              indexing="ij")
        n = f.size
        out[:, start:start + n] = pos + np.stack([f.ravel(), i.ravel(), j.ravel()])
        pos += max(gt, gh // m, gw // m)
        cursor = start + n
    out[:, cursor:] = pos + np.arange(t - cursor)
    last = int(out.max()) if t else -1
    return out.astype(np.int32), last + 1 - t


def batch_positions(rows: Sequence[Sequence[int]], grids_per_row, image_token_id: int,
                    config: VisionConfig, t: int, *, left_pad: bool = False):
    """(positions [b, t] (0.. per row's own tokens), rope positions [3, b, t], deltas [b])
    for rows padded to t tokens (right padding, or left with `left_pad`); pads get 0."""
    b = len(rows)
    pos_bt = np.zeros((b, t), np.int32)
    rope_3bt = np.zeros((3, b, t), np.int32)
    deltas = np.zeros((b,), np.int32)
    for r, (row, grids) in enumerate(zip(rows, grids_per_row)):
        n = len(row)
        if n > t:
            raise ValueError(f"row {r} has {n} tokens, more than the {t} of the batch")
        lo = t - n if left_pad else 0
        rope, deltas[r] = mrope_positions(row, image_token_id, grids, config)
        rope_3bt[:, r, lo:lo + n] = rope
        pos_bt[r, lo:lo + n] = np.arange(n)
    return pos_bt, rope_3bt, deltas
