"""Bounded staleness (rl.staleness = k >= 1): the batches generated ahead of the learner.

At step t the learner trains batch t and generates batch t + k from its current parameters
(version t - 1: the updates applied so far), so a batch trains k updates after the
parameters that generated it (fewer in a run's first k steps, all generated from the
initial ones): generation runs ahead of the learner by at most k policy versions. Each row
records the version that generated it (`meta["policy_version"]`); the loss corrects the lag
with the truncated importance weights against the sampler's log-probs (rl.tis_cap; with a
proximal policy's log-probs, rl.ppo_epochs > 1, the decoupled objective of AReaL).

Three threads. The learner's (prepare, update, log, save), the generation thread
(`producer.generate`, one batch at a time, in order) and the scoring thread
(`producer.score`: rewards, sandbox verdicts, in order, each batch as soon as it is
generated, so scoring has k steps to finish before the learner needs it). The weight sync
point is fixed by the schedule, not by a race: at the start of step t the learner waits for
the generation in flight (batch t + k - 1) to end, copies its parameters (version t - 1) for
the generation of batch t + k and hands them over; update t then runs while batch t + k is
generated (XLA releases the GIL: the two threads' device work overlaps), and donates the
learner's parameters, not the copy. So at most one generation is in flight, it overlaps
exactly one update, and what it generates depends on (version, records, key) only.
With many processes (multi-controller JAX) generation runs in the learner's thread instead,
before update t: every process must issue the same device programs in the same order.

Exact resume: a checkpoint of step t holds the data state before batch t + 1 was drawn and
the parameters each pending batch t + 1 .. t + k was generated from (`state()`); a resumed
run draws the same records and generates those batches again (`start`), with the same keys,
so it trains on what the uninterrupted run did. Copies of the parameters are kept only while
a checkpoint may need them.

With `interrupt` (rl.interrupt, ptrain/generate/interrupt.py) the generation in flight also takes the
learner's new version when update t ends (`publish`: a copy of the parameters, which the
generation of batch t + k + 1 then starts from, so no second copy): it switches at its next
decode-round boundary, so batch t + k holds tokens of versions t - 1 and t. The batches of
`start` are generated before any update and are not interrupted. Where the swap falls
depends on the threads' timing, so a checkpoint cannot regenerate a pending batch: it holds
the pending batches finished (`saved_batches`: a save waits for the generation in flight)
with their per-token versions, and the data state after the last one was drawn; a resumed
run trains on those (`start(..., finished=...)`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time

import jax
import jax.numpy as jnp

from ptrain.generate import interrupt as interrupt_lib


@dataclasses.dataclass
class Pending:
    step: int  # the step that trains it
    version: int  # updates applied to the parameters that generated it
    scored: concurrent.futures.Future  # its Batch
    data_state: object  # the data stream's state before its records were drawn
    params: object  # the copy of the parameters that generated it, while a save may need it
    switch: object = None  # interrupt: where the next version is published to it


def version(step: int, k: int) -> int:
    """The version of the parameters that generate the batch of `step`."""
    return max(0, step - k - 1)


def restore_template(params, saved: int) -> dict:
    """The checkpoint's `ahead_params` entry (its structure) for `saved` pending batches
    (`Checkpointer.aux_keys`: a run's last step saves none, however many it resumes to)."""
    return {str(j): params for j in range(saved)}


class LookAhead:
    """The pending batches of a run with staleness k (see the module docstring)."""

    def __init__(self, k: int, producer, batches, root_key, *, steps: int, save_every: int,
                 interrupt: bool = False, replay: bool = False, keep_cache: bool = False):
        self.k, self.producer, self.batches, self.root_key = k, producer, batches, root_key
        self.interrupt, self.published = bool(interrupt), None  # (version, copy)
        self.replay = bool(replay)  # rl.router_replay: a swap recomputes with recorded experts
        self.keep_cache = bool(keep_cache)  # rl.interrupt_cache="keep"
        self.steps, self.save_every = steps, save_every
        self.pending = collections.deque()
        # One worker each: batches are generated, then scored, in order (deterministic).
        self.generator = concurrent.futures.ThreadPoolExecutor(1, "lookahead-generate")
        self.scorer = concurrent.futures.ThreadPoolExecutor(1, "lookahead-score")
        self.generating = None  # the generation in flight (a Future)
        self.waited_s = 0.0  # the learner's time waiting on generation and scoring, this step

    def _saves(self, first: int, last: int) -> bool:
        return any(s % self.save_every == 0 or s == self.steps for s in range(first, last + 1))

    def _wait(self, future):
        start = time.perf_counter()
        try:
            return future.result()
        finally:
            self.waited_s += time.perf_counter() - start

    def _generate(self, now: int, step: int, params, *, interruptible: bool = True,
                  of_version: int | None = None) -> None:
        """Starts generating (then scoring) the batch of `step` at step `now`, in the threads,
        from a copy of `params` (the learner donates its own to the update meanwhile), which
        are `of_version` (default: the schedule's, `version`)."""
        of_version = version(step, self.k) if of_version is None else of_version
        if self.generating is not None:  # the sync point: one generation in flight at most
            self._wait(self.generating)
        if hasattr(self.batches, "at"):  # the adaptive draw: its observations by schedule
            self.batches.at(step)
        data_state = self.batches.get_state()
        records = next(self.batches)
        threaded = jax.process_count() == 1
        keep = self._saves(now, step - 1) and not self.interrupt  # (which saves batches)
        # A copy where the generation outlives this call (its thread runs on while the update
        # donates `params`) or a save may need these weights; otherwise `params` as they are.
        if self.published is not None and self.published[0] == version(step, self.k):
            weights = self.published[1]  # interrupt: the copy published after the update
        else:
            weights = jax.tree.map(jnp.copy, params) if threaded or keep else params
        key = jax.random.fold_in(self.root_key, step)
        switch = None
        if self.interrupt:
            if not threaded:
                raise ValueError("rl.interrupt needs the generation thread: one process")
            switch = (interrupt_lib.Switch(replay=self.replay, keep_cache=self.keep_cache)
                      if interruptible else None)
            weights = interrupt_lib.Live(weights, of_version, switch)
        if not threaded:
            # Many processes must issue the same device programs in the same order (their
            # collectives pair up across processes); a generation thread would interleave
            # its programs with the learner's differently on each process, and they hang.
            # So with many processes batch t + k is generated here, before update t (scoring
            # still runs in its thread: host work only).
            generated = concurrent.futures.Future()
            generated.set_result(self.producer.generate(weights, records, key))
        else:
            generated = self.generator.submit(self.producer.generate, weights, records, key)
        scored = self.scorer.submit(lambda: self.producer.score(generated.result()))
        self.generating = generated
        self.pending.append(Pending(step, of_version, scored, data_state,
                                    weights if keep else None, switch))

    def start(self, step: int, params_list, finished=None, *, current=None) -> None:
        """At a run's first step (or a resumed run's): the batches of step .. step + k - 1,
        from the initial parameters or those a checkpoint saved (oldest first), or, with
        interrupt, the finished batches a checkpoint saved (`restore_batches`). A run
        extended past the step it ended at has fewer saved than that (its last checkpoint
        needed none): the rest are generated from `current`, the restored parameters
        (version step - 1)."""
        for item in finished or ():
            done = concurrent.futures.Future()
            done.set_result(item["batch"])
            self.pending.append(Pending(item["step"], item["version"], done, None, None))
        if not finished:
            for j, params in enumerate(params_list):
                if step + j <= self.steps:
                    self._generate(step, step + j, params, interruptible=False)
        for j in range(len(finished or params_list), self.k):
            if step + j <= self.steps and current is not None:
                self._generate(step, step + j, current, interruptible=False,
                               of_version=step - 1)

    def publish(self, step: int, params) -> None:
        """interrupt: after update `step`, its parameters (version `step`) for the generation
        in flight to switch to (a copy: the learner donates its own to the next update)."""
        if not self.interrupt:
            return
        self.published = (step, jax.tree.map(jnp.copy, params))
        if self.pending and self.pending[-1].switch is not None:
            self.pending[-1].switch.publish(*self.published)

    def next(self, step: int, params):
        """Starts generating batch step + k from `params` (version step - 1), then returns
        batch `step` once scored, each row's meta recording its version. The generation runs
        on while the learner updates `params` (see the module docstring)."""
        if not self.pending:
            raise RuntimeError("LookAhead.next before start")
        self.waited_s = 0.0
        if step + self.k <= self.steps:
            self._generate(step, step + self.k, params)
        item = self.pending.popleft()
        if item.step != step:
            raise RuntimeError(f"look-ahead holds batch {item.step}, step {step} wants its own")
        batch = self._wait(item.scored)
        if self.interrupt and batch.versions_bn is None:
            raise ValueError("rl.interrupt: the producer's batch has no per-token policy "
                             "versions (Batch.versions_bn); rollout.SingleTurn, rollout.Tasks, "
                             "the terminal producer and a mix of them on the engine "
                             "(sampling.engine=True) record them")
        for meta in batch.meta:
            meta["policy_version"] = item.version  # (interrupt: the version it started from)
        return batch

    def state(self):
        """(data state, ahead_params) for a checkpoint after the step just trained (with
        interrupt: the state after the pending batches were drawn, and no parameters)."""
        if not self.pending or self.interrupt:
            return self.batches.get_state(), {}
        return self.pending[0].data_state, {str(j): p.params for j, p in enumerate(self.pending)}

    def saved_batches(self) -> tuple[dict, dict]:
        """interrupt: the pending batches, finished (this waits for the generation in flight
        and the scoring), for a checkpoint: (the metadata's part, its host arrays' part;
        `restore_batches` joins them again); otherwise ({}, {})."""
        if not self.interrupt:
            return {}, {}
        items, arrays = [], {}
        for j, p in enumerate(self.pending):
            arrays[str(j)], rest = interrupt_lib.encode_batch(self._wait(p.scored))
            items.append({"step": p.step, "version": p.version, "batch": rest})
        return {"ahead_batches": items}, {"ahead_batches": arrays}

    def close(self) -> None:
        """Ends the threads (work not started is dropped: a finished run leaves none, a
        failed one needs none)."""
        self.generator.shutdown(cancel_futures=True)
        self.scorer.shutdown(cancel_futures=True)


def restore_batches(extra: dict, host_state: dict):
    """interrupt: the finished pending batches a checkpoint holds (`saved_batches`: its
    metadata `extra` and its `host_state`), for `start(..., finished=...)`; None if none."""
    items = extra.get("ahead_batches")
    if not items:
        return None
    arrays = host_state.get("ahead_batches")
    if arrays is None:
        raise ValueError("this checkpoint's pending rl.interrupt batches have no arrays (it "
                         "was written by an older ptrain, which kept them in the metadata): "
                         "resume it with that version, or start a new workdir")
    return [{"step": item["step"], "version": item["version"],
             "batch": interrupt_lib.decode_batch(arrays[str(j)], item["batch"])}
            for j, item in enumerate(items)]


def metrics(batch, step: int, k: int, waited_s: float = 0.0) -> dict:
    """The batch's staleness: updates between its rows' versions and the learner's (step - 1),
    their mean and their histogram over 0..k (a list: counts of rows per lag); and the
    seconds the learner waited on the threads this step (`time/wait_rollout_s`)."""
    lags = [step - 1 - m["policy_version"] for m in batch.meta]
    if any(not 0 <= lag <= k for lag in lags):
        raise RuntimeError(f"step {step}: a row's staleness is outside [0, {k}]: {set(lags)}")
    out = {"rollout/staleness": sum(lags) / max(len(lags), 1),
           "rollout/staleness_hist": [lags.count(j) for j in range(k + 1)],
           "time/wait_rollout_s": waited_s}
    if getattr(batch, "versions_bn", None) is not None:  # rl.interrupt: per token
        out.update(interrupt_lib.metrics(batch, step, k))
    return out
