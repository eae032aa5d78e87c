"""ptrain.plan: real compiles of the long-context step over simulated meshes, the mesh search,
the step itself against a dense reference, and clear errors for bad input."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from ptrain import model as M
from ptrain import packing
from ptrain import plan
from ptrain import sharding
from ptrain import step as step_lib

TINY = M.ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                     attention_impl="ring", attn_block_q=64, attn_block_k=64, remat="full")
SEQ = 4096
OPTIM = plan.defaults().optim
COMMON = dict(seq_len=SEQ, batch=1, optim=OPTIM, chunk=256, layout="zigzag")
pytestmark = pytest.mark.xdist_group("plan")  # the module fixture compiles once, on one worker


@pytest.fixture(scope="module")
def by_sequence():
    """Plans of the tiny model over sequence = 1, 2, 4, 8 devices."""
    return {s: plan.compile_plan(TINY, {"sequence": s}, **COMMON) for s in (1, 2, 4, 8)}


def test_the_plan_compiles_packed_sfts_own_program(monkeypatch):
    """compile_plan's program is `step.jit_packed_update`'s, the one `learner.sft` runs with
    sft.packing (tests/test_packing.py spies on the learner's side)."""
    calls = []
    real = step_lib.jit_packed_update
    monkeypatch.setattr(step_lib, "jit_packed_update", lambda *a: calls.append(a) or real(*a))
    # by_sequence's plan for sequence=2: compiled here, read back from the compilation cache
    # there (the same program)
    plan.compile_plan(TINY, {"sequence": 2}, **COMMON)
    (graphdef, tx, mesh, chunk), = calls
    assert chunk == COMMON["chunk"] and dict(mesh.shape)["sequence"] == 2
    jitted = real(graphdef, tx, mesh, chunk)
    assert jitted is real(graphdef, tx, mesh, chunk)  # cached: one program per settings
    assert jitted.__wrapped__.func is step_lib.packed_update


def test_report_accounts_for_the_state(by_sequence):
    one, eight = by_sequence[1], by_sequence[8]
    m = one["memory"]
    assert m["peak"] == m["arguments"] + m["outputs"] - m["aliased"] + m["temporaries"]
    # One device holds every float32 parameter; Adam holds two moments (plus step counts).
    assert one["params_bytes"] == 4 * TINY.n_params
    assert 0 <= one["opt_state_bytes"] - 2 * one["params_bytes"] <= 64
    # The donated state comes back in place: arguments hold it, outputs alias it.
    assert m["arguments"] >= one["params_bytes"] + one["opt_state_bytes"]
    assert m["aliased"] >= one["params_bytes"] + one["opt_state_bytes"]
    # Over 8 devices the model dim of every weight is split 8 ways (norms stay whole).
    norms = 4 * (2 * TINY.n_layers + 1) * TINY.d_model
    assert eight["params_bytes"] == (4 * TINY.n_params - norms) // 8 + norms
    assert eight["devices"] == 8 and eight["mesh"]["sequence"] == 8
    assert one["xla_flops_per_device"] > 0
    # 6 x matmul parameters x tokens (the embedding lookup is no matmul) + causal attention.
    matmul = TINY.n_params - TINY.vocab_size * TINY.d_model
    attention = 6 * TINY.n_layers * TINY.n_heads * TINY.head_dim * SEQ**2
    assert one["model_flops"] == 6 * matmul * SEQ + attention


def test_activation_memory_falls_linearly_with_the_sequence_axis(by_sequence):
    temporaries = [by_sequence[s]["memory"]["temporaries"] for s in (1, 2, 4, 8)]
    for more, fewer in zip(temporaries, temporaries[1:]):
        assert 1.6 < more / fewer < 2.4, temporaries


def test_search_returns_the_smallest_mesh_that_fits(by_sequence):
    # A budget between one device's peak and eight devices' (sequence=8) peak.
    budget = math.sqrt(by_sequence[1]["memory"]["peak"] * by_sequence[8]["memory"]["peak"])
    result = plan.search(TINY, **COMMON, budget_gib=budget / plan.GIB,
                         device_counts=(1, 2, 4, 8), confirm=1)
    answer = result["answer"]
    assert answer is not None and answer["fits"] and answer["memory"]["peak"] <= budget
    smaller = result["smaller"]
    below = max(n for n in (1, 2, 4, 8) if n < answer["devices"])
    assert smaller and {r["devices"] for r in smaller} == {below}
    assert all(not r["fits"] and r["memory"]["peak"] > budget for r in smaller)
    # The best-ranked candidate of the smaller count was compiled (and did not fit).
    assert smaller[0]["mesh"] == result["ranking"][str(below)][0]["mesh"]
    # Every candidate is a split of its device count that the step can use.
    for n, ranked in result["ranking"].items():
        for entry in ranked:
            mesh = entry["mesh"]
            assert math.prod(mesh.values()) == int(n)
            assert TINY.n_kv_heads % mesh["tensor"] == 0 and SEQ % (2 * mesh["sequence"]) == 0


MOE = TINY.replace(n_experts=16, n_experts_per_token=2, d_ff_expert=256, moe_dispatch="capacity")


def test_the_search_covers_the_expert_axis_of_a_moe():
    """A MoE's candidates split over `expert` too (a dense model's never do); a compiled
    expert x sequence plan shards every weight 8 ways (experts over expert, their model dim
    over sequence), and the estimate counts the expert shards and the dispatch buffers."""
    moe_meshes = plan.candidate_meshes(MOE, 8, seq_len=SEQ, batch=1, layout="zigzag")
    assert {m["expert"] for m in moe_meshes} == {1, 2, 4, 8}
    assert all(16 % m["expert"] == 0 and math.prod(m.values()) == 8 for m in moe_meshes)
    dense = plan.candidate_meshes(TINY, 8, seq_len=SEQ, batch=1, layout="zigzag")
    assert {m["expert"] for m in dense} == {1}
    # A batch that does not divide over data x fsdp x expert is not split over data / fsdp.
    for m in plan.candidate_meshes(MOE, 8, seq_len=SEQ, batch=2, layout="zigzag"):
        assert 2 % (m["data"] * m["fsdp"] * m["expert"]) == 0 or m["data"] * m["fsdp"] == 1
    report = plan.compile_plan(MOE, {"sequence": 4, "expert": 2}, **COMMON)
    norms = 4 * (2 * MOE.n_layers + 1) * MOE.d_model
    assert report["params_bytes"] == (4 * MOE.n_params - norms) // 8 + norms
    assert report["estimate"]["state"] == 4 * report["params_bytes"]
    assert report["estimate"]["dispatch"] > 0 and report["mesh"]["expert"] == 2
    assert report["model_flops"] == plan.model_flops(MOE, seq_len=SEQ, batch=1)


def test_the_moe_plans_have_the_public_models_sizes():
    """configs/moe_plan.py's models are the public configs' sizes: Qwen3-30B-A3B 30.5B
    parameters, 3.3B active (its model card); the Kimi-K2-class one 1.03T, 34.8B active
    (Kimi K2: 1.04T, 32B; its MLA attention replaced by grouped-query attention of about the
    same size), 384 experts, 8 per token, 61 layers."""
    from configs import moe_plan
    qwen = plan.model_config(moe_plan.get_config("qwen3-30b-a3b"))
    assert 30.4e9 < qwen.n_params < 30.6e9 and 3.2e9 < qwen.n_active_params < 3.4e9
    kimi = plan.model_config(moe_plan.get_config("kimi-k2"))
    assert 1.0e12 < kimi.n_params < 1.06e12 and 30e9 < kimi.n_active_params < 36e9
    assert (kimi.n_experts, kimi.n_experts_per_token, kimi.n_layers) == (384, 8, 61)


def test_bad_input_gives_clear_errors():
    with pytest.raises(ValueError, match="needs 16 devices but JAX has 8"):
        plan.compile_plan(TINY, {"sequence": 16}, **COMMON)
    with pytest.raises(ValueError, match="divisible by 16"):
        plan.compile_plan(TINY, {"sequence": 8}, **{**COMMON, "seq_len": 1000})
    with pytest.raises(ValueError, match="device_counts go up to 16"):
        plan.search(TINY, **COMMON, budget_gib=1.0, device_counts=(8, 16))
    config = plan.defaults()
    config.budget = 80.0
    config.model.n_layer = 2
    with pytest.raises(ValueError, match=r"unknown keys \['budget', 'model.n_layer'\]"):
        plan.check_config(config)
    config = plan.defaults()
    config.mesh.sequence = 3
    with pytest.raises(ValueError, match="divisible by 6"):
        plan.check_config(config)


def test_packed_batch_positions_targets_and_mask():
    tokens = np.arange(10, 20)[None]
    segments = np.array([[1, 1, 1, 2, 2, 2, 2, 0, 0, 0]])
    batch = packing.packed_batch(tokens, segments)
    np.testing.assert_array_equal(batch["positions_bt"], [[0, 1, 2, 0, 1, 2, 3, 0, 1, 2]])
    np.testing.assert_array_equal(batch["targets_bt"][0, :6], [11, 12, 13, 14, 15, 16])
    np.testing.assert_array_equal(batch["loss_mask_bt"], [[1, 1, 0, 1, 1, 1, 0, 0, 0, 0]])
    zigzag = packing.packed_batch(tokens[:, :8], segments[:, :8], layout="zigzag", shards=2)
    np.testing.assert_array_equal(zigzag["tokens_bt"], [[10, 11, 16, 17, 12, 13, 14, 15]])
    np.testing.assert_array_equal(zigzag["positions_bt"], [[0, 1, 3, 0, 2, 0, 1, 2]])


def test_step_on_a_sequence_mesh_equals_a_dense_step():
    """fsdp=2 x sequence=2 x tensor=2 with ring attention in the zigzag layout: the loss and
    the updated parameters equal a one-device step with dense attention and full logits.
    Adam's eps is large so that the update is linear in the gradient."""
    config = TINY.replace(attn_block_q=8, attn_block_k=8)
    optim = ml_collections.ConfigDict({**OPTIM.to_dict(), "eps": 1.0, "lr": 1e-2})
    tx, _ = step_lib.make_optimizer(optim, total_steps=1)
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, config.vocab_size, (2, 64))
    segments = np.repeat([[1] * 23 + [2] * 36 + [0] * 5], 2, axis=0)
    graphdef, params0 = nnx.split(M.init(config.replace(attention_impl="reference"), seed=1))

    def dense_loss(params, batch):
        model = nnx.merge(graphdef, params)
        logits = model(batch["tokens_bt"], batch["positions_bt"], batch["segment_ids_bt"])
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets_bt"][..., None],
                                   -1)[..., 0]
        mask = batch["loss_mask_bt"]
        return -(logp * mask).sum() / mask.sum()

    batch = packing.packed_batch(tokens, segments)

    @jax.jit  # one compile for the reference, not one per op
    def dense_step(params):
        loss, grads = jax.value_and_grad(dense_loss)(params, batch)
        updates, _ = tx.update(grads, tx.init(params), params)
        return loss, optax.apply_updates(params, updates)

    loss, expected = dense_step(params0)

    mesh = sharding.make_mesh(fsdp=2, sequence=2, tensor=2)
    g, abstract_params, opt, _, _ = plan.abstract_inputs(config, mesh, seq_len=64, batch=2,
                                                         optim=optim)
    params = jax.device_put(params0, jax.tree.map(lambda x: x.sharding, abstract_params))
    opt_state = jax.jit(tx.init, out_shardings=jax.tree.map(lambda x: x.sharding, opt))(params)
    step = step_lib.jit_packed_update(g, tx, mesh, 16)  # packed SFT's program
    zigzag = sharding.shard_batch(packing.packed_batch(tokens, segments, layout="zigzag",
                                                    shards=2), mesh)
    new_params, _, metrics = jax.device_get(step(params, opt_state, zigzag))
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)



def test_the_rl_step_plan_compiles_the_learners_own_programs_and_searches_meshes(monkeypatch):
    """A learner config plans its RL step: the sampler's prefill and decode (its KV cache),
    step.prepare and step.update (through step.jit_update, as the learner calls it) with the
    config's settings; gae adds the critic's update, kl.coef > 0 the reference policy. The
    mesh search compiles these same programs per candidate mesh (here PPO over 1 and 2
    devices against a budget nothing meets, so the walk compiles the best-ranked mesh of each
    count); the state's bytes halve when fsdp doubles."""
    from configs import grpo_toy, ppo_toy
    from ptrain import config as config_lib
    from ptrain import model as model_lib

    seen = []
    update = step_lib.update

    def watched(*args, s, **kwargs):
        seen.append(s)
        return update(*args, s=s, **kwargs)

    monkeypatch.setattr(step_lib, "update", watched)
    step_lib.jit_update.cache_clear()
    with pytest.raises(ValueError, match=r"a plan names its devices.*fsdp=8"):
        plan.run(grpo_toy.get_config())  # grpo_toy's mesh is fsdp=-1 (all devices)
    with pytest.raises(ValueError, match="needs a budget and device counts"):
        plan.run(grpo_toy.get_config(), do_search=True)
    config = ppo_toy.get_config()
    config.kl.coef = 0.01
    result = plan.run(config, do_search=True, budget_gib=1e-9, device_counts=[1, 2], confirm=1)
    assert result["answer"] is None and "nothing fits" in plan.summary(result)
    assert "RL step peak" in plan.summary(result)
    one, two = result["compiled"]
    assert one["devices"] == 1 and two["mesh"] == result["ranking"]["2"][0]["mesh"]
    assert result["smaller"] == [two] and not one["fits"] and not two["fits"]
    assert list(one["programs"]) == ["sample_prefill", "sample_decode", "prepare",
                                     "critic_update", "update"]
    resolved = config_lib.resolve(config)
    assert seen == [resolved.critic, resolved.rl] * 2  # one compile each per mesh
    assert one["rows"] == config.data.prompts_per_step * config.sampling.num_samples
    assert one["length"] == config.sampling.max_new_tokens
    m = one["programs"]["update"]
    # The update takes the state and the prepared batch, and gives the donated state back.
    assert m["arguments"] >= one["params_bytes"] + one["opt_state_bytes"] + one["batch_bytes"]
    assert m["aliased"] >= one["params_bytes"] + one["opt_state_bytes"]
    assert one["step_peak"] >= max(p["peak"] for p in one["programs"].values())
    # The sampler's KV cache: keys and values of every layer for each sampled row's prompt and
    # continuation (the config's compute dtype), the prefill's output and the decode's input.
    mc = model_lib.ModelConfig(**config.model.to_dict())
    slots = config.data.max_prompt_len + config.sampling.max_new_tokens
    kv = 2 * mc.n_layers * one["rows"] * slots * mc.n_kv_heads * mc.head_dim * jnp.dtype(
        mc.dtype).itemsize
    assert kv <= one["kv_cache_bytes"] <= kv + 2 * one["rows"] * slots * 4 + 64
    assert one["programs"]["sample_prefill"]["outputs"] >= one["kv_cache_bytes"]
    assert one["programs"]["sample_decode"]["arguments"] >= one["kv_cache_bytes"]
    # The reference policy (a copy of the parameters) goes into prepare beside the policy.
    assert one["reference_bytes"] == one["params_bytes"] and one["critic_bytes"] > 0
    assert one["programs"]["prepare"]["arguments"] >= 2 * one["params_bytes"]
    parts = one["memory"]
    assert (parts["policy"], parts["optimizer"], parts["reference"], parts["critic"]) == (
        one["params_bytes"], one["opt_state_bytes"], one["reference_bytes"],
        one["critic_bytes"])
    assert parts["activations"] == one["programs"][parts["peak_program"]]["temporaries"]
    assert two["mesh"]["fsdp"] == 2  # the estimate ranks fsdp first for this state
    assert two["params_bytes"] < 0.6 * one["params_bytes"]
    assert two["critic_bytes"] < 0.6 * one["critic_bytes"]
    step_lib.jit_update.cache_clear()


def test_the_rl_step_plan_counts_the_engines_decode_copy():
    """sampling.decode_dtype="bfloat16": the engines' inference copy (ptrain/generate/decode_weights.py)
    is every floating-point parameter in bfloat16, resharded with nothing over fsdp, held
    through the whole step: its bytes are in the report and beside every program's peak."""
    from configs import grpo_toy
    config = grpo_toy.get_config()
    config.sampling.engine = True
    mesh = {"fsdp": 2, "tensor": 2}
    without = plan.compile_rl_step(config, mesh)
    config.sampling.decode_dtype = "bfloat16"
    with_copy = plan.compile_rl_step(config, mesh)
    copy = with_copy["decode_copy_bytes"]
    assert without["decode_copy_bytes"] == 0 and without["memory"]["decode_copy"] == 0
    # What a device of that mesh holds of the real copy of the learner's model.
    from ptrain import learner
    from ptrain.generate import decode_weights
    real = decode_weights.decode_copy(
        nnx.state(M.Transformer(learner.model_config(config), rngs=nnx.Rngs(0),
                                        mesh=plan.make_mesh(mesh))),
        "bfloat16", plan.make_mesh(mesh))
    device = jax.devices()[0]
    held = [s for x in jax.tree.leaves(real) for s in x.addressable_shards
            if s.device == device]
    assert copy == sum(s.data.nbytes for s in held) > 0
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(real)
               if jnp.issubdtype(x.dtype, jnp.floating))
    assert all("fsdp" not in str(x.sharding.spec) for x in jax.tree.leaves(real))
    # float32 over fsdp x tensor against bfloat16 over tensor: about as many bytes a device.
    assert with_copy["params_bytes"] == without["params_bytes"]
    assert 0.9 * with_copy["params_bytes"] <= copy <= with_copy["params_bytes"]
    assert with_copy["memory"]["decode_copy"] == copy
    assert with_copy["step_peak"] == pytest.approx(without["step_peak"] + copy, abs=1024)
    assert "decode copy" in plan.summary(with_copy)
    assert "decode copy" not in plan.summary(without)


def test_the_rl_step_plan_with_lora_holds_no_reference_and_adapter_sized_optimizer_state():
    """lora.rank > 0: the optimizer state mirrors the adapters only and no reference copy is
    held (the base, adapters off, is the reference); the policy is the base plus adapters."""
    from configs import grpo_toy
    config = grpo_toy.get_config()
    config.kl.coef = 0.01
    mesh = {"fsdp": 2}
    full = plan.compile_rl_step(config, mesh)
    config.lora.update(rank=4, alpha=8.0)
    with_lora = plan.compile_rl_step(config, mesh)
    assert full["reference_bytes"] == full["params_bytes"] and with_lora["reference_bytes"] == 0
    adapters = with_lora["trainable_bytes"]
    assert 0 < adapters < 0.3 * with_lora["params_bytes"]
    assert with_lora["params_bytes"] == full["params_bytes"] + adapters
    assert 2 * adapters <= with_lora["opt_state_bytes"] <= 2 * adapters + 64  # Adam's mu, nu
    assert full["opt_state_bytes"] >= 2 * full["params_bytes"]
