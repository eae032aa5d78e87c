"""The bubblewrap backend: terminal tasks that need only files, without docker.

A task qualifies when its Dockerfile only puts files on a base whose root file system is
unpacked on this machine (bwrap_plan.py: `plan`, `NeedsImage`, re-exported here; `bash
sandbox/setup_host.sh` unpacks ptrain-term-base's, the same files its docker image is made
of). Anything else needs the image the Dockerfile builds: `plan` raises `NeedsImage` naming
the line, never a silently different environment.

`Box` is the `Container` of this backend (the same methods, so `Harness`, `Episode`, `Shell`
and the verifier are the docker backend's code): one `bwrap` process per episode with

- a fresh tmpfs as `/` (sized by the task's `storage_mb`, else its `memory_mb`): the work
  dir, /tmp, /root, /home, /opt, /srv, /run, /tests, /logs live there and are writable; the
  base's /usr, /etc and /var are bound read-only (an episode cannot change them);
- every namespace new (`--unshare-all`): no network but a loopback of its own (unless the
  task allows it and the operator enables it), its own pids (bwrap is pid 1 and reaps), IPC,
  UTS (hostname "task"); root inside a user namespace, with docker's default capabilities
  minus NET_RAW, MKNOD, AUDIT_WRITE and SETFCAP;
- memory and pids limits from the task (sandbox/cgroups.py, where the host lets us write
  cgroups; else none: logged); CPUs are not bounded here.

Commands (the agent's shell on a pseudo-terminal, the verifier) join it with `nsenter`; files
go in and out through `/proc/<pid 1>/root` with `hostfs.ConfinedRoot` (no symlink followed).
The tests are copied in only by `Episode.verify`, after the agent's turn. Reset: the sandbox
is killed (its pid 1, and with it every process in it) and a new one started: nothing of an
episode survives into the next.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import logging
import math
import os
import pty
import select
import shlex
import shutil
import signal
import subprocess
import threading
import time

from sandbox.backends import base as sandbox_base
from sandbox.backends.bwrap import _KEYRING_SYSCALLS, _pipe_with, seccomp_filter
from sandbox.terminal import state as state_
from sandbox.terminal.bwrap_plan import ROOTFS_DIR, NeedsImage, Plan, bases, plan  # noqa: F401
from sandbox.terminal.container import Limits
from sandbox.terminal.exec_output import CappedBuffer, ExecResult
from sandbox.terminal.hostfs import ConfinedRoot, fs_identity
from sandbox.terminal.reset import _children, kill_tree

log = logging.getLogger("sandbox.terminal")

_READ_ONLY = ("usr", "etc", "var")  # of the base's top level; the rest is made writable
_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
         "NET_BIND_SERVICE", "SYS_CHROOT")  # docker's defaults minus _CAP_DROP's four
# Run inside, before every command that joins the box: a new session keyring (the host's is
# never reachable), docker's default capabilities only (the bounding set: the exec'd root
# keeps just those), no new privileges and the code sandbox's seccomp filter (keyrings and
# foreign system call ABIs refused); then become the user (by the sandbox's /etc/passwd).
_AS_USER = """
import ctypes, os, pwd, struct, sys
libc, keep = ctypes.CDLL(None, use_errno=True), {0, 1, 3, 4, 5, 6, 7, 8, 10, 18}
def check(r, what):
    if r != 0: raise OSError(ctypes.get_errno(), what)
check(libc.syscall(int(sys.argv[1]), 1, 0) < 0, "KEYCTL_JOIN_SESSION_KEYRING")
for cap in range(64):
    if cap not in keep and libc.prctl(24, cap, 0, 0, 0) != 0:
        if ctypes.get_errno() == 22: break
        raise OSError(ctypes.get_errno(), f"PR_CAPBSET_DROP {cap}")
if sys.argv[2] not in ("root", "0"):
    u = pwd.getpwuid(int(sys.argv[2])) if sys.argv[2].isdigit() else pwd.getpwnam(sys.argv[2])
    os.initgroups(u.pw_name, u.pw_gid); os.setgid(u.pw_gid); os.setuid(u.pw_uid)
    os.environ["HOME"] = u.pw_dir
prog = bytes.fromhex(sys.argv[3])
buf = ctypes.create_string_buffer(prog, len(prog))
fprog = struct.pack("HxxxxxxQ", len(prog) // 8, ctypes.addressof(buf))
check(libc.prctl(38, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
check(libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0), "PR_SET_SECCOMP")
os.execvp(sys.argv[4], sys.argv[4:])
"""


# bwrap's --die-with-parent is PR_SET_PDEATHSIG, which fires when the *thread* that started
# bwrap exits, not the process: a sandbox started from a pool thread (the terminal producer's,
# an evaluation's) was SIGKILLed when that pool shut down, and its warm box, reused by the
# next episode, was gone (ContainerGone; the episode scored 0). Every sandbox is started from
# one thread instead, which lives as long as the process (it ends at interpreter exit, and
# the sandboxes with it, as --die-with-parent means them to); one per process (a forked
# child has none of its parent's threads).
_spawner: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_spawner_lock = threading.Lock()


def _spawn(argv, **kwargs) -> subprocess.Popen:
    """subprocess.Popen(argv, **kwargs) on this process's spawner thread (see above)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():
            _spawner = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="bwrap-spawner"))
        pool = _spawner[1]
    return pool.submit(subprocess.Popen, argv, **kwargs).result()


# The /proc entries docker masks (an empty file or directory) and those it makes read-only.
_PROC_MASKED = ("asound", "acpi", "kcore", "keys", "latency_stats", "timer_list",
                "timer_stats", "sched_debug", "scsi", "interrupts", "kallsyms", "kmsg")
_PROC_READ_ONLY = ("bus", "fs", "irq", "sys", "sysrq-trigger")


def _proc_masks() -> list[str]:
    """bwrap arguments masking what exists of those on this kernel (below a fresh /proc)."""
    out = []
    for name in _PROC_MASKED:
        path = f"/proc/{name}"
        if os.path.isdir(path):
            out += ["--tmpfs", path, "--remount-ro", path]
        elif os.path.exists(path):
            out += ["--ro-bind", "/dev/null", path]
    for name in _PROC_READ_ONLY:
        if os.path.exists(f"/proc/{name}"):
            out += ["--ro-bind", f"/proc/{name}", f"/proc/{name}"]
    return out


def _wait_exited(pid: int, timeout_s: float) -> None:
    """Until `pid` is gone or a zombie: a namespace's pid 1 killed by SIGKILL first waits in
    the kernel for every other process of the namespace to die (a traced one may take a
    moment), so a box is only stopped once that wait is over."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    return
        except OSError:
            return
        time.sleep(0.002)
    log.warning("terminal (bwrap): pid %d still running %.0f s after its SIGKILL", pid, timeout_s)


def _pids_of(uid: int) -> list[int]:
    """Host pids running as `uid` (zombies included: their namespace is not gone yet)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:  # (status, not the /proc entry's owner: that is root for a non-dumpable one)
                with open(f"/proc/{name}/status", "rb") as f:
                    line = next(x for x in f if x.startswith(b"Uid:"))
                if int(line.split()[1]) == uid:
                    out.append(int(name))
            except (OSError, StopIteration):
                pass
    return out


def unavailable() -> str | None:
    """Why this machine cannot run the backend (None when it can)."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (make system-deps / bash sandbox/setup_host.sh)"
    if shutil.which("nsenter") is None:
        return "nsenter (util-linux) is not installed"
    if not os.path.isdir(ROOTFS_DIR) or not any(n.endswith(".json")
                                                for n in os.listdir(ROOTFS_DIR)):
        return (f"no base root file system in {ROOTFS_DIR} (bash sandbox/setup_host.sh "
                f"unpacks ptrain-term-base's there)")
    # (/usr only: a recursive bind of / races with the mounts docker makes and removes)
    r = subprocess.run(["bwrap", "--unshare-all", "--unshare-user", "--ro-bind", "/usr", "/usr",
                        "--ro-bind-try", "/lib", "/lib", "--ro-bind-try", "/lib64", "/lib64",
                        "/usr/bin/true"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"bwrap cannot make namespaces here: {r.stderr.strip()[-200:]}"
    return None


# ---------------------------------------------------------------------------------------------
# The sandbox
# ---------------------------------------------------------------------------------------------

def _readable(fd: int, timeout_s: float | None) -> bool:
    """Whether `fd` has data (or its other end hung up) within `timeout_s` (None: wait).
    poll, not select: select() refuses a descriptor >= FD_SETSIZE (1024), which a long-lived
    process with many files open (a test worker, a long run) hands out."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else max(0, math.ceil(timeout_s * 1000))))


class _PtyStream:
    """The socket-like end of a pseudo-terminal (what `Shell` reads and writes)."""

    def __init__(self, fd: int, proc: subprocess.Popen):
        self.fd, self.proc, self._timeout = fd, proc, None

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def settimeout(self, timeout) -> None:
        self._timeout = timeout

    def recv(self, n: int) -> bytes:
        if not _readable(self.fd, self._timeout):
            raise TimeoutError
        try:
            return os.read(self.fd, n)
        except OSError as e:
            if e.errno == errno.EIO:  # the terminal's other side closed: the shell exited
                return b""
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the session gets SIGHUP
            self.fd = -1
        threading.Thread(target=self.proc.wait, daemon=True).start()  # reaped when it ends


class Box:
    """A task's bwrap sandbox, with `Container`'s methods (see the module docstring)."""

    def __init__(self, plan_: Plan, limits: Limits = Limits(), *, env=(), name: str = "task",
                 pytest_dir: str | None = None, populate: bool = True,
                 net_of: int | None = None):
        """`populate`: lay the Dockerfile's files in (the verifier's box gets the agent's
        state instead); `net_of`: share that box's network namespace (a verifier of a task
        whose tests use the agent's services: nothing else of that box is shared)."""
        self.plan, self.limits, self._name = plan_, limits, name
        self._populate, self._net_of = populate, net_of
        self.image = plan_.image
        self.env = {"HOME": "/root", **dict(plan_.env), **dict(env)}
        self.workdir, self.user = plan_.workdir, ""
        self._pytest_dir = pytest_dir
        self._lock = threading.Lock()
        self.resets = {"restart": 0}
        self.storage = "tmpfs"
        self.proc = self.pid = self._cgroup = self._cgroup_error = None
        # An unprivileged host uid of its own (root inside, nobody outside), from the code
        # sandbox's pool; None when we are not root (then the box is our own uid).
        self.host_uid, self._uid_lock = sandbox_base.take_uid()
        try:
            self._start()
        except BaseException:
            self._release_uid()
            raise

    reset_mode = "restart"

    # --- life cycle ---------------------------------------------------------------------------

    def _release_uid(self) -> None:
        if self._uid_lock is not None:
            os.close(self._uid_lock)
            self._uid_lock = None

    def _argv(self, info_fd: int, seccomp_fd: int) -> list[str]:
        root, mb = self.plan.rootfs, self.limits.storage_mb or self.limits.memory_mb
        argv = []
        if self._net_of is not None:  # the agent's box's network, nothing else of it
            argv += ["nsenter", f"--net=/proc/{self._net_of}/ns/net", "--"]
        if self.host_uid is not None:
            argv += ["setpriv", f"--reuid={self.host_uid}", f"--regid={self.host_uid}",
                     "--clear-groups", "--"]
        unshare = ["--unshare-all"] if self._net_of is None else [
            "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        argv += ["bwrap", *unshare, "--unshare-user", "--uid", "0", "--gid", "0",
                 "--seccomp", str(seccomp_fd),
                "--die-with-parent", "--new-session", "--hostname", "task", "--disable-userns",
                "--cap-drop", "ALL", *[a for c in _CAPS for a in ("--cap-add", f"CAP_{c}")],
                "--size", str(mb << 20), "--tmpfs", "/", "--info-fd", str(info_fd)]
        # The sandbox's processes (whose /proc/N/environ the agent can read) get the task's
        # environment, never the host's (its tokens, paths, LD_PRELOAD); commands get theirs
        # from _enter.
        argv.append("--clearenv")
        for key, value in self.env.items():
            argv += ["--setenv", key, value]
        if self.limits.network and self._net_of is None:
            argv.append("--share-net")
        for entry in sorted(set(os.listdir(root)) - {"proc", "dev", "sys"}):
            path = os.path.join(root, entry)
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), f"/{entry}"]
            elif entry in _READ_ONLY:
                argv += ["--ro-bind", path, f"/{entry}"]
            elif os.path.isdir(path):
                argv += ["--perms", f"{os.stat(path).st_mode & 0o7777:o}", "--dir", f"/{entry}"]
        argv += ["--proc", "/proc", *_proc_masks(), "--dev", "/dev", "--perms", "1777",
                 "--dir", "/tmp", "--dir", "/tests", "--dir", "/logs"]
        if self._pytest_dir:
            from sandbox.terminal.container import PYTEST_MOUNT
            argv += ["--ro-bind", self._pytest_dir, PYTEST_MOUNT]
        # Its first words say the sandbox is set up (bwrap reports its pid before that).
        return argv + ["--", "/bin/sh", "-c", "echo ready; exec sleep infinity"]

    def _start(self) -> None:
        from sandbox import cgroups
        if self._cgroup is None and self._cgroup_error is None:  # one per box, kept by reset
            try:
                self._cgroup = cgroups.Cgroup(self.limits.memory_mb << 20, self.limits.pids)
            except OSError as e:
                self._cgroup_error = str(e)
                log.info("terminal (bwrap): no memory/pids cgroup here (%s): unbounded", e)
        r, w = os.pipe()
        seccomp_r = _pipe_with(seccomp_filter())
        try:
            # (bwrap's own pid 1 of the sandbox keeps bwrap's environment: only a PATH)
            self.proc = _spawn(self._joined(self._argv(w, seccomp_r)), pass_fds=(w, seccomp_r),
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE,
                               env={"PATH": os.environ.get("PATH", os.defpath)})
            os.close(w)
            os.close(seccomp_r)
            w = seccomp_r = -1
            info = b""
            while b"}" not in info and (chunk := os.read(r, 4096)):
                info += chunk
            ready = self.proc.stdout.readline()  # the sandbox is set up once it speaks
            if b"}" not in info or ready != b"ready\n":
                raise RuntimeError(f"bwrap did not start the sandbox for {self._name}: "
                                   f"{self.proc.stderr.read1(4096).decode()[-500:]}")
            self.pid = json.loads(info[:info.index(b"}") + 1])["child-pid"]
            self.root = f"/proc/{self.pid}/root"
            if os.path.samestat(os.stat(self.root + "/"), os.stat("/")):
                raise RuntimeError(f"the sandbox of {self._name} has the host's root")
            if self._populate:
                files = self._files()
                for d in self.plan.dirs:
                    files.fresh_dir(d, 0o755)
                files.write(self.plan.copies)
        except BaseException:
            self._stop()
            raise
        finally:
            os.close(r)
            for fd in (w, seccomp_r):
                if fd >= 0:
                    os.close(fd)

    def _joined(self, argv, tty: str | None = None) -> list[str]:
        """`argv` run by the host's sh, which first moves itself into the sandbox's cgroup
        (if there is one) and, with `tty`, onto that terminal as its controlling one, then
        execs: no preexec_fn, so subprocess spawns with vfork, never a fork of this (JAX,
        multi-threaded) process."""
        joins = self._cgroup.run_join_files() if self._cgroup is not None else []
        script = "".join(f"echo $$ > {shlex.quote(p)} && " for p in joins)
        if tty is not None:  # a session leader opening a terminal acquires it
            script += 'exec 0<>"$1" 1>&0 2>&0 && shift && '
        return ["/bin/sh", "-c", script + 'exec "$@"', "sh",
                *([tty] if tty is not None else []), *argv]

    def _stop(self, *, keep_cgroup: bool = False) -> None:
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)  # pid 1 of its namespace: all of it dies
            except ProcessLookupError:
                pass
        if self.proc is not None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
            self.proc.wait()
            for pipe in (self.proc.stdout, self.proc.stderr):
                pipe.close()
        if self.pid is not None:  # its pid 1 exits once every process of it is dead
            _wait_exited(self.pid, timeout_s=30.0)
        if self._cgroup is not None:
            if keep_cgroup:  # emptied: what pid 1's death left (an nsenter'd straggler)
                self._cgroup.kill_run()
            else:
                self._cgroup.remove()
                self._cgroup = None
        self.proc = self.pid = None

    def reset(self) -> str:
        """A new sandbox: nothing of the last episode (files, processes) is left."""
        with self._lock:
            self._stop(keep_cgroup=True)
            self._start()
            self.resets["restart"] += 1
            return "restart"

    def close(self) -> None:
        with self._lock:
            self._stop()
            if self.host_uid is not None:
                # Its uid goes back to the pool only once nothing runs as it: an orphan (the
                # shell, once its nsenter parent hung up) is reaped by the host's init.
                from sandbox import cgroups
                cgroups.kill_until_gone(lambda: _pids_of(self.host_uid), timeout_s=5.0)
            self._release_uid()

    # --- the end of an episode ----------------------------------------------------------------

    def end_episode(self, *, kill: bool, limit: int) -> state_.State:
        """The agent's files as data (the whole writable root), after killing every process
        of the box (`kill`: its pid namespace, by SIGKILL to its pid 1) unless the task's
        tests use the agent's running services. The box's root stays readable through a
        held descriptor while its processes die."""
        with self._lock:
            if self.pid is None:
                from sandbox.terminal.container import ContainerGone
                raise ContainerGone(f"the sandbox of {self._name} is gone")
            root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                if kill:
                    self._stop(keep_cgroup=True)
                # (the mounts below the root are detached once its processes are dead: their
                # mount points are left out by name)
                from sandbox.terminal.container import PYTEST_MOUNT
                skip = state_.NOT_STATE | {f"/{d}" for d in _READ_ONLY} | {PYTEST_MOUNT}
                return state_.capture(f"/proc/self/fd/{root}", "/", limit=limit, skip=skip,
                                      uid_of=self._box_uid)
            finally:
                os.close(root)

    def kill(self) -> None:
        """Every process of the box (its pid namespace): the next reset starts a new one."""
        with self._lock:
            self._stop(keep_cgroup=True)

    def lay_state(self, state: state_.State) -> None:
        """The agent's state into this (fresh, idle) box."""
        if self.host_uid is None:
            return state_.apply(state, self.root, uid_of=lambda _uid: os.getuid())
        with fs_identity((self.host_uid, self.host_uid)):
            state_.apply(state, self.root, uid_of=lambda _uid: self.host_uid)

    def _box_uid(self, host_uid: int) -> int:
        return 0 if host_uid == (self.host_uid if self.host_uid is not None
                                 else os.getuid()) else 65534

    def _files(self) -> ConfinedRoot:
        """The box's files from the host, made owned by the box's root."""
        if self.host_uid is None:
            return ConfinedRoot(self.root)
        return ConfinedRoot(self.root, as_user=(self.host_uid, self.host_uid))

    @property
    def id(self) -> str:
        return f"bwrap-{self.pid}"

    @property
    def shares_network(self) -> bool:
        """Whether it runs in another box's network (a service task's verifier)."""
        return self._net_of is not None

    @property
    def path(self) -> str | None:
        return self.env.get("PATH")

    # --- processes ----------------------------------------------------------------------------

    def _enter(self, user, env, workdir) -> tuple[list[str], dict]:
        """The command line that runs a command in the sandbox (its namespaces, its root, the
        work dir) as `user`, through _AS_USER: a new session keyring, docker's default
        capabilities (the user namespace's root otherwise has all of them there), the
        seccomp filter."""
        if self.pid is None or self.proc.poll() is not None:
            from sandbox.terminal.container import ContainerGone
            raise ContainerGone(f"the sandbox of {self._name} is gone")
        # (nsenter's -w opens its directory before it enters: env -C changes to it inside)
        # (nsenter becomes the user namespace's root: the box's unprivileged host uid)
        argv = ["nsenter", "-t", str(self.pid), "-a", "-r", "--",
                "/usr/bin/env", "-C", workdir or self.workdir,
                "/usr/bin/python3", "-I", "-S", "-c", _AS_USER,
                str(_KEYRING_SYSCALLS[os.uname().machine][1][2]), user or "root",
                seccomp_filter().hex()]
        return argv, {**self.env, **dict(env or {})}

    def open_terminal(self, argv, *, user=None, env=None, workdir=None):
        """(stream, None): `argv` on a new pseudo-terminal in the sandbox (the shell)."""
        enter, env = self._enter(user, env, workdir)
        master, slave = pty.openpty()
        try:
            # (the slave as stdio too: the terminal is never without a reader's other end,
            # which would read as its end, EIO; the sh opens it again to make it its own)
            proc = subprocess.Popen(self._joined(enter + list(argv), os.ttyname(slave)),
                                    stdin=slave, stdout=slave, stderr=slave, env=env,
                                    start_new_session=True)
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        return _PtyStream(master, proc), None

    def exec(self, argv, *, timeout_s: float, user: str | None = None, env=None,
             workdir: str | None = None, max_output_bytes: int = 1 << 20) -> ExecResult:
        """Run `argv` in the sandbox, output capped, cut at `timeout_s` (its tree killed)."""
        t0 = time.monotonic()
        enter, env = self._enter(user, env, workdir)
        proc = subprocess.Popen(self._joined(enter + list(argv)), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        out, timed_out = CappedBuffer(max_output_bytes), False
        fd = proc.stdout.fileno()
        while True:
            left = t0 + timeout_s - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if _readable(fd, min(left, 1.0)):
                data = os.read(fd, 1 << 16)
                if not data:
                    break
                out.add(data)
        if timed_out:
            kill_tree(proc.pid)
        proc.stdout.close()
        code = proc.wait()
        return ExecResult(out.value(), None if timed_out else code, timed_out,
                          out.dropped > 0, time.monotonic() - t0)

    def _inside(self) -> list[int]:
        """Host pids of the sandbox's processes but its pid 1 and that one's sleep."""
        try:
            ns = os.readlink(f"/proc/{self.pid}/ns/pid")
        except OSError:
            return []
        keep = {self.pid, *_children(self.pid)[:1]}
        out = []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in keep:
                try:
                    if os.readlink(f"/proc/{name}/ns/pid") == ns:
                        out.append(int(name))
                except OSError:
                    pass
        return out

    def kill_processes(self) -> None:
        """Every process in the sandbox but its pid 1 and sleep (the verifier's cut)."""
        from sandbox import cgroups
        cgroups.kill_until_gone(self._inside, timeout_s=0.5)

    # --- files (from the host, through its pid 1's root: no symlink followed) ------------------

    def fresh_dirs(self, paths, mode: int = 0o755) -> None:
        for path in paths:
            self._files().fresh_dir(path, mode)

    def put_files(self, files) -> None:
        self._files().write(files)

    def read_files(self, path: str, max_bytes: int = 4 << 20) -> dict[str, bytes]:
        return ConfinedRoot(self.root).read_tree(path, max_bytes)
