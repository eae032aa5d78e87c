"""Reference and inputs for the attention tests: a dense float32 softmax over [t, t] scores.

Written from the textbook formula, independent of long_context: kv heads are repeated (not
grouped), padding (segment 0) and causality are one boolean mask, and gradients come from
JAX autodiff through jax.nn.softmax.
"""

import jax
import jax.numpy as jnp
import numpy as np


def dense_attention(q_bthe, k_bske, v_bske, *, causal, segment_ids=None, positions=None,
                    kv_segment_ids=None, kv_positions=None):
    """softmax(q k^T / sqrt(e) + mask) v; rows with nothing visible give zeros.

    Key-side positions / segment ids default to the query-side ones.
    """
    b, t, h, e = q_bthe.shape
    s_len = k_bske.shape[1]
    group = h // k_bske.shape[2]
    k = jnp.repeat(k_bske, group, axis=2).astype(jnp.float32)
    v = jnp.repeat(v_bske, group, axis=2).astype(jnp.float32)
    q = q_bthe.astype(jnp.float32)
    s = jnp.einsum("bqhd,bshd->bhqs", q, k, precision="highest") / np.sqrt(e)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    kv_positions = positions if kv_positions is None else kv_positions
    kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
    mask = jnp.ones((b, t, s_len), bool)
    if causal:
        mask &= positions[:, :, None] >= kv_positions[:, None, :]
    if segment_ids is not None:
        mask &= segment_ids[:, :, None] == kv_segment_ids[:, None, :]
        mask &= kv_segment_ids[:, None, :] != 0
    mask = mask[:, None]
    p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
    p = p * jnp.any(mask, axis=-1, keepdims=True)
    return jnp.einsum("bhqs,bshd->bqhd", p, v, precision="highest")


def qkv(b, t, h, kv_heads, e, dtype=jnp.float32, seed=0):
    """Random q, k, v and an output cotangent w (so gradients are not all alike)."""
    kq, kk, kv, kw = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, t, h, e), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, t, kv_heads, e), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, t, kv_heads, e), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (b, t, h, e), jnp.float32).astype(dtype)
    return q, k, v, w


def packed_segments(doc_lengths, t):
    """[b, t] segment ids 1, 2, ... for the documents of each row, 0 (padding) after them."""
    seg = np.zeros((len(doc_lengths), t), np.int32)
    for row, lengths in enumerate(doc_lengths):
        if sum(lengths) > t:
            raise ValueError(f"documents {lengths} do not fit in {t} tokens")
        seg[row, :sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    return jnp.asarray(seg)


def out_and_grads(fn, q, k, v, w):
    """fn(q, k, v) and the gradients of sum(fn * w) w.r.t. q, k, v, in one jitted call."""

    @jax.jit
    def run(q, k, v, w):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(w.astype(out.dtype))

    return run(q, k, v, w)


def assert_close(actual, expected, tol, what=""):
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                               rtol=tol, atol=tol, err_msg=what)
