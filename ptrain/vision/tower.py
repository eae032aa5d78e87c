"""Qwen2.5-VL's vision transformer and patch merger, in Flax NNX.

Parameters are stacked over blocks (leading `l` axis) and the blocks run under one
`lax.scan`; whether a block attends over its window or its whole frame is a scanned flag,
so depth does not grow the program. Every matmul takes [n, ...] patch activations (one
flattened sequence of the patches of all images), as transformers' tower does.

Shape letters: n patches, m merged tokens, f flattened patch, d tower width, h heads,
e head dim, i MLP hidden, o decoder width, l blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ptrain import attention
from ptrain import model as model_lib
from ptrain import projection
from ptrain.vision.config import VisionConfig
from ptrain.vision.layout import Images

_ACT = {"silu": jax.nn.silu, "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x)}


class Blocks(nnx.Module):
    """All blocks' parameters, stacked on a leading `l` axis."""

    def __init__(self, c: VisionConfig, rngs: nnx.Rngs):
        l, d, h, e, i = c.depth, c.d_model, c.n_heads, c.head_dim, c.d_ff
        dt = jnp.dtype(c.param_dtype)
        p = model_lib._param
        self.norm1 = p(rngs, (l, d), ("layers", None), dt, "ones")
        self.wqkv = p(rngs, (l, d, 3, h, e), ("layers", None, None, "heads", None), dt)
        self.bqkv = p(rngs, (l, 3, h, e), ("layers", None, "heads", None), dt, "zeros")
        self.wo = p(rngs, (l, h, e, d), ("layers", "heads", None, None), dt)
        self.bo = p(rngs, (l, d), ("layers", None), dt, "zeros")
        self.norm2 = p(rngs, (l, d), ("layers", None), dt, "ones")
        self.w_gate = p(rngs, (l, d, i), ("layers", None, "mlp"), dt)
        self.b_gate = p(rngs, (l, i), ("layers", "mlp"), dt, "zeros")
        self.w_up = p(rngs, (l, d, i), ("layers", None, "mlp"), dt)
        self.b_up = p(rngs, (l, i), ("layers", "mlp"), dt, "zeros")
        self.w_down = p(rngs, (l, i, d), ("layers", "mlp", None), dt)
        self.b_down = p(rngs, (l, d), ("layers", None), dt, "zeros")


class Merger(nnx.Module):
    """RMSNorm, then each 2x2 group of patches concatenated through Linear-GELU-Linear."""

    def __init__(self, c: VisionConfig, rngs: nnx.Rngs):
        d, u, o = c.d_model, c.merge_unit * c.d_model, c.out_d
        dt = jnp.dtype(c.param_dtype)
        p = model_lib._param
        self.norm = p(rngs, (d,), (None,), dt, "ones")
        self.w1 = p(rngs, (u, u), (None, "mlp"), dt)
        self.b1 = p(rngs, (u,), ("mlp",), dt, "zeros")
        self.w2 = p(rngs, (u, o), ("mlp", "embed"), dt)
        self.b2 = p(rngs, (o,), ("embed",), dt, "zeros")


class VisionTower(nnx.Module):
    def __init__(self, config: VisionConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        # the HF Conv3d's weight [d, c, t, p, p]: kernel = stride = one patch, so a matmul
        self.patch_embed = model_lib._param(
            rngs, (c.d_model, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size),
            (None,) * 5, jnp.dtype(c.param_dtype))
        self.blocks = Blocks(c, rngs)
        self.merger = Merger(c, rngs)

    def __call__(self, images: Images) -> jax.Array:
        """Merged image features [n / merge_unit, out_d] in the tower's compute dtype, in
        processor order (rows of padding patches are garbage: place only real ones)."""
        return encode(self, images)


def rope_angles(c: VisionConfig, rope_hw_bn2) -> jax.Array:
    """Angles [b, n, e/2]: a quarter of the head turns with the row, a quarter with the
    column (transformers' axial rotary embedding)."""
    quarter = c.head_dim // 2
    inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))
    angles_bn2q = rope_hw_bn2[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    return angles_bn2q.reshape(rope_hw_bn2.shape[:2] + (-1,))


def _rotate(x_bnhe, angles_bne):
    """RoPE's rotate-half rotation by the given angles (float32, cast back)."""
    cos = jnp.cos(angles_bne)[:, :, None, :]
    sin = jnp.sin(angles_bne)[:, :, None, :]
    x1, x2 = jnp.split(x_bnhe.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_bnhe.dtype)


def _block(x_bnd, xs, *, c: VisionConfig, angles_bne, full_seg_bn, window_seg_bn):
    p, full = xs
    dt = jnp.dtype(c.dtype)
    w = {k: a.astype(dt) for k, a in p.items()}
    h_bnd = model_lib.rms_norm(x_bnd, w["norm1"], c.rms_eps)
    qkv_bn3he = projection.dense(h_bnd, w["wqkv"]) + w["bqkv"]
    q_bnhe, k_bnhe, v_bnhe = (qkv_bn3he[:, :, i] for i in range(3))
    q_bnhe, k_bnhe = _rotate(q_bnhe, angles_bne), _rotate(k_bnhe, angles_bne)
    seg_bn = jnp.where(full, full_seg_bn, window_seg_bn)
    zeros = jnp.zeros_like(seg_bn)
    o_bnhe = attention.attend(q_bnhe, k_bnhe, v_bnhe, q_positions_bt=zeros,
                              q_segment_ids_bt=seg_bn, kv_positions_bs=zeros,
                              kv_segment_ids_bs=seg_bn, impl=c.attention_impl, causal=False)
    x_bnd = x_bnd + projection.dense(o_bnhe, w["wo"], n_in=2) + w["bo"]
    h_bnd = model_lib.rms_norm(x_bnd, w["norm2"], c.rms_eps)
    act = _ACT[c.hidden_act]
    a_bni = (act(projection.dense(h_bnd, w["w_gate"]) + w["b_gate"])
             * (projection.dense(h_bnd, w["w_up"]) + w["b_up"]))
    return x_bnd + projection.dense(a_bni, w["w_down"]) + w["b_down"], None


def encode(tower: VisionTower, images: Images) -> jax.Array:
    """The tower on a padded batch of patches: features [b, n / merge_unit, out_d]."""
    c = tower.config
    dt = jnp.dtype(c.dtype)
    b, n = images.patches_bnf.shape[:2]
    w_fd = tower.patch_embed[...].astype(dt).reshape(c.d_model, c.patch_dim).T
    x_bnd = projection.dense(images.patches_bnf.astype(dt), w_fd)
    angles_bne = rope_angles(c, images.rope_hw_bn2)
    params = {k: v[...] for k, v in vars(tower.blocks).items() if isinstance(v, nnx.Param)}
    full_l = jnp.asarray(np.isin(np.arange(c.depth), c.fullatt_blocks))
    step = functools.partial(_block, c=c, angles_bne=angles_bne, full_seg_bn=images.full_seg_bn,
                             window_seg_bn=images.window_seg_bn)
    x_bnd, _ = jax.lax.scan(model_lib._remat(c.remat, step), x_bnd, (params, full_l))
    m = tower.merger
    x_bnd = model_lib.rms_norm(x_bnd, m.norm[...].astype(dt), c.rms_eps)
    x_bmu = x_bnd.reshape(b, n // c.merge_unit, c.merge_unit * c.d_model)
    h_bmu = jax.nn.gelu(projection.dense(x_bmu, m.w1[...].astype(dt)) + m.b1[...].astype(dt),
                        approximate=False)
    return projection.dense(h_bmu, m.w2[...].astype(dt)) + m.b2[...].astype(dt)
