"""Bring your own model, end to end: `launch/train.py` on configs/byo_qwen.py with a Hugging Face
directory (tests/hf_fixtures: a tiny random Qwen2.5-style model, its byte-level BPE tokenizer
and the real Qwen2.5 chat template), HumanEval- and GSM8K-format task files, and the python
tool (multi-turn episodes). The steps run; the brought model is evaluated at step 0 and after
RL, greedy and sampled; the rollouts' prompts are the template's rendering, tools included.
(tests/test_rollout.py drives the same formats with a scripted policy that answers correctly
and gets reward 1.)"""

import json
import os
import subprocess
import sys

import pytest

from ptrain import chat, hf, metrics, tasks

pytestmark = pytest.mark.xdist_group("closed_loop")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
        "steps": 2, "data.prompts_per_step": 2, "data.max_prompt_len": 1024,
        "sampling.num_samples": 2, "sampling.max_new_tokens": 12, "rollout.max_len": 40,
        "rollout.max_turns": 2, "rl.num_minibatches": 1, "rl.microbatch_size": 0,
        "model.remat": "none", "mesh.fsdp": 1,
        "eval.n": 2, "sandbox.workers": 1, "sandbox.backend": "process",
        "checkpoint.every": 1, "log.rollouts_every": 1,
        "tasks.train": ((files["humaneval"], "humaneval"), (files["gsm8k"], "gsm8k")),
        "tasks.heldout": ((held["humaneval"], "humaneval"), (gsm_held, "gsm8k")),
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
