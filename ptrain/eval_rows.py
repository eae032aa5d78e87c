"""The closed loop's evaluations in eval.jsonl, one row per (stage, step, domain, decoding),
each written as soon as it is measured: an interrupted evaluation resumes from the rows it
wrote, a resumed run repeats none, and a run extended to more steps evaluates its new last
step. Progress (`ptrain.progress`) counts held-out tasks as they are judged
(`eval.tasks_per_call` at a time); each row also goes to TensorBoard
(`metrics.write_eval`: <workdir>/tb/eval/).

  evaluate_once(evaluate, path, stage, step, config=..., heldout=..., ...)
"""

from __future__ import annotations

import logging
import os

import jax

from ptrain import jsonl
from ptrain import metrics
from ptrain import progress as progress_lib
from ptrain import sharding

log = logging.getLogger("ptrain.eval")


def decodings(config) -> list[str]:
    """The decodings an evaluation runs: greedy, and with eval.sample sampled."""
    return ["greedy"] + (["sample"] if config.eval.sample else [])


def evaluate_once(evaluate, path, stage, step, *, config, heldout, **kwargs) -> list[dict]:
    """The rows of (stage, step): those eval.jsonl has, the others measured by
    `evaluate(stage=, step=, config=, heldout=, skip=, on_line=, on_progress=, ...)` (which
    skips the (domain, decoding) pairs in `skip`, calls `on_line(row)` after each it measures
    and may call `on_progress(domain, n)` as n more of its tasks are done).
    Every process skips the same pairs; process 0 writes."""
    key = lambda r: (r["domain"], r["decoding"])  # noqa: E731
    have = {key(r): r for r in jsonl.read(path) if r.get("stage") == stage
            and r.get("step") == step}
    units = [(d, dec) for dec in decodings(config) for d in heldout]
    skip = {u for u in units if sharding.agree(u in have, "all")}
    if len(skip) < len(units):
        todo = [u for u in units if u not in skip]
        tasks = {d: min(len(heldout[d]), config.eval.n) for d in heldout}
        bar = progress_lib.Progress(sum(tasks[d] for d, _ in todo), desc=f"eval {stage}",
                                    unit="task", enabled=jax.process_index() == 0)
        log.info("eval %s step %d: %s (%d held-out tasks)%s", stage, step,
                 ", ".join(f"{d} {dec}" for d, dec in todo), bar.total,
                 f"; {len(skip)} already in {path}" if skip else "")
        counted = {}  # the tasks on_progress counted of the (domain, decoding) under way

        def on_progress(domain, n):
            counted[domain] = counted.get(domain, 0) + n
            bar.update(n)

        def on_line(row):
            have[key(row)] = row
            if jax.process_index() == 0:  # one writer of the (global) rows
                jsonl.append([row], path)
                metrics.write_eval(os.path.dirname(path), [row])
            log.info("eval %(stage)s step %(step)d %(domain)s %(decoding)s: pass@1 "
                     "%(pass_rate).3f (n=%(n)d, truncated %(truncated).2f)", row)
            bar.update(tasks[row["domain"]] - counted.pop(row["domain"], 0))

        try:
            evaluate(stage=stage, step=step, config=config, heldout=heldout, skip=skip,
                     on_line=on_line, on_progress=on_progress, **kwargs)
        finally:
            bar.close()
    return [have[u] for u in units if u in have]
