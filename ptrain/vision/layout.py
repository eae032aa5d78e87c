"""Where each patch sits: its 2-D rotary position and its attention segments.

The processor orders an image's patches frame by frame, each frame in 2x2 merge groups
(`spatial_merge_size`) row-major over the merged grid, the four patches of a group
consecutive. Full-attention blocks see the patches of their own frame; windowed blocks see
those of their own window of `window_size` pixels (`window_size // merge // patch` merged
tokens a side, cut at the image's bottom and right edges). transformers reorders the patches
window by window and runs attention per window; here every patch keeps its place and the
window is a segment id of the attention mask, which is the same computation.

`Images` is what the tower runs on: per batch row, the patches of the row's images
concatenated and padded to a fixed count (segment id 0 marks the pads), so that a batch with
one small image, many images or none compiles to the same program, and the images travel
(and shard) with their rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import numpy as np

from ptrain.vision.config import VisionConfig


@flax.struct.dataclass
class Images:
    """Each row's images' patches, padded to n patches (pads have segment ids 0)."""

    patches_bnf: jax.Array  # float [b, n, channels * temporal * patch * patch]
    rope_hw_bn2: jax.Array  # int32 [b, n, 2]: each patch's row and column in its image
    full_seg_bn: jax.Array  # int32 [b, n]: the image frame of each patch, 1-based (0: pad)
    window_seg_bn: jax.Array  # int32 [b, n]: its attention window, 1-based (0: padding)


def check_grids(grids_thw, config: VisionConfig) -> np.ndarray:
    """The grids as int [images, 3], with a clear error for sizes the merger cannot group."""
    grids = np.asarray(grids_thw, dtype=np.int64).reshape(-1, 3)
    m = config.spatial_merge_size
    for t, h, w in grids:
        if t < 1 or h < m or w < m or h % m or w % m:
            raise ValueError(f"image grid (t={t}, h={h}, w={w}) in patches: h and w must be "
                             f"positive multiples of spatial_merge_size ({m}); resize the image "
                             "with ptrain.vision.image_processing.preprocess")
    return grids


def n_merged(grids_thw, config: VisionConfig) -> list[int]:
    """How many tokens (merged patches) each image becomes in the decoder."""
    return [int(t * h * w) // config.merge_unit for t, h, w in check_grids(grids_thw, config)]


def layout(grids_thw, config: VisionConfig, n_pad: int | None = None):
    """(rope_hw [n, 2], full_seg [n], window_seg [n]) for the images' patches in processor
    order, padded to `n_pad` patches (default: no padding)."""
    grids = check_grids(grids_thw, config)
    m = config.spatial_merge_size
    ws = config.window_size // m // config.patch_size
    rope, full, window = [], [], []
    frames = windows = 0
    for t, h, w in grids:
        gh, gw = h // m, w // m
        i, j, a, b = np.meshgrid(np.arange(gh), np.arange(gw), np.arange(m), np.arange(m),
                                 indexing="ij")
        hw = np.stack([(i * m + a).ravel(), (j * m + b).ravel()], axis=-1)
        n_wc = -(-gw // ws)
        win = ((i // ws) * n_wc + j // ws).ravel()
        per_frame = -(-gh // ws) * n_wc
        for frame in range(t):
            rope.append(hw)
            full.append(np.full(len(hw), frames + frame + 1))
            window.append(win + windows + frame * per_frame + 1)
        frames += t
        windows += t * per_frame
    n = sum(len(x) for x in rope)
    n_pad = n if n_pad is None else n_pad
    if n_pad < n:
        raise ValueError(f"{n} patches do not fit in a buffer of {n_pad}; raise the patch "
                         "budget (or send fewer / smaller images)")
    out_rope = np.zeros((n_pad, 2), np.int32)
    out_full = np.zeros((n_pad,), np.int32)
    out_window = np.zeros((n_pad,), np.int32)
    if n:
        out_rope[:n] = np.concatenate(rope)
        out_full[:n] = np.concatenate(full)
        out_window[:n] = np.concatenate(window)
    return out_rope, out_full, out_window


def make_images(rows: Sequence, config: VisionConfig, n_pad: int) -> Images:
    """An `Images` batch of numpy arrays: `rows[r]` is row r's processor output (patches of
    its images concatenated [n, patch_dim], grids [k, 3]) or None, padded to `n_pad`
    patches with zeros."""
    b = len(rows)
    out = Images(np.zeros((b, n_pad, config.patch_dim), np.float32),
                 np.zeros((b, n_pad, 2), np.int32), np.zeros((b, n_pad), np.int32),
                 np.zeros((b, n_pad), np.int32))
    for r, item in enumerate(rows):
        if item is None:
            continue
        patches, grids = item
        grids = check_grids(grids, config)
        patches = np.asarray(patches, np.float32).reshape(-1, config.patch_dim)
        expected = int(np.prod(grids, axis=-1).sum()) if len(grids) else 0
        if patches.shape[0] != expected:
            raise ValueError(f"row {r}: {patches.shape[0]} patches for image grids "
                             f"{grids.tolist()}, which need {expected}")
        out.rope_hw_bn2[r], out.full_seg_bn[r], out.window_seg_bn[r] = layout(grids, config,
                                                                              n_pad)
        out.patches_bnf[r, :expected] = patches
    return out
