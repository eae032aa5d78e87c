"""Mixture of experts: dispatch equivalences, expert parallelism, imbalance, replay, losses.

The dense dispatch (every token through every expert, weighted by its combine weights) is
the reference the dropless and capacity dispatches must equal; transformers' own modules are
the reference for routing and logits (tests/test_hf.py) and for the load-balancing loss.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ptrain import model as M
from ptrain import moe
from ptrain import sharding

# Layer 0 dense (HF mlp_only_layers), layers 1-2 MoE: two stages, as few compiles as can be.
CONFIG = M.ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48,
                       qk_norm=True, n_experts=8, n_experts_per_token=2, d_ff_expert=16,
                       norm_topk_prob=True, dense_layers=(0,), attention_impl="reference")


# Everything runs jitted (one compile per shape and setting): eager shard_map, scans and
# sorts are many times slower than their compiles.
_block = jax.jit(moe.block, static_argnums=(3, 4))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(params, tokens, replay=None, *, graphdef):
    return nnx.merge(graphdef, params).forward(tokens, replay_lbtk=replay)


def _tokens(b=8, t=8, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, CONFIG.vocab_size, (b, t)))


def _model(config=CONFIG, mesh=None, seed=0):
    """Norms and router perturbed too, so that a wrong one shows."""
    def make():
        model = M.Transformer(config, rngs=nnx.Rngs(seed), mesh=mesh)
        graphdef, state = nnx.split(model)
        leaves, tree = jax.tree.flatten(state)
        keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
        leaves = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
        return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))
    return sharding.create_sharded(make, mesh)


@pytest.fixture(scope="module")
def reference():
    """The perturbed model on one device, and its logits and gradients."""
    model = _model()
    return model, _logits_and_grads(model, _tokens())


def _on_mesh(model, mesh):
    """The same parameters placed on `mesh` (no re-initialisation to compile)."""
    graphdef, abstract = sharding.abstract(
        lambda: M.Transformer(model.config, rngs=nnx.Rngs(0), mesh=mesh), mesh)
    params = nnx.state(model)
    # From host memory: a device-to-mesh put compiles a slicing program per leaf shape.
    placed = jax.tree.map(lambda x, a: jax.device_put(np.asarray(x), a.sharding), params,
                          abstract)
    return nnx.merge(graphdef, placed)


def _logits_and_grads(model, tokens):
    graphdef, params = nnx.split(model)
    weights = jax.random.normal(jax.random.key(7), tokens.shape + (CONFIG.vocab_size,))
    weights = weights / tokens.size  # gradients of order one

    @jax.jit
    def run(params, tokens):
        def loss(params):
            logits = nnx.merge(graphdef, params)(tokens)
            return jnp.sum(logits * weights), logits
        (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return logits, grads

    logits, grads = run(params, tokens)
    return np.asarray(logits), jax.tree.map(np.asarray, grads)


def _assert_trees_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


def test_layer_kinds_follow_sparse_step_and_dense_layers():
    c = CONFIG.replace(n_layers=6, moe_layer_step=2, dense_layers=(3,))
    assert [moe.is_moe_layer(c, i) for i in range(6)] == [False, True, False, False, False, True]
    assert moe.stages(c) == [(False, 0, 1, 0), (True, 1, 2, 0), (False, 2, 5, 1),
                             (True, 5, 6, 1)]
    model = nnx.eval_shape(lambda: M.Transformer(c, rngs=nnx.Rngs(0)))
    assert model.layers.w_gate.shape == (4, 32, 48)  # dense MLPs of the 4 dense layers
    assert model.experts.w_gate.shape == (2, 8, 32, 16)
    assert M.param_count(model) == c.n_params
    assert c.n_active_params < c.n_params


@pytest.mark.parametrize("dispatch", ["dense", "capacity"])
def test_dispatch_equals_dense_reference(reference, dispatch):
    """Dropless (the default, `reference`) equals dense, and so does a capacity that cannot
    bind (every assignment fits)."""
    model, (want_logits, want_grads) = reference
    graphdef, state = nnx.split(model)
    config = CONFIG.replace(moe_dispatch=dispatch, moe_capacity_factor=8.0)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: M.Transformer(config, rngs=nnx.Rngs(0))))
    logits, grads = _logits_and_grads(nnx.merge(graphdef, state), _tokens())
    np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0)
    _assert_trees_close(grads, want_grads, 1e-5)


@pytest.mark.parametrize("mesh_shape", [
    dict(expert=1, fsdp=8), dict(expert=2, fsdp=2, tensor=2),
    dict(expert=4, sequence=2), dict(expert=8, fsdp=1)])
def test_expert_parallel_logits_and_grads_match_one_device(reference, mesh_shape):
    model, (want_logits, want_grads) = reference
    mesh = sharding.make_mesh(**{"fsdp": 1, **mesh_shape})
    model = _on_mesh(model, mesh)
    if mesh_shape["expert"] > 1:
        assert model.experts.w_gate[...].sharding.spec[1] == "expert"
    logits, grads = _logits_and_grads(model, sharding.shard_batch(_tokens(), mesh))
    np.testing.assert_allclose(logits, want_logits, atol=1e-5, rtol=0)
    _assert_trees_close(grads, want_grads, 1e-5)


def _forced_block(n=64, d=32, seed=0):
    """Block inputs whose router sends every token's first choice to expert 3."""
    rng = np.random.RandomState(seed)
    c = CONFIG
    h = rng.randn(n, d).astype(np.float32)
    h[:, 0] = 5.0 + np.abs(h[:, 0])
    router = 0.1 * rng.randn(d, c.n_experts).astype(np.float32)
    router[0, 3] = 20.0
    p = {"router": router,
         "w_gate": 0.05 * rng.randn(c.n_experts, d, c.d_ff_expert).astype(np.float32),
         "w_up": 0.05 * rng.randn(c.n_experts, d, c.d_ff_expert).astype(np.float32),
         "w_down": 0.05 * rng.randn(c.n_experts, c.d_ff_expert, d).astype(np.float32)}
    return jax.tree.map(jnp.asarray, p), jnp.asarray(h.reshape(8, n // 8, d))


@pytest.mark.parametrize("expert, batch", [(1, 8), (8, 8), (8, 2)])
def test_dropless_under_total_imbalance_equals_dense(expert, batch):
    """batch 2 on expert=8: the token block is replicated over expert and split inside."""
    p, h_btd = _forced_block()
    h_btd = h_btd.reshape(batch, -1, h_btd.shape[-1])
    valid = jnp.ones(h_btd.shape[:2], jnp.int32)
    ref, ref_stats = _block(p, h_btd, valid, CONFIG.replace(moe_dispatch="dense"), None)
    assert (np.asarray(ref_stats["experts_btk"])[..., 0] == 3).all()
    mesh = sharding.make_mesh(expert=expert, fsdp=-1)
    for dispatch in ("dropless", "capacity"):
        c = CONFIG.replace(moe_dispatch=dispatch, moe_capacity_factor=1.0)
        y, stats = _block(p, h_btd, valid, c, mesh)
        if dispatch == "dropless":
            np.testing.assert_allclose(y, ref, atol=1e-5, rtol=0)
            assert float(stats["dropped"]) == 0
            assert float(stats["load_e"][3]) == 64  # all 64 tokens reached expert 3
            np.testing.assert_array_equal(stats["experts_btk"], ref_stats["experts_btk"])
        else:  # capacity 1.0 keeps n * 2 / 8 per expert (per token shard)
            assert float(stats["dropped"]) > 0
            assert np.abs(np.asarray(y) - np.asarray(ref)).max() > 1e-2
    if (expert, batch) != (8, 8):
        return
    # Gradients too, through the sharded dispatch.
    c = CONFIG.replace(moe_dispatch="dropless")
    grad = jax.jit(jax.grad(lambda p: jnp.sum(moe.block(p, h_btd, valid, c, mesh)[0] ** 2)))(p)
    ref_c = CONFIG.replace(moe_dispatch="dense")
    want = jax.jit(jax.grad(lambda p: jnp.sum(moe.block(p, h_btd, valid, ref_c, None)[0] ** 2)))(p)
    _assert_trees_close(grad, want, 1e-5)


def test_padding_tokens_are_not_dispatched_or_counted():
    p, h_btd = _forced_block()
    valid = jnp.ones(h_btd.shape[:2], jnp.int32).at[:, -2:].set(0)
    for dispatch in moe.DISPATCHES:
        c = CONFIG.replace(moe_dispatch=dispatch, moe_capacity_factor=8.0)
        y, stats = _block(p, h_btd, valid, c, None)
        assert float(stats["tokens"]) == 48 and float(stats["load_e"].sum()) == 96
    y_full, _ = _block(p, h_btd, jnp.ones_like(valid), CONFIG, None)
    np.testing.assert_allclose(np.asarray(y)[:, :-2], np.asarray(y_full)[:, :-2], atol=1e-5)


def test_decode_through_cache_matches_full_forward(reference):
    model = reference[0]
    graphdef, params = nnx.split(model)
    tokens = _tokens()[:2]
    full = reference[1][0][:2]  # the reference's logits of the same tokens

    @jax.jit
    def run(params, tokens, cache):
        return nnx.merge(graphdef, params)(tokens, cache=cache)

    cache = M.init_cache(CONFIG, batch=2, max_len=12)
    logits, cache = run(params, tokens[:, :4], cache)
    steps = [logits]
    for i in range(4, 8):
        logits, cache = run(params, tokens[:, i:i + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5, rtol=0)


def test_replay_reproduces_or_overrides_the_routing(reference):
    model = reference[0]
    graphdef, params = nnx.split(model)
    forward = functools.partial(_forward, graphdef=graphdef)
    agreement_l = jax.jit(moe.agreement_l, static_argnames="replayed")  # (not op by op)
    tokens = _tokens()
    h, _, routing = forward(params, tokens)
    assert routing.experts_lbtk.shape == (2, 8, 8, 2)  # two MoE layers (layer 0 is dense)
    assert (routing.agree_l == routing.tokens_l * 2).all()  # its own choice
    h_replayed, _, replayed = forward(params, tokens, routing.experts_lbtk)
    np.testing.assert_array_equal(replayed.experts_lbtk, routing.experts_lbtk)
    np.testing.assert_allclose(h_replayed, h, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(replayed.agree_l, routing.agree_l)
    other = (routing.experts_lbtk + 1) % CONFIG.n_experts
    h_other, _, forced = forward(params, tokens, other)
    np.testing.assert_array_equal(forced.experts_lbtk, other)
    assert np.abs(np.asarray(h_other) - np.asarray(h)).max() > 1e-3
    # Agreement with the replayed choices, counted against the router's own top-k, is the set
    # overlap computed outside (in the first MoE layer: the later ones see forced inputs).
    hit = (np.asarray(other)[0, ..., :, None] == np.asarray(
        routing.experts_lbtk)[0, ..., None, :]).any(-1).sum()
    assert float(forced.agree_l[0]) == hit > 0
    valid = jnp.ones(tokens.shape)
    np.testing.assert_allclose(
        agreement_l(forced, routing.experts_lbtk, valid, replayed=True)[0],
        agreement_l(routing, other, valid, replayed=False)[0], rtol=1e-6)
    with pytest.raises(ValueError, match=r"replay_lbtk has shape .*\(2, 8, 8, 2\)"):
        model.forward(tokens, replay_lbtk=other[:1])


def test_aux_loss_matches_transformers_and_z_loss_its_formula():
    torch = pytest.importorskip("torch")
    qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    c = CONFIG
    p, _ = _forced_block()
    p = dict(p, router=0.3 * jax.random.normal(jax.random.key(0), p["router"].shape))
    layers = [jax.random.normal(jax.random.key(i + 1), (4, 16, 32)) for i in range(3)]
    valid = jnp.ones((4, 16), jnp.int32)
    stats = [_block(p, h, valid, c, None)[1] for h in layers]
    routing = moe.routing_from_stats(jax.tree.map(lambda *x: jnp.stack(x), *stats))
    logits = [np.asarray(h.reshape(-1, 32) @ p["router"]) for h in layers]
    want = qwen3_moe.load_balancing_loss_func(
        tuple(torch.tensor(g) for g in logits), c.n_experts, c.n_experts_per_token)
    np.testing.assert_allclose(float(moe.aux_loss(routing)), float(want), rtol=1e-5)
    lse = np.log(np.exp(np.concatenate(logits).astype(np.float64)).sum(-1))
    np.testing.assert_allclose(float(moe.z_loss(routing)), np.mean(lse ** 2), rtol=1e-5)
    m = moe.metrics(routing)
    assert m["moe/load"].shape == (8,) and abs(float(m["moe/load"].sum()) - 1) < 1e-6
    assert float(m["moe/dropped_fraction"]) == 0
    coef = c.replace(router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
    np.testing.assert_allclose(
        float(moe.router_loss(routing, coef)),
        0.01 * float(moe.aux_loss(routing)) + 0.001 * float(moe.z_loss(routing)), rtol=1e-6)


def test_router_losses_have_gradients_to_the_router(reference):
    c = CONFIG.replace(router_aux_loss_coef=0.1, router_z_loss_coef=0.1)
    model = reference[0]
    graphdef, params = nnx.split(model)

    def loss(params):
        return moe.router_loss(nnx.merge(graphdef, params).forward(_tokens())[2], c)

    grads = jax.jit(jax.grad(loss))(params)
    assert float(jnp.abs(grads["experts"]["router"][...]).max()) > 0


@pytest.mark.parametrize("changes, message", [
    (dict(n_experts_per_token=9), "n_experts_per_token"),
    (dict(d_ff_expert=0), "d_ff_expert"),
    (dict(moe_dispatch="sparse"), "moe_dispatch"),
    (dict(dense_layers=(5,)), "dense_layers"),
    (dict(n_experts=0, n_shared_experts=1), "n_shared_experts"),
])
def test_bad_moe_config_is_named(changes, message):
    with pytest.raises(ValueError, match=message):
        CONFIG.replace(**changes)


def test_shared_experts_add_an_always_on_mlp():
    c = CONFIG.replace(n_shared_experts=2)
    p, h_btd = _forced_block()
    rng = np.random.RandomState(3)
    shared = {"shared_gate": rng.randn(32, 32), "shared_up": rng.randn(32, 32),
              "shared_down": rng.randn(32, 32)}
    shared = {k: jnp.asarray(0.1 * v, jnp.float32) for k, v in shared.items()}
    valid = jnp.ones(h_btd.shape[:2], jnp.int32)
    y, _ = _block({**p, **shared}, h_btd, valid, c, None)
    y0, _ = _block(p, h_btd, valid, CONFIG, None)
    mlp = jnp.einsum("btf,fd->btd", jax.nn.silu(h_btd @ shared["shared_gate"])
                     * (h_btd @ shared["shared_up"]), shared["shared_down"])
    np.testing.assert_allclose(y, y0 + mlp, atol=1e-5, rtol=0)
    model = nnx.eval_shape(lambda: M.Transformer(c, rngs=nnx.Rngs(0)))
    assert model.experts.shared_gate.shape == (2, 32, 32)
    assert M.param_count(model) == c.n_params
