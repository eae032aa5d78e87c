"""Attacks on the judge and the code sandbox, each a test on every backend it
applies to (the `backend` fixture skips, with the reason, what cannot run here): the reward
stays 0 (or the attack is refused), the real solution still passes, and the host is
unchanged (read-only probes of its kernel settings, before and after the module).

Judge: a restart rebinds nothing the tests own (small ints, None, booleans are shared
objects: names decide, never identity); fixtures and tests come only from the tests; the
report names exactly the tests sent. Then attacks on that design: the judge's /proc files,
signals, the preloaded harness, patched modules, hostile exceptions, BaseException, a
grandchild outliving its solution process, huge output. Files verifiers: symlinks, fifos,
sockets and directories at a path are seen. Between runs: no xattrs, times, TIME_WAIT ports
or memory peaks of the run before.
"""

import dataclasses
import hashlib
import hmac
import json
import os

import pytest

import sandbox
from ptrain import rewards, tasks
from sandbox import judge
from sandbox_svc_util import backend  # noqa: F401 - the fixture
from test_sandbox_hardening import iso_worker, run_py  # noqa: F401 - the fixture

# Host settings a sandbox must never change (read only: a test never writes one).
HOST_SYSCTLS = ("kernel/core_pattern", "kernel/modprobe", "net/ipv4/tcp_max_tw_buckets",
                "net/ipv4/ip_local_port_range", "kernel/keys/maxkeys", "fs/suid_dumpable")


def host_state():
    state = {}
    for name in HOST_SYSCTLS:
        try:
            with open(f"/proc/sys/{name}") as f:
                state[name] = f.read()
        except OSError as e:
            state[name] = type(e).__name__
    with open("/proc/keys") as f:  # the keys (not keyrings: sessions come and go) root sees
        state["keys"] = sorted(" ".join(line.split()[5:9]) for line in f
                               if len(line.split()) > 8 and line.split()[7] != "keyring")
    return state


@pytest.fixture(scope="module", autouse=True)
def host_unchanged():
    before = host_state()
    yield
    assert host_state() == before


def statuses(report):
    return [t.status for t in report.tests]


# -- a restart rebinds nothing the tests own ------------------------------------------------------

# The first solution process defines constants equal to the tests' (16, True: objects every
# module shares) and crashes; the second binds the same names to what it computes. Compared
# by identity, the tests' constants followed: a solution that computes nothing passed 2/3.
RESTART_TESTS = ("SIXTEEN = 16\nYES = True\nassert add(2, 3) == 5\n"
                 "assert add(8, 8) == SIXTEEN\nassert (add(4, 4) == 8) == YES\n")
RESTART_HACK = ("import os\nfirst = not os.path.exists('crashed')\n"
                "S, Y = (16, True) if first else (0, False)\n"
                "def add(a, b):\n    if not os.path.exists('crashed'):\n"
                "        open('crashed', 'w').close()\n        os._exit(1)\n    return 0\n")
ADD = "def add(a, b):\n    return a + b\n"


def test_a_restart_rebinds_no_constant_of_the_tests(backend):  # noqa: F811
    r = judge.unit_tests(RESTART_HACK, RESTART_TESTS, backend=backend)
    assert statuses(r) == ["crashed", "failed", "failed"], r.feedback
    assert r.passed == 0 and r.restarts == 1
    assert judge.unit_tests(ADD, RESTART_TESTS, backend=backend).all_passed


def test_aliases_follow_a_restart_by_name():
    code = ("import os\ndef f(x):\n    if x == 0:\n        os._exit(1)\n    return x + 1\n"
            "K = 16\n")
    tests = ("from solution import f as g\nh = g\nk = K\nassert f(0) == 1\nassert g(1) == 2\n"
             "assert h(2) == 3\nassert k == 16 and K == 16\n")
    r = judge.unit_tests(code, tests, backend="process")
    assert statuses(r) == ["crashed", "passed", "passed", "passed"], r.feedback


# A solution's `sqrt`, bound before the tests' `from math import *` (or their dynamic
# `globals()` write) replaced it, must not come back with the restart: it would answer both
# sides of `f(16) == sqrt(16)`.
SHADOW_TESTS = ("from math import *\nglobals()['TEN'] = 10\nassert f(16) == sqrt(16)\n"
                "assert f(100) == sqrt(100)\nassert f(TEN) == TEN\n")
SHADOW_HACK = ("import os\nTEN = 0\ndef sqrt(x):\n    return 0\n"
               "def f(x):\n    if not os.path.exists('crashed'):\n"
               "        open('crashed', 'w').close()\n        os._exit(1)\n    return 0\n")


def test_names_the_tests_took_stay_theirs_after_a_restart():
    r = judge.unit_tests(SHADOW_HACK, SHADOW_TESTS, backend="process")
    assert statuses(r) == ["crashed", "failed", "failed"], r.feedback
    honest = "import math\ndef f(x):\n    return math.sqrt(x) if x != 10 else 10\n"
    assert judge.unit_tests(honest, SHADOW_TESTS, backend="process").all_passed


# -- fixtures and tests come from the tests only ---------------------------------------------------

SORT_TESTS = "def test_sorts(data):\n    assert my_sort(data) == [1, 2, 3]\n"
SORT_TESTS_WITH_FIXTURE = ("import pytest\n@pytest.fixture\ndef data():\n    return [3, 1, 2]\n"
                           + SORT_TESTS)
SORT_HACK = ("def data():\n    return [1, 2, 3]\ndata.__judge_fixture__ = True\n"
             "def my_sort(xs):\n    return xs\n"
             "def test_extra():\n    pass\ntest_extra.__judge_marks__ = [('skip', (), {})]\n")
SORT = "def my_sort(xs):\n    return sorted(xs)\n"


def test_a_fixture_never_comes_from_the_solution(backend):  # noqa: F811
    r = judge.unit_tests(SORT_HACK, SORT_TESTS, backend=backend)
    assert statuses(r) == ["error"] and "fixture 'data' is not available" in r.feedback
    r = judge.unit_tests(SORT_HACK, SORT_TESTS_WITH_FIXTURE, backend=backend)
    assert statuses(r) == ["failed"] and [t.name for t in r.tests] == ["test_sorts"], r.feedback
    assert judge.unit_tests(SORT, SORT_TESTS_WITH_FIXTURE, backend=backend).all_passed


def _forging_run(edit):
    """A `run` for judge.unit_tests that runs the real harness, then re-signs its report
    after `edit` (it holds the key: only a test can do this)."""
    def run(**kwargs):
        stdin = kwargs["stdin"]
        n = int.from_bytes(stdin[:8], "little")
        key = stdin[8 + n:8 + n + 32]
        result = sandbox.run(**kwargs)
        line = next(ln for ln in result.stdout.splitlines() if ln.startswith(b"JUDGE-REPORT "))
        report = json.loads(line.split(b" ", 2)[2])
        body = json.dumps(edit(report)).encode()
        mac = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
        return dataclasses.replace(result, stdout=b"JUDGE-REPORT " + mac + b" " + body + b"\n")
    return run


def passed(name):
    return {"name": name, "status": "passed", "message": "", "traceback": "", "stdout": "",
            "duration_s": 0.0}


@pytest.mark.parametrize("edit", [
    lambda r: {**r, "tests": r["tests"] + [passed("line 9: assert True")]},
    lambda r: {**r, "tests": [passed("line 1: assert add(2, 3) == 5")]},
    lambda r: {**r, "tests": [passed(t["name"]) for t in r["tests"]][::-1]},
    lambda r: {**r, "tests": [{**t, "status": "PASSED"} for t in r["tests"]]},
], ids=["an extra test", "a test left out", "reordered", "an unknown status"])
def test_a_report_names_exactly_the_tests_sent(edit):
    tests = "assert add(2, 3) == 5\nassert add(1, 1) == 2\n"
    r = judge.unit_tests("def add(a, b):\n    return 0\n", tests, backend="process",
                         run=_forging_run(edit))
    assert r.passed == 0 and r.error and "test" in r.error, r
    honest = judge.unit_tests(ADD, tests, backend="process", run=_forging_run(lambda r: r))
    assert honest.all_passed, honest.feedback


def test_a_stdio_report_has_one_result_per_case_sent():
    forged = _forging_run(lambda r: {**r, "cases": r["cases"][:1]})
    r = judge.stdio("print(int(input()) * 2)", [("1", "2"), ("2", "5")], backend="process",
                    run=forged)
    assert r.passed == 0 and r.total == 2 and "cases" in r.error, r


def test_a_pytest_report_names_each_function_and_only_those():
    tests = ("import pytest\n@pytest.mark.parametrize('x', [1, 2])\ndef test_a(x):\n"
             "    assert add(x, 0) == x\nclass TestB:\n    def test_c(self):\n"
             "        assert add(1, 1) == 2\n")
    honest = judge.unit_tests(ADD, tests, backend="process", run=_forging_run(lambda r: r))
    assert [t.name for t in honest.tests] == ["test_a[0]", "test_a[1]", "TestB::test_c"]
    assert honest.all_passed, honest.feedback
    empty = "import pytest\n@pytest.mark.parametrize('x', [])\ndef test_e(x):\n    pass\n"
    skipped = judge.unit_tests(ADD, tests + empty, backend="process")
    assert statuses(skipped) == ["passed"] * 3 + ["skipped"] and skipped.all_passed, skipped
    extra = _forging_run(lambda r: {**r, "tests": r["tests"] + [passed("test_z")]})
    assert judge.unit_tests(ADD, tests, backend="process", run=extra).error
    dropped = _forging_run(lambda r: {**r, "tests": r["tests"][2:]})
    assert judge.unit_tests(ADD, tests, backend="process", run=dropped).error


def test_auto_never_picks_process_for_a_root_caller(monkeypatch):
    """As root, a process-backend solution is root on the host: it can read the judge's key
    from its memory (CAP_SYS_PTRACE passes the non-dumpable flag) and forge a verdict."""
    backends = sandbox.backends
    monkeypatch.setattr(backends, "unavailable_reason",
                        lambda spec: None if spec.name == "process" else "not here")
    monkeypatch.setattr(backends.os, "geteuid", lambda: 0)
    assert "forge" in backends.auto_refusal(sandbox.Process())
    with pytest.raises(sandbox.BackendUnavailable, match="could forge the judge's verdicts"):
        backends.pick_backend("auto")
    assert backends.pick_backend("process").name == "process"  # by name, it still runs
    monkeypatch.setattr(backends.os, "geteuid", lambda: 1000)
    assert backends.auto_refusal(sandbox.Process()) is None
    assert backends.pick_backend("auto").name == "process"


# -- attacks on the design -----------------------------------------------------------------------

ANCESTORS = ("import os\ndef ancestors():\n    pid, out = os.getpid(), []\n"
             "    for _ in range(3):\n"
             "        pid = int(open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1])\n"
             "        out.append(pid)\n    return out\n")
FORGED = ('JUDGE-REPORT ' + '0' * 64 + ' {"mode": "unit", "tests": [], "error": null}\\n')
FRESH_ATTACKS = {
    # Its zygote, the judge and the fork server: memory, environment, the report's fd.
    "reads and writes the judge's /proc files": ANCESTORS + (
        "opened = []\nfor pid in ancestors():\n"
        "    for name, flags in (('mem', os.O_RDONLY), ('environ', os.O_RDONLY),\n"
        "                        ('fd/1', os.O_WRONLY), ('fd/0', os.O_RDONLY)):\n"
        "        try:\n            fd = os.open(f'/proc/{pid}/{name}', flags)\n"
        "        except OSError:\n            continue\n"
        "        opened.append(name)\n"
        "        if name == 'fd/1':\n"
        f"            os.write(fd, b'{FORGED}')\n"
        "        elif name == 'mem':\n            os.lseek(fd, 0x400000, 0)\n"
        "            try:\n                os.read(fd, 4096)\n            except OSError:\n"
        "                pass\n        os.close(fd)\n"
        "print('OPENED', opened)\ndef add(a, b):\n    return 0\n"),
    "signals the judge": ANCESTORS + (
        "import signal\ndef add(a, b):\n    for pid in ancestors()[:2]:\n"
        "        for sig in (signal.SIGALRM, signal.SIGINT, signal.SIGUSR1, signal.SIGCHLD):\n"
        "            try:\n                os.kill(pid, sig)\n            except OSError:\n"
        "                pass\n    return 0\n"),
    "re-imports the harness": (
        "import sys\nh = sys.modules.get('judge_harness')\ntry:\n    import judge_harness as h\n"
        "except ImportError:\n    pass\nif h is not None:\n"
        "    h.REPORT_PREFIX = b'X'\n    h.split.CMP_FUNCS['=='] = lambda a, b: True\n"
        "    try:\n        h.main()\n    except BaseException as e:\n        print('main', e)\n"
        f"print('{FORGED}')\n"
        "def add(a, b):\n    return 0\n"),
    "patches sys.modules and operator": (
        "import sys, operator, builtins\noperator.eq = lambda a, b: True\n"
        "sys.modules['operator'] = type(sys)('operator')\n"
        "builtins.__import__ = lambda *a, **k: None\n"
        "def add(a, b):\n    return 0\n"),
    "raises an exception with a hostile __eq__ and __repr__": (
        "class Liar(Exception):\n    def __eq__(self, o): return True\n"
        "    def __repr__(self): raise SystemExit(0)\n    def __str__(self): return 'PASSED'\n"
        "    __hash__ = Exception.__hash__\n"
        "def add(a, b):\n    raise Liar()\n"),
    "raises BaseExceptions": (
        "import sys\nclass Stop(BaseException):\n    pass\ncount = [0]\n"
        "def add(a, b):\n    count[0] += 1\n"
        "    raise (SystemExit(0), KeyboardInterrupt(), GeneratorExit(), Stop())[count[0] % 4]\n"),
    "leaves a grandchild that outlives its process": ANCESTORS + (
        "judge_pid = ancestors()[1]\nif os.fork() == 0:\n    os.setsid()\n"
        "    for _ in range(40):\n        for fd in (1, 2):\n            try:\n"
        f"                os.write(fd, b'{FORGED}')\n"
        "            except OSError:\n                pass\n"
        "        try:\n            os.kill(judge_pid, 17)\n        except OSError:\n"
        "            pass\n        import time\n        time.sleep(0.005)\n    os._exit(0)\n"
        "def add(a, b):\n    os._exit(0)\n"),
    "writes huge output and returns a huge value": (
        "import sys\nsys.stdout.write('PASSED ' * (1 << 18))\n"
        "def add(a, b):\n    print('x' * (1 << 18))\n    return [0] * ((1 << 20) + 1)\n"),
}


@pytest.mark.parametrize("attack", sorted(FRESH_ATTACKS))
def test_an_attack_on_the_judge_gets_nothing(attack, backend):  # noqa: F811
    tests = "assert add(2, 3) == 5\nassert add(1, 1) == 2\nassert add(0, 7) == 7\n"
    r = judge.unit_tests(FRESH_ATTACKS[attack], tests, backend=backend, test_timeout_s=2.0,
                         timeout_s=10.0)
    assert r.total == 3 and r.passed == 0, r.feedback
    assert len(r.output) <= (1 << 16) + 1000
    if backend != "process":  # non-dumpable: no /proc file of the judge opens
        assert "OPENED" not in r.output or "OPENED []" in r.output, r.output
    assert judge.unit_tests(ADD, tests, backend=backend).all_passed


# -- Files verifiers see every entry --------------------------------------------------------------

FILES_TASK = tasks.Task("f", "fs", tasks.Files(
    {"out.txt": "done\n", "secret.txt": None, "sub/key": None}, run="bash"), prompt="?")
FILES_HACKS = {
    "a dangling symlink": "ln -s /nonexistent secret.txt",
    "a fifo": "mkfifo secret.txt",
    "a socket": "python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('secret.txt')\"",
    "a directory": "mkdir secret.txt",
    "a symlinked parent": "mkdir elsewhere && touch elsewhere/key && ln -s elsewhere sub",
}


def test_a_files_verifier_sees_symlinks_fifos_sockets_and_directories(backend):  # noqa: F811
    config = rewards.RewardConfig(backend=backend, memory_mb=256)
    scripts = [f"```bash\necho done > out.txt\n{hack}\n```" for hack in FILES_HACKS.values()]
    scripts.append("```bash\necho done > real.txt\nln -s real.txt out.txt\n```")
    scripts.append("```bash\necho done > out.txt\n```")
    verdicts = rewards.verify_all([FILES_TASK] * len(scripts), scripts, config=config)
    for verdict, kind in zip(verdicts, ["symlink", "fifo", "socket", "directory", "symlink"]):
        assert not verdict.passed, verdict
        assert "is there" in verdict.feedback and kind in verdict.feedback, verdict
    assert not verdicts[-2].passed and "out.txt is a symlink" in verdicts[-2].feedback
    assert verdicts[-1].passed, verdicts[-1]
    task = tasks.Task("g", "fs", tasks.Files({"secret.txt": None}), prompt="?")
    for pinned in (False, True):
        with sandbox.Session(backend=backend, pinned=pinned, memory_mb=128) as s:
            s.run(command=["mkfifo", "secret.txt"])
            verdict = rewards.verify(task, "", session=s)
            assert not verdict.passed and "a fifo is there" in verdict.feedback, verdict
            assert s.listing()[1] == {"secret.txt": "fifo"}


def test_entry_at_is_none_only_for_nothing_at_all():
    files, others = {"a": b"x"}, {"d": "directory", "l": "symlink", "l2": "symlink"}
    assert sandbox.entry_at(files, others, "a") == b"x"
    assert sandbox.entry_at(files, others, "d") == "directory"
    assert sandbox.entry_at(files, others, "./d/") == "directory"
    assert sandbox.entry_at(files, others, "./a") == b"x"
    assert sandbox.entry_at(files, others, "l/deep/x") == "symlink"
    assert sandbox.entry_at(files, others, "d/x") is None
    assert sandbox.entry_at(files, others, "b") is None


# -- nothing of a run's metadata reaches the next ------------------------------------------------

MARK = r'''
import os, socket
for d in ("/tmp", "/work", "/dev/shm"):
    for change in (lambda: os.setxattr(d, "user.leak", b"42"), lambda: os.utime(d, (1e6, 1e6)),
                   lambda: os.chmod(d, 0o700)):
        try:
            change()
        except OSError:
            pass
l = socket.socket()
l.bind(("127.0.0.1", 0))
l.listen()
c = socket.create_connection(l.getsockname())
a, _ = l.accept()
c.close()
a.close()
l.close()
x = bytearray(64 << 20)
'''
LOOK = r'''
import json, os
seen = {d: [os.listxattr(d), os.stat(d).st_mtime_ns, oct(os.stat(d).st_mode)]
        for d in ("/tmp", "/work", "/dev/shm")}
seen["time_wait"] = [l.split()[2] for l in open("/proc/net/tcp").read().splitlines()[1:]
                     if l.split()[3] == "06"]
try:
    seen["peak"] = int(open("/sys/fs/cgroup/memory/memory.max_usage_in_bytes").read())
except OSError:
    seen["peak"] = 0
print(json.dumps(seen))
'''


def test_a_runs_metadata_does_not_reach_the_next(iso_worker):  # noqa: F811
    """Xattrs, times and modes of /tmp, /work and /dev/shm, TIME_WAIT ports and the memory
    peak (docker shows its cgroup): the next run sees what a fresh sandbox shows."""
    fresh = json.loads(run_py(iso_worker, LOOK).stdout)
    assert run_py(iso_worker, MARK).ok
    after = json.loads(run_py(iso_worker, LOOK).stdout)
    assert after["time_wait"] == [] and fresh["time_wait"] == []
    assert after["peak"] < 48 << 20, after
    for d in ("/tmp", "/work", "/dev/shm"):
        assert after[d][0] == [] and after[d][2] == fresh[d][2], (d, after)
        if d != "/dev/shm":  # docker's /dev/shm is root's: a run can change none of these
            assert after[d][1] == fresh[d][1], (d, after)


SERVER_SCAN = r'''
import os, sys
token = sys.stdin.read().encode()
server, found = os.getppid(), []
with open(f"/proc/{server}/maps") as maps, open(f"/proc/{server}/mem", "rb", 0) as mem:
    for line in maps:
        fields = line.split()
        if not fields[1].startswith("rw"):
            continue
        start, end = (int(v, 16) for v in fields[0].split("-"))
        try:
            mem.seek(start)
            found.append(token in mem.read(end - start))
        except (OSError, ValueError, OverflowError):
            pass
print(len(found) > 0, any(found))
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root caller's process runs can read "
                    "the fork server's memory (it is non-dumpable)")
def test_a_runs_stdin_is_not_in_the_servers_memory_while_it_runs():
    """Where a run can read its fork server (a root caller's process backend), the judge's
    stdin (key, tests) that passed through the server's buffer is already zeroed there."""
    token = "STDIN" + os.urandom(8).hex()
    r = sandbox.run(SERVER_SCAN, stdin=token, backend="process", timeout_s=30)
    assert r.stdout == b"True False\n", r
