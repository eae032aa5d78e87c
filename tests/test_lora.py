"""ptrain.lora: adapters on the projections, the base frozen and the reference; exports.

References we did not write: transformers' forward of the merged export, and `peft` loading
the adapter directory onto the transformers base model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import grpo_toy
from ptrain import hf
from ptrain import learner as L
from ptrain import lora
from ptrain import model as model_lib
from ptrain import sharding
from ptrain import step as step_lib
from test_learner import _random_episodes

pytestmark = pytest.mark.xdist_group("lora")

ALL = tuple(lora.TARGETS.values())
# A Qwen2-shaped tiny model: biases on q/k/v, untied head, all seven projections adapted.
TINY = model_lib.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                             d_ff=48, qkv_bias=True, family="qwen2", rope_theta=10000.0)


def _one_device():
    return sharding.make_mesh(fsdp=1, devices=jax.devices()[:1])


def _randomised(state, seed=1, scale=0.05):
    """The adapters given random values (a fresh B is zero: nothing to check an export by)."""
    adapters, base = lora.split(state)
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    adapters = jax.tree.map(lambda x: scale * jax.random.normal(next(keys), x.shape, x.dtype),
                            adapters)
    return lora.join(adapters, base)


def test_zero_initialised_adapters_give_the_base_logits_exactly():
    base = model_lib.init(TINY, seed=0)
    c = TINY.replace(lora_rank=4, lora_alpha=8.0, lora_targets=ALL)
    graphdef, state = lora.attach(nnx.state(base), c, seed=3)
    adapters, kept = lora.split(state)
    assert {k for k in adapters["layers"]} == {f"{n}_lora_{ab}" for n in ALL for ab in "ab"}
    assert all(np.any(np.asarray(v)) for k, v in adapters["layers"].items() if k.endswith("_a"))
    tokens = np.random.RandomState(0).randint(0, 64, (2, 9))
    np.testing.assert_array_equal(np.asarray(nnx.merge(graphdef, state)(tokens)),
                                  np.asarray(base(tokens)))
    # A model built with LoRA from the seed is the same base (adapters drawn after it).
    direct = nnx.state(model_lib.init(c, seed=0))
    for a, b in zip(jax.tree.leaves(lora.split(direct)[1]), jax.tree.leaves(kept)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_adapters_are_created_sharded_like_the_weights_they_adapt():
    mesh = sharding.make_mesh(fsdp=2, tensor=2, devices=jax.devices()[:4])
    c = TINY.replace(lora_rank=4, lora_alpha=8.0, lora_targets=ALL)
    state = nnx.state(model_lib.init(c, seed=0, mesh=mesh))
    layers = state["layers"]
    spec = lambda name: layers[name].get_value().sharding.spec  # noqa: E731
    assert spec("wq_lora_a") == jax.sharding.PartitionSpec(None, "fsdp", None)  # d like wq's
    assert spec("wq_lora_b")[2] == "tensor"  # heads like wq's
    assert spec("w_down_lora_a")[1] == "tensor" and spec("w_down_lora_b")[2] == "fsdp"


def test_a_bfloat16_base_holds_float32_adapters_and_stays_near_the_float32_log_probs():
    """lora.base_dtype="bfloat16": the frozen base in bfloat16 (half its bytes), the adapters
    float32; the token log-probs move by the rounding of the base weights only (measured on
    this tiny model: mean |d logp| 2.3e-4, max 8e-4; docs/lora.md)."""
    config = _lora_config()
    f32 = L.model_config(config)
    config.lora.base_dtype = "bfloat16"
    bf16 = L.model_config(config)
    assert (f32.param_dtype, bf16.param_dtype) == ("float32", "bfloat16")
    graphdef, state = lora.attach(nnx.state(model_lib.init(lora.base_config(f32), seed=0)),
                                  f32, seed=1)
    state = _randomised(state)
    adapters, base = lora.split(state)
    base16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)
    graphdef16 = nnx.graphdef(nnx.eval_shape(lambda: model_lib.Transformer(
        bf16, rngs=nnx.Rngs(0))))
    state16 = lora.join(adapters, base16)
    assert {x.dtype for x in jax.tree.leaves(lora.split(state16)[0])} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(base16)} == {jnp.dtype("bfloat16")}
    tokens = np.random.RandomState(0).randint(0, 32, (4, 16))

    def logp(g, s):  # (a tiny vocabulary: the dense softmax is the reference)
        logp_btv = np.asarray(jax.nn.log_softmax(nnx.merge(g, s)(tokens)))
        return np.take_along_axis(logp_btv[:, :-1], tokens[:, 1:, None], -1)[..., 0]

    diff = np.abs(logp(graphdef, state) - logp(graphdef16, state16))
    print(f"bfloat16 base: mean |d logp| {diff.mean():.2e}, max {diff.max():.2e}")
    assert 0 < diff.mean() < 0.02, diff.mean()


def _lora_config(**changes):
    c = grpo_toy.get_config()
    c.lora.update(rank=4, alpha=8.0)
    c.update_from_flattened_dict(changes)
    return c


def test_rl_update_trains_the_adapters_only_and_the_base_is_the_reference():
    config = _lora_config(**{"kl.coef": 0.1, "optim.lr": 0.05})
    learner = L.Learner(config, mesh=_one_device())
    assert learner.ref_params is None  # no second copy of the weights
    params = learner.initial_params
    adapters, base_before = jax.device_get(lora.split(params))  # (the update donates them)
    opt_state = learner.init_opt_state(params)
    # The optimizer state mirrors the adapters only: its moments are adapter-shaped.
    adapter_shapes = sorted(x.shape for x in jax.tree.leaves(adapters))
    moments = sorted(x.shape for x in jax.tree.leaves(opt_state) if x.ndim)
    assert moments == sorted(adapter_shapes * 2)

    episodes = _random_episodes(config.data.prompts_per_step, config.sampling.num_samples)
    for _ in range(2):
        batch, _ = learner.prepare(params, episodes, 0.1)
        params, opt_state, metrics = learner.update(params, opt_state, batch, 0.1)
    # The base is bit for bit what it was; every adapter moved.
    new_adapters, new_base = lora.split(params)
    for a, b in zip(jax.tree.leaves(new_base), jax.tree.leaves(base_before)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for name, v in new_adapters["layers"].items():
        assert np.abs(np.asarray(v) - np.asarray(adapters["layers"][name])).max() > 0, name

    # The reference log-probs are the base model's, adapters off.
    batch, _ = learner.prepare(params, episodes, 0.1)
    base_graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.Transformer(
        lora.base_config(learner.model_config), rngs=nnx.Rngs(0))))
    s = learner.settings
    ref_bn = jax.jit(lambda p, x: step_lib.token_logprobs(
        base_graphdef, p, x, group_size=s.group_size, chunk=s.chunk,
        temperature=s.temperature)[0])(new_base, batch)
    mask = np.asarray(batch["loss_mask_bn"]) > 0
    np.testing.assert_allclose(np.asarray(batch["ref_logp_bn"])[mask], np.asarray(ref_bn)[mask],
                               atol=1e-6, rtol=0)
    assert float(metrics["kl/k1"]) != 0.0  # the adapters moved the policy off its base


def _sft_records(n=64, seed=1):
    rng = np.random.RandomState(seed)
    return [{"prompt_ids": [1] + rng.randint(2, 32, size=rng.randint(1, 6)).tolist(),
             "completion_ids": [7, 9, 7, 2]} for _ in range(n)]


@pytest.mark.parametrize("packing", [False, True])
def test_sft_with_lora_learns_and_leaves_the_base(tmp_path, packing):
    config = _lora_config(**{"sft.steps": 20, "sft.batch_size": 8, "sft.max_prompt_len": 8,
                             "sft.max_completion_len": 6, "sft.optim.lr": 1e-2,
                             "checkpoint.every": 20, "lora.alpha": 32.0, "sft.packing": packing,
                             "sft.seq_len": 64})
    records = _sft_records()
    config.sft.records_fn = lambda seed: records
    base = jax.device_get(lora.split(L.Learner(config, mesh=_one_device()).initial_params)[1])
    workdir = tmp_path / "sft"  # (a run's SFT stage, where launch.export reads it)
    params = L.sft(config, str(workdir), mesh=_one_device())
    # (The frozen unembedding and final norm of a random tiny model cap how sure it can get:
    # full fine-tuning reaches 0.1 of the first loss here, the adapters alone about 0.85.)
    losses = [r["sft/loss"] for r in _read(workdir)]
    assert np.mean(losses[-5:]) < losses[0] - 0.25
    for a, b in zip(jax.tree.leaves(lora.split(params)[1]), jax.tree.leaves(base)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if packing:
        return
    # launch.export rebuilds the base and merges the checkpoint's adapters: our logits.
    transformers = pytest.importorskip("transformers", reason="pip install '.[test]'")
    from ptrain import export as export_lib
    from ptrain import metrics
    config.sft.records_fn = None
    metrics.write_run_record(str(tmp_path), config, ["launch/train.py"])
    assert export_lib.export(str(tmp_path), str(tmp_path / "hf"), stage="sft") == 20
    tokens = np.random.RandomState(0).randint(0, 32, (2, 9))
    graphdef = L.Learner(config, mesh=_one_device()).graphdef
    ours = np.asarray(nnx.merge(graphdef, jax.device_get(params))(tokens))
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    np.testing.assert_allclose(_hf_logits(exported, tokens), ours, atol=2e-4, rtol=0)


def _read(workdir):
    from ptrain.metrics import read_jsonl
    return read_jsonl(str(workdir / "metrics.jsonl"))


# ------------------------------------------------------------------------------- exports

torch = pytest.importorskip("torch", reason="torch (CPU) is the reference; pip install '.[test]'")
transformers = pytest.importorskip("transformers", reason="pip install '.[test]'")


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Qwen2-shaped base written as a transformers directory, and our LoRA model on
    it with random (trained-like) adapters: (base dir, graphdef, state, config)."""
    base_dir = str(tmp_path_factory.mktemp("base"))
    base = model_lib.init(TINY, seed=0)
    hf.save(base, TINY, base_dir)
    c = TINY.replace(lora_rank=4, lora_alpha=8.0, lora_targets=ALL)
    graphdef, state = lora.attach(nnx.state(base), c, seed=3)
    return base_dir, graphdef, _randomised(state), c


def test_merged_export_loads_in_transformers_with_our_logits(trained, tmp_path):
    _, graphdef, state, c = trained
    merged, base_c = lora.merged(state, c)
    assert not lora.has_adapters(merged) and base_c.lora_rank == 0
    hf.save(merged, base_c, str(tmp_path))
    tokens = np.random.RandomState(0).randint(0, 64, (2, 11))
    ours = np.asarray(nnx.merge(graphdef, state)(tokens))
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    np.testing.assert_allclose(_hf_logits(exported, tokens), ours, atol=2e-4, rtol=0)
    # The rollout engine's decode copy is merged the same way (a base-shaped model).
    from ptrain.generate import decode_weights
    copy = decode_weights.decode_copy(state, "float32", lora_scale=lora.scale(c))
    assert not lora.has_adapters(copy)
    base_graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.Transformer(
        base_c, rngs=nnx.Rngs(0))))
    np.testing.assert_allclose(np.asarray(nnx.merge(base_graphdef, copy)(tokens)), ours,
                               atol=1e-5, rtol=0)


def test_peft_loads_the_adapter_directory_onto_the_transformers_base(trained, tmp_path):
    peft = pytest.importorskip("peft", reason="peft is the reference; pip install '.[test]'")
    base_dir, graphdef, state, c = trained
    lora.save_peft(state, c, str(tmp_path), base_model=base_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    tokens = np.random.RandomState(0).randint(0, 64, (2, 11))
    base_logits = _hf_logits(base, tokens)
    model = peft.PeftModel.from_pretrained(base, str(tmp_path)).eval()
    ours = np.asarray(nnx.merge(graphdef, state)(tokens))
    np.testing.assert_allclose(_hf_logits(model, tokens), ours, atol=2e-4, rtol=0)
    assert np.abs(base_logits - ours).max() > 1e-2  # the adapters matter


# ------------------------------------------------------------------- the engine's weight sync


def _engine_run(workdir, monkeypatch, *, stale):
    """3 GRPO steps with LoRA on the rollout engine's float32 decode copy; stale: the copy is
    never synced again after the first (the adapters the engine decodes stay the initial)."""
    from ptrain.generate import decode_weights
    if stale:  # (a float32 copy of float32 weights shares their arrays: copy, to keep them)
        copy = decode_weights.decode_copy
        monkeypatch.setattr(decode_weights, "decode_copy",
                            lambda *a, **k: jax.tree.map(jnp.copy, copy(*a, **k)))
        monkeypatch.setattr(decode_weights.DecodeWeights, "current",
                            lambda self, params: self.params is not None)
    config = _lora_config(**{"steps": 3, "optim.lr": 0.05, "sampling.engine": True,
                             "sampling.engine_slots": 16, "sampling.decode_dtype": "float32",
                             "data.prompts_per_step": 4, "sampling.num_samples": 4,
                             "rl.num_minibatches": 1, "rl.microbatch_size": 0,
                             "alerts.logp_mismatch_max": 0.01, "checkpoint.every": 10})
    L.train(config, str(workdir), mesh=_one_device())
    return _read(workdir)


def test_a_stale_adapter_in_the_engine_shows_in_logp_mismatch_and_fires_an_alert(
        tmp_path, monkeypatch):
    synced = _engine_run(tmp_path / "synced", monkeypatch, stale=False)
    assert max(r["rollout/logp_mismatch"] for r in synced) < 1e-4
    assert not any(k.startswith("alert/") for r in synced for k in r)
    stale = _engine_run(tmp_path / "stale", monkeypatch, stale=True)
    assert stale[0]["rollout/logp_mismatch"] < 1e-4  # step 1 decodes the initial adapters
    for r in stale[1:]:  # later steps decode them still, the learner has moved on
        assert r["rollout/logp_mismatch"] > 0.01 and r["alert/logp_mismatch"] == 1.0
