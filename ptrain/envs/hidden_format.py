"""Generated code tasks whose output format is stated only by the failing test: an
environment where the retry feedback carries information the prompt lacks.

    dict(env="ptrain.envs.hidden_format:make", args=dict(n_heldout=50, neutral=False))

A task asks for `name(x) = x <op> k`; its hidden tests also fix the return value's format,
drawn uniformly per task from FORMATS: the number itself (`x + 3`), its decimal text
(`str(x + 3)`) or a one-element list (`[x + 3]`). The prompt never says which, so a first
attempt can at best guess (one in three); a failing test's message shows the expected value
(`test failed: blue_fox(3) == '6', got 6`), so a retry that reads it can repair the answer.
With `neutral=True` every failure's feedback is the same NEUTRAL text: the retry learns
that it failed, not how.

The verifier does not execute the answer: it parses it (`ast`) and interprets the one
grammar the tasks need (a `def name(x):` (any one parameter) whose body returns `x <op> int`, optionally
wrapped in `str(...)` or `[...]`); anything else is judged a syntax or shape error. So
verdicts are cheap host computations, and no sandbox is needed.

The turn policy allows retries: with rollout.max_attempts > 1, attempt k + 1 sees attempt
k's feedback (`ptrain.rollout.episodes`). The demonstrations (for a supervised warm start)
are correct first attempts, and with `retry_demos` > 0 also retries whose second attempt
ignores the feedback (`retry_demonstration`).
"""

from __future__ import annotations

import ast
import dataclasses
import random

from ptrain import chat
from ptrain.envs import base, synthetic
from ptrain.envs.verdict import Verdict
from ptrain.rewards import extract_code
from ptrain.tasks import Task

NAME = "hidden_format"
FORMATS = ("int", "str", "list")
OPS = {"plus": ast.Add, "minus": ast.Sub, "times": ast.Mult}
SYMBOLS = {"plus": "+", "minus": "-", "times": "*"}
INPUTS = (0, 1, 3, -2, 7)  # the hidden tests' arguments, in the order they run
NEUTRAL = "that was wrong, try again"
CORRECT = "Correct."


@dataclasses.dataclass(frozen=True)
class Spec:
    """The verifier's data: the function's name, operation, constant and hidden format."""

    name: str
    op: str
    k: int
    format: str


def wrap(value: int, fmt: str):
    return {"int": value, "str": str(value), "list": [value]}[fmt]


def expected(spec: Spec, x: int):
    return wrap({"plus": x + spec.k, "minus": x - spec.k, "times": x * spec.k}[spec.op],
                spec.format)


def solution(spec: Spec) -> str:
    """The correct answer's text."""
    expr = f"x {SYMBOLS[spec.op]} {spec.k}"
    body = {"int": expr, "str": f"str({expr})", "list": f"[{expr}]"}[spec.format]
    return f"def {spec.name}(x):\n    return {body}\n"


# ----------------------------------------------------------------------------- the verifier

class Unsupported(Exception):
    """The answer is outside the grammar the verifier interprets."""


def _value(node, x: int, arg: str = "x"):
    """The value of a return expression in the tasks' grammar, for argument x (named arg)."""
    if isinstance(node, ast.Name) and node.id == arg:
        return x
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _value(node.operand, x, arg)
        if type(inner) is int:
            return -inner
    if isinstance(node, ast.BinOp) and type(node.op) in OPS.values():
        a, b = _value(node.left, x, arg), _value(node.right, x, arg)
        if type(a) is int and type(b) is int:
            return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}[type(node.op)]
        raise Unsupported(f"TypeError: unsupported operand types for "
                          f"{type(node.op).__name__}")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id == "str" and len(node.args) == 1 and not node.keywords:
        return str(_value(node.args[0], x, arg))
    if isinstance(node, ast.List) and len(node.elts) == 1:
        return [_value(node.elts[0], x, arg)]
    raise Unsupported("Unsupported: return x <op> k, str(...) of it or [...] of it")


def judge(spec: Spec, answer: str, *, neutral: bool = False) -> Verdict:
    """One answer's verdict: the hidden tests run in INPUTS order, the first failure's
    message as feedback (NEUTRAL instead when `neutral`)."""
    passed, feedback, error = _run_tests(spec, extract_code(answer, "python"))
    ok = passed == len(INPUTS)
    if not ok and neutral:
        feedback = NEUTRAL
    return Verdict(float(ok), ok, passed / len(INPUTS), CORRECT if ok else feedback,
                   "" if ok else error)


def _run_tests(spec: Spec, code: str) -> tuple[int, str, str]:
    """(tests passed, the first failure's message, its error type)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return 0, "SyntaxError: invalid syntax", "SyntaxError"
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if spec.name not in funcs:
        return 0, f"NameError: name '{spec.name}' is not defined", "NameError"
    fn = funcs[spec.name]
    args = fn.args
    if len(args.args) != 1 or args.vararg or args.kwarg or args.kwonlyargs or args.defaults \
            or args.posonlyargs:
        return 0, f"TypeError: {spec.name}() takes one argument", "TypeError"
    if len(fn.body) != 1 or not isinstance(fn.body[0], ast.Return) or fn.body[0].value is None:
        return 0, f"Unsupported: {spec.name} must be one return statement", "Unsupported"
    for i, x in enumerate(INPUTS):
        want = expected(spec, x)
        try:
            got = _value(fn.body[0].value, x, args.args[0].arg)
        except Unsupported as e:
            message = str(e)
            return i, message, message.partition(":")[0]
        if got != want or type(got) is not type(want):
            return i, f"test failed: {spec.name}({x}) == {want!r}, got {got!r}", "wrong_answer"
    return len(INPUTS), CORRECT, ""


# ----------------------------------------------------------------------------- tasks

def task(rng: random.Random, index: int, split: str) -> Task:
    spec = Spec(name=f"{rng.choice(synthetic.WORDS)}_{rng.choice(synthetic.WORDS)}",
                op=rng.choice(tuple(OPS)), k=rng.randint(2, 9), format=rng.choice(FORMATS))
    return Task(id=f"{split}/{NAME}/{index}", domain=NAME,
                prompt=f"code: {spec.name}(x) = x {spec.op} {spec.k}\n", verifier=spec,
                metadata={"format": spec.format, "op": spec.op})


def generate(n: int, *, seed: int, split: str, exclude=()) -> list[Task]:
    """n distinct tasks (by prompt) none of whose prompts is in `exclude`."""
    rng = random.Random(f"{seed}/{NAME}/{split}")
    return base.distinct(lambda i: task(rng, i, split), n, key=lambda t: t.prompt,
                         exclude=exclude, what=f"{NAME} tasks")


def demonstration(task: Task, tokenizer, fmt) -> dict:
    """The task's correct first attempt as an SFT record."""
    return synthetic.demo_record(task, (solution(task.verifier),), tokenizer, fmt)


def retry_demonstration(task: Task, rng: random.Random, tokenizer, fmt, *,
                        neutral: bool) -> dict:
    """A two-attempt SFT record that teaches the protocol, not the skill: a first attempt in
    a wrong format, its feedback (not trained on, rendered as a rollout appends it), and a
    second attempt in a format drawn from the other two *without* reading the feedback (right
    half the time). Each attempt ends with the format's end-of-turn token."""
    spec = task.verifier
    first = rng.choice([f for f in FORMATS if f != spec.format])
    second = rng.choice([f for f in FORMATS if f != first])
    attempts = [solution(dataclasses.replace(spec, format=f)) for f in (first, second)]
    feedback = judge(spec, attempts[0], neutral=neutral).feedback
    end = list(chat.end_of_turn_ids(fmt, tokenizer)[:1])
    parts = [(chat.encode(tokenizer, attempts[0]) + end, 1),
             (chat.encode(tokenizer, chat.feedback(fmt, feedback,
                                                    closed=bool(fmt.end_of_turn))), 0),
             (chat.encode(tokenizer, attempts[1]) + end, 1)]
    ids = [i for part, _ in parts for i in part]
    mask = [m for part, m in parts for _ in part]
    prompt = chat.render_prompt(fmt, tokenizer, prompt=task.prompt)
    return {"prompt_ids": prompt, "completion_ids": ids, "completion_mask": mask,
            "domain": task.domain}


def tokenizer() -> synthetic.WordTokenizer:
    """The generated tasks' word tokenizer (every text they, their answers and their
    feedback hold; other text is spelled letter by letter)."""
    words = " ".join(synthetic.WORDS + tuple(OPS) + (
        "code def return str test failed got NameError name is not defined SyntaxError "
        "invalid syntax TypeError takes one argument Unsupported must be statement "
        "unsupported operand types for of it that was wrong try again Correct Add Sub Mult "
        "Please fix",))
    return synthetic.WordTokenizer(synthetic._PIECES.findall(words) + [
        chr(i) for i in range(33, 127)] + [" " * n for n in range(1, 9)] + ["\n"])


def verifier(neutral: bool):
    def verify(tasks, answers, *, sessions=None, pool=None, config=None) -> list[Verdict]:
        del sessions, pool, config  # interpreted on the host: no sandbox
        for t in tasks:
            if not isinstance(t.verifier, Spec):
                raise ValueError(f"task {t.id}: a {NAME} task's verifier is a Spec, got "
                                 f"{type(t.verifier).__name__}")
        return [judge(t.verifier, a, neutral=neutral) for t, a in zip(tasks, answers)]
    return verify


def make(n_train: int = 2000, n_heldout: int = 100, neutral: bool = False,
         retry_demos: float = 0.0) -> base.Environment:
    """The environment: n_train training and n_heldout held-out tasks (no prompt in both),
    a demonstration per training task: a correct first attempt, or with probability
    `retry_demos` a `retry_demonstration` (a wrong attempt, its feedback, an uninformed
    second attempt: the model learns to answer again, not to read the feedback);
    `neutral`: every failure's feedback is NEUTRAL (the same turn policy, the information
    removed)."""
    if n_train < 1 or n_heldout < 0 or not 0 <= retry_demos <= 1:
        raise ValueError(f"{NAME}: n_train={n_train} must be >= 1, n_heldout={n_heldout} "
                         f">= 0 and retry_demos={retry_demos} in [0, 1]")

    def tasks(ctx: base.Context) -> base.Splits:
        held = generate(n_heldout, seed=ctx.seed, split="heldout")
        train = generate(n_train, seed=ctx.seed, split="train",
                         exclude={t.prompt for t in held})
        rename = (lambda t: t) if ctx.name == NAME else (
            lambda t: dataclasses.replace(t, domain=ctx.name))
        train, held = [rename(t) for t in train], [rename(t) for t in held]
        rng = random.Random(f"{ctx.seed}/{NAME}/demos")
        demos = ([retry_demonstration(t, rng, ctx.tokenizer, ctx.fmt, neutral=neutral)
                  if rng.random() < retry_demos else demonstration(t, ctx.tokenizer, ctx.fmt)
                  for t in train] if ctx.tokenizer is not None and ctx.fmt is not None else [])
        return base.Splits(train, held, demos)

    return base.Environment(name=NAME, tasks=tasks, verify=verifier(neutral),
                            turns=base.TurnPolicy(retries=True),
                            opens_session=lambda t: False, tokenizer=tokenizer)

