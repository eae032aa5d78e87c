"""The `bwrap` backend: the fork server in bubblewrap namespaces (user, pid, net, ipc, uts,
mount), read-only root with only /usr (and a synthetic /etc/passwd) from the host, private
tmpfs /tmp, /work and /dev/shm, the IPC namespace's own /dev/mqueue, an unprivileged host uid
of its own per sandbox (when the caller is root), no capabilities, no new privileges, no
nested user namespaces, no keyrings (seccomp), cgroup memory+pids limits where available."""

import dataclasses
import functools
import json
import os
import shutil
import socket
import struct
import subprocess

from sandbox.backends import base
from sandbox.backends.preimport import PREIMPORT
from sandbox.request import Limits


@dataclasses.dataclass(frozen=True)
class Bwrap:
    """bubblewrap namespaces. `ro_binds`: extra host paths made visible read-only;
    `preload`: as for `Process`."""
    python: str = "/usr/bin/python3"
    ro_binds: tuple[str, ...] = ()
    preimport: tuple[str, ...] = PREIMPORT
    preload: tuple[tuple[str, str], ...] = ()
    name = "bwrap"

    def unavailable_reason(self) -> str | None:
        if shutil.which("bwrap") is None:
            return "bwrap is not installed (apt-get install bubblewrap)"
        if not os.access(self.python, os.R_OK | os.X_OK):
            return f"no python at {self.python} for the sandbox"
        if os.uname().machine not in _KEYRING_SYSCALLS:
            return (f"no keyring seccomp filter for {os.uname().machine}: bwrap runs would "
                    "share the sandbox's keyrings")
        probe_uid = base.UID_BASE if os.geteuid() == 0 else None
        argv = self._argv(Limits(), _uid_prefix(probe_uid), None)
        probe = subprocess.run(argv + [self.python, "-I", "-S", "-c", "pass"],
                               capture_output=True, timeout=30)
        if probe.returncode != 0:
            return f"bwrap cannot start a sandbox here: {probe.stderr.decode()[-300:]}"
        return None

    def reset(self) -> dict:
        """What the fork server resets after each run, beyond the scratch dirs: SysV IPC and
        POSIX message queues (its IPC namespace's own)."""
        return {"sysv_ipc": True, "mqueue": "/dev/mqueue"}

    def start(self, limits, modules) -> base.LocalServer:
        host_end, server_end = socket.socketpair()
        server = base.LocalServer(self.name, host_end)

        def popen():
            uid, server.uid_lock = base.take_uid()
            shown_uid = os.getuid() if uid is None else uid
            passwd_r = _pipe_with(
                (f"root:x:0:0:root:/:/usr/sbin/nologin\n"
                 f"sandbox:x:{shown_uid}:{shown_uid}:sandbox:/work:/bin/bash\n"
                 "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n").encode())
            # kill(-1) from PID 1 of the namespace reaches every process of a run; the cgroup
            # (or, without one, RLIMIT_NPROC on the sandbox's own uid) bounds how many.
            server.cgroup = base.new_cgroup(limits)
            extra = {"oom_adj": True, "nproc": limits.max_processes + 1, **self.reset()}
            if server.cgroup is None:
                extra["address_space_mb"] = limits.memory_mb
            else:
                server.join_fds = base.open_join_files(server.cgroup)
                extra["join_cgroup_fds"] = server.join_fds
            cfg = base.server_config(modules, {"fd": server_end.fileno()}, "/work",
                                     ["/tmp", "/dev/shm"], **extra)
            seccomp_r = _pipe_with(seccomp_filter())
            argv = self._argv(limits, _uid_prefix(uid), passwd_r, seccomp_r)
            try:
                server.proc = subprocess.Popen(
                    argv + base.server_argv(self.python) + [json.dumps(cfg)],
                    pass_fds=[server_end.fileno(), passwd_r, seccomp_r, *server.join_fds],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, start_new_session=True, env={"PATH": base.PATH})
            finally:
                os.close(passwd_r)
                os.close(seccomp_r)

        server = base.start_local(server, popen, server_end)
        if not limits.network:
            base.no_time_wait(server.server_pid)
        return server

    def _argv(self, limits, prefix, passwd_fd, seccomp_fd=None) -> list[str]:
        """The bwrap command line: no part of cgroupfs or /sys is visible; /dev/mqueue is the
        IPC namespace's own (the server empties it after every run); `seccomp_fd` holds the
        filter that keeps keyrings out (`seccomp_filter`)."""
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
        for path in self.ro_binds:
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
                 "--remount-ro", "/", "--chdir", "/work", "--clearenv",
                 "--setenv", "PATH", base.PATH]
        return argv + ["--"]


def _uid_prefix(uid: int | None) -> list[str]:
    if uid is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


def _pipe_with(data: bytes) -> int:
    """The read end of a pipe that holds `data` (and is closed for writing)."""
    r, w = os.pipe()
    try:
        os.write(w, data)
    finally:
        os.close(w)
    return r


# Keyrings are per uid, not per IPC namespace: a key a run adds to its user keyring would be
# there for the next run of the same sandbox. Runs under bwrap cannot use them at all (docker's
# default seccomp profile refuses these calls too): add_key, request_key and keyctl fail with
# ENOSYS, as does every system call of a foreign ABI (i386, x32), which could reach them
# under other numbers.
_KEYRING_SYSCALLS = {"x86_64": (0xC000003E, (248, 249, 250)),
                     "aarch64": (0xC00000B7, (217, 218, 219))}


@functools.lru_cache(maxsize=1)
def seccomp_filter() -> bytes:
    """The classic-BPF seccomp program bwrap loads (--seccomp), as `struct sock_filter`s."""
    arch, calls = _KEYRING_SYSCALLS[os.uname().machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, enosys = 0x7FFF0000, 0x00050000 | 38
    n = 4 + len(calls)  # the index of the final "ret errno", from the first check on
    prog = [(ld, 0, 0, 4), (jeq, 0, n + 1 - 2, arch), (ld, 0, 0, 0),
            (jge, n + 1 - 4, 0, 0x40000000)]  # x32's numbers
    for i, nr in enumerate(calls):
        prog.append((jeq, n + 1 - (5 + i), 0, nr))
    prog += [(ret, 0, 0, allow), (ret, 0, 0, enosys)]
    return b"".join(struct.pack("<HBBI", *insn) for insn in prog)
