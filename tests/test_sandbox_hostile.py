"""Hostile programs, on every available backend.

For each program: the right verdict, wall time within timeout + 1 s, no process of the run
left (in the sandbox or anywhere on the host), no change on the host, no leaked fd, temp dir
or cgroup, and the same worker still serves afterwards. Programs that attack what the
`process` backend does not claim to protect (it is not a security boundary: the host file
system, network and /proc are its own) are skipped there with that reason.

Network isolation is shown with loopback sockets of this test only, and by what the sandbox
sees (interfaces, routes); no test sends a packet beyond this machine.
"""

import dataclasses
import hashlib
import os
import random
import signal
import socket
import string
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

import pytest

import sandbox
from sandbox import cgroups
from sandbox.workdir import WorkDir
from sandbox_backends import (  # noqa: F401 - the autouse fixture
    backend_params, objects_before_the_test_frozen, open_fds, own_cgroups, own_containers,
    own_temp_dirs, processes_with)

TIMEOUT_S = 1.0
MEMORY_MB = 128
MAX_PROCESSES = 32
MAX_OUTPUT = 1 << 16
MAX_FILE_MB = 8
MAX_OPEN_FILES = 64
SECRET = "ptrain-secret-" + "".join(random.choices(string.ascii_letters, k=24))
# Set before any worker starts: if the host's environment reached a sandbox, it shows.
os.environ["PTRAIN_SANDBOX_TEST_SECRET"] = SECRET

NOT_A_BOUNDARY = "the process backend is not a security boundary (docs/sandbox.md): "


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    code: str
    check: Callable  # (Result, Ctx) -> None, asserts
    language: str = "python"
    timeout_s: float = TIMEOUT_S
    stdin: bytes | None = None
    process_skip: str | None = None  # why the process backend does not defend this
    needs_limits: bool = False  # the process backend defends it only with cgroups or non-root


@dataclasses.dataclass
class Ctx:
    tcp: socket.socket
    udp: socket.socket
    canary_dir: str
    marker: str
    sentinel: subprocess.Popen

    def subs(self) -> dict:
        return {"SBX_TCP_PORT": self.tcp.getsockname()[1],
                "SBX_UDP_PORT": self.udp.getsockname()[1], "SBX_CANARY": self.canary_dir,
                "SBX_MARKER": self.marker}


def timed_out(r, ctx):
    assert r.timed_out and r.signal == signal.SIGKILL and r.status == "timeout", r


def oom(r, ctx):
    assert r.oom and not r.ok and not r.timed_out, r


def exit_ok_with(text):
    def check(r, ctx):
        assert r.ok, r
        assert text.encode() in r.stdout, r.stdout
    return check


def lines_all_start_with(prefix):
    def check(r, ctx):
        assert r.ok, r
        lines = r.stdout.decode().splitlines()
        assert lines and all(line.startswith(prefix) for line in lines), r.stdout
    return check


def flood(stream):
    def check(r, ctx):
        timed_out(r, ctx)
        assert getattr(r, stream) == b"x" * MAX_OUTPUT and getattr(r, stream + "_truncated")
    return check


def limited(limit):
    def check(r, ctx):
        assert r.ok, r
        word, n, *_ = r.stdout.split()
        assert word == b"limited" and 0 < int(n) <= limit, r.stdout
    return check


def no_secret(r, ctx):
    assert SECRET.encode() not in r.stdout + r.stderr
    shadow = _host_shadow_lines()
    assert not any(line in r.stdout + r.stderr for line in shadow)


def _host_shadow_lines() -> list[bytes]:
    try:
        with open("/etc/shadow", "rb") as f:
            return [line for line in f.read().splitlines() if b":" in line]
    except OSError:
        return []


def secret_hidden(r, ctx):
    no_secret(r, ctx)
    assert r.ok and b"read environ of" in r.stdout, r


def denied(error_name):
    def check(r, ctx):
        no_secret(r, ctx)
        assert r.exit_code == 1 and error_name.encode() in r.stderr, r
    return check


def killed_by(sig):
    def check(r, ctx):
        assert r.signal == sig and r.exit_code is None and not r.timed_out, r
    return check


def canary_intact(r, ctx):
    assert sorted(os.listdir(ctx.canary_dir)) == ["keep"], os.listdir(ctx.canary_dir)
    with open(os.path.join(ctx.canary_dir, "keep")) as f:
        assert f.read() == "canary"


def nothing_written(r, ctx):
    lines_all_start_with("blocked")(r, ctx)
    canary_intact(r, ctx)
    for path in ("/etc/ptrain-pwned", "/usr/ptrain-pwned", "/ptrain-pwned"):
        assert not os.path.exists(path)


def no_network_reached(r, ctx):
    assert r.ok, r
    assert b"connected" not in r.stdout and b"answered" not in r.stdout, r.stdout
    ctx.tcp.setblocking(False)
    with pytest.raises(BlockingIOError):
        ctx.tcp.accept()
    ctx.udp.setblocking(False)
    with pytest.raises(BlockingIOError):
        ctx.udp.recvfrom(512)


def only_loopback(r, ctx):
    assert r.ok, r
    assert r.stdout == b"['lo']\n[]\n", r.stdout


def sentinel_alive(r, ctx):
    exit_ok_with("survived")(r, ctx)
    assert ctx.sentinel.poll() is None  # our own process on the host is untouched


def exact_non_utf8(r, ctx):
    assert r.ok and r.stdout == b"\xff\xfe\x80ok\x00\xc3" and r.stderr == b"\xc3\x28", r
    assert sandbox.Result.from_dict(r.to_dict()) == r


def truncated_but_ok(r, ctx):
    assert r.ok and r.stdout == b"x" * MAX_OUTPUT and r.stdout_truncated, r


def stopped_or_oom(r, ctx):
    assert r.oom or (r.ok and r.stdout.startswith(b"stopped")), r


def linked_and_canary_intact(r, ctx):
    exit_ok_with("linked")(r, ctx)
    canary_intact(r, ctx)


STDIN = bytes(range(256)) * 64


def stdin_echoed(r, ctx):
    assert r.ok and r.stdout == STDIN[::-1], r


CASES = [
    # Time.
    Case("infinite_loop", "while True:\n    pass\n", timed_out),
    Case("sleep_forever", "import time\ntime.sleep(10 ** 6)\n", timed_out),
    Case("ignored_signals", """
import signal, time
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGALRM,
          signal.SIGXCPU, signal.SIGUSR1, signal.SIGPIPE):
    signal.signal(s, signal.SIG_IGN)
while True:
    time.sleep(0.01)
""", timed_out),
    Case("swallowed_timeouts", """
import signal
class Timeout(Exception):
    pass
def boom(*args):
    raise Timeout
for s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT):
    signal.signal(s, boom)
signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
while True:
    try:
        while True:
            pass
    except BaseException:
        pass
""", timed_out),
    Case("stops_itself", "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)\n", timed_out),
    Case("closes_its_output_and_spins", "import os\nos.close(1)\nos.close(2)\nwhile True:\n"
         "    pass\n", timed_out),
    # Memory.
    Case("one_huge_allocation", "x = b'x' * (1 << 30)\n", oom, needs_limits=True),
    Case("slow_memory_growth", """
import time
hog = []
while True:
    hog.append(b'x' * (4 << 20))
    time.sleep(0.005)
""", oom, timeout_s=3.0, needs_limits=True),
    Case("deep_recursion", "def f(n):\n    return f(n + 1)\nf(0)\n", denied("RecursionError")),
    Case("c_stack_overflow", """
import sys
sys.setrecursionlimit(10 ** 6)
x = []
for _ in range(200000):
    x = [x]
repr(x)
""", killed_by(signal.SIGSEGV), timeout_s=3.0),
    # Processes and threads.
    Case("fork_bomb", """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
""", timed_out, needs_limits=True),
    Case("bash_fork_bomb", "bomb() { bomb | bomb & }; bomb; wait; sleep 100", timed_out,
         language="bash", needs_limits=True),
    Case("thread_bomb", """
import threading, time
n = 0
try:
    while True:
        threading.Thread(target=time.sleep, args=(100,), daemon=True).start()
        n += 1
except RuntimeError:
    print('limited', n)
""", limited(MAX_PROCESSES + 2), needs_limits=True),
    Case("zombies", "import os\nfor _ in range(20):\n    if os.fork() == 0:\n"
         "        os._exit(0)\nprint('made zombies')\n", exit_ok_with("made zombies")),
    Case("setsid_survivor", """
import os
if os.fork() == 0:
    os.setsid()
    os.execvp('sleep', ['sleep', '$SBX_MARKER'])
print('parent done')
""", exit_ok_with("parent done")),
    Case("double_fork_survivor", """
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp('sleep', ['sleep', '$SBX_MARKER'])
    os._exit(0)
os.wait()
print('parent done')
""", exit_ok_with("parent done")),
    Case("nohup_background_survivor", "nohup sleep $SBX_MARKER >/dev/null 2>&1 & disown\n"
         "setsid sleep $SBX_MARKER & echo started", exit_ok_with("started"), language="bash"),
    Case("kills_its_parent", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
         "print('survived')\n", exit_ok_with("survived"),
         process_skip=NOT_A_BOUNDARY + "its worker runs as the caller"),
    Case("kills_everything", """
import os, signal
try:
    os.kill(-1, signal.SIGKILL)  # ESRCH when nothing it may signal is in reach
except ProcessLookupError:
    pass
print('survived')
""", sentinel_alive,
         process_skip=NOT_A_BOUNDARY + "kill(-1) reaches every process of the caller's uid"),
    Case("ptraces_its_parent", """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print('blocked' if libc.ptrace(16, os.getppid(), 0, 0) == -1 else 'attached')
""", lines_all_start_with("blocked"), process_skip=NOT_A_BOUNDARY + "no ptrace restriction"),
    # Output and input.
    Case("stdout_flood", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
         flood("stdout")),
    Case("stderr_flood", "import sys\nwhile True:\n    sys.stderr.write('x' * 65536)\n",
         flood("stderr")),
    Case("flood_then_exit", "import os\nfor _ in range(800):\n    os.write(1, b'x' * 65536)\n",
         truncated_but_ok),
    Case("non_utf8_output", "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\x80ok\\x00\\xc3')\n"
         "sys.stderr.buffer.write(b'\\xc3\\x28')\n", exact_non_utf8),
    Case("reads_stdin", "import sys\nsys.stdout.buffer.write(sys.stdin.buffer.read()[::-1])\n",
         stdin_echoed, stdin=STDIN),
    Case("reads_absent_stdin", "input()\n", denied("EOFError")),
    # Files and descriptors.
    Case("huge_file", "open('big', 'wb').write(b'\\0' * (64 << 20))\n", denied("File too large")),
    Case("huge_file_from_bash", "head -c 64M /dev/zero > big; echo \"status $?\"",
         exit_ok_with("status 153"), language="bash"),
    Case("fills_tmp", """
import itertools
n = 0
try:
    for i in itertools.count():
        with open(f'/tmp/fill{i}', 'wb') as f:
            f.write(b'\\0' * (1 << 20))
        n += 1
except OSError as e:
    print('stopped', n, e.errno)
""", stopped_or_oom, timeout_s=3.0,
         process_skip=NOT_A_BOUNDARY + "/tmp is the host's"),
    Case("fd_exhaustion", """
files = []
try:
    while True:
        files.append(open('/dev/null'))
except OSError as e:
    print('limited', len(files), e.errno)
""", limited(MAX_OPEN_FILES)),
    Case("locks_up_its_work_dir", """
import os
os.makedirs('a/b')
os.chmod('a/b', 0)
os.chmod('a', 0)
try:
    os.chmod('.', 0o500)
except PermissionError:  # docker's /work belongs to root
    pass
print('locked')
""", exit_ok_with("locked")),
    Case("symlinks_to_the_host", """
import os, tempfile
os.symlink('$SBX_CANARY', 'to_canary')
os.symlink('$SBX_CANARY', os.path.join(tempfile.gettempdir(), 'to_canary'))
print('linked')
""", linked_and_canary_intact),
    # Escapes: privileges, host files, secrets.
    Case("writes_outside_the_work_dir", """
import os
for path in ['/etc/ptrain-pwned', '/usr/ptrain-pwned', '/ptrain-pwned',
             '$SBX_CANARY/pwned', '$SBX_CANARY/keep', '/proc/sys/kernel/hostname']:
    try:
        with open(path, 'w') as f:
            f.write('pwned')
        print('wrote', path)
    except OSError as e:
        print('blocked', path, e.errno)
""", nothing_written, process_skip=NOT_A_BOUNDARY + "the host file system is writable"),
    Case("reads_etc_shadow", "print(open('/etc/shadow').read())\n", denied("Error"),
         process_skip=NOT_A_BOUNDARY + "the host's /etc is visible"),
    Case("reads_proc_1_environ", "print(open('/proc/1/environ', 'rb').read())\n",
         denied("PermissionError"), process_skip=NOT_A_BOUNDARY + "the host's /proc is visible"),
    Case("hunts_environment_secrets", """
import os
print(dict(os.environ))
for pid in os.listdir('/proc'):
    if pid.isdigit():
        for name in ('environ', 'cmdline'):
            try:
                print('read environ of', pid, open(f'/proc/{pid}/{name}', 'rb').read())
            except OSError:
                pass
""", secret_hidden, process_skip=NOT_A_BOUNDARY + "the host's /proc is visible"),
    Case("raises_its_rlimits", """
import resource
for name in ('RLIMIT_NOFILE', 'RLIMIT_FSIZE', 'RLIMIT_CPU', 'RLIMIT_CORE'):
    which = getattr(resource, name)
    try:
        resource.setrlimit(which, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print('raised', name)
    except (ValueError, OSError):
        print('blocked', name)
""", lines_all_start_with("blocked"),
         process_skip=NOT_A_BOUNDARY + "a privileged caller's runs may raise rlimits"),
    Case("escapes_its_cgroup", """
import os
for path in ['/sys/fs/cgroup/cgroup.procs', '/sys/fs/cgroup/memory/cgroup.procs',
             '/sys/fs/cgroup/pids/cgroup.procs', '/sys/fs/cgroup/unified/cgroup.procs']:
    try:
        with open(path, 'w') as f:
            f.write(str(os.getpid()))
        print('moved', path)
    except OSError as e:
        print('blocked', path, e.errno)
for path in ['/sys/fs/cgroup/memory/ptrain-escape', '/sys/fs/cgroup/ptrain-escape']:
    try:
        os.mkdir(path)
        print('made', path)
    except OSError as e:
        print('blocked', path, e.errno)
""", lines_all_start_with("blocked"), process_skip=NOT_A_BOUNDARY + "root may move cgroups"),
    Case("new_user_namespace", "unshare -Ur true && echo 'made userns' || echo blocked",
         lines_all_start_with("blocked"), language="bash",
         process_skip=NOT_A_BOUNDARY + "no namespace restriction"),
    Case("mounts_a_file_system", "mkdir -p m && (mount -t tmpfs none m 2>/dev/null "
         "&& echo mounted || echo blocked)", lines_all_start_with("blocked"), language="bash",
         process_skip=NOT_A_BOUNDARY + "a privileged caller's runs keep its capabilities"),
    # Network: only loopback sockets of this test; what the sandbox sees.
    Case("connects_to_the_host", """
import socket
try:
    socket.create_connection(('127.0.0.1', $SBX_TCP_PORT), timeout=0.5)
    print('connected')
except OSError as e:
    print('refused', e.errno)
""", no_network_reached, process_skip=NOT_A_BOUNDARY + "it shares the host's network"),
    Case("sends_a_dns_query_to_the_host", """
import socket
query = bytes.fromhex('abcd01000001000000000000076578616d706c6503636f6d0000010001')
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(0.3)
try:
    s.sendto(query, ('127.0.0.1', $SBX_UDP_PORT))
    s.recvfrom(512)
    print('answered')
except OSError as e:
    print('no answer', e.errno)
""", no_network_reached, process_skip=NOT_A_BOUNDARY + "it shares the host's network"),
    Case("looks_at_interfaces_and_routes", """
import socket
print(sorted(name for _, name in socket.if_nameindex()))
print(open('/proc/net/route').read().splitlines()[1:])
""", only_loopback, process_skip=NOT_A_BOUNDARY + "it shares the host's network"),
    # Crashes.
    Case("segfault", "import ctypes\nctypes.string_at(0)\n", killed_by(signal.SIGSEGV)),
    Case("abort", "import os\nos.abort()\n", killed_by(signal.SIGABRT)),
]


@pytest.fixture(scope="module")
def ctx():
    with (socket.create_server(("127.0.0.1", 0)) as tcp,
          socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp,
          tempfile.TemporaryDirectory(prefix="ptrain-canary-") as canary):
        udp.bind(("127.0.0.1", 0))
        with open(os.path.join(canary, "keep"), "w") as f:
            f.write("canary")
        sentinel = subprocess.Popen(["sleep", "3600"])
        marker = f"86{random.randrange(10 ** 6):06d}.{os.getpid()}"
        yield Ctx(tcp, udp, canary, marker, sentinel)
        sentinel.kill()
        sentinel.wait()


@pytest.fixture(scope="module", params=backend_params())
def worker(request):
    """One worker per backend serves every hostile program: each must leave it usable."""
    backend = request.param
    before = (own_temp_dirs(), own_cgroups(), own_containers())
    w = sandbox.Sandbox(backend, sandbox.Limits(memory_mb=MEMORY_MB,
                                               max_processes=MAX_PROCESSES))
    yield w
    w.close()
    # Nothing new is left behind (what existed before may be gone: other tests' warm workers
    # in this process can retire meanwhile).
    after = (own_temp_dirs(), own_cgroups(), own_containers())
    assert [a - b for a, b in zip(after, before)] == [set(), set(), set()]


def _host_view(backend):
    return {
        "fds": open_fds(), "temp": own_temp_dirs(), "cgroups": own_cgroups(),
        "containers": own_containers(), "root": sorted(os.listdir("/")),
        "etc": sorted(os.listdir("/etc")), "tmp_links": _tmp_entries("to_canary"),
        "escape_cgroups": [p for p in ("/sys/fs/cgroup/memory/ptrain-escape",
                                       "/sys/fs/cgroup/ptrain-escape") if os.path.exists(p)],
    }


def _tmp_entries(name):
    return sorted(n for n in os.listdir(tempfile.gettempdir()) if n == name)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_program(worker, case, ctx):
    if worker.backend == "process":
        if case.process_skip:
            pytest.skip(case.process_skip)
        if case.needs_limits and cgroups.layout() is None and os.geteuid() == 0:
            pytest.skip(NOT_A_BOUNDARY + "without cgroups, root's runs have no process or "
                        "memory limit it cannot lift")
    code = string.Template(case.code).safe_substitute(ctx.subs())
    before = _host_view(worker.backend)
    start = time.monotonic()
    r = worker.run(sandbox.Request(
        code=code, language=case.language, stdin=case.stdin, timeout_s=case.timeout_s,
        max_output_bytes=MAX_OUTPUT, max_file_mb=MAX_FILE_MB, max_open_files=MAX_OPEN_FILES))
    wall_s = time.monotonic() - start
    case.check(r, ctx)
    assert r.backend == worker.backend
    assert wall_s <= case.timeout_s + 1.0
    assert worker.processes() == []
    assert processes_with(ctx.marker) == []
    assert _host_view(worker.backend) == before
    after = worker.run(sandbox.Request(code="import os\nopen('f', 'w').write('2')\n"
                                            "print(1 + 1, os.listdir('.'))"))
    assert after.stdout == b"2 ['f']\n", after


# Programs that leave processes, files or a locked-up work dir behind, run through an unpinned
# session: its work dir is collected after the run and laid into a worker for the next one.
SESSION_CASES = ("sleep_forever", "fork_bomb", "double_fork_survivor", "stdout_flood",
                 "huge_file_from_bash", "locks_up_its_work_dir", "symlinks_to_the_host",
                 "writes_outside_the_work_dir")


@pytest.fixture(scope="module", params=backend_params())
def session_backend(request):
    """A backend with one warm worker of the suite's limits, which each session borrows."""
    sandbox.warm(1, backend=request.param, memory_mb=MEMORY_MB, max_processes=MAX_PROCESSES)
    _host_view(request.param)  # the docker SDK opens its connection on first use
    yield request.param
    sandbox.shutdown()


@pytest.mark.parametrize("case", [c for c in CASES if c.name in SESSION_CASES],
                         ids=lambda c: c.name)
def test_hostile_program_in_a_session(session_backend, case, ctx):
    backend = session_backend
    if backend == "process" and case.process_skip:
        pytest.skip(case.process_skip)
    code = string.Template(case.code).safe_substitute(ctx.subs())
    before, workers = _host_view(backend), sandbox.live_sandboxes()
    with sandbox.Session(backend=backend, memory_mb=MEMORY_MB,
                         max_processes=MAX_PROCESSES) as s:
        start = time.monotonic()
        r = s.run(code, language=case.language, stdin=case.stdin, timeout_s=case.timeout_s,
                  max_output_bytes=MAX_OUTPUT, max_file_mb=MAX_FILE_MB,
                  max_open_files=MAX_OPEN_FILES)
        wall_s = time.monotonic() - start
        case.check(r, ctx)
        assert wall_s <= case.timeout_s + 1.0
        assert processes_with(ctx.marker) == []
        assert all(w.processes() == [] for w in sandbox.live_sandboxes())
        left = s.read_files()
        after = s.run("import os\nprint(sorted(os.listdir('.')))")
        assert after.ok, after
        assert s.read_files() == left and not s.pinned
    assert sandbox.live_sandboxes() == workers  # the one warm worker, handed back clean
    assert _host_view(backend) == before
    clean = sandbox.run("import os\nprint(os.listdir('.'))", backend=backend,
                        memory_mb=MEMORY_MB, max_processes=MAX_PROCESSES)
    assert clean.stdout == b"[]\n", clean


SCAN_OWN_MEMORY = """
import ctypes, hashlib, re
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: /proc/self/mem becomes readable
candidates = re.compile(rb"LEAK[0-9a-z]{28}")  # cannot match itself
found = 0
with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', buffering=0) as mem:
    for line in maps:
        span, perms = line.split()[:2]
        start, end = (int(x, 16) for x in span.split('-'))
        if not perms.startswith('r') or end - start > 1 << 28:
            continue
        try:
            mem.seek(start)
            chunk = mem.read(end - start)
        except (OSError, ValueError, OverflowError):
            continue
        found += sum(hashlib.sha256(m.group()).hexdigest() == '$SBX_DIGEST'
                     for m in candidates.finditer(chunk))
print('found', found)
"""


@pytest.mark.parametrize("backend", backend_params(("bwrap", "docker")))
def test_a_run_cannot_find_an_earlier_runs_data_in_its_memory(backend):
    """Each run's child is a fork of the fork server: nothing of an earlier run (code,
    stdin, files, output, a session's work dir) may be left in the server's memory for it to
    inherit. The scanner
    knows only the secret's digest; the control shows it finds the secret when it is there."""
    secret = "LEAK" + "".join(random.choices(string.ascii_lowercase + string.digits, k=28))
    scan = string.Template(SCAN_OWN_MEMORY).substitute(
        SBX_DIGEST=hashlib.sha256(secret.encode()).hexdigest())
    with sandbox.Sandbox(backend) as worker:
        planted = worker.run(sandbox.Request(
            code=f"import sys\ns = {secret!r}\nprint(s)\nsys.stderr.write(s + sys.stdin.read())"
                 f"\nopen('out.txt', 'w').write(s + open('in.txt').read())",
            stdin=secret, files={"in.txt": secret}, return_files=True))
        assert planted.ok and planted.files["out.txt"] == (secret * 2).encode(), planted
        # A session's work dir: collected after its run, laid into the next one.
        caps = {"max_bytes": 1 << 20, "max_files": 100}
        _, kept = worker.run_in(WorkDir(pending={"in.txt": secret.encode()}), sandbox.Request(
            code="open('kept.txt', 'w').write(open('in.txt').read())"), **caps)
        assert kept.files()["kept.txt"] == secret.encode()
        assert worker.run_in(kept, sandbox.Request(code="open('kept.txt').read()"), **caps)[0].ok
        for _ in range(2):  # the next run, and the one after (a later parked child)
            r = worker.run(sandbox.Request(code=scan, timeout_s=30))
            assert r.stdout == b"found 0\n", r
        half = len(secret) // 2
        control = worker.run(sandbox.Request(
            code=f"s = {secret[:half]!r} + {secret[half:]!r}\n" + scan, timeout_s=30))
        assert control.ok and int(control.stdout.split()[1]) >= 1, control


@pytest.mark.parametrize("backend", backend_params(("bwrap", "docker")))
def test_a_listener_in_the_sandbox_is_unreachable_from_the_host(backend):
    """The program listens and waits for a connection while the host keeps trying to
    connect to that port; neither side gets through. With network=True (the control) the
    same harness connects."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = f"""
import socket
s = socket.create_server(('0.0.0.0', {port}))
s.settimeout(1.5)
try:
    s.accept()
    print('accepted')
except OSError:
    print('no connection')
"""
    for network in (False, True):
        stop, reached = threading.Event(), []

        def knock():
            while not stop.is_set():
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    reached.append(True)
                    return
                except OSError:
                    stop.wait(0.02)

        knocker = threading.Thread(target=knock)
        knocker.start()
        try:
            with sandbox.Sandbox(backend, sandbox.Limits(network=network)) as w:
                r = w.run(sandbox.Request(code=code, timeout_s=3))
        finally:
            stop.set()
            knocker.join()
        if network:
            assert r.stdout == b"accepted\n" and reached, r
        else:
            assert r.stdout == b"no connection\n" and not reached, r
