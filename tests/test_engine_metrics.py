"""The rollout engine in the learner (sampling.engine=True): its bfloat16 decode copy
(sampling.decode_dtype) is refreshed from each update's parameters, and each step logs the
engine's metrics (tokens/s, occupancy, queues, tool waits, weight-sync time) to
metrics.jsonl and TensorBoard."""

import glob
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import grpo_toy
from ptrain import learner as L
from ptrain import model as M
from ptrain import rollout
from ptrain import sharding
from ptrain.generate import engine as E
from ptrain.generate import engine_sampler
from ptrain.metrics import read_jsonl

BF16 = jnp.dtype(jnp.bfloat16)


class Recording:
    """SingleTurn on the engine, recording at each generate the parameters it was given (cast
    to bfloat16) and the engine's decode copy after it."""

    def __init__(self, inner):
        self.inner, self.sampler, self.seen = inner, inner.sampler, []

    def generate(self, params, records, key):
        out = self.inner.generate(params, records, key)
        copy = self.sampler.weights.params
        self.seen.append((jax.device_get(jax.tree.map(lambda x: x.astype(BF16), params)),
                          jax.device_get(copy), {str(x.sharding.spec)
                                                 for x in jax.tree.leaves(copy)}))
        return out

    def score(self, generated):
        return self.inner.score(generated)


def test_learner_refreshes_the_bf16_copy_and_logs_engine_metrics(tmp_path):
    config = grpo_toy.get_config()
    config.steps = 3
    config.sampling.update(engine=True, engine_slots=16, decode_dtype="bfloat16")
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    learner = L.Learner(config, mesh=mesh)
    producer = Recording(rollout.SingleTurn(config, rollout.make_sampler(
        nnx.merge(learner.graphdef, learner.initial_params), config)))
    assert engine_sampler.find(producer) == [producer.sampler]
    L.train(config, str(tmp_path), producer=producer, mesh=mesh)

    # The copy the engine decoded at step t is the parameters of step t (after t - 1
    # updates) in bfloat16, exactly; the updates change them, so a stale copy would fail.
    assert len(producer.seen) == 3
    for want, got, specs in producer.seen:
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            assert b.dtype == BF16
            np.testing.assert_array_equal(a, b)
        assert not any("fsdp" in s for s in specs) and any("tensor" in s for s in specs)
    first, second = (jax.tree.leaves(producer.seen[i][0]) for i in (0, 1))
    assert any(not np.array_equal(a, b) for a, b in zip(first, second))

    rows = config.data.prompts_per_step * config.sampling.num_samples
    for m in read_jsonl(os.path.join(tmp_path, "metrics.jsonl")):
        assert m["engine/weight_syncs"] == 1  # one sync a step, the step's own
        assert m["time/weight_sync_s"] > 0
        assert 0 < m["engine/slot_occupancy"] <= 1 and 0 < m["engine/bucket_occupancy"] <= 1
        # every token of the step's completions, decoded at the rate logged
        assert m["engine/tokens"] == pytest.approx(m["response/length_mean"] * rows)
        assert m["engine/tokens_per_s"] == pytest.approx(m["engine/tokens"] / m["engine/decode_s"])
        assert m["engine/queue_waiting_max"] >= 1 and m["engine/queue_live_max"] <= 16
        assert m["engine/queue_on_tools_max"] == 0 and m["time/tool_wait_s"] == 0
        assert m["engine/prefill_tokens"] > 0
    [events] = glob.glob(os.path.join(tmp_path, "tb", "events.*"))
    with open(events, "rb") as f:
        logged = f.read()
    for key in ("time/weight_sync_s", "engine/tokens_per_s", "engine/slot_occupancy"):
        assert key.encode() in logged


def test_step_metrics_count_tool_waits_and_reset_each_step():
    """Multi-turn on the engine: while every episode is on its tool the device waits, and
    that time is `time/tool_wait_s`; each call reports what happened since the last."""
    model = M.init(M.ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4,
                                 n_kv_heads=2, d_ff=64, attention_impl="reference"), seed=3)
    sampler = engine_sampler.EngineSampler(model, slots=2)
    calls, lock = {}, threading.Lock()

    def on_turn(traj):
        with lock:
            calls[traj.request] = calls.get(traj.request, 0) + 1
            n = calls[traj.request]
        time.sleep(0.05 if traj.request == 0 else 0.3)  # one back first, one still out
        return [3, 4] if n < 2 else None

    def run():
        return sampler.run(model, [E.Request([1, 5, 9], key=i, on_turn=on_turn)
                                   for i in range(2)], max_len=64, max_new_tokens=4,
                           greedy=True)

    trajs = run()
    m = engine_sampler.step_metrics([sampler])
    tokens = sum(sum(t.mask) for t in trajs)
    assert m["engine/tokens"] == tokens == 16  # 2 episodes x 2 turns x 4 tokens
    assert m["time/tool_wait_s"] >= 0.05  # both on tools at once at least once
    assert m["engine/queue_on_tools_max"] >= 1 and m["engine/queue_waiting_max"] == 0
    assert m["engine/weight_syncs"] == 0 and m["time/weight_sync_s"] == 0
    assert 0 < m["engine/slot_occupancy"] <= 1
    assert engine_sampler.step_metrics([sampler])["engine/tokens"] == 0  # reset
    calls.clear()
    run()
    assert engine_sampler.step_metrics([sampler])["engine/tokens"] == 16
    assert engine_sampler.step_metrics([]) == {}
