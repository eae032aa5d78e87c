"""LoRA dropout (config.lora.dropout, PEFT's lora_dropout): on the adapters' input in the
update's forwards only, its masks a function of (seed, step, update, microbatch, layer,
projection). The reference we did not write: peft's `lora.Linear` in training mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ptrain import learner as L
from ptrain import lora
from ptrain import model as model_lib
from ptrain import sharding
from ptrain import step as step_lib
from test_learner import _random_episodes
from test_lora import ALL, TINY, _lora_config, _one_device, _randomised

pytestmark = pytest.mark.xdist_group("lora")


def test_adapter_dropout_is_peft_lora_dropout_with_the_same_mask(monkeypatch):
    """Our adapted projection with dropout p equals peft's LoraLayer forward in training
    mode (torch's nn.Dropout on the adapter's input), given the mask torch drew."""
    torch = pytest.importorskip("torch", reason="torch (CPU) is the reference")
    peft = pytest.importorskip("peft", reason="peft is the reference; pip install '.[test]'")
    d, f, r, alpha, p = 16, 24, 4, 8.0, 0.3
    rng = np.random.RandomState(0)
    w_df, a_dr, b_rf = (rng.randn(d, f) / 4, rng.randn(d, r) / 4, rng.randn(r, f) / 4)
    x_btd = rng.randn(2, 5, d).astype(np.float32)
    torch.manual_seed(0)
    layer = peft.tuners.lora.Linear(torch.nn.Linear(d, f, bias=False), "default", r=r,
                                    lora_alpha=alpha, lora_dropout=p)
    with torch.no_grad():
        layer.base_layer.weight.copy_(torch.tensor(w_df.T))
        layer.lora_A["default"].weight.copy_(torch.tensor(a_dr.T))
        layer.lora_B["default"].weight.copy_(torch.tensor(b_rf.T))
    seen = {}
    layer.lora_dropout["default"].register_forward_hook(
        lambda m, i, o: seen.update(keep=(o != 0).numpy()))
    layer.train()
    with torch.no_grad():
        theirs = layer(torch.tensor(x_btd)).numpy()
    assert 0 < seen["keep"].mean() < 1
    c = TINY.replace(lora_rank=r, lora_alpha=alpha, lora_targets=ALL, lora_dropout=p)
    w = {"w_up": jnp.asarray(w_df, jnp.float32), "w_up_lora_a": jnp.asarray(a_dr, jnp.float32),
         "w_up_lora_b": jnp.asarray(b_rf, jnp.float32)}
    monkeypatch.setattr(lora, "dropout_keep", lambda key, shape, rate: seen["keep"])
    ours = lora.adapted(jnp.asarray(x_btd), w, "w_up", c, key=jax.random.key(0))
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5, rtol=1e-5)
    monkeypatch.undo()
    layer.eval()  # no dropout: both the plain LoRA projection
    with torch.no_grad():
        np.testing.assert_allclose(np.asarray(lora.adapted(jnp.asarray(x_btd), w, "w_up", c)),
                                   layer(torch.tensor(x_btd)).numpy(), atol=1e-5, rtol=1e-5)


def test_dropout_runs_in_keyed_forwards_only_and_is_the_same_under_remat_and_sharding():
    c = TINY.replace(lora_rank=4, lora_alpha=8.0, lora_targets=ALL, lora_dropout=0.25)
    graphdef, state = nnx.split(model_lib.init(c, seed=0))
    state = _randomised(state)
    tokens = np.random.RandomState(0).randint(0, 64, (4, 9))

    def hidden(state, key, graphdef=graphdef):
        return np.asarray(jax.jit(lambda s, k: nnx.merge(graphdef, s).forward(
            tokens, dropout_key=k)[0])(state, key))

    k1, k2 = jax.random.key(1), jax.random.key(2)
    plain, h1 = hidden(state, None), hidden(state, k1)
    # p = 0 (and p > 0 without a key: sampling, old and reference log-probs) is today's
    # forward bit for bit.
    g0 = nnx.graphdef(nnx.eval_shape(lambda: model_lib.Transformer(
        c.replace(lora_dropout=0.0), rngs=nnx.Rngs(0))))
    np.testing.assert_array_equal(hidden(state, k1, g0), plain)
    np.testing.assert_array_equal(hidden(state, None, g0), plain)
    assert np.abs(h1 - plain).max() > 1e-3 and np.abs(hidden(state, k2) - h1).max() > 1e-3
    np.testing.assert_array_equal(hidden(state, k1), h1)  # a pure function of the key
    # The base alone (B zeroed) sees no dropout: the masks touch the adapters' input only.
    np.testing.assert_array_equal(hidden(lora.disabled(state), k1),
                                  hidden(lora.disabled(state), None))
    # Remat recomputes the same masks; a sharded batch draws the same ones.
    g_remat = nnx.graphdef(nnx.eval_shape(lambda: model_lib.Transformer(
        c.replace(remat="full"), rngs=nnx.Rngs(0))))
    np.testing.assert_allclose(hidden(state, k1, g_remat), h1, atol=1e-6, rtol=0)
    mesh = sharding.make_mesh(fsdp=2, devices=jax.devices()[:2])
    g_mesh, s_mesh = nnx.split(model_lib.init(c, seed=0, mesh=mesh))
    s_mesh = jax.device_put(state, jax.tree.map(lambda x: x.sharding, s_mesh))
    np.testing.assert_allclose(hidden(s_mesh, k1, g_mesh), h1, atol=1e-5, rtol=0)


def test_dropout_masks_differ_across_steps_and_microbatches_and_repeat_for_a_step():
    config = _lora_config(**{"lora.dropout": 0.1, "optim.lr": 0.05})
    learner = L.Learner(config, mesh=_one_device())
    assert L.Learner(_lora_config(), mesh=_one_device()).dropout_key(1) is None  # p = 0
    keys = [learner.dropout_key(s) for s in (1, 2)]
    # The step's key is a function of (seed, step): a resumed run's learner draws the same.
    again = L.Learner(config, mesh=_one_device()).dropout_key(1)
    assert np.array_equal(jax.random.key_data(again), jax.random.key_data(keys[0]))
    masks = {tuple(np.asarray(lora.dropout_keep(key, (64,), 0.5)))
             for step_key in keys for u in range(2)
             for key in step_lib.dropout_keys(step_key, u, 3)}
    assert len(masks) == 2 * 2 * 3  # every (step, update, microbatch) its own masks

    params = learner.initial_params
    opt_state = learner.init_opt_state(params)
    episodes = _random_episodes(config.data.prompts_per_step, config.sampling.num_samples)
    batch, _ = learner.prepare(params, episodes, 0.0)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731 (the update donates)
    out = {}
    for name, step in (("a", 1), ("b", 1), ("c", 2)):
        new, _, metrics = learner.update(copy(params), copy(opt_state), batch, 0.0, step)
        out[name] = jax.device_get(lora.split(new)[0])
    for a, b in zip(jax.tree.leaves(out["a"]), jax.tree.leaves(out["b"])):
        np.testing.assert_array_equal(a, b)  # the same step: the same masks, bit for bit
    assert max(np.abs(a - c).max() for a, c in zip(jax.tree.leaves(out["a"]),
                                                   jax.tree.leaves(out["c"]))) > 0
