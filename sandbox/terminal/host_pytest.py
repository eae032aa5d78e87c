"""The verifier's own pytest, from a read-only directory the agent's state cannot shadow.

The host's pytest distribution (and those it requires: pluggy, iniconfig, packaging,
pygments), the runner and the verdict plugin of `trusted/` are copied once into a host
directory that every task box mounts read-only at /opt/ptrain-pytest. The verifier puts its
bin/ first on PATH: `pytest` and `python3 -m pytest` there run this pytest by the image's
python3 in isolated mode (trusted/run_pytest.py), whatever pytest the image or the agent has.
Pure Python: any python3 in the image new enough for that pytest runs it.
"""

import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import tempfile

from sandbox.terminal.container import PYTEST_MOUNT

VERDICT_DIR = "/logs/ptrain-verdict"  # where the verdict plugin writes (trusted/)
BIN = f"{PYTEST_MOUNT}/bin"  # first on the verifier's PATH: pytest, python3, python
_TRUSTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trusted")
# (file of trusted/, its path in the mounted directory, its mode)
_FILES = (("pytest.sh", "bin/pytest", 0o755), ("python.sh", "bin/python3", 0o755),
          ("python.sh", "bin/python", 0o755), ("run_pytest.py", "run_pytest.py", 0o644),
          ("ptrain_verdict.py", "site/ptrain_verdict.py", 0o644),
          ("verifier.ini", "verifier.ini", 0o644))
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
    ours = b"".join(open(os.path.join(_TRUSTED, src), "rb").read() for src, _, _ in _FILES)
    tag = hashlib.sha256(" ".join(sorted(f"{k}=={d.version}" for k, d in dists.items()))
                         .encode() + ours).hexdigest()[:12]
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
    for src, rel, mode in _FILES:
        shutil.copyfile(os.path.join(_TRUSTED, src), os.path.join(tmp, rel))
        os.chmod(os.path.join(tmp, rel), mode)
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
