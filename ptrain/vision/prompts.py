"""Image prompts on the host: what the sampler and the learner pass with the tokens.

`prepare` turns padded token rows and each row's images (processor output: patches and
grids, or None) into one pytree: the padded `Images` (patches of all rows, row by row, their
count rounded up to a power of two so that similar batches share a compilation), where each
merged feature goes (`dest_m`), the M-RoPE positions [3, b, t] and each row's rope delta.
A batch without images gets the same structure with a minimal buffer of padding patches, so
text-only and image batches run the same program (no branch that some devices skip).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ptrain.vision.layout import check_grids, make_images
from ptrain.vision.positions import batch_positions
from ptrain.vision.vl import VLConfig, image_dest


def patch_bucket(n: int, merge_unit: int, minimum: int = 16) -> int:
    """The padded patch count for n patches: a power of two, at least `minimum`."""
    size = max(minimum, merge_unit)
    while size < n:
        size *= 2
    return size


def prepare(tokens_bt: np.ndarray, lengths_b: Sequence[int], images: Sequence, config: VLConfig,
            *, left_pad: bool, n_patches: int | None = None) -> dict:
    """{"images", "dest_m", "rope_3bt", "delta_b"} for a padded batch; `images[r]` is row r's
    (patches [n, patch_dim], grids [k, 3]) or None (rows past len(images) have none).
    `n_patches`: the patch buffer (default `patch_bucket` of the batch's patches)."""
    tokens_bt = np.asarray(tokens_bt)
    b, t = tokens_bt.shape
    v = config.vision
    grids, patches, rows = [], [], []
    for r in range(b):
        n = int(lengths_b[r])
        rows.append(tokens_bt[r, t - n:] if left_pad else tokens_bt[r, :n])
        item = images[r] if r < len(images) else None
        if item is None:
            grids.append(np.zeros((0, 3), np.int64))
            continue
        p, g = item
        g = check_grids(g, v)
        grids.append(g)
        patches.append(np.asarray(p, np.float32).reshape(-1, v.patch_dim))
    pos_bt, rope_3bt, delta_b = batch_positions(rows, grids, config.image_token_id, v, t,
                                                left_pad=left_pad)
    all_grids = np.concatenate(grids)
    all_patches = (np.concatenate(patches) if patches
                   else np.zeros((0, v.patch_dim), np.float32))
    n_pad = n_patches or patch_bucket(len(all_patches), v.merge_unit)
    batch = make_images(all_patches, all_grids, v, n_pad)
    return {"images": batch, "dest_m": image_dest(tokens_bt, config.image_token_id,
                                                 n_pad // v.merge_unit),
            "rope_3bt": rope_3bt, "delta_b": delta_b, "positions_bt": pos_bt}
