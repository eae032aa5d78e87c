"""The README's Python example of the main job runs as written, cut to one small step: the
closed loop on a built-in environment and the SQL worked example (examples/sql_env.py), both
named by import path."""

import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.xdist_group("closed_loop")


def _block(title: str) -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    after = text[text.index(title):]
    return re.search(r"```python\n(.*?)```", after, re.DOTALL).group(1)


def test_the_main_job_from_python(tmp_path, capsys):
    code = _block("## The main job from Python")
    assert len(code.strip().splitlines()) <= 16
    for pattern, cut in ((r'"steps": \d+', '"steps": 1'), (r"n_train=\d+", "n_train=8"),
                         (r"n_heldout=\d+", "n_heldout=2"),
                         ('"rollout.max_len": 48,', '"rollout.max_len": 48, "data.prompts_per_step"'
                          ': 2, "sampling.num_samples": 4, "rl.num_minibatches": 1, '
                          '"sandbox.backend": "process", "checkpoint.async_save": False,'),
                         ('"runs/from_python"', repr(str(tmp_path)))):
        code, n = re.subn(pattern, cut, code)
        assert n >= 1, pattern
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in printed] == [["rl", "code"], ["rl", "sql"]]
    assert all(re.fullmatch(r"rl \w+ pass@1 \d\.\d\d", line) for line in printed)
    from ptrain import metrics
    rows = metrics.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1]
    assert {"reward/code/mean", "reward/sql/mean"} <= set(rows[0])
    with open(os.path.join(tmp_path, "tasks", "sql.heldout.jsonl")) as f:
        held = [json.loads(line) for line in f]
    assert len(held) == 2 and held[0]["verifier"]["kind"] == "examples.sql_env:Rows"
