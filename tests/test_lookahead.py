"""Bounded staleness (ptrain/lookahead.py) with a producer of plain arrays (no model): batch
t + k is generated in the generation thread while update t runs, from a copy of the
parameters of version t - 1 (the learner donates its own), whatever the threads' timing."""

import random
import threading
import time
import types

import jax
import jax.numpy as jnp
import pytest

from ptrain import lookahead

WAIT_S = 60.0  # generous: only a generation that does not overlap the update waits this long


class Stream:
    """A data stream whose n-th batch of records is [n]; its state is n."""

    def __init__(self, n=0):
        self.n = n

    def get_state(self):
        return self.n

    def __next__(self):
        self.n += 1
        return [self.n - 1]


class Producer:
    """generate(batch b) records the version it was given; with `overlap`, the generation of
    batch t + k (started at step t) first waits until update t has donated the learner's
    parameters: a look-ahead that generated in the learner's thread would wait out WAIT_S,
    one that handed over the learner's own arrays would read deleted ones."""

    def __init__(self, k, donated, *, overlap=True, jitter=None):
        self.k, self.donated, self.overlap, self.jitter = k, donated, overlap, jitter
        self.seen, self.waited = {}, {}

    def _sleep(self):
        if self.jitter is not None:
            time.sleep(self.jitter.uniform(0, 0.01))

    def generate(self, params, records, key):
        b = records[0] + 1  # the batch's step
        t = b - self.k
        if self.overlap and t >= 1:
            self.waited[b] = self.donated[t].wait(WAIT_S)
        self._sleep()
        self.seen[b] = float(params["w"])
        return types.SimpleNamespace(b=b, w=self.seen[b])

    def score(self, generated):
        self._sleep()
        return types.SimpleNamespace(meta=[{"b": generated.b, "w": generated.w}] * 2)


def _run(k, steps, **producer_kwargs):
    donated = {t: threading.Event() for t in range(1, steps + 1)}
    producer = Producer(k, donated, **producer_kwargs)
    ahead = lookahead.LookAhead(k, producer, Stream(), jax.random.key(0), steps=steps,
                                save_every=100)
    params = {"w": jnp.zeros(())}
    rows = []
    try:
        for step in range(1, steps + 1):
            if step == 1:
                ahead.start(step, [params] * k)
            batch = ahead.next(step, params)
            rows.append((step, batch.meta, lookahead.metrics(batch, step, k)))
            # The update: a new version; its input is donated (deleted) as step.jit_update's.
            old, params = params, {"w": params["w"] + 1}
            old["w"].delete()
            donated[step].set()
    finally:
        ahead.close()
    return producer, rows


@pytest.mark.parametrize("k", [1, 2, 4])
def test_batch_t_plus_k_is_generated_during_update_t_from_version_t_minus_1(k):
    steps = 6
    producer, rows = _run(k, steps)
    # Every batch generated ahead waited for its step's update to donate the parameters:
    # it ran while the learner updated, on its own copy of version t - 1.
    assert producer.waited == {b: True for b in range(k + 1, steps + 1)}
    assert producer.seen == {b: lookahead.version(b, k) for b in range(1, steps + 1)}
    for step, meta, m in rows:
        assert all(r["b"] == step and r["policy_version"] == lookahead.version(step, k)
                   == r["w"] for r in meta)
        lag = min(step - 1, k)
        assert m["rollout/staleness"] == lag
        assert m["rollout/staleness_hist"] == [0] * lag + [2] + [0] * (k - lag)


def test_what_is_generated_does_not_depend_on_the_threads_timing():
    reference, rows = _run(2, 6, overlap=False)
    for seed in range(3):
        producer, jittered = _run(2, 6, overlap=False, jitter=random.Random(seed))
        assert producer.seen == reference.seen
        assert [(s, meta) for s, meta, _ in jittered] == [(s, meta) for s, meta, _ in rows]


def test_an_error_in_the_generation_thread_reaches_the_learner():
    class Failing(Producer):
        def generate(self, params, records, key):
            if records[0] == 3:
                raise ValueError("generation failed")
            return super().generate(params, records, key)

    producer = Failing(2, {}, overlap=False)
    ahead = lookahead.LookAhead(2, producer, Stream(), jax.random.key(0), steps=6,
                                save_every=100)
    params = {"w": jnp.zeros(())}
    with pytest.raises(ValueError, match="generation failed"):
        try:
            ahead.start(1, [params, params])
            for step in range(1, 7):
                ahead.next(step, params)
        finally:
            ahead.close()
