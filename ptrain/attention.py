"""Attention dispatch: the one place the model's attention implementation is chosen.

Every implementation takes queries [b, t, h, e] and keys/values [b, s, k, e] with h = k * g
(grouped-query attention: kv heads are never repeated in memory), plus the positions and
segment ids of both sides. One masking rule serves causal decoding, caches, packing and
padding: query i sees key j iff they share a segment id, the key's segment id is not 0
(0 marks padding and empty cache slots) and, when causal, position(j) <= position(i).
A query that sees nothing (a padding row) returns zeros.

  reference  dense softmax, float32 scores: exact and simple, O(t * s) memory
  blockwise  flash-style online softmax (`long_context.blockwise_attention`), O(t) memory
  ring       sequence parallel over the mesh's `sequence` axis (`long_context.ring_attention`):
             each device keeps its query shard while key/value shards travel the ring. With
             a KV cache (decoding) the keys are not sharded like the queries, so the cache
             path uses `blockwise`.
  cudnn      `jax.nn.dot_product_attention` (cuDNN's fused kernel on GPU, XLA elsewhere).
             It has no segment ids or positions, so the rule above is passed as a dense
             [b, 1, t, s] mask: for short and medium sequences, not for long context.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

import long_context
from ptrain import sharding

IMPLS = ("reference", "blockwise", "ring", "cudnn")


def attend(q_bthe, k_bske, v_bske, *, q_positions_bt, q_segment_ids_bt, kv_positions_bs,
           kv_segment_ids_bs, impl: str = "reference", causal: bool = True, scale=None,
           mesh=None, block_q: int = long_context.DEFAULT_BLOCK_Q,
           block_k: int = long_context.DEFAULT_BLOCK_K):
    """Attention output [b, t, h, e] in the query dtype."""
    tokens = dict(q_positions_bt=q_positions_bt, q_segment_ids_bt=q_segment_ids_bt,
                  kv_positions_bs=kv_positions_bs, kv_segment_ids_bs=kv_segment_ids_bs)
    self_attention = q_bthe.shape[1] == k_bske.shape[1]
    use_ring = (impl == "ring" and self_attention and mesh is not None
                and mesh.shape.get("sequence", 1) > 1)
    if impl == "reference":
        return reference_attention(q_bthe, k_bske, v_bske, causal=causal, scale=scale, **tokens)
    if impl == "cudnn":
        return cudnn_attention(q_bthe, k_bske, v_bske, causal=causal, scale=scale, **tokens)
    if impl == "blockwise" or (impl == "ring" and not use_ring):
        return long_context.blockwise_attention(
            q_bthe, k_bske, v_bske, causal=causal, scale=scale, block_q=block_q,
            block_k=block_k, positions=q_positions_bt, segment_ids=q_segment_ids_bt,
            kv_positions=kv_positions_bs, kv_segment_ids=kv_segment_ids_bs)
    if impl == "ring":
        return _ring(q_bthe, k_bske, v_bske, mesh=mesh, causal=causal, scale=scale,
                     positions_bt=q_positions_bt, segment_ids_bt=q_segment_ids_bt,
                     block_q=block_q, block_k=block_k)
    raise ValueError(f"attention impl {impl!r} is not one of {IMPLS}")


def _ring(q_bthe, k_btke, v_btke, *, mesh, causal, scale, positions_bt, segment_ids_bt,
          block_q, block_k):
    """Ring attention with the model's sharding: batch over data x fsdp, heads over tensor.

    Where a dimension does not divide over its axes it is replicated, as everywhere else;
    kv heads that do not divide over `tensor` are repeated up to a multiple of it (the ring
    then carries the repeats: the price of sharding heads finer than the checkpoint has).
    """
    b, _, h, _ = q_bthe.shape
    k = k_btke.shape[2]
    batch_axes = sharding.batch_axes(mesh)
    if b % math.prod(mesh.shape[a] for a in batch_axes):
        batch_axes = ()
    tensor = mesh.shape.get("tensor", 1)
    head_axes = ("tensor",) if tensor > 1 and h % tensor == 0 else ()
    if head_axes and k % tensor:
        repeat = math.lcm(k, tensor) // k
        if h % (k * repeat):
            head_axes = ()
        else:
            k_btke = jnp.repeat(k_btke, repeat, axis=2)
            v_btke = jnp.repeat(v_btke, repeat, axis=2)
    return long_context.ring_attention(
        q_bthe, k_btke, v_btke, mesh=mesh, axis="sequence", causal=causal, scale=scale,
        positions=positions_bt, segment_ids=segment_ids_bt, block_q=block_q, block_k=block_k,
        batch_axes=batch_axes, head_axes=head_axes)


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


def cudnn_attention(q_bthe, k_bske, v_bske, *, q_positions_bt, q_segment_ids_bt,
                    kv_positions_bs, kv_segment_ids_bs, causal=True, scale=None):
    """`jax.nn.dot_product_attention`: cuDNN on GPU (bf16/fp16), XLA elsewhere."""
    mask_bts = make_mask(q_positions_bt, q_segment_ids_bt, kv_positions_bs, kv_segment_ids_bs,
                         causal)
    on_gpu = jax.default_backend() == "gpu" and q_bthe.dtype in (jnp.bfloat16, jnp.float16)
    out_bthe = jax.nn.dot_product_attention(
        q_bthe, k_bske, v_bske, mask=mask_bts[:, None], scale=scale,
        implementation="cudnn" if on_gpu else None)
    seen_bt = jnp.any(mask_bts, axis=-1)  # a row that sees nothing returns zeros, as above
    return jnp.where(seen_bt[:, :, None, None], out_bthe, 0).astype(q_bthe.dtype)
