"""Interruption at a weight update (ptrain/generate/interrupt.py): the swap forced at a known decode
round (`Switch(at_round=...)`), against runs of the old weights alone, teacher-forced
forwards of the new weights over the same prefix, and the versions recorded per token."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from ptrain import model as M
from ptrain.generate import engine as E
from ptrain.generate import interrupt
from tests.test_lookahead import Stream

CONFIG = M.ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                       qkv_bias=True, attention_impl="reference")
PROMPTS = [[1, 5, 9, 33, 2], [1, 7], [1, 40, 41, 12, 3, 3, 18], [1, 8, 8]]
EVERY = 4  # decode steps per round while a switch is attached


@pytest.fixture(scope="module")
def models():
    return M.init(CONFIG, seed=3), M.init(CONFIG, seed=11)


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _teacher_forced(model, tokens, temperature=1.0):
    """log-probs of tokens[1:] under `model`, one forward (float64 on the host)."""
    padded = np.zeros((1, 64), np.int32)
    padded[0, :len(tokens)] = tokens
    logits = np.asarray(_forward(model, padded), np.float64)[0, :len(tokens) - 1]
    return _log_softmax(logits / temperature)[np.arange(len(tokens) - 1), tokens[1:]]


def _greedy(model, prefix, n):
    tokens = list(prefix)
    for _ in range(n):
        padded = np.zeros((1, 64), np.int32)
        padded[0, :len(tokens)] = tokens
        tokens.append(int(np.argmax(np.asarray(_forward(model, padded))[0, len(tokens) - 1])))
    return tokens[len(prefix):]


def _engine(model, **kw):
    return E.Engine(model, **dict(dict(slots=2, max_len=64, max_new_tokens=10,
                                       token_buckets=(64,), prefill_rows=2), **kw))


def _swapped(old, new, requests, at_round=1, **kw):
    switch = interrupt.Switch(every=EVERY, at_round=at_round)
    switch.publish(1, new)  # published early: the swap still falls at `at_round` exactly
    engine = _engine(old, **kw)
    trajs = engine.generate(old, requests, live=interrupt.Live(old, 0, switch))
    return trajs, engine


def test_greedy_swap_at_a_round_continues_with_the_new_weights(models):
    """2 slots, 4 requests: after round 1 (4 tokens each) the 2 decoding rows switch to the
    new weights mid-turn; the 2 waiting ones run on the new weights alone."""
    old, new = models
    trajs, engine = _swapped(old, new, [E.Request(p) for p in PROMPTS], greedy=True)
    interrupted = 0
    for t, prompt in zip(trajs, PROMPTS):
        completion, p = t.turns[0], len(prompt)
        assert len(completion) == 10 and t.finish_reasons == ["length"]
        if len(t.versions) == 2:  # in flight at the swap: 4 old tokens, then new ones
            interrupted += 1
            assert t.versions == [(p, 0), (p + EVERY, 1)]
            assert completion[:EVERY] == _greedy(old, prompt, 10)[:EVERY]
            assert completion[EVERY:] == _greedy(new, prompt + completion[:EVERY], 10 - EVERY)
        else:  # admitted after the swap
            assert t.versions == [(p, 1)]
            assert completion == _greedy(new, prompt, 10)
        v = interrupt.token_versions(t, p, p + 10)
        np.testing.assert_array_equal(v, [0] * EVERY + [1] * 6 if len(t.versions) == 2
                                      else [1] * 10)
        # Each token's recorded log-prob is its own version's, teacher-forced, to 1e-5.
        logp = np.where(v == 0, _teacher_forced(old, t.tokens)[p - 1:],
                        _teacher_forced(new, t.tokens)[p - 1:])
        np.testing.assert_allclose(t.logp_t1[p:], logp, atol=1e-5)
    assert interrupted == 2
    m = engine.metrics()
    assert m["interruptions"] == 1 and m["interrupted_rows"] == 2
    assert m["recompute_tokens"] == len(PROMPTS[0]) + len(PROMPTS[1]) + 2 * EVERY


@nnx.jit
def _cached(model, tokens_bt, cache):
    return model(tokens_bt, cache=cache)


def test_a_swap_that_keeps_the_cache_goes_on_from_the_old_keys_and_values(models):
    """rl.interrupt_cache="keep": nothing is recomputed at the swap; the token drawn from
    the old weights' last logits is the old version's, and the new weights' tokens after it
    are the greedy choices and log-probs (1e-5) of the new weights attending to the old
    weights' keys and values of the prefix (a cached forward of each, one after the other)."""
    old, new = models
    switch = interrupt.Switch(every=EVERY, at_round=1, keep_cache=True)
    switch.publish(1, new)
    engine = _engine(old, greedy=True)
    trajs = engine.generate(old, [E.Request(p) for p in PROMPTS],
                            live=interrupt.Live(old, 0, switch))
    interrupted = 0
    for t, prompt in zip(trajs, PROMPTS):
        p, tokens = len(prompt), np.asarray(t.tokens, np.int32)
        if len(t.versions) == 1:  # admitted after the swap: the new weights alone
            assert t.versions == [(p, 1)] and t.turns[0] == _greedy(new, prompt, 10)
            continue
        interrupted += 1
        cut = p + EVERY  # the old weights ran the tokens before it
        assert t.versions == [(p, 0), (cut + 1, 1)]
        assert t.turns[0][:EVERY + 1] == _greedy(old, prompt, 10)[:EVERY + 1]
        np.testing.assert_allclose(t.logp_t1[p:cut + 1],
                                   _teacher_forced(old, t.tokens)[p - 1:cut], atol=1e-5)
        _, cache = _cached(old, tokens[None, :cut], M.init_cache(CONFIG, 1, 64))
        logits, _ = _cached(new, tokens[None, cut:], cache)
        logits = np.asarray(logits, np.float64)[0, :-1]
        assert t.tokens[cut + 1:] == np.argmax(logits, -1).tolist()
        logp = _log_softmax(logits)[np.arange(len(logits)), tokens[cut + 1:]]
        np.testing.assert_allclose(t.logp_t1[cut + 1:], logp, atol=1e-5)
        # ... which is not the recomputing swap's continuation (the new weights throughout)
        assert not np.allclose(t.logp_t1[cut + 1:],
                               _teacher_forced(new, t.tokens)[cut:], atol=1e-5)
    assert interrupted == 2
    m = engine.metrics()
    assert m["interruptions"] == 1 and m["interrupted_rows"] == 2
    assert m.get("recompute_tokens", 0) == 0  # (counted only when a swap prefills)


def test_sampled_swap_keeps_the_tokens_before_it_and_each_tokens_behaviour_logp(models):
    """Sampled (T = 0.7, 2 samples a prompt sharing a prefill): the tokens before the swap
    are those of the old weights' run with the same keys; every token's log-prob (at T and
    at 1) is that of the version that sampled it, teacher-forced, to 1e-5."""
    old, new = models
    temperature = 0.7
    requests = [E.Request(p, key=jax.random.key(20 + i), num_samples=2)
                for i, p in enumerate(PROMPTS[:2])]
    trajs, _ = _swapped(old, new, requests, temperature=temperature, slots=4)
    alone = _engine(old, temperature=temperature, slots=4).generate(old, requests)
    for t, ref in zip(trajs, alone):
        p = t.prompt_len
        assert t.versions == [(p, 0), (p + EVERY, 1)]
        assert t.turns[0][:EVERY] == ref.turns[0][:EVERY]
        v = interrupt.token_versions(t, p, len(t.tokens))
        for logp, temp in ((t.logp, temperature), (t.logp_t1, 1.0)):
            expected = np.where(v == 0, _teacher_forced(old, t.tokens, temp)[p - 1:],
                                _teacher_forced(new, t.tokens, temp)[p - 1:])
            np.testing.assert_allclose(logp[p:], expected, atol=1e-5)
    assert {tuple(t.turns[0]) for t in trajs} != {tuple(t.turns[0]) for t in alone}


def test_a_sequence_on_its_tool_at_the_swap_answers_with_the_new_weights(models):
    """Multi-turn: turn 1 (4 tokens) ends in round 0, the swap falls while its tool runs;
    the observation is prefilled on a cache recomputed under the new weights, and turn 2 is
    the new weights' greedy continuation of the whole history."""
    old, new = models
    obs = [3, 9, 4]
    request = E.Request(PROMPTS[0], max_new_tokens=EVERY,
                        on_turn=lambda traj: obs if len(traj.turns) < 2 else None)
    trajs, engine = _swapped(old, new, [request], greedy=True)
    (t,) = trajs
    first, second = t.turns
    p = len(PROMPTS[0])
    assert first == _greedy(old, PROMPTS[0], EVERY)
    assert second == _greedy(new, PROMPTS[0] + first + obs, EVERY)
    assert t.versions == [(p, 0), (p + EVERY, 1)]
    assert t.tokens == PROMPTS[0] + first + obs + second
    assert engine.metrics()["interrupted_rows"] == 1


def test_without_a_publication_nothing_changes(models):
    """A switch nobody published to (and no switch at all): the old weights' run, one
    version per sequence."""
    old, _ = models
    requests = [E.Request(p) for p in PROMPTS]
    plain = _engine(old, greedy=True).generate(old, requests)
    live = interrupt.Live(old, 5, interrupt.Switch(every=EVERY))
    watched = _engine(old, greedy=True).generate(old, requests, live=live)
    for a, b in zip(plain, watched):
        assert a.turns == b.turns and a.logp_t1 == b.logp_t1
        assert a.versions == [(a.prompt_len, 0)] and b.versions == [(b.prompt_len, 5)]


MOE = M.ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                    n_experts=4, n_experts_per_token=2, d_ff_expert=16,
                    attention_impl="reference")


@nnx.jit
def _replayed(model, tokens_bt, experts_lbtk):
    h_btd, _, routing = model.forward(tokens_bt, replay_lbtk=experts_lbtk)
    return h_btd @ model.unembedding_vd().T, routing.experts_lbtk


@pytest.mark.parametrize("replay", [True, False])
def test_a_swap_under_router_replay_keeps_the_recorded_experts(replay):
    """MoE, greedy, swap after round 1: with rl.router_replay (Switch(replay=True)) the
    prefix's cache is recomputed with the experts it recorded, which stay as recorded (the
    old weights' routing), and each later token is the new weights' greedy choice and
    log-prob with every position routed as recorded (the learner's replayed forward,
    teacher-forced, to 1e-5), not as the new router would. Without replay the prefix is
    re-routed by the new weights and recorded so (the replayed forward is then that one)."""
    old, new = M.init(MOE, seed=3), M.init(MOE, seed=11)
    switch = interrupt.Switch(every=EVERY, at_round=1, replay=replay)
    switch.publish(1, new)
    kw = dict(greedy=True, record_routing=True)
    trajs = _engine(old, **kw).generate(old, [E.Request(p) for p in PROMPTS],
                                        live=interrupt.Live(old, 0, switch))
    alone = _engine(old, **kw).generate(old, [E.Request(p) for p in PROMPTS])
    interrupted, rerouted = 0, 0
    for t, ref in zip(trajs, alone):
        if len(t.versions) != 2:
            continue
        interrupted += 1
        cut = t.versions[1][0]  # the first position the new weights sampled
        tokens = np.asarray(t.tokens, np.int32)[None]
        assert t.experts.shape == (len(t.tokens), 2, 2)  # every token ran: 2 MoE layers, k 2
        # Positions before the cut: their experts under the old weights (the lone run's),
        # before and after the swap alike, with replay; the new router's without.
        new_logits, new_routing = _replayed(new, tokens, None)
        prefix_old = ref.experts[:cut]
        prefix_new = np.moveaxis(np.asarray(new_routing), 0, 2)[0, :cut]
        if replay:
            np.testing.assert_array_equal(t.experts[:cut], prefix_old)
        else:
            np.testing.assert_array_equal(t.experts[:cut], prefix_new)
        rerouted += int((np.sort(prefix_old, -1) != np.sort(prefix_new, -1)).any())
        # The learner's forward: new weights, every position routed as recorded.
        experts_lbtk = np.moveaxis(t.experts, 1, 0)[:, None].astype(np.int32)
        logits, _ = _replayed(new, tokens, experts_lbtk)
        logits = np.asarray(logits, np.float64)[0, :-1]
        logp = _log_softmax(logits)[np.arange(len(t.tokens) - 1), tokens[0, 1:]]
        np.testing.assert_allclose(t.logp_t1[cut:], logp[cut - 1:], atol=1e-5)
        assert t.tokens[cut:] == np.argmax(logits[cut - 1:], -1).tolist()
        if replay and (np.sort(prefix_old, -1) != np.sort(prefix_new, -1)).any():
            # ... which is not the new weights' own routing of the prefix
            own = _log_softmax(np.asarray(new_logits, np.float64)[0, :-1])
            own = own[np.arange(len(t.tokens) - 1), tokens[0, 1:]]
            assert not np.allclose(t.logp_t1[cut:], own[cut - 1:], atol=1e-5)
    assert interrupted == 2
    assert rerouted  # the two routers disagree on the prefix: the test tells them apart


def test_token_metrics_and_checkpoint_encoding():
    from ptrain.batch import Batch
    batch = Batch.from_rows([[1, 2]] * 3, [[3, 4, 5], [6, 7], [8]], [[1, 1, 1], [1, 1], [1]],
                            [[-0.5, -1.25, -2.0], [-0.1, -0.2], [-3.0]], [1.0, 0.0, 0.5],
                            [0, 0, 0], prompt_len=4, length=4,
                            meta=[{"a": np.float32(0.5)}, {"b": "x"}, {}])
    u = interrupt.UNSAMPLED
    batch.versions_bn = np.array([[3, 3, 4, u], [4, 4, u, u], [2, u, u, u]], np.int32)
    m = interrupt.metrics(batch, step=5, k=2)  # the learner holds version 4
    assert m["rollout/token_staleness_hist"] == [3, 2, 1]
    assert m["rollout/token_staleness"] == pytest.approx(4 / 6)
    assert m["rollout/interrupted"] == pytest.approx(1 / 3)
    with pytest.raises(RuntimeError, match="outside"):
        interrupt.metrics(batch, step=4, k=2)
    arrays, rest = interrupt.encode_batch(batch)
    assert sorted(arrays) == sorted(n for n, v in batch.columns().items()
                                    if isinstance(v, np.ndarray))  # saved as arrays
    json.dumps(rest)  # the rest goes in the checkpoint's JSON metadata
    back = interrupt.decode_batch(arrays, rest)
    for name, value in batch.columns().items():
        if isinstance(value, np.ndarray):
            assert back.columns()[name].dtype == value.dtype
            np.testing.assert_array_equal(back.columns()[name], value)
    assert back.meta == [{"a": 0.5}, {"b": "x"}, {}]
    batch.meta[0]["bad"] = object()
    with pytest.raises(ValueError, match="JSON"):
        interrupt.encode_batch(batch)


class _RoundsProducer:
    """generate(Live) "decodes" 3 rounds of one token each, polling its switch before each
    round as the engine does; each token records the version of the weights it read."""

    def generate(self, live, records, key):
        from ptrain.generate import interrupt as I
        assert isinstance(live, I.Live)
        version, w, tokens = live.version, float(live.params["w"]), []
        for r in range(3):
            new = live.switch and live.switch.poll(version, r)
            if new:
                version, w = new[0], float(new[1]["w"])
            tokens.append(w)
        return records[0] + 1, tokens

    def score(self, generated):
        from ptrain.batch import Batch
        b, tokens = generated
        batch = Batch.from_rows([[1]], [[1, 2, 3]], [[1, 1, 1]], [[0.0] * 3], [0.0], [0],
                                prompt_len=1, length=3, meta=[{"b": b}])
        batch.versions_bn = np.asarray([tokens], np.int32)  # w == its version here
        return batch


def test_lookahead_publishes_each_update_to_the_generation_in_flight(monkeypatch):
    """k = 2, the swap forced after round 1: batch b (generated at step b - 2 from version
    b - 3) takes version b - 2 when update b - 2 ends, for its last two tokens; the first k
    batches (generated before any update) are not interrupted. Each update donates its
    input, so a generation reading the learner's own arrays would fail. A checkpoint's
    pending batches come back finished and equal."""
    import jax.numpy as jnp
    from ptrain import lookahead

    monkeypatch.setattr(interrupt.Switch, "at_round", 1)
    k, steps = 2, 6
    ahead = lookahead.LookAhead(k, _RoundsProducer(), Stream(), jax.random.key(0),
                                steps=steps, save_every=100, interrupt=True)
    params, seen, saved = {"w": jnp.zeros(())}, {}, None
    try:
        for step in range(1, steps + 1):
            if step == 1:
                ahead.start(step, [params] * k)
            batch = ahead.next(step, params)
            seen[step] = (batch.versions_bn[0].tolist(), lookahead.metrics(batch, step, k))
            old, params = params, {"w": params["w"] + 1}
            old["w"].delete()  # donated, as step.jit_update's input
            ahead.publish(step, params)
            if step == 3:
                saved = lookahead.restore_batches(*ahead.saved_batches())
                assert ahead.state() == (5, {})  # drawn through batch 5; no parameters kept
    finally:
        ahead.close()
    for b in range(1, steps + 1):
        versions, m = seen[b]
        v0 = lookahead.version(b, k)
        assert versions == ([v0] * 3 if b <= k else [v0, v0 + 1, v0 + 1])
        assert m["rollout/interrupted"] == float(b > k)
        assert m["rollout/token_staleness_hist"] == np.bincount(
            [b - 1 - v for v in versions], minlength=k + 1).tolist()
    assert [item["step"] for item in saved] == [4, 5]
    resumed = lookahead.LookAhead(k, _RoundsProducer(), Stream(5), jax.random.key(0),
                                  steps=steps, save_every=100, interrupt=True)
    resumed.start(4, [], finished=saved)
    try:
        assert resumed.next(4, {"w": jnp.full((), 3.0)}).versions_bn[0].tolist() == seen[4][0]
        resumed.publish(4, {"w": jnp.full((), 4.0)})  # (batch 6's generation waits for it)
    finally:
        resumed.close()


def test_interrupt_config_errors():
    from ptrain import config as config_lib
    c = config_lib.defaults()
    c.rl.interrupt = True
    with pytest.raises(ValueError, match="rl.staleness >= 1"):
        config_lib.check(c)
    c.rl.staleness = 1
    with pytest.raises(ValueError, match="sampling.engine=True"):
        config_lib.check(c)
    c.sampling.engine = True
    c.reward_fn = lambda *a: 0.0
    c.data.records_fn = lambda seed: []
    config_lib.check(c)
    c.rl.interrupt_cache = "reuse"
    with pytest.raises(ValueError, match="use 'recompute' or 'keep'"):
        config_lib.check(c)


def test_a_swap_refreshes_the_engines_decode_copy(models):
    """sampling.decode_dtype: the engine decodes its own copy (float32 here, so that the
    tokens compare exactly); a swap syncs the copy from the new weights: the same tokens
    as the swap on the learner's weights, and the learner's metrics count it."""
    from ptrain.generate import engine_sampler
    old, new = models
    requests = [E.Request(p) for p in PROMPTS]
    reference, _ = _swapped(old, new, requests, greedy=True)
    sampler = engine_sampler.EngineSampler(old, slots=2, decode_dtype="float32")
    switch = interrupt.Switch(every=EVERY, at_round=1)
    switch.publish(1, new)
    out = sampler.sample(interrupt.Live(old, 0, switch), PROMPTS, max_new_tokens=10,
                         greedy=True, prompt_len=16)
    assert out.completions() == [t.turns[0] for t in reference]
    np.testing.assert_array_equal(out.versions[:2], [[0] * EVERY + [1] * 6] * 2)
    np.testing.assert_array_equal(out.versions[2:], [[1] * 10] * 2)
    m = engine_sampler.step_metrics([sampler])
    assert m["engine/interruptions"] == 1 and m["engine/interrupted_rows"] == 2
    assert m["engine/weight_syncs"] == 2  # the copy of the old weights, then of the new
    # The swap advanced the Live: a later call of the same generation (a terminal episode's
    # next turn, a mixed batch's next part) starts from the new weights, never the old ones.
    switch = interrupt.Switch(every=EVERY, at_round=1)
    switch.publish(1, new)
    live = interrupt.Live(old, 0, switch)
    sampler.sample(live, PROMPTS[:1], max_new_tokens=10, greedy=True, prompt_len=16)
    assert live.version == 1 and live.params is new
    again = sampler.sample(live, PROMPTS, max_new_tokens=10, greedy=True, prompt_len=16)
    assert again.completions() == [_greedy(new, p, 10) for p in PROMPTS]
    np.testing.assert_array_equal(again.versions, [[1] * 10] * 4)


# ------------------------------------------------------------------ the mixed producer

MIX_STEPS, MIX_K = 5, 2


def _mixed_run(workdir, weights=None, scored=None):
    """grpo_toy at k = 2 with rl.interrupt on the engine (the swap forced after the first
    round of 4 decode steps, as tests/resume_program.py does), its records split between two
    rollout.SingleTurn producers by prompt length through a MixedProducer (two parts, one
    engine: each batch is two generations one after the other, under one Live). weights:
    version -> the learner's parameters of that version (copies on the host); scored: the
    mixed batches, in the order they were scored."""
    import os
    from configs import grpo_toy
    from ptrain import learner, lookahead, rollout, sharding
    from ptrain.rollout import mixed as mixed_producer
    c = grpo_toy.get_config()
    c.sampling.update(engine=True, engine_slots=8, num_samples=4)
    c.rl.update(staleness=MIX_K, interrupt=True, tis_cap=2.0, num_minibatches=1,
                microbatch_size=0)
    c.data.prompts_per_step = 4
    c.checkpoint.update(every=2, keep=3)  # (the test resumes from step 2's)
    c.log.rollouts_every = 1
    c.steps = MIX_STEPS
    mesh = sharding.make_mesh(fsdp=1, devices=jax.devices()[:1])
    model = nnx.eval_shape(lambda: M.Transformer(learner.model_config(c), rngs=nnx.Rngs(0),
                                                 mesh=mesh))
    sampler = rollout.make_sampler(model, c)

    class Mixed(mixed_producer.MixedProducer):
        def score(self, generated):
            batch = super().score(generated)
            if scored is not None:
                scored.append(batch)
            return batch

    producer = Mixed({"odd": rollout.SingleTurn(c, sampler), "even": rollout.SingleTurn(
        c, sampler)}, route=lambda r: "odd" if len(r["prompt_ids"]) % 2 else "even")
    original = lookahead.LookAhead.next

    def next_(self, step, params):  # (the learner's parameters of version step - 1)
        if weights is not None:
            weights[step - 1] = jax.device_get(params)
        return original(self, step, params)

    lookahead.LookAhead.next = next_
    try:
        learner.train(c, str(workdir), producer=producer, mesh=mesh)
    finally:
        lookahead.LookAhead.next = original
    return nnx.split(model)[0], os.path.join(str(workdir), "checkpoints")


def _untimed(workdir):
    import os
    from ptrain.metrics import read_jsonl
    return ([{k: v for k, v in r.items() if not k.startswith(("time/", "engine/"))}
             for r in read_jsonl(os.path.join(str(workdir), "metrics.jsonl"))],
            read_jsonl(os.path.join(str(workdir), "rollouts.jsonl")))


def test_a_mixed_run_keeps_each_tokens_version_and_resumes_exactly(tmp_path, monkeypatch):
    """A mixed batch's tokens keep the versions the engine recorded in each part: within k
    of the learner's, tokens from the first round of a batch generated during update t of
    version t - 1 and the rest of version t (the second part starts where the first left
    off), every token's behaviour log-prob (what the loss corrects against) that of its
    recorded version's weights, teacher-forced, to 1e-5; a run resumed from the step-2
    checkpoint (its pending batches finished) logs what the uninterrupted one did."""
    import shutil
    from ptrain import lookahead
    monkeypatch.setattr(interrupt.Switch, "at_round", 1)
    monkeypatch.setattr(interrupt.Switch, "every", 4)
    weights, scored = {}, []
    graphdef, checkpoints = _mixed_run(tmp_path / "reference", weights, scored)
    assert len(scored) == MIX_STEPS
    interrupted = 0
    for b, batch in enumerate(scored, start=1):  # scored in order: batch b trains at step b
        v_bn, mask_bn = np.asarray(batch.versions_bn), batch.loss_mask_bn > 0
        np.testing.assert_array_equal(v_bn != interrupt.UNSAMPLED, mask_bn)
        v0 = lookahead.version(b, MIX_K)
        sampled = v_bn[mask_bn]
        assert set(sampled.tolist()) <= ({v0} if b <= MIX_K else {v0, v0 + 1}), b
        assert (b - 1 - sampled).max() <= MIX_K
        rows = [row[m].tolist() for row, m in zip(v_bn, mask_bn)]
        assert all(r == sorted(r) for r in rows)  # a row never goes back to an older version
        if b > MIX_K:  # the first round's tokens are the old version's, the rest the new's
            interrupted += sum(len(set(r)) == 2 for r in rows)
            assert all(r[:4] == [v0] * min(4, len(r)) for r in rows if len(set(r)) == 2)
        # Each token's behaviour log-prob is its version's (teacher-forced over the row).
        p = batch.prompt_bp.shape[1]
        for i in range(len(batch)):
            n, pl = int(batch.lengths_b[i]), int(batch.prompt_lens_b[i])
            seq = batch.prompt_bp[i, p - pl:].tolist() + batch.tokens_bn[i, :n].tolist()
            for version in set(rows[i]):
                ref = _teacher_forced(nnx.merge(graphdef, weights[version]), seq)[pl - 1:]
                at = v_bn[i, :n] == version
                np.testing.assert_allclose(batch.rollout_logp_bn[i, :n][at], ref[at],
                                           atol=1e-5)
    assert interrupted > 0
    metrics, rollouts = _untimed(tmp_path / "reference")
    for r in metrics:
        hist, lag = r["rollout/token_staleness_hist"], min(r["step"] - 1, MIX_K)
        assert len(hist) == MIX_K + 1 and sum(hist[lag - 1:lag + 1] if r["step"] > MIX_K
                                              else hist[lag:]) == sum(hist), r
    resumed = tmp_path / "resumed"
    shutil.copytree(f"{checkpoints}/2", resumed / "checkpoints" / "2")
    _mixed_run(resumed)
    again = _untimed(resumed)
    assert [r["step"] for r in again[0]] == list(range(3, MIX_STEPS + 1))
    assert again[0] == metrics[2:]
    assert again[1] == [r for r in rollouts if r["step"] > 2]


# ------------------------------------------------------------------ terminal episodes

def test_a_terminal_episode_goes_on_with_the_new_weights_at_its_next_turn(tmp_path):
    """rl.interrupt on terminal episodes (the terminal environment's tasks through
    rollout.Tasks on the engine, bwrap task boxes; a chat format that reads every turn as a
    bash call): version 4, published before the first turn, takes over after the first round
    of 4 tokens, and the second turn (after the tool ran in the task's shell) is version 4's
    throughout; each model token's version is kept in the batch, the prompt and the tool's
    output UNSAMPLED, and the token staleness metrics read them."""
    import dataclasses
    from ptrain import chat, config as config_lib, rollout
    from ptrain.envs import terminal as terminal_env
    from ptrain.envs.terminal import generated as terminal_tasks
    from ptrain.generate import engine_sampler
    from sandbox import terminal
    from sandbox.terminal import bwrap
    if bwrap.unavailable() is not None:
        pytest.skip(bwrap.unavailable())
    train = terminal_tasks.generate(str(tmp_path), 2, seed=0, split="train")
    for g in train:  # the agent's clock runs from the episode's start: the engine's compiles
        toml = tmp_path / g.task_dir / "task.toml"
        toml.write_text(toml.read_text().replace("[agent]\ntimeout_sec = 60.0",
                                                 "[agent]\ntimeout_sec = 3600.0"))
    tok = terminal_tasks.tokenizer()
    config = dataclasses.replace(CONFIG, vocab_size=tok.vocab_size)
    old, new = M.init(config, seed=3), M.init(config, seed=11)
    c = config_lib.defaults(closed_loop=True)
    c.sampling.update(num_samples=2, max_new_tokens=8, stop_token_ids=())
    c.rollout.update(max_turns=2, max_len=64)
    c.data.max_prompt_len = 24
    switch = interrupt.Switch(every=EVERY, at_round=1)
    switch.publish(4, nnx.state(new))
    live = interrupt.Live(nnx.state(old), 3, switch)
    with terminal.Harness(backend="bwrap", max_idle=4) as h:
        env = dataclasses.replace(terminal_env.make(system="", threads=4), open_session=lambda t:
                                  h.episode(terminal.load_task(t.task_dir)))
        producer = rollout.Tasks(engine_sampler.EngineSampler(old, slots=4, decode=tok.decode),
                                 tok, c, None, envs={"terminal": env})
        producer.fmt = dataclasses.replace(
            chat.PLAIN, parse_calls=lambda text: [chat.ToolCall("bash", {"command": "true"})])
        batch = producer.score(producer.generate(live, train, jax.random.key(0)))
    assert live.version == 4
    u = interrupt.UNSAMPLED
    v_bn, mask_bn = batch.versions_bn, batch.loss_mask_bn > 0
    np.testing.assert_array_equal(v_bn != u, mask_bn)
    for i in range(len(batch)):
        mask = mask_bn[i, :int(batch.lengths_b[i])]
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
        (a, b), (c2, d) = edges.reshape(-1, 2)  # two model turns, an observation after each
        assert batch.meta[i]["turns"] == 2 and a == 0 and b < c2, batch.meta[i]
        assert v_bn[i, a:b].tolist() == [3] * EVERY + [4] * (b - a - EVERY)
        assert v_bn[i, c2:d].tolist() == [4] * (d - c2)
    m = interrupt.metrics(batch, step=5, k=1)  # the learner holds version 4
    assert m["rollout/interrupted"] == 1.0
    assert m["rollout/token_staleness_hist"] == [int((v_bn == 4).sum()), EVERY * len(batch)]
