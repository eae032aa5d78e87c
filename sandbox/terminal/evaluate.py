"""Evaluate an agent on terminal tasks: results.jsonl, transcripts, pass@1 and pass@k.

    summary = evaluate(tasks, agents.oracle, "runs/eval", attempts=5, concurrency=4)
    summary["pass@1"], summary["pass@5"], summary["tasks"]["hello-world"]

Each finished attempt is one line of OUT/results.jsonl (task, attempt, reward, passed, time,
turns, tool calls, feedback, ...), written and flushed as it finishes, and its transcript is
OUT/transcripts/TASK/ATTEMPT.json; an interrupted evaluation started again with the same OUT
runs only the attempts that have no line yet. A harness failure (an image that cannot be
built, a container that dies) is that attempt's reward 0 with the reason, never the end of
the evaluation.
"""

import concurrent.futures
import json
import math
import os
import threading
import time
import traceback

from sandbox.terminal.episode import Harness, TimeUp


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. (2021), "Evaluating Large Language Models
    Trained on Code", eq. 1: 1 - C(n - c, k) / C(n, k), for n attempts of which c passed."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def run_attempt(harness: Harness, task, agent, attempt: int) -> tuple[dict, dict]:
    """One episode of `agent` on `task`: (results row, transcript)."""
    t0 = time.monotonic()
    row = {"task": task.name, "attempt": attempt, "agent": getattr(agent, "__name__", "agent"),
           "category": task.category, "layout": task.layout}
    transcript = {"task": task.name, "attempt": attempt, "instruction": task.instruction,
                  "steps": []}
    try:
        with harness.episode(task) as ep:
            agent_error = None
            try:
                agent(ep)
            except TimeUp:
                pass  # ep.agent_timed_out says so
            except Exception as e:  # noqa: BLE001 (the agent's failure is its attempt's result)
                agent_error = f"the agent failed: {type(e).__name__}: {e}"
            verdict = ep.verify()
            row.update(reward=verdict.reward, passed=verdict.passed,
                       agent_time_s=round(ep.agent_time_s, 3),
                       verify_time_s=round(verdict.duration_s, 3), turns=ep.turns,
                       tool_calls=ep.tool_calls, agent_timed_out=ep.agent_timed_out,
                       verifier_timed_out=verdict.timed_out, error=agent_error or verdict.error,
                       rewards=verdict.rewards, failures=list(verdict.failures),
                       feedback=verdict.feedback)
            transcript["steps"] = ep.transcript
            transcript["verdict"] = verdict.to_dict()
    except Exception as e:  # noqa: BLE001 (no environment: this attempt scores 0, with why)
        row.update(reward=0.0, passed=False, turns=0, tool_calls=0,
                   error=f"{type(e).__name__}: {e}", feedback=f"reward 0: {e}")
        transcript["error"] = traceback.format_exc()
    row["time_s"] = round(time.monotonic() - t0, 3)
    return row, transcript


def evaluate(tasks, agent, out_dir: str, *, attempts: int = 1, concurrency: int = 2,
             harness: Harness | None = None, progress=None) -> dict:
    """Run `agent` `attempts` times on each task, `concurrency` episodes at a time; write
    OUT/results.jsonl and OUT/summary.json; return the summary. `progress(done, total, row)`
    is called after each attempt."""
    if attempts < 1 or concurrency < 1:
        raise ValueError(f"attempts and concurrency must be >= 1, got {attempts}, {concurrency}")
    os.makedirs(os.path.join(out_dir, "transcripts"), exist_ok=True)
    path = os.path.join(out_dir, "results.jsonl")
    rows = read_rows(path)
    done = {(r["task"], r["attempt"]) for r in rows}
    todo = [(t, a) for a in range(attempts) for t in tasks if (t.name, a) not in done]
    own = harness is None
    harness = harness or Harness()
    lock = threading.Lock()
    try:
        with open(path, "a") as out, concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            futures = [pool.submit(run_attempt, harness, t, agent, a) for t, a in todo]
            for n, future in enumerate(concurrent.futures.as_completed(futures), 1):
                row, transcript = future.result()
                with lock:
                    write_transcript(out_dir, transcript)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    rows.append(row)
                if progress is not None:
                    progress(len(done) + n, len(done) + len(todo), row)
    finally:
        if own:
            harness.close()
    names = [t.name for t in tasks]
    summary = summarize([r for r in rows if r["task"] in names and r["attempt"] < attempts],
                        attempts)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def summarize(rows: list[dict], attempts: int) -> dict:
    """pass@1 and pass@k (k = 1, 2, 4, ... up to `attempts`, and `attempts`), mean reward,
    per task and per category."""
    by_task: dict[str, list[dict]] = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(r)
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, attempts) if k <= attempts})
    tasks = {}
    for name, rs in sorted(by_task.items()):
        n, c = len(rs), sum(bool(r.get("passed")) for r in rs)
        tasks[name] = {"attempts": n, "passed": c,
                       "mean_reward": sum(r["reward"] for r in rs) / n,
                       "category": rs[0].get("category", ""),
                       **{f"pass@{k}": pass_at_k(n, c, k) for k in ks if k <= n}}
    summary = {"tasks_evaluated": len(tasks), "attempts": attempts, "tasks": tasks}
    for k in ks:
        scored = [t[f"pass@{k}"] for t in tasks.values() if f"pass@{k}" in t]
        summary[f"pass@{k}"] = sum(scored) / len(scored) if scored else 0.0
    summary["mean_reward"] = (sum(t["mean_reward"] for t in tasks.values()) / len(tasks)
                              if tasks else 0.0)
    categories: dict[str, list[dict]] = {}
    for t in tasks.values():
        categories.setdefault(t["category"] or "uncategorized", []).append(t)
    summary["categories"] = {c: {"tasks": len(ts), "pass@1": sum(t["pass@1"] for t in ts)
                                 / len(ts)} for c, ts in sorted(categories.items())}
    return summary


def read_rows(path: str) -> list[dict]:
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                raise ValueError(f"{path}:{i}: not a JSON line; move the file away to start "
                                 f"the evaluation afresh") from None
    return rows


def transcript_path(out_dir: str, task: str, attempt: int) -> str:
    """OUT/transcripts/TASK/ATTEMPT.json (the task's name with only [A-Za-z0-9._-] kept)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in task)
    return os.path.join(out_dir, "transcripts", safe, f"{attempt}.json")


def write_transcript(out_dir: str, transcript: dict) -> None:
    path = transcript_path(out_dir, transcript["task"], transcript["attempt"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(transcript, f, indent=1)
    os.replace(tmp, path)
