"""LoRA on a MoE's experts (lora.experts): one adapter per layer and expert on the experts'
stacked weights, merged into them in the forward (PEFT's `target_parameters` on 3-D expert
weights does the same). The reference we did not write: transformers' Qwen3-MoE forward of
the merged export."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ptrain import hf
from ptrain import lora
from ptrain import model as model_lib
from ptrain import sharding
from ptrain import step as step_lib
from test_lora import _randomised
from test_moe import CONFIG

pytestmark = pytest.mark.xdist_group("lora")

BASE = CONFIG.replace(family="qwen3_moe")
C = BASE.replace(lora_rank=4, lora_alpha=8.0, lora_targets=tuple(lora.TARGETS.values()),
                 lora_experts=True)
TOKENS = np.random.RandomState(0).randint(0, 64, (4, 9))


@pytest.fixture(scope="module")
def moe_lora():
    """(base model, graphdef, state with random adapters) of the tiny Qwen3-MoE."""
    base = model_lib.init(BASE, seed=0)
    graphdef, state = lora.attach(nnx.state(base), C, seed=3)
    return base, graphdef, state


def _logits(graphdef, state):
    return np.asarray(jax.jit(lambda s: nnx.merge(graphdef, s)(TOKENS))(state))


def test_each_expert_gets_its_own_adapter_and_zero_ones_give_the_base(moe_lora):
    base, graphdef, state = moe_lora
    experts = lora.split(state)[0]["experts"]
    l, e, d, f, r = 2, BASE.n_experts, BASE.d_model, BASE.d_ff_expert, 4
    assert {k: v.shape for k, v in experts.items()} == {
        "w_gate_lora_a": (l, e, d, r), "w_gate_lora_b": (l, e, r, f),
        "w_up_lora_a": (l, e, d, r), "w_up_lora_b": (l, e, r, f),
        "w_down_lora_a": (l, e, f, r), "w_down_lora_b": (l, e, r, d)}
    a = np.asarray(experts["w_gate_lora_a"])
    assert not np.allclose(a[:, 0], a[:, 1])  # drawn per expert
    np.testing.assert_array_equal(_logits(graphdef, state), _logits(*nnx.split(base)))


def test_expert_adapters_train_and_merge_into_a_model_transformers_runs(moe_lora, tmp_path):
    transformers = pytest.importorskip("transformers", reason="pip install '.[test]'")
    torch = pytest.importorskip("torch", reason="torch (CPU) is the reference")
    base, graphdef, state = moe_lora
    state = _randomised(state)
    ours = _logits(graphdef, state)
    assert np.abs(ours - _logits(*nnx.split(base))).max() > 1e-2
    # Gradients reach every expert adapter (the base is not differentiated).
    trainable, frozen = step_lib.split_trainable(state)
    grads = jax.grad(lambda t: jnp.sum(nnx.merge(graphdef, lora.join(t, frozen))(TOKENS)[..., 3]
                                       ))(trainable)
    for name, g in grads["experts"].items():
        assert np.abs(np.asarray(g)).max() > 0, name
    merged, base_c = lora.merged(state, C)
    assert not lora.has_adapters(merged)
    hf.save(merged, base_c, str(tmp_path))
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        theirs = exported(torch.tensor(TOKENS)).logits.float().numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-4, rtol=0)


def test_expert_adapters_under_expert_and_tensor_parallelism_equal_one_device(moe_lora):
    _, graphdef, state = moe_lora
    state = _randomised(state)
    mesh = sharding.make_mesh(expert=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    g_mesh, s_mesh = nnx.split(sharding.create_sharded(
        lambda: model_lib.Transformer(C, rngs=nnx.Rngs(0), mesh=mesh), mesh))
    spec = s_mesh["experts"]["w_down_lora_a"].get_value().sharding.spec
    assert spec[1] == "expert" and spec[2] == "tensor"  # [l, E, f, r] placed as w_down
    s_mesh = jax.device_put(state, jax.tree.map(lambda x: x.sharding, s_mesh))
    np.testing.assert_allclose(_logits(g_mesh, s_mesh), _logits(graphdef, state),
                               atol=2e-5, rtol=0)


@pytest.mark.parametrize("changes,message", [
    (dict(n_experts=0, n_experts_per_token=0, d_ff_expert=0), "MoE model"),
    (dict(lora_dropout=0.1), "lora.dropout=0"),
    (dict(lora_targets=("wq",)), "gate_proj"),
])
def test_bad_expert_lora_config_is_named(changes, message):
    with pytest.raises(ValueError, match=message):
        C.replace(**changes)
