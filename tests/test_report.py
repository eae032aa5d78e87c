"""ptrain.report: the run report of a work dir written by the real writers (MetricsWriter's
metrics.jsonl and rollouts.jsonl, eval_rows' eval.jsonl of closed_loop.eval_summary rows),
its escaping of model output, and its rendering in a real headless browser (Debian's chromium,
installed by sandbox/setup_host.sh). The closed loop's own report is asserted in
tests/test_closed_loop.py's quickstart run."""

import base64
import logging
import os
import re
import shutil
import subprocess
import sys
import types

import ml_collections
import numpy as np
import pytest
from PIL import Image

from ptrain import closed_loop, eval_rows, jsonl, report
from ptrain.metrics import MetricsWriter
from ptrain.report import episodes, svg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVIL = "<script>document.body.setAttribute('data-pwned','1');console.error('pwned')</script>"
TOOL_TURN = ('<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n'
             "</tool_call>\n<tool_response>\n42\n</tool_response>\nanswer: 42\n")
# held-out passes out of 4 per (stage, domain): what the tables must show
PASSES = {("sft", "code"): 1, ("sft", "arith"): 2, ("rl", "code"): 3, ("rl", "arith"): 2}


def _eval_rows(path):
    """eval.jsonl as the closed loop writes it: eval_rows.evaluate_once, each row
    closed_loop.eval_summary of episodes with those verdicts."""
    config = ml_collections.ConfigDict(dict(eval=dict(sample=False, n=4)))
    heldout = {"code": [None] * 4, "arith": [None] * 4}

    def evaluate(*, stage, step, config, heldout, skip, on_line, on_progress):
        for domain in heldout:
            eps = [types.SimpleNamespace(
                verdicts=[types.SimpleNamespace(reward=float(i < PASSES[stage, domain]),
                                                passed=i < PASSES[stage, domain])],
                finish="answered") for i in range(4)]
            on_line({"stage": stage, "step": step, "split": "heldout", "domain": domain,
                     "decoding": "greedy", **closed_loop.eval_summary(eps, 1)})

    for stage, step in (("sft", 8), ("rl", 4)):
        eval_rows.evaluate_once(evaluate, path, stage, step, config=config, heldout=heldout)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A finished run's work dir: SFT and RL metrics, rollouts of steps 1 and 4 (a tool call,
    a completion with a <script>, a CAD-like render), held-out evals after SFT and RL."""
    root = tmp_path_factory.mktemp("run")
    os.makedirs(root / "artefacts")
    render = np.zeros((24, 32, 3), np.uint8)
    render[:, :16] = (200, 30, 30)
    Image.fromarray(render).save(root / "artefacts" / "part.png")
    with MetricsWriter(root / "sft", total_steps=8, primary=True, desc="sft") as w:
        for step in range(1, 9):
            w.write(step, {"sft/loss": 4.0 / step})
    with MetricsWriter(root, total_steps=4, primary=True, desc="rl") as w:
        for step in range(1, 5):
            w.write(step, {"reward/mean": 0.2 * step, "reward/code/mean": 0.25 * step,
                           "reward/arith/mean": 0.1 * step, "episode/code/passed": 0.25 * step,
                           "episode/arith/passed": 0.1 * step})
            if step in (1, 4):
                w.write_rollouts(step, [
                    dict(prompt="arith: 6 times 7 = ? (python)\n", completion=TOOL_TURN,
                         reward=1.0, passed=True, domain="arith", feedback="Correct.",
                         task_id="train/arith/1", turns=2, tool_calls=1),
                    dict(prompt="code: f(x) = x plus 1\n", completion=f"def f(x):\n {EVIL}",
                         reward=0.0, passed=False, domain="code", error_type="SyntaxError",
                         feedback=f"0/3 tests passed: {EVIL}", task_id="train/code/2"),
                    dict(prompt="cad: a plate", completion="box(10, 10, 2)", reward=0.8,
                         passed=True, domain="code", feedback="IoU 0.80",
                         artefacts={"render": "artefacts/part.png", "step": "x.step"})])
    _eval_rows(str(root / "eval.jsonl"))
    return str(root)


def test_report_shows_heldout_results_curves_and_episodes_with_model_output_as_text(workdir):
    page = open(report.write_report(workdir)).read()
    # held-out pass@1 per environment after SFT and after RL, and the change
    for domain in ("code", "arith"):
        sft, rl = PASSES["sft", domain] / 4, PASSES["rl", domain] / 4
        assert re.search(rf"<tr><td>{domain}</td><td>{sft:.3f} .*?</td><td>{rl:.3f} .*?</td>"
                         rf'<td[^>]*>{re.escape(f"{rl - sft:+.3f}")}</td></tr>', page), domain
    # curves: reward (all + 2 environments), pass@1 (2), SFT loss (1)
    assert page.count("<svg") == 3 and page.count('class="series"') == 6
    # episodes: the tool call and the sandbox's answer apart, the verdict, the feedback
    assert '<pre class="call">&lt;tool_call&gt;' in page and "print(6*7)" in page
    assert re.search(r'<pre class="result">&lt;tool_response&gt;\s*42', page)
    assert "verdict: failed (SyntaxError)" in page
    # model output is text: no markup of it reaches the page
    assert "<script" not in page and page.count("&lt;script&gt;") == 4  # 2 steps x 2 places
    # the render inline, byte for byte; no reference outside the file
    data = base64.b64encode(open(os.path.join(workdir, "artefacts", "part.png"), "rb").read())
    assert f'src="data:image/png;base64,{data.decode()}"' in page
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", page)


def test_segments_split_tool_calls_and_results_of_each_chat_format():
    assert [k for k, _ in episodes.segments(TOOL_TURN)] == ["call", "result", "model"]
    llama = ("<|python_tag|>print(1)<|eom_id|><|start_header_id|>ipython<|end_header_id|>\n\n"
             "1<|eot_id|>done")
    assert [k for k, _ in episodes.segments(llama)] == ["pycall", "result", "model"]
    assert episodes.segments("just text") == [("model", "just text")]


def test_a_report_that_cannot_be_written_is_logged_and_never_raised(tmp_path, caplog):
    os.makedirs(tmp_path / "report.html")  # os.replace onto a directory fails
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    with caplog.at_level(logging.ERROR, logger="ptrain.report"):
        assert report.write_report_quietly(str(tmp_path)) is None
    assert "the run report of" in caplog.text and (tmp_path / "metrics.jsonl").exists()
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="neither a training run's work dir"):
        report.write_report(str(tmp_path / "empty"))


def test_launch_report_writes_the_report_of_a_finished_work_dir(workdir):
    if os.path.exists(os.path.join(workdir, "report.html")):
        os.remove(os.path.join(workdir, "report.html"))
    p = subprocess.run([sys.executable, "-m", "launch.report", workdir], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == os.path.join(workdir, "report.html")
    assert os.path.getsize(p.stdout.strip()) > 1000


# --------------------------------------------------------------------- a real browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary (sandbox/setup_host.sh installs Debian's "
    "chromium where apt-get is available)")


def _chromium(page, *args):
    """(stdout, the console messages) of headless chromium on a file."""
    p = subprocess.run([CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox",
                        "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000",
                        "--window-size=1200,1600", *args, f"file://{page}"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout, [line for line in p.stderr.splitlines() if ":CONSOLE" in line]


@needs_chromium
def test_report_renders_in_chromium_without_console_errors(workdir, tmp_path):
    # The console capture sees what a page logs (else "no console error" would mean nothing).
    control = tmp_path / "control.html"
    control.write_text(f"<!DOCTYPE html><html><body>{EVIL}</body></html>")
    dom, console = _chromium(control, "--dump-dom")
    assert 'data-pwned="1"' in dom and any("pwned" in line for line in console)

    page = report.write_report(workdir)
    dom, console = _chromium(page, "--dump-dom")
    assert console == []
    assert 'data-pwned="1"' not in dom and "&lt;script&gt;document" in dom  # shown, not run
    assert dom.count('class="heldout"') == 1 and dom.count('class="series"') == 6
    rollouts = jsonl.read(os.path.join(workdir, "rollouts.jsonl"))
    assert dom.count('class="episode"') == len(episodes.sample(rollouts)) == 6

    shot = tmp_path / "shot.png"
    _, console = _chromium(page, f"--screenshot={shot}")
    assert console == []
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    table = pixels[120:420, 40:500].mean(axis=2)  # the held-out table, under the headings
    assert (table < 80).mean() > 0.003 and (table > 230).mean() > 0.3  # text on white
    line = np.array([int(svg.COLOURS[0][i:i + 2], 16) for i in (1, 3, 5)])
    assert (np.abs(pixels - line).sum(axis=2) < 60).sum() > 100  # a curve is drawn
