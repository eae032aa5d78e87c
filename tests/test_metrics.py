"""ptrain.metrics: JSONL + TensorBoard logs, rollouts, plots, progress bar, resume."""

import glob
import io
import logging
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from ptrain.metrics import MetricsWriter, read_jsonl


def read_events(path):
    """Events of a TensorBoard file (TFRecord: length, crc, payload, crc)."""
    events, data = [], open(path, "rb").read()
    while data:
        (n,) = struct.unpack("<Q", data[:8])
        events.append(event_pb2.Event.FromString(data[12:12 + n]))
        data = data[12 + n + 4:]
    return events


def tb_scalars(workdir):
    out = {}
    for path in sorted(glob.glob(os.path.join(workdir, "tb", "events.*"))):
        for e in read_events(path):
            for v in e.summary.value:
                out.setdefault(v.tag, []).append((e.step, v.simple_value))
    return out


def sample(i, reward):
    return {"prompt": f"p{i}", "completion": f"c{i}", "reward": reward, "feedback": "ok",
            "domain": "code"}


def test_writes_jsonl_tensorboard_rollouts_and_plots(tmp_path):
    with MetricsWriter(tmp_path, total_steps=3) as w:
        for step in (1, 2, 3):
            w.write(step, {"reward/mean": jnp.float32(step / 4), "kl": np.float64(0.01 * step),
                           "response_length": step * 10, "lr": 1e-4,
                           "moe/load": jnp.asarray([0.25, 0.75])})  # a vector: a histogram
            w.write_rollouts(step, [sample(step, np.float32(0.5))])
        with pytest.raises(ValueError, match="must be a number"):
            w.write(4, {"reward": [[1.0, 2.0]]})
        with pytest.raises(ValueError, match=r"lacks \['completion'\]"):
            w.write_rollouts(4, [{"prompt": "p", "reward": 1.0}])
        paths = w.plot()
        assert w.plot(["lr"]) == [str(tmp_path / "plots" / "lr.png")]
        with pytest.raises(ValueError, match="no metric named"):
            w.plot(["accuracy"])
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3] and lines[2]["reward/mean"] == 0.75
    assert lines[1]["response_length"] == 20.0 and lines[0]["moe/load"] == [0.25, 0.75]
    rollouts = read_jsonl(tmp_path / "rollouts.jsonl")
    assert rollouts[0] == {"step": 1, **sample(1, 0.5)}
    assert len(tb_scalars(tmp_path)["moe/load"]) == 3  # histograms
    assert tb_scalars(tmp_path)["kl"] == [(1, pytest.approx(0.01)), (2, pytest.approx(0.02)),
                                          (3, pytest.approx(0.03))]
    assert sorted(os.path.basename(p) for p in paths) == \
        ["kl.png", "response_length.png", "reward_mean.png"]
    for p in paths:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_resume_truncates_past_the_restored_step(tmp_path, caplog):
    with MetricsWriter(tmp_path) as w:
        for step in range(1, 6):
            w.write(step, {"reward": float(step)})
            w.write_rollouts(step, [sample(step, 1.0), sample(step, 0.0)])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')  # a write torn by the crash
    # The run crashed; the latest checkpoint was step 3. Steps 4, 5 are redone.
    with caplog.at_level(logging.WARNING):
        with MetricsWriter(tmp_path, start_step=3) as w:
            for step in (4, 5):
                w.write(step, {"reward": 10.0 * step})
                w.write_rollouts(step, [sample(step, 0.5)])
    assert any("torn last line" in r.getMessage() for r in caplog.records)
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward"]) for r in metrics] == \
        [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    assert [r["step"] for r in read_jsonl(tmp_path / "rollouts.jsonl")] == [1, 1, 2, 2, 3, 3, 4, 5]
    # TensorBoard: the second event file asks to purge everything from step 4 on.
    second = sorted(glob.glob(str(tmp_path / "tb" / "events.*")))[-1]
    starts = [e.step for e in read_events(second) if e.session_log.status == 1]  # START
    assert starts == [4]


def test_malformed_line_in_the_middle_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not valid JSON"):
        MetricsWriter(tmp_path, start_step=1)


def test_progress_bar_eta_and_quiet_without_tty(tmp_path, capsys):
    stream = io.StringIO()
    with MetricsWriter(tmp_path / "a", total_steps=10, start_step=2, progress=stream) as w:
        w.write(5, {"reward/mean": 0.5})
    out = stream.getvalue()
    assert "5/10" in out and "<" in out and "reward/mean=0.5" in out  # elapsed<remaining
    with MetricsWriter(tmp_path / "b", total_steps=10) as w:  # stderr is not a TTY here
        w.write(1, {"reward/mean": 0.5})
    assert capsys.readouterr().err == ""  # (log lines instead: tests/test_progress.py)


def test_only_the_primary_process_writes(tmp_path):
    """With many processes, process 0 writes; the others check their input and write nothing."""
    with MetricsWriter(tmp_path / "other", total_steps=3, primary=False) as w:
        w.write(1, {"reward/mean": 0.5})
        w.write_rollouts(1, [sample(1, 0.5)])
        assert w.plot() == []
        with pytest.raises(ValueError, match="must be a number"):
            w.write(2, {"reward": [[1.0, 2.0]]})
        with pytest.raises(ValueError, match=r"lacks \['completion'\]"):
            w.write_rollouts(2, [{"prompt": "p", "reward": 1.0}])
    assert not os.path.exists(tmp_path / "other")
    with MetricsWriter(tmp_path / "one") as w:  # one process: it is process 0
        assert w.primary
        w.write(1, {"reward/mean": 0.5})
    assert read_jsonl(tmp_path / "one" / "metrics.jsonl") == [{"step": 1, "reward/mean": 0.5}]


def tb_events(directory):
    """{tag: [(step, summary value)]} of every event file in `directory`."""
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "events.*"))):
        for e in read_events(path):
            for v in e.summary.value:
                out.setdefault(v.tag, []).append((e.step, v))
    return out


def test_250_domains_stay_readable_in_tensorboard_and_complete_in_jsonl(tmp_path):
    """Per-domain metrics of 250 domains (batch.domain_metrics' keys): every one in
    metrics.jsonl, grouped under domain/ in TensorBoard, with the per-step count, best and
    worst k, a histogram and the ranking text; held-out eval lines summarised alike."""
    import types

    from ptrain import batch, metrics
    names = [f"env{i:03d}" for i in range(250)]
    rewards = {d: (i * 37 % 250) / 249 for i, d in enumerate(names)}  # distinct, shuffled
    steps = {1: names, 2: names[:100]}  # step 2 sees 100 of them
    # The adaptive draw's weights (`ptrain.mixture`): of every environment, each step.
    weights = {f"tasks/weight/{d}": r / sum(rewards.values()) for d, r in rewards.items()}
    with MetricsWriter(tmp_path, total_steps=2) as w:
        for step, seen in steps.items():
            episodes = types.SimpleNamespace(  # two rows per domain, as a producer leaves them
                meta=[{"domain": d, "passed": float(rewards[d] > 0.5), "turns": 1} for d in seen
                      for _ in range(2)],
                rewards_b=np.asarray([rewards[d] for d in seen for _ in range(2)]))
            w.write(step, {"reward/mean": 0.5, **batch.domain_metrics(episodes), **weights})
        assert [os.path.basename(p) for p in w.plot()] == ["reward_mean.png"]
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    for line, seen in zip(lines, steps.values()):
        assert {k for k in line if k.startswith("reward/env")} == {
            f"reward/{d}/mean" for d in seen}
        assert all(line[f"reward/{d}/mean"] == pytest.approx(rewards[d]) for d in seen)
        assert all(f"episode/{d}/passed" in line and f"episode/{d}/turns" in line for d in seen)
        assert {k: v for k, v in line.items() if k.startswith("tasks/weight/")} == weights
    tb = tb_events(tmp_path / "tb")
    assert [v.histo.num for _, v in tb["tasks/weight"]] == [250, 250]  # summaries only
    assert not any(t.startswith("tasks/weight/env") for t in tb)
    assert tb["tasks/weight/max"][0][1].simple_value == pytest.approx(max(weights.values()))
    assert {t for t in tb if t.startswith("domain/") and t.endswith("/reward")} == {
        f"domain/{d}/reward" for d in names}
    assert not any(t.startswith("reward/env") for t in tb)  # not 250 curves among the others
    assert [(s, v.simple_value) for s, v in tb["domains/count"]] == [(1, 250), (2, 100)]
    assert [(s, v.simple_value) for s, v in tb["domains/seen"]] == [(1, 250), (2, 250)]
    ranked = sorted(rewards.values())
    for k in (1, 5):
        assert tb[f"domains/reward/best_{k}"][0][1].simple_value == pytest.approx(ranked[-k])
        assert tb[f"domains/reward/worst_{k}"][0][1].simple_value == pytest.approx(ranked[k - 1])
    assert "domains/reward/best_6" not in tb
    assert tb["domains/reward/mean"][0][1].simple_value == pytest.approx(np.mean(ranked))
    histo = tb["domains/reward"][0][1].histo  # one value per domain
    assert histo.num == 250 and histo.min == 0 and histo.max == pytest.approx(1.0)
    assert tb["domains/passed"][0][1].histo.num == 250
    best = max(rewards, key=rewards.get)
    text = tb["domains/reward/ranking/text_summary"][0][1].tensor.string_val[0].decode()
    worst = min(rewards, key=rewards.get)
    assert f"| best 1 | {best} |" in text and f"| worst 1 | {worst} |" in text
    # Resumed after step 1: the domains seen so far come from the kept lines.
    with MetricsWriter(tmp_path, start_step=1) as w:
        w.write(2, {"reward/fresh/mean": 1.0})
    tb = tb_events(tmp_path / "tb")
    assert tb["domains/seen"][-1][0] == 2 and tb["domains/seen"][-1][1].simple_value == 251

    # Held-out evaluation, one line per domain and decoding (closed_loop.evaluate's lines).
    evals = [{"stage": "rl", "step": 7, "split": "heldout", "domain": d, "decoding": dec,
              "pass_rate": rewards[d], "pass@1": rewards[d], "n": 4, "samples": 1,
              "truncated": 0.0, "finish": {"answer": 4}}
             for d in names for dec in ("greedy", "sample")]
    metrics.write_eval(tmp_path, evals)
    tb = tb_events(tmp_path / "tb" / "eval")
    per_domain = {t for t in tb if t.startswith("eval_domain/")}
    assert {t for t in per_domain if t.endswith("/rl_greedy/pass_rate")} == {
        f"eval_domain/{d}/rl_greedy/pass_rate" for d in names}
    for run in ("rl_greedy", "rl_sample"):
        assert [(s, v.simple_value) for s, v in tb[f"eval/{run}/count"]] == [(7, 250)]
        assert tb[f"eval/{run}/pass_rate"][0][1].histo.num == 250
        assert tb[f"eval/{run}/pass_rate/worst_1"][0][1].simple_value == pytest.approx(0.0)
    assert not any("finish" in t or "/split" in t for t in tb)
