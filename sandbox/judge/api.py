"""Judge a solution: unit tests (assert- or pytest-style) or stdin/stdout cases.

One judge call is one sandbox run of `judge/harness.py`, which runs all tests in a single
trusted process against one solution process (restarted only after a crash or timeout), so a
call costs about one run. The verdict leaves the sandbox signed with a per-call key that no
solution process ever holds; the expected outputs of stdio cases never enter the sandbox (they
are compared here). See judge/harness.py for why a program cannot fake a pass.

Nothing the program does raises: it is all in the Report. Bad arguments raise ValueError or
TypeError; a sandbox that failed raises `sandbox.SandboxError` (safe to retry; a Pool does).
"""

import base64
import dataclasses
import functools
import hashlib
import hmac
import json
import marshal
import fractions
import math
import os
import re
import secrets
import struct
import sys
import zlib
from typing import Callable, Optional, Sequence

from sandbox import backends, session
from sandbox.judge import split

_HERE = os.path.dirname(os.path.abspath(__file__))


def _payload(name: str):
    """(compiled, source) of one harness module, each zlib-compressed and base64-encoded."""
    with open(os.path.join(_HERE, name + ".py"), encoding="utf-8") as f:
        source = f.read()
    compiled = marshal.dumps(compile(source, name + ".py", "exec", optimize=2))
    pack = lambda data: base64.b64encode(zlib.compress(data, 9)).decode("ascii")  # noqa: E731
    return pack(compiled), pack(source.encode())


@functools.lru_cache(maxsize=None)
def harness_code() -> str:
    """The program of a judge run on any executor. Compiling the harness costs ~20 ms, more
    than the rest of a judge call: an interpreter of our version gets it compiled (marshal),
    any other its source. Built once per process, on first use."""
    return _bootstrap(f"sys.implementation.cache_tag == {sys.implementation.cache_tag!r}",
                      {name: _payload(name) for name in _MODULES})


@functools.lru_cache(maxsize=None)
def preload_source() -> str:
    """The harness as the body of a module `judge_harness` that a fork server executes once,
    before it forks any run (`judge_backend`); a run then only calls its `main`. Sources
    only (the server compiles them in its own Python, whatever its version)."""
    return _bootstrap("False", {name: ("", _payload(name)[1]) for name in _MODULES}) + (
        '_load_module("pytest_shim")\n')


def _bootstrap(use_marshal: str, payload: dict) -> str:
    return f"""import sys
_JUDGE_MARSHAL = {use_marshal}
_JUDGE_PAYLOAD = {payload!r}
import binascii, zlib
_code = _JUDGE_PAYLOAD["harness"]
if _JUDGE_MARSHAL:
    import marshal
    exec(marshal.loads(zlib.decompress(binascii.a2b_base64(_code[0]))))
else:
    exec(compile(zlib.decompress(binascii.a2b_base64(_code[1])), "harness.py", "exec"))
"""


_MODULES = ("harness", "rpc", "codec", "split", "stdio_cases", "zygote", "pytest_shim")
# A judge run on a fork server that preloaded the harness (see `judge_backend`).
_PRELOADED_RUN = "import sys\nsys.modules['judge_harness'].main()\n"

# What the harness's trusted process imports beyond a fork server's defaults: judge runs go
# to fork servers that import these once, before they fork.
JUDGE_PREIMPORT = ("_json", "ast", "binascii", "ctypes", "fcntl", "hashlib", "hmac", "inspect",
                   "marshal", "select", "zlib")

STATUSES = ("passed", "failed", "error", "timeout", "crashed", "unjudgeable", "skipped")
_SLACK_S = 2.0  # the run's limit over the judge's time budget: start-up and the report


@dataclasses.dataclass(frozen=True)
class TestResult:
    """One test: status is one of STATUSES."""

    name: str
    status: str
    message: str = ""
    traceback: str = ""
    stdout: str = ""
    duration_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Report:
    """A verdict. `passed`/`total` count tests (skipped ones are not counted); `feedback` is a
    short text for the model; `error` says why no test could be judged (then passed == 0);
    `restarts` counts the solution processes started after the first (each after a crash or
    a timeout killed the one before: the tests it was running failed)."""

    passed: int
    total: int
    tests: tuple
    feedback: str
    error: Optional[str] = None
    output: str = ""
    duration_s: float = 0.0
    backend: str = ""
    restarts: int = 0

    @property
    def fraction_passed(self) -> float:
        return self.passed / self.total if self.total else 0.0

    score = fraction_passed  # its former name, kept for a release

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    @property
    def first_failure(self) -> Optional[TestResult]:
        return next((t for t in self.tests if t.status not in ("passed", "skipped")), None)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tests"] = [dataclasses.asdict(t) for t in self.tests]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Report":
        tests = tuple(TestResult(**t) for t in d["tests"])
        return cls(**{**d, "tests": tests})


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------

def unit_tests(code: str, tests: str, *, entry_point: Optional[str] = None,
               style: str = "auto", test_timeout_s: float = 2.0, timeout_s: float = 10.0,
               memory_mb: int = 1024, backend: str = "auto",
               run: Optional[Callable] = None) -> Report:
    """Judges `code` against `tests` (Python source).

    style "assert": each top-level statement with an `assert` is a test (HumanEval's
    `def check(candidate)` is unrolled when `entry_point` names the solution's function);
    "pytest": each `test*` function / `Test*` method, with `parametrize`, `raises`, `approx`
    and file-local fixtures; "auto" picks pytest if there is a `test*` function.
    The tests import the solution as `solution` (`from solution import f`) or use its names.
    `timeout_s` bounds the whole judge; tests not reached in time count as timeouts.
    """
    _check_str("code", code)
    _check_str("tests", tests)
    style, units, _ = split.split_tests(tests, entry_point, style)
    names = [name for name, _ in units]
    payload = {"tests": tests, "entry_point": entry_point, "style": style,
               "test_timeout_s": _positive("test_timeout_s", test_timeout_s),
               "time_budget_s": _positive("timeout_s", timeout_s),
               "max_output_bytes": 1 << 16}
    report, run_result = _execute("unit", code, payload, timeout_s, memory_mb, backend, run)
    if not isinstance(report, str):
        report = _check_test_names(report, style, names)
    if isinstance(report, str):
        return _harness_failure(report, names, run_result)
    results = tuple(TestResult(**{k: t[k] for k in _TEST_FIELDS}) for t in report["tests"])
    return _make_report(results, report, run_result)


def stdio(code: str, cases: Sequence, *, float_tol: Optional[float] = 1e-6,
          case_timeout_s: float = 2.0, timeout_s: float = 10.0, memory_mb: int = 1024,
          backend: str = "auto", run: Optional[Callable] = None) -> Report:
    """Judges a stdin/stdout program on `cases`, a sequence of (input, expected_output) pairs
    or {"input", "output"} dicts. Outputs are compared token by token (so whitespace and line
    breaks do not matter); integers are compared exactly; where the expected token is an
    integer, other output must be within `float_tol` of it (absolute); where it is a float,
    within `float_tol` absolute or relative. The expected outputs never enter the sandbox."""
    _check_str("code", code)
    pairs = _normalise_cases(cases)
    payload = {"inputs": [i for i, _ in pairs],
               "output_caps": [2 * len(o.encode()) + 4096 for _, o in pairs],
               "case_timeout_s": _positive("case_timeout_s", case_timeout_s),
               "time_budget_s": _positive("timeout_s", timeout_s)}
    report, run_result = _execute("stdio", code, payload, timeout_s, memory_mb, backend, run)
    names = [f"case {i}" for i in range(len(pairs))]
    if not isinstance(report, str) and (type(report.get("cases")) is not list
                                        or len(report["cases"]) != len(pairs)):
        report = "the report's cases are not the cases that were sent"
    if isinstance(report, str):
        return _harness_failure(report, names, run_result)
    results = []
    for name, (_, expected), case in zip(names, pairs, report["cases"]):
        results.append(_judge_case(name, case, expected, float_tol))
    return _make_report(tuple(results), report, run_result)


def compare_output(got: str, expected: str, float_tol: Optional[float] = 1e-6):
    """(equal, message): token-wise comparison with float tolerance; see `stdio`."""
    got_tokens, exp_tokens = got.split(), expected.split()
    for i, (g, e) in enumerate(zip(got_tokens, exp_tokens)):
        if g != e and not _numbers_close(g, e, float_tol):
            return False, f"token {i + 1}: expected {_clip(e)!r}, got {_clip(g)!r}"
    if len(got_tokens) != len(exp_tokens):
        return False, (f"expected {len(exp_tokens)} tokens, got {len(got_tokens)}"
                       + (f" (first missing: {_clip(exp_tokens[len(got_tokens)])!r})"
                          if len(got_tokens) < len(exp_tokens) else ""))
    return True, ""


# ----------------------------------------------------------------------------------------------
# The run and its report
# ----------------------------------------------------------------------------------------------

_TEST_FIELDS = ("name", "status", "message", "traceback", "stdout", "duration_s")


def build_stdin(mode: str, code: str, payload: dict, key: bytes) -> bytes:
    """The harness's stdin: the solution section, then the key, then the tests section."""
    first = json.dumps({"mode": mode, "code": code}).encode()
    second = json.dumps(payload).encode()
    return (struct.pack("<Q", len(first)) + first + key
            + struct.pack("<Q", len(second)) + second)


def parse_report(stdout: bytes, key: bytes):
    """The harness's report if its signature checks, else a string saying what is wrong."""
    prefix = _harness().REPORT_PREFIX
    lines = [ln for ln in stdout.splitlines() if ln.startswith(prefix)]
    if not lines:
        return "the judge harness wrote no report"
    if len(lines) > 1:
        return "more than one report (something forged one)"
    try:
        mac, body = lines[0][len(prefix):].split(b" ", 1)
    except ValueError:
        return "the report is malformed"
    want = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    if not hmac.compare_digest(mac, want):
        return "the report's signature does not match (forged)"
    try:
        return json.loads(body)
    except ValueError:
        return "the report is not JSON"


def _check_test_names(report, style, names):
    """The report if it names exactly the tests that were sent (assert style: the units, in
    order; pytest: each function unit at least once, as itself or its parametrized cases,
    and nothing else), else a string saying what is wrong."""
    try:
        got = [str(t["name"]) for t in report["tests"]]
        if not all(t["status"] in STATUSES for t in report["tests"]):
            return "the report's tests have an unknown status"
    except (KeyError, TypeError):
        return "the report's tests are malformed"
    if style == "assert":
        ok = got == names
    else:
        base = [re.sub(r"\[[^\]]*\]\Z", "", name).split("::")[0] for name in got]
        ok = (len(set(got)) == len(got) and set(base) <= set(names)
              and {n for n in names if not n[:1].isupper()} <= set(base))
    return report if ok else "the report's test names are not the tests that were sent"


def _execute(mode, code, payload, timeout_s, memory_mb, backend, run):
    if run is None:
        # sandbox.run's fork server hands a run its stdin (the key, the tests) without it
        # ever becoming an object in the run's memory (forkserver.lay_in), so the harness may
        # fork its zygote before it reads them (judge/harness.py) rather than start one.
        run = functools.partial(session.run, env={"SANDBOX_CLEAN_FORK": "1"})
        backend, program = judge_backend(backend), _PRELOADED_RUN
    else:
        program = harness_code()
    key = secrets.token_bytes(_harness().KEY_BYTES)
    result = run(code=program, language="python",
                 stdin=build_stdin(mode, code, payload, key),
                 timeout_s=float(timeout_s) + _SLACK_S, memory_mb=memory_mb, backend=backend)
    report = parse_report(_as_bytes(result.stdout), key)
    if isinstance(report, str) and result.stderr:
        report += f" (its stderr ends: {_as_bytes(result.stderr)[-300:].decode(errors='replace')})"
    elif not isinstance(report, str) and report.get("error"):
        report = "the judge harness failed: " + str(report["error"])
    return report, result


def _harness():
    """The harness module (for its constants), imported on first use."""
    from sandbox.judge import harness
    return harness


def judge_backend(backend):
    """`backend` (a name, "auto" or a spec) with the harness's modules pre-imported and the
    harness itself preloaded in its fork servers."""
    spec = backends.pick_backend(backend)
    preimport = tuple(dict.fromkeys(tuple(spec.preimport) + JUDGE_PREIMPORT))
    preload = tuple(p for p in spec.preload if p[0] != "judge_harness") + (
        ("judge_harness", preload_source()),)
    return dataclasses.replace(spec, preimport=preimport, preload=preload)


def _as_bytes(data):
    return data if isinstance(data, bytes) else str(data).encode("utf-8", "surrogateescape")


def _harness_failure(why, names, run_result):
    """No trustworthy verdict: every test failed, and the reason says why."""
    if getattr(run_result, "timed_out", False):
        why = f"the judge ran out of time ({why})"
    elif getattr(run_result, "oom", False):
        why = f"the judge ran out of memory ({why})"
    tests = tuple(TestResult(n, "error", why) for n in names)
    return Report(passed=0, total=len(tests), tests=tests, feedback=f"Judge error: {why}.",
                  error=why, duration_s=getattr(run_result, "duration_s", 0.0),
                  backend=getattr(run_result, "backend", ""))


def _make_report(results, report, run_result):
    counted = [t for t in results if t.status != "skipped"]
    passed = sum(t.status == "passed" for t in counted)
    output = str(report.get("output", ""))
    return Report(passed=passed, total=len(counted), tests=results,
                  feedback=feedback_text(results, passed, len(counted)), output=output,
                  duration_s=getattr(run_result, "duration_s", 0.0),
                  backend=getattr(run_result, "backend", ""),
                  restarts=int(report.get("restarts", 0)))


def feedback_text(results, passed, total, max_chars=1500) -> str:
    """A short text for the model: the count, then the first failure with its traceback."""
    if total and passed == total:
        return f"All {total} tests passed."
    head = f"{passed}/{total} tests passed."
    first = next((t for t in results if t.status not in ("passed", "skipped")), None)
    if first is None:
        return head
    parts = [head, f"First failure ({first.name}): {first.status}."]
    if first.traceback:
        parts.append(first.traceback.rstrip())
    elif first.message:
        parts.append(first.message.rstrip())
    if first.stdout.strip():
        parts.append("Output:\n" + first.stdout.strip())
    text = "\n".join(parts)
    return text if len(text) <= max_chars else text[:max_chars - 15] + "\n...[truncated]"


def _judge_case(name, case, expected, float_tol):
    got = base64.b64decode(case["stdout"]).decode("utf-8", "replace")
    stderr = case.get("stderr", "")
    if case.get("not_run"):
        return TestResult(name, "timeout", "not run: the judge's time budget ran out")
    if case["timed_out"]:
        return TestResult(name, "timeout", f"timed out after {case['duration_s']:.3g} s",
                          stdout=_clip(got, 500), duration_s=case["duration_s"])
    if case.get("stdout_truncated"):  # stopped at twice the expected length
        return TestResult(name, "failed", "output is far longer than expected", stderr,
                          _clip(got, 500), case["duration_s"])
    if case["signal"] is not None:
        return TestResult(name, "crashed", f"killed by signal {case['signal']}", stderr,
                          _clip(got, 500), case["duration_s"])
    if case["exit_code"] != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        return TestResult(name, "error", f"exit code {case['exit_code']}: {last}", stderr,
                          _clip(got, 500), case["duration_s"])
    ok, why = compare_output(got, expected, float_tol)
    return TestResult(name, "passed" if ok else "failed", why, stderr if not ok else "",
                      _clip(got, 500) if not ok else "", case["duration_s"])


_INT = re.compile(r"[+-]?\d+\Z")
_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d{1,4})?\Z")


def _numbers_close(got, expected, tol):
    """Integers compare exactly; where the expected token is an integer and the output is not,
    the tolerance is absolute and the difference exact (`12345679.0` is not `12345678`);
    only where the expected token is a float is it also relative."""
    if _INT.match(expected):
        if _INT.match(got):
            return int(got) == int(expected)
        if tol is None:
            return False
        if len(got) > 400 or not _DECIMAL.match(got):
            return False  # not a finite decimal number (nan, inf, words), or absurdly long
        return abs(fractions.Fraction(got) - int(expected)) <= fractions.Fraction(tol)
    if tol is None:
        return False
    try:
        g, e = float(got), float(expected)
    except ValueError:
        return False
    if math.isnan(g) or math.isnan(e):
        return math.isnan(g) and math.isnan(e)
    return abs(g - e) <= tol * max(1.0, abs(e))


def _clip(text, limit=80):
    return text if len(text) <= limit else text[:limit] + "..."


def _check_str(name, value):
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str of Python source, got {type(value).__name__}")


def _positive(name, value):
    if not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _normalise_cases(cases):
    if isinstance(cases, (str, bytes)) or not hasattr(cases, "__len__"):
        raise TypeError("cases must be a sequence of (input, output) pairs")
    pairs = []
    for i, case in enumerate(cases):
        if isinstance(case, dict):
            if set(case) != {"input", "output"}:
                raise ValueError(f"case {i} must have exactly the keys 'input' and 'output', "
                                 f"got {sorted(case)}")
            case = (case["input"], case["output"])
        if (not isinstance(case, (tuple, list)) or len(case) != 2
                or not all(isinstance(x, str) for x in case)):
            raise ValueError(f"case {i} must be an (input, output) pair of str, got {case!r:.80}")
        pairs.append((case[0], case[1]))
    if not pairs:
        raise ValueError("cases is empty: give at least one (input, output) pair")
    return pairs
