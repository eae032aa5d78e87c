"""Attention dispatch: the one place the model's attention implementation is chosen.

Every implementation takes queries [b, t, h, e] and keys/values [b, s, k, e] with h = k * g
(grouped-query attention: kv heads are never repeated in memory), plus the positions and
segment ids of both sides. One masking rule serves causal decoding, caches, packing and
padding: query i sees key j iff they share a segment id, the key's segment id is not 0
(0 marks padding and empty cache slots) and, when causal, position(j) <= position(i).
A query that sees nothing (a padding row) returns zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("reference",)


def attend(q_bthe, k_bske, v_bske, *, q_positions_bt, q_segment_ids_bt, kv_positions_bs,
           kv_segment_ids_bs, impl: str = "reference", causal: bool = True, scale=None,
           mesh=None):
    """Attention output [b, t, h, e] in the query dtype."""
    if impl == "reference":
        return reference_attention(
            q_bthe, k_bske, v_bske, q_positions_bt=q_positions_bt,
            q_segment_ids_bt=q_segment_ids_bt, kv_positions_bs=kv_positions_bs,
            kv_segment_ids_bs=kv_segment_ids_bs, causal=causal, scale=scale)
    raise ValueError(f"attention impl {impl!r} is not one of {IMPLS}")


def make_mask(q_positions_bt, q_segment_ids_bt, kv_positions_bs, kv_segment_ids_bs, causal: bool):
    """Boolean [b, t, s]: which keys each query may attend to (the rule in the module doc)."""
    q_seg = q_segment_ids_bt[:, :, None]
    kv_seg = kv_segment_ids_bs[:, None, :]
    mask = (q_seg == kv_seg) & (kv_seg != 0)
    if causal:
        mask &= kv_positions_bs[:, None, :] <= q_positions_bt[:, :, None]
    return mask


def reference_attention(q_bthe, k_bske, v_bske, *, q_positions_bt, q_segment_ids_bt,
                        kv_positions_bs, kv_segment_ids_bs, causal=True, scale=None):
    """Dense softmax attention with float32 logits: simple, exact, O(t * s) memory."""
    b, t, h, e = q_bthe.shape
    k = k_bske.shape[2]
    scale = e ** -0.5 if scale is None else scale
    q_btkge = q_bthe.reshape(b, t, k, h // k, e)
    logits_bkgts = jnp.einsum("btkge,bske->bkgts", q_btkge, k_bske,
                              preferred_element_type=jnp.float32) * scale
    mask_bts = make_mask(q_positions_bt, q_segment_ids_bt, kv_positions_bs, kv_segment_ids_bs,
                         causal)
    logits_bkgts = jnp.where(mask_bts[:, None, None], logits_bkgts, -jnp.inf)
    # Rows that see nothing would be NaN after softmax; give them zero weights instead.
    row_max = jnp.max(logits_bkgts, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(logits_bkgts - jax.lax.stop_gradient(row_max))
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    probs_bkgts = weights / jnp.where(denom > 0, denom, 1.0)
    out_btkge = jnp.einsum("bkgts,bske->btkge", probs_bkgts.astype(v_bske.dtype), v_bske,
                           preferred_element_type=jnp.float32)
    return out_btkge.reshape(b, t, h, e).astype(q_bthe.dtype)
