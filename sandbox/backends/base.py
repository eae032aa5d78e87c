"""What every backend's fork server has in common, on the host side: the `Server` handle
(its socket, how to stop it), the server's config, the start-up handshake, per-sandbox uids,
cgroups joined through host-held fds, and the OOM shield. Each backend (process.py,
bwrap.py, docker.py) builds on these."""

import fcntl
import functools
import logging
import os
import signal
import socket
import subprocess
import tempfile
import threading

from sandbox import cgroups, forkserver
from sandbox.request import Limits

log = logging.getLogger("sandbox")

PATH = "/usr/local/bin:/usr/bin:/bin"
STARTUP_TIMEOUT_S = 60.0
UID_BASE = 500_000  # per-sandbox uids when the caller is root: 500000 + slot
_UID_SLOTS = 4096


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this machine; the message says why."""


class Server:
    """The host's side of one running fork server: its socket, what only the host can see
    (OOM kills, the processes in the sandbox) and how to stop it. Each backend has its own
    subclass holding what that backend started."""

    def __init__(self, backend: str, sock: socket.socket):
        self.backend, self.sock = backend, sock
        self.server_pid: int | None = None  # host pid of the fork server
        self.uid_lock: int | None = None

    def oom_kills(self) -> int | None:
        """OOM kills in this sandbox so far, or None where it cannot be known."""
        return None

    def after_run(self) -> None:
        """Called after every run: resets what the host can reset and a run could read (the
        cgroup's memory peak and fail counts)."""

    def processes(self) -> list[int]:
        """Host pids of everything in the sandbox except the fork server (between runs, only
        the child parked for the next run)."""
        return []

    def stop(self) -> None:
        """Ask the server to exit, then make sure of it; idempotent."""
        try:
            forkserver.send_frame(self.sock, {"op": "exit"})
        except OSError:
            pass
        self.sock.close()
        self._teardown()
        if self.uid_lock is not None:
            os.close(self.uid_lock)
            self.uid_lock = None

    def kill(self) -> None:
        """Stop it now, without asking."""
        self.stop()

    def _teardown(self) -> None:
        """What the backend removes once the server was told to exit."""


class LocalServer(Server):
    """A fork server that is a child process of ours (the process and bwrap backends), with
    the sandbox's cgroup where the machine has one."""

    def __init__(self, backend: str, sock: socket.socket):
        super().__init__(backend, sock)
        self.proc: subprocess.Popen | None = None
        self.cgroup: cgroups.Cgroup | None = None
        self.join_fds: list[int] = []  # the run cgroup's cgroup.procs, open for the server
        self.cleanup_paths: list[str] = []

    def oom_kills(self) -> int | None:
        return self.cgroup.oom_kills() if self.cgroup is not None else None

    def after_run(self) -> None:
        if self.cgroup is not None:
            self.cgroup.reset_peaks()

    def processes(self) -> list[int]:
        if self.cgroup is not None:
            pids = self.cgroup.pids()
        else:
            pids = descendants(self.proc.pid) if self.proc else []
        skip = {self.server_pid} | ({self.proc.pid} if self.proc else set())
        return [p for p in pids if p not in skip]

    def kill(self) -> None:
        if self.proc is not None:
            self._kill_processes()
        self.stop()

    def _teardown(self) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._kill_processes()
                self.proc.wait()
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        for path in self.cleanup_paths:
            if not forkserver.remove_tree(path):  # fd-based: no depth or path length limit
                log.warning("sandbox: could not remove %s (left by a %s sandbox)", path,
                            self.backend)
        self.cleanup_paths = []
        for fd in self.join_fds:
            os.close(fd)
        self.join_fds = []

    def _kill_processes(self) -> None:
        # The server first: under bwrap it is PID 1 of the namespace, and takes every
        # process of the sandbox with it.
        for pid in (self.server_pid, self.proc.pid):
            if pid is not None and self.proc.poll() is None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out.extend(kids)
        todo.extend(kids)
    return out


def server_argv(python: str) -> list[str]:
    """How the fork server is started: its source is passed inline, so the sandbox needs
    nothing of ours on its file system."""
    return [python, "-I", "-X", "utf8", "-c", _server_source()]


@functools.lru_cache(maxsize=1)
def _server_source() -> str:
    with open(forkserver.__file__) as f:
        return f.read()


def server_config(modules, channel, workdir, tmpdirs, **extra) -> dict:
    """The fork server's config. `modules`: {"preimport": [names], "preload": [[name,
    source]]}; `tmpdirs` (and `workdir`) are emptied after every run, with what `extra`
    asks of the reset (`sysv_ipc`, `mqueue`)."""
    return {
        "channel": channel, "workdir": workdir, "tmpdir": tmpdirs[0],
        "wipe": list(tmpdirs) + [workdir], "path": PATH, **modules, **extra,
    }


def await_ready(server: Server) -> None:
    server.sock.settimeout(STARTUP_TIMEOUT_S)
    try:
        ready = forkserver.recv_frame(server.sock)
    except (OSError, EOFError) as e:
        ready = None
        why = repr(e)
    else:
        why = "it exited"
    if not ready or not ready.get("ready"):
        raise BackendUnavailable(f"the {server.backend} fork server did not start ({why})")
    server.sock.settimeout(None)


def join_server_cgroup(server: LocalServer) -> None:
    """Move the server (and bwrap's monitor) into the sandbox's server cgroup, and shield
    them from the OOM killer where we may. Nothing has forked a run yet, so nothing is left
    behind."""
    tree = [server.proc.pid] + descendants(server.proc.pid)
    server.server_pid = tree[-1]
    for pid in tree:
        if server.cgroup is not None:
            server.cgroup.add_server(pid)
        shield_from_oom(pid)


def shield_from_oom(pid: int) -> None:
    """oom_score_adj -1000 for a server process where we may (CAP_SYS_RESOURCE); else it
    keeps 0. Either way a run (1000, set by itself and checked) is the OOM killer's choice."""
    if os.geteuid() != 0:
        return
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("-1000")
    except OSError as e:  # no CAP_SYS_RESOURCE (a container without it)
        log.debug("sandbox: the fork server keeps oom_score_adj 0: %s", e)


def no_time_wait(pid: int) -> bool:
    """Set `net.ipv4.tcp_max_tw_buckets` to 0 in the network namespace of `pid`, a sandbox's
    own (never the host's: where `pid` shares ours, nothing is written): a connection a run
    closes leaves no TIME_WAIT socket, whose port the next run could see. From a thread of
    its own that enters that namespace (setns moves only the calling thread) and ends there;
    True if done. The caller may: root, or the owner of the sandbox's user namespace."""
    target = f"/proc/{pid}/ns/net"
    try:
        want = os.stat(target).st_ino
        if want == os.stat("/proc/self/ns/net").st_ino:
            return False
    except OSError:
        return False
    done = []

    def inside():
        import ctypes
        fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                return
        finally:
            os.close(fd)
        if os.stat("/proc/thread-self/ns/net").st_ino == want:
            with open("/proc/sys/net/ipv4/tcp_max_tw_buckets", "w") as f:
                f.write("0")
            done.append(True)

    thread = threading.Thread(target=inside, name="sandbox-netns")
    thread.start()
    thread.join()
    return bool(done)


def new_cgroup(limits: Limits) -> cgroups.Cgroup | None:
    if cgroups.layout() is None:
        return None
    return cgroups.Cgroup(limits.memory_mb << 20, limits.max_processes)


def open_join_files(cgroup: cgroups.Cgroup) -> list[int]:
    """The run cgroup's cgroup.procs files, opened here for writing: the fork server holds
    these fds and each run child writes "0" to them to join, then closes them. Nothing in the
    sandbox can open a cgroup file itself (v1 checks the writer's uid against the moved
    process only, so a writable cgroup.procs would let a run move the server)."""
    fds = []
    try:
        for path in cgroup.run_join_files():
            fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def start_local(server: LocalServer, popen, server_end: socket.socket) -> LocalServer:
    """Finish starting a local fork server: `popen()` starts it (sets `server.proc`), then
    the handshake and the cgroup; on any failure everything is undone."""
    try:
        popen()
        await_ready(server)
        join_server_cgroup(server)
    except BaseException:
        server_end.close()
        server.kill()
        raise
    server_end.close()
    return server


def take_uid() -> tuple[int | None, int | None]:
    """A uid no other live sandbox on this machine holds, and the lock that holds it; (None,
    None) when we are not root (then the sandbox runs as our own uid)."""
    if os.geteuid() != 0:
        return None, None
    lock_dir = os.path.join(tempfile.gettempdir(), "ptrain-sandbox-uids")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    for slot in range(_UID_SLOTS):
        fd = os.open(os.path.join(lock_dir, str(slot)), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return UID_BASE + 1 + slot, fd
    raise BackendUnavailable(f"all {_UID_SLOTS} sandbox uids are in use")
