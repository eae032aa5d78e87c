"""Per-sandbox memory and pids cgroups, on the host side, where the machine allows them.

Detects what is there (cgroup v1 `memory` + `pids` hierarchies, or a cgroup v2 tree with both
controllers delegated to us) and whether we may write it; never assumes. Without cgroups the
backends fall back to rlimits (see docs/sandbox.md).

A sandbox's cgroup is a child of the caller's own cgroup, so the caller's limits still hold,
named `ptrain-sbx-<host pid>-<n>`, with `server` and `run` below it; cgroups left by a
crashed host are removed the next time one is made.
"""

import functools
import itertools
import os
import signal
import time

_ROOT = "/sys/fs/cgroup"
_PREFIX = "ptrain-sbx-"
_counter = itertools.count()


def _own_paths() -> dict[str, str]:
    """controller (or "" for the v2 tree) -> this process's cgroup path."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _try_mkdir(parent: str) -> str | None:
    path = os.path.join(parent, f"{_PREFIX}probe-{os.getpid()}-{next(_counter)}")
    try:
        os.mkdir(path)
    except OSError:
        return None
    os.rmdir(path)
    return parent


def _layout() -> tuple[str, dict[str, str]] | None:
    """("v1", {"memory": dir, "pids": dir}) or ("v2", {"": dir}): where sandbox cgroups go."""
    try:
        own = _own_paths()
    except OSError:
        return None
    v1 = {c: os.path.join(_ROOT, c) + own.get(c, "/") for c in ("memory", "pids")}
    if all(os.path.exists(os.path.join(_ROOT, c, "cgroup.procs")) for c in v1):
        if all(_try_mkdir(d) for d in v1.values()):
            return "v1", v1
        return None
    controllers = os.path.join(_ROOT, "cgroup.controllers")
    if os.path.exists(controllers) and "" in own:
        parent = _ROOT + own[""]
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
        except OSError:
            return None
        if {"memory", "pids"} <= set(enabled) and _try_mkdir(parent):
            return "v2", {"": parent}
    return None


@functools.lru_cache(maxsize=1)
def layout():
    """The cgroup layout sandbox cgroups use, or None (then rlimits only). Cached."""
    return _layout()


class Cgroup:
    """The cgroups of one sandbox: `<name>/server` holds the fork server (no limit of ours),
    `<name>/run` holds each run (memory and pids limits). Every run child moves itself into
    `run` before anything else, so the limits cover all it starts, its files on tmpfs too,
    and the server never competes with a run for memory (an OOM kill always hits the run)."""

    def __init__(self, memory_bytes: int, pids_max: int):
        found = layout()
        if found is None:
            raise OSError("no writable cgroup memory+pids hierarchy")
        self.version, parents = found
        _sweep(parents)
        name = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        self.top = {c: os.path.join(p, name) for c, p in parents.items()}
        self.made: list[str] = []
        self.peak_fds: list[int] = []  # the run's memory peaks (`reset_peaks`)
        try:
            for top in self.top.values():
                self._mkdir(top)
                if self.version == "v2":
                    _write(os.path.join(top, "cgroup.subtree_control"), "+memory +pids")
                self._mkdir(os.path.join(top, "server"))
                self._mkdir(os.path.join(top, "run"))
            self._set_limits(memory_bytes, pids_max)
            if self.version == "v1":
                self.peak_fds = open_peaks(os.path.dirname(self._file("memory", "run", "x")))
        except OSError:
            self.remove()
            raise

    def _mkdir(self, path: str) -> None:
        os.mkdir(path)
        self.made.append(path)

    def _file(self, controller: str, part: str, name: str) -> str:
        return os.path.join(self.top["" if self.version == "v2" else controller], part, name)

    def _set_limits(self, memory_bytes: int, pids_max: int) -> None:
        if self.version == "v1":
            _write(self._file("memory", "run", "memory.limit_in_bytes"), memory_bytes)
            try:  # no swapping past the limit, where swap accounting exists
                _write(self._file("memory", "run", "memory.memsw.limit_in_bytes"), memory_bytes)
            except OSError:
                pass
        else:
            _write(self._file("memory", "run", "memory.max"), memory_bytes)
            try:
                _write(self._file("memory", "run", "memory.swap.max"), 0)
            except OSError:
                pass
        _write(self._file("pids", "run", "pids.max"), pids_max)

    def add_server(self, pid: int) -> None:
        """Move `pid` (one process, all its threads) into the server's cgroup."""
        for top in self.top.values():
            _write(os.path.join(top, "server", "cgroup.procs"), pid)

    def run_join_files(self) -> list[str]:
        """The files a run child writes "0" to, to move itself into the run cgroup (by fds
        the host opens: backends.base.open_join_files)."""
        return [os.path.join(top, "run", "cgroup.procs") for top in self.top.values()]

    def procs_file(self) -> str:
        """The file that lists the run's processes."""
        return self._file("pids", "run", "cgroup.procs")

    def pids(self) -> list[int]:
        """Processes of the run (there are none between runs)."""
        try:
            with open(self.procs_file()) as f:
                return [int(p) for p in f.read().split()]
        except OSError:
            return []

    def oom_kills(self) -> int:
        """How many processes the OOM killer has killed in the run cgroup so far."""
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        try:
            with open(self._file("memory", "run", name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            pass
        return 0

    def reset_peaks(self) -> None:
        """Reset the run cgroup's memory peak and fail counts (v1; v2's memory.peak has no
        reset for all readers), so that no run reads the one before's."""
        reset_peaks(self.peak_fds)

    def kill_run(self) -> None:
        """Kill every process of the run cgroup (the cgroups stay, for the next run)."""
        _kill_all(os.path.dirname(self.procs_file()))

    def remove(self) -> None:
        """Kill whatever is left in any of the cgroups, then remove them."""
        for fd in self.peak_fds:
            os.close(fd)
        self.peak_fds = []
        for path in reversed(self.made):
            _kill_all(path)
            _rmdir(path)
        self.made = []


_PEAKS = ("memory.max_usage_in_bytes", "memory.memsw.max_usage_in_bytes", "memory.failcnt",
          "memory.memsw.failcnt")


def open_peaks(memory_dir: str) -> list[int]:
    """The v1 memory controller's peak and fail counters in `memory_dir` (those this kernel
    has: without swap accounting, no memsw files), opened for writing: `reset_peaks` writes
    0 to each, ~40x cheaper than opening them every time. The caller closes them."""
    fds = []
    for name in _PEAKS:
        try:
            fds.append(os.open(os.path.join(memory_dir, name), os.O_WRONLY | os.O_CLOEXEC))
        except OSError:
            pass
    return fds


def reset_peaks(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.write(fd, b"0")
        except OSError:
            pass


def kill_until_gone(list_pids, timeout_s: float) -> None:
    """SIGKILL every pid `list_pids()` returns, again, until it returns none or `timeout_s`
    passes (a process may fork between a listing and its kill)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = list_pids()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.001)


def _kill_all(path: str, timeout_s: float = 5.0) -> None:
    def procs():
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                return [int(p) for p in f.read().split()]
        except OSError:
            return []
    kill_until_gone(procs, timeout_s)


def _rmdir(path: str) -> None:
    for _ in range(100):  # the last exiting tasks may still hold it for a moment
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.005)


def _sweep(parents: dict[str, str]) -> None:
    """Remove sandbox cgroups whose host process is gone (a crashed caller leaves them)."""
    for parent in parents.values():
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            if not name.startswith(_PREFIX) or name.startswith(_PREFIX + "probe"):
                continue
            try:
                host_pid = int(name[len(_PREFIX):].split("-")[0])
            except ValueError:
                continue
            if host_pid != os.getpid() and not os.path.exists(f"/proc/{host_pid}"):
                path = os.path.join(parent, name)
                for sub in ("run", "server", ""):
                    _kill_all(os.path.join(path, sub))
                    _rmdir(os.path.join(path, sub))
