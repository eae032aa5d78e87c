"""ptrain.generate.engine against one-at-a-time sampling (ptrain.generate.sampler), teacher-forced forwards of
the same model and the re-prefilling multi-turn path."""

import threading

import jax
import numpy as np
import pytest
from flax import nnx

from ptrain import model as M
from ptrain import sharding
from ptrain.generate import engine as E
from ptrain.generate import engine_sampler
from ptrain.generate import kv_slots
from ptrain.generate import sampler as S

CONFIG = M.ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                       qkv_bias=True, attention_impl="reference")
PROMPTS = [[1, 5, 9, 33, 2], [1, 7], [1, 40, 41, 12, 3, 3, 18, 30, 22, 9, 11], [1, 8, 8],
           [1, 20, 21, 22, 23, 24, 25], [1, 44]]
LIMITS = [9, 3, 12, 6, 1, 10]  # per-request max_new_tokens: mixed lengths


@pytest.fixture(scope="module")
def model():
    return M.init(CONFIG, seed=3)


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def _logits(model, tokens, length=64):
    padded = np.zeros((1, length), np.int32)
    padded[0, :len(tokens)] = tokens
    return np.asarray(_forward(model, padded), np.float64)[0, :len(tokens)]


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _engine(model, **kw):
    """Engines share shapes and settings where they can (each new one compiles)."""
    kw = dict(dict(slots=2, max_len=64, max_new_tokens=12, token_buckets=(64,),
                   prefill_rows=2), **kw)
    return E.Engine(model, **kw)


def _greedy(model, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(_logits(model, tokens)[-1])))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def stop(model):
    """A token greedy decoding of PROMPTS[0] emits at its 4th step (so some rows stop)."""
    return _greedy(model, PROMPTS[0], 4)[3]


def _reference(model, prompt, n, stop, decode=None, stop_strings=()):
    """The static sampler on one prompt (one compilation for every call: fixed shapes,
    the completion cut to n tokens afterwards, which greedy decoding allows)."""
    sampler = S.Sampler(model, decode=decode, stop_check_every=4)
    out = sampler.sample(model, [prompt], max_new_tokens=12, greedy=True, prompt_len=64,
                         stop_token_ids=() if stop is None else (stop,),
                         stop_strings=stop_strings)
    tokens, reason = out.completions()[0], out.finish_reasons[0]
    if len(tokens) >= n:
        tokens, reason = tokens[:n], ("stop" if reason == "stop" and len(tokens) == n
                                      else "length")
    return tokens, out.logp_t1[0, :len(tokens)], reason


def test_greedy_equals_one_at_a_time(model, stop):
    """6 requests through 2 slots (slots are reused as rows finish), mixed lengths, a stop
    token: each equals the static sampler run on that prompt alone, token for token."""
    engine = _engine(model, greedy=True, stop_token_ids=(stop,))
    trajs = engine.generate(model, [E.Request(p, max_new_tokens=n)
                                    for p, n in zip(PROMPTS, LIMITS)])
    reasons = set()
    for traj, prompt, n in zip(trajs, PROMPTS, LIMITS):
        tokens, logp_t1, reason = _reference(model, prompt, n, stop)
        assert traj.turns[0] == tokens
        assert traj.finish_reasons == [reason]
        np.testing.assert_allclose(traj.logp_t1[len(prompt):], logp_t1, atol=1e-5)
        assert traj.tokens == prompt + traj.turns[0] and traj.mask == [0] * len(prompt) + [1] * len(
            traj.turns[0])
        reasons.update(traj.finish_reasons)
    assert reasons == {"stop", "length"}
    m = engine.metrics()
    assert m["tokens"] == sum(len(t.turns[0]) for t in trajs) and 0 < m["slot_occupancy"] <= 1
    assert m["queue_waiting_max"] == 4 and engine.queues() == dict(waiting=0, live=0,
                                                                    on_tools=0)


def test_sampled_independent_of_slots_neighbours_and_order(model):
    """Fixed keys per request: the same samples with 1 slot or 4, in any arrival order, and
    logp = log_softmax(logits / T) and logp_t1 of a teacher-forced forward to 1e-5."""
    temperature = 0.7
    requests = [E.Request(p, key=jax.random.key(10 + i), num_samples=2, max_new_tokens=n)
                for i, (p, n) in enumerate(zip(PROMPTS, LIMITS))]
    wide = _engine(model, slots=4, temperature=temperature).generate(model, requests)
    order = [3, 5, 0, 2, 1, 4]
    narrow = _engine(model, slots=2, temperature=temperature).generate(
        model, [requests[i] for i in order])
    by_key = {(order[t.request], t.sample): t for t in narrow}
    assert len({tuple(t.turns[0]) for t in wide}) > 6  # samples differ
    for t in wide:
        assert t.turns[0] == by_key[(t.request, t.sample)].turns[0]
        prompt = PROMPTS[t.request]
        logits = _logits(model, t.tokens)[len(prompt) - 1:-1]
        steps, tokens = np.arange(len(t.turns[0])), t.turns[0]
        np.testing.assert_allclose(t.logp_t1[len(prompt):], _log_softmax(logits)[steps, tokens],
                                   atol=1e-5)
        np.testing.assert_allclose(t.logp[len(prompt):],
                                   _log_softmax(logits / temperature)[steps, tokens], atol=1e-5)


def _hf_filtered_log_softmax(logits_tv, temperature, top_k=0, top_p=1.0):
    """log_softmax of logits after transformers' temperature, top-k and top-p warpers (the
    order of its generation config), in float64: -inf outside the kept set."""
    torch = pytest.importorskip("torch", reason="torch (CPU) runs transformers' warpers")
    warpers = pytest.importorskip("transformers.generation.logits_process",
                                  reason="pip install '.[test]'")
    z = torch.tensor(np.asarray(logits_tv, np.float64))
    chain = [warpers.TemperatureLogitsWarper(temperature)]
    chain += [warpers.TopKLogitsWarper(top_k)] if top_k else []
    chain += [warpers.TopPLogitsWarper(top_p)] if top_p < 1 else []
    for warp in chain:
        z = warp(None, z)
    return torch.log_softmax(z, dim=-1).numpy()


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (0, 0.7), (4, 0.7)])
def test_inverse_cdf_sampling_follows_the_filtered_distribution(top_k, top_p):
    logits = np.log(np.array([[0.5, 0.0, 0.2, 0.25, 0.05]], np.float32) + 1e-30)
    n = 8000
    keys = jax.random.split(jax.random.key(0), n)
    sample = jax.jit(kv_slots.sample_rows, static_argnums=3)  # one compile, not one per op
    settings = kv_slots.Settings(temperature=0.9, top_k=top_k, top_p=top_p)
    tok, logp, logp_temp, logp_t1 = map(np.asarray, sample(
        np.repeat(logits, n, 0), keys, np.zeros(n, np.int32), settings))
    ref = _hf_filtered_log_softmax(logits, 0.9, top_k, top_p)[0]
    freq = np.bincount(tok, minlength=5) / n
    np.testing.assert_allclose(freq, np.exp(ref), atol=0.02)
    assert np.all(freq[np.exp(ref) == 0] == 0)  # a removed (or zero-mass) token: never drawn
    np.testing.assert_allclose(logp, ref[tok], atol=1e-5)
    np.testing.assert_allclose(logp_temp, _log_softmax(logits[0] / 0.9)[tok], atol=1e-5)
    np.testing.assert_allclose(logp_t1, _log_softmax(logits[0].astype(np.float64))[tok],
                               atol=1e-5)


def test_top_k_top_p_samples_are_exact_in_any_slot_and_order(model):
    """Temperature, then top-k, then top-p (transformers' warpers as the reference): with 2
    slots or 4 and in any arrival order the same tokens, each inside the kept set of a
    teacher-forced forward; `logp` is the filtered distribution's log-prob, `logp_temp` that
    of logits / T (what the learner's forward computes), `logp_t1` the plain model's."""
    temperature, top_k, top_p = 0.7, 6, 0.8
    requests = [E.Request(p, key=jax.random.key(20 + i), num_samples=2, max_new_tokens=n)
                for i, (p, n) in enumerate(zip(PROMPTS, LIMITS))]
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    wide = _engine(model, slots=4, **kw).generate(model, requests)
    order = [4, 1, 5, 0, 3, 2]
    narrow = _engine(model, slots=2, **kw).generate(model, [requests[i] for i in order])
    by_key = {(order[t.request], t.sample): t for t in narrow}
    assert len({tuple(t.turns[0]) for t in wide}) > 6  # samples differ
    kept = []
    for t in wide:
        assert t.turns[0] == by_key[(t.request, t.sample)].turns[0]
        p = len(PROMPTS[t.request])
        logits = _logits(model, t.tokens)[p - 1:-1]
        steps, tokens = np.arange(len(t.turns[0])), t.turns[0]
        filtered = _hf_filtered_log_softmax(logits, temperature, top_k, top_p)
        kept += np.isfinite(filtered).sum(-1).tolist()
        np.testing.assert_allclose(t.logp[p:], filtered[steps, tokens], atol=1e-5)
        np.testing.assert_allclose(t.logp_temp[p:],
                                   _log_softmax(logits / temperature)[steps, tokens], atol=1e-5)
        np.testing.assert_allclose(t.logp_t1[p:], _log_softmax(logits)[steps, tokens],
                                   atol=1e-5)
    assert max(kept) <= top_k and min(kept) < top_k  # top-p cut some sets further


def test_no_recompilation_after_warm_up(model, stop):
    engine = _engine(model, slots=4, temperature=0.7, stop_token_ids=(stop,))
    compiled = engine.warm_up(model)
    assert compiled > 0
    before = dict(kv_slots.TRACES)

    def obs(traj):
        return [3, 4, 5] if len(traj.turns) < 2 else None

    requests = [E.Request(p, key=i, num_samples=1 + i % 3, max_new_tokens=n,
                          on_turn=obs if i % 2 else None)
                for i, (p, n) in enumerate(zip(PROMPTS, LIMITS))]
    engine.generate(model, requests)
    engine.generate(model, requests[:2])
    assert dict(kv_slots.TRACES) == before


def _observation(turn):
    return [3, 5 + sum(turn) % 40, 4]


def _reprefill_reference(model, prompt, turns, max_new, stop):
    """Today's multi-turn path: every turn re-prefills the whole history."""
    tokens, mask, logp = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
    for turn in range(turns):
        new, new_logp, _ = _reference(model, tokens, max_new, stop)
        tokens += new
        mask += [1] * len(new)
        logp += new_logp.tolist()
        if turn < turns - 1:
            obs = _observation(new)
            tokens += obs
            mask += [0] * len(obs)
            logp += [0.0] * len(obs)
    return tokens, mask, logp


def test_multi_turn_equals_reprefill_without_prefilling_history(model, stop):
    turns = 3

    def on_turn(traj):
        return _observation(traj.turns[-1]) if len(traj.turns) < turns else None

    engine = _engine(model, greedy=True, stop_token_ids=(stop,))
    prompts = PROMPTS[:4]
    trajs = engine.generate(model, [E.Request(p, on_turn=on_turn, max_new_tokens=6)
                                    for p in prompts])
    for traj, prompt in zip(trajs, prompts):
        tokens, mask, logp = _reprefill_reference(model, prompt, turns, 6, stop)
        assert traj.tokens == tokens and traj.mask == mask
        np.testing.assert_allclose(traj.logp_t1, logp, atol=1e-5)
        assert len(traj.turns) == turns
    # Prefilled: each prompt once and each observation once, never the history.
    observed = sum(len(_observation(t)) for traj in trajs for t in traj.turns[:-1])
    assert engine.metrics()["prefill_tokens"] == sum(map(len, prompts)) + observed


def test_samples_share_the_prompt_prefill(model):
    engine = _engine(model, slots=4, temperature=0.7)
    trajs = engine.generate(model, [E.Request(PROMPTS[2], key=1, num_samples=4)])
    assert engine.metrics()["prefill_tokens"] == len(PROMPTS[2])
    assert len({tuple(t.turns[0]) for t in trajs}) > 1
    for t in trajs:  # each copy continues the shared prefix exactly
        logits = _logits(model, t.tokens)[len(PROMPTS[2]) - 1:-1]
        np.testing.assert_allclose(t.logp_t1[len(PROMPTS[2]):], _log_softmax(logits)[
            np.arange(len(t.turns[0])), t.turns[0]], atol=1e-5)


def test_episodes_decode_while_another_waits_on_its_tool(model, stop):
    """Episode 0's tool returns only once episode 1 has finished all its turns: the engine
    must keep decoding episode 1 meanwhile (waiting on the tool would never end)."""
    other_done = threading.Event()
    waited = []

    def slow(traj):
        waited.append(other_done.wait(timeout=60))
        return None

    def fast(traj):
        if len(traj.turns) < 3:
            return [3, 4]
        other_done.set()
        return None

    engine = _engine(model, greedy=True, stop_token_ids=(stop,))
    trajs = engine.generate(model, [E.Request(PROMPTS[0], on_turn=slow, max_new_tokens=4),
                                    E.Request(PROMPTS[1], on_turn=fast, max_new_tokens=4)])
    assert waited == [True] and len(trajs[1].turns) == 3
    m = engine.metrics()
    assert m["tool_wait_s"] > 0 and trajs[0].tool_wait_s > 0


def _text(ids):
    return "".join(chr(97 + t % 26) for t in ids)


def test_stop_strings_equal_the_static_sampler(model):
    """The stop string completes mid-chunk: the row is cut there (and its slot rolled back)."""
    text = _text(_greedy(model, PROMPTS[2], 7))
    stop = text[5:7]  # completes at token 7 (or earlier)
    engine = _engine(model, greedy=True, stop_strings=(stop,), decode=_text,
                     stop_check_every=4)
    trajs = engine.generate(model, [E.Request(p) for p in PROMPTS[:3]])
    for traj, prompt in zip(trajs, PROMPTS[:3]):
        tokens, _, reason = _reference(model, prompt, 12, None, _text, (stop,))
        assert traj.turns[0] == tokens
        assert traj.finish_reasons == [reason]
    assert trajs[2].finish_reasons == ["stop"]


def test_stop_string_cut_then_next_turn_continues_from_the_cut(model):
    """After a stop-string cut the slot continues at the cut: the next turn equals the
    re-prefilled history's."""
    stop = _text(_greedy(model, PROMPTS[2], 4))[2:4]
    engine = _engine(model, greedy=True, stop_strings=(stop,), decode=_text,
                     stop_check_every=8)
    traj = engine.generate(model, [E.Request(
        PROMPTS[2], on_turn=lambda t: [3, 4] if len(t.turns) < 2 else None)])[0]
    first = traj.turns[0]
    assert _text(first).endswith(stop) and len(first) < 8  # cut inside the first 8-token chunk
    history = PROMPTS[2] + first + [3, 4]
    assert traj.turns[1] == _reference(model, history, 12, None, _text, (stop,))[0]


def test_bf16_decode_copy_resharded_and_refreshed(model):
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    engine = _engine(model, greedy=True, decode_dtype="bfloat16", mesh=mesh)
    with pytest.raises(ValueError, match="sync_weights"):
        engine.generate(None, [E.Request(PROMPTS[0])])
    assert engine.sync_weights(model) >= 0
    leaves = jax.tree.leaves(engine.params)
    assert all(x.dtype == np.dtype("bfloat16") for x in leaves)
    wq = engine.params["layers"]["wq"][...]
    assert "fsdp" not in str(wq.sharding.spec) and "tensor" in str(wq.sharding.spec)
    first = engine.generate(None, [E.Request(PROMPTS[0])])[0]
    # a bf16 decode of a float32 model: near the float32 model's greedy tokens and log-probs
    assert first.turns[0][:2] == _greedy(model, PROMPTS[0], 2)
    # refresh: the next generate decodes the new weights, and the old ones again after
    other = M.init(CONFIG, seed=4)
    engine.sync_weights(other)
    again = engine.generate(None, [E.Request(PROMPTS[0])])[0].turns[0]
    assert again[:2] == _greedy(other, PROMPTS[0], 2) and again != first.turns[0]
    engine.sync_weights(model)
    assert engine.generate(None, [E.Request(PROMPTS[0])])[0].turns[0] == first.turns[0]
    assert engine.metrics()["weight_syncs"] == 3


def test_bad_input_is_refused(model):
    engine = _engine(model)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate(model, [E.Request([])])
    with pytest.raises(ValueError, match="num_samples"):
        engine.generate(model, [E.Request([1], num_samples=3)])
    with pytest.raises(ValueError, match="max_len"):
        _engine(model, max_len=12, max_new_tokens=12)


def test_engine_sampler_equals_the_static_sampler_greedily(model, stop):
    """sampling.engine=True: rollout.make_sampler puts the engine behind Sampler.sample's
    interface (what the producers call); greedily its Samples equal the static sampler's."""
    from ptrain import config as config_lib
    from ptrain import rollout

    config = config_lib.defaults()
    config.sampling.engine, config.sampling.engine_slots = True, 2
    sampler = rollout.make_sampler(model, config)
    assert isinstance(sampler, engine_sampler.EngineSampler)
    kw = dict(max_new_tokens=12, num_samples=2, greedy=True, stop_token_ids=(stop,),
              prompt_len=16)
    got = sampler.sample(model, PROMPTS[:4], **kw)
    want = S.Sampler(model).sample(model, PROMPTS[:4], **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_array_equal(got.prompt_index, want.prompt_index)
    assert got.finish_reasons == want.finish_reasons and set(got.finish_reasons) == {
        "stop", "length"}
    np.testing.assert_allclose(got.logp_t1, want.logp_t1, atol=1e-5)
    np.testing.assert_allclose(got.logp_temp, want.logp_temp, atol=1e-5)
    sampled = sampler.sample(model, PROMPTS[:2], max_new_tokens=6, num_samples=2,
                             temperature=0.7, key=jax.random.key(0), prompt_len=16)
    assert sampled.tokens.shape == (4, 6) and np.all(sampled.lengths == 6)
    np.testing.assert_array_equal(sampled.logp_temp, sampled.logp)
    # top_k=1 at any temperature is greedy decoding: the greedy tokens, each of probability 1
    # under the filtered distribution; logp_temp is still the policy's (logits / T).
    top1 = sampler.sample(model, PROMPTS[:4], **dict(kw, greedy=False, temperature=0.7,
                                                      top_k=1))
    np.testing.assert_array_equal(top1.tokens, want.tokens)
    np.testing.assert_allclose(top1.logp, 0.0, atol=1e-6)
    for r, n in enumerate(top1.lengths):
        prompt = PROMPTS[top1.prompt_index[r]]
        completion = top1.tokens[r, :n]
        logits = _logits(model, [*prompt, *completion])[len(prompt) - 1:-1]
        np.testing.assert_allclose(top1.logp_temp[r, :n],
                                   _log_softmax(logits / 0.7)[np.arange(n), completion],
                                   atol=1e-5)


def test_single_turn_producer_runs_on_the_engine(model):
    """The learner's producer with sampling.engine=True: a scored batch of G rows per prompt,
    its log-probs the engine's (logp_temp of each completion token)."""
    from ptrain import config as config_lib
    from ptrain import rollout

    config = config_lib.defaults()
    config.sampling.update(engine=True, engine_slots=4, num_samples=2, max_new_tokens=5)
    config.data.max_prompt_len = 16
    producer = rollout.SingleTurn(config, rollout.make_sampler(model, config),
                                  reward_fn=lambda record, ids, text: float(len(ids)))
    records = [{"prompt_ids": p} for p in PROMPTS[:3]]
    generated = producer.generate(model, records, jax.random.key(0))
    samples = generated[2]
    assert isinstance(producer.sampler, engine_sampler.EngineSampler)
    assert samples.tokens.shape == (6, 5)
    batch = producer.score(generated)
    np.testing.assert_array_equal(batch.rewards_b, [5.0] * 6)
    np.testing.assert_allclose(batch.rollout_logp_bn, samples.logp_temp, atol=1e-6)
