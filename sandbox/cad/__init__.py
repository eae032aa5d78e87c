"""CAD in the sandbox: build a model's CadQuery script, then measure what it built where the
script never ran.

    from sandbox import cad
    report = cad.build_and_measure(script, target={"part": stl_bytes})
    report.text            # the observation for the model: build error, or the measurements
    report.measurement     # the numbers (None if the build failed); report.png: the render

Two runs, each in a sandbox of the CAD backend (`spec`: an interpreter with CadQuery that the
sandbox can read, its fork server preimporting it):
1. the build (`build_program.py`): the script runs, leaves `result`, and the program exports
   out/NAME.stl per part and out/part.step;
2. the measurement (`geometry.py`), in a fresh run that receives only those STL files and the
   target's (never shown to the build): solid check, volume, area, bounding box, IoU,
   Chamfer, interference between parts, named checks, and a render.
So the numbers come from the geometry alone: nothing the script prints or writes besides its
meshes reaches them, and the target is never readable from the run the script controls.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import sys

from sandbox import backends
from sandbox.backends.preimport import PREIMPORT
from sandbox.request import Limits

VENV = os.environ.get("PTRAIN_CAD_VENV", "/opt/ptrain/cad")
IMAGE = os.environ.get("PTRAIN_CAD_IMAGE", "ptrain-cad:latest")
# What the fork server imports before it forks a run (OCP's import is seconds).
MODULES = PREIMPORT + ("numpy", "cadquery", "trimesh", "manifold3d", "scipy.spatial",
                       "matplotlib.figure", "matplotlib.backends.backend_agg")
LIMITS = Limits(memory_mb=3072, max_processes=64)
BUILD_TIMEOUT_S = 60.0
MEASURE_TIMEOUT_S = 60.0
MAX_MESH_MB = 64  # an export larger than this fails the build (RLIMIT_FSIZE)
_HERE = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)
def _source(name: str) -> str:
    with open(os.path.join(_HERE, name)) as f:
        return f.read()


def _host_has_cadquery() -> bool:
    return all(importlib.util.find_spec(m) for m in ("cadquery", "trimesh", "manifold3d"))


def spec(backend: str = "auto"):
    """The sandbox backend spec for CAD runs: `backend` ("process", "bwrap", "docker" or
    "auto": the strongest that can run here, never process for a root caller, as
    `sandbox.backends.pick_backend`) with CadQuery's interpreter and preimports."""
    python = os.path.join(VENV, "bin", "python")
    if backend == "auto":
        return backends.strongest([spec(c.name) for c in backends.STRONGEST_FIRST], what="CAD")
    if backend == "process":
        return backends.Process(python=sys.executable if _host_has_cadquery() else python,
                                preimport=MODULES)
    if backend == "bwrap":
        return backends.Bwrap(python=python, ro_binds=(VENV,), preimport=MODULES)
    if backend == "docker":
        return backends.Docker(image=IMAGE, python=python, preimport=MODULES)
    raise ValueError(f"unknown CAD backend {backend!r}: use auto, process, bwrap or docker")


def unavailable_reason(backend: str = "auto") -> str | None:
    """Why CAD runs cannot use `backend` here (None if they can)."""
    try:
        s = spec(backend)
    except backends.BackendUnavailable as e:
        return str(e)
    reason = backends.unavailable_reason(s)
    if reason is None and s.python != sys.executable and not os.path.exists(
            os.path.join(VENV, "ptrain-packages")) and s.name != "docker":
        reason = f"no CAD venv at {VENV} (bash sandbox/setup_host.sh builds it)"
    return reason


@dataclasses.dataclass
class Report:
    """What one build + measurement gave. `built`: the script ran and exported solids;
    `measurement`: geometry.py's numbers (None when the build failed); `text`: the observation
    the model reads; `files`: the exported STL/STEP (artefacts for people); `png`: the render."""

    built: bool
    text: str
    measurement: dict | None = None
    build_error: str | None = None
    stdout: str = ""
    files: dict = dataclasses.field(default_factory=dict)
    png: bytes | None = None


def build(script: str, *, backend="auto", timeout_s: float = BUILD_TIMEOUT_S):
    """Runs `script` in a fresh CAD sandbox run; returns (Result, build.json as a dict or None,
    {path: bytes} of out/)."""
    from sandbox.session import run
    result = run(_source("build_program.py"), files={"script.py": script},
                 backend=spec(backend) if isinstance(backend, str) else backend,
                 memory_mb=LIMITS.memory_mb, max_processes=LIMITS.max_processes,
                 timeout_s=timeout_s, return_files=True, max_file_mb=MAX_MESH_MB,
                 max_files_bytes=(MAX_MESH_MB + 1) << 20)
    files = {p: d for p, d in (result.files or {}).items() if p.startswith("out/")}
    try:
        report = json.loads(files.pop("out/build.json"))
        report = report if isinstance(report, dict) else None
    except (KeyError, ValueError):
        report = None
    return result, report, files


def measure(parts: dict, target: dict | None = None, checks=(), *, render=True,
            backend="auto", timeout_s: float = MEASURE_TIMEOUT_S) -> dict:
    """geometry.py's numbers for `parts` (name -> STL bytes) against `target`, in a fresh run
    that holds only those meshes. A run that fails comes back as {"ok": False, "error": ...}."""
    from sandbox.session import run
    files = {f"parts/{n}.stl": d for n, d in parts.items()}
    files.update({f"target/{n}.stl": d for n, d in (target or {}).items()})
    request = {"parts": {n: f"parts/{n}.stl" for n in parts},
               "target": {n: f"target/{n}.stl" for n in target} if target else None,
               "checks": list(checks), "render": render}
    result = run(_source("geometry.py"), files=files, stdin=json.dumps(request),
                 backend=spec(backend) if isinstance(backend, str) else backend,
                 memory_mb=LIMITS.memory_mb, max_processes=LIMITS.max_processes,
                 timeout_s=timeout_s, return_files=render)
    try:
        out = json.loads(result.stdout_text)
    except ValueError:
        return {"ok": False, "error": f"the measurement failed: {result.describe()}: "
                                      f"{result.stderr_text[-500:]}"}
    if render and result.files and "render.png" in result.files:
        out["png"] = result.files["render.png"]
    return out


def build_and_measure(script: str, target: dict | None = None, checks=(), *, render=True,
                      backend="auto", build_timeout_s: float = BUILD_TIMEOUT_S) -> Report:
    """Builds `script`, measures its parts (against `target` and `checks` when given), and
    writes the observation. Raises ValueError only for a bad task (a target that is not a
    closed solid); everything the script does comes back in the Report."""
    result, report, files = build(script, backend=backend, timeout_s=build_timeout_s)
    stdout = result.stdout_text[-2000:]
    if result.timed_out:
        error = f"the build timed out after {build_timeout_s:g} s"
    elif result.oom:
        error = "the build ran out of memory"
    elif report is None:
        error = f"the build did not finish ({result.describe()})"
    else:
        error = report.get("error") if not report.get("ok") else None
    if error is None and not any(p.endswith(".stl") for p in files):
        error = "the build exported no part"
    if error is not None:
        return Report(False, f"Build failed: {error}", build_error=str(error), stdout=stdout,
                      files=files)
    parts = {os.path.basename(p)[:-4]: d for p, d in files.items() if p.endswith(".stl")}
    m = measure(parts, target, checks, render=render, backend=backend)
    if m.get("task_error"):
        raise ValueError(f"the CAD task is bad, not the script: {m['error']}")
    png = m.pop("png", None)
    return Report(bool(m.get("ok")), describe(m), measurement=m, stdout=stdout,
                  files=files, png=png)


def describe(m: dict) -> str:
    """The measurement as the model reads it."""
    if not m.get("ok"):
        return f"Build failed: {m.get('error')}"
    lines = ["Built:"]
    for name, p in m["parts"].items():
        size = " x ".join(f"{x:.3g}" for x in p["size"])
        lines.append(f"- {name}: volume {p['volume']:.4g}, area {p['area']:.4g}, size {size}, "
                     f"bbox {_xyz(p['bbox_min'])} to {_xyz(p['bbox_max'])}, "
                     f"{p['bodies']} bod{'y' if p['bodies'] == 1 else 'ies'}, watertight")
    t = m.get("target")
    if t:
        lines.append(f"Against the target: IoU {t['iou']:.3f}, Chamfer {t['chamfer']:.4f} "
                     f"(of the target's diagonal), bounding box off by {t['bbox_error']:.3f}, "
                     f"volume off by {100 * t['volume_error']:.1f}%")
    for c in m.get("contacts", ()):
        a, b = c["parts"]
        if c["interference"] > 0:
            lines.append(f"- {a} and {b} collide: overlap volume {c['interference']:.4g}")
        elif c["clearance"] is not None:
            lines.append(f"- {a} and {b}: clearance {c['clearance']:.4g}")
    failed = [c for c in m.get("checks", ()) if not c["passed"]]
    for c in failed:
        how = f"off by {c['by']:.4g}" if c.get("by") is not None else c.get("why", "")
        lines.append(f"Check failed: {c['name']} ({how})")
    return "\n".join(lines)


def _xyz(v) -> str:
    return "(" + ", ".join(f"{x:.3g}" for x in v) + ")"
