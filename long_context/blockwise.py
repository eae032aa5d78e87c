"""Blockwise (flash-style) attention on one device.

An online softmax walks over key/value blocks for each query block, so no [t, t] score matrix
ever exists: memory is linear in length. A custom VJP saves only q, k, v, the output and the
log-sum-exp and recomputes scores block by block in the backward pass (FlashAttention-2).
GQA is native: queries are viewed as [k, g] head groups and kv heads are never repeated.

Masking is one rule from per-token integers, so reordered layouts, packing and padding need
no special cases:
  - causal: query at position p sees keys at positions <= p (`positions`, default arange);
  - segments: a query sees only keys with the same segment id; id 0 is padding, which sees
    nothing and is seen by nothing. A query row with no visible key returns zeros and gets
    zero gradients.
Block pairs that the rule masks entirely are skipped at run time (causal halves the work).

The block-level pieces (`forward_blocks`, `backward_blocks`, ...) are shared with
`ring_attention`, which runs them once per visiting key/value shard.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

# Within a few percent of the best on CPU (the sweep in docs/benchmarks.md); on GPU try
# larger blocks with bench/gpu_attention.py.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512

_F32 = jnp.float32


def blockwise_attention(q_bthe, k_bske, v_bske, *, causal=True, segment_ids=None,
                        positions=None, scale=None, block_q=DEFAULT_BLOCK_Q,
                        block_k=DEFAULT_BLOCK_K, kv_segment_ids=None, kv_positions=None):
    """Softmax attention over [b, t, h, e] queries and [b, s, k, e] keys/values (h = k * g).

    segment_ids / positions: [b, t] ints of the queries (0 = padding, see module doc);
    positions default to arange. kv_segment_ids / kv_positions: the same for the keys; they
    default to the query ones when s == t (self-attention) and to arange(s) / none otherwise
    (e.g. prefill into a cache: pass both sides). scale: default e ** -0.5. Blocks are
    clipped to the lengths, which are padded internally to multiples of the blocks.
    Returns [b, t, h, e] in the dtype of q.
    """
    b, t, s, e = check_qkv(q_bthe, k_bske, v_bske)
    tokens = check_tokens(b, t, s, positions, segment_ids, kv_positions, kv_segment_ids)
    scale = e ** -0.5 if scale is None else float(scale)
    *args, bq, bk = pad_to_blocks(q_bthe, k_bske, v_bske, *tokens, block_q, block_k)
    return _flash(*args, bool(causal), scale, bq, bk)[:, :t]


# ----------------------------------------------------------------------------- checks, padding


def check_qkv(q_bthe, k_bske, v_bske):
    """Validates shapes and dtypes; returns (b, t, s, e)."""
    if q_bthe.ndim != 4 or k_bske.ndim != 4 or v_bske.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, time, heads, head_dim]; got shapes "
                         f"{q_bthe.shape}, {k_bske.shape}, {v_bske.shape}")
    if k_bske.shape != v_bske.shape:
        raise ValueError(f"k and v must have the same shape; got {k_bske.shape} and "
                         f"{v_bske.shape}")
    b, t, h, e = q_bthe.shape
    if k_bske.shape[0] != b or k_bske.shape[3] != e:
        raise ValueError(f"k/v {k_bske.shape} must match q {q_bthe.shape} in batch and "
                         f"head_dim")
    if h % k_bske.shape[2]:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads "
                         f"({k_bske.shape[2]}) for grouped-query attention")
    if not (q_bthe.dtype == k_bske.dtype == v_bske.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q_bthe.dtype}, {k_bske.dtype}, "
                         f"{v_bske.dtype}")
    return b, t, k_bske.shape[1], e


def check_tokens(b, t, s, positions, segment_ids, kv_positions=None, kv_segment_ids=None):
    """Validates and completes (q_pos, q_seg, kv_pos, kv_seg): int32 [b, t] / [b, s].

    Key-side arrays default to the query-side ones when s == t; positions default to arange;
    segment ids stay None only if neither side has them.
    """
    named = {"positions": (positions, t), "segment_ids": (segment_ids, t),
             "kv_positions": (kv_positions, s), "kv_segment_ids": (kv_segment_ids, s)}
    out = {}
    for name, (x, length) in named.items():
        if x is not None:
            if x.shape != (b, length):
                raise ValueError(f"{name} must have shape [batch, length] = {(b, length)}; "
                                 f"got {x.shape}")
            if not jnp.issubdtype(x.dtype, jnp.integer):
                raise ValueError(f"{name} must be integers; got {x.dtype}")
            x = jnp.asarray(x, jnp.int32)
        out[name] = x
    if s == t:
        out["kv_positions"] = _first(out["kv_positions"], out["positions"])
        out["kv_segment_ids"] = _first(out["kv_segment_ids"], out["segment_ids"])
    if (out["segment_ids"] is None) != (out["kv_segment_ids"] is None):
        raise ValueError("pass both segment_ids and kv_segment_ids (queries and keys have "
                         "different lengths) or neither")
    for name, length in (("positions", t), ("kv_positions", s)):
        if out[name] is None:
            out[name] = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    return out["positions"], out["segment_ids"], out["kv_positions"], out["kv_segment_ids"]


def _first(x, default):
    return default if x is None else x


def pad_to_blocks(q, k, v, q_pos, q_seg, kv_pos, kv_seg, block_q, block_k):
    """Clips the blocks to the lengths and pads queries / keys to multiples of them; padded
    tokens get segment id 0 (padding). Returns the padded arrays and (block_q, block_k)."""
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block sizes must be positive; got {block_q}, {block_k}")
    (b, t), s = q.shape[:2], k.shape[1]
    bq, bk = min(block_q, t), min(block_k, s)
    t_pad, s_pad = -(-t // bq) * bq, -(-s // bk) * bk
    if (t_pad, s_pad) != (t, s) and q_seg is None:
        q_seg, kv_seg = jnp.ones((b, t), jnp.int32), jnp.ones((b, s), jnp.int32)
    pad = lambda x, n: x if x is None or x.shape[1] == n else jnp.pad(
        x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    return (pad(q, t_pad), pad(k, s_pad), pad(v, s_pad), pad(q_pos, t_pad), pad(q_seg, t_pad),
            pad(kv_pos, s_pad), pad(kv_seg, s_pad), bq, bk)


# ----------------------------------------------------------------------------- block layouts
# Head-major, so every block matmul is a plain batched matmul over (b, k) without copies:
# Queries, outputs and their gradients:  [n_q, b, k, g, block_q, e]   (h = k * g)
# Keys, values and their gradients:      [n_k, b, k, block_k, e]
# Per-row softmax statistics (m, l, lse, delta): [n_q, b, k, g, block_q]


def split_q(x_bthe, kv_heads, block):
    b, t, h, e = x_bthe.shape
    x = x_bthe.reshape(b, t // block, block, kv_heads, h // kv_heads, e)
    return x.transpose(1, 0, 3, 4, 2, 5)


def merge_q(x_nbkgqe):
    n, b, k, g, bq, e = x_nbkgqe.shape
    return x_nbkgqe.transpose(1, 0, 4, 2, 3, 5).reshape(b, n * bq, k * g, e)


def split_kv(x_btke, block):
    b, t, k, e = x_btke.shape
    return x_btke.reshape(b, t // block, block, k, e).transpose(1, 0, 3, 2, 4)


def merge_kv(x_nbkse):
    n, b, k, bk, e = x_nbkse.shape
    return x_nbkse.transpose(1, 0, 3, 2, 4).reshape(b, n * bk, k, e)


def split_tokens(x_bt, block):
    if x_bt is None:
        return None
    b, t = x_bt.shape
    return jnp.moveaxis(x_bt.reshape(b, t // block, block), 1, 0)


def varying_axes(*xs):
    """Mesh axes over which any of xs varies inside shard_map (empty outside)."""
    axes = frozenset()
    for x in jax.tree.leaves(xs):
        mat = getattr(jax.typeof(x), "manual_axis_type", None)
        if mat is not None:
            axes |= mat.varying
    return axes


def make_varying(x, axes):
    """Marks a freshly made array as varying over `axes`, so loop carries type-check."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _transposed(x, dims_from_end=1):
    """x with its last axis moved `dims_from_end` places left; the barrier keeps XLA from
    folding the transpose back into the matmuls (which would redo it every block)."""
    return lax.optimization_barrier(jnp.moveaxis(x, -1, -1 - dims_from_end))


def _zeros(shape, dtype, axes):
    return make_varying(jnp.zeros(shape, dtype), axes)


# ----------------------------------------------------------------------------- masks


def _block_mask(qpos_bq, kpos_bs, qseg_bq, kseg_bs, causal, transposed=False):
    """[b, 1, 1, q, s] boolean mask ([b, 1, s, 1, q] if transposed), or None if all True."""
    q_axis, k_axis = (2, 1) if transposed else (1, 2)
    as_q = lambda x: jnp.expand_dims(x, k_axis)  # [b, q] -> [b, q, 1] or [b, 1, q]
    as_k = lambda x: jnp.expand_dims(x, q_axis)
    mask = None
    if causal:
        mask = as_q(qpos_bq) >= as_k(kpos_bs)
    if qseg_bq is not None:
        same = (as_q(qseg_bq) == as_k(kseg_bs)) & (as_k(kseg_bs) != 0)
        mask = same if mask is None else mask & same
    if mask is None:
        return None
    return mask[:, None, :, None, :] if transposed else mask[:, None, None]


def _block_live(qpos_bq, kpos_bs, qseg_bq, kseg_bs, causal):
    """False only if the mask of this block pair is all False (then it is skipped)."""
    live = None
    if causal:
        live = jnp.max(qpos_bq) >= jnp.min(kpos_bs)
    if qseg_bq is not None:
        overlap = ((jnp.max(qseg_bq) >= jnp.min(kseg_bs)) & (jnp.max(kseg_bs) >= jnp.min(qseg_bq))
                   & (jnp.max(kseg_bs) > 0))
        live = overlap if live is None else live & overlap
    return live


def _maybe(live, compute, skip, operand):
    return compute(operand) if live is None else lax.cond(live, compute, skip, operand)


# ----------------------------------------------------------------------------- forward


def init_state(q_blocks, axes):
    """Running (max, denominator, numerator) for every query row, in float32."""
    n, b, k, g, bq, e = q_blocks.shape
    m = make_varying(jnp.full((n, b, k, g, bq), -jnp.inf, _F32), axes)
    return m, _zeros((n, b, k, g, bq), _F32, axes), _zeros((n, b, k, g, bq, e), _F32, axes)


def _forward_block(q_bkgqe, kt_bkes, v_bkse, mask, state, scale):
    m, l, acc = state
    s = jnp.einsum("bkgqe,bkes->bkgqs", q_bkgqe, kt_bkes, preferred_element_type=_F32) * scale
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    # A row with nothing visible yet keeps m = -inf; shift by 0 so exp gives 0, not nan.
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    corr = jnp.exp(m - m_safe)
    l = l * corr + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgqs,bkse->bkgqe", p.astype(v_bkse.dtype), v_bkse,
                    preferred_element_type=_F32)
    return m_new, l, acc * corr[..., None] + pv


def forward_blocks(q_blocks, k_blocks, v_blocks, qpos, kpos, qseg, kseg, state, *, causal,
                   scale):
    """Folds one key/value chunk (all its blocks) into the running state of every query."""
    kt_blocks = _transposed(k_blocks)

    def per_query_block(xs):
        q, qp, qs, *carry = xs

        def per_key_block(carry, ys):
            kt, v, kp, ks = ys
            mask = _block_mask(qp, kp, qs, ks, causal)
            live = _block_live(qp, kp, qs, ks, causal)
            new = _maybe(live, lambda c: _forward_block(q, kt, v, mask, c, scale),
                         lambda c: c, carry)
            return new, None

        carry, _ = lax.scan(per_key_block, tuple(carry), (kt_blocks, v_blocks, kpos, kseg))
        return carry

    return lax.map(per_query_block, (q_blocks, qpos, qseg, *state))


def finalize(state, dtype):
    """Output in the query layout and `dtype`, and float32 log-sum-exp (0 if empty)."""
    m, l, acc = state
    empty = l == 0.0
    out = acc / jnp.where(empty, 1.0, l)[..., None]
    lse = jnp.where(empty, 0.0, m + jnp.log(jnp.where(empty, 1.0, l)))
    return out.astype(dtype), lse


# ----------------------------------------------------------------------------- backward


def delta_rows(do_blocks, out_blocks):
    """rowsum(dO * O) in float32, the softmax-gradient correction term."""
    return jnp.einsum("nbkgqe,nbkgqe->nbkgq", do_blocks, out_blocks, preferred_element_type=_F32)


def _backward_block(q, qt, kt, k, v, do, dot, lse, delta, mask_t, scale):
    """Gradients of one block pair, computed transposed ([s, q] scores) so that every matmul
    takes its operands in their stored layout: no per-block transposes (kt, qt, dot are the
    transposed k, q, dO, made once per chunk or query block)."""
    s_t = jnp.einsum("bkse,bkegq->bksgq", k, qt, preferred_element_type=_F32) * scale
    if mask_t is not None:
        s_t = jnp.where(mask_t, s_t, -jnp.inf)
    p_t = jnp.exp(s_t - lse[:, :, None])
    dv = jnp.einsum("bksgq,bkgqe->bkse", p_t.astype(do.dtype), do, preferred_element_type=_F32)
    dp_t = jnp.einsum("bkse,bkegq->bksgq", v, dot, preferred_element_type=_F32)
    ds_t = p_t * (dp_t - delta[:, :, None])
    dk = jnp.einsum("bksgq,bkgqe->bkse", ds_t.astype(q.dtype), q, preferred_element_type=_F32)
    dq_t = jnp.einsum("bkes,bksgq->bkegq", kt, ds_t.astype(kt.dtype),
                      preferred_element_type=_F32)
    return dq_t * scale, dk * scale, dv


def backward_blocks(q_blocks, k_blocks, v_blocks, do_blocks, lse, delta, qpos, kpos, qseg, kseg,
                    dq_acc, *, causal, scale, axes):
    """Gradients through one key/value chunk.

    Adds into dq_acc (float32, query layout) and returns it with this chunk's float32 dK, dV
    (key layout). One pass: scores are recomputed once.
    """
    dkv_zero = _zeros(k_blocks.shape, _F32, axes)
    kt_blocks = _transposed(k_blocks)

    def per_query_block(dkv, xs):
        q, do, lse_q, delta_q, qp, qs, dq = xs
        qt, dot = _transposed(q, 2), _transposed(do, 2)

        def per_key_block(carry, ys):
            dq_t, dk_all, dv_all = carry
            kt, k, v, kp, ks, j = ys
            mask_t = _block_mask(qp, kp, qs, ks, causal, transposed=True)
            live = _block_live(qp, kp, qs, ks, causal)
            grads = _maybe(
                live,
                lambda _: _backward_block(q, qt, kt, k, v, do, dot, lse_q, delta_q, mask_t, scale),
                lambda _: (_zeros(dq_t.shape, _F32, axes), _zeros(k.shape, _F32, axes),
                           _zeros(k.shape, _F32, axes)), None)
            ddq_t, ddk, ddv = grads
            return (dq_t + ddq_t, dk_all.at[j].add(ddk), dv_all.at[j].add(ddv)), None

        idx = jnp.arange(k_blocks.shape[0])
        dq_t = _zeros(qt.shape, _F32, axes)
        (dq_t, *dkv), _ = lax.scan(per_key_block, (dq_t, *dkv),
                                   (kt_blocks, k_blocks, v_blocks, kpos, kseg, idx))
        return tuple(dkv), dq + jnp.moveaxis(dq_t, 2, -1)

    (dk, dv), dq_acc = lax.scan(per_query_block, (dkv_zero, dkv_zero),
                                (q_blocks, do_blocks, lse, delta, qpos, qseg, dq_acc))
    return dq_acc, dk, dv


# ----------------------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _flash(q, k, v, q_pos, q_seg, kv_pos, kv_seg, causal, scale, bq, bk):
    return _flash_fwd(q, k, v, q_pos, q_seg, kv_pos, kv_seg, causal, scale, bq, bk)[0]


def _flash_fwd(q, k, v, q_pos, q_seg, kv_pos, kv_seg, causal, scale, bq, bk):
    # Tie the token arrays to q, or a differentiated scan around this call (the model's
    # layers) hoists their loop-invariant masks out of it, for all block pairs at once.
    q, q_pos, q_seg, kv_pos, kv_seg = lax.optimization_barrier((q, q_pos, q_seg, kv_pos, kv_seg))
    axes = varying_axes(q, k, v, q_pos, q_seg, kv_pos, kv_seg)
    q_blocks = split_q(q, k.shape[2], bq)
    state = forward_blocks(q_blocks, split_kv(k, bk), split_kv(v, bk), split_tokens(q_pos, bq),
                           split_tokens(kv_pos, bk), split_tokens(q_seg, bq),
                           split_tokens(kv_seg, bk), init_state(q_blocks, axes),
                           causal=causal, scale=scale)
    out, lse = finalize(state, q.dtype)
    out = merge_q(out)
    return out, (q, k, v, out, lse, q_pos, q_seg, kv_pos, kv_seg)


def _flash_bwd(causal, scale, bq, bk, res, dout):
    q, k, v, out, lse, q_pos, q_seg, kv_pos, kv_seg = res
    kv_heads = k.shape[2]
    dout = dout.astype(q.dtype)
    axes = varying_axes(res, dout)
    q_blocks, do_blocks = split_q(q, kv_heads, bq), split_q(dout, kv_heads, bq)
    delta = delta_rows(do_blocks, split_q(out, kv_heads, bq))
    dq, dk, dv = backward_blocks(
        q_blocks, split_kv(k, bk), split_kv(v, bk), do_blocks, lse, delta,
        split_tokens(q_pos, bq), split_tokens(kv_pos, bk), split_tokens(q_seg, bq),
        split_tokens(kv_seg, bk), _zeros(q_blocks.shape, _F32, axes),
        causal=causal, scale=scale, axes=axes)
    return (merge_q(dq).astype(q.dtype), merge_kv(dk).astype(k.dtype),
            merge_kv(dv).astype(v.dtype), None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
