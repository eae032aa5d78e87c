"""The `docker` backend: a warm container per sandbox (docker SDK): network none, memory/pids
limits, read-only root, tmpfs /work (exec), /tmp and /dev/shm, all capabilities dropped, no
new privileges, the default seccomp profile (no keyrings), an unprivileged uid of its own per
sandbox. The fork server resets the container between runs (docs/sandbox.md has the
measurement behind keeping it warm)."""

import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import socket
import tempfile
import time

from sandbox import cgroups
from sandbox.backends import base
from sandbox.backends.preimport import PREIMPORT

# The fork server's own memory counts against a docker container's limit; it gets this much
# on top of `memory_mb` (it uses ~25 MiB with the pre-imports, see docs/sandbox.md).
_SERVER_MEMORY_MB = 48


@dataclasses.dataclass(frozen=True)
class Docker:
    """A warm docker container per sandbox; `image` must have Python >= 3.8 at `python`;
    `preload`: as for `Process`."""
    image: str = "ptrain-sandbox:latest"
    python: str = "/usr/bin/python3"
    preimport: tuple[str, ...] = PREIMPORT
    preload: tuple[tuple[str, str], ...] = ()
    name = "docker"

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("docker") is None:
            return "the docker SDK is not installed (it is in ptrain's install: pip install -e .)"
        try:
            client = docker_client()
            client.ping()
        except Exception as e:  # noqa: BLE001 (any failure to reach the daemon)
            return f"docker daemon not reachable: {e}"
        try:
            client.images.get(self.image)
        except Exception as e:  # noqa: BLE001
            return f"docker image {self.image!r} not present (bash sandbox/setup_host.sh): {e}"
        return None

    def reset(self) -> dict:
        """What the fork server resets after each run, beyond the scratch dirs: SysV IPC and
        POSIX message queues (docker mounts the IPC namespace's mqueue at /dev/mqueue)."""
        return {"sysv_ipc": True, "mqueue": "/dev/mqueue"}

    def start(self, limits, modules) -> "DockerServer":
        client = docker_client()
        uid, uid_lock = base.take_uid()
        uid = 65534 if uid is None else uid
        chan_dir = tempfile.mkdtemp(prefix=f"ptrain-sbx-{os.getpid()}-docker-")
        os.chmod(chan_dir, 0o711)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.path.join(chan_dir, "sock"))
        os.chmod(os.path.join(chan_dir, "sock"), 0o666)
        listener.listen(1)
        cfg = base.server_config(modules, {"connect": "/chan/sock"}, "/work",
                                 ["/tmp", "/dev/shm"], oom_adj=True, **self.reset())
        # The container's one memory limit also covers the server and the tmpfs mounts, whose
        # pages outlive a killed run: the mounts share `memory_mb` between them, so that what
        # a run leaves there never squeezes the server (see docs/sandbox.md).
        mb = limits.memory_mb
        container = None
        try:
            container = client.containers.run(
                self.image, base.server_argv(self.python) + [json.dumps(cfg)], detach=True,
                auto_remove=True, network_mode="host" if limits.network else "none",
                mem_limit=f"{mb + _SERVER_MEMORY_MB}m", memswap_limit=f"{mb + _SERVER_MEMORY_MB}m",
                pids_limit=limits.max_processes + 1, read_only=True, user=f"{uid}:{uid}",
                tmpfs={"/work": f"size={mb // 2}m,mode=1777,uid={uid},gid={uid},exec",
                       "/tmp": f"size={mb // 4}m,mode=1777,uid={uid},gid={uid}"},
                shm_size=f"{mb // 4}m", cap_drop=["ALL"], security_opt=["no-new-privileges"],
                sysctls=None if limits.network else {"net.ipv4.tcp_max_tw_buckets": "0"},
                hostname=None if limits.network else "sandbox",
                working_dir="/work", environment={"PATH": base.PATH},
                volumes={chan_dir: {"bind": "/chan", "mode": "rw"}},
                labels={"ptrain-sandbox": str(os.getpid())})
            listener.settimeout(base.STARTUP_TIMEOUT_S)
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
        server = DockerServer(sock, container)
        server.uid_lock = uid_lock
        # Connected: the rendezvous dir has done its job; gone now, it cannot outlive a crash.
        shutil.rmtree(chan_dir, ignore_errors=True)
        try:
            base.await_ready(server)
        except BaseException:
            server.kill()
            raise
        server.find_cgroup()
        return server


class DockerServer(base.Server):
    """A fork server in a warm container: the container, and its cgroup files where the host
    can read them (OOM kills, processes)."""

    def __init__(self, sock, container):
        super().__init__("docker", sock)
        self.container = container
        self.oom_control: str | None = None  # the container's memory.oom_control
        self.pids_file: str | None = None  # the container's cgroup.procs
        self.peak_fds: list[int] = []  # the container's v1 memory peaks (cgroups.open_peaks)

    def find_cgroup(self) -> None:
        cid = self.container.id
        for top in ("/sys/fs/cgroup/memory/docker", "/sys/fs/cgroup/system.slice"):
            if os.path.isdir(os.path.join(top, cid)):
                self.oom_control = os.path.join(top, cid, "memory.oom_control")
                if top.startswith("/sys/fs/cgroup/memory/"):  # v1: peaks reset by writing 0
                    self.peak_fds = cgroups.open_peaks(os.path.join(top, cid))
        pids_dir = f"/sys/fs/cgroup/pids/docker/{cid}"
        if os.path.isdir(pids_dir):
            self.pids_file = os.path.join(pids_dir, "cgroup.procs")
            try:
                with open(self.pids_file) as f:
                    self.server_pid = int(f.read().split()[0])
            except (OSError, IndexError):
                pass
        if self.server_pid is not None:
            base.shield_from_oom(self.server_pid)

    def after_run(self) -> None:
        """The container's cgroup is visible (read-only) in it: its memory peak and fail
        counts go back to 0 after every run (cgroup v1)."""
        cgroups.reset_peaks(self.peak_fds)

    def oom_kills(self) -> int | None:
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
        if self.pids_file is not None:
            try:
                with open(self.pids_file) as f:
                    pids = [int(p) for p in f.read().split()]
            except OSError:
                pids = []
        elif self.container is not None:  # a cgroup layout we do not read: ask docker
            top = self.container.top(ps_args="-o pid")
            pids = [int(row[0]) for row in top["Processes"] or []]
        else:
            pids = []
        return [p for p in pids if p != self.server_pid]

    def kill(self) -> None:
        if self.container is not None:
            try:
                self.container.kill()
            except Exception:  # noqa: BLE001
                pass
        self.stop()

    def _teardown(self) -> None:
        if self.container is not None:
            _remove_container(self.container)
            self.container = None
        for fd in self.peak_fds:
            os.close(fd)
        self.peak_fds = []


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


@functools.lru_cache(maxsize=1)
def docker_client():
    """One docker SDK client per process (it pools its connections to the daemon)."""
    import docker
    return docker.from_env(timeout=60)
