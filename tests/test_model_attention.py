"""Every attention implementation inside the model, and sequence parallelism end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import long_context
from ptrain import model as M
from ptrain import sharding

CONFIG = M.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                       qk_norm=True, attn_block_q=8, attn_block_k=8)
T = 64


def _batch(b=2, seed=0):
    """Two packed documents per row (one crossing the middle) and padding at the end."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, CONFIG.vocab_size, (b, T))
    cut, pad = 23, 5
    segments = np.concatenate([np.ones((b, cut)), 2 * np.ones((b, T - cut - pad)),
                               np.zeros((b, pad))], axis=1).astype(np.int32)
    positions = np.concatenate([np.arange(cut), np.arange(T - cut - pad), np.zeros(pad)])
    positions = np.broadcast_to(positions, (b, T)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    mask = (segments > 0) & (np.roll(segments, -1, axis=1) == segments)  # same doc next
    mask[:, -1] = False
    return dict(tokens=tokens, positions=positions, segments=segments, targets=targets,
                mask=mask.astype(np.float32))


def _loss(graphdef, state, batch):
    model = nnx.merge(graphdef, state)
    logits = model(batch["tokens"], batch["positions"], batch["segments"])
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    return jnp.sum(nll * batch["mask"]) / jnp.sum(batch["mask"])


_loss_and_grad = jax.jit(jax.value_and_grad(_loss, argnums=1), static_argnums=0)


def _model(config, mesh=None):
    return M.init(config, seed=3, mesh=mesh)


@pytest.fixture(scope="module")
def reference():
    model = _model(CONFIG)
    graphdef, state = nnx.split(model)
    loss, grads = _loss_and_grad(graphdef, state, _batch())
    return state, loss, grads


@pytest.mark.parametrize("impl", ["blockwise", "cudnn", "ring"])  # ring without a mesh: blockwise
def test_impl_matches_reference(impl, reference):
    state, loss_ref, grads_ref = reference
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: _model(CONFIG.replace(attention_impl=impl))))
    loss, grads = _loss_and_grad(graphdef, state, _batch())
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_blockwise_decoding_through_the_cache(reference):
    state, _, _ = reference
    config = CONFIG.replace(attention_impl="blockwise")
    model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: _model(config))), state)
    forward = nnx.jit(lambda m, x, c=None: m(x, cache=c))
    tokens = jnp.asarray(_batch()["tokens"][:, :20])
    full = forward(model, tokens)
    logits, cache = forward(model, tokens[:, :12], M.init_cache(config, 2, 24))
    steps = [logits]
    for i in range(12, 20):
        logits, cache = forward(model, tokens[:, i:i + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mesh_shape, layout", [
    (dict(sequence=8), "contiguous"),
    (dict(sequence=8), "zigzag"),
    (dict(fsdp=2, sequence=2, tensor=2), "striped"),
])
def test_sequence_parallel_model_equals_one_device(mesh_shape, layout, reference):
    """The whole model with ring attention over the `sequence` axis: same loss and grads."""
    _, loss_ref, grads_ref = reference
    mesh = sharding.make_mesh(**{"fsdp": 1, **mesh_shape})
    shards = mesh.shape["sequence"]
    config = CONFIG.replace(attention_impl="ring")
    model = _model(config, mesh)
    graphdef, state = nnx.split(model)
    # Load balancing reorders the tokens once; positions travel with them, so RoPE and the
    # causal rule see the true positions, and the loss (a masked sum) does not care.
    batch = {k: long_context.reorder(v, layout, shards, axis=1) for k, v in _batch().items()}
    batch = sharding.shard_batch(batch, mesh)
    assert batch["tokens"].sharding.spec[1] == "sequence"
    assert "collective_permute" in _loss_and_grad.lower(graphdef, state, batch).as_text()
    loss, grads = _loss_and_grad(graphdef, state, batch)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=0)
