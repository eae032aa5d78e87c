"""Alerts fire on crafted runs (a NaN, rewards forced to 0, a sandbox that times out, ...) and
stay quiet on real metric streams (tests/data: the toy GRPO / PPO runs and the quickstart's SFT
stage, as launch/train.py wrote them)."""

import json
import math
import os
import subprocess
import sys
import threading

import pytest

from ptrain import alerts, rewards, tasks

DATA = os.path.join(os.path.dirname(__file__), "data")
STREAMS = ("metrics_grpo_toy.jsonl", "metrics_ppo_toy.jsonl", "metrics_quickstart_sft.jsonl")


def stream(name):
    with open(os.path.join(DATA, name)) as f:
        return [json.loads(line) for line in f]


def run(records, config=None):
    monitor = alerts.Monitor(config)
    fired = []
    for r in records:
        fired += monitor.check(r["step"], r)
    return fired


@pytest.mark.parametrize("name", STREAMS)
def test_none_fires_on_real_runs(name):
    # The toy runs solve their task: reward 1.0 and entropy 1e-3 by the end, which is fine.
    assert run(stream(name), alerts.AlertConfig(stall="off")) == []


@pytest.mark.parametrize("key", ["optim/loss", "optim/grad_norm", "sft/loss"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_stops(key, bad):
    records = stream("metrics_grpo_toy.jsonl")[:6]
    records[4] = {**records[4], key: bad}
    fired = run(records)
    assert [(a.name, a.action, a.step) for a in fired] == [("nonfinite", "stop", 5)]
    assert key in fired[0].message and "checkpoint is not written" in fired[0].message
    assert alerts.as_metrics(fired) == {"alert/nonfinite": 1.0}
    with pytest.raises(alerts.AlertStop, match=f"step 5: nonfinite: non-finite {key}="):
        alerts.raise_on_stop(fired)
    alerts.raise_on_stop(run(records[:4]))  # nothing to stop


def test_nonfinite_can_warn_instead():
    records = [{"step": 1, "optim/loss": math.nan}]
    fired = run(records, alerts.AlertConfig(nonfinite="warn"))
    assert [a.action for a in fired] == ["warn"]
    alerts.raise_on_stop(fired)
    assert run(records, alerts.AlertConfig(nonfinite="off")) == []


def test_reward_collapse_when_rewards_forced_to_zero():
    records = stream("metrics_grpo_toy.jsonl")
    forced = [dict(r, **{"reward/mean": 0.0}) if r["step"] > 20 else r for r in records]
    config = alerts.AlertConfig(entropy_collapse="off")  # (its entropy is 1e-3 by then)
    fired = run(forced, config)
    assert {a.name for a in fired} == {"reward_collapse"}
    # window of 5: the mean falls below 0.3 x best (1.0) once 4 of the 5 last are zero
    assert fired[0].step == 24 and "best 0.9996" in fired[0].message
    fired = run(forced, alerts.AlertConfig(reward_collapse="stop", reward_window=2))
    collapse = [a for a in fired if a.name == "reward_collapse"]
    assert collapse[0].step == 22 and collapse[0].action == "stop"
    assert {a.name for a in fired if a.step == 22} == {"reward_collapse", "entropy_collapse"}


def test_a_monitor_restored_from_its_state_fires_what_the_uninterrupted_one_does():
    """A resumed run gets the history from its checkpoint (JSON), so the collapse fires at
    the same step as without the restart."""
    records = stream("metrics_grpo_toy.jsonl")
    forced = [dict(r, **{"reward/mean": 0.0}) if r["step"] > 20 else r for r in records]
    config = alerts.AlertConfig(entropy_collapse="off")
    before = alerts.Monitor(config)
    for r in forced[:22]:
        before.check(r["step"], r)
    state = json.loads(json.dumps(before.state()))
    resumed, fresh = alerts.Monitor(config), alerts.Monitor(config)
    resumed.restore(state)
    fired = [a for r in forced[22:] for a in resumed.check(r["step"], r)]
    assert [a.step for a in fired] == [a.step for a in run(forced, config)] == [24, 25, 26,
                                                                               27, 28, 29, 30]
    assert [a for r in forced[22:] for a in fresh.check(r["step"], r)] == []  # no history
    assert alerts.Monitor(config).state() == {"rewards": [], "best_reward": None}


def test_no_reward_collapse_before_any_reward():
    records = [{"step": i, "reward/mean": 0.0 if i % 3 else 0.05} for i in range(1, 30)]
    assert run(records) == []  # best stays under reward_min_best


def test_kl_and_logp_mismatch_blowup():
    records = stream("metrics_ppo_toy.jsonl")[:10]
    records[6] = {**records[6], "kl/k1": 3.5}
    records[7] = {**records[7], "actor/ppo_kl": 2.0}
    records[8] = {**records[8], "rollout/logp_mismatch": 0.9}
    fired = run(records)
    assert [(a.name, a.step) for a in fired] == [("kl_blowup", 7), ("kl_blowup", 8),
                                                ("logp_mismatch", 9)]
    assert "kl/k1=3.5" in fired[0].message and "actor/ppo_kl=2" in fired[1].message
    assert run(records, alerts.AlertConfig(kl_max=5.0, logp_mismatch_max=1.0)) == []


def test_entropy_collapse_only_while_unsolved():
    records = stream("metrics_grpo_toy.jsonl")
    unsolved = [dict(r, **{"reward/mean": 0.2}) for r in records]
    fired = run(unsolved, alerts.AlertConfig(reward_collapse="off"))
    assert {a.name for a in fired} == {"entropy_collapse"}
    first = min(r["step"] for r in records if r["actor/entropy"] < 0.01)
    assert fired[0].step == first and "reward/mean=0.2" in fired[0].message


def test_sandbox_error_rate_from_a_sandbox_that_times_out():
    add = tasks.Task("add", "code", tasks.UnitTests("assert add(1, 2) == 3\n"), prompt="add")
    hang = "def add(a, b):\n    while True:\n        pass\n"
    good = "def add(a, b):\n    return a + b\n"
    config = rewards.RewardConfig(timeout_s=2.0, test_timeout_s=0.3)
    verdicts = rewards.verify_all([add] * 4, [hang, hang, hang, good], config=config)
    assert [v.error_type for v in verdicts] == ["timeout"] * 3 + [""]
    rate = alerts.sandbox_error_rate(v.error_type for v in verdicts)
    assert rate == 0.75
    assert alerts.sandbox_error_rate(["", "AssertionError", "NameError"]) == 0.0
    assert alerts.sandbox_error_rate([]) == 0.0
    fired = run([{"step": 1, "sandbox/error_rate": rate}, {"step": 2, "sandbox/error_rate": 0.25}])
    assert [(a.name, a.step) for a in fired] == [("sandbox_errors", 1)]
    assert "sandbox/error_rate=0.75" in fired[0].message


def test_config_from_section_rejects_unknown_keys():
    c = alerts.AlertConfig.from_config({"kl_max": 2.0, "stall": "stop"})
    assert c.kl_max == 2.0 and c.stall == "stop" and c.nonfinite == "stop"
    assert alerts.AlertConfig.from_config(alerts.defaults()) == alerts.AlertConfig()
    with pytest.raises(ValueError, match=r"unknown keys \['kl_maximum'\]"):
        alerts.AlertConfig.from_config({"kl_maximum": 2.0})
    with pytest.raises(ValueError, match="alerts.nonfinite='explode'"):
        alerts.AlertConfig(nonfinite="explode")


def test_watchdog_fires_on_a_stall_and_rearms_after_a_beat():
    messages, fired = [], threading.Event()

    def on_stall(message):
        messages.append(message)
        fired.set()

    dog = alerts.Watchdog(stall_minutes=0.2 / 60, on_stall=on_stall, poll_s=0.01)
    with dog:
        dog.beat(3)
        assert fired.wait(30)
        assert "no step finished" in messages[0] and "after step 3" in messages[0]
        fired.clear()
        dog.beat(4)
        assert fired.wait(30)
        assert "after step 4" in messages[-1]


def test_watchdog_quiet_while_steps_progress():
    messages = []
    dog = alerts.Watchdog(stall_minutes=1.0, on_stall=messages.append, poll_s=0.001)
    with dog:
        for step in range(200):
            dog.beat(step)
    assert messages == [] and not dog._thread.is_alive()
    alerts.Watchdog(stall_minutes=1.0, action="off").start().close()  # no thread at all


def test_watchdog_stop_exits_the_process_with_a_message():
    code = ("import time; from ptrain import alerts\n"
            "alerts.Watchdog(stall_minutes=0.1 / 60, action='stop', poll_s=0.01).start()\n"
            "time.sleep(60)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHONPATH": root})
    assert p.returncode == alerts.STALL_EXIT_CODE, p.stderr
    assert "alert: stall: no step finished" in p.stderr
    assert "time.sleep" in p.stderr or "line 3" in p.stderr  # the stuck thread's stack


def test_a_nan_stops_training_and_keeps_the_last_good_checkpoint(tmp_path):
    """The toy GRPO run with NaN rewards injected at step 3: the learner stops there with the
    alert's message, before writing step 3's checkpoint; step 2's is the latest."""
    import dataclasses

    import jax
    import numpy as np

    from configs import grpo_toy
    from flax import nnx

    from ptrain import learner, rollout, sharding
    from ptrain.checkpoint import Checkpointer
    from ptrain.metrics import read_jsonl

    config = grpo_toy.get_config()
    config.steps, config.checkpoint.every = 6, 1
    config.checkpoint.async_save = False
    mesh = sharding.make_mesh(fsdp=1, devices=jax.devices()[:1])
    calls = []

    def poisoned(params, records, key):
        calls.append(1)
        batch = producer.score(producer.generate(params, records, key))
        if len(calls) == 3:
            batch = dataclasses.replace(batch, rewards_b=np.full_like(batch.rewards_b, np.nan))
        return batch

    model_learner = learner.Learner(config, mesh=mesh)
    producer = rollout.SingleTurn(config, rollout.make_sampler(
        nnx.merge(model_learner.graphdef, model_learner.initial_params), config))
    with pytest.raises(alerts.AlertStop, match=r"step 3: nonfinite: non-finite .*grad_norm"):
        learner.train(config, str(tmp_path), rollout_fn=poisoned, mesh=mesh,
                      params=model_learner.initial_params)
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        assert ckpt.latest_step() == 2
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert lines[2]["alert/nonfinite"] == 1.0 and "alert/nonfinite" not in lines[1]
