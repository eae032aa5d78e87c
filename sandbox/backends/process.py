"""The `process` backend: the fork server as a plain child process on the host. Rlimits, its
own session, a fresh temp work dir, a scrubbed environment, a memory+pids cgroup where the
machine allows (else rlimits), and the whole tree killed after every run. Not a security
boundary (docs/sandbox.md)."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile

from sandbox.backends import base
from sandbox.backends.preimport import PREIMPORT


@dataclasses.dataclass(frozen=True)
class Process:
    """Plain processes on the host (weakest, needs nothing). Not a security boundary.
    `preload`: (module name, Python source) pairs the fork server executes once, as the
    bodies of modules of those names, before it forks any run (the judge's harness)."""
    python: str = sys.executable
    preimport: tuple[str, ...] = PREIMPORT
    preload: tuple[tuple[str, str], ...] = ()
    name = "process"

    def unavailable_reason(self) -> str | None:
        return None if os.access(self.python, os.X_OK) else f"no python at {self.python}"

    def reset(self) -> dict:
        """What the fork server resets after each run, beyond the scratch dirs: nothing
        (/dev/shm and IPC are the host's)."""
        return {}

    def start(self, limits, modules) -> base.LocalServer:
        host_end, server_end = socket.socketpair()
        server = base.LocalServer(self.name, host_end)
        root = tempfile.mkdtemp(prefix=f"ptrain-sbx-{os.getpid()}-")
        server.cleanup_paths.append(root)

        def popen():
            server.cgroup = base.new_cgroup(limits)
            extra = {"remove_on_exit": [root], "oom_adj": True, **self.reset()}
            if server.cgroup is not None:
                server.join_fds = base.open_join_files(server.cgroup)
                extra.update(cgroup_procs=server.cgroup.procs_file(),
                             join_cgroup_fds=server.join_fds)
            else:
                extra.update(address_space_mb=limits.memory_mb,
                             nproc=None if os.geteuid() == 0
                             else _user_processes() + limits.max_processes)
            cfg = base.server_config(modules, {"fd": server_end.fileno()},
                                     os.path.join(root, "work"), [os.path.join(root, "tmp")],
                                     **extra)
            cfg["path"] = os.path.dirname(self.python) + ":" + base.PATH
            server.proc = subprocess.Popen(
                base.server_argv(self.python) + [json.dumps(cfg)],
                pass_fds=[server_end.fileno(), *server.join_fds],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, cwd=root, env={"PATH": cfg["path"], "LANG": "C.UTF-8"})

        return base.start_local(server, popen, server_end)


def _user_processes() -> int:
    uid, n = os.getuid(), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                n += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                pass
    return n
