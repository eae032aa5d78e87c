"""ptrain.generate.sampler against teacher-forced forwards of the same model, and numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ptrain import model as M
from ptrain import sharding
from ptrain.generate import sampler as S

CONFIG = M.ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                       qkv_bias=True)
PROMPTS = [[1, 5, 9, 33, 2], [1, 7], [1, 40, 41, 12, 3, 3, 18, 30, 22, 9, 11]]
GREEDY_LEN = 10  # one length for the greedy runs: they share a compilation


@pytest.fixture(scope="module")
def model():
    return M.init(CONFIG, seed=3)


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def _logits(model, tokens, length=40):
    """The full forward of one sequence, right-padded to a fixed length (one compilation;
    causal attention makes the padding invisible to the real positions)."""
    padded = np.zeros((1, length), np.int32)
    padded[0, :len(tokens)] = tokens
    return np.asarray(_forward(model, jnp.asarray(padded)), np.float64)[0, :len(tokens)]


def _teacher_forced(model, prompt, completion):
    """float64 log-softmax of the full forward at the positions that predict the completion."""
    logits = _logits(model, prompt + completion)
    logits = logits[len(prompt) - 1:len(prompt) - 1 + len(completion)]
    return logits, logits - _logsumexp(logits)


def _logsumexp(x):
    m = x.max(-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_logprobs_equal_teacher_forced_forward(model):
    """Both log-probs, for prompts of different lengths, G samples each from one prefill."""
    temperature, top_k = 0.7, 20
    out = S.Sampler(model, seed=0).sample(nnx.state(model), PROMPTS, max_new_tokens=12,
                                          num_samples=3, temperature=temperature, top_k=top_k)
    assert out.tokens.shape == (9, 12) and out.prompt_index.tolist() == [0] * 3 + [1] * 3 + [2] * 3
    assert len({tuple(c) for c in out.completions()}) > 3  # G samples differ
    for r, completion in enumerate(out.completions()):
        logits, logp_t1 = _teacher_forced(model, PROMPTS[out.prompt_index[r]], completion)
        steps = np.arange(len(completion))
        np.testing.assert_allclose(out.logp_t1[r, steps], logp_t1[steps, completion], atol=1e-5)
        # The distribution sampled from: temperature, then the top-k mask, renormalised.
        z = logits / temperature
        kth = np.sort(z, -1)[:, -top_k][:, None]
        z = np.where(z >= kth, z, -np.inf)
        logp = z - _logsumexp(z)
        np.testing.assert_allclose(out.logp[r, steps], logp[steps, completion], atol=1e-5)
        assert np.isfinite(logp[steps, completion]).all()  # every token inside the top-k


def test_behaviour_logprob_at_temperature_is_the_teacher_forced_logits_over_t(model):
    """At T = 0.6 (with a nucleus that changes the sampled-from distribution) the stored
    behaviour log-prob is log_softmax(logits / T) of a teacher-forced forward: the policy the
    learner trains, as verl and TRL define it; neither the filtered nor the T=1 log-prob."""
    temperature = 0.6
    out = S.Sampler(model, seed=1).sample(nnx.state(model), PROMPTS, max_new_tokens=12,
                                          num_samples=2, temperature=temperature, top_p=0.8)
    gaps = []
    for r, completion in enumerate(out.completions()):
        logits, logp_t1 = _teacher_forced(model, PROMPTS[out.prompt_index[r]], completion)
        steps = np.arange(len(completion))
        z = logits / temperature
        expected = (z - _logsumexp(z))[steps, completion]
        np.testing.assert_allclose(out.logp_temp[r, steps], expected, atol=1e-5)
        gaps += [np.abs(expected - logp_t1[steps, completion]).max(),
                 np.abs(expected - out.logp[r, steps]).max()]
    assert min(gaps) > 1e-3  # the three log-probs are different numbers
    greedy = S.Sampler(model).sample(nnx.state(model), PROMPTS[:1], max_new_tokens=4,
                                     greedy=True, temperature=temperature)
    np.testing.assert_array_equal(greedy.logp_temp, greedy.logp_t1)


def _argmax_decode(model, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(_logits(model, tokens)[-1])))
    return tokens[len(prompt):]


def test_greedy_equals_argmax_of_full_forward_and_top_k_1(model):
    sampler = S.Sampler(model)
    greedy = sampler.sample(model, PROMPTS, max_new_tokens=GREEDY_LEN, greedy=True)
    for r, prompt in enumerate(PROMPTS):
        assert greedy.completions()[r] == _argmax_decode(model, prompt, GREEDY_LEN)
    assert (greedy.logp == 0).all()  # a point mass
    assert greedy.finish_reasons == ["length"] * 3
    assert greedy.lengths.tolist() == [GREEDY_LEN] * 3
    top1 = sampler.sample(model, PROMPTS, max_new_tokens=GREEDY_LEN, top_k=1, temperature=1.3)
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)
    np.testing.assert_allclose(top1.logp_t1, greedy.logp_t1, atol=1e-6)


def test_top_p_masks_exactly_the_tail():
    """Kept: the smallest set of most likely tokens whose probability reaches p."""
    z = np.random.RandomState(0).randn(64, 48) * 2.0
    for top_p in (0.05, 0.5, 0.9, 0.999):
        out = np.asarray(S.filter_top_k_top_p(jnp.asarray(z, jnp.float32), 0, top_p))
        p = np.exp(z - _logsumexp(z))
        for row in range(len(z)):
            order = np.argsort(-p[row])
            n_keep = int(np.searchsorted(np.cumsum(p[row, order]), top_p) + 1)
            expected = np.zeros(48, bool)
            expected[order[:min(n_keep, 48)]] = True
            np.testing.assert_array_equal(np.isfinite(out[row]), expected)
    # top-k then top-p on the renormalised top-k distribution (Hugging Face's order)
    both = np.asarray(S.filter_top_k_top_p(jnp.asarray(z, jnp.float32), 5, 0.6))
    assert (np.isfinite(both).sum(-1) <= 5).all()
    only_k = np.asarray(S.filter_top_k_top_p(jnp.asarray(z, jnp.float32), 5, 1.0))
    assert (np.isfinite(only_k).sum(-1) == 5).all()
    assert (np.isfinite(both) <= np.isfinite(only_k)).all()


def test_sampled_tokens_stay_in_the_nucleus(model):
    out = S.Sampler(model, seed=1).sample(model, PROMPTS, max_new_tokens=6, num_samples=4,
                                          top_p=0.3)
    for r, completion in enumerate(out.completions()):
        logits, logp_t1 = _teacher_forced(model, PROMPTS[out.prompt_index[r]], completion)
        p = np.exp(logp_t1)
        for i, tok in enumerate(completion):
            larger = p[i][p[i] > p[i, tok]].sum()
            assert larger < 0.3  # the mass of the tokens before it in the sorted order


def test_stop_token_ids(model):
    sampler = S.Sampler(model)
    free = sampler.sample(model, PROMPTS, max_new_tokens=GREEDY_LEN, greedy=True)
    stop = int(free.tokens[0, 3])  # a token the first row emits at step 4
    out = sampler.sample(model, PROMPTS, max_new_tokens=GREEDY_LEN, greedy=True,
                         stop_token_ids=(stop,))
    for r in range(3):
        row = free.tokens[r].tolist()
        if stop in row:
            end = row.index(stop) + 1
            assert out.finish_reasons[r] == "stop" and out.lengths[r] == end
            assert out.completions()[r] == row[:end]  # the stop token is part of the completion
            assert (out.tokens[r, end:] == 0).all() and (out.logp_t1[r, end:] == 0).all()
        else:
            assert out.finish_reasons[r] == "length" and out.completions()[r] == row
    assert out.finish_reasons[0] == "stop" and out.lengths[0] <= 4


def _decode(ids):
    """A toy detokeniser with multi-character tokens: token i is 'ab'[i % 2] * (1 + i % 3)."""
    return "".join("ab"[i % 2] * (1 + i % 3) for i in ids)


def test_stop_strings_end_the_completion_where_the_string_completes(model):
    sampler = S.Sampler(model, decode=_decode, stop_check_every=3)
    free = sampler.sample(model, PROMPTS, max_new_tokens=GREEDY_LEN, greedy=True)
    texts = [_decode(c) for c in free.completions()]
    stop = texts[1][3:6]  # a string the second row writes, probably across tokens
    out = sampler.sample(model, PROMPTS, max_new_tokens=GREEDY_LEN, greedy=True,
                         stop_strings=(stop,))
    for r in range(3):
        full = free.completions()[r]
        ends = [n for n in range(1, GREEDY_LEN + 1) if stop in _decode(full[:n])]
        if ends:
            assert out.finish_reasons[r] == "stop" and out.lengths[r] == ends[0]
            assert out.completions()[r] == full[:ends[0]]
        else:
            assert out.finish_reasons[r] == "length" and out.completions()[r] == full
    assert out.finish_reasons[1] == "stop"


def test_key_advances_and_state_restores(model):
    sampler = S.Sampler(model, seed=5)
    state = sampler.get_state()
    a = sampler.sample(model, PROMPTS, max_new_tokens=8, num_samples=2)
    b = sampler.sample(model, PROMPTS, max_new_tokens=8, num_samples=2)
    assert not np.array_equal(a.tokens, b.tokens)  # a fixed key would repeat the noise
    sampler.set_state(state)
    np.testing.assert_array_equal(sampler.sample(model, PROMPTS, max_new_tokens=8,
                                                 num_samples=2).tokens, a.tokens)
    key = jax.random.key(11)
    before = sampler.get_state()
    c = sampler.sample(model, PROMPTS, max_new_tokens=8, num_samples=2, key=key)
    np.testing.assert_array_equal(sampler.get_state(), before)  # an explicit key: state kept
    np.testing.assert_array_equal(
        c.tokens, sampler.sample(model, PROMPTS, max_new_tokens=8, num_samples=2, key=key).tokens)


def test_sharded_sampler_equals_unsharded(model):
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    graphdef, abstract = sharding.abstract(
        lambda: M.Transformer(CONFIG, rngs=nnx.Rngs(0), mesh=mesh), mesh)
    params = jax.device_put(nnx.state(model), jax.tree.map(lambda x: x.sharding, abstract))
    sharded_model = nnx.merge(graphdef, params)
    kwargs = dict(max_new_tokens=GREEDY_LEN, num_samples=2, greedy=True)
    out = S.Sampler(sharded_model).sample(params, PROMPTS, **kwargs)
    ref = S.Sampler(model).sample(model, PROMPTS, **kwargs)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_allclose(out.logp_t1, ref.logp_t1, atol=1e-5)


def test_bad_requests_raise_clear_errors(model):
    sampler = S.Sampler(model)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        sampler.sample(model, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sampler.sample(model, [[1]], max_new_tokens=2, temperature=0.0)
    with pytest.raises(ValueError, match="need a decode callable"):
        sampler.sample(model, [[1]], max_new_tokens=2, stop_strings=("x",))
    with pytest.raises(ValueError, match="more than prompt_len=4"):
        sampler.sample(model, [[1] * 5], max_new_tokens=2, prompt_len=4)
    with pytest.raises(ValueError, match="token ids must be in"):
        sampler.sample(model, [[1, 48]], max_new_tokens=2)
