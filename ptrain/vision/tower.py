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


def rope_angles(c: VisionConfig, rope_hw_n2) -> jax.Array:
    """Angles [n, e/2]: a quarter of the head turns with the row, a quarter with the column
    (transformers' axial rotary embedding)."""
    quarter = c.head_dim // 2
    inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))
    angles_n2q = rope_hw_n2[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    return angles_n2q.reshape(rope_hw_n2.shape[0], -1)


def _rotate(x_nhe, angles_ne):
    cos = jnp.cos(angles_ne)[:, None, :]
    sin = jnp.sin(angles_ne)[:, None, :]
    x1, x2 = jnp.split(x_nhe.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_nhe.dtype)


def _block(x_nd, xs, *, c: VisionConfig, angles_ne, full_seg_n, window_seg_n):
    p, full = xs
    dt = jnp.dtype(c.dtype)
    w = {k: a.astype(dt) for k, a in p.items()}
    h_nd = model_lib.rms_norm(x_nd, w["norm1"], c.rms_eps)
    qkv_n3he = jnp.einsum("nd,dghe->nghe", h_nd, w["wqkv"]) + w["bqkv"]
    q_nhe, k_nhe, v_nhe = (qkv_n3he[:, i] for i in range(3))
    q_nhe, k_nhe = _rotate(q_nhe, angles_ne), _rotate(k_nhe, angles_ne)
    seg_n = jnp.where(full, full_seg_n, window_seg_n)[None]
    zeros = jnp.zeros_like(seg_n)
    o_nhe = attention.attend(q_nhe[None], k_nhe[None], v_nhe[None], q_positions_bt=zeros,
                             q_segment_ids_bt=seg_n, kv_positions_bs=zeros,
                             kv_segment_ids_bs=seg_n, impl=c.attention_impl, causal=False)[0]
    x_nd = x_nd + jnp.einsum("nhe,hed->nd", o_nhe, w["wo"]) + w["bo"]
    h_nd = model_lib.rms_norm(x_nd, w["norm2"], c.rms_eps)
    act = _ACT[c.hidden_act]
    a_ni = act(h_nd @ w["w_gate"] + w["b_gate"]) * (h_nd @ w["w_up"] + w["b_up"])
    return x_nd + a_ni @ w["w_down"] + w["b_down"], None


def encode(tower: VisionTower, images: Images) -> jax.Array:
    """The tower on a padded batch of patches: features [n / merge_unit, out_d]."""
    c = tower.config
    dt = jnp.dtype(c.dtype)
    w_df = tower.patch_embed[...].astype(dt).reshape(c.d_model, c.patch_dim)
    x_nd = images.patches_nf.astype(dt) @ w_df.T
    angles_ne = rope_angles(c, images.rope_hw_n2)
    params = {k: v[...] for k, v in vars(tower.blocks).items() if isinstance(v, nnx.Param)}
    full_l = jnp.asarray(np.isin(np.arange(c.depth), c.fullatt_blocks))
    step = functools.partial(_block, c=c, angles_ne=angles_ne, full_seg_n=images.full_seg_n,
                             window_seg_n=images.window_seg_n)
    x_nd, _ = jax.lax.scan(step, x_nd, (params, full_l))
    m = tower.merger
    x_nd = model_lib.rms_norm(x_nd, m.norm[...].astype(dt), c.rms_eps)
    x_mu = x_nd.reshape(-1, c.merge_unit * c.d_model)
    h_mu = jax.nn.gelu(x_mu @ m.w1[...].astype(dt) + m.b1[...].astype(dt), approximate=False)
    return h_mu @ m.w2[...].astype(dt) + m.b2[...].astype(dt)
