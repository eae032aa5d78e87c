import os
import subprocess

SCRIPT = "/app/bin/greet"


def test_is_executable():
    assert os.path.isfile(SCRIPT), f"{SCRIPT} is missing"
    assert os.access(SCRIPT, os.X_OK), f"{SCRIPT} is not executable"


def test_greets_by_name():
    for name in ("Ada", "Grace Hopper"):
        r = subprocess.run([SCRIPT, name], capture_output=True, text=True, timeout=10)
        assert r.returncode == 0, r.stderr
        assert r.stdout == f"Hello, {name}!\n"


def test_usage_without_argument():
    r = subprocess.run([SCRIPT], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2
    assert r.stdout == ""
    assert "usage: greet NAME" in r.stderr
