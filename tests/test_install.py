"""The package as a user installs it: setup.py's wheel, installed (not editable) into a fresh
venv outside the checkout, used from another directory. The checkout's editable install and
pytest's `pythonpath = .` cannot stand in for anything here.

One wheel build and one install for the module (a few seconds); the venv reaches the
installed dependencies through a .pth path line to this interpreter's site-packages, which
adds the directory but runs none of its .pth files (so the checkout's editable finder stays
out) and needs no network.
"""

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What setup.py packages (its find_packages roots), copied so the build writes nothing here.
SOURCES = ("setup.py", "ptrain", "sandbox", "long_context", "configs", "launch")


def _run(argv, **kwargs):
    p = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    assert p.returncode == 0, f"{argv}\n{p.stdout}\n{p.stderr}"
    return p


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory):
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        path = os.path.join(REPO, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(path, src / name)
    dist = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "--no-index", "-w", str(dist), str(src)])
    (wheel,) = dist.glob("ptrain-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
          "--no-index", str(wheel)])
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    with open(os.path.join(site.stdout.strip(), "_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return python


PROGRAM = """
import json, os
import ptrain, sandbox, sandbox.judge, sandbox.backends, ptrain.rewards, ptrain.config
from sandbox import terminal
result = sandbox.run("print(1+1)")
loaded = terminal.load_tasks(terminal.BUNDLED_TASKS)
here = os.path.dirname(sandbox.__file__)
print(json.dumps({
    "files": [m.__file__ for m in (ptrain, sandbox, ptrain.rewards, terminal)],
    "stdout": result.stdout_text, "ok": result.ok,
    "tasks": sorted(t.name for t in loaded.tasks), "skipped": len(loaded.skipped),
    "setup_host": os.path.isfile(os.path.join(here, "setup_host.sh"))}))
"""


def test_installed_wheel_imports_runs_the_sandbox_and_loads_bundled_tasks(venv_python,
                                                                           tmp_path):
    import json

    from sandbox import terminal
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = json.loads(_run([venv_python, "-c", PROGRAM], cwd=elsewhere, env=env).stdout)
    venv = os.path.dirname(os.path.dirname(venv_python))
    assert all(f.startswith(venv + os.sep) for f in out["files"]), out["files"]
    assert out["stdout"] == "2\n" and out["ok"]
    # The same tasks as the checkout's copy, none skipped.
    want = sorted(t.name for t in terminal.load_tasks(terminal.BUNDLED_TASKS).tasks)
    assert out["tasks"] == want and len(want) >= 12 and out["skipped"] == 0
    assert out["setup_host"]
