"""Interruption at a weight update (ptrain/interrupt.py): the swap forced at a known decode
round (`Switch(at_round=...)`), against runs of the old weights alone, teacher-forced
forwards of the new weights over the same prefix, and the versions recorded per token."""

import jax
import numpy as np
import pytest
from flax import nnx

from ptrain import engine as E
from ptrain import interrupt
from ptrain import model as M
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
    back = interrupt.decode_batch(interrupt.encode_batch(batch))
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
        from ptrain import interrupt as I
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
                saved = ahead.saved_batches()
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
    assert [item["step"] for item in saved["ahead_batches"]] == [4, 5]
    resumed = lookahead.LookAhead(k, _RoundsProducer(), Stream(5), jax.random.key(0),
                                  steps=steps, save_every=100, interrupt=True)
    resumed.start(4, [], finished=saved["ahead_batches"])
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


def test_a_swap_refreshes_the_engines_decode_copy(models):
    """sampling.decode_dtype: the engine decodes its own copy (float32 here, so that the
    tokens compare exactly); a swap syncs the copy from the new weights: the same tokens
    as the swap on the learner's weights, and the learner's metrics count it."""
    from ptrain import engine_sampler
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
