"""blockwise_attention against a dense float32 softmax: outputs, gradients, dtypes, memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_reference import assert_close, dense_attention, out_and_grads, packed_segments
from attention_reference import qkv
from long_context import blockwise_attention, layout_permutation

TOL = 1e-5

# (causal, heads, kv_heads, t, block_q, block_k, packed, reordered positions)
CASES = [
    pytest.param(True, 4, 4, 100, 16, 32, False, False, id="causal-mha-t_not_multiple"),
    pytest.param(True, 8, 2, 96, 32, 16, True, False, id="causal-gqa4-packed"),
    pytest.param(False, 4, 1, 64, 16, 16, True, False, id="noncausal-mqa-packed"),
    pytest.param(False, 4, 4, 48, 512, 512, False, False, id="noncausal-blocks_over_t"),
    pytest.param(True, 4, 1, 64, 8, 8, True, True, id="causal-mqa-zigzag_positions"),
]


@pytest.mark.parametrize("causal,h,kv_heads,t,block_q,block_k,packed,reordered", CASES)
def test_matches_dense_softmax(causal, h, kv_heads, t, block_q, block_k, packed, reordered):
    b, d = 2, 16
    q, k, v, w = qkv(b, t, h, kv_heads, d)
    seg = packed_segments([[5, t // 2, 3], [1, t - 20, 7]], t) if packed else None
    pos = None
    if reordered:  # tokens in zigzag order over 4 shards, positions carried along
        perm = layout_permutation(t, "zigzag", 4)
        q, k, v, w = (x[:, perm] for x in (q, k, v, w))
        seg = None if seg is None else seg[:, perm]
        pos = jnp.broadcast_to(jnp.asarray(perm), (b, t))

    def ours(q, k, v):
        return blockwise_attention(q, k, v, causal=causal, segment_ids=seg, positions=pos,
                                   block_q=block_q, block_k=block_k)

    def ref(q, k, v):
        return dense_attention(q, k, v, causal=causal, segment_ids=seg, positions=pos)

    out, grads = out_and_grads(ours, q, k, v, w)
    ref_out, ref_grads = out_and_grads(ref, q, k, v, w)
    assert out.shape == (b, t, h, d) and out.dtype == jnp.float32
    assert_close(out, ref_out, TOL, "output")
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert g.shape == rg.shape
        assert_close(g, rg, TOL, f"d{name}")


def test_queries_against_a_longer_cache():
    # Prefill of 40 new tokens into a 96-slot cache holding 30 old ones; 26 slots are empty.
    b, t, s, h, d = 2, 40, 96, 4, 16
    q, _, _, w = qkv(b, t, h, 2, d, seed=4)
    _, k, v, _ = qkv(b, s, h, 2, d, seed=5)
    pos = jnp.broadcast_to(30 + jnp.arange(t), (b, t))
    kv_pos = jnp.broadcast_to(jnp.arange(s), (b, s))
    seg = jnp.ones((b, t), jnp.int32)
    kv_seg = (kv_pos < 70).astype(jnp.int32)
    kw = dict(causal=True, segment_ids=seg, positions=pos, kv_segment_ids=kv_seg,
              kv_positions=kv_pos)
    out, grads = out_and_grads(
        lambda q, k, v: blockwise_attention(q, k, v, block_q=16, block_k=32, **kw), q, k, v, w)
    ref_out, ref_grads = out_and_grads(lambda q, k, v: dense_attention(q, k, v, **kw),
                                       q, k, v, w)
    assert_close(out, ref_out, TOL, "output")
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, TOL, f"d{name}")
    with pytest.raises(ValueError, match="pass both segment_ids and kv_segment_ids"):
        blockwise_attention(q, k, v, segment_ids=seg)


def test_padding_rows_are_zero_with_zero_gradients():
    b, t, h, d = 2, 64, 4, 16
    q, k, v, w = qkv(b, t, h, 2, d, seed=1)
    seg = packed_segments([[20, 30], [64]], t)  # row 0 ends in 14 padding tokens
    fn = lambda q, k, v: blockwise_attention(q, k, v, segment_ids=seg, block_q=16, block_k=16)
    out, (dq, dk, dv) = out_and_grads(fn, q, k, v, w)
    for x in (out, dq, dk, dv):
        assert np.isfinite(np.asarray(x)).all()
    pad = np.asarray(seg) == 0
    assert pad.sum() == 14
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        np.testing.assert_array_equal(np.asarray(x)[pad], 0.0, err_msg=name)
    assert np.abs(np.asarray(out)[~pad]).min(axis=-1).max() > 0  # real rows are not zeroed


def test_bfloat16_inputs_give_bfloat16_outputs_and_gradients():
    b, t, h, d = 1, 64, 8, 32
    q, k, v, w = qkv(b, t, h, 2, d, dtype=jnp.bfloat16, seed=2)
    fn = lambda q, k, v: blockwise_attention(q, k, v, block_q=16, block_k=16)
    out, grads = out_and_grads(fn, q, k, v, w)
    up = [x.astype(jnp.float32) for x in (q, k, v, w)]
    ref_out, ref_grads = out_and_grads(lambda q, k, v: dense_attention(q, k, v, causal=True),
                                       *up)
    assert out.dtype == jnp.bfloat16
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3
    assert_close(out, ref_out, 2e-2, "output")
    for name, g, rg in zip("qkv", grads, ref_grads):
        scale = float(jnp.abs(rg).max())
        assert_close(g / scale, rg / scale, 2e-2, f"d{name}")


def test_saves_only_q_k_v_out_and_logsumexp():
    b, t, h, kv_heads, d = 1, 128, 4, 2, 16
    q, k, v, _ = qkv(b, t, h, kv_heads, d)
    _, vjp = jax.vjp(lambda q, k, v: blockwise_attention(q, k, v, block_q=32, block_k=32),
                     q, k, v)
    saved = [x for x in jax.tree.leaves(vjp) if jnp.issubdtype(x.dtype, jnp.floating)]
    expected = sorted([q.size, k.size, v.size, q.size, b * h * t])  # q, k, v, out, lse
    assert sorted(x.size for x in saved) == expected


def _temp_bytes(fn, t, h=4, d=32):
    q = jax.ShapeDtypeStruct((1, t, h, d), jnp.float32)
    grad = jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))
    return jax.jit(grad).lower(q, q, q).compile().memory_analysis().temp_size_in_bytes


def test_memory_grows_linearly_with_length():
    lengths = (512, 2048)
    ours = [_temp_bytes(lambda q, k, v: blockwise_attention(q, k, v, block_q=64, block_k=64), t)
            for t in lengths]
    dense = [_temp_bytes(lambda q, k, v: dense_attention(q, k, v, causal=True), t)
             for t in lengths]
    # 4x the length: linear memory grows about 4x, quadratic memory 16x.
    assert ours[1] / ours[0] < 6, ours
    assert dense[1] / dense[0] > 10, dense  # the measurement does see quadratic growth
    assert ours[1] * 10 < dense[1]


@pytest.mark.parametrize("kwargs,message", [
    (dict(kv_heads=3), "multiple of kv heads"),
    (dict(segment_ids=jnp.zeros((1, 32), jnp.float32)), "must be integers"),
    (dict(positions=jnp.zeros((1, 16), jnp.int32)), "shape"),
    (dict(block_q=0), "positive"),
])
def test_bad_input_says_what_to_fix(kwargs, message):
    kv_heads = kwargs.pop("kv_heads", 2)
    q, k = jnp.ones((1, 32, 4, 8)), jnp.ones((1, 32, kv_heads, 8))
    with pytest.raises(ValueError, match=message):
        blockwise_attention(q, k, k, **kwargs)
