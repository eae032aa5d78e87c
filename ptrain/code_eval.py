"""Evaluate an agent on code and math tasks (the formats of `ptrain.tasks`), judged through
`ptrain.rewards`, writing what `sandbox.terminal.evaluate` writes for terminal tasks.

    items = load("humaneval.jsonl", "humaneval")        # [(Task, reference answer or None)]
    summary = evaluate(items, oracle, "runs/he", attempts=2, pool=pool)

OUT/results.jsonl has one line per attempt (task, attempt, agent, category = the task's
domain, layout = the file's format, reward, passed, time_s, turns, tool_calls, error,
feedback), OUT/transcripts/TASK/ATTEMPT.json the prompt, the model's turns and the verdict,
OUT/summary.json pass@1 / pass@k (unbiased) per task and per category; a run started again
with the same OUT runs only the attempts that have no line yet.

An agent is `agent(items, attempt) -> [Attempt]`, one per item (a batch, so that a model
samples all of them at once). `oracle` answers with the dataset's reference solution
(HumanEval's canonical_solution, MBPP's code, GSM8K's and MATH's worked answers, the first
Python solution of APPS and CodeContests), `nop` with nothing. An attempt without a verdict
is judged here (`rewards.verify_all`); a model agent that ran tools judges its own episodes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence

from sandbox.terminal.evaluate import read_rows, summarize, write_transcript

from ptrain import jsonl
from ptrain import rewards as rewards_lib
from ptrain import tasks as tasks_lib
from ptrain.envs.verdict import Verdict


@dataclasses.dataclass
class Attempt:
    completion: str  # the final answer judged
    steps: list = dataclasses.field(default_factory=list)  # [{"role", "text"}] for the report
    turns: int = 1
    tool_calls: int = 0
    verdict: Verdict | None = None  # None: judged by `evaluate`
    error: str | None = None


# ----------------------------------------------------------------------------- loading

def _python_solution(solutions, languages=None) -> str | None:
    if isinstance(solutions, str):
        solutions = json.loads(solutions) if solutions.strip() else []
    if isinstance(solutions, dict):  # CodeContests: {"language": [...], "solution": [...]}
        languages, solutions = solutions.get("language", []), solutions.get("solution", [])
        python3 = [s for lang, s in zip(languages, solutions) if lang in (3, "PYTHON3")]
        solutions = python3 or [s for lang, s in zip(languages, solutions) if lang in (1, "PYTHON")]
    return solutions[0] if solutions else None


def reference(record: dict, fmt: str) -> str | None:
    """The dataset's own solution of a record, as an answer `ptrain.rewards` accepts; None
    where the record carries none."""
    if fmt == "humaneval":
        return record.get("canonical_solution")
    if fmt == "mbpp":
        return record.get("code")
    if fmt == "gsm8k":
        return record.get("answer")
    if fmt == "math":
        if record.get("solution"):
            return record["solution"]
        return f"\\boxed{{{record['answer']}}}" if record.get("answer") else None
    if fmt == "apps":
        return _python_solution(record.get("solutions") or [])
    if fmt == "codecontests":
        return _python_solution(record.get("solutions") or {})
    if fmt == "ptrain":
        return (record.get("metadata") or {}).get("reference")
    raise ValueError(f"unknown task format {fmt!r}; use one of {list(tasks_lib.FORMATS)}")


def detect_format(path: str) -> str:
    """The format of a task file, from its first record's keys."""
    for _, record in jsonl.records(path):
        fmt = tasks_lib.guess_format(record)
        if fmt is None:
            raise ValueError(f"{path}: the first record's keys {sorted(record)} match none of "
                             f"the formats {list(tasks_lib.FORMATS)}; name the format")
        return fmt
    raise ValueError(f"{path}: no records")


def load(path: str, fmt: str = "") -> list[tuple[tasks_lib.Task, str | None]]:
    """(task, reference answer or None) for every record of a task file in a format of
    `ptrain.tasks.FORMATS` ("" detects it)."""
    fmt = fmt or detect_format(path)
    tasks = tasks_lib.load(path, fmt)
    records = [r for _, r in jsonl.records(path)]
    if len(records) != len(tasks):
        raise ValueError(f"{path}: {len(records)} records but {len(tasks)} tasks")
    items = [(t, reference(r, fmt)) for t, r in zip(tasks, records)]
    ids = [t.id for t, _ in items]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"{path}: task ids {dup[:5]} appear more than once")
    return [(dataclasses.replace(t, metadata={**t.metadata, "format": fmt}), ref)
            for t, ref in items]


# ----------------------------------------------------------------------------- agents

def oracle(items, attempt: int) -> list[Attempt]:
    del attempt
    out = []
    for task, ref in items:
        if ref is None:
            out.append(Attempt("", error=f"{task.id}: the record has no reference solution "
                                         "for the oracle"))
        else:
            out.append(Attempt(ref, steps=[{"role": "oracle", "text": ref}], turns=0))
    return out


def nop(items, attempt: int) -> list[Attempt]:
    del attempt
    return [Attempt("", turns=0) for _ in items]


class ModelAgent:
    """A model's single-turn answers, sampled for a batch of tasks at once: each prompt
    rendered by the chat format (the tokenizer's template, or plain text), or by `prompt`
    (task -> (ids, images or None): a vision-language model's prompts with their images,
    `ptrain.envs.charts.agent`), the answer the turn's text without special tokens
    (`chat.verifier_text`)."""

    __name__ = "model"

    def __init__(self, sampler, params, tokenizer, fmt, *, stop_ids, max_new_tokens=512,
                 temperature=1.0, greedy=False, seed=0, batch_size=16, prompt=None):
        self.sampler, self.params, self.tokenizer, self.fmt = sampler, params, tokenizer, fmt
        self.stop_ids, self.max_new_tokens = tuple(stop_ids), max_new_tokens
        self.temperature, self.greedy, self.batch_size = temperature, greedy, batch_size
        self.seed, self.prompt = seed, prompt

    def _prompt(self, task):
        from ptrain import chat
        if task.tools:
            raise ValueError(f"task {task.id} calls tools {list(task.tools)}: multi-turn "
                             "code tasks are evaluated by the closed loop, not here")
        if self.prompt is not None:
            return self.prompt(task)
        return chat.render_prompt(self.fmt, self.tokenizer, prompt=task.prompt,
                                  messages=task.messages), None

    def __call__(self, items, attempt: int) -> list[Attempt]:
        import jax
        from ptrain import chat
        made = [self._prompt(t) for t, _ in items]  # a bad prompt raises before sampling
        out = []
        for start in range(0, len(made), self.batch_size):
            part = made[start:start + self.batch_size]
            images = [im for _, im in part]
            key = jax.random.fold_in(jax.random.key(self.seed * 100003 + attempt), start)
            s = self.sampler.sample(self.params, [ids for ids, _ in part],
                                    max_new_tokens=self.max_new_tokens,
                                    temperature=self.temperature, greedy=self.greedy,
                                    stop_token_ids=self.stop_ids, key=key,
                                    images=images if any(im is not None for im in images)
                                    else None)
            for ids in s.completions():
                text = chat.verifier_text(self.tokenizer, ids, self.stop_ids)
                out.append(Attempt(text, steps=[{"role": "model", "text": text}]))
        return out


# ----------------------------------------------------------------------------- evaluation

def evaluate(items: Sequence, agent, out_dir: str, *, attempts: int = 1, pool=None,
             config: rewards_lib.RewardConfig = rewards_lib.RewardConfig(),
             progress=None, verify=None) -> dict:
    """Runs `agent` `attempts` times on every item, writes OUT (see the module docstring),
    returns the summary. `progress(done, total, row)` is called after each attempt.
    `verify`: an environment's verifier (`ptrain.envs.Environment.verify`) for tasks that
    have no built-in one (CAD); None: `rewards.verify_all`."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    os.makedirs(os.path.join(out_dir, "transcripts"), exist_ok=True)
    path = os.path.join(out_dir, "results.jsonl")
    rows = read_rows(path)
    done = {(r["task"], r["attempt"]) for r in rows}
    total = len(items) * attempts
    name = getattr(agent, "__name__", type(agent).__name__)
    for attempt in range(attempts):
        todo = [it for it in items if (it[0].id, attempt) not in done]
        if not todo:
            continue
        t0 = time.monotonic()
        results = agent(todo, attempt)
        if len(results) != len(todo):
            raise ValueError(f"agent {name} returned {len(results)} attempts for "
                             f"{len(todo)} tasks")
        judge = [i for i, a in enumerate(results) if a.verdict is None and a.error is None]
        verdicts = (verify or rewards_lib.verify_all)(
            [todo[i][0] for i in judge], [results[i].completion for i in judge], pool=pool,
            config=config)
        for i, v in zip(judge, verdicts):
            results[i].verdict = v
        per = (time.monotonic() - t0) / len(todo)
        for (task, _), a in zip(todo, results):
            row = _row(task, attempt, name, a, per)
            write_transcript(out_dir, {
                "task": task.id, "attempt": attempt,
                "instruction": task.prompt or json.dumps(list(task.messages), indent=1),
                "steps": a.steps,
                "verdict": a.verdict.to_dict() if a.verdict is not None else None})
            jsonl.append([row], path)
            rows.append(row)
            if progress is not None:
                progress(len(rows), total, row)
    ids = {t.id for t, _ in items}
    summary = summarize([r for r in rows if r["task"] in ids
                                       and r["attempt"] < attempts], attempts)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _row(task, attempt, agent_name, a: Attempt, time_s: float) -> dict:
    v = a.verdict
    return {"task": task.id, "attempt": attempt, "agent": agent_name,
            "category": task.domain, "layout": task.metadata.get("format", ""),
            "reward": v.reward if v else 0.0, "passed": bool(v and v.passed),
            "time_s": round(time_s, 3), "turns": a.turns, "tool_calls": a.tool_calls,
            "error": a.error or (v.error_type or None if v and not v.passed else None),
            "feedback": v.feedback if v else f"reward 0: {a.error}"}
