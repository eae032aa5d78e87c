"""Isolation backends: how to start a fork server (sandbox/forkserver.py) inside each.

- `Process()`: a plain child process: rlimits, its own session, a fresh temp work dir, a
  scrubbed environment, a memory+pids cgroup where the machine allows (else rlimits), and the
  whole tree killed after every run. Not a security boundary.
- `Bwrap()`: bubblewrap: new user/pid/net/ipc/uts/mount namespaces, read-only root with only
  /usr (and a synthetic /etc/passwd) from the host, private tmpfs /tmp, /work and /dev/shm,
  an unprivileged host uid of its own per worker (when the caller is root), no capabilities,
  no new privileges, no nested user namespaces, cgroup memory+pids limits where available.
- `Docker()`: a container (docker SDK): network none, memory/pids limits, read-only root,
  tmpfs /work, /tmp and /dev/shm, all capabilities dropped, no new privileges, the default
  seccomp profile, an unprivileged uid of its own per worker. The container stays warm; the
  fork server resets it between runs (docs/sandbox.md has the measurement behind this).

`resolve("auto")` picks the strongest available: docker, then bwrap, then process.
A backend is a frozen dataclass: `backend="bwrap"` and `backend=Bwrap()` mean the same; pass an
instance to change its settings (`Docker(image="my-image:tag")`).
"""

import dataclasses
import fcntl
import functools
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

from sandbox import cgroups, forkserver
from sandbox.request import Limits  # noqa: F401 - part of this module's face

log = logging.getLogger("sandbox")

# Imported by the fork server before it forks any run: a run that uses them starts faster.
PREIMPORT = (
    "abc", "array", "bisect", "collections", "copy", "dataclasses", "datetime", "decimal",
    "enum", "fractions", "functools", "heapq", "io", "itertools", "json", "math", "operator",
    "pathlib", "random", "re", "statistics", "string", "textwrap", "threading", "traceback",
    "typing", "unittest",
)
_PATH = "/usr/local/bin:/usr/bin:/bin"
_STARTUP_TIMEOUT_S = 60.0
# The fork server's own memory counts against a docker container's limit; it gets this much
# on top of `memory_mb` (it uses ~25 MiB with the pre-imports, see docs/sandbox.md).
_SERVER_MEMORY_MB = 48
_UID_BASE = 500_000  # per-worker uids when the caller is root: 500000 + slot
_UID_SLOTS = 4096


# Each spec also has `preload`: (module name, Python source) pairs the fork server executes
# once, as the bodies of modules of those names, after `preimport` and before it forks any
# run (the judge's harness: sandbox/judge/api.py). Runs find them in sys.modules.


@dataclasses.dataclass(frozen=True)
class Process:
    """Plain processes on the host (weakest, needs nothing). Not a security boundary."""
    python: str = sys.executable
    preimport: tuple[str, ...] = PREIMPORT
    preload: tuple[tuple[str, str], ...] = ()
    name = "process"


@dataclasses.dataclass(frozen=True)
class Bwrap:
    """bubblewrap namespaces. `ro_binds`: extra host paths made visible read-only."""
    python: str = "/usr/bin/python3"
    ro_binds: tuple[str, ...] = ()
    preimport: tuple[str, ...] = PREIMPORT
    preload: tuple[tuple[str, str], ...] = ()
    name = "bwrap"


@dataclasses.dataclass(frozen=True)
class Docker:
    """A warm docker container per worker; `image` must have Python >= 3.8 at `python`."""
    image: str = "ptrain-sandbox:latest"
    python: str = "/usr/bin/python3"
    preimport: tuple[str, ...] = PREIMPORT
    preload: tuple[tuple[str, str], ...] = ()
    name = "docker"


BY_NAME = {"process": Process, "bwrap": Bwrap, "docker": Docker}
STRONGEST_FIRST = ("docker", "bwrap", "process")


class BackendUnavailable(RuntimeError):
    """The backend cannot run on this machine; the message says why."""


def resolve(backend):
    """A backend spec from "auto", a name, or a spec instance."""
    if isinstance(backend, (Process, Bwrap, Docker)):
        return backend
    if backend == "auto":
        reasons = {}
        for name in STRONGEST_FIRST:
            spec = BY_NAME[name]()
            reasons[name] = unavailable_reason(spec)
            if reasons[name] is None:
                _log_auto_once(name, tuple((k, v) for k, v in reasons.items() if v))
                return spec
        raise BackendUnavailable(f"no backend can run here: {reasons}")
    if backend in BY_NAME:
        return BY_NAME[backend]()
    raise ValueError(f"unknown backend {backend!r}; use 'auto', one of {sorted(BY_NAME)}, "
                     "or an instance of sandbox.Process/Bwrap/Docker")


@functools.lru_cache(maxsize=None)
def _log_auto_once(name, skipped):
    if skipped:
        log.info("sandbox backend 'auto' uses %r; stronger ones not available: %s", name,
                 dict(skipped))
    else:
        log.info("sandbox backend 'auto' uses %r, the strongest", name)


@functools.lru_cache(maxsize=None)
def unavailable_reason(spec) -> str | None:
    """None if `spec` can run here, else why not (cached per process)."""
    if sys.platform != "linux":
        return "sandbox backends need Linux"
    if isinstance(spec, Process):
        return None if os.access(spec.python, os.X_OK) else f"no python at {spec.python}"
    if isinstance(spec, Bwrap):
        if shutil.which("bwrap") is None:
            return "bwrap is not installed (apt-get install bubblewrap)"
        if not os.access(spec.python, os.R_OK | os.X_OK):
            return f"no python at {spec.python} for the sandbox"
        argv = _bwrap_argv(spec, Limits(), _uid_prefix(_probe_uid()), None)
        probe = subprocess.run(argv + [spec.python, "-I", "-S", "-c", "pass"],
                               capture_output=True, timeout=30)
        if probe.returncode != 0:
            return f"bwrap cannot start a sandbox here: {probe.stderr.decode()[-300:]}"
        return None
    if isinstance(spec, Docker):
        if importlib.util.find_spec("docker") is None:
            return "the docker SDK is not installed (pip install 'ptrain[docker]')"
        try:
            client = docker_client()
            client.ping()
        except Exception as e:  # noqa: BLE001 (any failure to reach the daemon)
            return f"docker daemon not reachable: {e}"
        try:
            client.images.get(spec.image)
        except Exception as e:  # noqa: BLE001
            return f"docker image {spec.image!r} not present (bash sandbox/setup_host.sh): {e}"
        return None
    raise TypeError(f"not a backend spec: {spec!r}")


# ---------------------------------------------------------------------------------------------
# A started fork server
# ---------------------------------------------------------------------------------------------

class Handle:
    """The host's side of one running fork server: its socket and how to stop it."""

    def __init__(self, backend: str, sock: socket.socket):
        self.backend, self.sock = backend, sock
        self.proc: subprocess.Popen | None = None
        self.container = None
        self.cgroup: cgroups.Cgroup | None = None
        self.oom_control: str | None = None  # docker: the container's memory.oom_control
        self.pids_file: str | None = None  # docker: the container's cgroup.procs
        self.server_pid: int | None = None  # host pid of the fork server
        self.cleanup_paths: list[str] = []
        self.uid_lock: int | None = None
        self.join_fds: list[int] = []  # the run cgroup's cgroup.procs, open for the server

    def oom_kills(self) -> int | None:
        """OOM kills in this sandbox so far, or None where it cannot be known."""
        if self.cgroup is not None:
            return self.cgroup.oom_kills()
        if self.oom_control is not None:
            try:
                with open(self.oom_control) as f:
                    for line in f:
                        if line.startswith("oom_kill "):
                            return int(line.split()[1])
            except OSError:
                pass
        return None

    def processes(self) -> list[int]:
        """Host pids of everything in the sandbox except the fork server (and bwrap's own
        monitor): between runs, only the child parked for the next run."""
        if self.cgroup is not None:
            pids = self.cgroup.pids()
        elif self.pids_file is not None:
            try:
                with open(self.pids_file) as f:
                    pids = [int(p) for p in f.read().split()]
            except OSError:
                pids = []
        elif self.container is not None:  # a cgroup layout we do not read: ask docker
            top = self.container.top(ps_args="-o pid")
            pids = [int(row[0]) for row in top["Processes"] or []]
        else:
            pids = _descendants(self.proc.pid) if self.proc else []
        skip = {self.server_pid} | ({self.proc.pid} if self.proc else set())
        return [p for p in pids if p not in skip]

    def stop(self) -> None:
        """Ask the server to exit, then make sure of it; idempotent."""
        try:
            forkserver.send_frame(self.sock, {"op": "exit"})
        except OSError:
            pass
        self.sock.close()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._kill_processes()
                self.proc.wait()
        if self.container is not None:
            _remove_container(self.container)
            self.container = None
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        for path in self.cleanup_paths:
            if not forkserver.remove_tree(path):  # fd-based: no depth or path length limit
                log.warning("sandbox: could not remove %s (left by a %s worker)", path,
                            self.backend)
        self.cleanup_paths = []
        for fd in self.join_fds:
            os.close(fd)
        self.join_fds = []
        if self.uid_lock is not None:
            os.close(self.uid_lock)
            self.uid_lock = None

    def kill(self) -> None:
        """Stop it now, without asking."""
        if self.proc is not None:
            self._kill_processes()
        if self.container is not None:
            try:
                self.container.kill()
            except Exception:  # noqa: BLE001
                pass
        self.stop()

    def _kill_processes(self) -> None:
        # The server first: under bwrap it is PID 1 of the namespace, and takes every
        # process of the sandbox with it.
        for pid in (self.server_pid, self.proc.pid):
            if pid is not None and self.proc.poll() is None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _remove_container(container) -> None:
    """Wait for the container to exit (its server was told to), then until docker has
    removed it (auto_remove runs just after the exit); force it if it does not go."""
    import docker
    try:
        container.wait(timeout=5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            container.reload()
            time.sleep(0.01)
    except docker.errors.NotFound:
        return
    except Exception:  # noqa: BLE001 (stuck or the daemon went away: force it below)
        pass
    try:
        container.remove(force=True)
    except Exception:  # noqa: BLE001
        pass


def _descendants(pid: int) -> list[int]:
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


def start(spec, limits: Limits, *, preimport: bool = True) -> Handle:
    """Start a fork server in `spec`'s isolation; returns once it is ready to serve."""
    reason = unavailable_reason(spec)
    if reason is not None:
        raise BackendUnavailable(f"backend {spec.name!r} is unavailable: {reason}")
    modules = {"preimport": list(spec.preimport) if preimport else [],
               "preload": [list(p) for p in spec.preload] if preimport else []}
    if isinstance(spec, Docker):
        return _start_docker(spec, limits, modules)
    host_end, server_end = socket.socketpair()
    handle = Handle(spec.name, host_end)
    try:
        if isinstance(spec, Process):
            _start_process(handle, spec, limits, modules, server_end)
        else:
            _start_bwrap(handle, spec, limits, modules, server_end)
        _await_ready(handle)
        _join_cgroup(handle)
    except BaseException:
        server_end.close()
        handle.kill()
        raise
    server_end.close()
    return handle


def _await_ready(handle: Handle) -> None:
    handle.sock.settimeout(_STARTUP_TIMEOUT_S)
    try:
        ready = forkserver.recv_frame(handle.sock)
    except (OSError, EOFError) as e:
        ready = None
        why = repr(e)
    else:
        why = "it exited"
    if not ready or not ready.get("ready"):
        raise BackendUnavailable(f"the {handle.backend} fork server did not start ({why})")
    handle.sock.settimeout(None)


def _join_cgroup(handle: Handle) -> None:
    """Move the server (and bwrap's monitor) into the worker's server cgroup, and shield
    them from the OOM killer where we may. Nothing has forked a run yet, so nothing is left
    behind."""
    if handle.proc is None:
        return
    tree = [handle.proc.pid] + _descendants(handle.proc.pid)
    handle.server_pid = tree[-1]
    for pid in tree:
        if handle.cgroup is not None:
            handle.cgroup.add_server(pid)
        _shield_from_oom(pid)


def _shield_from_oom(pid: int) -> None:
    """oom_score_adj -1000 for a server process where we may (CAP_SYS_RESOURCE); else it
    keeps 0. Either way a run (1000, set by itself and checked) is the OOM killer's choice."""
    if os.geteuid() != 0:
        return
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("-1000")
    except OSError as e:  # no CAP_SYS_RESOURCE (a container without it)
        log.debug("sandbox: the fork server keeps oom_score_adj 0: %s", e)


def _new_cgroup(limits: Limits) -> cgroups.Cgroup | None:
    if cgroups.layout() is None:
        return None
    return cgroups.Cgroup(limits.memory_mb << 20, limits.max_processes)


def _server_config(modules, channel, workdir, tmpdirs, **extra) -> dict:
    """`modules`: {"preimport": [names], "preload": [[name, source]]}."""
    return {
        "channel": channel, "workdir": workdir, "tmpdir": tmpdirs[0],
        "wipe": list(tmpdirs) + [workdir], "path": _PATH, **modules, **extra,
    }


def _start_process(handle, spec, limits, modules, server_end):
    root = tempfile.mkdtemp(prefix=f"ptrain-sbx-{os.getpid()}-")
    handle.cleanup_paths.append(root)
    handle.cgroup = _new_cgroup(limits)
    extra = {"remove_on_exit": [root], "oom_adj": True}
    if handle.cgroup is not None:
        handle.join_fds = _open_join_files(handle.cgroup)
        extra.update(cgroup_procs=handle.cgroup.procs_file(), join_cgroup_fds=handle.join_fds)
    else:
        extra.update(address_space_mb=limits.memory_mb,
                     nproc=None if os.geteuid() == 0 else _user_processes() + limits.max_processes)
    cfg = _server_config(modules, {"fd": server_end.fileno()},
                         os.path.join(root, "work"), [os.path.join(root, "tmp")], **extra)
    cfg["path"] = os.path.dirname(spec.python) + ":" + _PATH
    handle.proc = subprocess.Popen(
        server_argv(spec.python) + [json.dumps(cfg)],
        pass_fds=[server_end.fileno(), *handle.join_fds],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, cwd=root, env={"PATH": cfg["path"], "LANG": "C.UTF-8"})


def _open_join_files(cgroup: cgroups.Cgroup) -> list[int]:
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


def _user_processes() -> int:
    uid, n = os.getuid(), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                n += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                pass
    return n


def _probe_uid() -> int | None:
    return _UID_BASE if os.geteuid() == 0 else None


def _take_uid() -> tuple[int | None, int | None]:
    """A uid no other live worker on this machine holds, and the lock that holds it; (None,
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
        return _UID_BASE + 1 + slot, fd
    raise BackendUnavailable(f"all {_UID_SLOTS} sandbox uids are in use")


def _uid_prefix(uid: int | None) -> list[str]:
    if uid is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def _bwrap_argv(spec, limits, prefix, passwd_fd, seccomp_fd=None) -> list[str]:
    """The bwrap command line: no part of cgroupfs or /sys is visible; /dev/mqueue is the IPC
    namespace's own (the server empties it after every run); `seccomp_fd` holds the filter
    that keeps keyrings out (`seccomp_filter`)."""
    argv = prefix + ["bwrap", "--unshare-user", "--unshare-ipc", "--unshare-pid",
                     "--unshare-uts", "--disable-userns", "--as-pid-1", "--new-session",
                     "--hostname", "sandbox"]
    if not limits.network:
        argv.append("--unshare-net")
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for path in ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime"):
        argv += ["--ro-bind-try", path, path]
    for path in spec.ro_binds:
        argv += ["--ro-bind", path, path]
    if passwd_fd is not None:
        argv += ["--ro-bind-data", str(passwd_fd), "/etc/passwd"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    size = str(limits.memory_mb << 20)
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--size", size, "--perms", "1777", "--tmpfs", "/dev/shm",
             "--mqueue", "/dev/mqueue", "--remount-ro", "/dev",
             "--size", size, "--perms", "1777", "--tmpfs", "/tmp",
             "--size", size, "--perms", "0755", "--tmpfs", "/work",
             "--remount-ro", "/", "--chdir", "/work", "--clearenv", "--setenv", "PATH", _PATH]
    return argv + ["--"]


def _start_bwrap(handle, spec, limits, modules, server_end):
    uid, handle.uid_lock = _take_uid()
    shown_uid = os.getuid() if uid is None else uid
    passwd_r, passwd_w = os.pipe()
    os.write(passwd_w, (f"root:x:0:0:root:/:/usr/sbin/nologin\n"
                        f"sandbox:x:{shown_uid}:{shown_uid}:sandbox:/work:/bin/bash\n"
                        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n").encode())
    os.close(passwd_w)
    # kill(-1) from PID 1 of the namespace reaches every process of a run; the cgroup (or,
    # without one, RLIMIT_NPROC on the worker's own uid) bounds how many there are.
    handle.cgroup = _new_cgroup(limits)
    extra = {"oom_adj": True, "sysv_ipc": True, "mqueue": "/dev/mqueue",
             "nproc": limits.max_processes + 1}  # + server
    if handle.cgroup is None:
        extra["address_space_mb"] = limits.memory_mb
    else:
        handle.join_fds = _open_join_files(handle.cgroup)
        extra["join_cgroup_fds"] = handle.join_fds
    cfg = _server_config(modules, {"fd": server_end.fileno()}, "/work",
                         ["/tmp", "/dev/shm"], **extra)
    seccomp_r = _pipe_with(seccomp_filter())
    argv = _bwrap_argv(spec, limits, _uid_prefix(uid), passwd_r, seccomp_r)
    try:
        handle.proc = subprocess.Popen(
            argv + server_argv(spec.python) + [json.dumps(cfg)],
            pass_fds=[server_end.fileno(), passwd_r, seccomp_r, *handle.join_fds],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env={"PATH": _PATH})
    finally:
        os.close(passwd_r)
        os.close(seccomp_r)


def _pipe_with(data: bytes) -> int:
    """The read end of a pipe that holds `data` (and is closed for writing)."""
    r, w = os.pipe()
    try:
        os.write(w, data)
    finally:
        os.close(w)
    return r


# Keyrings are per uid, not per IPC namespace: a key a run adds to its user keyring would be
# there for the next run of the same worker. Runs under bwrap cannot use them at all (docker's
# default seccomp profile refuses these calls too): add_key, request_key and keyctl fail with
# ENOSYS, as does every system call of a foreign ABI (i386, x32), which could reach them
# under other numbers.
_KEYRING_SYSCALLS = {"x86_64": (0xC000003E, (248, 249, 250)),
                     "aarch64": (0xC00000B7, (217, 218, 219))}


@functools.lru_cache(maxsize=1)
def seccomp_filter() -> bytes:
    """The classic-BPF seccomp program bwrap loads (--seccomp), as `struct sock_filter`s."""
    machine = os.uname().machine
    if machine not in _KEYRING_SYSCALLS:
        raise BackendUnavailable(f"no keyring seccomp filter for {machine}: bwrap runs would "
                                 "share the worker's keyrings")
    arch, calls = _KEYRING_SYSCALLS[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, enosys = 0x7FFF0000, 0x00050000 | 38
    n = 4 + len(calls)  # the index of the final "ret errno", from the first check on
    prog = [(ld, 0, 0, 4), (jeq, 0, n + 1 - 2, arch), (ld, 0, 0, 0),
            (jge, n + 1 - 4, 0, 0x40000000)]  # x32's numbers
    for i, nr in enumerate(calls):
        prog.append((jeq, n + 1 - (5 + i), 0, nr))
    prog += [(ret, 0, 0, allow), (ret, 0, 0, enosys)]
    return b"".join(struct.pack("<HBBI", *insn) for insn in prog)


@functools.lru_cache(maxsize=1)
def docker_client():
    """One docker SDK client per process (it pools its connections to the daemon)."""
    import docker
    return docker.from_env(timeout=60)


def _start_docker(spec, limits, modules) -> Handle:
    client = docker_client()
    uid, uid_lock = _take_uid()
    uid = 65534 if uid is None else uid
    chan_dir = tempfile.mkdtemp(prefix=f"ptrain-sbx-{os.getpid()}-docker-")
    os.chmod(chan_dir, 0o711)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(chan_dir, "sock"))
    os.chmod(os.path.join(chan_dir, "sock"), 0o666)
    listener.listen(1)
    cfg = _server_config(modules, {"connect": "/chan/sock"}, "/work",
                         ["/tmp", "/dev/shm"], oom_adj=True, sysv_ipc=True,
                         mqueue="/dev/mqueue")
    # The container's one memory limit also covers the server and the tmpfs mounts, whose
    # pages outlive a killed run: the mounts share `memory_mb` between them, so that what a
    # run leaves there never squeezes the server (see docs/sandbox.md).
    mb = limits.memory_mb
    container = None
    try:
        container = client.containers.run(
            spec.image, server_argv(spec.python) + [json.dumps(cfg)], detach=True,
            auto_remove=True, network_mode="host" if limits.network else "none",
            mem_limit=f"{limits.memory_mb + _SERVER_MEMORY_MB}m",
            memswap_limit=f"{limits.memory_mb + _SERVER_MEMORY_MB}m",
            pids_limit=limits.max_processes + 1, read_only=True, user=f"{uid}:{uid}",
            tmpfs={"/work": f"size={mb // 2}m,mode=1777,exec",
                   "/tmp": f"size={mb // 4}m,mode=1777"},
            shm_size=f"{mb // 4}m", cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            hostname=None if limits.network else "sandbox",
            working_dir="/work", environment={"PATH": _PATH},
            volumes={chan_dir: {"bind": "/chan", "mode": "rw"}},
            labels={"ptrain-sandbox": str(os.getpid())})
        listener.settimeout(_STARTUP_TIMEOUT_S)
        sock, _ = listener.accept()
    except BaseException:
        listener.close()
        if container is not None:
            try:
                container.remove(force=True)
            except Exception:  # noqa: BLE001
                pass
        shutil.rmtree(chan_dir, ignore_errors=True)
        if uid_lock is not None:
            os.close(uid_lock)
        raise
    listener.close()
    handle = Handle("docker", sock)
    handle.container, handle.uid_lock = container, uid_lock
    # Connected: the rendezvous dir has done its job; gone now, it cannot outlive a crash.
    shutil.rmtree(chan_dir, ignore_errors=True)
    try:
        _await_ready(handle)
    except BaseException:
        handle.kill()
        raise
    cid = container.id
    for base in ("/sys/fs/cgroup/memory/docker", "/sys/fs/cgroup/system.slice"):
        if os.path.isdir(os.path.join(base, cid)):
            handle.oom_control = os.path.join(base, cid, "memory.oom_control")
    pids_dir = f"/sys/fs/cgroup/pids/docker/{cid}"
    if os.path.isdir(pids_dir):
        handle.pids_file = os.path.join(pids_dir, "cgroup.procs")
        try:
            with open(handle.pids_file) as f:
                handle.server_pid = int(f.read().split()[0])
        except (OSError, IndexError):
            pass
    if handle.server_pid is not None:
        _shield_from_oom(handle.server_pid)
    return handle
