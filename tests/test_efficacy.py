"""The hidden_format environment (the information only its feedback carries), the efficacy
bench's verifier-call counting and pass@k, and the bench's pipeline at its smallest."""

import dataclasses
import itertools
import json
import os
import random
import re

import pytest

from bench import efficacy
from ptrain import chat
from ptrain.envs import Context, hidden_format as hf, load
from ptrain.rewards import extract_code

ENTRY = dict(env="ptrain.envs.hidden_format:make", args=dict(n_train=60, n_heldout=12))


def splits(seed=0, **args):
    env = load(dict(ENTRY, args=dict(ENTRY["args"], **args)))
    return env, env.tasks(Context(name=env.name, seed=seed, workdir="/tmp",
                                  tokenizer=hf.tokenizer(), fmt=chat.FORMATS["plain"]))


def python_passes(spec, code) -> bool:
    """The reference: CPython runs the code and the hidden tests."""
    scope = {}
    try:
        exec(code, scope)
        fn = scope[spec.name]
        return all(type(fn(x)) is type(hf.expected(spec, x)) and fn(x) == hf.expected(spec, x)
                   for x in hf.INPUTS)
    except Exception:
        return False


def variants(spec):
    """Answers near the solution: every format, a wrong op, constant, name, or argument."""
    out = [hf.solution(dataclasses.replace(spec, format=f)) for f in hf.FORMATS]
    other_op = next(o for o in hf.OPS if o != spec.op)
    out.append(hf.solution(dataclasses.replace(spec, op=other_op)))
    out.append(hf.solution(dataclasses.replace(spec, k=spec.k + 1)))
    out.append(hf.solution(spec).replace(spec.name, "other_name"))
    out.append(hf.solution(spec).replace("(x)", "(y)", 1).replace("x ", "y "))
    out.append(hf.solution(spec).replace("return", "return return"))
    out.append(f"```python\n{hf.solution(spec)}```")
    return out


def test_verdicts_agree_with_running_the_code():
    _, sp = splits()
    for task in sp.heldout:
        for answer in variants(task.verifier):
            verdict = hf.judge(task.verifier, answer)
            code = extract_code(answer, "python")
            assert verdict.passed == python_passes(task.verifier, code), (answer, verdict)
            assert verdict.reward == float(verdict.passed)


def test_the_format_is_only_in_the_feedback_and_neutral_hides_it():
    _, sp = splits()
    repaired = 0
    for task in sp.heldout:
        spec = task.verifier
        assert not any(f in task.prompt for f in ("str", "[", "list", "int"))
        for wrong in (f for f in hf.FORMATS if f != spec.format):
            attempt = hf.solution(dataclasses.replace(spec, format=wrong))
            verdict = hf.judge(spec, attempt)
            assert not verdict.passed and verdict.error_type == "wrong_answer"
            # the expected value, as Python writes it, names the format
            want = re.search(r"== (.*), got", verdict.feedback).group(1)
            read = {"'": "str", "[": "list"}.get(want[0], "int")
            assert read == spec.format
            fixed = hf.solution(dataclasses.replace(spec, format=read))
            repaired += hf.judge(spec, fixed).passed
            neutral = hf.judge(spec, attempt, neutral=True)
            assert not neutral.passed and neutral.feedback == hf.NEUTRAL
            assert want not in neutral.feedback
    assert repaired == 2 * len(sp.heldout)
    missing = hf.judge(sp.heldout[0].verifier, "def f(x):\n    return x\n")
    assert f"name '{sp.heldout[0].verifier.name}' is not defined" in missing.feedback


def test_splits_generated_disjoint_and_with_demonstrations():
    env, sp = splits(seed=3)
    assert env.turns.retries
    assert len(sp.train) == 60 and len(sp.heldout) == 12
    assert not {t.prompt for t in sp.train} & {t.prompt for t in sp.heldout}
    assert {t.verifier.format for t in sp.train} == set(hf.FORMATS)
    assert [t.prompt for t in splits(seed=3)[1].heldout] == [t.prompt for t in sp.heldout]
    assert [t.prompt for t in splits(seed=4)[1].heldout] != [t.prompt for t in sp.heldout]
    tok = hf.tokenizer()
    for task, demo in zip(sp.train, sp.demonstrations):
        text = tok.decode(demo["completion_ids"])
        assert hf.judge(task.verifier, text).passed
    neutral = load(dict(ENTRY, args=dict(ENTRY["args"], neutral=True)))
    v = neutral.verify([sp.heldout[0]], ["def f(x):\n    return x\n"], sessions=None,
                       pool=None, config=None)
    assert v[0].feedback == hf.NEUTRAL


def test_counter_counts_every_answer_and_budget_stops():
    env, sp = splits()
    counted, counter = efficacy.counted(env)
    counted.verify(sp.heldout[:3], ["x"] * 3)
    counted.verify(sp.heldout[:2], ["x"] * 2)
    assert (counter.calls, counter.batches) == (5, 2)

    class Inner:
        def generate(self, params, records, key):
            return counted.verify(records, ["x"] * len(records))

        def score(self, generated):
            return generated

    budgeted = efficacy.Budgeted(Inner(), counter, budget=9)
    budgeted.generate(None, sp.heldout[:4], None)  # 5 -> 9
    with pytest.raises(efficacy.BudgetSpent):
        budgeted.generate(None, sp.heldout[:4], None)
    assert counter.calls == 9 and budgeted.steps == 1


def test_pass_at_k_is_the_chance_that_k_samples_hold_a_pass():
    rng = random.Random(0)
    n = 6
    flags = [rng.random() < 0.3 for _ in range(5 * n)]
    got = efficacy.pass_at_ks(flags, n)
    assert sorted(got) == ["pass@1", "pass@2", "pass@4", "pass@6"]
    for k in (1, 2, 4, 6):
        per_task = []
        for t in range(5):
            mine = flags[t * n:(t + 1) * n]
            subsets = list(itertools.combinations(mine, k))
            per_task.append(sum(any(s) for s in subsets) / len(subsets))
        assert got[f"pass@{k}"] == pytest.approx(sum(per_task) / 5)


def test_pipeline_runs_every_method_at_equal_counted_calls(tmp_path):
    out = tmp_path / "eff"
    prompts, group, steps = 8, 2, 2  # a minibatch of 8 rows: the tests' 8 CPU devices
    result = efficacy.main([
        "--seeds", "0", "--steps", str(steps), "--tasks", "2", "--train_tasks", "16",
        "--samples", "2", "--prompts", str(prompts), "--group", str(group),
        "--sft_steps", "2", "--rft_rounds", "2", "--rft_steps", "1", "--no_curve",
        "--out", str(out), "--jax_cache", ""])
    budget = steps * prompts * group
    rows = {r["method"]: r for r in result["results"]}
    assert set(rows) == set(efficacy.METHODS)
    assert rows["sft"]["after"]["train_calls"] == 0
    assert rows["grpo"]["after"]["train_calls"] == budget
    assert rows["rft"]["after"]["train_calls"] == budget
    for m in ("grpo_retry", "grpo_neutral"):
        calls, done = rows[m]["after"]["train_calls"], rows[m]["after"]["steps"]
        assert done * prompts * group <= calls <= 2 * done * prompts * group
        assert calls >= budget or done == steps
        assert calls < budget + 2 * prompts * group
    befores = {json.dumps(r["before"], sort_keys=True) for r in rows.values()}
    assert len(befores) == 1  # every method starts from the same SFT model's numbers
    for r in rows.values():
        for part in ("greedy", "sample"):
            assert 0 <= r["after"][part]["pass@1"] <= r["after"][part]["pass_within_2"] <= 1
        assert set(r["after"]["sample"]) >= {"pass@1", "pass@2", "repair_rate"}
    page = (out / "efficacy.html").read_text()
    assert page.count("data:image/png;base64,") == 2
    assert not re.search(r"(src|href)=\"https?:", page)
    for name in ("pass_vs_calls.png", "repair_rate.png", "results.json"):
        assert os.path.getsize(out / name) > 0


def test_retry_demonstrations_answer_again_without_reading_the_feedback():
    tok, fmt = hf.tokenizer(), chat.FORMATS["plain"]
    _, sp = splits()
    rng, seconds = random.Random(0), []
    for task in sp.train[:30]:
        for neutral in (False, True):
            demo = hf.retry_demonstration(task, rng, tok, fmt, neutral=neutral)
            ids, mask = demo["completion_ids"], demo["completion_mask"]
            starts = [i for i in range(1, len(mask)) if mask[i] != mask[i - 1]]
            assert mask[0] == 1 and len(starts) == 2  # attempt, feedback, attempt
            first, fb, second = (tok.decode(ids[a:b]) for a, b in
                                 zip([0, *starts], [*starts, len(ids)]))
            one, two = hf.judge(task.verifier, first), hf.judge(task.verifier, second)
            assert not one.passed
            assert (hf.NEUTRAL if neutral else one.feedback) in fb
            assert first != second
            seconds.append(two.passed)
    assert 0 < sum(seconds) < len(seconds)  # the second attempt is right only by chance
