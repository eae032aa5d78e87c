"""Tasks: what the model is asked, how its answer is verified, and the domain it counts for.

A `Task` is plain data that round-trips through JSON (`to_record` / `from_record`), so task
sets live in JSONL files and stream through `ptrain.data` (shuffling, weighted mixtures of
domains, per-host shards, exact resume). The verifier says how `ptrain.rewards` judges an
answer; every verifier runs through the sandbox.

Loaders turn public formats into tasks: HumanEval and MBPP (code + unit tests), APPS and
CodeContests (stdin/stdout problems), GSM8K and MATH (final answers).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import Union


@dataclasses.dataclass(frozen=True)
class UnitTests:
    """Python tests run against the solution (assert-style statements or pytest functions)."""

    tests: str
    setup: str = ""  # code run before the solution (imports the tests expect)
    entry_point: str = ""  # the function under test, when the tests call `check(candidate)`


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
TOOLS = ("python", "bash", "write_file", "read_file")


@dataclasses.dataclass(frozen=True)
class Task:
    """One problem. `prompt` is plain text; `messages` (role/content dicts) is a chat prompt."""

    id: str
    domain: str
    verifier: Verifier
    prompt: str = ""
    messages: tuple[Mapping[str, str], ...] = ()
    tools: tuple[str, ...] = ()  # tools the episode may call; () = single turn, no tools
    files: Mapping[str, str] = dataclasses.field(default_factory=dict)  # laid into the work dir
    metadata: Mapping = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.id or not self.domain:
            raise ValueError("a task needs a non-empty id and domain")
        if not self.prompt and not self.messages:
            raise ValueError(f"task {self.id}: give a prompt or chat messages")
        unknown = set(self.tools) - set(TOOLS)
        if unknown:
            raise ValueError(f"task {self.id}: unknown tools {sorted(unknown)}; known: {TOOLS}")
        object.__setattr__(self, "tools", tuple(self.tools))
        object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))


def to_record(task: Task) -> dict:
    verifier = dataclasses.asdict(task.verifier)
    if isinstance(task.verifier, Stdio):
        verifier["cases"] = [list(c) for c in task.verifier.cases]
    return {"id": task.id, "domain": task.domain, "prompt": task.prompt,
            "messages": list(task.messages), "tools": list(task.tools),
            "files": dict(task.files), "metadata": dict(task.metadata),
            "verifier": {"kind": _KIND[type(task.verifier)], **verifier}}


def from_record(record: Mapping, where: str = "") -> Task:
    """Task from its JSON record; a malformed record raises naming `where` and the field."""
    at = f"{where}: " if where else ""
    try:
        spec = dict(record["verifier"])
        kind = spec.pop("kind")
        cls = VERIFIERS[kind]
    except KeyError as e:
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


def write_jsonl(tasks: Iterable[Task], path: str) -> int:
    """Write tasks atomically; returns how many."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    n, tmp = 0, path + ".tmp"
    with open(tmp, "w") as f:
        for task in tasks:
            f.write(json.dumps(to_record(task)) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def read_jsonl(path: str) -> list[Task]:
    return [from_record(r, where) for where, r in _records(path)]


def _records(path: str):
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: a JSON {type(record).__name__}, not an object")
            yield where, record


# ----------------------------------------------------------------------------- public formats

def _need(record: Mapping, keys: Iterable[str], where: str, fmt: str):
    missing = [k for k in keys if k not in record]
    if missing:
        raise ValueError(f"{where}: {fmt} record is missing {missing}")


def from_humaneval(record: Mapping, where: str = "", domain: str = "code") -> Task:
    """HumanEval: `prompt` (signature + docstring), `test` defining check(candidate)."""
    _need(record, ("task_id", "prompt", "test", "entry_point"), where, "HumanEval")
    tests = f"{record['test']}\n\ncheck({record['entry_point']})\n"
    return Task(id=str(record["task_id"]), domain=domain, prompt=record["prompt"],
                verifier=UnitTests(tests=tests, entry_point=record["entry_point"]),
                metadata={"source": "humaneval"})


def from_mbpp(record: Mapping, where: str = "", domain: str = "code") -> Task:
    """MBPP: `text` (the request), `test_list` (assert lines), optional `test_setup_code`."""
    _need(record, ("task_id", "text", "test_list"), where, "MBPP")
    tests = "\n".join(record["test_list"]) + "\n"
    prompt = (f"{record['text']}\nYour code should pass these tests:\n"
              f"{record['test_list'][0]}\n")
    return Task(id=f"mbpp/{record['task_id']}", domain=domain, prompt=prompt,
                verifier=UnitTests(tests=tests, setup=record.get("test_setup_code", "")),
                metadata={"source": "mbpp"})


def from_apps(record: Mapping, where: str = "", domain: str = "stdio") -> Task:
    """APPS: `question` and `input_output` (a JSON string with `inputs` / `outputs`)."""
    _need(record, ("problem_id", "question", "input_output"), where, "APPS")
    io = record["input_output"]
    io = json.loads(io) if isinstance(io, str) else io
    cases = tuple((_text(i), _text(o)) for i, o in zip(io["inputs"], io["outputs"]))
    if not cases:
        raise ValueError(f"{where}: APPS problem {record['problem_id']} has no test cases")
    return Task(id=f"apps/{record['problem_id']}", domain=domain, prompt=record["question"],
                verifier=Stdio(cases=cases), metadata={"source": "apps"})


def from_code_contests(record: Mapping, where: str = "", domain: str = "stdio") -> Task:
    """CodeContests: `description` and public / private / generated tests."""
    _need(record, ("name", "description"), where, "CodeContests")
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
    _need(record, ("question", "answer"), where, "GSM8K")
    match = re.search(r"####\s*(.+?)\s*$", record["answer"])
    if not match:
        raise ValueError(f"{where}: GSM8K answer has no '#### <number>' line")
    final = match.group(1).replace(",", "")
    task_id = record.get("id") or f"gsm8k/{_digest(record['question'])}"
    return Task(id=str(task_id), domain=domain, prompt=record["question"],
                verifier=Answer(answer=final, numeric=True), metadata={"source": "gsm8k"})


def from_math(record: Mapping, where: str = "", domain: str = "math") -> Task:
    """MATH: `problem`, and `answer` or a `solution` with a final \\boxed{...}."""
    _need(record, ("problem",), where, "MATH")
    answer = record.get("answer") or boxed(record.get("solution", ""))
    if not answer:
        raise ValueError(f"{where}: MATH record has neither `answer` nor a \\boxed{{}} solution")
    task_id = record.get("unique_id") or record.get("id") or f"math/{_digest(record['problem'])}"
    return Task(id=str(task_id), domain=domain, prompt=record["problem"],
                verifier=Answer(answer=answer, numeric=_is_number(answer)),
                metadata={"source": "math", "level": record.get("level", "")})


LOADERS = {"humaneval": from_humaneval, "mbpp": from_mbpp, "apps": from_apps,
           "code_contests": from_code_contests, "gsm8k": from_gsm8k, "math": from_math}


def load(path: str, fmt: str, *, domain: str | None = None) -> list[Task]:
    """Tasks from a JSONL file in one of the public formats (`LOADERS`)."""
    if fmt not in LOADERS:
        raise ValueError(f"unknown task format {fmt!r}; use one of {sorted(LOADERS)}")
    loader = LOADERS[fmt]
    extra = {} if domain is None else {"domain": domain}
    return [loader(record, where, **extra) for where, record in _records(path)]


def boxed(text: str) -> str:
    """The content of the last \\boxed{...} in `text` (braces balanced), or ''."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return ""
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return ""


def _digest(text: str) -> str:
    """A stable id for records that have none (Python's hash() changes every process)."""
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", ""))
        return True
    except ValueError:
        return False


def _text(x) -> str:
    return x if isinstance(x, str) else "\n".join(map(str, x)) if isinstance(x, list) else str(x)
