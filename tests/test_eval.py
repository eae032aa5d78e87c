"""launch/eval.py: the command line on terminal tasks (docker) and on code / math task files,
its files (results.jsonl, summary.json, transcripts) and the HTML report."""

import html.parser
import json
import os
import shutil
import subprocess
import sys

import pytest

import multiprocess  # (tests/)
from sandbox.terminal import report
from sandbox.terminal.evaluate import summarize, transcript_path, write_transcript
from tests.test_terminal_load import TASKS_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_eval(*args):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "launch.eval", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def read_rows(out):
    with open(os.path.join(out, "results.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


class _Tags(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.ids, self.hrefs = [], set(), []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if "href" in attrs:
            self.hrefs.append(attrs["href"])


def parse(page):
    p = _Tags()
    p.feed(page)
    return p


# --- terminal tasks through the command line (docker) -------------------------------------------

@pytest.mark.xdist_group("terminal")
def test_cli_oracle_and_nop_on_bundled_terminal_tasks(tmp_path):
    from tests.test_terminal import _REASON
    if _REASON is not None:
        pytest.skip(_REASON)
    tasks = tmp_path / "tasks"
    for name in ("hello-file", "fix-word-count"):  # one Harbor task, one TB 1.0 task
        shutil.copytree(os.path.join(TASKS_DIR, name), tasks / name)
    out = str(tmp_path / "oracle")
    p = run_eval(f"--tasks={tasks}", "--agent=oracle", f"--out={out}", "--attempts=2")
    assert "4/4" in p.stderr  # the progress bar
    assert "pass@1 1.000, pass@2 1.000" in p.stdout
    rows = read_rows(out)
    assert sorted((r["task"], r["attempt"]) for r in rows) == [
        ("fix-word-count", 0), ("fix-word-count", 1), ("hello-file", 0), ("hello-file", 1)]
    for r in rows:
        assert r["reward"] == 1.0 and r["passed"] and r["tool_calls"] == 1 and r["turns"] == 1
        assert r["time_s"] > 0 and "tests passed" in r["feedback"]
    s = read_summary(out)
    assert s["pass@1"] == s["pass@2"] == 1.0
    assert s["categories"] == {"debugging": {"tasks": 1, "pass@1": 1.0},
                               "file-operations": {"tasks": 1, "pass@1": 1.0}}
    page = open(os.path.join(out, "report.html")).read()
    tags = parse(page)
    assert "script" not in tags.tags and "link" not in tags.tags  # self-contained
    assert all(h.startswith("#") and h[1:] in tags.ids for h in tags.hrefs)  # links resolve
    assert len([h for h in tags.hrefs if h.startswith("#a-")]) == 4  # one per attempt
    assert "bash /solution/solution.sh" in page and "fix-word-count" in page

    nop = str(tmp_path / "nop")
    p = run_eval(f"--tasks={tasks}", "--agent=nop", f"--out={nop}")
    rows = read_rows(nop)
    assert [r["reward"] for r in rows] == [0.0, 0.0] and read_summary(nop)["pass@1"] == 0.0
    assert all(r["tool_calls"] == 0 for r in rows)
    assert "test_counts_words" in open(os.path.join(nop, "report.html")).read()  # feedback


# --- code and math task files -------------------------------------------------------------------

MBPP = [{"task_id": 1, "text": "Write a function to add two numbers.",
         "code": "def add(a, b):\n    return a + b\n",
         "test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]},
        {"task_id": 2, "text": "Write a function to reverse a string.",
         "code": "def rev(s):\n    return s[::-1]\n", "test_list": ["assert rev('ab') == 'ba'"]}]
GSM8K = [{"question": "Ann has 3 apples and buys 4 more. How many?",
          "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}]


def write_jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


@pytest.mark.xdist_group("terminal")
def test_cli_model_agent_on_a_word_tokenizer_run(tmp_path):
    """--agent=model on the work dir of a run on the word tokenizer (configs/terminal_toy.py,
    a few SFT steps): its checkpoint exported, acting with the run's own tokenizer, chat
    format and system prompt (none: the bare instruction, as it was trained)."""
    from tests.test_terminal import _REASON
    if _REASON is not None:
        pytest.skip(_REASON)
    work, out = str(tmp_path / "run"), str(tmp_path / "eval")
    # One CPU device: the run's sharding is not what this test is about (8 devices: 47 s).
    env = multiprocess.env_for(1)
    p = subprocess.run([sys.executable, "-m", "launch.train",
                        "--config=configs/terminal_toy.py:short", "--config.steps=0",
                        "--config.sft.steps=4", "--config.tasks.envs=({'env': "
                        "'ptrain.envs.terminal:make', 'args': {'n_train': 8, 'n_heldout': 2}},)",
                        "--config.eval.n=2", f"--workdir={work}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    run_eval(f"--tasks={work}/tasks/terminal/heldout", "--agent=model", f"--model={work}",
             f"--out={out}", "--greedy", "--max_turns=2", "--max_new_tokens=8", "--max_len=96")
    assert not os.path.exists(os.path.join(out, "model", "tokenizer.json"))  # none to write
    rows = read_rows(out)
    assert len(rows) == 2
    for row in rows:
        assert row["error"] is None and row["turns"] >= 1 and row["reward"] in (0.0, 1.0), row
        with open(transcript_path(out, row["task"], row["attempt"])) as f:
            steps = json.load(f)["steps"]
        assert steps and steps[0]["role"] == "model"


def test_cli_code_tasks_oracle_passes_nop_fails_and_resumes(tmp_path):
    mbpp = write_jsonl(tmp_path / "mbpp.jsonl", MBPP)
    gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    out = str(tmp_path / "oracle")
    p = run_eval(f"--tasks={mbpp}", "--agent=oracle", f"--out={out}", "--attempts=2")
    assert "4/4" in p.stderr
    rows = read_rows(out)
    assert sorted((r["task"], r["attempt"]) for r in rows) == [
        ("mbpp/1", 0), ("mbpp/1", 1), ("mbpp/2", 0), ("mbpp/2", 1)]
    assert all(r["reward"] == 1.0 and r["layout"] == "mbpp" and r["category"] == "code"
               for r in rows)
    assert read_summary(out)["pass@2"] == 1.0
    # Again with one more attempt: only the new attempt runs.
    run_eval(f"--tasks={mbpp}", "--agent=oracle", f"--out={out}", "--attempts=3")
    assert len(read_rows(out)) == 6 and read_summary(out)["pass@3"] == 1.0

    nop = str(tmp_path / "nop")
    run_eval(f"--tasks={mbpp}", "--format=mbpp", "--agent=nop", f"--out={nop}")
    rows = read_rows(nop)
    assert [r["reward"] for r in rows] == [0.0, 0.0] and all(r["error"] for r in rows)
    assert "NameError" in open(os.path.join(nop, "report.html")).read()  # the feedback

    gs = str(tmp_path / "gsm8k")
    run_eval(f"--tasks={gsm8k}", "--agent=oracle", f"--out={gs}")
    assert [r["reward"] for r in read_rows(gs)] == [1.0]


def test_cli_rejects_a_format_that_does_not_match_the_file(tmp_path):
    mbpp = write_jsonl(tmp_path / "mbpp.jsonl", MBPP)
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-m", "launch.eval", f"--tasks={mbpp}",
                        "--format=gsm8k", "--agent=nop", f"--out={tmp_path / 'o'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "read the file with format 'mbpp'" in p.stderr


def test_oracle_of_a_record_without_a_reference_is_an_error_row(tmp_path):
    from ptrain import code_eval
    records = [dict(MBPP[0])]
    del records[0]["code"]
    items = code_eval.load(write_jsonl(tmp_path / "m.jsonl", records))
    s = code_eval.evaluate(items, code_eval.oracle, str(tmp_path / "o"))
    (row,) = read_rows(str(tmp_path / "o"))
    assert s["pass@1"] == 0.0 and "no reference solution" in row["error"]


# --- the report ---------------------------------------------------------------------------------

def test_report_escapes_everything_and_links_each_attempt(tmp_path):
    out = str(tmp_path)
    evil = "<script>alert('x')</script>"
    rows = []
    for task, attempt, passed in (("t<b>1", 0, True), ("t<b>1", 1, False), ("plain", 0, False)):
        rows.append({"task": task, "attempt": attempt, "agent": "model", "category": evil,
                     "reward": float(passed), "passed": passed, "time_s": 1.5, "turns": 2,
                     "tool_calls": 1, "error": None if passed else evil, "feedback": evil})
        write_transcript(out, {"task": task, "attempt": attempt, "instruction": evil,
                               "steps": [{"role": "model", "text": evil},
                                         {"command": evil, "output": evil + "\x1b[31m",
                                          "exit_code": 1, "timed_out": False,
                                          "duration_s": 0.1, "restarted": False}]})
    with open(os.path.join(out, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summarize(rows, 2), f)
    page = open(report.write_html(out, title=evil)).read()
    tags = parse(page)
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "script" not in tags.tags and "t&lt;b&gt;1" in page
    assert "\x1b" not in page and "\\x1b[31m" in page  # control characters shown, not sent
    assert sorted(h for h in tags.hrefs if h.startswith("#a-")) == sorted(
        "#" + report._anchor(r["task"], r["attempt"]) for r in rows)
    assert all(h[1:] in tags.ids for h in tags.hrefs)
    assert page.count("<details id=") == 3
    assert "pass@1" in page and "pass@2" in page


# --- environment failures: said on the console, exit status 2 -------------------------------


def test_environment_failures_are_told_apart_from_the_agents():
    from ptrain import eval_failures
    rows = [
        {"task": "a", "error": "ImageError: Dockerfile:1: image 'python:3.12-slim' is not "
         "present locally; ...", "turns": 0, "time_s": 0.1},  # never started
        {"task": "b", "error": "no pytest results in the output (did the tests run?)",
         "verify_time_s": 1.0, "feedback": "reward 0\n/usr/bin/python3: No module named pytest"},
        {"task": "c", "error": None, "verify_time_s": 1.0, "feedback": "reward 0: 0 of 2"},
        {"task": "d", "error": "the agent failed: ValueError: x", "verify_time_s": 1.0,
         "feedback": "reward 0"},  # the agent's own failure
    ]
    found = eval_failures.environment(rows)
    assert [(f["example"], f["attempts"]) for f in found] == [("a", 1), ("b", 1)]
    assert "--image_map=FROM=LOCAL" in found[0]["fix"] and "pytest is part of its install" in found[1]["fix"]
    text = eval_failures.report(found, total=4)
    assert text.startswith("2 of 4 attempts failed for an environment reason")
    assert "docker SDK" in eval_failures.fix("No module named 'docker'")


@pytest.mark.xdist_group("terminal")
def test_cli_a_missing_image_is_said_with_its_fix_and_exits_2(tmp_path):
    from tests.test_terminal import _REASON
    if _REASON is not None:
        pytest.skip(_REASON)
    task = tmp_path / "tasks" / "hello-file"
    shutil.copytree(os.path.join(TASKS_DIR, "hello-file"), task)
    dockerfile = task / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace("FROM ptrain-term-base:latest",
                                                         "FROM python:3.12-slim"))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "launch.eval", f"--tasks={tmp_path / 'tasks'}",
                        "--agent=oracle", f"--out={tmp_path / 'out'}"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "1 of 1 attempts failed for an environment reason" in p.stderr
    assert "'python:3.12-slim' is not present locally" in p.stderr
    assert "fix: the task's image is not on this machine" in p.stderr


def test_cli_without_the_docker_sdk_says_which_extra_to_install(tmp_path):
    """As after `make install` alone: `import docker` fails (blocked here in the process)."""
    tasks = tmp_path / "tasks"
    shutil.copytree(os.path.join(TASKS_DIR, "hello-file"), tasks / "hello-file")
    program = ("import sys; sys.modules['docker'] = None\n"
               "from absl import app\nfrom launch import eval as e\napp.run(e.main)\n")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", program, f"--tasks={tasks}", "--agent=oracle",
                        f"--out={tmp_path / 'out'}"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "pip install -e ." in out, out[-3000:]
    assert "Traceback" not in out
