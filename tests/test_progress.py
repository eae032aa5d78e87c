"""ptrain.progress: on a terminal a bar, in a log file a line at a bounded interval with
done/total, rate and ETA (a fake clock: no sleeps, no timing thresholds)."""

import io
import logging

from ptrain import metrics
from ptrain.progress import Progress


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_log_lines_at_a_bounded_interval_with_rate_and_eta(caplog):
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="ptrain.progress"):
        p = Progress(100, desc="rl", unit="step", bar=False, interval_s=60, clock=clock)
        for step in range(1, 101):  # 2 s a step
            clock.now += 2
            p.advance_to(step, **{"reward/mean": 0.25})
    starting, *lines = [r.getMessage() for r in caplog.records]
    assert starting == "rl: starting at 0/100 steps"
    # the first, then one every 60 s (30 steps), then the last
    assert [line.split(":")[1].split()[0] for line in lines] == ["1/100", "31/100", "61/100",
                                                                 "91/100", "100/100"]
    assert lines[1] == ("rl: 31/100 steps (31%), 2 s/step, ETA 2m18s, elapsed 1m02s, "
                        "reward/mean 0.25")


def test_a_resumed_bar_counts_its_rate_from_where_it_resumed(caplog):
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="ptrain.progress"):
        p = Progress(20, desc="sft", unit="step", initial=10, bar=False, clock=clock)
        clock.now += 5
        p.update(5)
    assert caplog.records[1].getMessage() == ("sft: 15/20 steps (75%), 1 step/s, ETA 0m05s, "
                                              "elapsed 0m05s")


def test_a_bar_on_a_terminal_and_no_log_lines(caplog):
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger="ptrain.progress"):
        p = Progress(4, desc="eval rl", unit="task", bar=stream)
        p.update(2)
        p.close()
    assert "eval rl" in stream.getvalue() and "2/4" in stream.getvalue()
    assert not caplog.records


def test_the_metrics_writer_logs_sft_and_rl_progress_in_a_log_file(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ptrain.progress"):
        with metrics.MetricsWriter(tmp_path, total_steps=3, desc="sft", progress=False) as w:
            w.write(1, {"sft/loss": 2.5})
    assert caplog.records[1].getMessage().startswith("sft: 1/3 steps (33%)")
    assert caplog.records[1].getMessage().endswith("sft/loss 2.5")
