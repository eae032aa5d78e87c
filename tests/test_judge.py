"""sandbox.judge: unit tests (assert- and pytest-style) and stdio cases, judged honestly.

Semantics run on the process backend; the programs that try to fake a pass run on every
backend available here, next to an honest solution that must pass the same tests."""

import secrets

import pytest

import sandbox
from sandbox import judge
from sandbox_svc_util import backend  # noqa: F401 - the fixture

P = {"backend": "process"}


def statuses(report):
    return [t.status for t in report.tests]


# -- unit tests ---------------------------------------------------------------------------------

def test_assert_style_counts_each_assert_and_reports_the_first_failure():
    code = "def add(a, b):\n    return a + b if a != 2 else a * b + 1\n"
    tests = "assert add(1, 2) == 3\nassert add(2, 2) == 4\nx = add(0, 5)\nassert x == 5\n"
    r = judge.unit_tests(code, tests, **P)
    assert (r.passed, r.total, r.score) == (2, 3, 2 / 3)
    assert statuses(r) == ["passed", "failed", "passed"]
    first = r.first_failure
    assert first.name == "line 2: assert add(2, 2) == 4"
    assert first.message == "AssertionError: assert 5 == 4"
    assert 'File "tests.py", line 2' in first.traceback and "judge_harness" not in first.traceback
    assert r.feedback.startswith("2/3 tests passed.") and "assert 5 == 4" in r.feedback
    assert not r.all_passed and r.error is None and r.backend == "process"


def test_humaneval_check_is_unrolled_with_the_entry_point():
    tests = ("METADATA = {'author': 'x'}\n\ndef check(candidate):\n"
             "    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n"
             "    for n in range(5):\n        assert candidate([n]) == n\n")
    r = judge.unit_tests("def total(xs):\n    return sum(xs)\n", tests, entry_point="total", **P)
    assert (r.passed, r.total) == (3, 3) and r.all_passed and r.feedback == "All 3 tests passed."
    r = judge.unit_tests("def tot(xs):\n    return sum(xs)\n", tests, entry_point="total", **P)
    assert r.passed == 0 and "does not define 'total'" in r.tests[0].message


def test_pytest_style_parametrize_raises_approx_fixtures_classes_and_skip():
    code = ("import math\ndef root(x):\n    if x < 0:\n        raise ValueError('negative')\n"
            "    return math.sqrt(x)\n")
    tests = '''
import pytest
from solution import root

@pytest.fixture
def squares():
    yield [4, 9]

@pytest.mark.parametrize("x, want", [(4, 2), (9, 3), (2, 1.5)])
def test_param(x, want):
    assert root(x) == pytest.approx(want)

def test_raises():
    with pytest.raises(ValueError, match="neg"):
        root(-1)

def test_fixture(squares):
    assert [root(s) for s in squares] == [2, 3]

class TestRoot:
    def test_zero(self):
        assert root(0) == 0

@pytest.mark.skip(reason="not today")
def test_skipped():
    assert False
'''
    r = judge.unit_tests(code, tests, **P)
    assert [t.name for t in r.tests] == [
        "test_param[0]", "test_param[1]", "test_param[2]", "test_raises", "test_fixture",
        "TestRoot::test_zero", "test_skipped"]
    assert statuses(r) == ["passed", "passed", "failed", "passed", "passed", "passed",
                           "skipped"]
    assert (r.passed, r.total) == (5, 6)  # skipped tests are not counted


def test_an_error_in_the_solution_comes_with_a_traceback_trimmed_to_its_code():
    code = "def f(x):\n    return helper(x)\n\ndef helper(x):\n    return 1 // x\n"
    r = judge.unit_tests(code, "assert f(1) == 1\nassert f(0) == 0\n", **P)
    assert statuses(r) == ["passed", "error"]
    tb = r.tests[1].traceback
    assert tb.startswith("Traceback (most recent call last):\n")
    assert tb.index('"tests.py", line 2') < tb.index('"solution.py", line 2') < tb.index(
        '"solution.py", line 5')
    assert tb.rstrip().endswith("ZeroDivisionError: integer division or modulo by zero")
    assert "judge_harness" not in tb and "pool" not in tb
    assert r.tests[1].message.startswith("ZeroDivisionError")


def test_values_cross_as_python_would_compare_them():
    code = '''
import collections, fractions
Point = collections.namedtuple("Point", "x y")
def values():
    return [1, 2.5, "a", b"\\xff", {1: [2]}, {3}, None, True, 10 ** 5000, float("inf")]
def pair():
    return [1, 2]
def point():
    return Point(1, 2)
def counter():
    return collections.Counter("aab")
def frac():
    return fractions.Fraction(1, 3)
def gen(n):
    yield from range(n)
def sort_in_place(xs):
    xs.sort()
def apply(f, x):
    return f(x) + 1
class Stack:
    def __init__(self):
        self.items = []
    def push(self, x):
        self.items.append(x)
    def pop(self):
        return self.items.pop()
    def __len__(self):
        return len(self.items)
'''
    tests = '''
import collections, fractions
assert values() == [1, 2.5, "a", b"\\xff", {1: [2]}, {3}, None, True, 10 ** 5000, float("inf")]
assert pair() == (1, 2)
assert point() == (1, 2) and point().y == 2
assert counter() == {"a": 2, "b": 1} and counter().most_common(1) == [("a", 2)]
assert frac() == fractions.Fraction(2, 6)
assert list(gen(200)) == list(range(200))
xs = [3, 1, 2]
sort_in_place(xs)
assert xs == [1, 2, 3]
assert apply(lambda v: v * 10, 4) == 41
s = Stack()
s.push(1)
s.push(2)
assert len(s) == 2 and s.pop() == 2 and isinstance(s, Stack) and s.items == [1]
'''
    r = judge.unit_tests(code, tests, **P)
    # A list never equals a tuple in Python, here neither; everything else holds.
    assert statuses(r) == ["passed", "failed", "passed", "passed", "passed", "passed",
                           "passed", "passed", "passed"], r.feedback
    assert r.tests[1].message == "AssertionError: assert [1, 2] == (1, 2)"


def test_timeouts_and_crashes_fail_only_their_own_test():
    code = ('import ctypes, sys\ncalls = []\ndef f(x):\n    calls.append(x)\n'
            '    if x == "loop":\n        while True:\n            pass\n'
            '    if x == "segv":\n        ctypes.string_at(0)\n'
            '    if x == "exit":\n        sys.exit(0)\n    return len(calls)\n')
    tests = ('assert f("a") == 1\nassert f("loop") == 0\nassert f("b") == 1\n'
             'assert f("segv") == 0\nassert f("c") == 1\nassert f("exit") == 0\n'
             'assert f("d") == 3\n')
    r = judge.unit_tests(code, tests, test_timeout_s=0.5, **P)
    # After a timeout or crash the solution restarts (so `calls` starts again); after an
    # exception it goes on.
    assert statuses(r) == ["passed", "timeout", "passed", "crashed", "passed", "error", "passed"]
    assert "SIGSEGV" in r.tests[3].message and "SystemExit" in r.tests[5].message


def test_the_time_budget_ends_the_judge_with_a_verdict():
    code = "def slow():\n    while True:\n        pass\n"
    tests = "".join("assert slow() == 1\n" for _ in range(6))
    r = judge.unit_tests(code, tests, test_timeout_s=0.4, timeout_s=1.0, **P)
    assert r.total == 6 and r.passed == 0 and set(statuses(r)) == {"timeout"}
    assert r.error is None and sum("not run" in t.message for t in r.tests) >= 3


def test_a_solution_that_does_not_parse_fails_every_test():
    r = judge.unit_tests("def f(:\n    pass\n", "assert f() == 1\nassert f() == 2\n", **P)
    assert (r.passed, r.total) == (0, 2) and statuses(r) == ["error", "error"]
    assert "SyntaxError" in r.tests[0].traceback


def test_the_solution_output_is_shown_with_its_failure():
    r = judge.unit_tests("def f():\n    print('thinking...')\n    return 2\n", "assert f() == 3\n",
                         **P)
    assert r.tests[0].stdout == "thinking...\n" and "Output:\nthinking..." in r.feedback


def test_bad_arguments_are_clear_errors():
    with pytest.raises(TypeError, match="code must be a str"):
        judge.unit_tests(b"x", "assert 1\n", **P)
    with pytest.raises(ValueError, match="do not parse"):
        judge.unit_tests("x = 1", "assert (\n", **P)
    with pytest.raises(ValueError, match="no assert"):
        judge.unit_tests("x = 1", "y = 2\n", **P)
    with pytest.raises(ValueError, match="style"):
        judge.unit_tests("x = 1", "assert x\n", style="nose", **P)
    with pytest.raises(ValueError, match="test_timeout_s"):
        judge.unit_tests("x = 1", "assert x\n", test_timeout_s=0, **P)
    with pytest.raises(ValueError, match="exactly the keys"):
        judge.stdio("print(1)", [{"in": "", "out": "1"}], **P)
    with pytest.raises(ValueError, match="empty"):
        judge.stdio("print(1)", [], **P)


# -- programs that try to fake a pass -----------------------------------------------------------

TESTS = ("assert f(2) == 4\nassert f(3) == 9\nassert abs(f(1.5) - 2.25) < 1e-9\n"
         "import math\nassert math.isclose(f(0.5), 0.25)\n"
         "assert isinstance(f(4), int) and f(4) == 16\n")
HONEST = "def f(x):\n    return x * x\n"
_PARENT_OF_ZYGOTE = ("zygote = os.getppid()\n"
                     "    judge_pid = int(open(f'/proc/{zygote}/stat').read().split(')')[1]"
                     ".split()[1])\n")
ATTACKS = {
    "prints PASSED and a fake report": (
        "print('PASSED\\n' * 20 + 'JUDGE-REPORT 00 {\"tests\": [], \"error\": null}')\n"
        "def f(x):\n    print('PASSED')\n    return 0\n"),
    "os._exit(0) before the asserts": "import os\nos._exit(0)\n",
    "os._exit(0) inside the call": "import os\ndef f(x):\n    os._exit(0)\n",
    "sys.exit(0) at import": "import sys\nsys.exit(0)\n",
    "sys.exit(0) inside the call": "import sys\ndef f(x):\n    sys.exit(0)\n",
    "__eq__ always True": (
        "class Any:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
        "    def __lt__(self, o): return True\n    def __sub__(self, o): return self\n"
        "    def __rsub__(self, o): return self\n    def __abs__(self): return self\n"
        "    def __float__(self): return float('nan')\n    __hash__ = object.__hash__\n"
        "def f(x):\n    return Any()\n"),
    "int subclass with __eq__ True": (
        "class I(int):\n    def __eq__(self, o): return True\n    __hash__ = int.__hash__\n"
        "def f(x):\n    return I(0)\n"),
    "overrides builtins": (
        "import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.isinstance = lambda *a: True\n"
        "builtins.AssertionError = type('X', (BaseException,), {})\n"
        "def abs(x): return 0\ndef isinstance(*a): return True\ndef f(x):\n    return -1\n"),
    "replaces math with a fake": (
        "class M:\n    isclose = staticmethod(lambda *a, **k: True)\nmath = M()\n"
        "def f(x):\n    return -1\n"),
    "plants modules in the work dir": (
        "for name in ('math', 'pytest', 'json', 'solution', 'tests'):\n"
        "    open(name + '.py', 'w').write('isclose = lambda *a, **k: True\\n'"
        " 'import os\\nos._exit(0)\\n')\n"
        "def f(x):\n    return -1\n"),
    "monkey-patches the harness in its process": (
        "import gc, sys\nfor o in gc.get_objects():\n    if callable(o) and hasattr(o, '__code__'):"
        "\n        if o.__module__ in (None, '__main__') and o.__name__.startswith('_'):\n"
        "            try:\n                o.__code__ = (lambda *a, **k: None).__code__\n"
        "            except Exception:\n                pass\nfor m in list(sys.modules.values()):"
        "\n    if hasattr(m, 'send_fds'):\n        m.send_fds = None\ndef f(x):\n    return -1\n"),
    "kills the judge": (
        "import os, signal\ndef f(x):\n    " + _PARENT_OF_ZYGOTE +
        "    os.kill(judge_pid, signal.SIGKILL)\n    return x * x\n"),
    "writes a report to the judge's stdout, then kills it": (
        "import os, signal\ndef f(x):\n    " + _PARENT_OF_ZYGOTE +
        "    fd = os.open(f'/proc/{judge_pid}/fd/1', os.O_WRONLY)\n"
        "    os.write(fd, b'JUDGE-REPORT 00 {\"mode\": \"unit\", \"tests\": [], '\n"
        "             b'\"error\": null}\\n')\n"
        "    os.kill(judge_pid, signal.SIGKILL)\n"),
    "kills its zygote": (
        "import os, signal\nzygote = os.getppid()\ndef f(x):\n"
        "    os.kill(zygote, signal.SIGKILL)\n    return -1\n"),
    "reads stdin for the tests": (
        "import sys\nseen = sys.stdin.read()\ndef f(x):\n"
        "    return 4 if 'assert' in seen else -1\n"),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_program_cannot_fake_a_pass(attack, backend):  # noqa: F811
    r = judge.unit_tests(ATTACKS[attack], TESTS, test_timeout_s=1.0, backend=backend)
    assert r.total == 5 and r.passed == 0, r.feedback


def test_the_honest_solution_passes_the_same_tests(backend):  # noqa: F811
    r = judge.unit_tests(HONEST, TESTS, backend=backend)
    assert (r.passed, r.total) == (5, 5), r.feedback


SCAN = r'''
import binascii, ctypes, gc, re
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # dumpable again (the judge made it not), to read
                                        # /proc/self/mem
def scan(token_re):
    """Every match of token_re in this process: in its objects, and anywhere in its memory,
    as text or base64-encoded (as a fork server may hold a run's stdin)."""
    found = {m for o in gc.get_objects() if isinstance(o, str) for m in re.findall(token_re, o)}
    token, b64 = re.compile(token_re.encode()), re.compile(rb"[A-Za-z0-9+/]{40,}")
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
        for line in maps:
            fields = line.split()
            if "r" not in fields[1] or line.rstrip().endswith("[vsyscall]"):
                continue
            start, end = (int(v, 16) for v in fields[0].split("-"))
            try:
                mem.seek(start)
                data = mem.read(end - start)
            except (OSError, ValueError, OverflowError):
                continue
            found.update(m.decode() for m in token.findall(data))
            for run in b64.findall(data):
                for shift in range(4):
                    chunk = run[shift:][:(len(run) - shift) // 4 * 4]
                    try:
                        decoded = binascii.a2b_base64(chunk)
                    except binascii.Error:
                        continue
                    found.update(m.decode() for m in token.findall(decoded))
    return sorted(found)
'''


# Which zygote the solution process came from: a fresh interpreter runs the judge's boot
# script, a fork has the fork server's command line.
ZYGOTE = ("import os\ndef zygote():\n"
          "    with open(f'/proc/{os.getppid()}/cmdline', 'rb') as f:\n"
          "        return 'fresh' if b'zygote_entry' in f.read() else 'forked'\n")
ZYGOTE_PATHS = {"forked": None,  # sandbox.run: its fork server declares clean memory
                "fresh": sandbox.run}  # an executor that does not declare it


@pytest.mark.parametrize("zygote", sorted(ZYGOTE_PATHS))
def test_the_expected_values_are_nowhere_in_the_solution_process(backend, zygote):  # noqa: F811
    """The tests (and the key) reach the judge only after its zygote exists; the control
    shows the scan finds a token that is in the solution's memory."""
    token = "EXPECT" + secrets.token_hex(8)
    code = SCAN + ZYGOTE + (
        "def f():\n    hits = scan('EXPECT' + '[0-9a-f]{16}')\n"
        "    return hits[0] if hits else 'nothing found'\n"
        "def control():\n    planted = 'CONT' + 'ROL' + '0123456789abcdef'\n"
        "    return 'found' if scan('CONTROL' + '[0-9a-f]{16}') == [planted] else 'missed'\n")
    r = judge.unit_tests(code, f"assert zygote() == {zygote!r}\nassert control() == 'found'\n"
                               f"SECRET = {token!r}\nassert f() == SECRET\n",
                         backend=backend, run=ZYGOTE_PATHS[zygote])
    assert statuses(r) == ["passed", "passed", "failed"], r.feedback
    assert "nothing found" in r.tests[2].message, r.feedback


# -- stdin/stdout -------------------------------------------------------------------------------

@pytest.mark.parametrize("got, expected, tol, equal", [
    ("1 2\n3", "1\n2 3\n", 1e-6, True),  # whitespace and line breaks do not matter
    ("3.0000001", "3", 1e-6, True),  # |3.0000001 - 3| = 1e-7 <= 1e-6 * max(1, 3)
    ("3.00001", "3", 1e-6, False),  # 1e-5 > 3e-6
    ("1000000.5", "1000000.0", 1e-6, True),  # relative: 0.5 <= 1e-6 * 1e6 = 1
    ("1000002", "1000000", 1e-6, False),  # integers compare exactly
    ("12345678901234567891", "12345678901234567890", 1e-6, False),
    ("3.0000001", "3", None, False),  # tolerance off: tokens must match
    ("nan", "NaN", 1e-6, True),
    ("1 2", "1 2 3", 1e-6, False),
    ("yes", "YES", 1e-6, False),
])
def test_compare_output(got, expected, tol, equal):
    assert judge.compare_output(got, expected, tol)[0] is equal


def test_stdio_verdicts_per_case():
    code = ('import sys\nline = sys.stdin.readline()\na, b = map(int, line.split())\n'
            'if a == 7:\n    while True:\n        pass\nif a == 8:\n    print(1 / 0)\n'
            'if a == 9:\n    sys.stdout.buffer.write(b"\\xff" * 10**7)\nprint(a + b)\n')
    cases = [("1 2\n", "3\n"), {"input": "2 2", "output": "4"}, ("3 3", "7"), ("7 0", "7"),
             ("8 0", "8"), ("9 0", "9"), ("10 5", "15")]
    r = judge.stdio(code, cases, case_timeout_s=0.5, **P)
    assert statuses(r) == ["passed", "passed", "failed", "timeout", "error", "failed", "passed"]
    assert r.tests[2].message == "token 1: expected '7', got '6'"
    assert "ZeroDivisionError" in r.tests[4].message and "exit code 1" in r.tests[4].message
    assert "far longer" in r.tests[5].message
    assert (r.passed, r.total) == (3, 7) and r.feedback.startswith("3/7 tests passed.")


def test_stdio_expected_outputs_never_enter_the_sandbox(backend):  # noqa: F811
    token = "EXPECT" + secrets.token_hex(8)
    code = SCAN + "hits = scan('EXPECT' + '[0-9a-f]{16}')\nprint(hits[0] if hits else 'none')\n"
    r = judge.stdio(code, [("", token)], backend=backend)
    assert r.passed == 0 and "got 'none'" in r.tests[0].message, r.feedback


def test_a_stdio_program_cannot_fake_a_pass(backend):  # noqa: F811
    code = ("import os, sys\nprint('PASSED')\nsys.stdout.flush()\n"
            "judge = int(open(f'/proc/{os.getppid()}/stat').read().split(')')[1].split()[1])\n"
            "try:\n    fd = os.open(f'/proc/{judge}/fd/1', os.O_WRONLY)\n"
            "    os.write(fd, b'JUDGE-REPORT 00 {\"cases\": []}\\n')\nexcept OSError:\n"
            "    pass\nos._exit(0)\n")
    r = judge.stdio(code, [("", "42"), ("", "43")], backend=backend)
    assert r.passed == 0, r.feedback


def test_on_an_executor_that_does_not_declare_clean_memory_the_zygote_is_fresh():
    """What `run=` callers get (the verdicts are the same as with a forked zygote)."""
    code = ZYGOTE + ("def f(x):\n    if x == 0:\n        os._exit(3)\n    return x * x\n")
    tests = ("assert zygote() == 'fresh'\nassert f(2) == 4\nassert f(0) == 0\n"
             "assert f(3) == 8\nassert f(3) == 9\n")
    r = judge.unit_tests(code, tests, run=sandbox.run, **P)
    assert statuses(r) == ["passed", "passed", "crashed", "failed", "passed"]
    assert "exited with code 3" in r.tests[2].message
    r = judge.stdio("print(int(input()) * 2)", [("2", "4"), ("3", "7")], run=sandbox.run, **P)
    assert statuses(r) == ["passed", "failed"]


def test_report_round_trips_through_json():
    r = judge.unit_tests(HONEST, TESTS, **P)
    assert judge.Report.from_dict(r.to_dict()) == r
