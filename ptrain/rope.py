"""Rotary position embeddings of the decoder family: the tables of a `ModelConfig` (plain,
llama3 and yarn scaling, Qwen2.5-VL's M-RoPE sections) and their application to queries and
keys (`model.layer_qkv`, the engine's `kv_slots`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from ptrain.model import ModelConfig


def rope_tables(c: ModelConfig) -> tuple[np.ndarray, float, tuple[int, ...]]:
    """Inverse frequencies [e/2], the cos/sin scale and the M-RoPE sections, for the config's
    RoPE scaling.

    Follows the published recipes (and Hugging Face's `modeling_rope_utils`): Llama 3.1's
    wavelength-banded rescaling and YaRN's ramp between interpolation and extrapolation.
    """
    e = c.head_dim
    inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, e, 2, dtype=np.float64) / e))
    scale = 1.0
    if c.rope_type == "linear":
        inv_freq = inv_freq / c.rope_factor
    elif c.rope_type == "llama3":
        old_len = c.rope_original_max_position
        low_wavelen = old_len / c.rope_low_freq_factor
        high_wavelen = old_len / c.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / c.rope_factor, inv_freq)
        smooth = (old_len / wavelen - c.rope_low_freq_factor) / (
            c.rope_high_freq_factor - c.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / c.rope_factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    elif c.rope_type == "yarn":
        inv_freq, scale = _yarn(c, inv_freq)
    return inv_freq.astype(np.float32), float(scale), c.mrope_section


def _yarn(c: ModelConfig, inv_freq):
    e, base, factor = c.head_dim, c.rope_theta, c.rope_factor

    def mscale(s, m=1.0):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    if c.rope_attention_factor:
        scale = c.rope_attention_factor
    elif c.rope_mscale and c.rope_mscale_all_dim:
        scale = mscale(factor, c.rope_mscale) / mscale(factor, c.rope_mscale_all_dim)
    else:
        scale = mscale(factor)

    def correction_dim(rotations):
        return (e * math.log(c.rope_original_max_position / (rotations * 2 * math.pi))
                ) / (2 * math.log(base))

    low, high = correction_dim(c.rope_beta_fast), correction_dim(c.rope_beta_slow)
    if c.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, e - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(e // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, scale


def apply_rope(x_bthe, positions_bt, inv_freq: np.ndarray, scale: float, sections=()):
    """Rotate the two halves of each head (the Llama/Qwen "rotate_half" convention).

    With M-RoPE `sections` (t, h, w), `positions_bt` may be [3, b, t]: frequency j turns with
    the position of the section it falls in (Qwen2-VL's temporal / height / width split); a
    [b, t] array is text, the same position in all three."""
    if sections:
        which_e = np.repeat(np.arange(3), sections)  # the section of each frequency
        positions_3bt = jnp.broadcast_to(positions_bt, (3,) + positions_bt.shape[-2:])
        positions_bte = jnp.moveaxis(positions_3bt[which_e], 0, -1)
        angles_bte = positions_bte.astype(jnp.float32) * jnp.asarray(inv_freq)
    else:
        angles_bte = positions_bt[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    cos = (jnp.cos(angles_bte) * scale)[:, :, None, :]
    sin = (jnp.sin(angles_bte) * scale)[:, :, None, :]
    x1, x2 = jnp.split(x_bthe.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthe.dtype)
