"""The decoder's behaviour: causality, cache decoding, packing, sharding, remat, dtypes."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ptrain import model as M
from ptrain import sharding

CONFIG = M.ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                       qkv_bias=True, qk_norm=True, rope_theta=1e4)


def _model(config=CONFIG, seed=0, mesh=None):
    """A model whose norms and biases are random too, so that a wrong one shows."""
    def make():
        model = M.Transformer(config, rngs=nnx.Rngs(seed), mesh=mesh)
        graphdef, state = nnx.split(model)
        leaves, tree = jax.tree.flatten(state)
        keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
        leaves = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
        return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))
    return sharding.create_sharded(make, mesh)


@functools.cache
def _shared(config=CONFIG):
    """`_model(config)`, built once for the tests that only read it (each build compiles)."""
    return _model(config)


@nnx.jit
def _jit_forward(model, tokens, positions=None, segments=None, cache=None):
    return model(tokens, positions, segments, cache=cache)


def _forward(model, tokens, positions=None, segments=None, cache=None):
    """The jitted forward; its logits as a numpy array, so that slicing and comparing them
    compiles nothing (each eager op on a jax array is a compile of its own)."""
    out = _jit_forward(model, tokens, positions, segments, cache)
    if cache is None:
        return np.asarray(out)
    return np.asarray(out[0]), out[1]


def _tokens(b=2, t=12, seed=0, vocab=96):
    return np.random.RandomState(seed).randint(0, vocab, (b, t)).astype(np.int32)


def test_causal():
    model = _shared()
    tokens = _tokens()
    changed = tokens.copy()
    changed[:, 7:] = (tokens[:, 7:] + 1) % 96
    a, b = _forward(model, tokens), _forward(model, changed)
    np.testing.assert_array_equal(a[:, :7], b[:, :7])
    assert np.abs(a[:, 7:] - b[:, 7:]).max() > 1e-3


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])  # MHA, GQA, MQA
def test_decode_through_cache_matches_full_forward(n_kv_heads):
    config = CONFIG.replace(n_kv_heads=n_kv_heads)
    model = _shared(config)
    tokens = _tokens(t=11)
    full = _forward(model, tokens)
    cache = M.init_cache(config, batch=2, max_len=16)
    logits, cache = _forward(model, tokens[:, :5], cache=cache)  # prefill a chunk
    steps = [logits]
    for i in range(5, 11):  # then one token at a time
        logits, cache = _forward(model, tokens[:, i:i + 1], cache=cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)
    assert int(cache.index) == 11
    assert (np.asarray(cache.segment_ids_bs)[:, 11:] == 0).all()


def test_left_padded_cache_matches_unpadded_rows():
    """Prompts of different lengths, left-padded in one batch, give each row's own logits."""
    model = _shared()
    long, short = _tokens(b=1, t=9, seed=1), _tokens(b=1, t=6, seed=2)
    pad = 3
    tokens = np.concatenate([long, np.pad(short, ((0, 0), (pad, 0)))], axis=0)
    segments = np.asarray([[1] * 9, [0] * pad + [1] * 6], np.int32)
    positions = np.maximum(np.cumsum(segments, axis=1) - 1, 0).astype(np.int32)
    cache = M.init_cache(CONFIG, batch=2, max_len=12)
    logits, cache = _forward(model, tokens, positions, segments, cache=cache)
    np.testing.assert_allclose(logits[0], _forward(model, long)[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[1, pad:], _forward(model, short)[0], atol=1e-5, rtol=0)
    next_tokens = _tokens(b=2, t=1, seed=3)
    step, _ = _forward(model, next_tokens, positions[:, -1:] + 1, np.ones((2, 1), np.int32),
                       cache=cache)
    continued = _forward(model, np.concatenate([short, next_tokens[1:]], 1))
    np.testing.assert_allclose(step[1], continued[0, -1:], atol=1e-5, rtol=0)


def test_packed_documents_equal_documents_one_by_one():
    model = _shared()
    docs = [_tokens(b=1, t=n, seed=n) for n in (5, 3, 6)]
    packed = np.concatenate(docs, axis=1)
    segments = np.concatenate([np.full((1, d.shape[1]), i + 1, np.int32)
                               for i, d in enumerate(docs)], 1)
    positions = np.concatenate([np.arange(d.shape[1], dtype=np.int32)[None] for d in docs], 1)
    packed = np.pad(packed, ((0, 0), (0, 2)))  # two padding tokens at the end (segment 0)
    segments, positions = np.pad(segments, ((0, 0), (0, 2))), np.pad(positions, ((0, 0), (0, 2)))
    logits = _forward(model, packed, positions, segments)
    start = 0
    for doc in docs:
        n = doc.shape[1]
        np.testing.assert_allclose(logits[:, start:start + n], _forward(model, doc),
                                   atol=1e-5, rtol=0)
        start += n
    assert np.isfinite(np.asarray(logits)).all()


def _loss_fn(graphdef, state, tokens):
    logits = nnx.merge(graphdef, state)(tokens)
    return -jnp.mean(jax.nn.log_softmax(logits)[:, :-1].max(-1))


def test_sharded_forward_and_grads_equal_unsharded():
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    ref = _shared()
    sharded = _model(mesh=mesh)
    wq = sharded.layers.wq[...]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert len({str(s.index) for s in wq.addressable_shards}) == 4  # 4 slices on 8 devices
    w_down = sharded.layers.w_down[...]
    assert w_down.sharding.spec == jax.sharding.PartitionSpec(None, "tensor", "fsdp")

    tokens = _tokens(b=4)
    g_ref, s_ref = nnx.split(ref)
    g, s = nnx.split(sharded)
    np.testing.assert_allclose(
        jax.jit(lambda s, x: nnx.merge(g, s)(x))(s, sharding.shard_batch(tokens, mesh)),
        _forward(ref, tokens), atol=1e-5, rtol=0)
    grad_fn = jax.jit(jax.grad(_loss_fn, argnums=1), static_argnums=0)
    grads = grad_fn(g, s, sharding.shard_batch(tokens, mesh))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grad_fn(g_ref, s_ref, tokens))):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_parameters_that_do_not_divide_are_replicated():
    mesh = sharding.make_mesh(fsdp=2, tensor=4)
    config = CONFIG.replace(n_kv_heads=2)  # 2 kv heads over tensor=4: replicate, don't fail
    model = M.init(config, mesh=mesh)
    assert model.layers.wk[...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", None, None)
    assert model.layers.wq[...].sharding.spec == jax.sharding.PartitionSpec(
        None, "fsdp", "tensor", None)
    assert _forward(model, _tokens()).shape == (2, 12, 96)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_changes_nothing_numerically(remat):
    ref = _shared()
    g, s = nnx.split(ref)
    g_remat, _ = nnx.split(nnx.eval_shape(lambda: _model(CONFIG.replace(remat=remat))))
    tokens = _tokens()
    grad_fn = jax.jit(jax.grad(_loss_fn, argnums=1), static_argnums=0)
    grads, grads_remat = grad_fn(g, s, tokens), grad_fn(g_remat, s, tokens)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_remat)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_program_size_does_not_grow_with_depth():
    """Layers are scanned: the traced program is the same size for 2 and 16 layers."""
    def n_equations(n_layers):
        config = CONFIG.replace(n_layers=n_layers)
        g, s = nnx.split(nnx.eval_shape(lambda: M.Transformer(config, rngs=nnx.Rngs(0))))
        jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(g, s)(x))(s, _tokens())
        return len(jaxpr.jaxpr.eqns)

    assert n_equations(2) == n_equations(16)


def test_dtypes():
    config = CONFIG.replace(param_dtype="float32", dtype="bfloat16")
    g, s = nnx.split(_shared())
    mixed = nnx.merge(nnx.split(nnx.eval_shape(lambda: M.init(config)))[0], s)
    h, _ = nnx.jit(lambda m, x: m.hidden(x))(mixed, _tokens())
    assert h.dtype == jnp.bfloat16
    logits = _forward(mixed, _tokens())
    assert logits.dtype == jnp.float32
    ref = _forward(nnx.merge(g, s), _tokens())
    assert np.abs(logits - ref).max() < 0.05 * np.abs(ref).max()

    bf16 = M.init(CONFIG.replace(param_dtype="bfloat16", dtype="bfloat16"))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(bf16, nnx.Param)))


def test_param_count_matches_config():
    for config in (CONFIG, CONFIG.replace(tie_embeddings=True, qkv_bias=False, qk_norm=False)):
        abstract = nnx.eval_shape(lambda: M.Transformer(config, rngs=nnx.Rngs(0)))
        assert M.param_count(abstract) == config.n_params


@pytest.mark.parametrize("change, message", [
    (dict(n_kv_heads=3), "multiple of n_kv_heads"),
    (dict(rope_type="longrope"), "rope_type 'longrope' is not supported"),
    (dict(remat="some"), "remat 'some'"),
    (dict(attention_impl="magic"), "attention_impl 'magic'"),
    (dict(dtype="float16"), "dtype must be one of"),
])
def test_bad_config_is_rejected(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CONFIG, **change)


def test_mesh_sizes():
    mesh = sharding.make_mesh(data=2, fsdp=-1, tensor=2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 2}
    with pytest.raises(ValueError, match="needs 16 devices but 8"):
        sharding.make_mesh(data=4, fsdp=2, tensor=2)
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        sharding.make_mesh(data=-1, fsdp=-1)


@pytest.mark.parametrize("axes", [dict(data=2, fsdp=4), dict(fsdp=2, tensor=4),
                                  dict(fsdp=2, sequence=2, tensor=2)])
def test_the_projections_gather_no_activations(axes):
    """`projection.dense` flattens [b, t] into one token axis (XLA:CPU's weight gradients are 2x
    faster so); on a mesh that must not gather activations: the step's all-gathers are the
    weights' (FSDP) only, whatever the mesh shards."""
    mesh = sharding.make_mesh(**axes)
    config = CONFIG.replace(vocab_size=128, d_ff=64,  # every weight's (shard's) size 2^n
                            attention_impl="ring" if "sequence" in axes else "blockwise")
    g, s = nnx.split(M.init(config, mesh=mesh))
    b, t = 24, 40  # and no activation's
    tokens = sharding.shard_batch(_tokens(b=b, t=t, vocab=128), mesh)
    hlo = jax.jit(jax.grad(_loss_fn, argnums=1), static_argnums=0).lower(
        g, s, tokens).compile().as_text()
    gathered = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", hlo)
    assert gathered  # (FSDP gathers every layer's weights)
    local = {b, t, b // 2, b // 4, b // 8, t // 2}
    activations = [shape for shape in gathered if local & {int(n) for n in shape.split(",")}]
    assert not activations, f"all-gathers of activations: {activations}"
