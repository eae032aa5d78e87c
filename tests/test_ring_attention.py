"""Ring attention on 8 simulated CPU devices against a dense float32 softmax.

Covers ring sizes 1-8, the three layouts (restored before comparing), causal and not, GQA 1/4
and MQA, packed documents crossing shard edges, padding, bfloat16, the data/tensor axes passing
through, the per-shard entry point, and the structure (no all-gather; memory per device falls
with ring size).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from attention_reference import assert_close, dense_attention, out_and_grads, packed_segments
from attention_reference import qkv
from long_context import layout_permutation, reorder, restore, ring_attention
from long_context import ring_attention_shard

TOL = 1e-5
T = 128
# Row 0: a 50-token document over shards 0-3 of 8 (and 1-2 of 4), then padding.
# Row 1: a 1-token document and a 70-token one spanning 5 of 8 shards.
DOCS = [[5, 50, 3, 40, 20], [1, 70, 20, 37]]


def _seq_mesh(n):
    return jax.make_mesh((n,), ("sequence",), devices=jax.devices()[:n])


def _ring_vs_dense(mesh, n, layout, causal, h, kv_heads, packed, b=2, d=16, dtype=jnp.float32,
                   **kwargs):
    """Runs ring attention in `layout`, restores the order, returns (ours, reference, seg)."""
    q, k, v, w = qkv(b, T, h, kv_heads, d, dtype=dtype)
    seg = packed_segments(DOCS[:b], T) if packed else None
    pos = jnp.broadcast_to(jnp.asarray(layout_permutation(T, layout, n)), (b, T))

    def ours(q, k, v):
        r = lambda x: reorder(x, layout, n)
        out = ring_attention(r(q), r(k), r(v), mesh=mesh, causal=causal,
                             segment_ids=None if seg is None else r(seg), positions=pos,
                             block_q=8, block_k=16, **kwargs)
        return restore(out, layout, n)

    def ref(q, k, v):
        return dense_attention(q, k, v, causal=causal, segment_ids=seg)

    up = [x.astype(jnp.float32) for x in (q, k, v, w)]
    return out_and_grads(ours, q, k, v, w), out_and_grads(ref, *up), seg


# (ring size, layout, causal, heads, kv heads, packed documents with padding)
CASES = [
    pytest.param(1, "contiguous", True, 4, 4, False, id="n1-contiguous-causal-mha"),
    pytest.param(2, "zigzag", True, 8, 2, True, id="n2-zigzag-causal-gqa4-packed"),
    pytest.param(2, "striped", False, 4, 1, False, id="n2-striped-noncausal-mqa"),
    pytest.param(4, "contiguous", True, 4, 1, True, id="n4-contiguous-causal-mqa-packed"),
    pytest.param(4, "striped", True, 8, 2, True, id="n4-striped-causal-gqa4-packed"),
    pytest.param(4, "zigzag", False, 4, 4, True, id="n4-zigzag-noncausal-mha-packed"),
    pytest.param(8, "zigzag", True, 4, 4, True, id="n8-zigzag-causal-mha-packed"),
    pytest.param(8, "striped", True, 4, 1, False, id="n8-striped-causal-mqa"),
    pytest.param(8, "contiguous", False, 8, 2, True, id="n8-contiguous-noncausal-gqa4-packed"),
]


@pytest.mark.parametrize("n,layout,causal,h,kv_heads,packed", CASES)
def test_matches_dense_softmax(n, layout, causal, h, kv_heads, packed):
    (out, grads), (ref_out, ref_grads), seg = _ring_vs_dense(_seq_mesh(n), n, layout, causal, h,
                                                             kv_heads, packed)
    assert out.dtype == jnp.float32
    assert_close(out, ref_out, TOL, "output")
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, TOL, f"d{name}")
    if packed:  # padding rows: finite zeros, and no gradient flows to or from them
        pad = np.asarray(seg) == 0
        assert pad.any()
        for name, x in zip(("out", "dq", "dk", "dv"), (out, *grads)):
            assert np.isfinite(np.asarray(x)).all()
            np.testing.assert_array_equal(np.asarray(x)[pad], 0.0, err_msg=name)


def test_batch_and_heads_stay_sharded_over_data_and_tensor():
    # An Auto mesh; batch over "data", heads over "tensor" (inferred), sequence ring of 2.
    mesh = jax.make_mesh((2, 2, 2), ("data", "sequence", "tensor"),
                         axis_types=(AxisType.Auto,) * 3)
    (out, grads), (ref_out, ref_grads), _ = _ring_vs_dense(mesh, 2, "zigzag", True, 8, 2, True)
    assert_close(out, ref_out, TOL, "output")
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, TOL, f"d{name}")


def test_bfloat16_inputs_give_bfloat16_outputs_and_gradients():
    (out, grads), (ref_out, ref_grads), _ = _ring_vs_dense(
        _seq_mesh(4), 4, "zigzag", True, 8, 2, True, b=1, d=32, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3
    assert_close(out, ref_out, 2e-2, "output")
    for name, g, rg in zip("qkv", grads, ref_grads):
        scale = float(jnp.abs(rg).max())
        assert_close(g.astype(jnp.float32) / scale, rg / scale, 2e-2, f"d{name}")


def test_per_shard_function_inside_a_users_shard_map():
    n, b, h, d = 4, 2, 4, 16
    mesh = _seq_mesh(n)
    q, k, v, w = qkv(b, T, h, 2, d, seed=3)
    seg = packed_segments(DOCS, T)
    spec_x, spec_t = P(None, "sequence"), P(None, "sequence")

    def ours(q, k, v):
        # Contiguous layout: the per-shard default positions are axis_index * t_local + arange.
        body = lambda q, k, v, s: ring_attention_shard(q, k, v, segment_ids=s, block_q=16,
                                                       block_k=8)
        sm = jax.shard_map(body, mesh=mesh, in_specs=(spec_x, spec_x, spec_x, spec_t),
                           out_specs=spec_x)
        put = lambda x, s: jax.reshard(x, NamedSharding(mesh, s))
        return sm(put(q, spec_x), put(k, spec_x), put(v, spec_x), put(seg, spec_t))

    out, grads = out_and_grads(ours, q, k, v, w)
    ref_out, ref_grads = out_and_grads(
        lambda q, k, v: dense_attention(q, k, v, causal=True, segment_ids=seg), q, k, v, w)
    assert_close(out, ref_out, TOL, "output")
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, TOL, f"d{name}")


def _compiled_grad(n, t, h=2, d=32, block=128):
    mesh = _seq_mesh(n)
    sharding = NamedSharding(mesh, P(None, "sequence"))
    x = jax.ShapeDtypeStruct((1, t, h, d), jnp.float32, sharding=sharding)
    loss = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, block_q=block,
                                          block_k=block).sum()
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return jax.make_jaxpr(grad)(x, x, x), grad.lower(x, x, x).compile()


def test_ring_moves_kv_by_ppermute_and_never_all_gathers():
    jaxpr, compiled = _compiled_grad(4, 512)
    jaxpr, hlo = str(jaxpr), compiled.as_text()
    assert "ppermute" in jaxpr and "collective-permute" in hlo
    assert "all_gather" not in jaxpr and "all-gather" not in hlo
    assert "all-to-all" not in hlo and "all-reduce" not in hlo


def test_memory_per_device_falls_with_ring_size():
    def per_device_bytes(n):
        mem = _compiled_grad(n, 4096)[1].memory_analysis()
        return mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes

    sizes = [per_device_bytes(n) for n in (1, 2, 4, 8)]
    for smaller, larger in zip(sizes[1:], sizes):  # each doubling of the ring
        assert smaller < 0.7 * larger, sizes
    assert sizes[3] < sizes[0] / 4, sizes


def test_layouts_match_their_definitions_and_balance_causal_work():
    n, t = 2, 8
    np.testing.assert_array_equal(layout_permutation(t, "contiguous", n), np.arange(8))
    np.testing.assert_array_equal(layout_permutation(t, "zigzag", n), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(layout_permutation(t, "striped", n), [0, 2, 4, 6, 1, 3, 5, 7])
    x = np.arange(2 * 64 * 3).reshape(2, 64, 3)
    for layout in ("contiguous", "zigzag", "striped"):
        np.testing.assert_array_equal(restore(reorder(x, layout, 4), layout, 4), x)
        np.testing.assert_array_equal(
            np.asarray(restore(reorder(jnp.asarray(x), layout, 4), layout, 4)), x)
        # Causal (query, key) pairs per shard: a balanced layout gives every shard the same.
        pos = layout_permutation(64, layout, 4).reshape(4, 16)
        work = [(p[:, None] >= np.arange(64)[None]).sum() for p in pos]
        if layout == "contiguous":
            assert work[-1] > 6 * work[0]
        else:
            assert max(work) - min(work) <= 0.1 * max(work), (layout, work)
    with pytest.raises(ValueError, match="divisible by 8"):
        reorder(x[:, :60], "zigzag", 4)
    with pytest.raises(ValueError, match="unknown layout"):
        reorder(x, "spiral", 4)


@pytest.mark.parametrize("shape,kwargs,message", [
    ((1, 36, 4, 2), {}, "divisible by the 'sequence' axis size"),
    ((1, 32, 4, 2), dict(axis="seq"), "not a mesh axis"),
    ((1, 32, 4, 2), dict(batch_axes="sequence"), "other than 'sequence'"),
])
def test_bad_input_says_what_to_fix(shape, kwargs, message):
    b, t, h, kv_heads = shape
    q, k = jnp.ones((b, t, h, 8)), jnp.ones((b, t, kv_heads, 8))
    with pytest.raises(ValueError, match=message):
        ring_attention(q, k, k, mesh=_seq_mesh(8), **kwargs)


def test_kv_heads_must_divide_the_tensor_axis():
    mesh = jax.make_mesh((2, 4), ("sequence", "tensor"))
    q, k = jnp.ones((1, 32, 4, 8)), jnp.ones((1, 32, 2, 8))
    with pytest.raises(ValueError, match="kv heads"):
        ring_attention(q, k, k, mesh=mesh)
