"""The closed loop's evaluations in eval.jsonl, one row per (stage, step, domain, decoding),
each written as soon as it is measured: an interrupted evaluation resumes from the rows it
wrote, a resumed run repeats none, and a run extended to more steps evaluates its new last
step. Progress (`ptrain.progress`) counts held-out tasks; each row also goes to TensorBoard
(`<workdir>/tb/eval`, tags `eval_<stage>/<domain>/<decoding>/pass_at_k`).

  evaluate_once(evaluate, path, stage, step, config=..., heldout=..., ...)
"""

from __future__ import annotations

import logging
import os
import time

import jax

from ptrain import jsonl
from ptrain import progress as progress_lib
from ptrain import sharding

log = logging.getLogger("ptrain.eval")


def decodings(config) -> list[str]:
    """The decodings an evaluation runs: greedy, and with eval.sample sampled."""
    return ["greedy"] + (["sample"] if config.eval.sample else [])


def evaluate_once(evaluate, path, stage, step, *, config, heldout, **kwargs) -> list[dict]:
    """The rows of (stage, step): those eval.jsonl has, the others measured by
    `evaluate(stage=, step=, config=, heldout=, skip=, on_line=, ...)` (which skips the
    (domain, decoding) pairs in `skip` and calls `on_line(row)` after each it measures).
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
        writer = _TensorBoard(os.path.dirname(path))

        def on_line(row):
            have[key(row)] = row
            if jax.process_index() == 0:  # one writer of the (global) rows
                jsonl.append([row], path)
                writer.write(row)
            log.info("eval %(stage)s step %(step)d %(domain)s %(decoding)s: pass@1 "
                     "%(pass_rate).3f (n=%(n)d, truncated %(truncated).2f)", row)
            bar.update(tasks[row["domain"]])

        try:
            evaluate(stage=stage, step=step, config=config, heldout=heldout, skip=skip,
                     on_line=on_line, **kwargs)
        finally:
            bar.close()
            writer.close()
    return [have[u] for u in units if u in have]


class _TensorBoard:
    """Eval rows as TensorBoard scalars (opened at the first row, process 0 only)."""

    def __init__(self, workdir):
        self.dir, self.tb = os.path.join(workdir, "tb", "eval"), None

    def write(self, row):
        if self.tb is None:
            from ptrain import metrics
            self.tb = metrics._import_tensorboardx().SummaryWriter(  # a file per writer
                self.dir, filename_suffix=f".{time.time_ns()}")
        for k, v in row.items():
            if (k.startswith("pass@") or k in ("truncated", "pass_rate_with_folder")) \
                    and isinstance(v, (int, float)):
                tag = f"eval_{row['stage']}/{row['domain']}/{row['decoding']}/{k}"
                self.tb.add_scalar(tag.replace("@", "_at_"), float(v),
                                   global_step=int(row["step"]))
        self.tb.flush()

    def close(self):
        if self.tb is not None:
            self.tb.close()
