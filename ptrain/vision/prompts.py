"""Image prompts on the host: what the sampler and the learner pass with the tokens.

`prepare` turns padded token rows and each row's images (processor output: patches and
grids, or None) into row-aligned arrays: the rows' padded `Images` (the patch count rounded
up to a power of two so that similar batches share a compilation), where each merged
feature goes (`dest_bm`), the M-RoPE positions and each row's rope delta. A row without
images has only padding patches, so text-only and image rows run the same program, and
every array has the batch's rows first: they split into microbatches and shard over devices
with their rows.
"""

from __future__ import annotations

import dataclasses
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
    """{"images", "dest_bm", "positions_bt", "rope_3bt", "delta_b"} for a padded batch;
    `images[r]` is row r's (patches [n, patch_dim], grids [k, 3]) or None (rows past
    len(images) have none). `n_patches`: the patch buffer per row (default `patch_bucket` of
    the largest row's)."""
    tokens_bt = np.asarray(tokens_bt)
    b, t = tokens_bt.shape
    v = config.vision
    rows, items, grids = [], [], []
    for r in range(b):
        n = int(lengths_b[r])
        rows.append(tokens_bt[r, t - n:] if left_pad else tokens_bt[r, :n])
        item = images[r] if r < len(images) else None
        items.append(item)
        grids.append(np.zeros((0, 3), np.int64) if item is None else check_grids(item[1], v))
    pos_bt, rope_3bt, delta_b = batch_positions(rows, grids, config.image_token_id, v, t,
                                                left_pad=left_pad)
    most = max(int(np.prod(g, axis=-1).sum()) for g in grids)
    n_pad = n_patches or patch_bucket(most, v.merge_unit)
    return {"images": make_images(items, v, n_pad),
            "dest_bm": image_dest(tokens_bt, config.image_token_id, n_pad // v.merge_unit),
            "positions_bt": pos_bt, "rope_3bt": rope_3bt, "delta_b": delta_b}


def learner_arrays(prompt_bp: np.ndarray, prompt_lens_b: Sequence[int], images: Sequence,
                   config: VLConfig, *, n_patches: int | None = None) -> dict:
    """The vision_* arrays a learner batch carries (`vl.learner_inputs`) for left-padded
    prompts [b, p] (G rows per group, as `ptrain.batch.Batch` holds them) and each row's
    images (its group's: the same for the G rows). Pass a fixed `n_patches` (the run's patch
    budget) so that every step has the same shapes, with or without images."""
    v = prepare(prompt_bp, prompt_lens_b, images, config, left_pad=True, n_patches=n_patches)
    im = v["images"]
    return {"vision_patches_bnf": im.patches_bnf, "vision_rope_hw_bn2": im.rope_hw_bn2,
            "vision_full_seg_bn": im.full_seg_bn, "vision_window_seg_bn": im.window_seg_bn,
            "vision_dest_bm": v["dest_bm"],
            "vision_rope_b3p": np.ascontiguousarray(np.moveaxis(v["rope_3bt"], 0, 1)),
            "vision_delta_b": v["delta_b"]}


def with_images(batch, images: Sequence, config: VLConfig, *, n_patches: int):
    """A `ptrain.batch.Batch` with its rows' prompt images (`images[r]`: row r's (patches,
    grids) or None, the same for the G rows of a group) as its vision_* arrays, padded to
    `n_patches` per row (the run's budget: every step the same shapes)."""
    return dataclasses.replace(batch, **learner_arrays(batch.prompt_bp, batch.prompt_lens_b,
                                                       images, config, n_patches=n_patches))
