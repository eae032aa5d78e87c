"""An int8 frozen base under LoRA (lora.base_dtype="int8", `ptrain.quant`): projections int8
with per-output-channel scales, dequantised in the forward; adapters float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ptrain import hf
from ptrain import learner as L
from ptrain import lora
from ptrain import model as model_lib
from ptrain import quant
from test_learner import _random_episodes
from test_lora import ALL, TINY, _lora_config, _one_device, _randomised

pytestmark = pytest.mark.xdist_group("lora")

C8 = TINY.replace(lora_rank=4, lora_alpha=8.0, lora_targets=ALL, int8_base=True)


def test_quantize_is_symmetric_absmax_per_output_channel():
    w = np.random.RandomState(0).randn(2, 16, 4, 8).astype(np.float32)  # [l, d, h, e]
    q, s = quant.quantize(jnp.asarray(w), lead=1, n_in=1)
    assert q.dtype == jnp.int8 and s.shape == (2, 1, 4, 8)
    np.testing.assert_allclose(np.asarray(s), np.abs(w).max(axis=1, keepdims=True) / 127,
                               rtol=1e-6)
    err = np.abs(np.asarray(quant.dequantize(q, s, jnp.float32)) - w)
    assert np.all(err <= np.asarray(s) / 2 + 1e-7)


def test_int8_base_forward_is_the_dequantised_base_and_near_the_float_one():
    """Logits are the float model's on the dequantised weights; the token log-probs move by
    the rounding (measured here and printed; docs/lora.md)."""
    base = model_lib.init(TINY, seed=0)
    g8, s8 = lora.attach(nnx.state(base), C8, seed=3)
    s8 = _randomised(s8)
    layers = lora.split(s8)[1]["layers"]
    assert layers["wq"].get_value().dtype == jnp.int8 and "wq_scale" in layers
    assert layers["attn_norm"].get_value().dtype == jnp.float32
    f32 = C8.replace(int8_base=False)
    g32 = nnx.graphdef(nnx.eval_shape(lambda: model_lib.Transformer(f32, rngs=nnx.Rngs(0))))
    adapters = lora.split(s8)[0]
    tokens = np.random.RandomState(0).randint(0, 64, (4, 16))
    run = jax.jit(lambda g, s: nnx.merge(g, s)(tokens), static_argnums=0)
    ours = np.asarray(run(g8, s8))
    np.testing.assert_allclose(
        ours, np.asarray(run(g32, quant.dequantize_state(s8))), atol=1e-6, rtol=0)

    def logp(logits):
        logp_btv = np.asarray(jax.nn.log_softmax(logits))
        return np.take_along_axis(logp_btv[:, :-1], tokens[:, 1:, None], -1)[..., 0]

    float_state = lora.join(adapters, nnx.state(base))
    diff = np.abs(logp(ours) - logp(np.asarray(run(g32, float_state))))
    print(f"int8 base: mean |d logp| {diff.mean():.2e}, max {diff.max():.2e}")
    assert 0 < diff.mean() < 0.05, diff.mean()
    # The base's bytes: the projections a quarter of float32's.
    nbytes = lambda s: sum(x.nbytes for x in jax.tree.leaves(lora.split(s)[1]))  # noqa: E731
    assert nbytes(s8) < 0.5 * nbytes(float_state)


def test_int8_lora_trains_the_adapters_only_and_exports_dequantised_base_plus_ba(tmp_path):
    transformers = pytest.importorskip("transformers", reason="pip install '.[test]'")
    torch = pytest.importorskip("torch", reason="torch (CPU) is the reference")
    config = _lora_config(**{"lora.base_dtype": "int8", "optim.lr": 0.05})
    learner = L.Learner(config, mesh=_one_device())
    c = learner.model_config
    assert c.int8_base and c.param_dtype == "float32"
    params = learner.initial_params
    adapters, base_before = jax.device_get(lora.split(params))
    opt_state = learner.init_opt_state(params)
    episodes = _random_episodes(config.data.prompts_per_step, config.sampling.num_samples)
    batch, _ = learner.prepare(params, episodes, 0.0)
    params, opt_state, _ = learner.update(params, opt_state, batch, 0.0)
    new_adapters, new_base = jax.device_get(lora.split(params))
    for a, b in zip(jax.tree.leaves(new_base), jax.tree.leaves(base_before)):
        np.testing.assert_array_equal(a, b)  # int8 values and scales, bit for bit
    for name, v in new_adapters["layers"].items():
        assert np.abs(np.asarray(v) - np.asarray(adapters["layers"][name])).max() > 0, name
    # The merged export: each weight is dequant(q, s) + (alpha / r) A B.
    merged, base_c = lora.merged(params, c)
    assert not base_c.int8_base and not quant.is_quantized(merged)
    lay, new = new_base["layers"], new_adapters["layers"]
    arr = lambda tree, name: np.asarray(tree[name])  # noqa: E731
    want = (arr(lay, "w_down").astype(np.float32) * arr(lay, "w_down_scale")
            + lora.scale(c) * np.matmul(arr(new, "w_down_lora_a"), arr(new, "w_down_lora_b")))
    np.testing.assert_allclose(np.asarray(merged["layers"]["w_down"].get_value()), want,
                               atol=1e-6, rtol=0)
    hf.save(merged, base_c, str(tmp_path))
    tokens = np.random.RandomState(0).randint(0, 32, (2, 9))
    ours = np.asarray(nnx.merge(learner.graphdef, params)(tokens))
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        theirs = exported(torch.tensor(tokens)).logits.float().numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-4, rtol=0)


def test_an_int8_base_needs_lora():
    with pytest.raises(ValueError, match="int8 base"):
        TINY.replace(int8_base=True)
