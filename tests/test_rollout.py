"""Multi-turn episodes: token in / token out, loss masks, caps, malformed tool calls, retries.

The model is replaced by a scripted sampler (each row's next turn is a function of its history)
so that every token of an episode is known in advance; tools and verdicts are the real
sandbox's.
"""

import numpy as np
import pytest

from ptrain import learner, rewards, rollout, tasks
from ptrain.sampler import Samples
from ptrain.synthetic_tasks import EOS, WordTokenizer

pytestmark = pytest.mark.xdist_group("sandbox")

TOK = WordTokenizer.for_tasks()
FMT = rollout.ChatFormat()
ARITH = tasks.Task("a1", "arith", tasks.Answer("42", numeric=True),
                   prompt="arith: 6 times 7 = ? (python)\n", tools=("python",))
CALL = '<tool_call>{"name":"python","arguments":{"code":"print(6*7)"}}</tool_call>'


class ScriptedSampler:
    """Returns, for each history, the turn `script(history_text)` as token ids; the sampled
    log-prob of a token is -(its index in the turn + 1) / 100, so misalignment shows."""

    def __init__(self, script):
        self.script = script
        self.calls = []

    def sample(self, params, prompts, *, max_new_tokens, num_samples=1, stop_token_ids=(),
               stop_strings=(), key=None, **kwargs):
        del params, key, kwargs
        self.calls.append({"rows": len(prompts) * num_samples, "stop_ids": stop_token_ids,
                           "stop_strings": stop_strings, "max_new_tokens": max_new_tokens})
        rows = [p for p in prompts for _ in range(num_samples)]
        turns = [TOK.encode(self.script(TOK.decode(row))) for row in rows]
        n = len(rows)
        tokens = np.zeros((n, max_new_tokens), np.int32)
        logp = np.zeros((n, max_new_tokens), np.float32)
        lengths = np.zeros(n, np.int32)
        for i, turn in enumerate(turns):
            turn = turn[:max_new_tokens]
            tokens[i, :len(turn)] = turn
            logp[i, :len(turn)] = -(np.arange(len(turn)) + 1) / 100
            lengths[i] = len(turn)
        return Samples(tokens=tokens, logp=logp, logp_temp=logp, logp_t1=logp, lengths=lengths,
                       finish_reasons=["stop"] * n,
                       prompt_index=np.repeat(np.arange(len(prompts)), num_samples))


def _generate(script, task_list, *, score=True, **config):
    sampler = ScriptedSampler(script)
    cfg = rollout.RolloutConfig(**{"num_samples": 1, "max_new_tokens": 64, "max_len": 256,
                                   "stop_token_ids": (EOS,), **config})
    episodes = rollout.generate(sampler, None, task_list, tokenizer=TOK, key=_key(),
                                config=cfg)
    if score:
        rollout.score(episodes)
    return episodes, sampler, cfg


def _key():
    import jax
    return jax.random.key(0)


def _turns(*texts):
    """script: the i-th model turn of an episode is texts[i] (by counting its earlier turns)."""
    def script(history):
        return texts[history.count("<tool_response>") + history.count("<feedback>")]
    return script


def test_token_in_token_out_and_loss_mask():
    answer = "answer: 42\n<eos>"
    [e], sampler, cfg = _generate(_turns(CALL, answer), [ARITH])
    prompt = TOK.encode(ARITH.prompt)
    observation = TOK.encode(FMT.observation.format(output="42\n"))
    turn1, turn2 = TOK.encode(CALL), TOK.encode(answer)
    # The history is exactly the pieces each party produced, concatenated, never re-tokenised.
    assert e.tokens == prompt + turn1 + observation + turn2
    assert e.mask == [0] * len(prompt) + [1] * len(turn1) + [0] * len(observation) + \
        [1] * len(turn2)
    expected_logp = [0.0] * len(prompt) + [-(i + 1) / 100 for i in range(len(turn1))] + \
        [0.0] * len(observation) + [-(i + 1) / 100 for i in range(len(turn2))]
    np.testing.assert_allclose(e.logp, expected_logp, rtol=1e-6)
    assert (e.turns, e.tool_calls, e.tool_errors, e.finish) == (2, 1, 0, "answered")
    assert e.verdicts[-1].passed and e.reward(cfg) == 1.0
    assert e.session is None  # the work dir is removed once the episode is scored
    # A closing tag that is one token stops on the device, not through stop strings.
    assert TOK.ids["</tool_call>"] in sampler.calls[0]["stop_ids"]
    assert sampler.calls[0]["stop_strings"] == ()
    # The learner gets the same tokens, masks and log-probs, split at the prompt.
    batch = learner.Episodes.from_histories(**rollout.to_rows([e], cfg),
                                            prompt_lens=[len(prompt)], prompt_len=32,
                                            length=128)
    n = batch.lengths_b[0]
    assert batch.tokens_bn[0, :n].tolist() == e.tokens[len(prompt):]
    assert batch.loss_mask_bn[0, :n].tolist() == e.mask[len(prompt):]
    assert batch.meta[0]["domain"] == "arith" and batch.rewards_b[0] == 1.0


@pytest.mark.parametrize("turn, error", [
    ("<tool_call>{not json}</tool_call>", "Error: the tool call is not valid JSON"),
    ('<tool_call>{"name":"rm","arguments":{}}</tool_call>', "Error: tool 'rm' is not available"),
    ('<tool_call>{"name":"bash","arguments":{"command":"ls"}}</tool_call>',
     "Error: tool 'bash' is not available here; use one of: python"),
    ('<tool_call>{"name":"python","arguments":{"source":"1"}}</tool_call>',
     "Error: bad arguments for python: missing 'code'"),
    ('<tool_call>["python"]</tool_call>', "Error: a tool call is"),
])
def test_malformed_tool_calls_become_error_observations(turn, error):
    [e], _, _ = _generate(_turns(turn, "answer: 42\n<eos>"), [ARITH])
    text = TOK.decode(e.tokens)
    assert error in text
    assert e.tool_errors == 1 and e.finish == "answered" and e.verdicts[-1].passed


def test_caps():
    # Out of turns: the model keeps calling tools.
    [e], _, cfg = _generate(_turns(CALL, CALL, CALL, CALL), [ARITH], max_turns=2)
    assert e.finish == "max_turns" and e.turns == 2 and e.reward(cfg) == 0.0
    # Out of room: the episode is cut at max_len tokens after the prompt.
    [e], _, _ = _generate(_turns(CALL, "answer: " + "4" * 80 + "\n<eos>"), [ARITH], max_len=60,
                          max_new_tokens=48)
    assert e.finish == "max_len" and len(e.tokens) - e.prompt_len == 60
    # Tool output is clipped to max_tool_output_chars.
    flood = '<tool_call>{"name":"python","arguments":{"code":"print(7 * 10000)"}}</tool_call>'
    flood = flood.replace("7 * 10000", "'x' * 5000")
    [e], _, _ = _generate(_turns(flood, "answer: 42\n<eos>"), [ARITH],
                          max_tool_output_chars=200)
    observation = TOK.decode(e.tokens).split("<tool_response>")[1].split("</tool_response>")[0]
    assert len(observation) <= 200 + 2 and "characters omitted" in observation


@pytest.mark.parametrize("mode, expected", [("final", 1.0), ("first", 0.0), ("mean", 0.5),
                                            ("discounted", 0.5)])
def test_self_correction(mode, expected):
    script = _turns(CALL, "answer: 41\n<eos>", "answer: 42\n<eos>")
    [e], _, cfg = _generate(script, [ARITH], max_attempts=2, attempt_reward=mode)
    assert [v.passed for v in e.verdicts] == [False, True]
    feedback = TOK.encode(FMT.feedback.format(feedback=e.verdicts[0].feedback))
    start = next(i for i in range(len(e.tokens)) if e.tokens[i:i + len(feedback)] == feedback)
    assert e.mask[start:start + len(feedback)] == [0] * len(feedback)  # feedback is not trained
    assert e.reward(cfg) == expected


def test_work_dir_persists_within_an_episode_and_not_across():
    task = tasks.Task("f1", "files", tasks.Files({"notes.txt": "hi"}), prompt="write notes\n",
                      tools=("write_file", "read_file"))
    write = '<tool_call>{"name":"write_file","arguments":{"path":"notes.txt","content":"hi"}}' \
            '</tool_call>'
    read = '<tool_call>{"name":"read_file","arguments":{"path":"notes.txt"}}</tool_call>'

    def script(history):  # row 0 writes then reads; row 1 only reads
        n = history.count("<tool_response>")
        if "first" in history:
            return [write, read, "done\n<eos>"][n]
        return [read, "done\n<eos>"][n]

    first = tasks.Task("f1", "files", task.verifier, prompt="first\n", tools=task.tools)
    second = tasks.Task("f2", "files", task.verifier, prompt="second\n", tools=task.tools)
    (a, b), _, _ = _generate(script, [first, second])
    assert TOK.decode(a.tokens).count("hi") >= 2  # written, then read back in a later turn
    assert "Error: cannot read notes.txt" in TOK.decode(b.tokens)
    assert a.verdicts[-1].passed and not b.verdicts[-1].passed


def test_groups_share_their_prompt():
    episodes, sampler, cfg = _generate(_turns(CALL, "answer: 42\n<eos>"), [ARITH, ARITH],
                                       num_samples=3)
    assert sampler.calls[0]["rows"] == 6  # one prefill per task, 3 samples each
    assert [e.group_id for e in episodes] == [0, 0, 0, 1, 1, 1]
    rows = rollout.to_rows(episodes, cfg)
    batch = learner.Episodes.from_histories(**rows, prompt_lens=[e.prompt_len for e in episodes],
                                            prompt_len=32, length=128)
    batch.check_groups(3)


def test_parse_tool_call():
    assert rollout.parse_tool_call("no call here") is None
    assert rollout.parse_tool_call(CALL) == ("python", {"code": "print(6*7)"})
    assert rollout.parse_tool_call('<tool_call>{"name": "python", "arguments": '
                                   '"{\\"code\\": \\"1\\"}"}</tool_call>') == \
        ("python", {"code": "1"})
    assert "not closed" in rollout.parse_tool_call("<tool_call>{")
    assert rewards.extract_answer("answer:") == ""
