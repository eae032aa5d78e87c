"""Exact resume: a tiny GRPO run SIGKILLed at points drawn from a seed (during generation,
scoring, the update, after the metrics, during an asynchronous checkpoint save) and restarted
after each kill writes the same metrics.jsonl and rollouts.jsonl (timings aside) as the run
never interrupted, with rl.staleness=0, 1 and 2 (batch t+k generated at step t, from the
parameters before update t, each batch scored in a thread meanwhile), and with 2 and
rl.interrupt (the generation in flight switches to the new weights after its first
round); the staleness-1 run trains LoRA adapters on a frozen base (its checkpoints hold the
adapters only); the staleness-2 run draws its prompts from two environments by the adaptive
sampler (`ptrain.mixture`: learning progress and a task filter, observed on the staleness
schedule), whose state the checkpoints hold. The runs are in tests/resume_program.py."""

import json
import os
import signal
import subprocess
import sys

import pytest

from ptrain.metrics import read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, KILLS = 6, 3
pytestmark = pytest.mark.xdist_group("resume")


def _logs(workdir):
    # Timings aside, and the engine's own counters (engine/*: what this process's engines did
    # in the step's wall-clock window, which with k >= 1 holds parts of overlapping
    # generations, and which a resumed run that trains on a checkpoint's finished batches
    # never re-generates): observations of the process, not of the training.
    untimed = [{k: v for k, v in r.items() if not k.startswith(("time/", "engine/"))}
               for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))]
    return untimed, read_jsonl(os.path.join(workdir, "rollouts.jsonl"))


@pytest.mark.parametrize("staleness,seed,interrupt,lora,adaptive",
                         [(0, 0, 0, 0, 0), (1, 3, 0, 1, 0), (2, 7, 0, 0, 1), (2, 5, 1, 0, 0)])
def test_sigkill_at_seeded_points_then_resume_equals_the_uninterrupted_run(
        tmp_path, staleness, seed, interrupt, lora, adaptive):
    # (The runs read their programs from the test run's compilation cache, conftest.py.)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}
    out = subprocess.run([sys.executable, os.path.join(REPO, "tests", "resume_program.py"),
                          str(tmp_path), str(staleness), str(STEPS), str(seed), str(KILLS),
                          str(interrupt), str(lora), str(adaptive)],
                         env=env, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.splitlines()[-1])
    points = report["points"]
    # Every child died at its point, none of an error; the last one finished the run.
    assert report["reference"] == 0 and report["finished"] == 0, out.stderr[-3000:]
    assert report["killed"] == [-signal.SIGKILL] * KILLS, (points, out.stderr[-3000:])
    metrics, rollouts = _logs(tmp_path / "killed")
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1)), points
    reference = _logs(tmp_path / "reference")
    assert metrics == reference[0], points
    if lora:  # the checkpoint holds the adapters, not the frozen base
        from ptrain.checkpoint import Checkpointer
        with Checkpointer(str(tmp_path / "killed" / "checkpoints")) as ckpt:
            saved = ckpt.param_shapes()
        assert saved and all(path[-1].endswith(("_lora_a", "_lora_b")) for path in saved)
    assert rollouts == reference[1], points
    if staleness:  # each row's version within k of the learner's: k after the first steps
        for r in metrics:
            lag = min(r["step"] - 1, staleness)
            assert r["rollout/staleness"] == lag
            assert r["rollout/staleness_hist"] == [0] * lag + [16] + [0] * (staleness - lag)
        assert rollouts and all(r["policy_version"] == max(0, r["step"] - staleness - 1)
                                for r in rollouts)
    if adaptive:  # the draw followed the verdicts: its weights moved off the configured ones
        weights = [(r["tasks/weight/a"], r["tasks/weight/b"]) for r in metrics]
        assert all(a + b == pytest.approx(1.0) for a, b in weights), weights
        assert weights[0] == (0.5, 0.5) and len(set(weights)) > 2, weights
    if interrupt:  # batches generated during an update took its version after 4 tokens
        for r in metrics:
            tokens = r["rollout/token_staleness_hist"]
            assert (r["rollout/interrupted"] > 0) == (r["step"] > staleness), r
            lag = min(r["step"] - 1, staleness)
            assert sum(tokens[lag - 1:lag + 1] if r["step"] > staleness else tokens[lag:]) \
                == sum(tokens), r
