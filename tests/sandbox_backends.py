"""Shared by the sandbox tests: every backend as a pytest param, skipped with the reason
when it cannot run here, and host-side views used to check that a run left nothing behind."""

import collections
import gc
import os
import re
import socket
import struct
import tempfile
import time

import pytest

import sandbox
from sandbox import cgroups


def backend_params(names=("process", "bwrap", "docker")):
    params = []
    for name in names:
        reason = sandbox.unavailable_reason(sandbox.pick_backend(name))
        params.append(pytest.param(name, id=name, marks=pytest.mark.skipif(
            reason is not None, reason=f"{name} backend unavailable: {reason}")))
    return params


def own_temp_dirs(pid: int | None = None) -> set[str]:
    """This process's (or `pid`'s) sandbox scratch dirs in the temp dir."""
    prefix = f"ptrain-sbx-{pid or os.getpid()}-"
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(prefix)}


def own_cgroups(pid: int | None = None) -> set[str]:
    """This process's (or `pid`'s) worker cgroups."""
    found = cgroups.layout()
    if found is None:
        return set()
    prefix = f"ptrain-sbx-{pid or os.getpid()}-"
    return {os.path.join(p, n) for p in found[1].values() for n in os.listdir(p)
            if n.startswith(prefix)}


def own_containers(pid: int | None = None) -> set[str]:
    """Docker containers this process's (or `pid`'s) workers started."""
    if sandbox.unavailable_reason(sandbox.Docker()) is not None:
        return set()
    label = f"ptrain-sandbox={pid or os.getpid()}"
    found = sandbox.backends.docker_client().containers.list(all=True, sparse=True,
                                                             filters={"label": label})
    return {c.id for c in found}


@pytest.fixture(autouse=True)
def objects_before_the_test_frozen():
    """Autouse in the modules that import it: what the process held before the test is out of
    `open_fds`'s collection (gc.freeze) for the test's length. A full collection of an xdist
    worker that has run the JAX tests walks its ~10^6 objects (measured: 0.3 s each at 427k
    objects, after test_model alone, twice per test); frozen objects are never collected, so
    the fd views before and after a test see the same ones, and what the test made is still
    collected."""
    gc.freeze()
    yield
    gc.unfreeze()


def open_fds() -> dict[str, int]:
    """This process's open fds by kind (what each links to, its inode number dropped: "pipe",
    "socket", "anon_inode:[pidfd]", a file's path), so that a leak names itself. Left out:
    the docker SDK's connections to the daemon (a pool that grows as it likes; the containers
    are checked instead), told apart by their peer process; collected first, so that an
    unreachable object's fds (a failed connection) are gone (`objects_before_the_test_frozen`
    keeps that collection to the test's own objects)."""
    gc.collect()
    kinds = collections.Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not (target.startswith("socket:") and _peer_command(int(fd)) == "dockerd"):
            kinds[re.sub(r":\[\d+\]$", "", target)] += 1
    return dict(kinds)


def _peer_command(fd: int) -> str:
    """The command name of the process at the other end of a unix socket ("" if none)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", creds)[0]
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() if pid else ""
    except OSError:
        return ""


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker` (a survivor a program tried to leave)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        out.append(int(name))
            except OSError:
                pass
    return out


def wait_until(condition, timeout_s: float = 20.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout_s` passes (False): for effects that
    land asynchronously (a process exiting after its parent died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()
