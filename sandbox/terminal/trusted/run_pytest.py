"""The verifier's pytest, run by the image's python3 with -I -S (bin/pytest): no PYTHONPATH
from the environment, no user site, no .pth file and no sitecustomize of the agent's.
sys.path: the standard library, the supplied pytest, then PYTHONPATH and the image's
site-/dist-packages (their .pth files are not run). The ini file is the task's own in /tests
or an empty one (never one above the tests), conftest files come from /tests only, no plugin
is auto-loaded, and the verdict plugin goes first. The verifier's bin dir is taken off PATH
so that the tests see the task's PATH."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.join(HERE, "bin")
sys.path[:] = [p for p in sys.path if p and os.path.exists(p)]
sys.path.append(os.path.join(HERE, "site"))
sys.path += [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
_v = "python%d.%d" % sys.version_info[:2]
for base in (f"/usr/local/lib/{_v}", f"/usr/lib/{_v}", "/usr/lib/python3", "/usr/local/lib/python3"):
    for sub in ("site-packages", "dist-packages"):
        if os.path.isdir(os.path.join(base, sub)):
            sys.path.append(os.path.join(base, sub))
os.environ["PATH"] = ":".join(p for p in os.environ.get("PATH", "").split(":") if p != BIN)
os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
for var in ("PYTEST_PLUGINS", "PYTEST_ADDOPTS"):
    os.environ.pop(var, None)
_INI = ("pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
ini = next((os.path.join("/tests", n) for n in _INI if os.path.isfile(os.path.join("/tests", n))),
           os.path.join(HERE, "verifier.ini"))
import pytest  # noqa: E402

sys.exit(pytest.main(["-p", "ptrain_verdict", "-p", "no:cacheprovider", "-c", ini,
                      "--rootdir=/tests", "--confcutdir=/tests", "-rA", *sys.argv[1:]]))
