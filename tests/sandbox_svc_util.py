"""Shared by the sandbox service tests (judge, pool, server, tools): a `backend` fixture that
skips with the reason when a backend cannot run here, the functions pool workers run in the
tests, and the pool drivers that run in a child process which is a subreaper, so that every
process the pool leaves behind is found."""

import ctypes
import functools
import json
import os
import random
import select
import signal
import sys
import threading

import pytest

import sandbox

BACKENDS = ("process", "bwrap", "docker")


@functools.lru_cache(maxsize=None)
def backend_problem(name):
    """None if `name` runs `print(1)` here, else why not."""
    reason = sandbox.unavailable_reason(sandbox.pick_backend(name))
    if reason:
        return reason
    try:
        result = sandbox.run("print(1)", backend=name, timeout_s=30)
    except Exception as e:  # noqa: BLE001 - any failure to start is a reason to skip
        return f"{name} cannot start a sandbox here: {type(e).__name__}: {str(e)[:300]}"
    return None if result.stdout == b"1\n" else f"{name} ran print(1) as {result.describe()}"


@pytest.fixture(params=BACKENDS)
def backend(request):
    problem = backend_problem(request.param)
    if problem:
        pytest.skip(f"backend {request.param} unavailable: {problem}")
    return request.param


# -- functions that pool workers run --------------------------------------------------------

def square(x):
    return x * x


def die_once(marker):
    """Kills its own worker the first time (leaving `marker`), returns on the retry."""
    if os.path.exists(marker):
        return "second attempt"
    with open(marker, "w"):
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def log_attempt(path):
    with open(path, "a") as f:
        f.write("attempt\n")


def raise_value_error(path):
    log_attempt(path)
    raise ValueError("bad input")


def always_die(path):
    log_attempt(path)
    os.kill(os.getpid(), signal.SIGKILL)


def read_fifo(path, timeout_s=None):
    """Blocks until someone writes to the FIFO at `path` (opening it blocks until then)."""
    with open(path) as f:
        return f.read()


def hold(started, release):
    """Tells the test it runs (opening FIFO `started` for writing blocks until the test opens
    it for reading), then waits for FIFO `release`."""
    with open(started, "w") as f:
        f.write("started")
    return read_fifo(release)


def fifos(tmp_path, *names):
    paths = [str(tmp_path / name) for name in names]
    for path in paths:
        os.mkfifo(path)
    return paths


def read_then_write(started, release, value):
    """The test's side of `hold`: waits until it runs, then lets it return `value`."""
    with open(started) as f:
        assert f.read() == "started"
    return lambda: _write(release, value)


def _write(path, value):
    with open(path, "w") as f:
        f.write(value)


# -- drivers, run as `python -c "import sandbox_svc_util as u; u.main()" MODE ARGS` ----------

def _subreaper():
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _children():
    """Pids (and command lines) of this process's children, zombies reaped first."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid():
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found[int(entry)] = f.read().replace(b"\0", b" ")[:200].decode("replace")
        except (OSError, ValueError, IndexError):
            continue
    return found


def leftovers(wait_s=15.0):
    """Children still alive `wait_s` after the pool closed (each waited on by pidfd)."""
    left = {}
    for pid, cmd in _children().items():
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if select.select([fd], [], [], wait_s)[0]:
                os.waitpid(pid, 0)
            else:
                left[pid] = cmd
        except ChildProcessError:
            pass
        finally:
            os.close(fd)
    return left


def _chaos(backend, n, workers, kills, seed):
    """`n` mixed requests through a pool whose workers are killed at random (every n/kills
    completions); returns what the test checks."""
    rng = random.Random(seed)
    done = {"count": 0, "kills": 0, "callbacks": [0] * n}
    lock = threading.Lock()
    expected, futures = [], []
    with sandbox.Pool(workers, backend=backend, queue_size=8, max_retries=6) as pool:
        def on_done(i, _future):
            with lock:
                done["callbacks"][i] += 1
                done["count"] += 1
                kill = done["count"] % max(n // kills, 1) == 0
            if kill:
                pids = pool.worker_pids()
                if pids:
                    try:
                        os.kill(rng.choice(pids), signal.SIGKILL)
                        done["kills"] += 1
                    except ProcessLookupError:
                        pass

        for i in range(n):
            kind = ("print", "exit", "judge", "stdio", "print")[i % 5]
            if i % 50 == 4:
                kind = "timeout"
            if kind == "print":
                fut = pool.run(f"print({i} * {i})", timeout_s=5)
                expected.append(("print", f"{i * i}\n"))
            elif kind == "exit":
                fut = pool.run(f"import sys; sys.exit({i % 7 + 1})", timeout_s=5)
                expected.append(("exit", i % 7 + 1))
            elif kind == "timeout":
                fut = pool.run("while True: pass", timeout_s=0.3)
                expected.append(("timeout", None))
            elif kind == "judge":
                fut = pool.unit_tests("def f(x):\n    return 2 * x\n",
                                      f"assert f({i}) == {2 * i}\nassert f(1) == 3\n")
                expected.append(("judge", (1, 2)))
            else:
                fut = pool.stdio("print(int(input()) + 1)\n", [(f"{i}\n", f"{i + 1}\n"),
                                                               ("0\n", "2\n")])
                expected.append(("stdio", (1, 2)))
            fut.add_done_callback(functools.partial(on_done, i))
            futures.append(fut)
        wrong = []
        for i, (fut, (kind, want)) in enumerate(zip(futures, expected)):
            try:
                got = fut.result()
            except Exception as e:  # noqa: BLE001 - reported to the test
                wrong.append(f"request {i} ({kind}) raised {type(e).__name__}: {e}")
                continue
            ok = {"print": lambda r: r.stdout.decode() == want and r.exit_code == 0,
                  "exit": lambda r: r.exit_code == want,
                  "timeout": lambda r: r.timed_out,
                  "judge": lambda r: (r.passed, r.total) == want,
                  "stdio": lambda r: (r.passed, r.total) == want}[kind](got)
            if not ok:
                wrong.append(f"request {i} ({kind}): got {got!r:.300}")
        after = pool.run("print('still serving')", timeout_s=5).result().stdout.decode()
        stats = pool.stats()
    return {"wrong": wrong[:20], "n_wrong": len(wrong), "callbacks": sorted(set(
        done["callbacks"])), "kills": done["kills"], "stats": stats, "after": after}


HOSTILE = {  # name -> (code, timeout_s, backends it is safe on)
    "infinite loop": ("while True: pass", 0.5, BACKENDS),
    "sleep forever": ("import time\ntime.sleep(10**6)", 0.5, BACKENDS),
    "ignore signals": ("import signal, time\nfor s in (signal.SIGTERM, signal.SIGINT, "
                       "signal.SIGHUP):\n    signal.signal(s, signal.SIG_IGN)\nwhile True: "
                       "pass", 0.5, BACKENDS),
    "memory bomb": ("x = bytearray(1 << 34)", 5, BACKENDS),
    "stdout flood": ("import sys\nwhile True: sys.stdout.write('x' * 65536)", 1, BACKENDS),
    "setsid survivor": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                        "    time.sleep(10**6)\n", 2, BACKENDS),
    "double fork": ("import os, time\nif os.fork() == 0:\n    if os.fork() == 0:\n"
                    "        time.sleep(10**6)\n    os._exit(0)\nos.wait()", 2, BACKENDS),
    "kill its parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                        "while True: pass", 1, BACKENDS),
    # As root under the process backend these would reach the whole machine.
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                  "        pass", 2, ("bwrap", "docker")),
    "kill(-1)": ("import os, signal\nos.kill(-1, signal.SIGKILL)", 2, ("bwrap", "docker")),
}


def _hostile(backend):
    """Each hostile program through a pool, then a plain request: the pool still serves."""
    outcomes = {}
    with sandbox.Pool(2, backend=backend, max_retries=1) as pool:
        for name, (code, timeout_s, safe_on) in HOSTILE.items():
            if backend not in safe_on:
                continue
            try:
                outcomes[name] = pool.run(code, timeout_s=timeout_s).result().status
            except sandbox.WorkerLost as e:
                outcomes[name] = f"worker lost: {e}"
            check = pool.run("print(6 * 7)", timeout_s=5).result()
            if check.stdout != b"42\n":
                outcomes[name] += f"; then print(6 * 7) gave {check!r:.200}"
        report = pool.unit_tests("def f(x):\n    return x\n", "assert f(3) == 3\n").result()
        outcomes["judge after all"] = f"{report.passed}/{report.total}"
    return outcomes


def main():
    _subreaper()
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    out = _chaos(**args) if mode == "chaos" else _hostile(**args)
    sandbox.shutdown()
    out["leftovers"] = leftovers()
    print(json.dumps(out))


def run_driver(mode, timeout_s, **args):
    """Runs `main` in a fresh interpreter (a subreaper); returns its JSON output."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    proc = subprocess.run(
        [sys.executable, "-c", "import sandbox_svc_util as u; u.main()", mode,
         json.dumps(args)], capture_output=True, text=True, timeout=timeout_s, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def forge_a_reply(answer):
    """Writes a reply to a request the pool never sent (id 999) on its worker's socket, then
    answers: the pool must not take the forged reply for this request's."""
    import socket
    from sandbox import pool
    sock = socket.socket(fileno=os.dup(int(sys.argv[1])))
    pool._send(sock, (999, True, "forged"))
    sock.detach()
    return answer
