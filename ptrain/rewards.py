"""The built-in verifiers' judges: a task's verifier (`ptrain.tasks`: UnitTests, Stdio, Answer,
Files, Format) and an answer -> an `envs.Verdict` with reward and feedback. The environments of
tasks with these verifiers (code, math, files, task files) verify with `verify_all`.

Every verifier that executes anything goes through the sandbox (`sandbox.judge` for unit
tests and stdin/stdout cases, `sandbox.run` for scripts judged by the files they leave), one
call per answer, submitted to a `sandbox.Pool` so a batch is judged concurrently. Final
answers are compared by `ptrain.answers`, formats here. Each `Verdict` keeps the feedback the
model sees on a retry: the error type, the first failing test and a traceback trimmed to its
own code.
"""

from __future__ import annotations

import ast
import concurrent.futures
import dataclasses
import re
from collections.abc import Sequence

import sandbox
from sandbox import judge

from ptrain import answers
from ptrain.envs.base import submit
from ptrain.envs.verdict import Verdict
from ptrain.tasks import Answer, Files, Format, Stdio, Task, UnitTests


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    partial_credit: bool = False  # fraction of tests passed, instead of all-or-nothing
    timeout_s: float = 10.0  # per judged answer
    test_timeout_s: float = 2.0  # per unit test / stdio case
    memory_mb: int = 512
    backend: str = "auto"


# ----------------------------------------------------------------------------- extraction

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str, language: str = "python") -> str:
    """The last fenced block (preferring one tagged `language`), else the whole text."""
    blocks = _FENCE.findall(text)
    tagged = [body for tag, body in blocks if tag.lower() in (language, language[:2])]
    chosen = tagged or [body for _, body in blocks]
    return chosen[-1] if chosen else text


extract_answer = answers.extract  # the name callers know


def _defines(code: str, name: str) -> bool:
    """Whether `code` parses on its own and defines function `name` at its top level."""
    try:
        module = ast.parse(code)
    except SyntaxError:
        return False
    return any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == name
               for s in module.body)


def program(v: UnitTests, completion: str) -> str:
    """The solution module judged for an answer: the setup, then the answer's code, which
    continues `v.prefix` (HumanEval's prompt) as a body, or replaces the prompt's stub when it
    defines the entry point itself. Either way the prompt's imports and helpers come first,
    and the tests hold their own copy of the helpers (`tasks.from_humaneval`): a wrong answer
    gains nothing from redefining them, in either form."""
    code = extract_code(completion)
    if v.prefix:
        whole = bool(v.entry_point) and _defines(code, v.entry_point)
        code = v.prefix + ("\n" + code if whole else code)
    return (v.setup + "\n" if v.setup else "") + code


# ----------------------------------------------------------------------------- verdicts

def _binary(passed: bool, feedback: str, error_type: str) -> Verdict:
    return Verdict(float(passed), passed, float(passed), feedback, "" if passed else error_type)


def check_answer(v: Answer, completion: str) -> Verdict:
    got = extract_answer(completion)
    if not got:
        return _binary(False, "No answer found: end with 'answer: <value>'.", "no_answer")
    if v.latex:
        ok = answers.same_math(got, v.answer)
    elif v.numeric:
        ok = answers.same_number(got, v.answer, v.tol)
    else:
        ok = answers.same_text(got, v.answer)
    return _binary(ok, "Correct." if ok else f"Wrong answer: {got!r}.", "wrong_answer")


def check_format(v: Format, completion: str) -> Verdict:
    ok = re.search(v.pattern, completion, re.DOTALL) is not None
    return _binary(ok, "Format ok." if ok else "The answer does not have the required format.",
                   "format")


def check_files(v: Files, files: dict[str, bytes] | None, run_result=None,
                others: dict[str, str] | None = None) -> Verdict:
    """Compare the work dir's final files with the expected ones. `others`: the kinds of its
    other entries (symlinks, fifos, directories, ...; `run_result.other_files` by default):
    an expected file must be a regular file, and a path that must not exist holds nothing
    at all (`sandbox.entry_at`)."""
    if run_result is not None and run_result.status in ("timeout", "oom", "signal"):
        return _binary(False, f"The script did not finish: {run_result.describe()}",
                       run_result.status)
    if run_result is not None and run_result.files_truncated:
        return _binary(False, "The work dir's files could not all be read back (over the "
                       "listing's size cap, or unreadable): the files cannot be verified.",
                       "files_truncated")
    files = files or {}
    if others is None and run_result is not None:
        others = run_result.other_files
    wrong = []
    for path, want in v.expected.items():
        have = sandbox.entry_at(files, others or {}, path)
        kind = "" if have is None or isinstance(have, bytes) else have
        if want is None and have is not None:
            wrong.append(f"{path} should not exist" + (f" (a {kind} is there)" if kind else ""))
        elif want is not None and have is None:
            wrong.append(f"{path} is missing")
        elif want is not None and kind:
            wrong.append(f"{path} is a {kind}, not a regular file")
        elif want is not None and have != want.encode():
            wrong.append(f"{path} has the wrong content: {have[:80]!r}")
    total = len(v.expected)
    fraction = (total - len(wrong)) / total if total else 0.0
    feedback = "All files are as expected." if not wrong else "; ".join(wrong) + "."
    if run_result is not None and run_result.stderr.strip() and wrong:
        feedback += "\n" + run_result.stderr_text.strip()[-500:]
    return Verdict(fraction, not wrong, fraction, feedback, "" if not wrong else "wrong_files")


def from_report(report: judge.Report) -> Verdict:
    """A judge report's verdict: its fraction of tests passed as the reward (`verify_all`
    applies partial_credit), its feedback, and the error type of the first failure."""
    error_type = ""
    first = report.first_failure
    if report.error:
        error_type = "judge_error"
    elif first is not None:
        error_type = first.status
        last = (first.traceback or first.message).strip().splitlines()[-1:] or [""]
        match = re.match(r"(\w+(?:Error|Exception|Interrupt|Exit))\b", last[0])
        if match:
            error_type = match.group(1)
    return Verdict(report.fraction_passed, report.all_passed, report.fraction_passed,
                   report.feedback, error_type)


# ----------------------------------------------------------------------------- judging a batch

def needs_session(task: Task) -> bool:
    """Whether a task's episode needs a sandbox session: it calls tools, or its verifier
    judges the work dir its tool calls left (`Files(run="")`)."""
    return bool(task.tools) or (isinstance(task.verifier, Files) and not task.verifier.run)


# Each verifier kind: start(task, completion, session, pool, config) -> a Future of what the
# sandbox returned, or the Verdict itself; finish(verifier, result) -> Verdict.

def _start_unit_tests(task, completion, session, pool, c):
    v = task.verifier
    return submit(pool, judge.unit_tests, program(v, completion), v.tests,
                   entry_point=v.entry_point or None, timeout_s=c.timeout_s,
                   test_timeout_s=c.test_timeout_s, memory_mb=c.memory_mb, backend=c.backend)


def _start_stdio(task, completion, session, pool, c):
    v = task.verifier
    return submit(pool, judge.stdio, extract_code(completion), list(v.cases),
                   float_tol=v.float_tol, timeout_s=c.timeout_s,
                   case_timeout_s=c.test_timeout_s, memory_mb=c.memory_mb, backend=c.backend)


def _start_files(task, completion, session, pool, c):
    v = task.verifier
    if v.run:
        return submit(pool, sandbox.run, extract_code(completion, v.run), language=v.run,
                       files=dict(task.files), return_files=True, timeout_s=c.timeout_s,
                       memory_mb=c.memory_mb, backend=c.backend)
    if session is None:
        raise ValueError(f"task {task.id}: Files(run='') judges an episode's work dir; "
                         "pass its session")
    try:
        return session.listing()
    except ValueError as e:  # more than read_files returns: not all of it is seen
        return _binary(False, f"The work dir cannot be verified: {e}.", "files_truncated")


def _finish_files(v, item):
    result = item.result() if isinstance(item, concurrent.futures.Future) else None
    files, others = (result.files, None) if result is not None else item
    return check_files(v, files, result, others)


JUDGES = {
    UnitTests: (_start_unit_tests, lambda v, item: from_report(item.result())),
    Stdio: (_start_stdio, lambda v, item: from_report(item.result())),
    Files: (_start_files, _finish_files),
    Answer: (lambda task, completion, *_: check_answer(task.verifier, completion), None),
    Format: (lambda task, completion, *_: check_format(task.verifier, completion), None),
}


def verify_all(tasks_: Sequence[Task], completions: Sequence[str], *, pool=None,
               sessions=None, config: RewardConfig = RewardConfig()) -> list[Verdict]:
    """Verdicts for a batch of tasks with built-in verifiers (`JUDGES`), judged concurrently
    on `pool` (in this process without one).

    sessions: for tasks judged by the files their episode left (`Files(run="")`), the
    episode's `sandbox.Session`, aligned with the tasks (None elsewhere).
    """
    if len(tasks_) != len(completions):
        raise ValueError(f"{len(tasks_)} tasks but {len(completions)} completions")
    sessions = sessions if sessions is not None else [None] * len(tasks_)
    for task in tasks_:
        if type(task.verifier) not in JUDGES:
            raise TypeError(f"task {task.id}: verifier {type(task.verifier).__name__} is not "
                            f"a built-in kind ({[k.__name__ for k in JUDGES]}); its "
                            "environment verifies it")
    pending = [JUDGES[type(task.verifier)][0](task, completion, session, pool, config)
               for task, completion, session in zip(tasks_, completions, sessions)]
    verdicts = []
    for task, item in zip(tasks_, pending):
        if isinstance(item, Verdict):
            verdicts.append(item)
            continue
        verdict = JUDGES[type(task.verifier)][1](task.verifier, item)
        if not config.partial_credit:
            verdict = dataclasses.replace(verdict, reward=float(verdict.passed))
        verdicts.append(verdict)
    return verdicts


def verify(task: Task, completion: str, *, session=None,
           config: RewardConfig = RewardConfig()) -> Verdict:
    """One answer, judged in this process."""
    return verify_all([task], [completion], sessions=[session], config=config)[0]
