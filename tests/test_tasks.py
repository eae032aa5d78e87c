"""Tasks: JSON round trips, the public-format loaders, clear errors on bad records."""

import json
import re

import pytest

from ptrain import data, tasks

HUMANEVAL = {
    "task_id": "HumanEval/0",
    "prompt": "def has_close_elements(numbers, threshold):\n    \"\"\"Any two closer than "
              "threshold?\"\"\"\n",
    "canonical_solution": "    return any(abs(a - b) < threshold for i, a in enumerate(numbers)"
                          " for b in numbers[i + 1:])\n",
    "test": "def check(candidate):\n    assert candidate([1.0, 2.8, 3.0], 0.3) == True\n",
    "entry_point": "has_close_elements",
}
MBPP = {"task_id": 2, "text": "Write a function to find the shared elements of two lists.",
        "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
        "test_list": ["assert set(similar_elements((3, 4), (4, 5))) == set((4,))",
                      "assert similar_elements((1,), (2,)) == ()"],
        "test_setup_code": ""}
APPS = {"problem_id": 7, "question": "Read n, print n squared.",
        "input_output": json.dumps({"inputs": ["3\n", "4\n"], "outputs": ["9\n", "16\n"]})}
APPS_CALL = {"problem_id": 8, "question": "Return the pair sorted.",
             "starter_code": "class Solution:\n    def pair(self, a, b):\n",
             "input_output": json.dumps({"fn_name": "pair", "inputs": [[2, 1], [1, 3]],
                                         "outputs": [[[1, 2]], [[1, 3]]]})}
CODE_CONTESTS = {"name": "1A_theatre", "description": "Tiles.",
                 "public_tests": {"input": ["6 6 4\n"], "output": ["4\n"]},
                 "private_tests": {"input": ["1 1 1\n"], "output": ["1\n"]},
                 "generated_tests": {"input": [], "output": []}}
GSM8K = {"question": "Tom has 3 apples and buys 4. How many?",
         "answer": "3 + 4 = <<3+4=7>>7\n#### 1,007"}
MATH = {"problem": "Compute $\\frac{1}{2}+\\frac{1}{2}$.",
        "solution": "It is $\\boxed{\\frac{2}{2}}$, i.e. \\boxed{1}.", "level": "Level 1"}


def test_every_verifier_round_trips_through_json(tmp_path):
    examples = [
        tasks.Task("a", "code", tasks.UnitTests("assert f(1) == 2", setup="import math"),
                   prompt="write f"),
        tasks.Task("b", "stdio", tasks.Stdio((("1\n", "2\n"), ("2\n", "4\n")), float_tol=1e-3),
                   messages=({"role": "user", "content": "double it"},)),
        tasks.Task("c", "math", tasks.Answer("3.5", numeric=True), prompt="7/2?",
                   tools=("python",), metadata={"level": 2}),
        tasks.Task("d", "fs", tasks.Files({"out/a.txt": "hi\n", "tmp.txt": None}),
                   prompt="make it", tools=("bash", "write_file"), files={"in.txt": "x"}),
        tasks.Task("e", "format", tasks.Format(r"^ANSWER: \d+$"), prompt="say"),
    ]
    path = str(tmp_path / "tasks.jsonl")
    assert tasks.write_jsonl(examples, path) == len(examples)
    assert tasks.read_jsonl(path) == examples
    # and they stream through the data pipeline as plain records
    batches = data.prompt_batches([path], batch_size=5, seed=0, shuffle=False,
                                  process_index=0, process_count=1)
    records = next(batches.iterator())
    assert [tasks.from_record(r) for r in records] == examples


def _jsonl(tmp_path, *records):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_humaneval_and_mbpp(tmp_path):
    [he] = tasks.load(_jsonl(tmp_path, HUMANEVAL), "humaneval")
    assert he.domain == "code" and he.prompt == HUMANEVAL["prompt"]
    assert he.verifier.tests.rstrip().endswith("check(has_close_elements)")
    assert he.verifier.prefix == HUMANEVAL["prompt"]  # the answer continues the prompt
    assert he.verifier.entry_point == "has_close_elements"
    [mb] = tasks.load(_jsonl(tmp_path, MBPP), "mbpp", domain="lists")
    assert mb.domain == "lists" and mb.id == "mbpp/2"
    assert mb.verifier.tests.splitlines() == MBPP["test_list"]
    assert all(test in mb.prompt for test in MBPP["test_list"])  # as in the MBPP paper
    sanitized = {"task_id": 3, "prompt": "Write is_not_prime(n).", "test_imports": ["import math"],
                 "test_list": ["assert is_not_prime(2) == False"]}
    [san] = tasks.load(_jsonl(tmp_path, sanitized), "mbpp")
    assert san.verifier.setup == "import math" and san.prompt.startswith("Write is_not_prime")


def test_humaneval_tests_hold_the_prompts_helpers(tmp_path):
    record = {"task_id": "HumanEval/38", "entry_point": "decode_cyclic",
              "prompt": "import math\n\n\ndef encode_cyclic(s: str):\n    return s[1:] + s[:1]"
                        "\n\n\ndef decode_cyclic(s: str):\n    \"\"\"Undo it.\"\"\"\n",
              "test": "def check(c):\n    assert c(encode_cyclic('abc')) == 'abc'\n"}
    [task] = tasks.load(_jsonl(tmp_path, record), "humaneval")
    tests = task.verifier.tests
    assert tests.startswith("import math\n\ndef encode_cyclic(s: str):")
    assert "def decode_cyclic" not in tests  # the stub is the answer's to write
    with pytest.raises(ValueError, match="the HumanEval prompt does not parse"):
        tasks.load(_jsonl(tmp_path, {**record, "prompt": "def f(:\n"}), "humaneval")


def test_every_format_has_a_name_and_ptrain_is_our_records(tmp_path):
    assert tasks.FORMATS == ("ptrain", "humaneval", "mbpp", "apps", "codecontests", "gsm8k",
                             "math")
    own = tasks.Task("a", "code", tasks.Format("x"), prompt="p")
    path = str(tmp_path / "own.jsonl")
    tasks.write_jsonl([own], path)
    assert tasks.load(path, "ptrain") == [own]
    assert tasks.load(path, "ptrain", domain="other")[0].domain == "other"
    with pytest.raises(ValueError, match="unknown task format 'jsonl'"):
        tasks.load(path, "jsonl")


@pytest.mark.parametrize("record, fmt, wrong", [
    (HUMANEVAL, "humaneval", "ptrain"), (MBPP, "mbpp", "ptrain"), (GSM8K, "gsm8k", "ptrain"),
    (MATH, "math", "ptrain"), (APPS, "apps", "ptrain"), (CODE_CONTESTS, "codecontests", "ptrain"),
    (HUMANEVAL, "humaneval", "gsm8k"),
])
def test_a_file_read_with_the_wrong_format_says_which_to_set(tmp_path, record, fmt, wrong):
    with pytest.raises(ValueError, match=rf"in.jsonl:1: .*read the file with format '{fmt}'"):
        tasks.load(_jsonl(tmp_path, record), wrong)


def test_ptrain_record_read_as_humaneval_says_ptrain(tmp_path):
    own = tasks.to_record(tasks.Task("a", "code", tasks.Format("x"), prompt="p"))
    with pytest.raises(ValueError, match="HumanEval record is missing.*format 'ptrain'"):
        tasks.load(_jsonl(tmp_path, own), "humaneval")


def test_a_config_entry_names_its_format_and_errors_name_the_key(tmp_path):
    path = _jsonl(tmp_path, HUMANEVAL)
    with pytest.raises(ValueError, match=re.escape(
            f"tasks.train[0]: {path}:1 is a humaneval record, not a ptrain task record; set "
            f"the file's format: tasks.train[0]=({path!r}, 'humaneval')")):
        tasks.load_entry(path, key="tasks.train[0]")
    loaded = tasks.load_entry((path, "humaneval"), key="tasks.train[0]", domain="code")
    assert loaded == tasks.load(path, "humaneval", domain="code")
    with pytest.raises(ValueError, match=r"tasks.heldout\[1\]=.*'jsonl'.*a \(path, format\)"):
        tasks.load_entry((path, "jsonl"), key="tasks.heldout[1]")
    bad = _jsonl(tmp_path, {"id": "a", "domain": "code", "prompt": "p",
                            "verifier": {"kind": "nope"}})
    with pytest.raises(ValueError, match=r"^tasks.train\[2\]: .*in.jsonl:1: task record needs"):
        tasks.load_entry(bad, key="tasks.train[2]")


def test_lengths_are_checked_against_the_key_that_bounds_them():
    tasks.check_lengths({"a": 3, "b": 64}, 64, key="data.max_prompt_len")
    with pytest.raises(ValueError, match=re.escape(
            "2 of 3 prompts are longer than data.max_prompt_len=64 tokens (the longest, "
            "'HumanEval/3', has 90): raise data.max_prompt_len to at least 90")):
        tasks.check_lengths({"HumanEval/1": 3, "HumanEval/2": 70, "HumanEval/3": 90}, 64,
                            key="data.max_prompt_len")
    with pytest.raises(ValueError, match="1 of 1 completions are longer than "
                                         "sft.max_completion_len=8"):
        tasks.check_lengths({"demo 0": 9}, 8, key="sft.max_completion_len", what="completion")


def test_gzipped_files_are_read(tmp_path):
    import gzip
    path = tmp_path / "he.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(HUMANEVAL) + "\n")
    assert tasks.load(str(path), "humaneval")[0].id == "HumanEval/0"


def test_stdio_formats(tmp_path):
    [apps] = tasks.load(_jsonl(tmp_path, APPS), "apps")
    assert apps.verifier.cases == (("3\n", "9\n"), ("4\n", "16\n"))
    assert "Use Standard Input format" in apps.prompt
    [call] = tasks.load(_jsonl(tmp_path, APPS_CALL), "apps")
    assert isinstance(call.verifier, tasks.UnitTests) and "Use Call-Based format" in call.prompt
    assert APPS_CALL["starter_code"] in call.prompt
    [cc] = tasks.load(_jsonl(tmp_path, CODE_CONTESTS), "codecontests")
    assert cc.verifier.cases == (("6 6 4\n", "4\n"), ("1 1 1\n", "1\n"))


def test_math_formats(tmp_path):
    [gsm] = tasks.load(_jsonl(tmp_path, GSM8K), "gsm8k")
    assert gsm.verifier == tasks.Answer("1007", numeric=True)
    assert gsm.id == tasks.load(_jsonl(tmp_path, GSM8K), "gsm8k")[0].id  # stable ids
    [math] = tasks.load(_jsonl(tmp_path, MATH), "math")
    assert math.verifier == tasks.Answer("1", latex=True)
    assert tasks.boxed("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"


@pytest.mark.parametrize("fmt, record, message", [
    ("humaneval", {"task_id": "x", "prompt": "p"}, r"in.jsonl:1: HumanEval record is missing"),
    ("gsm8k", {"question": "q", "answer": "no marker"}, r"in.jsonl:1: GSM8K answer has no"),
    ("apps", {**APPS, "input_output": json.dumps({"inputs": [], "outputs": []})},
     "has no test cases"),
])
def test_bad_public_records_name_file_and_line(tmp_path, fmt, record, message):
    with pytest.raises(ValueError, match=message):
        tasks.load(_jsonl(tmp_path, record), fmt)


def test_bad_task_records(tmp_path):
    path = tmp_path / "t.jsonl"
    good = tasks.to_record(tasks.Task("a", "code", tasks.Format("x"), prompt="p"))
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "verifier": {"kind": "vibes"}})
                    + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl:2: task record needs a verifier with a kind"):
        tasks.read_jsonl(str(path))
    with pytest.raises(ValueError, match=r"environment 'code' has no tool 'browser'; its "
                                         r"tools: python, bash, write_file, read_file"):
        from ptrain import rollout
        rollout.render_prompt(tasks.Task("a", "code", tasks.Format("x"), prompt="p",
                                         tools=("browser",)), tokenizer=None)
    with pytest.raises(ValueError, match="give a prompt or chat messages"):
        tasks.Task("a", "code", tasks.Format("x"))
    with pytest.raises(ValueError, match="unknown task format 'csv'"):
        tasks.load(str(path), "csv")
