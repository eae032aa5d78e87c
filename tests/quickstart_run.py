"""configs/quickstart.py:short launched as `make quickstart` launches it (`python -m
launch.train`, one CPU device as on a laptop): tests/conftest.py's `quickstart_run` runs it
once a session for the tests that read a finished quickstart run (tests/test_closed_loop.py's
end to end and resume, tests/test_colab.py's notebook), all in xdist group closed_loop."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(workdir: str, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launch.train", "--config=configs/quickstart.py:short",
           f"--workdir={workdir}", *overrides]
    env = dict(os.environ, XLA_FLAGS=" ".join(  # one CPU device, as on a laptop, and LLVM -O1:
        [f for f in os.environ.get("XLA_FLAGS", "").split()  # its cost is running, not compiling
         if "device_count" not in f and "optimization_level" not in f
         and "expensive_passes" not in f] + ["--xla_backend_optimization_level=1"]))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
