"""ptrain.learner: the toy GRPO run learns, sharding changes nothing,
advantages match their formulas, PPO's critic (values, GAE, training, resume), SFT trains on
completion tokens only, DAPO sampling, config. (SIGKILL + resume: test_resume.py.)"""

import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs import grpo_toy
from configs import ppo_toy
from ptrain import batch as batch_lib
from ptrain import config as config_lib
from ptrain import learner as L
from ptrain import rollout
from ptrain import sharding
from ptrain import step as step_lib
from ptrain.generate.sampler import Sampler
from ptrain.metrics import read_jsonl

pytestmark = pytest.mark.xdist_group("learner")  # the module fixtures run once, on one worker


def one_device():
    return sharding.make_mesh(fsdp=1, devices=jax.devices()[:1])


def toy_config(_module=grpo_toy, **changes):
    c = _module.get_config()
    c.update_from_flattened_dict(changes)  # dotted keys, e.g. 'rl.staleness'
    return c


@pytest.fixture(scope="module")
def initial_params():
    """The toy model's parameters (built once: initialising compiles for seconds)."""
    return jax.device_get(nnx.state(L.build_model(toy_config(), one_device())))


def _learner(config, params, mesh=None):
    return L.Learner(config, mesh=mesh or one_device(), params=params)


def _metrics(workdir):
    """metrics.jsonl without wall-clock timings."""
    return [{k: v for k, v in r.items() if not k.startswith("time/")}
            for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


# --------------------------------------------------------------------- the toy run, resumed

STEPS, EVERY = 12, 4


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """The uninterrupted toy GRPO run."""
    workdir = str(tmp_path_factory.mktemp("toy"))
    config = toy_config(steps=STEPS, **{"checkpoint.every": EVERY})
    L.train(config, workdir, mesh=one_device())
    return workdir


def test_grpo_toy_run_reaches_high_reward(toy_run):
    from ptrain import metrics
    assert metrics.read_run_config(toy_run).steps == STEPS  # a Python run's record (export)
    records = _metrics(toy_run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[0]["reward/mean"] < 0.2  # about 1/32 at random
    assert records[-1]["reward/mean"] >= 0.9
    assert records[-1]["actor/entropy"] < records[0]["actor/entropy"]
    # The sampler's log-probs are the learner's (same model, same float32 math).
    assert max(r["rollout/logp_mismatch"] for r in records) < 1e-5
    steps = sorted(int(n) for n in os.listdir(os.path.join(toy_run, "checkpoints")) if n.isdigit())
    assert steps == [8, 12]  # keep=2
    rollouts = read_jsonl(os.path.join(toy_run, "rollouts.jsonl"))
    assert {r["step"] for r in rollouts} == {1, 10} and len(rollouts) == 8  # step 1 always
    assert os.path.exists(os.path.join(toy_run, "plots", "reward_mean.png"))


# ------------------------------------------------------------------------ one update, sharded


def _random_episodes(groups, per_group, seed=0):
    """Prompts of 2-8 tokens, completions of 1-8, rewards 0/1, rollout log-probs near the
    untrained model's (about -log 32)."""
    rng = np.random.RandomState(seed)
    prompts, tokens, masks, logps = [], [], [], []
    for _ in range(groups):
        prompt = [1] + rng.randint(2, 32, size=rng.randint(1, 8)).tolist()
        for _ in range(per_group):
            n = rng.randint(1, 9)
            prompts.append(prompt)
            tokens.append(rng.randint(2, 32, size=n).tolist())
            masks.append([1] * n)
            logps.append((-3.5 + 0.3 * rng.randn(n)).tolist())
    return L.Batch.from_rows(prompts, tokens, masks, logps,
                                rng.randint(0, 2, groups * per_group),
                                np.repeat(np.arange(groups), per_group), prompt_len=8, length=8)


# The PPO settings of the sharded tests (test_microbatched_prepare_equals_one_shot's too, so
# that its one-pass prepare on fsdp=4 x tensor=2 is this test's program: compiled once).
SHARDED_PPO = {"rl.agg": "seq-mean-token-sum", "rl.entropy_coef": 0.01, "kl.coef": 0.05,
               "kl.kind": "k3", "optim.eps": 1.0, "rl.tis_cap": 1.5, "rl.estimator": "gae",
               "rl.lam": 0.9, "critic.optim.eps": 1.0, "critic.optim.lr": 1e-3}


def test_sharded_update_with_accumulation_equals_unsharded(initial_params):
    """fsdp=4 x tensor=2 with 2 microbatches per minibatch == one device, no accumulation,
    for the policy and its critic (PPO with GAE).

    Rows differ in length, so seq-mean-token-sum depends on the whole minibatch's sequence
    count. Adam's eps is large so that the update is linear in the gradient (float noise in
    near-zero gradients cannot flip their sign).
    """
    changes = SHARDED_PPO
    plain = _learner(toy_config(**changes, **{"rl.microbatch_size": 0}), initial_params)
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    sharded = _learner(toy_config(**changes, **{"rl.microbatch_size": 16}), initial_params,
                       mesh)
    assert sharded.settings.has_old_logp and sharded.settings.kl_loss
    episodes = _random_episodes(groups=8, per_group=8)

    def run(learner):
        params, critic = learner.initial_params, learner.init_critic()
        if learner is sharded:  # the critic is sharded like the policy
            for decoder in (params, critic["decoder"]):
                assert decoder["layers"]["wq"][...].sharding.spec == P(None, "fsdp", "tensor",
                                                                       None)
        batch, prep = learner.prepare(params, episodes, 0.05, critic_params=critic)
        critic, _, critic_metrics = learner.update_critic(
            critic, learner.init_opt_state(critic, learner.critic_tx), batch)
        params, _, metrics = learner.update(params, learner.init_opt_state(params), batch, 0.05)
        return jax.device_get(((params, critic), prep, {**metrics, **critic_metrics}))

    critic0 = jax.device_get(plain.init_critic())
    p_plain, prep_plain, m_plain = run(plain)
    p_sharded, prep_sharded, m_sharded = run(sharded)
    for got, expected, before in zip(p_sharded, p_plain, (initial_params, critic0)):
        moved = 0.0
        for a, b, p0 in zip(jax.tree.leaves(got), jax.tree.leaves(expected),
                            jax.tree.leaves(before)):
            np.testing.assert_allclose(a, b, atol=2e-6, rtol=0)
            moved = max(moved, float(np.abs(b - p0).max()))
        assert moved > 1e-4  # the update did something
    for key in m_plain:
        np.testing.assert_allclose(m_sharded[key], m_plain[key], atol=1e-5, rtol=1e-5,
                                   err_msg=key)
    for key in prep_plain:
        np.testing.assert_allclose(prep_sharded[key], prep_plain[key], atol=1e-5, err_msg=key)


def test_token_logprobs_sequence_parallel(initial_params):
    """Continuations over `sequence` (4) x `fsdp` (2): the log-probs, entropies and their
    gradients equal one device's, and the hidden states [b, n, d] are never all-gathered
    (each sequence shard scores its own tokens)."""
    from test_losses import all_gather_shapes

    config, group, n = toy_config(), 8, 16
    rng = np.random.RandomState(1)
    prompts = [[1] + rng.randint(2, 32, size=rng.randint(1, 7)).tolist() for _ in range(2)]
    tokens = [rng.randint(2, 32, size=rng.randint(1, n + 1)).tolist() for _ in range(16)]
    episodes = L.Batch.from_rows(
        [prompts[i // group] for i in range(16)], tokens, [[1] * len(x) for x in tokens],
        [[0.0] * len(x) for x in tokens], np.zeros(16), np.arange(16) // group, prompt_len=8,
        length=n)
    weights = rng.randn(16, n).astype(np.float32)

    def run(mesh):
        learner = _learner(config, initial_params, mesh)
        batch = sharding.shard_batch(episodes.arrays(), learner.mesh)

        def f(params):
            logp, ent = step_lib.token_logprobs(learner.graphdef, params, batch, group_size=group,
                                         chunk=4)
            return (weights * logp).sum() + 0.1 * ent.sum(), (logp, ent)

        # One compile: the values come from the executable whose HLO is inspected.
        fn = jax.jit(jax.value_and_grad(f, has_aux=True)).lower(learner.initial_params).compile()
        return jax.device_get(fn(learner.initial_params)), all_gather_shapes(fn.as_text())

    expected, _ = run(None)
    got, gathered = run(sharding.make_mesh(fsdp=2, sequence=4))
    d = config.model.d_model
    assert not [s for s in gathered if d in s and np.prod(s) >= 16 // 2 * n * d], gathered
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ advantages


THREE_GROUPS_OF_3 = {"sampling.num_samples": 3, "data.prompts_per_step": 3,
                     "rl.num_minibatches": 1, "rl.microbatch_size": 0}


def _fixed_episodes():
    """Three groups of three (the last with equal rewards), completions of different
    lengths, one with a masked-out (observation) token in the middle."""
    rng = np.random.RandomState(0)
    lengths = [3, 5, 2, 4, 6, 1, 2, 7, 3]
    rewards = [1.0, 0.0, 0.5, 2.0, 2.0, -1.0, 0.7, 0.7, 0.7]
    prompts = [[1] + rng.randint(2, 32, size=3).tolist() for _ in range(3)]
    masks = [[1] * n for n in lengths]
    masks[4][2] = 0
    return L.Batch.from_rows(
        [prompts[i // 3] for i in range(9)], [rng.randint(2, 32, size=n).tolist()
                                              for n in lengths],
        masks, [[0.0] * n for n in lengths], rewards, np.arange(9) // 3, prompt_len=6,
        length=8)


def _expected_advantages(estimator, rewards, groups, mask_bn):
    r, g = np.asarray(rewards, np.float64), np.asarray(groups)
    adv_b = np.zeros(len(r))
    for gid in np.unique(g):
        i = g == gid
        n, mean = i.sum(), r[i].mean()
        if estimator == "grpo":
            adv_b[i] = (r[i] - mean) / (r[i].std(ddof=1) + 1e-6)
        elif estimator in ("drgrpo", "reinforce++-baseline"):  # the latter whitened below
            adv_b[i] = r[i] - mean
        elif estimator == "rloo":
            adv_b[i] = (n * r[i] - r[i].sum()) / (n - 1)
        else:  # reinforce++, gamma 1: the return passes through the observation token, so
            adv_b[i] = r[i]  # every model token before it gets the final reward too
    adv_bn = adv_b[:, None] * mask_bn
    if estimator.startswith("reinforce++"):  # whitened over all valid tokens, Bessel
        valid = adv_bn[mask_bn > 0]
        adv_bn = np.where(mask_bn > 0, (adv_bn - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8),
                          0)
    return adv_bn


@pytest.mark.parametrize("estimator", [e for e in config_lib.ESTIMATORS if e != "gae"])
def test_advantages_follow_the_published_formulas(estimator, initial_params):
    learner = _learner(toy_config(**{"rl.estimator": estimator}, **THREE_GROUPS_OF_3),
                       initial_params)
    episodes = _fixed_episodes()
    batch, _ = learner.prepare(learner.initial_params, episodes)
    expected = _expected_advantages(estimator, episodes.rewards_b, episodes.group_ids_b,
                                    episodes.loss_mask_bn.astype(np.float64))
    np.testing.assert_allclose(np.asarray(batch["adv_bn"]), expected, atol=1e-5)


def test_kl_in_reward_lowers_the_sequence_score(initial_params):
    config = toy_config(**{"kl.coef": 0.5, "kl.in_reward": True, "kl.kind": "k1",
                           "rl.estimator": "drgrpo"}, **THREE_GROUPS_OF_3)
    learner = _learner(config, initial_params)
    # A reference that differs from the policy, so the KL is not zero.
    learner.ref_params = jax.tree.map(lambda x: x * 1.5, learner.ref_params)
    episodes = _fixed_episodes()
    batch, metrics = learner.prepare(learner.initial_params, episodes, 0.5)
    mask = episodes.loss_mask_bn.astype(np.float64)
    kl_bn = (np.asarray(batch["old_logp_bn"], np.float64)
             - np.asarray(batch["ref_logp_bn"], np.float64)) * mask
    assert np.abs(kl_bn).max() > 1e-2
    scores = episodes.rewards_b - 0.5 * kl_bn.sum(-1)
    expected = _expected_advantages("drgrpo", scores, episodes.group_ids_b, mask)
    np.testing.assert_allclose(np.asarray(batch["adv_bn"]), expected, atol=1e-4)
    per_seq = kl_bn.sum(-1) / mask.sum(-1)
    np.testing.assert_allclose(metrics["kl/in_reward"], per_seq.mean(), rtol=1e-4)


# ------------------------------------------------------------------------- PPO's critic


def test_gae_advantages_from_the_critic_values(initial_params):
    """The critic starts as the policy's decoder with a value head; its value of token j is
    read at the state before j (the prompt's last token for j = 0) in a plain full forward of
    prompt + continuation; GAE over those values skips the observation token, and its token
    rewards carry the KL penalty when the KL is in the reward."""
    from test_losses import ref_gae, ref_whiten

    config = toy_config(**{"rl.estimator": "gae", "rl.gamma": 0.9, "rl.lam": 0.8,
                           "kl.coef": 0.5, "kl.in_reward": True, "kl.kind": "k1"},
                        **THREE_GROUPS_OF_3)
    learner = _learner(config, initial_params)
    learner.ref_params = jax.tree.map(lambda x: x * 1.5, learner.ref_params)
    critic = learner.init_critic()
    np.testing.assert_array_equal(critic["decoder"]["layers"]["wq"][...],
                                  initial_params["layers"]["wq"][...])
    assert "lm_head" not in critic["decoder"]  # the critic carries no output projection
    episodes = _fixed_episodes()
    with pytest.raises(ValueError, match="pass critic_params exactly when"):
        learner.prepare(learner.initial_params, episodes)
    batch, metrics = learner.prepare(learner.initial_params, episodes, 0.5,
                                     critic_params=critic)

    model = nnx.merge(learner.critic_graphdef, critic)
    lengths = episodes.lengths_b
    rows = np.zeros((9, 6 + 8), np.int32)
    for i in range(9):
        p = episodes.prompt_lens_b[i]
        rows[i, :p + lengths[i]] = np.concatenate([episodes.prompt_bp[i, -p:],
                                                   episodes.tokens_bn[i, :lengths[i]]])
    v_full = np.asarray(nnx.jit(lambda m, x: m.values(m.decoder.hidden(x)[0]))(
        model, jnp.asarray(rows)), np.float64)
    values = np.zeros((9, 8))
    for i in range(9):
        p = episodes.prompt_lens_b[i]
        values[i, :lengths[i]] = v_full[i, p - 1:p - 1 + lengths[i]]
    assert values.std() > 1e-3  # the values differ: the alignment is tested
    valid = np.arange(8)[None] < lengths[:, None]
    np.testing.assert_allclose(np.where(valid, batch["old_values_bn"], 0), values, atol=1e-5)

    mask = episodes.loss_mask_bn.astype(np.float64)
    kl_bn = (np.asarray(batch["old_logp_bn"], np.float64)
             - np.asarray(batch["ref_logp_bn"], np.float64)) * mask
    assert np.abs(kl_bn).max() > 1e-2
    rewards = -0.5 * kl_bn
    for i in range(9):
        rewards[i, np.flatnonzero(mask[i])[-1]] += episodes.rewards_b[i]
    adv = ref_gae(rewards, values, mask, 0.9, 0.8)
    np.testing.assert_allclose(batch["adv_bn"], ref_whiten(adv, mask), atol=1e-5)
    np.testing.assert_allclose(np.asarray(batch["returns_bn"]) * mask, (adv + values) * mask,
                               atol=1e-5)
    ret = (adv + values)[mask > 0]
    np.testing.assert_allclose(metrics["critic/returns_mean"], ret.mean(), atol=1e-5)
    np.testing.assert_allclose(
        metrics["critic/vf_explained_var"],
        1 - (ret - values[mask > 0]).var(ddof=1) / (ret.var(ddof=1) + 1e-5), atol=1e-4)


def test_critic_learns_the_returns_of_a_fixed_batch(initial_params):
    """Repeated prepare + update_critic on one batch: the clipped value loss falls and the
    values come to explain much of the returns (not all: the first token's value is its
    group's prompt's, shared by rows of different returns). A critic init "random" is not
    the policy's."""
    config = toy_config(**{"rl.estimator": "gae", "critic.init": "random",
                           "critic.optim.lr": 1e-2, "critic.optim.weight_decay": 0.0},
                        **THREE_GROUPS_OF_3)
    learner = _learner(config, initial_params)
    critic = learner.init_critic()
    assert not np.allclose(critic["decoder"]["layers"]["wq"][...],
                           initial_params["layers"]["wq"][...])
    opt_state = learner.init_opt_state(critic, learner.critic_tx)
    episodes = _fixed_episodes()
    history = []
    for _ in range(30):
        batch, prep = learner.prepare(learner.initial_params, episodes, critic_params=critic)
        critic, opt_state, metrics = learner.update_critic(critic, opt_state, batch)
        history.append(jax.device_get({**prep, **metrics}))
    first, last = history[0], history[-1]
    assert set(first) >= {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean",
                          "critic/grad_norm", "critic/values_mean", "critic/returns_mean"}
    assert last["critic/vf_loss"] < 0.25 * first["critic/vf_loss"]
    assert first["critic/vf_explained_var"] < 0.1 and last["critic/vf_explained_var"] > 0.5


PPO_STEPS, PPO_EVERY = 12, 4


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    """The uninterrupted toy PPO run (configs/ppo_toy.py)."""
    workdir = str(tmp_path_factory.mktemp("ppo"))
    config = toy_config(ppo_toy, steps=PPO_STEPS, **{"checkpoint.every": PPO_EVERY})
    L.train(config, workdir, mesh=one_device())
    return workdir


def test_ppo_toy_run_trains_the_critic_and_the_policy(ppo_run):
    records = _metrics(ppo_run)
    assert [r["step"] for r in records] == list(range(1, PPO_STEPS + 1))
    assert records[0]["reward/mean"] < 0.2 and records[-1]["reward/mean"] >= 0.9
    # The returns climb from about 0 to about 1: a critic that did not learn would lag them.
    first, last = records[:3], records[-3:]
    assert np.mean([r["critic/vf_loss"] for r in last]) < 0.3 * np.mean(
        [r["critic/vf_loss"] for r in first])
    assert last[-1]["critic/returns_mean"] > 0.8
    assert abs(last[-1]["critic/values_mean"] - last[-1]["critic/returns_mean"]) < 0.1
    assert all(r["critic/grad_norm"] > 0 and "critic/vf_clipfrac" in r for r in records)


def test_ppo_resume_restores_the_critic_exactly(ppo_run, tmp_path):
    """A run restarted from the step-8 checkpoint (params, optimizer states of the policy and
    the critic, data and PRNG state) logs what the uninterrupted run logged after it."""
    workdir = tmp_path / "resumed"
    shutil.copytree(os.path.join(ppo_run, "checkpoints", str(2 * PPO_EVERY)),
                    workdir / "checkpoints" / str(2 * PPO_EVERY))
    config = toy_config(ppo_toy, steps=PPO_STEPS, **{"checkpoint.every": PPO_EVERY})
    L.train(config, str(workdir), mesh=one_device())
    resumed = _metrics(workdir)
    assert [r["step"] for r in resumed] == list(range(2 * PPO_EVERY + 1, PPO_STEPS + 1))
    assert resumed == _metrics(ppo_run)[2 * PPO_EVERY:]


# ------------------------------------------------------------------------------------- SFT


def test_sft_loss_covers_completion_tokens_only(initial_params, tmp_path):
    rng = np.random.RandomState(1)
    records = [{"prompt_ids": [1] + rng.randint(2, 32, size=rng.randint(1, 6)).tolist(),
                "completion_ids": [7, 9, 7, 2]} for _ in range(64)]
    config = toy_config(**{"sft.steps": 40, "sft.batch_size": 8, "sft.max_prompt_len": 8,
                           "sft.max_completion_len": 6, "sft.microbatch_size": 4,
                           "sft.optim.lr": 1e-2, "checkpoint.every": 20})
    config.sft.records_fn = lambda seed: records
    learner = _learner(config, initial_params)
    episodes = L.sft_episodes(learner, records[:8], prompt_len=8, length=6)
    assert (episodes.loss_mask_bn == [1, 1, 1, 1, 0, 0]).all()

    # The loss of one step is the mean NLL of the completion tokens under a full forward of
    # prompt + completion (right-padded: causal attention keeps the padding out).
    rows = np.zeros((8, 12), np.int32)
    for i, r in enumerate(records[:8]):
        rows[i, :len(r["prompt_ids"]) + 4] = r["prompt_ids"] + r["completion_ids"]
    model = nnx.merge(learner.graphdef, learner.initial_params)
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(rows)), np.float64)
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    nll = [-logp[i, len(r["prompt_ids"]) + j - 1, r["completion_ids"][j]]
           for i, r in enumerate(records[:8]) for j in range(4)]
    params = learner.initial_params
    _, _, metrics = learner.sft_update(params, learner.init_opt_state(params, learner.sft_tx),
                                       episodes)
    np.testing.assert_allclose(float(metrics["sft/loss"]), np.mean(nll), rtol=1e-5)

    # The whole loop: the completion is learned, whatever the prompt.
    params = L.sft(config, str(tmp_path), params=initial_params, mesh=one_device())
    losses = [r["sft/loss"] for r in _metrics(tmp_path)]
    assert len(losses) == 40 and losses[-1] < 0.1 * losses[0]
    sampler = Sampler(nnx.merge(learner.graphdef, learner.initial_params))
    out = sampler.sample(params, [[1, 5], [1, 30, 2, 8]], max_new_tokens=4, greedy=True)
    assert out.completions() == [[7, 9, 7, 2]] * 2


# ---------------------------------------------------------------------- DAPO, episodes, config


def _collect(rollout, batches, config):
    """The learner's loop over a `batch.Collector`, with rollout(records, attempt) -> Batch
    as the producer."""
    collector = batch_lib.Collector(config)
    while collector.wants_more():
        collector.add(rollout(next(batches), collector.calls))
    return collector.result()


def _episodes(rewards, groups, lengths):
    return L.Batch.from_rows([[1, 3]] * len(lengths), [[5] * n for n in lengths],
                                [[1] * n for n in lengths], [[0.0] * n for n in lengths],
                                rewards, groups, prompt_len=4, length=12,
                                meta=[{"row": i} for i in range(len(groups))])


def test_dynamic_sampling_keeps_informative_groups_and_caps(tmp_path):
    config = toy_config(**{"data.prompts_per_step": 2, "sampling.num_samples": 2,
                           "sampling.max_new_tokens": 8, "dapo.dynamic_sampling": True,
                           "dapo.max_gen_batches": 3, "dapo.overlong_buffer": 4,
                           "dapo.overlong_penalty": 1.0})
    calls = [  # (rewards, lengths) per call; groups are [0, 0, 1, 1]
        ([1.0, 1.0, 0.0, 1.0], [2, 2, 2, 2]),  # group 0 all equal: dropped
        ([0.0, 0.0, 1.0, 1.0], [2, 2, 2, 2]),  # both all equal
        ([1.0, 0.0, 1.0, 1.0], [2, 3, 2, 2]),  # group 0 kept: the batch is full
    ]
    log = []

    def rollout(records, attempt):
        log.append((records, attempt))
        rewards, lengths = calls[attempt]
        return _episodes(rewards, [0, 0, 1, 1], lengths)

    batches = iter([[{"id": i}] * 2 for i in range(10)])
    episodes, metrics = _collect(rollout, batches, config)
    assert [a for _, a in log] == [0, 1, 2] and log[2][0] == [{"id": 2}] * 2
    assert [m["row"] for m in episodes.meta] == [2, 3, 0, 1]
    np.testing.assert_array_equal(episodes.rewards_b, [0.0, 1.0, 1.0, 0.0])
    assert metrics["dapo/gen_batches"] == 3 and metrics["dapo/uninformative_groups"] == 0
    assert metrics["reward/mean"] == pytest.approx(np.mean([1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 1]))

    # Overlong rows are penalised (8 tokens of at most 8 with a 4-token buffer: -1; 6: -0.5)
    # before the groups are judged: group 0 of the second call now differs and is kept.
    calls[1] = ([0.0, 0.0, 1.0, 1.0], [8, 6, 2, 2])
    log.clear()
    episodes, metrics = _collect(rollout, iter([[{}] * 2] * 3), config)
    assert metrics["dapo/gen_batches"] == 2
    np.testing.assert_allclose(episodes.rewards_b, [0.0, 1.0, -1.0, -0.5])

    # Capped at 2 calls with one informative group: topped up with a dropped one.
    config.dapo.max_gen_batches = 2
    calls[1] = ([0.0, 0.0, 1.0, 1.0], [8, 8, 2, 2])
    episodes, metrics = _collect(rollout, iter([[{}] * 2] * 2), config)
    assert metrics["dapo/gen_batches"] == 2 and metrics["dapo/uninformative_groups"] == 1
    np.testing.assert_allclose(episodes.rewards_b, [0.0, 1.0, -1.0, -1.0])


def _dapo_overlong_reward(length, *, max_len, cache, factor):
    """R_length of the DAPO paper (arXiv 2503.14476, eq. 13), times the penalty factor."""
    if length <= max_len - cache:
        return 0.0
    if length <= max_len:
        return factor * ((max_len - cache) - length) / cache
    return -factor


def test_overlong_penalty_measures_a_multi_turn_episode_against_rollout_max_len():
    """Turns (mask 1) and tool observations (mask 0): the episode's tokens after the prompt
    against rollout.max_len (40), not against the per-turn sampling.max_new_tokens (16)."""
    from ptrain import closed_loop
    config = closed_loop.defaults()
    config.update_from_flattened_dict({
        "data.prompts_per_step": 2, "sampling.num_samples": 2, "sampling.max_new_tokens": 16,
        "rollout.max_len": 40, "dapo.overlong_buffer": 12, "dapo.overlong_penalty": 0.5})
    closed_loop.check_config(config)  # (learner.train and batch.Collector get this config)
    rng = np.random.RandomState(0)
    turns = [[9, 16, 8], [4], [16, 6, 16, 2], [16, 12, 7]]  # per episode: turn, obs, turn...
    histories, masks = [], []
    for parts in turns:
        ids, mask = [1, 2, 3], [0, 0, 0]
        for k, n in enumerate(parts):
            ids += rng.randint(4, 30, n).tolist()
            mask += [1 - k % 2] * n
        histories.append(ids)
        masks.append(mask)
    lengths = [sum(p) for p in turns]
    assert lengths == [33, 4, 40, 35] and max(lengths) > config.sampling.max_new_tokens
    rewards = [1.0, 0.0, 1.0, 0.0]
    episodes = L.Batch.from_histories(
        histories, masks, [[0.0] * len(h) for h in histories], rewards, [0, 0, 1, 1],
        prompt_lens=[3] * 4, prompt_len=4, length=config.rollout.max_len)
    out, metrics = _collect(lambda records, attempt: episodes, iter([[{}] * 2]), config)
    expected = [r + _dapo_overlong_reward(n, max_len=40, cache=12, factor=0.5)
                for r, n in zip(rewards, lengths)]
    np.testing.assert_allclose(out.rewards_b, expected, rtol=1e-6)
    assert expected == [1.0 - 0.5 * 5 / 12, 0.0, 0.5, -0.5 * 7 / 12]
    assert metrics["reward/mean"] == pytest.approx(np.mean(expected))
    # The buffer must fit in the episode's cap, checked with the config.
    config = closed_loop.defaults()
    config.rollout.max_len, config.dapo.overlong_buffer = 40, 41
    with pytest.raises(ValueError, match=r"overlong_buffer=41 .* cap 40 \(rollout.max_len\)"):
        closed_loop.check_config(config)


def test_filter_overlong_masks_truncated_episodes_out_of_the_loss():
    """dapo.filter_overlong: rows cut at a cap (a single turn at max_new_tokens, an episode's
    answer cut or out of room) keep their tokens but lose their loss mask."""
    config = toy_config(**{"data.prompts_per_step": 2, "sampling.num_samples": 2,
                           "dapo.filter_overlong": True})
    finishes = [{"finish_reason": "length"}, {"finish_reason": "stop"},
                {"finish": "max_len"}, {"finish": "answered"}]
    episodes = _episodes([1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1], [8, 3, 12, 5])
    episodes.meta = finishes
    before = episodes.loss_mask_bn.copy()
    out, metrics = _collect(lambda records, attempt: episodes, iter([[{}] * 2]), config)
    np.testing.assert_array_equal(out.loss_mask_bn, before * np.array([[0], [1], [0], [1]]))
    assert metrics["dapo/filtered_overlong"] == 0.5
    np.testing.assert_array_equal(out.lengths_b, [8, 3, 12, 5])  # the tokens stay


def test_episodes_rows_are_checked():
    def rows(prompt=(1,), tokens=(5, 6), mask=(1, 1), logp=(0.0, 0.0), **kw):
        return L.Batch.from_rows([list(prompt)], [list(tokens)], [list(mask)], [list(logp)],
                                    [0.0], [0], **{"prompt_len": 2, "length": 4, **kw})

    with pytest.raises(ValueError, match="continues its prompt with 5 tokens, more than"):
        rows(tokens=[5] * 5, mask=[1] * 5, logp=[0.0] * 5)
    with pytest.raises(ValueError, match="2 tokens but 1 mask values"):
        rows(mask=[1])
    with pytest.raises(ValueError, match="its prompt has 3 tokens; it needs 1 to prompt_len=2"):
        rows(prompt=[1, 2, 3])
    episodes = rows(prompt=[7])
    assert episodes.prompt_bp.tolist() == [[0, 7]] and episodes.tokens_bn.tolist() == [[5, 6, 0, 0]]
    # Whole histories (a multi-turn producer's view) split at each prompt's length.
    histories = L.Batch.from_histories(
        [[1, 7, 5, 9, 6]], [[0, 0, 1, 0, 1]], [[0.0, 0.0, -1.0, 0.0, -2.0]], [1.0], [0],
        prompt_lens=[2], prompt_len=3, length=4)
    assert histories.prompt_bp.tolist() == [[0, 1, 7]]
    assert histories.tokens_bn.tolist() == [[5, 9, 6, 0]]
    assert histories.loss_mask_bn.tolist() == [[1, 0, 1, 0]]
    assert histories.rollout_logp_bn.tolist() == [[-1.0, 0.0, -2.0, 0.0]]
    with pytest.raises(ValueError, match="loss mask is 1 inside the prompt"):
        L.Batch.from_histories([[1, 7, 5]], [[0, 1, 1]], [[0.0] * 3], [1.0], [0],
                                  prompt_lens=[2], prompt_len=3, length=4)
    two = L.Batch.from_rows([[1], [2]], [[5], [5]], [[1], [1]], [[0.0], [0.0]], [0, 0],
                               [0, 0], prompt_len=2, length=2)
    with pytest.raises(ValueError, match="must share their prompt; keep each prompt's samples"):
        two.check_groups(2)


def test_config_keys_and_values_are_checked():
    L.check_config(grpo_toy.get_config())
    with pytest.raises(AttributeError):  # locked: a typo is an error, not a new key
        grpo_toy.get_config().rl.clip_hihg = 0.3
    config = grpo_toy.get_config()
    config.unlock()
    config.rl.clip_hihg = 0.3
    del config.sampling["top_p"]
    with pytest.raises(ValueError, match=r"missing keys \['sampling.top_p'\].*unknown keys "
                                         r"\['rl.clip_hihg'\]"):
        L.check_config(config)
    for change, message in [({"rl.loss": "gspo"}, "aggregates seq-mean-token-mean"),
                            ({"rl.estimator": "ppo"}, "rl.estimator='ppo'"),
                            ({"rl.estimator": "gae", "rl.lam": -0.5},
                             "needs 0 <= rl.gamma <= 1 and 0 <= rl.lam <= 1; got gamma=1.0, "
                             "lam=-0.5"),
                            ({"critic.init": "sft"}, "critic.init='sft'; use one of"),
                            ({"critic.clip_value": 0.0}, "critic.clip_value=0.0 must be > 0"),
                            ({"rl.num_minibatches": 3}, "must divide into rl.num_minibatches"),
                            ({"rl.microbatch_size": 12}, "a multiple of sampling.num_samples=8"),
                            ({"rl.microbatch_size": 24}, "divides the minibatch of 32 rows"),
                            ({"kl.target": 0.1}, "set kl.in_reward=True")]:
        with pytest.raises(ValueError, match=message):
            L.check_config(toy_config(**change))
    assert isinstance(L.defaults(), ml_collections.ConfigDict)


def test_sft_errors_name_the_sft_keys(initial_params, tmp_path):
    config = toy_config(**{"sft.steps": 1, "sft.batch_size": 2, "sft.max_prompt_len": 8,
                           "sft.max_completion_len": 4})
    with pytest.raises(ValueError, match=r"no sft: set sft.sources .* or sft.records_fn"):
        L.sft(config, str(tmp_path / "none"), params=initial_params, mesh=one_device())
    config.sft.records_fn = lambda seed: [{"prompt_ids": [1, 2], "completion_ids": [7] * 6}] * 2
    with pytest.raises(ValueError, match=r"SFT step 1: .*6 tokens.*sft.max_completion_len=4"):
        L.sft(config, str(tmp_path / "long"), params=initial_params, mesh=one_device())


def test_log_probs_are_of_logits_over_the_sampling_temperature(initial_params):
    """At T = 0.6 the learner's log-probs (old, for the ratio) are the sampler's behaviour
    log-probs (logits / T), as verl and TRL define the policy; the T = 1 log-probs are not."""
    config = toy_config(**{"sampling.temperature": 0.6, "rl.ppo_epochs": 2})
    learner = _learner(config, initial_params)
    records = grpo_toy.prompt_records(0)[:config.data.prompts_per_step]
    params = learner.initial_params
    producer = rollout.SingleTurn(config, rollout.make_sampler(
        nnx.merge(learner.graphdef, params), config))
    episodes = producer.score(producer.generate(params, records, jax.random.key(1)))
    batch, metrics = learner.prepare(params, episodes)
    assert float(metrics["rollout/logp_mismatch"]) < 1e-5
    mask = np.asarray(batch["loss_mask_bn"])
    t1 = jax.jit(lambda p, b: step_lib.token_logprobs(  # one compile, not one per op
        learner.graphdef, p, b, group_size=config.sampling.num_samples)[0])(params, batch)
    gap = np.abs(np.asarray(t1) - np.asarray(batch["rollout_logp_bn"]))
    assert (gap * mask).sum() / mask.sum() > 1e-2


def test_bfloat16_reference_log_probs_match_float32(initial_params):
    """kl.ref_dtype="bfloat16": the reference policy is held in bfloat16 (half the bytes),
    its log-probs are those of the float32 model with its weights rounded to bfloat16
    (computed in float32), and within 1e-2 of the float32 reference's: the toy model with
    its weights doubled (distributions farther from uniform) measured 3.1e-3 at most, 9.3e-4
    on average, on one device."""
    params = jax.tree.map(lambda x: x * 2 if x.ndim > 1 else x, initial_params)
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), params)
    changes = {"kl.coef": 0.05}
    f32 = _learner(toy_config(**changes), params)
    bf16 = _learner(toy_config(**changes, **{"kl.ref_dtype": "bfloat16"}), params)
    ref = _learner(toy_config(**changes), rounded)
    assert {x.dtype for x in jax.tree.leaves(bf16.ref_params)} == {jnp.dtype(jnp.bfloat16)}
    nbytes = [sum(x.nbytes for x in jax.tree.leaves(lr.ref_params)) for lr in (bf16, f32)]
    assert nbytes[0] * 2 == nbytes[1]
    episodes = _random_episodes(groups=4, per_group=8)
    got, want, rounded_logp = (
        np.asarray(lr.prepare(lr.initial_params, episodes, 0.05)[0]["ref_logp_bn"])
        for lr in (bf16, f32, ref))
    mask = episodes.arrays()["loss_mask_bn"] > 0
    np.testing.assert_allclose(got, rounded_logp, atol=1e-6, rtol=0)
    err = np.abs(got - want)[mask].max()
    assert 0 < err < 1e-2, err
    assert np.abs(want[mask] + np.log(32)).max() > 0.3  # not the uniform distribution
    with pytest.raises(ValueError, match="kl.ref_dtype='float16'"):
        L.check_config(toy_config(**{"kl.ref_dtype": "float16"}))


def test_microbatched_prepare_equals_one_shot(initial_params):
    """rl.logprob_microbatch_size: old and reference log-probs, the critic's values, GAE
    advantages and returns in passes of 16 rows (4 passes, sharded over fsdp=4 x tensor=2)
    equal the one-pass prepare (the sharded update's settings: GAE, a k3 KL, 2 minibatches)."""
    changes = {**SHARDED_PPO, "rl.num_minibatches": 2}
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    one = _learner(toy_config(**changes), initial_params, mesh)
    micro = _learner(toy_config(**changes, **{"rl.logprob_microbatch_size": 16}),
                     initial_params, mesh)
    assert micro.settings.logprob_microbatch == 16 and micro.settings.has_old_logp
    episodes = _random_episodes(groups=8, per_group=8)
    critic = one.init_critic()
    got, want = (jax.device_get(learner.prepare(learner.initial_params, episodes, 0.05,
                                                critic_params=critic))
                 for learner in (micro, one))
    for name in ("old_logp_bn", "ref_logp_bn", "old_values_bn", "returns_bn", "adv_bn"):
        np.testing.assert_allclose(got[0][name], want[0][name], atol=1e-6, rtol=0,
                                   err_msg=name)
    for key in want[1]:
        np.testing.assert_allclose(got[1][key], want[1][key], atol=1e-6, err_msg=key)
    with pytest.raises(ValueError, match="logprob_microbatch_size=12 must be a multiple"):
        L.check_config(toy_config(**{"rl.logprob_microbatch_size": 12}))
