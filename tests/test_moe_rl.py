"""Mixture of experts in RL and SFT: the sampler records each token's experts (against
transformers' own router), the learner replays them (rl.router_replay) and measures its
agreement with them, the router's aux and z losses enter the RL loss (against transformers'
load-balancing loss), and GRPO and SFT run end to end on a tiny MoE and resume exactly."""

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import grpo_toy
from ptrain import learner as L
from ptrain import moe
from ptrain import rollout as rollout_lib
from ptrain import sharding
from ptrain import step as step_lib
from ptrain.metrics import read_jsonl
from tests import hf_fixtures

pytestmark = pytest.mark.xdist_group("moe_rl")

E, K = 8, 2


def one_device():
    return sharding.make_mesh(fsdp=1, devices=jax.devices()[:1])


def moe_config(**changes):
    """grpo_toy on a tiny MoE (layer 0 dense, layer 1 sparse): 4 prompts x 4 samples."""
    c = grpo_toy.get_config()
    c.model.update(n_layers=2, n_experts=E, n_experts_per_token=K, d_ff_expert=16,
                   norm_topk_prob=True, dense_layers=(0,), attention_impl="reference")
    c.data.prompts_per_step = 4
    c.sampling.update(num_samples=4, max_new_tokens=8)
    c.rl.update(num_minibatches=1, microbatch_size=0)
    c.update_from_flattened_dict(changes)  # dotted keys, e.g. 'rl.staleness'
    return c


def _metrics(workdir):
    return [{k: v for k, v in r.items() if not k.startswith("time/")}
            for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


# ------------------------------------------------------------- recording, against transformers

def _hf_moe(path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return hf_fixtures.tiny_qwen3_moe(path, num_experts=E, num_experts_per_tok=K)


def test_sampler_records_the_experts_transformers_routes_to(tmp_path):
    """Prompt and sampled tokens: the recorded experts of every MoE layer are the ones
    transformers' own Qwen3MoeTopKRouter picks in a forward over prompt + completion."""
    import torch
    from ptrain import hf
    from ptrain.generate import sampler as sampler_lib
    ref = _hf_moe(str(tmp_path))
    model, config = hf.load(str(tmp_path), overrides={"attention_impl": "reference"})
    assert moe.n_moe_layers(config) == 2
    prompts = [[1, 5, 9, 12, 3], [1, 40], [7, 7, 7, 20, 31, 2, 60]]
    out = sampler_lib.Sampler(model, seed=0).sample(
        model, prompts, max_new_tokens=6, num_samples=2, temperature=1.0, prompt_len=8)
    assert out.experts.shape == (6, 6, 2, K) and out.prompt_experts.shape == (3, 8, 2, K)

    chosen = []  # per forward: the experts of each MoE layer, as the router returns them
    routers = [m for m in ref.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    assert len(routers) == 2
    hooks = [r.register_forward_hook(lambda m, i, o: chosen.append(
        (o[0].float().softmax(-1).numpy(), o[2].numpy()))) for r in routers]
    compared = 0
    try:
        for row, completion in enumerate(out.completions()):
            prompt = prompts[out.prompt_index[row]]
            chosen.clear()
            with torch.no_grad():
                ref(torch.tensor([prompt + completion]))
            p = len(prompt)
            for layer, (probs, experts) in enumerate(chosen):
                margin = np.sort(probs, -1)[:, -K] - np.sort(probs, -1)[:, -K - 1]
                ours = np.concatenate([out.prompt_experts[out.prompt_index[row], 8 - p:, layer],
                                       out.experts[row, :len(completion), layer]])
                clear = margin > 1e-4  # a near-tie may flip under float differences
                np.testing.assert_array_equal(np.sort(ours[clear], -1),
                                              np.sort(experts[clear], -1))
                compared += clear.sum()
    finally:
        for h in hooks:
            h.remove()
    assert compared > 0.9 * sum(len(prompts[i]) + n for i, n in
                                zip(out.prompt_index, out.lengths)) * 2
    assert all((out.experts[r, n:] == 0).all() for r, n in enumerate(out.lengths))


# ---------------------------------------------------------------------------- router replay

@pytest.fixture(scope="module")
def rollout():
    """A learner on the tiny MoE, one rollout batch sampled from its initial parameters."""
    config = moe_config(**{"rl.num_minibatches": 2})  # old log-probs: measured in prepare
    learner = L.Learner(config, mesh=one_device())
    records = grpo_toy.prompt_records(0)[:4]
    producer = rollout_lib.SingleTurn(config, rollout_lib.make_sampler(
        nnx.merge(learner.graphdef, learner.initial_params), config))
    batch = producer.score(producer.generate(learner.initial_params, records,
                                             jax.random.key(3)))
    return learner, batch


@functools.partial(jax.jit, static_argnames=("graphdef", "group_size", "replay"))
def _learner_experts(params, x, *, graphdef, group_size, replay):
    """The experts the learner's log-prob forward (`step.token_logprobs`, as prepare and the
    update run it) routes each group's prompt and each continuation token to, with or
    without replay: ([MoE layers, b / G, p, k], [MoE layers, b, n, k]). Jitted: one compile
    per batch shape and replay, not one per eager op."""
    _, _, (prompt_r, tokens_r) = step_lib.token_logprobs(
        graphdef, params, x, group_size=group_size, replay=replay, return_routing=True)
    return prompt_r.experts_lbtk, tokens_r.experts_lbtk


@jax.jit
def _perturbed_router(params, scale):
    """A copy of `params` with router noise of `scale` x its std (jitted: one compile)."""
    params = jax.tree.map(jnp.copy, params)
    router = params["experts"]["router"]
    noise = jax.random.normal(jax.random.key(9), router[...].shape)
    router.value = router[...] + scale * jnp.std(router[...]) * noise
    return params


def test_replay_routes_training_to_the_rollouts_experts_and_cuts_the_mismatch(rollout):
    learner, batch = rollout
    s = learner.settings
    g = s.group_size
    assert batch.experts_bnlk.shape == (16, 8, 1, K)
    assert batch.prompt_experts_bplk.shape == (16, 8, 1, K)
    x = sharding.shard_batch(batch.arrays(), learner.mesh)
    valid_bn = np.arange(8)[None, :] < batch.lengths_b[:, None]

    def experts(params, replay):
        prompt_e, tokens_e = _learner_experts(params, x, graphdef=learner.graphdef,
                                              group_size=g, replay=replay)
        return np.asarray(prompt_e), np.asarray(tokens_e)

    # Same parameters: the learner's own routing is the sampler's, token for token.
    prompt_e, tokens_e = experts(learner.initial_params, False)
    np.testing.assert_array_equal(tokens_e[0][valid_bn], batch.experts_bnlk[:, :, 0][valid_bn])
    prompt_valid = np.arange(8)[None, :] >= 8 - batch.prompt_lens_b[::g, None]
    np.testing.assert_array_equal(prompt_e[0][prompt_valid],
                                  batch.prompt_experts_bplk[::g, :, 0][prompt_valid])

    # A perturbed router routes some tokens elsewhere; replay routes them where they went.
    moved = _perturbed_router(learner.initial_params, 0.5)
    tokens_moved = experts(moved, False)[1]
    assert (np.sort(tokens_moved[0], -1) != np.sort(batch.experts_bnlk[:, :, 0], -1)).any(
        -1)[valid_bn].mean() > 0.05
    np.testing.assert_array_equal(experts(moved, True)[1][0][valid_bn],
                                  batch.experts_bnlk[:, :, 0][valid_bn])

    def prepare(replay):
        settings = s.__class__(**{**s.__dict__, "router_replay": replay})
        return step_lib.prepare(moved, None, None, x, jnp.float32(0.0), graphdef=learner.graphdef,
                                critic_graphdef=None, s=settings)[1]

    off, on = prepare(False), prepare(True)
    agreement = float(off["moe/router_agreement"])
    assert 0.3 < agreement < 0.95
    # The same measure either way: the learner's router against the sampler's choices.
    np.testing.assert_allclose(float(on["moe/router_agreement"]), agreement, rtol=1e-6)
    assert float(on["rollout/logp_mismatch"]) < 0.5 * float(off["rollout/logp_mismatch"])


def test_replay_without_recorded_routing_is_a_clear_error(rollout):
    learner, batch = rollout
    bare = batch.__class__(**{**batch.columns(), "experts_bnlk": None,
                              "prompt_experts_bplk": None})
    settings = learner.settings.__class__(**{**learner.settings.__dict__,
                                             "router_replay": True})
    with pytest.raises(ValueError, match="no recorded routing"):
        step_lib.prepare(learner.initial_params, None, None,
                         sharding.shard_batch(bare.arrays(), learner.mesh), jnp.float32(0.0),
                         graphdef=learner.graphdef, critic_graphdef=None, s=settings)


# ------------------------------------------------------------------- aux loss in the RL loss

@pytest.fixture(scope="module")
def hf_router_batch(tmp_path_factory):
    """`_hf_router_batch`, built once for the two tests that read it."""
    return _hf_router_batch(tmp_path_factory.mktemp("hf_router"))


def _hf_router_batch(tmp_path, **model_changes):
    """transformers' tiny Qwen3-MoE, a learner on the same weights and a batch of 4 groups of
    4 random rows with zero advantages (so the policy loss is 0 and the RL loss is the
    router's), and transformers' (aux, z) over the router logits of every token the learner
    runs (each group's prompt once, each continuation): load_balancing_loss_func with
    coefficient 1, and the mean logsumexp^2."""
    import torch
    from transformers.models.qwen3_moe import modeling_qwen3_moe
    ref = _hf_moe(str(tmp_path))
    config = moe_config(hf_model=str(tmp_path))
    config.model.update(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                        d_ff=48, dense_layers=(1,), router_aux_loss_coef=0.01,
                        router_z_loss_coef=0.001, **model_changes)
    config.model.rope_theta = 10000.0
    rng = np.random.RandomState(0)
    prompts = [[1] + rng.randint(2, 64, rng.randint(1, 7)).tolist() for _ in range(4)]
    rows = [rng.randint(2, 64, rng.randint(1, 9)).tolist() for _ in range(16)]
    batch = L.Batch.from_rows([prompts[i // 4] for i in range(16)], rows,
                                 [[1] * len(r) for r in rows], [[0.0] * len(r) for r in rows],
                                 np.zeros(16), np.arange(16) // 4, prompt_len=8, length=8)

    logits = [[], []]  # per MoE layer: prompts' tokens once, then each row's continuation
    routers = [m for m in ref.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    hooks = [r.register_forward_hook(lambda m, i, o, layer=layer: logits[layer].append(o[0]))
             for layer, r in enumerate(routers)]
    with torch.no_grad():
        for prompt in prompts:
            ref(torch.tensor([prompt]))
        n_prompt_calls = len(logits[0])
        for i, row in enumerate(rows):
            ref(torch.tensor([prompts[i // 4] + row]))
    for h in hooks:
        h.remove()
    per_layer = []
    for layer in logits:
        prompt_part = layer[:n_prompt_calls]
        row_part = [l[len(prompts[i // 4]):] for i, l in enumerate(layer[n_prompt_calls:])]
        per_layer.append(torch.cat(prompt_part + row_part).double())
    aux = float(modeling_qwen3_moe.load_balancing_loss_func(tuple(per_layer), E, K))
    z = float(torch.mean(torch.logsumexp(torch.cat(per_layer), -1) ** 2))
    return config, batch, aux, z


def test_rl_loss_adds_transformers_load_balancing_loss(hf_router_batch):
    """With zero advantages the policy loss is 0, so the RL loss is the router's: aux_coef x
    transformers' load_balancing_loss_func over the router logits of every token the learner
    runs (each group's prompt once, each continuation) + z_coef x mean logsumexp^2."""
    config, batch, aux, z = hf_router_batch
    assert config.model.get("router_loss_scope", "microbatch") == "microbatch"
    learner = L.Learner(config, mesh=one_device())
    x = dict(sharding.shard_batch(batch.arrays(), learner.mesh),
             adv_bn=jnp.zeros((16, 8)))
    mask = x["loss_mask_bn"]
    rl_loss = jax.jit(functools.partial(step_lib._rl_loss, graphdef=learner.graphdef,
                                        s=learner.settings))  # one compile, not one per op
    loss, metrics = rl_loss(learner.initial_params, x, mask.sum(), (mask.sum(-1) > 0).sum(),
                            0.0)
    np.testing.assert_allclose(float(metrics["moe/aux_loss"]), aux, rtol=2e-4)
    np.testing.assert_allclose(float(metrics["moe/z_loss"]), z, rtol=2e-4)
    np.testing.assert_allclose(float(loss), 0.01 * aux + 0.001 * z, rtol=2e-4)
    load = np.asarray(metrics["moe/load"])
    assert load.shape == (E,) and abs(load.sum() - 1) < 1e-5
    assert float(metrics["moe/dropped_fraction"]) == 0


def test_global_router_loss_is_transformers_over_the_whole_batch(hf_router_batch):
    """router_loss_scope="global": with the batch in 2 microbatches on a data x fsdp mesh,
    the update's loss is aux_coef x transformers' load_balancing_loss_func over the whole
    batch (+ z_coef x its z-loss), and its gradient is the one-microbatch update's; the
    per-microbatch scope gives another value and another gradient."""
    config, batch, aux, z = hf_router_batch  # (each update below sets its scope)

    def update(scope, microbatch, mesh):
        c = config.copy_and_resolve_references()
        c.model.router_loss_scope = scope
        c.rl.microbatch_size = microbatch
        learner = L.Learner(c, mesh=mesh)
        params = learner.initial_params
        x = dict(sharding.shard_batch(batch.arrays(), learner.mesh),
                 adv_bn=sharding.shard_batch({"a": np.zeros((16, 8), np.float32)},
                                             learner.mesh)["a"])
        metrics = learner.update(params, learner.init_opt_state(params), x)[2]
        return {k: float(np.asarray(v)) for k, v in metrics.items() if np.ndim(v) == 0}

    shards = sharding.make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])
    split = update("global", 8, shards)
    whole = update("microbatch", 0, one_device())
    per_micro = update("microbatch", 8, shards)
    np.testing.assert_allclose(split["optim/loss"], 0.01 * aux + 0.001 * z, rtol=2e-4)
    np.testing.assert_allclose(split["moe/aux_loss"], aux, rtol=2e-4)
    np.testing.assert_allclose(split["moe/z_loss"], z, rtol=2e-4)
    np.testing.assert_allclose(whole["optim/loss"], split["optim/loss"], rtol=2e-5)
    np.testing.assert_allclose(whole["optim/grad_norm"], split["optim/grad_norm"], rtol=1e-4)
    assert abs(per_micro["moe/aux_loss"] - aux) > 1e-3 * aux
    assert abs(per_micro["optim/grad_norm"] - split["optim/grad_norm"]) > 1e-3 * split[
        "optim/grad_norm"]


# ----------------------------------------------------------------- end to end, with resume

RUN_STEPS, EVERY = 4, 2


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("moe_grpo"))
    config = moe_config(steps=RUN_STEPS, **{"checkpoint.every": EVERY, "rl.router_replay": True,
                                            "model.router_aux_loss_coef": 0.01,
                                            "model.router_z_loss_coef": 0.001})
    L.train(config, workdir, mesh=one_device())
    return workdir, config


def test_grpo_on_a_tiny_moe_logs_routing_and_resumes_exactly(grpo_run, tmp_path):
    workdir, config = grpo_run
    records = _metrics(workdir)
    assert [r["step"] for r in records] == list(range(1, RUN_STEPS + 1))
    for r in records:
        assert len(r["moe/load"]) == E and abs(sum(r["moe/load"]) - 1) < 1e-5
        assert r["moe/dropped_fraction"] == 0 and r["moe/aux_loss"] > 0
        assert r["moe/router_agreement"] >= 0.99  # on-policy, one update: the same router
        assert r["rollout/logp_mismatch"] < 1e-5
    resumed = tmp_path / "resumed"
    shutil.copytree(os.path.join(workdir, "checkpoints", str(EVERY)),
                    resumed / "checkpoints" / str(EVERY))
    L.train(config, str(resumed), mesh=one_device())
    again = _metrics(resumed)
    assert [r["step"] for r in again] == list(range(EVERY + 1, RUN_STEPS + 1))
    assert again == records[EVERY:]


@pytest.mark.parametrize("cache", ["recompute", "keep"])
def test_replay_with_interruption_trains_and_resumes_exactly(tmp_path, monkeypatch, cache):
    """rl.router_replay with rl.interrupt (k = 1 on the engine, the swap forced after 4 of
    the 8 tokens): batches 2.. are interrupted (their prefixes recomputed with the experts
    they recorded, tests/test_interrupt.py, or with rl.interrupt_cache="keep" their caches
    kept), the learner replays them, and a run resumed from step 2's checkpoint logs what
    the uninterrupted one did."""
    from ptrain.generate import interrupt
    monkeypatch.setattr(interrupt.Switch, "at_round", 1)
    monkeypatch.setattr(interrupt.Switch, "every", 4)
    config = moe_config(steps=RUN_STEPS, **{
        "checkpoint.every": EVERY, "rl.router_replay": True, "rl.staleness": 1,
        "rl.interrupt": True, "rl.interrupt_cache": cache, "rl.tis_cap": 2.0,
        "sampling.engine": True, "sampling.engine_slots": 16})
    workdir = tmp_path / "reference"
    L.train(config, str(workdir), mesh=one_device())
    records = _metrics(str(workdir))
    assert [r["step"] for r in records] == list(range(1, RUN_STEPS + 1))
    assert records[0]["rollout/interrupted"] == 0  # generated before any update
    assert all(r["rollout/interrupted"] > 0 for r in records[1:])
    assert all(r["rollout/token_staleness_hist"][1] > 0 for r in records[1:])
    recomputed = sum(r.get("engine/recompute_tokens", 0) for r in records)
    assert (recomputed > 0) == (cache == "recompute")
    resumed = tmp_path / "resumed"
    shutil.copytree(workdir / "checkpoints" / str(EVERY), resumed / "checkpoints" / str(EVERY))
    L.train(config, str(resumed), mesh=one_device())
    # (engine/* describe each process's own generations: the resumed one trains on the
    # pending batches its checkpoint saved finished, so it generates less)
    untimed = [[{k: v for k, v in r.items() if not k.startswith("engine/")} for r in rs]
               for rs in (_metrics(str(resumed)), records[EVERY:])]
    assert untimed[0] == untimed[1]


def test_expert_parallel_grpo_matches_the_one_device_run(grpo_run, tmp_path):
    """The same GRPO run with router replay on fsdp=2 x expert=4 of the 8 simulated devices
    (experts sharded 4 ways, tokens dispatched by all-to-all) gives the one-device run's
    metrics step for step: the same samples and rewards, losses and routing to float
    rounding."""
    workdir, config = grpo_run
    c = config.copy_and_resolve_references()
    c.mesh.update(fsdp=2, expert=4)
    L.train(c, str(tmp_path), mesh=sharding.make_mesh(fsdp=2, expert=4))
    one, ep = _metrics(workdir), _metrics(tmp_path)
    assert [r["step"] for r in ep] == [r["step"] for r in one]
    for a, b in zip(one, ep):
        assert a.keys() == b.keys()
        assert a["reward/mean"] == b["reward/mean"]
        assert b["moe/router_agreement"] >= 0.99
        for key in a:
            np.testing.assert_allclose(np.asarray(b[key], float), np.asarray(a[key], float),
                                       rtol=1e-4, atol=1e-6, err_msg=key)


def test_sft_on_a_tiny_moe_resumes_exactly(tmp_path):
    rng = np.random.RandomState(1)
    records = [{"prompt_ids": [1] + rng.randint(2, 32, size=rng.randint(1, 6)).tolist(),
                "completion_ids": [7, 9, 7, 2]} for _ in range(32)]
    config = moe_config(**{"sft.steps": 4, "sft.batch_size": 8, "sft.max_prompt_len": 8,
                           "sft.max_completion_len": 6, "checkpoint.every": 2,
                           "model.router_aux_loss_coef": 0.01})
    config.sft.records_fn = lambda seed: records
    L.sft(config, str(tmp_path / "full"), mesh=one_device())
    full = _metrics(tmp_path / "full")
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert all(len(r["moe/load"]) == E and r["moe/aux_loss"] > 0 for r in full)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "2",
                    tmp_path / "resumed" / "checkpoints" / "2")
    L.sft(config, str(tmp_path / "resumed"), mesh=one_device())
    assert _metrics(tmp_path / "resumed") == full[2:]


# ------------------------------------------------- multi-turn and mixed producers record routing

@pytest.fixture(scope="module")
def mixed_rollout():
    return _mixed_rollout(engine=False)


def _loop_config(tok, **data):
    """closed_loop's config on the tiny MoE for `tok`, 2 samples of 6 tokens per prompt."""
    from ptrain import closed_loop as CL
    c = CL.defaults()
    c.model.update(vocab_size=tok.vocab_size, d_model=32, d_ff=64, n_layers=2, n_experts=E,
                   n_experts_per_token=K, d_ff_expert=16, norm_topk_prob=True,
                   dense_layers=(0,), attention_impl="reference")
    c.data.update(**data)
    c.sampling.update(num_samples=2, max_new_tokens=6, stop_token_ids=(tok.eos_token_id,))
    c.rl.update(num_minibatches=2)  # old log-probs (and agreement) measured in prepare
    return c


def _mixed_rollout(*, engine):
    """One batch of a mixed producer on the tiny MoE: two multi-turn task records (a failed
    first answer gets its feedback and a second attempt: the feedback is routed by the second
    turn's prefill, or on the engine by its own prefill into the episode's slot) next to two
    single-turn prompt records, sampled from the initial parameters; the learner's config is
    closed_loop's."""
    from ptrain import closed_loop as CL
    from ptrain import tasks
    from ptrain.rollout import mixed as mixed_producer
    from ptrain.envs.synthetic import WordTokenizer
    tok = WordTokenizer.for_tasks()
    c = _loop_config(tok, max_prompt_len=16, prompts_per_step=4)
    c.rollout.update(max_turns=1, max_attempts=2, max_len=64)
    c.reward_fn = lambda record, ids, text: float(len(ids) % 2)
    c.sampling.update(engine=engine, engine_slots=8)
    learner = L.Learner(c, mesh=one_device(), tokenizer=tok)
    sampler = CL.make_sampler(c, learner.mesh, tok)
    producer = mixed_producer.MixedProducer(
        {"tasks": rollout_lib.Tasks(sampler, tok, c, pool=None),
         "single": rollout_lib.SingleTurn(c, sampler, tokenizer=tok)},
        route=lambda r: "single" if "prompt_ids" in r else "tasks", pad_id=learner.pad_id)
    records = [tasks.to_record(tasks.Task(f"t{i}", "arith", tasks.Answer("42", numeric=True),
                                          prompt=f"arith: what is {i} plus 40"))
               for i in range(2)]
    records += [{"prompt_ids": tok.encode("arith: what is 3 plus 4")}, {"prompt_ids": [5, 9]}]
    batch = producer.score(producer.generate(learner.initial_params, records,
                                             jax.random.key(4)))
    return learner, batch


def _valid(batch, g):
    """Valid continuation tokens [b, n] and each group's valid prompt tokens [b / G, p]."""
    n, p = batch.tokens_bn.shape[1], batch.prompt_bp.shape[1]
    return (np.arange(n)[None, :] < batch.lengths_b[:, None],
            np.arange(p)[None, :] >= p - batch.prompt_lens_b[::g, None])


def test_multi_turn_and_mixed_producers_record_routing_and_replay_restores_it(mixed_rollout):
    _check_recorded_routing(*mixed_rollout)


def test_the_engine_records_routing_single_and_multi_turn():
    """The same producers on the rollout engine (sampling.engine=True: each episode keeps its
    slot across turns, an observation prefilled alone): what it records is what the learner
    routes each token to, and replay restores it."""
    _check_recorded_routing(*_mixed_rollout(engine=True))


def _check_recorded_routing(learner, batch):
    multi = [i for i, m in enumerate(batch.meta) if m.get("attempts") == 2]
    assert len(multi) == 4 and len(batch) == 8  # both task groups tried twice
    assert batch.experts_bnlk.shape == (8, 64, 1, K)
    _check_replay_restores(learner, batch)


def _check_replay_restores(learner, batch, valid_bn=None, *, agreement=True):
    """Every token the learner runs up to `valid_bn` (default: each row's length) has its
    recorded experts, which are the learner's own routing with the same parameters and
    which replay restores under a moved router; with `agreement`, also the prepare step's
    agreement metrics (1.0 with the same parameters, replay-independent under moved ones)."""
    from ptrain import routing
    s = learner.settings
    g = s.group_size
    lengths_bn, valid_gp = _valid(batch, g)
    valid_bn = lengths_bn if valid_bn is None else valid_bn
    # Every token the learner runs is recorded: prompts, both turns, the feedback between.
    assert (batch.experts_bnlk[valid_bn] >= 0).all()
    assert (batch.prompt_experts_bplk[::g][valid_gp] >= 0).all()
    routing.check_replay(batch)
    x = sharding.shard_batch(batch.arrays(), learner.mesh)

    def experts(params, replay):
        prompt_e, tokens_e = _learner_experts(params, x, graphdef=learner.graphdef,
                                              group_size=g, replay=replay)
        return np.asarray(prompt_e)[0], np.asarray(tokens_e)[0]

    recorded_bnk = batch.experts_bnlk[:, :, 0]
    recorded_gpk = batch.prompt_experts_bplk[::g, :, 0]
    # Same parameters: the learner's own routing of each history (one forward of the whole
    # continuation) is what the sampler's turns recorded, token for token.
    prompt_e, tokens_e = experts(learner.initial_params, False)
    np.testing.assert_array_equal(tokens_e[valid_bn], recorded_bnk[valid_bn])
    np.testing.assert_array_equal(prompt_e[valid_gp], recorded_gpk[valid_gp])

    moved = _perturbed_router(learner.initial_params, 0.5)
    tokens_moved = experts(moved, False)[1]
    assert (np.sort(tokens_moved, -1) != np.sort(recorded_bnk, -1)).any(-1)[valid_bn].mean() > 0.05
    prompt_on, tokens_on = experts(moved, True)
    np.testing.assert_array_equal(tokens_on[valid_bn], recorded_bnk[valid_bn])
    np.testing.assert_array_equal(prompt_on[valid_gp], recorded_gpk[valid_gp])
    if not agreement:
        return

    def prepare(params, replay):
        settings = s.__class__(**{**s.__dict__, "router_replay": replay})
        return step_lib.prepare(params, None, None, x, jnp.float32(0.0),
                                graphdef=learner.graphdef, critic_graphdef=None, s=settings)[1]

    same = prepare(learner.initial_params, False)
    assert float(same["moe/router_agreement"]) == 1.0
    assert float(same["moe/router_agreement_prompt"]) == 1.0
    off, on = prepare(moved, False), prepare(moved, True)
    for name in ("moe/router_agreement", "moe/router_agreement_prompt"):
        assert 0.3 < float(off[name]) < 0.95, name
        np.testing.assert_allclose(float(on[name]), float(off[name]), rtol=1e-6)
    assert np.asarray(off["moe/router_agreement_prompt_l"]).shape == (1,)
    assert float(on["rollout/logp_mismatch"]) < 0.5 * float(off["rollout/logp_mismatch"])


def test_terminal_episodes_record_routing_and_replay_restores_it(tmp_path):
    """Terminal episodes (rollout.Tasks on the terminal environment) on the tiny MoE, its
    episodes in real task shells: a chat format that reads every turn as the same bash call
    gives each episode two model turns with the shell's answer between them (routed by the
    second turn's prefill). Every token up to the last sampled one is recorded, the learner
    routes it the same way, replay restores it; the observation after the last turn, which
    no sampler forward consumed, is unrecorded. (On bwrap where it can run, else on docker.)
"""
    import dataclasses
    from ptrain import chat, closed_loop as CL, routing, rollout
    from ptrain.envs import terminal as terminal_env
    from ptrain.envs.terminal import generated as terminal_tasks
    from sandbox import terminal
    backend = "bwrap" if terminal.bwrap.unavailable() is None else "docker"
    if backend == "docker":
        from tests.test_terminal import _REASON
        if _REASON is not None:
            pytest.skip(f"{terminal.bwrap.unavailable()}; {_REASON}")
    tok = terminal_tasks.tokenizer()
    c = _loop_config(tok, max_prompt_len=24, prompts_per_step=2)
    learner = L.Learner(c, mesh=one_device(), tokenizer=tok)
    sampler = CL.make_sampler(c, learner.mesh, tok)
    always_calls = dataclasses.replace(
        chat.PLAIN, name="every-turn-a-call",
        parse_calls=lambda text: [chat.ToolCall("bash", {"command": "echo routed"})])
    generated = terminal_tasks.generate(str(tmp_path), 2, seed=0, split="train")
    c.rollout.update(max_turns=2, max_len=64)
    with terminal.Harness(backend=backend) as h:
        env = dataclasses.replace(terminal_env.make(system="", threads=4), open_session=lambda t:
                                  h.episode(terminal.load_task(t.task_dir)))
        producer = rollout.Tasks(sampler, tok, c, None, envs={"terminal": env})
        producer.fmt = always_calls
        batch = producer.score(producer.generate(learner.initial_params, generated,
                                                 jax.random.key(3)))
    assert len(batch) == 4 and all(m["turns"] == 2 and m["tool_calls"] == 2
                                   for m in batch.meta), batch.meta
    assert batch.experts_bnlk.shape == (4, 64, 1, K)
    n = batch.tokens_bn.shape[1]
    mask_bn = batch.loss_mask_bn > 0
    last_b = n - 1 - np.argmax(mask_bn[:, ::-1], axis=1)
    upto_bn = np.arange(n)[None, :] <= last_b[:, None]
    # Two model turns, the first observation between them: tokens of all three kinds.
    for i in range(4):
        runs = np.flatnonzero(np.diff(mask_bn[i, :last_b[i] + 1].astype(int)))
        assert len(runs) == 2, mask_bn[i]
    after_bn = (np.arange(n)[None, :] < batch.lengths_b[:, None]) & ~upto_bn
    assert after_bn.any() and (batch.experts_bnlk[after_bn] == routing.UNRECORDED).all()
    _check_replay_restores(learner, batch, upto_bn, agreement=False)  # (metrics: above)


def test_replay_refuses_rows_whose_producer_records_no_routing(mixed_rollout):
    """A mixed batch with one producer that records nothing (a producer that records none, or routing dropped): the
    concat marks its rows unrecorded, the learner refuses to replay them and names them."""
    from ptrain import routing
    from ptrain.rollout import mixed as mixed_producer
    learner, batch = mixed_rollout
    rows = np.arange(len(batch))
    tasks_rows = rows[:4] if batch.meta[0].get("attempts") else rows[4:]
    part = lambda idx, keep: batch.__class__(**{  # noqa: E731
        **{k: v[idx] for k, v in batch.columns().items() if k != "meta"},
        "meta": [batch.meta[i] for i in idx],
        **({} if keep else {"experts_bnlk": None, "prompt_experts_bplk": None})})
    others = np.setdiff1d(rows, tasks_rows)
    mixed = mixed_producer.concat([part(tasks_rows, True), part(others, False)])
    assert (mixed.experts_bnlk[4:] == routing.UNRECORDED).all()
    np.testing.assert_array_equal(mixed.experts_bnlk[:4], batch.experts_bnlk[tasks_rows])
    settings = learner.settings.__class__(**{**learner.settings.__dict__,
                                             "router_replay": True})
    learner.settings = settings
    try:
        with pytest.raises(ValueError, match="4 rows .* without recorded routing"):
            learner.prepare(learner.initial_params, mixed)
    finally:
        learner.settings = settings.__class__(**{**settings.__dict__, "router_replay": False})
