"""Issue 15's attack classes, each with a test of its own, on every isolating backend where
the class concerns the sandbox (the `backend` fixture skips what cannot run here).

Reward hacking: a value crosses from the solution to the judge only as plain data; the
tests' globals survive a restart; integers compare as integers; a truncated file listing
fails a Files verdict.
"""

import pytest

import sandbox
from ptrain import rewards, tasks
from sandbox import judge
from sandbox_svc_util import backend  # noqa: F401 - the fixture

P = {"backend": "process"}


def statuses(report):
    return [t.status for t in report.tests]


# -- the judge compares plain data in the trusted harness ---------------------------------------

# HumanEval/4 as written: abs(candidate(x) - expected) < 1e-6.
HE4_TESTS = ("def check(candidate):\n"
             "    assert abs(candidate([1.0, 2.0, 3.0]) - 2.0/3.0) < 1e-6\n"
             "    assert abs(candidate([1.0, 2.0, 3.0, 4.0]) - 1.0) < 1e-6\n")
OPERATOR_ATTACKS = {
    "__sub__ returns 0.0": ("class Z:\n    def __sub__(self, o): return 0.0\n"
                            "    def __rsub__(self, o): return 0.0\n"
                            "def mad(xs):\n    return Z()\n"),
    "__abs__ and __lt__ lie": ("class Z:\n    def __sub__(self, o): return self\n"
                               "    def __abs__(self): return self\n"
                               "    def __lt__(self, o): return True\n"
                               "def mad(xs):\n    return Z()\n"),
    "float subclass": ("class F(float):\n    def __sub__(self, o): return 0.0\n"
                       "def mad(xs):\n    return F(7)\n"),
    "inside a list": ("class Z:\n    def __sub__(self, o): return 0.0\n"
                      "def mad(xs):\n    return [Z()][0]\n"),
}


@pytest.mark.parametrize("attack", sorted(OPERATOR_ATTACKS))
def test_arithmetic_on_a_returned_object_is_unjudgeable(attack, backend):  # noqa: F811
    r = judge.unit_tests(OPERATOR_ATTACKS[attack], HE4_TESTS, entry_point="mad",
                         backend=backend)
    assert r.passed == 0 and r.total == 2, r.feedback
    assert statuses(r) == ["unjudgeable", "unjudgeable"], r.feedback
    assert "cannot be judged" in r.tests[0].message and "of type" in r.tests[0].message


def test_in_hash_bool_str_and_indexing_never_run_the_solutions_code():
    code = ("class Yes:\n    def __contains__(self, x): return True\n"
            "    def __bool__(self): return True\n    def __str__(self): return '4'\n"
            "    def __hash__(self): return hash(4)\n    def __eq__(self, o): return True\n"
            "    def __getitem__(self, i): return 4\n    def __iter__(self): return iter([4])\n"
            "def f():\n    return Yes()\n")
    tests = ("assert 3 in f()\nassert f()\nassert str(f()) == '4'\nassert f() in {4}\n"
             "assert f()[0] == 4\nassert list(f()) == [4]\n"
             "try:\n    assert f() == 4\nexcept Exception:\n    pass\n")
    r = judge.unit_tests(code, tests, **P)
    assert statuses(r) == ["unjudgeable"] * 7, r.feedback
    assert "'Yes'" in r.tests[0].message


def test_objects_of_the_solution_still_work_as_objects():
    code = ("class Stack:\n    def __init__(self):\n        self.items = []\n"
            "    def push(self, x):\n        self.items.append(x)\n        return self\n"
            "    def __len__(self):\n        return len(self.items)\n"
            "def gen(n):\n    yield from range(n)\n")
    tests = ("s = Stack().push(1).push(2)\nassert len(s) == 2 and s.items == [1, 2]\n"
             "assert isinstance(s, Stack) and not isinstance(3, Stack)\n"
             "assert sum(gen(10)) == 45 and list(gen(3)) == [0, 1, 2]\n")
    r = judge.unit_tests(code, tests, **P)
    assert r.all_passed, r.feedback


def test_deep_data_crosses_as_data_and_a_cycle_is_unjudgeable():
    code = ("import sys\nsys.setrecursionlimit(100000)\n"
            "def deep(n):\n    x = 'leaf'\n    for _ in range(n):\n        x = [x]\n    return x\n"
            "def cycle():\n    a = []\n    a.append(a)\n    return a\n")
    tests = ("d = deep(20000)\nn = 0\nwhile type(d) is list:\n    d = d[0]\n    n += 1\n"
             "assert (n, d) == (20000, 'leaf')\nassert cycle() == []\n")
    r = judge.unit_tests(code, tests, test_timeout_s=10, timeout_s=30, **P)
    assert statuses(r) == ["passed", "unjudgeable"], r.feedback
    assert "cycle" in r.tests[1].message


# -- each test starts from the same state ------------------------------------------------------

CRASH_ONCE = ("import os\nEXPECTED = {2: 0, 3: 0, 4: 0}\ndef square(x):\n    return 0\n"
              "def f(x):\n    if not os.path.exists('crashed'):\n"
              "        open('crashed', 'w').close()\n        os._exit(1)\n    return 0\n")
GLOBALS_TESTS = ("EXPECTED = {2: 4, 3: 9, 4: 16}\ndef square(x):\n    return x * x\n"
                 "assert f(1) == 1\nassert f(2) == EXPECTED[2]\nassert f(3) == square(3)\n"
                 "assert f(4) == EXPECTED[4]\n")


def test_a_restart_never_rebinds_the_tests_globals(backend):  # noqa: F811
    r = judge.unit_tests(CRASH_ONCE, GLOBALS_TESTS, backend=backend)
    assert statuses(r) == ["crashed", "failed", "failed", "failed"], r.feedback
    assert r.passed == 0 and r.restarts == 1
    assert r.to_dict()["restarts"] == 1 and judge.Report.from_dict(r.to_dict()) == r


def test_after_a_restart_the_tests_see_the_new_solution():
    code = ("import os\ndef f(x):\n    if x == 0:\n        os._exit(1)\n    return x + 1\n")
    tests = ("from solution import f as g\nimport solution\nassert f(0) == 1\n"
             "assert f(1) == 2\nassert g(2) == 3\nassert solution.f(3) == 4\n")
    r = judge.unit_tests(code, tests, **P)
    assert statuses(r) == ["crashed", "passed", "passed", "passed"], r.feedback
    assert r.restarts == 1


# -- verifiers say what they did not see -------------------------------------------------------

def test_an_integer_answer_compares_as_an_integer():
    r = judge.stdio("print(12345679.0)", [("", "12345678")], **P)
    assert statuses(r) == ["failed"], r.feedback
    assert statuses(judge.stdio("print(12345678.0)", [("", "12345678")], **P)) == ["passed"]
    assert statuses(judge.stdio("print(1.0000004e7)", [("", "1e7")], **P)) == ["passed"]


SECRET_TASK = tasks.Task("s", "fs", tasks.Files({"out.txt": "done\n", "secret.txt": None},
                                                run="bash"), prompt="?")


def test_a_truncated_file_listing_fails_the_files_verdict():
    config = rewards.RewardConfig(backend="process", memory_mb=256)
    padded = "```bash\necho done > out.txt\nhead -c 17000000 /dev/zero > secret.txt\n```"
    honest = "```bash\necho done > out.txt\n```"
    bad, good = rewards.score([SECRET_TASK] * 2, [padded, honest], config=config)
    assert not bad.passed and bad.reward == 0.0 and bad.error_type == "files_truncated"
    assert "cannot be verified" in bad.feedback
    assert good.passed
    truncated = sandbox.Result(exit_code=0, files={"out.txt": b"done\n"}, files_truncated=True)
    assert not rewards.check_files(SECRET_TASK.verifier, truncated.files, truncated).passed


def test_a_session_too_large_to_read_fails_the_files_verdict():
    task = tasks.Task("g", "fs", tasks.Files({"secret.txt": None}), prompt="?")
    with sandbox.Session(backend="process", pinned=True) as s:
        s.run(command=["bash", "-c", "head -c 17000000 /dev/zero > secret.txt"])
        verdict = rewards.verify(task, "", session=s)
    assert not verdict.passed and verdict.error_type == "files_truncated", verdict
