"""colabs/quickstart.ipynb runs top to bottom on the short quickstart and shows what it made.

The notebook is executed by a real Jupyter kernel (nbclient); its parameters cell gets a copy
of the work dir of the short quickstart that tests/conftest.py's `quickstart_run` launched
(tests/test_closed_loop.py asserts that run trains end to end and resumes): the notebook's
`closed_loop.run` resumes it (loads the finished SFT and RL checkpoints, repeats no
evaluation), then shows the evaluations, reward curve and rollouts. Formats are asserted
here, gains by the quickstart test.
"""

import json
import os
import re
import shutil

import matplotlib.image
import nbclient
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

from configs import quickstart

pytestmark = pytest.mark.xdist_group("closed_loop")  # not alongside the other long loop test

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "colabs", "quickstart.ipynb")
DOMAINS = ("code", "arith", "files")
CONFIG = quickstart.get_config("short")
EVAL_N = CONFIG.eval.n
# The cell's overrides are applied (an unknown key is an error); these equal the run's own
# values, so the notebook resumes the finished run instead of training again.
OVERRIDES = {"steps": CONFIG.steps, "eval.n": EVAL_N}


def _kernel(tmp_path, monkeypatch) -> str:
    """The `python3` kernel spec (jupyter_client starts it with this interpreter); installed
    into a temp Jupyter path when the machine has none."""
    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        import ipykernel.kernelspec
        ipykernel.kernelspec.install(prefix=str(tmp_path / "jupyter"))
        monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter" / "share" / "jupyter"))
    return "python3"


def _one_device(monkeypatch):
    """The kernel sees the host as a researcher's machine does: not conftest's 8 simulated
    devices (the quickstart's mesh is one device)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    monkeypatch.setenv("XLA_FLAGS", " ".join(
        f for f in flags if "xla_force_host_platform_device_count" not in f))


def _outputs(cell, kind):
    return [o for o in cell.outputs if o.output_type == kind]


def test_quickstart_notebook_runs_and_shows_its_results(quickstart_run, tmp_path, monkeypatch):
    finished, proc = quickstart_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, "the notebook needs one code cell tagged 'parameters'"
    assert 'CONFIG_ARG = "short"' in params[0].source
    workdir = tmp_path / "run"
    shutil.copytree(finished, workdir)
    with open(workdir / "rollouts.jsonl") as f:
        logged = [json.loads(line) for line in f]
    params[0].source += f"\nWORKDIR = {str(workdir)!r}\nOVERRIDES = {OVERRIDES!r}\n"

    _one_device(monkeypatch)
    client = nbclient.NotebookClient(
        nb, kernel_name=_kernel(tmp_path, monkeypatch), timeout=600,
        resources={"metadata": {"path": os.path.join(REPO, "colabs")}})
    client.execute()  # raises CellExecutionError, with the traceback, if a cell fails
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert not any(_outputs(c, "error") for c in code)

    # eval.jsonl: after SFT and after RL, one greedy held-out line per domain.
    with open(workdir / "eval.jsonl") as f:
        evals = [json.loads(line) for line in f]
    assert sorted((e["stage"], e["domain"]) for e in evals) == sorted(
        (s, d) for s in ("sft", "rl") for d in DOMAINS)
    for e in evals:
        assert set(e) == {"stage", "step", "split", "domain", "decoding", "pass_rate", "n",
                          "pass@1", "samples", "truncated", "finish"}
        assert (e["split"], e["decoding"], e["n"]) == ("heldout", "greedy", EVAL_N)
        assert e["step"] == {"sft": CONFIG.sft.steps, "rl": CONFIG.steps}[e["stage"]]
        assert e["pass_rate"] * EVAL_N == pytest.approx(round(e["pass_rate"] * EVAL_N))

    # The printed table shows exactly those numbers.
    text = "".join(o.text for c in code for o in _outputs(c, "stream"))
    rate = {(e["stage"], e["domain"]): e["pass_rate"] for e in evals}
    for domain in DOMAINS:
        row = re.search(rf"^{domain} +([\d.]+) +([\d.]+) +[-+][\d.]+p +(\d+)$", text, re.M)
        assert row, f"no table row for {domain} in the notebook's output:\n{text}"
        assert float(row[1]) == pytest.approx(rate[("sft", domain)], abs=5e-4)
        assert float(row[2]) == pytest.approx(rate[("rl", domain)], abs=5e-4)
        assert int(row[3]) == EVAL_N

    # The reward curve: a real PNG, shown inline.
    image = matplotlib.image.imread(workdir / "reward_curve.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    shown = [o for c in code for o in _outputs(c, "display_data") if "image/png" in o.data]
    assert len(shown) == 1

    # Rollout samples: the fields the last cell prints, and they are printed.
    with open(workdir / "rollouts.jsonl") as f:
        samples = [json.loads(line) for line in f]
    assert samples == logged  # the run's, not one more step's
    for s in samples:
        assert {"prompt", "completion", "feedback", "reward", "domain", "step"} <= set(s)
        assert s["domain"] in DOMAINS and 0.0 <= s["reward"] <= 1.0
    assert samples[-1]["completion"] in text
