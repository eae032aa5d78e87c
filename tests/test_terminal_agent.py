"""ptrain/envs/terminal/agent.py: a model acting through its chat format's tool calls in a task's
persistent shell. A scripted policy (fixed token ids, parsed by the same path as a model's)
solves bundled tasks on docker; a fake episode checks the turn loop without docker; a tiny
random Hugging Face model runs end to end through `launch.eval --agent=model`."""

import json
import os
import shutil

import pytest

from ptrain import chat
from ptrain.envs.terminal import agent as terminal_agent
from sandbox.terminal.shell import ShellResult
from tests.test_terminal_load import TASKS_DIR


@pytest.fixture(scope="module")
def qwen(hf_dir):
    from ptrain import hf
    path = hf_dir("qwen2.5-instruct")
    tok = hf.load_tokenizer(path)
    return path, tok, chat.stop_ids(chat.QWEN, tok, eos_sources=hf.eos_token_ids(path))


def scripted(tok, turns):
    """A policy that answers with `turns` in order: each the text of a model turn, encoded
    and closed with <|im_end|> (a model's turn as sampled), log-prob -1 per token."""
    eot = chat.token_id(tok, "<|im_end|>")
    queue = [chat.encode(tok, t) + [eot] for t in turns]
    seen = []

    def policy(ids):
        seen.append(list(ids))
        new = queue.pop(0)
        return new, [-1.0] * len(new)
    policy.seen = seen
    return policy


def bash_turn(command, content=""):
    return chat.format_turn(chat.QWEN, content, [chat.ToolCall("bash", {"command": command})])


class FakeEpisode:
    """What ShellAgent uses of an Episode: instruction, turns, note, run."""

    def __init__(self, outputs=()):
        self.instruction, self.turns, self.transcript = "List the files.", 0, []
        self.outputs, self.commands = list(outputs), []

    def note(self, role, text):
        self.transcript.append({"role": role, "text": text})

    def run(self, command, timeout_s=None):
        self.commands.append(command)
        self.transcript.append({"command": command})
        return ShellResult(self.outputs.pop(0), 0, False, False, 0.01)


def test_turn_loop_runs_calls_reports_errors_and_masks_model_tokens(qwen):
    _, tok, stop = qwen
    turns = [bash_turn("ls /app", "Let me look."),
             '<tool_call>\n{"name": "bash", "arguments": {"command": 5}}\n</tool_call>',
             '<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n</tool_call>',
             "<tool_call>\nnot json\n</tool_call>",
             "Done."]
    policy = scripted(tok, turns)
    agent = terminal_agent.ShellAgent(policy, tok, chat.QWEN, stop_ids=stop, max_turns=8)
    ep = FakeEpisode(["a.txt\nb.txt\n"])
    tokens = agent(ep)
    assert ep.commands == ["ls /app"] and ep.turns == 5 and tokens.finish == "answered"
    assert [s["text"] for s in ep.transcript if "role" in s] == turns
    # The second turn's prompt is the first's history plus the observation, token for token.
    obs = tok.decode(policy.seen[1][len(policy.seen[0]):], skip_special_tokens=False)
    assert "a.txt\nb.txt\n[exit status 0]" in obs and "Let me look." in obs
    history = tok.decode(tokens.tokens, skip_special_tokens=False)
    assert "'command' must be a string" in history  # the tool's schema, checked
    assert "tool 'python' is not available here" in history
    assert "not valid JSON" in history
    model_ids = [i for i, m in zip(tokens.tokens, tokens.mask) if m]
    assert model_ids == sum((chat.encode(tok, t) + [stop[0]] for t in turns), [])
    assert all(lp == -1.0 for lp, m in zip(tokens.logp, tokens.mask) if m)
    assert tokens.tokens[:tokens.prompt_len] == terminal_agent.render_prompt(
        chat.QWEN, tok, ep.instruction)
    rendered = tok.decode(tokens.tokens[:tokens.prompt_len], skip_special_tokens=False)
    assert '"name": "bash"' in rendered and "List the files." in rendered  # the schema


def test_turn_loop_stops_at_max_turns_and_max_len(qwen):
    _, tok, stop = qwen
    loop = [bash_turn("true")] * 3
    agent = terminal_agent.ShellAgent(scripted(tok, loop), tok, chat.QWEN, stop_ids=stop,
                                      max_turns=3)
    ep = FakeEpisode([""] * 3)
    assert agent(ep).finish == "max_turns" and ep.commands == ["true"] * 3
    short = terminal_agent.ShellAgent(scripted(tok, loop), tok, chat.QWEN, stop_ids=stop,
                                      max_len=10)
    ep = FakeEpisode([""] * 3)
    tokens = short(ep)
    assert tokens.finish == "max_len" and ep.commands == []
    assert len(tokens.tokens) - tokens.prompt_len == 10


def test_an_answer_cut_at_max_new_tokens_is_truncated_not_answered(qwen):
    """A final turn that ends without a stop id (the sampler's cap cut it) finishes
    "truncated", as in the closed loop's episodes (evaluations count it, dapo.filter_overlong
    masks it)."""
    _, tok, stop = qwen

    def cut(ids):
        new = chat.encode(tok, "The files are a.txt and")  # no <|im_end|>: cut short
        return new, [-1.0] * len(new)
    agent = terminal_agent.ShellAgent(cut, tok, chat.QWEN, stop_ids=stop)
    assert agent(FakeEpisode()).finish == "truncated"
    agent = terminal_agent.ShellAgent(scripted(tok, ["Done."]), tok, chat.QWEN, stop_ids=stop)
    assert agent(FakeEpisode()).finish == "answered"


def test_detect_format_by_tokenizer_family(hf_dir):
    from ptrain import hf
    assert terminal_agent.detect_format(hf.load_tokenizer(hf_dir("qwen2.5-instruct"))) is chat.QWEN
    assert terminal_agent.detect_format(
        hf.load_tokenizer(hf_dir("llama3.1-instruct"))) is chat.LLAMA3


# --- on docker ----------------------------------------------------------------------------------

def _docker():
    from tests.test_terminal import _REASON
    if _REASON is not None:
        pytest.skip(_REASON)
    from sandbox import terminal
    return terminal


@pytest.mark.xdist_group("terminal")
def test_scripted_policy_solves_bundled_tasks_through_tool_calls(qwen, tmp_path):
    terminal = _docker()
    _, tok, stop = qwen
    tasks = {t.name: t for t in terminal.load_tasks(TASKS_DIR).tasks}
    with terminal.Harness() as h:
        for name, script in (("hello-file", "solution/solve.sh"),
                             ("fix-word-count", "solution.sh")):
            with open(os.path.join(TASKS_DIR, name, script)) as f:
                solution = f.read()
            agent = terminal_agent.ShellAgent(
                scripted(tok, [bash_turn("cd /tmp && pwd"), bash_turn(solution), "Done."]),
                tok, chat.QWEN, stop_ids=stop)
            row, transcript = terminal.run_attempt(h, tasks[name], agent, 0)
            assert row["reward"] == 1.0 and row["error"] is None, row["feedback"]
            assert row["turns"] == 3 and row["tool_calls"] == 2 and row["agent"] == "model"
            steps = transcript["steps"]
            assert [("role" in s) for s in steps] == [True, False, True, False, True]
            assert steps[1]["output"] == "/tmp\n"
        wrong = terminal_agent.ShellAgent(
            scripted(tok, [bash_turn("echo hi > /app/hello.txt"), "Done."]), tok, chat.QWEN,
            stop_ids=stop)
        row, _ = terminal.run_attempt(h, tasks["hello-file"], wrong, 0)
        assert row["reward"] == 0.0 and row["failures"]


@pytest.mark.xdist_group("terminal")
def test_cli_model_agent_with_a_tiny_hf_model(qwen, tmp_path):
    _docker()
    from tests.test_eval import read_rows, run_eval, write_jsonl, MBPP
    path = qwen[0]
    tasks = tmp_path / "tasks"
    shutil.copytree(os.path.join(TASKS_DIR, "hello-file"), tasks / "hello-file")
    out = str(tmp_path / "model")
    run_eval(f"--tasks={tasks}", "--agent=model", f"--model={path}", f"--out={out}",
             "--max_turns=2", "--max_new_tokens=12", "--attempts=2")
    rows = read_rows(out)
    assert len(rows) == 2 and all(r["reward"] == 0.0 and r["agent"] == "model" for r in rows)
    assert all(1 <= r["turns"] <= 2 for r in rows)
    with open(os.path.join(out, "transcripts", "hello-file", "0.json")) as f:
        steps = json.load(f)["steps"]
    assert steps and steps[0]["role"] == "model"
    code = str(tmp_path / "code")
    run_eval(f"--tasks={write_jsonl(tmp_path / 'mbpp.jsonl', MBPP)}", "--agent=model",
             f"--model={path}", f"--out={code}", "--max_new_tokens=8")
    rows = read_rows(code)
    assert [r["reward"] for r in rows] == [0.0, 0.0] and all(r["turns"] == 1 for r in rows)


def test_cli_model_agent_from_a_training_run_workdir(hf_dir, tmp_path):
    """--model=WORKDIR: the run's latest checkpoint, exported (launch/export.py), answers."""
    import jax
    import optax
    from flax import nnx
    from ptrain import checkpoint, closed_loop, hf, metrics
    from tests.test_eval import MBPP, read_rows, run_eval, write_jsonl
    source = hf_dir("qwen2.5-instruct")
    workdir = str(tmp_path / "run")
    config = closed_loop.defaults()
    config.hf_model, config.rollout.chat_format = source, "qwen"
    metrics.write_run_record(workdir, config, ["launch/train.py", "--config=byo.py"])
    _, params = nnx.split(hf.load(source)[0])
    with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False) as c:
        c.save(4, params=params, opt_state=optax.adam(1e-3).init(params),
               rng=jax.random.key(0), extra={"kl_coef": 0.0})
    out = str(tmp_path / "eval")
    p = run_eval(f"--tasks={write_jsonl(tmp_path / 'mbpp.jsonl', MBPP)}", "--agent=model",
                 f"--model={workdir}", f"--out={out}", "--max_new_tokens=4", "--greedy")
    assert "rl checkpoint exported" in p.stderr
    assert os.path.isfile(os.path.join(out, "model", "config.json"))
    assert [r["agent"] for r in read_rows(out)] == ["model", "model"]
