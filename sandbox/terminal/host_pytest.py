"""The real pytest, for task images that lack it.

Terminal-Bench tests run pytest; a task image built without network often has python3 but no
pytest. The harness then supplies the host's own pytest distribution (and those it requires:
pluggy, iniconfig, packaging, pygments), copied once into a host directory that each task
container mounts read-only at /opt/ptrain-pytest. The verifier puts it on PYTHONPATH and PATH
only when the image's python3 cannot import pytest itself. Pure Python: any python3 in the
image new enough for that pytest runs it.
"""

import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import tempfile

from sandbox.terminal.container import PYTEST_MOUNT

# Run by the verifier before the task's test script: puts the supplied pytest where the
# task's script finds it, if the image has none of its own.
ACTIVATE = (f'if ! python3 -c "import pytest" >/dev/null 2>&1 && [ -d {PYTEST_MOUNT} ]; then '
            f'export PYTHONPATH="{PYTEST_MOUNT}/site${{PYTHONPATH:+:$PYTHONPATH}}" '
            f'PATH="$PATH:{PYTEST_MOUNT}/bin"; fi')
_LAUNCHER = '#!/bin/sh\nexec python3 -m pytest "$@"\n'
log = logging.getLogger("sandbox.terminal")


def _closure(name: str, seen: dict) -> None:
    dist = importlib.metadata.distribution(name)
    key = dist.metadata["Name"].lower().replace("_", "-")
    if key in seen:
        return
    seen[key] = dist
    for req in dist.requires or ():
        if "extra ==" in req:
            continue
        marker_ok = True
        if ";" in req:
            req, marker = req.split(";", 1)
            marker_ok = _marker_holds(marker)
        if marker_ok:
            _closure(re.split(r"[\s<>=!~\[(]", req.strip(), 1)[0], seen)


def _marker_holds(marker: str) -> bool:
    """The environment markers pytest's requirements use (python_version, sys_platform)."""
    try:
        from packaging.markers import Marker
        return Marker(marker).evaluate()
    except Exception:  # noqa: BLE001 (unknown marker: leave that requirement out)
        return False


def pytest_dir() -> str | None:
    """A host directory with site/ (pytest and its requirements) and bin/pytest; made once
    per pytest version, reused after that. None where this host has no pytest to give."""
    dists = {}
    try:
        _closure("pytest", dists)
    except importlib.metadata.PackageNotFoundError as e:
        log.warning("no pytest on this host to supply to task images without one (%s)", e)
        return None
    tag = hashlib.sha256(" ".join(sorted(f"{k}=={d.version}" for k, d in dists.items()))
                         .encode()).hexdigest()[:12]
    root = os.path.join(tempfile.gettempdir(), f"ptrain-term-pytest-{tag}")
    if os.path.isfile(os.path.join(root, "bin", "pytest")):
        return root
    shutil.rmtree(root, ignore_errors=True)  # a copy a crash left half made
    tmp = tempfile.mkdtemp(prefix=f"ptrain-term-pytest-{tag}-", dir=tempfile.gettempdir())
    site = os.path.join(tmp, "site")
    for dist in dists.values():
        for f in dist.files or ():
            src = str(dist.locate_file(f))
            rel = str(f)
            if rel.startswith("..") or os.path.isabs(rel) or "__pycache__" in rel:
                continue  # scripts outside site-packages; byte code is compiled in place
            if not os.path.isfile(src):
                continue
            dst = os.path.join(site, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(src, dst)
    os.makedirs(os.path.join(tmp, "bin"))
    with open(os.path.join(tmp, "bin", "pytest"), "w") as f:
        f.write(_LAUNCHER)
    os.chmod(os.path.join(tmp, "bin", "pytest"), 0o755)
    for top, dirs, files in os.walk(tmp):  # readable by any uid in the container
        os.chmod(top, 0o755)
        for name in files:
            path = os.path.join(top, name)
            os.chmod(path, os.stat(path).st_mode | 0o444)
    try:
        os.rename(tmp, root)
    except OSError:  # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return root
