"""The multi-turn producer on the rollout engine (sampling.engine=True): episodes keep their
slots across turns. Against the per-turn (re-prefilling) path with the static sampler, and
against a teacher-forced forward of each whole episode.

The model is scripted by its embeddings: token a's embedding is a one-hot and the output
head maps it to chosen successors with a large margin (a bigram table over the turn
vocabulary: a malformed tool call, or an answer), so episodes call tools, answer, fail and
retry; its layers are random (scaled up), so every log-prob depends on the whole history."""

import jax
import numpy as np
import pytest
from flax import nnx

from ptrain import config as config_lib
from ptrain import model as M
from ptrain import rollout, tasks
from ptrain.generate import engine_sampler, kv_slots
from ptrain.generate.sampler import Sampler
from ptrain.envs.synthetic import EOS, WordTokenizer

pytestmark = pytest.mark.xdist_group("sandbox")

TOK = WordTokenizer.for_tasks()
CONFIG = M.ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4,
                       n_kv_heads=2, d_ff=64, qkv_bias=True, attention_impl="reference")
# Each history-ending or turn token -> its successors' probabilities (greedy: the largest).
SCRIPT = {"\n": {"<tool_call>": 0.6, "answer": 0.4}, "?": {"answer": 1.0},
          "<tool_call>": {"7": 1.0}, "7": {"</tool_call>": 1.0}, "answer": {":": 1.0},
          ":": {" ": 1.0}, " ": {"4": 1.0}, "4": {"2": 0.45, "1": 0.55},
          "2": {"<eos>": 1.0}, "1": {"<eos>": 1.0}}


def _task(i, prompt):
    return tasks.Task(f"t{i}", "arith", tasks.Answer("42", numeric=True), prompt=prompt,
                      tools=("python",))


# Ends with "\n": calls a tool first; ends with "?": answers at once (41, then retries).
TASKS = [_task(0, "arith: what is 6 times 7?\n"), _task(1, "arith: what is 6 times 7?"),
         _task(2, "arith: 6 times 7 = ?\n")]


@pytest.fixture(scope="module")
def model():
    model = M.init(CONFIG, seed=0)
    d = CONFIG.d_model
    embed = np.random.RandomState(0).normal(size=(CONFIG.vocab_size, d)).astype(np.float32)
    embed[:, :len(SCRIPT)] = 0.0
    head = np.zeros((CONFIG.vocab_size, d), np.float32)
    for k, (a, successors) in enumerate(SCRIPT.items()):
        embed[TOK.ids[a]] = np.eye(d)[k]
        for b, p in successors.items():
            head[TOK.ids[b], k] = (10.0 + np.log(p)) / np.sqrt(d)
    model.embed[...] = embed
    model.lm_head[...] = head
    for name, var in vars(model.layers).items():
        if isinstance(var, nnx.Param) and "norm" not in name:
            var[...] = var[...] * 3.0
    return model


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def _teacher_forced(model, tokens, temperature):
    """log_softmax(logits / T) of each token given all before it, from one forward pass."""
    padded = np.zeros((1, 256), np.int32)
    padded[0, :len(tokens)] = tokens
    z = np.asarray(_forward(model, padded), np.float64)[0, :len(tokens) - 1] / temperature
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return np.concatenate([[0.0], logp[np.arange(len(tokens) - 1), tokens[1:]]])


def _last_turn_end(e):
    """Tokens after the prompt up to the end of the episode's last model turn."""
    after = e.mask[e.prompt_len:]
    return len(after) - after[::-1].index(1)


def _generate(sampler, model, **config):
    c = rollout.RolloutConfig(**{"num_samples": 2, "max_new_tokens": 8, "max_turns": 2,
                                 "max_attempts": 2, "max_len": 120, "stop_token_ids": (EOS,),
                                 **config})
    return rollout.generate(sampler, model, TASKS, tokenizer=TOK, key=jax.random.key(0),
                            config=c)


def test_greedy_episodes_equal_the_per_turn_path_without_prefilling_history(model):
    engine = engine_sampler.EngineSampler(model, slots=4, decode=TOK.decode)
    got = _generate(engine, model, greedy=True)
    want = _generate(Sampler(model, decode=TOK.decode), model, greedy=True)
    for a, b in zip(got, want):
        assert a.tokens == b.tokens and a.mask == b.mask
        np.testing.assert_allclose(a.logp, b.logp, atol=1e-5)
        assert (a.finish, a.turns, a.tool_calls, a.answers) == (b.finish, b.turns,
                                                                b.tool_calls, b.answers)
        assert [v.passed for v in a.verdicts] == [v.passed for v in b.verdicts]
    # Task 0: two tool calls, out of turns; task 1: answers 41, gets feedback, then calls
    # tools until out of room (its second observation cut at max_len): an attempt, a retry,
    # turns and observations, all in one slot.
    assert (got[0].turns, got[0].tool_calls, got[0].finish) == (2, 2, "max_turns")
    assert (got[2].attempts, got[2].turns, got[2].finish) == (2, 3, "max_len")
    assert len(got[2].tokens) - got[2].prompt_len == 120
    assert "<feedback>" in TOK.decode(got[2].tokens)
    # Prefilled: each task's prompt once (its G episodes share it) and each observation or
    # feedback that a model turn followed once, never the history.
    [eng] = engine.engines.values()
    appended = sum(e.mask[e.prompt_len:e.prompt_len + _last_turn_end(e)].count(0) for e in got)
    assert eng.metrics()["prefill_tokens"] == sum(got[i].prompt_len for i in (0, 2, 4)) + \
        appended


def test_sampled_episodes_through_the_producer_equal_a_teacher_forced_forward(model):
    """sampling.engine=True: rollout.Tasks samples on the engine; each episode's log-probs
    (sampled at T=0.8) equal a teacher-forced forward of the whole episode to 1e-5; after a
    warm-up no program compiles again."""
    config = config_lib.defaults(closed_loop=True)
    config.sampling.update(engine=True, engine_slots=4, num_samples=4, max_new_tokens=8,
                           temperature=0.8, stop_token_ids=(EOS,))
    config.rollout.update(max_turns=3, max_attempts=2, max_len=120)
    sampler = rollout.make_sampler(model, config, TOK)
    producer = rollout.Tasks(sampler, TOK, config, pool=None)
    records = [tasks.to_record(t) for t in TASKS]
    episodes = producer.generate(model, records, jax.random.key(1))
    assert isinstance(sampler, engine_sampler.EngineSampler)
    for e in episodes:
        mask = np.array(e.mask, bool)
        np.testing.assert_allclose(np.array(e.logp)[mask],
                                   _teacher_forced(model, e.tokens, 0.8)[mask], atol=1e-5)
        assert not np.any(np.array(e.logp)[~mask])
    # The samples went different ways: tool calls, answers, retries.
    assert len({(e.turns, e.tool_calls, e.attempts) for e in episodes}) >= 3
    assert "answered" in {e.finish for e in episodes} and len({e.finish for e in episodes}) > 1
    batch = producer.score(episodes)
    assert batch.rewards_b.shape == (12,) and 0 < batch.rewards_b.sum() < 12
    [engine] = sampler.engines.values()
    engine.warm_up(model)
    before = dict(kv_slots.TRACES)
    producer.generate(model, records, jax.random.key(2))
    assert dict(kv_slots.TRACES) == before


def test_top_k_top_p_episodes_record_the_policys_log_probs(model):
    """sampling.top_k / top_p on the engine's episodes: every model token lies in the kept set
    of a teacher-forced forward of its episode (top-p 0.5 keeps one successor of "\n", the
    tool call, and of "4", the wrong "1"), and the recorded log-probs are those of logits / T,
    the policy the learner recomputes, to 1e-5."""
    engine = engine_sampler.EngineSampler(model, slots=4, decode=TOK.decode)
    episodes = _generate(engine, model, temperature=0.8, top_k=3, top_p=0.5, num_samples=4)
    for e in episodes:
        mask = np.array(e.mask, bool)
        np.testing.assert_allclose(np.array(e.logp)[mask],
                                   _teacher_forced(model, e.tokens, 0.8)[mask], atol=1e-5)
        for before, after in (("\n", "<tool_call>"), ("4", "1")):
            sampled = {b for a, b, m in zip(e.tokens, e.tokens[1:], mask[1:])
                       if m and a == TOK.ids[before]}
            assert sampled <= {TOK.ids[after]}, (before, sampled)
    assert all(e.tool_calls > 0 for e in episodes[:4] + episodes[8:])  # prompts ending "\n"
    assert not any(v.passed for e in episodes for v in e.verdicts)  # always 41



def test_interrupted_episodes_record_each_tokens_version(model):
    """rl.interrupt through rollout.Tasks: the swap forced after round 1 (4 decode steps;
    the same weights published as version 4, so the episodes are those of an uninterrupted
    run): every model token of the batch has a version, 3 before its row's swap and 4
    after, and nothing else has one."""
    from ptrain.generate import interrupt
    config = config_lib.defaults(closed_loop=True)
    config.sampling.update(engine=True, engine_slots=4, num_samples=2, max_new_tokens=8,
                           stop_token_ids=(EOS,))
    config.rollout.update(max_turns=3, max_len=120)
    sampler = rollout.make_sampler(model, config, TOK)
    producer = rollout.Tasks(sampler, TOK, config, pool=None)
    records = [tasks.to_record(t) for t in TASKS]
    plain = producer.score(producer.generate(model, records, jax.random.key(1)))
    switch = interrupt.Switch(every=4, at_round=1)
    switch.publish(4, model)
    batch = producer.score(producer.generate(interrupt.Live(model, 3, switch), records,
                                             jax.random.key(1)))
    np.testing.assert_array_equal(batch.tokens_bn, plain.tokens_bn)
    v_bn = batch.versions_bn
    np.testing.assert_array_equal(v_bn != interrupt.UNSAMPLED, batch.loss_mask_bn > 0)
    assert set(np.unique(v_bn[batch.loss_mask_bn > 0]).tolist()) == {3, 4}
    for row in v_bn:  # 3s, then 4s
        sampled = row[row != interrupt.UNSAMPLED].tolist()
        assert sampled == sorted(sampled)
    assert plain.versions_bn is None
