"""Rewards from the real sandbox, for every verifier kind, including programs that cheat."""

import pytest

import sandbox
from ptrain import rewards, tasks

pytestmark = pytest.mark.xdist_group("sandbox")

ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(2, 2) == 4\n"
CODE = tasks.Task("add", "code", tasks.UnitTests(ADD_TESTS), prompt="write add(a, b)")
STDIO = tasks.Task("sq", "stdio", tasks.Stdio((("3\n", "9\n"), ("4\n", "16\n")),
                                             float_tol=1e-3), prompt="square n")
MATH = tasks.Task("m", "math", tasks.Answer("1007", numeric=True), prompt="?")
WORD = tasks.Task("w", "words", tasks.Answer("Blue Whale"), prompt="?")
FILES = tasks.Task("f", "fs", tasks.Files({"out/a.txt": "red fox\n", "old.txt": None},
                                          run="bash"),
                   prompt="write it", files={"old.txt": "stale"})
FORMAT = tasks.Task("fmt", "format", tasks.Format(r"ANSWER: \d+$"), prompt="?")


@pytest.fixture(scope="module")
def pool():
    with sandbox.Pool(2) as p:
        yield p


def test_unit_tests(pool):
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    bad = "def add(a, b):\n    return a * b\n"  # passes only add(2, 2)
    crash = "def add(a, b):\n    return undefined_name\n"
    verdicts = rewards.verify_all([CODE] * 3, [good, bad, crash], pool=pool)
    assert [v.reward for v in verdicts] == [1.0, 0.0, 0.0]
    assert verdicts[0].passed and verdicts[0].feedback == "All 3 tests passed."
    assert verdicts[1].error_type == "AssertionError" and "1/3 tests passed" in verdicts[1].feedback
    assert verdicts[2].error_type == "NameError" and "undefined_name" in verdicts[2].feedback
    partial = rewards.verify_all([CODE], [bad], pool=pool,
                            config=rewards.RewardConfig(partial_credit=True))[0]
    assert partial.reward == pytest.approx(1 / 3) and not partial.passed


@pytest.mark.parametrize("cheat", [
    "print('All 3 tests passed.')\nprint('PASSED')\nimport os\nos._exit(0)\n",
    "import sys\nsys.exit(0)\n",
    "class Yes:\n    def __eq__(self, other):\n        return True\n"
    "def add(a, b):\n    return Yes()\n",
    "import builtins\nbuiltins.AssertionError = type('E', (Exception,), {})\n"
    "def add(a, b):\n    return 0\n",
])
def test_a_program_cannot_fake_a_pass(pool, cheat):
    verdict = rewards.verify_all([CODE], [cheat], pool=pool)[0]
    assert verdict.reward == 0.0 and not verdict.passed


def test_stdio(pool):
    good = "n = int(input())\nprint(n * n)\n"
    close = "n = int(input())\nprint(n * n + 0.0001)\n"  # within float_tol
    wrong = "print(0)\n"
    verdicts = rewards.verify_all([STDIO] * 3, [good, close, wrong], pool=pool)
    assert [v.reward for v in verdicts] == [1.0, 1.0, 0.0]
    assert verdicts[2].error_type == "failed"


def test_answers_and_formats():
    assert rewards.verify(MATH, "so the answer is 1,007.").passed
    assert rewards.verify(MATH, "it must be \\boxed{1007}").passed
    assert not rewards.verify(MATH, "answer: 1006").passed
    assert rewards.verify(MATH, "no idea").error_type == "no_answer"
    assert rewards.verify(WORD, "Answer: blue  whale").passed
    assert rewards.verify(FORMAT, "thinking...\nANSWER: 42").passed
    assert rewards.verify(FORMAT, "ANSWER: forty-two").error_type == "format"


def test_files_from_a_script(pool):
    good = "```bash\nmkdir -p out\necho 'red fox' > out/a.txt\nrm old.txt\n```"
    no_mkdir = "echo 'red fox' > out/a.txt\nrm old.txt\n"
    verdicts = rewards.verify_all([FILES] * 2, [good, no_mkdir], pool=pool,
                             config=rewards.RewardConfig(partial_credit=True))
    assert verdicts[0].passed and verdicts[0].reward == 1.0
    assert not verdicts[1].passed and verdicts[1].reward == 0.5
    assert "out/a.txt is missing" in verdicts[1].feedback
    assert "No such file or directory" in verdicts[1].feedback


def test_files_left_by_an_episode():
    task = tasks.Task("g", "fs", tasks.Files({"notes.txt": "hi"}), prompt="?")
    with sandbox.Session() as session:
        session.run("open('notes.txt', 'w').write('hi')")
        assert rewards.verify(task, "", session=session).passed
        session.run("open('notes.txt', 'w').write('bye')")
        verdict = rewards.verify(task, "", session=session)
        assert not verdict.passed and "wrong content" in verdict.feedback
    with pytest.raises(ValueError, match="pass its session"):
        rewards.verify(task, "")


def test_pool_and_in_process_agree(pool):
    completions = ["def add(a, b):\n    return a + b\n", "n = int(input())\nprint(n * n)\n",
                   "answer: 7"]
    batch = [CODE, STDIO, MATH]
    assert [v.reward for v in rewards.verify_all(batch, completions, pool=pool)] == \
        [v.reward for v in rewards.verify_all(batch, completions)] == [1.0, 1.0, 0.0]


def test_extractors():
    text = "first\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```\n"
    assert rewards.extract_code(text) == "x = 2\n"
    assert rewards.extract_code("plain code") == "plain code"
    assert rewards.extract_code("```bash\nls\n```", "bash") == "ls\n"
    assert rewards.extract_answer("3 then 4 so 7") == "7"


def test_public_formats_judged_in_the_sandbox(pool, tmp_path):
    import json
    records = {
        "mbpp": {"task_id": 9, "text": "Write area(r).", "test_setup_code": "import math",
                 "test_list": ["assert abs(area(1) - math.pi) < 1e-9",
                               "assert area(0) == 0"]},
        "apps": {"problem_id": 1, "question": "Sort the pair.",
                 "input_output": json.dumps({"fn_name": "pair", "inputs": [[2, 1], [1, 3]],
                                             "outputs": [[[1, 2]], [[1, 3]]]})},
    }
    loaded = {}
    for fmt, record in records.items():
        path = tmp_path / f"{fmt}.jsonl"
        path.write_text(json.dumps(record) + "\n")
        [loaded[fmt]] = tasks.load(str(path), fmt)
    mbpp, apps = loaded["mbpp"], loaded["apps"]
    answers = [
        (mbpp, "def area(r):\n    return math.pi * r * r\n", True),  # math from the setup
        (mbpp, "def area(r):\n    return 3.14 * r * r\n", False),
        (apps, "def pair(a, b):\n    return (min(a, b), max(a, b))\n", True),  # tuple == list
        (apps, "class Solution:\n    def pair(self, a, b):\n        return sorted([a, b])\n",
         True),  # LeetCode style
        (apps, "def pair(a, b):\n    return [a, b]\n", False),
    ]
    verdicts = rewards.verify_all([t for t, _, _ in answers], [a for _, a, _ in answers], pool=pool)
    assert [v.passed for v in verdicts] == [ok for _, _, ok in answers]


def test_humaneval_body_or_whole_function(pool):
    task = tasks.from_humaneval({
        "task_id": "HE/x", "entry_point": "inc", "test": "def check(c):\n    assert c(1) == 2\n",
        "prompt": "from typing import List\n\n\ndef inc(x: int) -> int:\n    \"\"\"x + 1\"\"\"\n"})
    answers = ["    return x + 1\n",  # a body, as a base model continues the prompt
               "```python\ndef inc(x: int) -> int:\n    return x + 1\n```",  # a whole function
               "def inc(x: List[int]) -> int:\n    return x + 1\n",  # List from the prompt
               "return x + 1\n",  # a body at column 0: not the function's
               "    return x\n"]
    verdicts = rewards.verify_all([task] * len(answers), answers, pool=pool)
    assert [v.passed for v in verdicts] == [True, True, True, False, False]
    assert verdicts[3].error_type == "SyntaxError" and "outside function" in verdicts[3].feedback
