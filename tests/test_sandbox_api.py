"""sandbox.run / Result on every available backend (sessions: test_sandbox_session.py).

The reference for what a Python program prints and how it exits is CPython itself, run on
the same source in a plain subprocess.
"""

import json
import os
import signal
import socket
import subprocess
import tempfile
import textwrap
import threading

import pytest

import sandbox
from sandbox_backends import backend_params

BACKENDS = backend_params()


def run(backend, code=None, **kw):
    kw.setdefault("timeout_s", 10)
    return sandbox.run(code, backend=backend, **kw)


# ---------------------------------------------------------------------------------------------
# Result and Request: pure data
# ---------------------------------------------------------------------------------------------

def test_result_dict_round_trips_through_json_including_non_utf8():
    r = sandbox.Result(stdout=b"caf\xc3\xa9\n", stderr=b"\xff\xfe\x00bad", exit_code=None,
                       signal=9, timed_out=True, duration_s=1.5, backend="bwrap",
                       files={"a.txt": b"text", "b.bin": b"\x80\x81"}, stdout_truncated=True)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["stdout"] == "café\n" and "stderr" not in d and "stderr_b64" in d
    assert d["files"] == {"a.txt": "text"} and set(d["files_b64"]) == {"b.bin"}
    assert sandbox.Result.from_dict(d) == r
    assert r.status == "timeout" and not r.ok
    assert r.stderr_text == "\ufffd\ufffd\x00bad"


def test_result_from_dict_rejects_unknown_keys():
    d = sandbox.Result(exit_code=0).to_dict()
    d["exitcode"] = 0
    with pytest.raises(ValueError, match="exitcode"):
        sandbox.Result.from_dict(d)


def test_result_status_and_describe():
    assert sandbox.Result(exit_code=0).status == "ok"
    assert sandbox.Result(exit_code=2).describe() == "exited with status 2"
    assert sandbox.Result(signal=11).describe() == "killed by SIGSEGV"
    assert sandbox.Result(signal=9, oom=True).status == "oom"


def test_request_dict_round_trips_through_json_and_rejects_unknown_keys():
    req = sandbox.Request(code="print(1)", files={"a.txt": "hi", "b.bin": b"\xff"},
                          stdin=b"\x80", env={"K": "V"}, timeout_s=2.5)
    d = json.loads(json.dumps(req.to_dict()))
    assert d["files"] == {"a.txt": "hi"} and d["stdin_b64"] == "gA=="
    assert sandbox.Request.from_dict(d) == req
    with pytest.raises(ValueError, match="unknown request keys"):
        sandbox.Request.from_dict({"code": "1", "timeout": 3})
    with pytest.raises(ValueError, match="base64"):
        sandbox.Request.from_dict({"code": "1", "stdin_b64": "!!"})


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one"),
    (dict(code="1", command=["true"]), "exactly one"),
    (dict(command="ls -l"), "list of strings"),
    (dict(command=[]), "non-empty"),
    (dict(code="1", language="cobol"), "not supported"),
    (dict(command=["ls"], language="bash"), "goes with `code`"),
    (dict(code="1", files={"../x": "a"}), "inside the work dir"),
    (dict(code="1", files={"/etc/x": "a"}), "relative"),
    (dict(code="1", files={"a": "x", "a/b": "y"}), "as a file and as a directory"),
    (dict(code="1", files={"a": 3}), "str or bytes"),
    (dict(code="1", timeout_s=0), "positive"),
    (dict(code="1", timeout_s=float("nan")), "positive"),
    (dict(code="1", env={"A=B": "x"}), "environment"),
    (dict(code="1", max_open_files=3), "max_open_files"),
])
def test_request_rejects_bad_input_with_a_clear_message(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        sandbox.Request(**kwargs)


def test_pick_backend_turns_a_name_or_a_spec_into_the_spec_runs_use():
    assert [sandbox.pick_backend(n) for n in ("process", "bwrap", "docker")] == [
        sandbox.Process(), sandbox.Bwrap(), sandbox.Docker()]
    custom = sandbox.Docker(image="my-image:tag")
    assert sandbox.pick_backend(custom) is custom
    assert sandbox.pick_backend("auto").name in ("process", "bwrap", "docker")
    with pytest.raises(ValueError, match=r"unknown backend 'vm'; use 'auto', one of "
                                         r"\['bwrap', 'docker', 'process'\]"):
        sandbox.pick_backend("vm")


def test_bad_backend_and_limits_are_clear_errors():
    with pytest.raises(ValueError, match="unknown backend"):
        sandbox.run("1", backend="vm")
    with pytest.raises(ValueError, match="memory_mb"):
        sandbox.run("1", backend="process", memory_mb=1)


# ---------------------------------------------------------------------------------------------
# Running programs
# ---------------------------------------------------------------------------------------------

PROGRAMS = {
    "traceback": "def f(x):\n    return 1 / x\n\nprint('before')\nf(0)\n",
    "syntax_error": "print('never')\nx = (\n",
    "exit_3": "import sys\nprint('out'); sys.exit(3)\n",
    "exit_message": "raise SystemExit('bye now')\n",
    "os_exit": "import os\nprint('lost', end='')\nos._exit(7)\n",
    "thread_joined": ("import threading, time\n"
                      "t = threading.Thread(target=lambda: (time.sleep(0.1), print('thread')))\n"
                      "t.start()\nprint('main')\n"),
    "atexit": "import atexit\natexit.register(print, 'at exit')\nprint('body')\n",
    "keyboard_interrupt": "raise KeyboardInterrupt\n",
    "main_guard": "if __name__ == '__main__':\n    print('main', __name__)\n",
}


def _cpython(code: str, python: str) -> tuple[bytes, bytes, int]:
    """The reference: `python main.py` in a fresh directory."""
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "main.py"), "w") as f:
            f.write(code)
        p = subprocess.run([python, "-I", "main.py"], cwd=d, capture_output=True, timeout=30)
    stderr = p.stderr.replace(os.path.join(d, "main.py").encode(), b"main.py")
    return p.stdout, stderr, p.returncode


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_python_runs_exactly_like_cpython(backend, name):
    code = PROGRAMS[name]
    stdout, stderr, returncode = _cpython(code, sandbox.pick_backend(backend).python)
    r = run(backend, code)
    assert (r.stdout, r.stderr) == (stdout, stderr)
    if returncode < 0:
        assert (r.exit_code, r.signal) == (None, -returncode)
    else:
        assert (r.exit_code, r.signal) == (returncode, None)
    assert r.backend == backend and not r.timed_out and not r.oom


@pytest.mark.parametrize("backend", BACKENDS)
def test_bash_command_files_stdin_env_and_returned_files(backend):
    files = {"in/data.bin": bytes(range(256)), "script.sh": "echo from-script\n"}
    r = run(backend, "cat > out.txt; bash script.sh; echo \"$GREETING\" >&2; "
            "mkdir -p d/e && printf '\\x80\\xff' > d/e/raw; ln -s /etc/hostname link",
            language="bash", files=files, stdin=b"stdin \x00 bytes", env={"GREETING": "hey"},
            return_files=True)
    assert r.ok, r.stderr
    assert r.stdout == b"from-script\n" and r.stderr == b"hey\n"
    assert r.files == {"in/data.bin": bytes(range(256)), "script.sh": b"echo from-script\n",
                       "out.txt": b"stdin \x00 bytes", "d/e/raw": b"\x80\xff"}
    r = run(backend, command=["sh", "-c", "exit 42"])
    assert (r.exit_code, r.status) == (42, "error")
    r = run(backend, command=["no-such-program-here"])
    assert r.exit_code == 127 and b"no-such-program-here" in r.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_environment_is_scrubbed_and_work_dir_is_cwd(backend, monkeypatch):
    monkeypatch.setenv("PTRAIN_HOST_ONLY", "should-not-leak")
    r = run(backend, "import os, json; print(json.dumps([os.getcwd(), dict(os.environ)]))")
    cwd, env = json.loads(r.stdout)
    assert "PTRAIN_HOST_ONLY" not in env
    assert set(env) == {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE"}
    assert env["HOME"] == cwd


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_is_capped_exactly_and_flagged(backend):
    r = run(backend, "import sys\nsys.stdout.write('a' * 5000)\nsys.stderr.write('b' * 10)\n",
            max_output_bytes=1000)
    assert r.stdout == b"a" * 1000 and r.stdout_truncated
    assert r.stderr == b"b" * 10 and not r.stderr_truncated and r.ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_returned_files_respect_the_byte_budget(backend):
    files = {"a": b"1" * 600, "b": b"2" * 600}
    r = run(backend, "pass", files=files, return_files=True, max_files_bytes=1000)
    assert r.files_truncated and r.files == {"a": b"1" * 600}


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_limit_allows_most_of_memory_mb_and_stops_beyond_it(backend):
    touch = "x = bytearray({mb} << 20)\nx[::4096] = b'y' * len(x[::4096])\nprint('held')"
    within = run(backend, touch.format(mb=160 - 48), memory_mb=160)
    beyond = run(backend, touch.format(mb=160 + 64), memory_mb=160)
    assert within.ok and within.stdout == b"held\n", within
    assert beyond.oom and not beyond.ok and beyond.stdout == b"", beyond


@pytest.mark.parametrize("backend", backend_params(("process", "bwrap")))
def test_without_cgroups_rlimits_bound_memory_and_processes(backend, monkeypatch):
    """The fallback on machines without writable cgroups: RLIMIT_AS for memory, and
    RLIMIT_NPROC on the sandbox's own uid for processes (not for a root caller's
    process backend, which docs/sandbox.md says)."""
    monkeypatch.setattr(sandbox.cgroups, "layout", lambda: None)
    with sandbox.Sandbox(backend, sandbox.Limits(memory_mb=160, max_processes=8)) as worker:
        assert worker._handle.cgroup is None
        big = worker.run(sandbox.Request(code="x = b'x' * (400 << 20)"))
        assert big.oom and big.stderr.rstrip().endswith(b"MemoryError"), big
        small = worker.run(sandbox.Request(code="x = b'x' * (40 << 20)\nprint(len(x) >> 20)"))
        assert small.stdout == b"40\n", small
        if backend == "process" and os.geteuid() == 0:
            return
        forks = worker.run(sandbox.Request(code=textwrap.dedent("""
            import os
            n = 0
            try:
                while True:
                    if os.fork() == 0:
                        import time; time.sleep(100)
                    n += 1
            except OSError:
                print('limited', n)
        """), timeout_s=5))
        word, n = forks.stdout.split()
        assert word == b"limited" and int(n) < 8, forks
        assert worker.processes() == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_cold_sandbox_gives_the_same_result_as_the_fork_server(backend):
    code = "import sys\nprint(sys.argv, __name__)\nraise SystemExit(5)\n"
    warm, cold = run(backend, code), run(backend, code, fork_server=False)
    assert (warm.stdout, warm.exit_code) == (cold.stdout, cold.exit_code) == (
        b"['main.py'] __main__\n", 5)


def test_auto_picks_the_strongest_available_backend_and_says_so():
    expected = next(c.name for c in sandbox.backends.STRONGEST_FIRST
                    if sandbox.unavailable_reason(c()) is None
                    and sandbox.backends.auto_refusal(c()) is None)
    assert sandbox.pick_backend("auto").name == expected
    assert sandbox.run("print(1)").backend == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_runs_get_separate_workers(backend):
    results = [None] * 4

    def go(i):
        results[i] = run(backend, f"import os\nopen('mine', 'w').write('{i}')\n"
                                  f"print(sorted(os.listdir('.')), open('mine').read())")

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout for r in results] == [f"['mine'] {i}\n".encode() for i in range(4)]


# ---------------------------------------------------------------------------------------------
# Clean state
# ---------------------------------------------------------------------------------------------

LEAVE_TRACES = textwrap.dedent("""
    import os, tempfile
    open('work_file', 'w').write('x')
    os.makedirs('locked/inner'); open('locked/inner/f', 'w').write('x')
    os.chmod('locked/inner', 0); os.chmod('locked', 0o500)
    open(os.path.join(tempfile.gettempdir(), 'tmp_file'), 'w').write('x')
    if os.environ.get('HOST_SHARED') != '1':  # /dev/shm and SysV IPC of the sandbox only
        open('/dev/shm/shm_file', 'w').write('x')
        import ctypes
        assert ctypes.CDLL(None).shmget(0x5eed, 4096, 0o1666) >= 0  # IPC_CREAT | 0666
""")
LOOK_FOR_TRACES = textwrap.dedent("""
    import os, tempfile
    shm = open('/proc/sysvipc/shm').read().splitlines()[1:]
    dev_shm = os.listdir('/dev/shm') if os.path.isdir('/dev/shm') else []
    print(sorted(os.listdir('.')), os.listdir(tempfile.gettempdir()), dev_shm, shm)
""")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_sees_nothing_a_previous_run_left(backend):
    host_shared = backend == "process"  # /dev/shm and SysV IPC are the host's there
    env = {"HOST_SHARED": "1" if host_shared else "0"}
    with sandbox.Sandbox(backend) as worker:
        first = worker.run(sandbox.Request(code=LEAVE_TRACES, env=env))
        assert first.ok, first.stderr
        second = worker.run(sandbox.Request(code=LOOK_FOR_TRACES))
    assert second.ok, second.stderr
    if host_shared:
        assert second.stdout.startswith(b"[] [] ")
    else:
        assert second.stdout == b"[] [] [] []\n"


# ---------------------------------------------------------------------------------------------
# Failures of the sandbox itself, and the network switch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dead_sandbox_raises_sandbox_error_and_run_recovers(backend):
    box = sandbox.Sandbox(backend)
    os.kill(box.server_pid, signal.SIGKILL)
    with pytest.raises(sandbox.SandboxError):
        box.run(sandbox.Request(code="print(1)"))
    assert not box.alive
    assert run(backend, "print(1)").stdout == b"1\n"


def test_the_names_from_before_sandbox_and_worker_were_told_apart_still_work_and_warn():
    """`Worker` (the fork-server handle) is now `Sandbox`; "worker" means only a pool's process
    or Ray actor. The old names stay for one release: the same objects, each access warning."""
    import importlib
    import sys

    from sandbox import fleet, session, warm_sandboxes
    for old, new in [("Worker", sandbox.Sandbox), ("WorkerError", sandbox.SandboxError),
                     ("live_workers", sandbox.live_sandboxes), ("resolve", sandbox.pick_backend)]:
        with pytest.warns(DeprecationWarning, match=f"sandbox.{old} is deprecated"):
            assert getattr(sandbox, old) is new
    with pytest.warns(DeprecationWarning, match="backends.resolve is deprecated"):
        assert sandbox.backends.resolve is sandbox.pick_backend
    with pytest.warns(DeprecationWarning, match="BY_NAME is deprecated"):
        assert sandbox.backends.BY_NAME == {"process": sandbox.Process, "bwrap": sandbox.Bwrap,
                                            "docker": sandbox.Docker}
    sys.modules.pop("sandbox.worker", None)
    old_module = importlib.import_module("sandbox.worker")
    with pytest.warns(DeprecationWarning, match="use sandbox.Sandbox"):
        assert old_module.Worker is sandbox.Sandbox
    with pytest.warns(DeprecationWarning, match="use sandbox.SandboxError"):
        assert old_module.WorkerError is sandbox.SandboxError
    sys.modules.pop("sandbox.warm_workers", None)
    with pytest.warns(DeprecationWarning, match="sandbox.warm_workers is deprecated"):
        old_registry = importlib.import_module("sandbox.warm_workers")
    assert old_registry is warm_sandboxes  # one module: monkeypatching either name is one bound
    with pytest.warns(DeprecationWarning, match="MAX_SANDBOXES_PER_KEY"):
        assert old_registry.MAX_WORKERS_PER_KEY == warm_sandboxes.MAX_SANDBOXES_PER_KEY
    s = session.Session(backend="process")  # unpinned: holds no sandbox, starts none
    try:
        with pytest.warns(DeprecationWarning, match="Session.sandbox"):
            assert s.worker is s.sandbox is None
    finally:
        s.close()
    assert fleet.Session.worker is fleet.Session.sandbox is None
    with pytest.raises(AttributeError, match="no attribute 'Workers'"):
        sandbox.Workers


@pytest.mark.parametrize("backend", backend_params(("bwrap", "process")))
def test_network_true_reaches_a_host_loopback_listener(backend):
    """The control for the isolation tests: with network=True the same connect works."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        r = run(backend, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)\n"
                         "print('connected')", network=True)
        assert r.stdout == b"connected\n", r.stderr
        server.settimeout(5)
        server.accept()[0].close()
