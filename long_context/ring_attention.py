"""Ring attention: attention over a sequence sharded across a mesh axis.

Each device keeps its query shard and passes its key/value shard around a ring of
`lax.ppermute`s; after n steps every query has seen every key, and no device ever holds more
than two key/value shards. Each step first issues the transfer of the next shard, then runs the
blockwise kernel (`long_context.blockwise`) on the current one, so communication can hide
behind compute. The custom VJP sends dK/dV around the ring with their shard (they arrive home
after the last step); nothing is all-gathered.

Masks come from the positions and segment ids that rotate with each key/value shard, so one
rule serves every layout (`long_context.layouts`), packed documents that cross shard edges,
and padding (segment id 0). Only the kv heads rotate (native GQA).

Two entry points:
  - `ring_attention` takes global arrays and wraps `jax.shard_map` itself;
  - `ring_attention_shard` is the per-shard function, for code already inside a shard_map.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from long_context import blockwise as bw

DEFAULT_BLOCK_Q = bw.DEFAULT_BLOCK_Q
DEFAULT_BLOCK_K = bw.DEFAULT_BLOCK_K
_BATCH_AXES = ("data", "fsdp")
_HEAD_AXES = ("tensor",)
_F32 = jnp.float32


def ring_attention(q_bthe, k_btke, v_btke, *, mesh, axis="sequence", causal=True,
                   segment_ids=None, positions=None, scale=None, block_q=DEFAULT_BLOCK_Q,
                   block_k=DEFAULT_BLOCK_K, batch_axes=None, head_axes=None):
    """Attention over global [b, t, h, e] / [b, t, k, e] arrays, time sharded over `axis`.

    positions: [b, t] true token positions for the causal rule; default arange, i.e. the
    contiguous layout. For zigzag/striped, pass the reordered positions
    (`layout_permutation`). segment_ids: [b, t], 0 = padding. batch_axes / head_axes: mesh
    axes sharding the batch and the heads; None infers those of ("data", "fsdp") and
    ("tensor",) present in the mesh; () means replicated. Inputs are resharded to these specs
    if they are not already. Returns [b, t, h, e] sharded like q.
    """
    b, t, s, _ = bw.check_qkv(q_bthe, k_btke, v_btke)
    _check_self_attention(t, s)
    positions, segment_ids, _, _ = bw.check_tokens(b, t, t, positions, segment_ids)
    h = q_bthe.shape[2]
    if axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not a mesh axis; the mesh has {mesh.axis_names}")
    n = mesh.shape[axis]
    if t % n:
        raise ValueError(f"sequence length {t} must be divisible by the {axis!r} axis size {n}")
    batch_axes = _mesh_axes(mesh, batch_axes, _BATCH_AXES, axis, "batch_axes")
    head_axes = _mesh_axes(mesh, head_axes, _HEAD_AXES, axis, "head_axes")
    _check_divisible(mesh, batch_axes, b, "batch", "batch_axes")
    _check_divisible(mesh, head_axes, h, "query heads", "head_axes")
    _check_divisible(mesh, head_axes, k_btke.shape[2], "kv heads (repeat them up to a "
                     "multiple of the head axes first)", "head_axes")

    batch, heads = batch_axes or None, head_axes or None
    spec_x, spec_t = P(batch, axis, heads, None), P(batch, axis)
    args = [q_bthe, k_btke, v_btke, positions]
    specs = [spec_x, spec_x, spec_x, spec_t]
    if segment_ids is not None:
        args.append(segment_ids)
        specs.append(spec_t)
    args = [_reshard(x, mesh, spec) for x, spec in zip(args, specs)]

    def per_shard(q, k, v, pos, seg=None):
        return ring_attention_shard(q, k, v, axis=axis, causal=causal, segment_ids=seg,
                                    positions=pos, scale=scale, block_q=block_q,
                                    block_k=block_k)

    return jax.shard_map(per_shard, mesh=mesh, in_specs=tuple(specs), out_specs=spec_x)(*args)


def ring_attention_shard(q_bthe, k_btke, v_btke, *, axis="sequence", causal=True,
                         segment_ids=None, positions=None, scale=None,
                         block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
    """Per-shard ring attention: call inside a shard_map that is manual over `axis`.

    Arguments are the local shards ([b, t_local, ...]). positions default to the contiguous
    layout (axis_index * t_local + arange); pass them for any other layout.
    """
    b, t, s, e = bw.check_qkv(q_bthe, k_btke, v_btke)
    _check_self_attention(t, s)
    if not isinstance(axis, str):
        raise ValueError(f"axis must be one mesh axis name; got {axis!r}")
    if positions is None:
        start = lax.axis_index(axis).astype(jnp.int32) * t
        positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    tokens = bw.check_tokens(b, t, t, positions, segment_ids)
    scale = e ** -0.5 if scale is None else float(scale)
    *args, bq, bk = bw.pad_to_blocks(q_bthe, k_btke, v_btke, *tokens, block_q, block_k)
    return _ring(*args, axis, bool(causal), scale, bq, bk)[:, :t]


# ----------------------------------------------------------------------------- helpers


def _check_self_attention(t, s):
    if s != t:
        raise ValueError(f"ring attention is self-attention over one sharded sequence: k/v "
                         f"length {s} must equal q length {t}")


def _mesh_axes(mesh, given, defaults, seq_axis, name):
    if given is None:
        return tuple(a for a in defaults if a in mesh.axis_names and a != seq_axis)
    given = (given,) if isinstance(given, str) else tuple(given)
    for a in given:
        if a not in mesh.axis_names or a == seq_axis:
            raise ValueError(f"{name}: {a!r} must be a mesh axis other than {seq_axis!r}; the "
                             f"mesh has {mesh.axis_names}")
    return given


def _check_divisible(mesh, axes, size, what, name):
    shards = 1
    for a in axes:
        shards *= mesh.shape[a]
    if size % shards:
        raise ValueError(f"{what} ({size}) must be divisible by the size of {name} {axes} "
                         f"({shards}); pass {name}=() to replicate instead")


def _reshard(x, mesh, spec):
    """Brings x to `spec` on meshes with Explicit axes; Auto axes are left to shard_map."""
    explicit = {a for a, ty in zip(mesh.axis_names, mesh.axis_types) if ty == AxisType.Explicit}
    if not explicit:
        return x

    def keep(entry):
        if entry is None:
            return None
        entry = (entry,) if isinstance(entry, str) else entry
        kept = tuple(a for a in entry if a in explicit)
        return kept or None

    return jax.reshard(x, NamedSharding(mesh, P(*(keep(e) for e in spec))))


def _rotate(x, axis, n):
    """Sends x one step around the ring (device i -> i + 1)."""
    if n == 1:
        return x
    return lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)])


# ----------------------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _ring(q, k, v, q_pos, q_seg, kv_pos, kv_seg, axis, causal, scale, bq, bk):
    return _ring_fwd(q, k, v, q_pos, q_seg, kv_pos, kv_seg, axis, causal, scale, bq, bk)[0]


def _ring_fwd(q, k, v, q_pos, q_seg, kv_pos, kv_seg, axis, causal, scale, bq, bk):
    n = lax.axis_size(axis)
    # Tie the token arrays to q, or a differentiated scan around this call (the model's
    # layers) hoists their loop-invariant masks out of it, for all block pairs at once.
    q, q_pos, q_seg, kv_pos, kv_seg = lax.optimization_barrier((q, q_pos, q_seg, kv_pos, kv_seg))
    axes = bw.varying_axes(q, k, v, q_pos, q_seg, kv_pos, kv_seg)
    q_blocks = bw.split_q(q, k.shape[2], bq)
    qpos, qseg = bw.split_tokens(q_pos, bq), bw.split_tokens(q_seg, bq)
    kv = (bw.split_kv(k, bk), bw.split_kv(v, bk), bw.split_tokens(kv_pos, bk),
          bw.split_tokens(kv_seg, bk))

    def step(carry, _):
        state, kv = carry
        kv_next = _rotate(kv, axis, n)  # in flight while this shard is computed
        state = bw.forward_blocks(q_blocks, kv[0], kv[1], qpos, kv[2], qseg, kv[3], state,
                                  causal=causal, scale=scale)
        return (state, kv_next), None

    (state, _), _ = lax.scan(step, (bw.init_state(q_blocks, axes), kv), None, length=n)
    out, lse = bw.finalize(state, q.dtype)
    out = bw.merge_q(out)
    return out, (q, k, v, out, lse, q_pos, q_seg, kv_pos, kv_seg)


def _ring_bwd(axis, causal, scale, bq, bk, res, dout):
    q, k, v, out, lse, q_pos, q_seg, kv_pos, kv_seg = res
    n = lax.axis_size(axis)
    kv_heads = k.shape[2]
    dout = dout.astype(q.dtype)
    axes = bw.varying_axes(res, dout)
    q_blocks, do_blocks = bw.split_q(q, kv_heads, bq), bw.split_q(dout, kv_heads, bq)
    delta = bw.delta_rows(do_blocks, bw.split_q(out, kv_heads, bq))
    qpos, qseg = bw.split_tokens(q_pos, bq), bw.split_tokens(q_seg, bq)
    kv = (bw.split_kv(k, bk), bw.split_kv(v, bk), bw.split_tokens(kv_pos, bk),
          bw.split_tokens(kv_seg, bk))
    dkv_zero = bw.make_varying(jnp.zeros(kv[0].shape, _F32), axes)

    def step(carry, _):
        # dkv holds the finished-here gradient of the shard this device saw last step; it
        # travels to the next device, which sees that shard now and adds its part.
        dq, kv, dkv = carry
        kv_next = _rotate(kv, axis, n)
        dkv_in = _rotate(dkv, axis, n)
        dq, dk, dv = bw.backward_blocks(q_blocks, kv[0], kv[1], do_blocks, lse, delta, qpos,
                                        kv[2], qseg, kv[3], dq, causal=causal, scale=scale,
                                        axes=axes)
        return (dq, kv_next, (dkv_in[0] + dk, dkv_in[1] + dv)), None

    dq0 = bw.make_varying(jnp.zeros(q_blocks.shape, _F32), axes)
    (dq, _, dkv), _ = lax.scan(step, (dq0, kv, (dkv_zero, dkv_zero)), None, length=n)
    dk, dv = _rotate(dkv, axis, n)  # the last hop brings each shard's gradient home
    return (bw.merge_q(dq).astype(q.dtype), bw.merge_kv(dk).astype(k.dtype),
            bw.merge_kv(dv).astype(v.dtype), None, None, None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)
