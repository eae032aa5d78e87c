"""A task container: started once from its image, reset to the image's state between episodes.

Disk (`storage_mb`): docker's size quota (`storage_opt`) where the storage driver has one
(overlay2 on xfs with project quotas), else a tmpfs of that size at the image's work dir,
filled with the image's files there at the start and at every reset: writing past it there
fails with "No space left on device" (elsewhere in the container disk use is then unbounded,
and a tmpfs's pages count towards the container's memory limit).

The container runs `sleep infinity` under docker's init (which reaps orphans), with the task's
limits. `reset()` brings it back to what a fresh `docker run` of the image gives: in place
where this host allows it (root on the docker host, overlay2 storage: reset.py, a few ms, no
docker API call), else, and whenever an in-place reset meets anything it does not expect, by
removing the container and starting a new one. Files go in and out from the host where it
can do so safely (hostfs.py: no symlink is ever followed), else through the docker API
(`put_archive`, `get_archive`), which resolves paths inside the container.
"""

import atexit
import dataclasses
import io
import logging
import os
import signal
import socket
import tarfile
import threading
import time
import uuid
import weakref

from sandbox.terminal import state as state_
from sandbox.terminal.exec_output import CappedBuffer, ExecResult
from sandbox.terminal.hostfs import ConfinedRoot
from sandbox.terminal.reset import InPlaceReset, ResetRefused, kill_tree

log = logging.getLogger("sandbox.terminal")

PYTEST_MOUNT = "/opt/ptrain-pytest"
_KEEP_ALIVE = ["sleep", "infinity"]
# Dropped on top of docker's defaults: raw sockets, device nodes, audit writes, file caps.
_CAP_DROP = ["NET_RAW", "MKNOD", "AUDIT_WRITE", "SETFCAP"]
# Without the host's view: from inside, everything but init, its keep-alive sleep (its first
# child) and this shell, twice (for what forked meanwhile).
_KILL_ALL_INSIDE = (
    "keep=$(tr ' ' '\\n' < /proc/1/task/1/children | sort -n | head -n 1); "
    "for _ in 1 2; do for d in /proc/[0-9]*; do p=${d#/proc/}; "
    'case " 1 $$ $keep " in *" $p "*) ;; *) kill -9 "$p" 2>/dev/null;; esac; done; done')
_live: "weakref.WeakSet[Container]" = weakref.WeakSet()


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a task's container may use (from task.toml's [environment]); `network` is the
    task's wish and the operator's permission together."""
    cpus: float = 1.0
    memory_mb: int = 2048
    pids: int = 4096
    network: bool = False
    storage_mb: int | None = None  # None: unbounded


def docker_client():
    """The sandbox's shared docker SDK client where it offers one, else our own."""
    try:
        from sandbox.backends import docker_client as shared
    except ImportError:  # pragma: no cover (the sandbox restructure may move it)
        shared = None
    if shared is not None:
        return shared()
    import docker
    global _own_client
    if _own_client is None:
        _own_client = docker.from_env(timeout=120)
    return _own_client


_own_client = None


def remove_orphans(client=None) -> int:
    """Remove the task containers that a process of this machine started and that outlived
    it (a crash, a SIGKILL); returns how many."""
    client = client or docker_client()
    n = 0
    # sparse: no inspect per container, which fails (404) for one another process removes
    # between the listing and the inspect
    for c in client.containers.list(all=True, filters={"label": "ptrain-term"}, sparse=True):
        labels = c.attrs.get("Labels") or {}
        if labels.get("ptrain-term-host") != socket.gethostname():
            continue
        try:
            os.kill(int(labels["ptrain-term"]), 0)
            continue  # its owner lives
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):
            continue
        try:
            c.remove(force=True)
            n += 1
        except Exception:  # noqa: BLE001 (removed meanwhile)
            pass
    return n


class ContainerGone(RuntimeError):
    """The container stopped (the agent killed its init's child, or it ran out of memory)."""


class Container:
    """A started task container. `reset="auto"` resets in place where this host allows it."""

    def __init__(self, image: str, limits: Limits = Limits(), *, env=(), name: str = "task",
                 pytest_dir: str | None = None, reset: str = "auto", client=None,
                 network_of: str | None = None):
        """`network_of`: share that container's network namespace (the verifier of a task
        whose tests use the agent's services; nothing else of it is shared)."""
        if reset not in ("auto", "inplace", "recreate"):
            raise ValueError(f"reset must be 'auto', 'inplace' or 'recreate', got {reset!r}")
        self.image, self.limits, self.env = image, limits, dict(env)
        self._name, self._pytest_dir, self._want = name, pytest_dir, reset
        self._network_of = network_of
        self._client = client or docker_client()
        self._lock = threading.Lock()
        self.container = None
        self._killed = False  # by end_episode or kill(): the next reset recreates, as meant
        self.resets = {"inplace": 0, "recreate": 0}
        self.storage = None  # how storage_mb is enforced: "quota", "workdir" or None
        self._workdir_tar = None  # with "workdir": the image's files there (a tar)
        self._start()
        _live.add(self)

    # --- life cycle ---------------------------------------------------------------------------

    def _start(self) -> None:
        slug = "".join(c if c.isalnum() else "-" for c in self._name.lower())[:40]
        volumes = {}
        if self._pytest_dir:
            volumes[self._pytest_dir] = {"bind": PYTEST_MOUNT, "mode": "ro"}
        import docker
        network = "host" if self.limits.network else "none"
        if self._network_of is not None:
            network = f"container:{self._network_of}"
        run = dict(
            detach=True, init=True, network_mode=network,
            hostname=None if network != "none" else "task",
            security_opt=["no-new-privileges:true"],
            mem_limit=f"{self.limits.memory_mb}m", memswap_limit=f"{self.limits.memory_mb}m",
            nano_cpus=int(min(self.limits.cpus, os.cpu_count() or 1) * 1e9),
            pids_limit=self.limits.pids, cap_drop=_CAP_DROP, environment=self.env,
            volumes=volumes, labels=_labels())
        storage, self.storage = self._storage()
        try:
            self.container = self._client.containers.run(
                self.image, _KEEP_ALIVE, name=f"ptrain-term-{slug}-{uuid.uuid4().hex[:8]}",
                **run, **storage)
        except docker.errors.APIError as e:
            if self.storage != "quota" or "storage-opt" not in str(e):
                raise
            _no_quota.add(self._client.info().get("ID", ""))  # xfs without pquota, say
            storage, self.storage = self._storage()
            self.container = self._client.containers.run(
                self.image, _KEEP_ALIVE, name=f"ptrain-term-{slug}-{uuid.uuid4().hex[:8]}",
                **run, **storage)
        try:
            self.container.reload()
            attrs = self.container.attrs
            self.workdir = attrs["Config"].get("WorkingDir") or "/"
            self.path = next((e.split("=", 1)[1] for e in attrs["Config"].get("Env") or ()
                              if e.startswith("PATH=")), None)  # the image's PATH
            self.user = attrs["Config"].get("User") or ""
            self._inplace = None
            if self._want != "recreate":
                reason = self._host_access(attrs)
                if reason is None:
                    self._inplace = InPlaceReset(attrs)
                elif self._want == "inplace":
                    raise RuntimeError(f"in-place reset is not possible here: {reason}")
                else:
                    log.info("terminal containers are recreated between episodes: %s", reason)
            self._fill_workdir(clear=False)
        except BaseException:
            self._remove()
            raise

    def _storage(self) -> tuple[dict, str | None]:
        """(docker run arguments, how) for limits.storage_mb (see the module docstring)."""
        mb = self.limits.storage_mb
        if not mb:
            return {}, None
        info = self._client.info()
        backing = dict(info.get("DriverStatus") or []).get("Backing Filesystem", "")
        if info.get("Driver") == "overlay2" and backing == "xfs" and \
                info.get("ID", "") not in _no_quota:
            return {"storage_opt": {"size": f"{mb}M"}}, "quota"
        workdir = self._client.images.get(self.image).attrs["Config"].get("WorkingDir") or "/"
        if workdir == "/":
            log.warning("terminal: storage_mb=%d is not enforced for %s: docker's storage "
                        "driver has no quota here and the image has no WORKDIR to bound",
                        mb, self.image)
            return {}, None
        return {"tmpfs": {workdir: f"size={mb}m,exec,mode=755"}}, "workdir"

    def _fill_workdir(self, *, clear: bool) -> None:
        """With a tmpfs work dir: (emptied, then) the image's files there. Docker's archive
        API writes beneath a tmpfs mount, not into it: the image's tar goes to the root of
        the container's own layer and is unpacked from inside, or, where the host reaches
        the container's files, it is unpacked from the host (no docker API call)."""
        if self.storage != "workdir":
            return
        if self._workdir_tar is None:
            self._workdir_tar = _image_dir_tar(self._client, self.image, self.workdir)
        if self._inplace is not None:
            try:
                return ConfinedRoot(self._inplace.root).refill(self.workdir,
                                                               self._workdir_tar)
            except OSError as e:  # a link in the way, a hard link in the image: from inside
                log.info("terminal: host-side refill of %s refused (%s); using docker exec",
                         self.workdir, e)
        staged = "/.ptrain-workdir.tar"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            data = self._workdir_tar
            info = tarfile.TarInfo(staged.lstrip("/"))
            info.size, info.mode = len(data), 0o600
            tar.addfile(info, io.BytesIO(data))
        if not self.container.put_archive("/", buf.getvalue()):
            raise ContainerGone(f"cannot copy {self.workdir}'s files into {self._name}")
        parent = os.path.dirname(self.workdir.rstrip("/")) or "/"
        empty = f"find '{self.workdir}' -mindepth 1 -delete && " if clear else ""
        r = self.exec(["sh", "-c", f"{empty}tar -xpf {staged} -C '{parent}'; s=$?; "
                                   f"rm -f {staged}; exit $s"], timeout_s=60, user="root")
        if r.exit_code != 0:
            raise ContainerGone(f"cannot fill {self.workdir} of {self._name}'s container: "
                                f"{r.text[-300:]}")

    @staticmethod
    def _host_access(attrs) -> str | None:
        if os.geteuid() != 0:
            return "not root on the docker host"
        driver = attrs.get("GraphDriver", {})
        if driver.get("Name") != "overlay2":
            return f"storage driver {driver.get('Name')!r} is not overlay2"
        upper = driver.get("Data", {}).get("UpperDir")
        if not upper or not os.path.isdir(upper):
            return "the container's overlay layer is not on this machine"
        if not os.path.isdir(f"/proc/{attrs['State']['Pid']}/root/"):
            return "the container's processes are not visible here"
        return None

    @property
    def id(self) -> str:
        return self.container.id

    @property
    def shares_network(self) -> bool:
        """Whether it runs in another container's network (a service task's verifier)."""
        return self._network_of is not None

    @property
    def reset_mode(self) -> str:
        return "inplace" if self._inplace is not None else "recreate"

    def reset(self) -> str:
        """Back to the image's state; returns how ("inplace" or "recreate")."""
        with self._lock:
            if self._inplace is not None:
                try:
                    if self._inplace.pid_alive():
                        self._inplace.reset()
                        self._fill_workdir(clear=True)
                        self.resets["inplace"] += 1
                        return "inplace"
                    why = "the container stopped"
                except (ResetRefused, OSError, ContainerGone) as e:
                    why = str(e)
                if not self._killed:
                    log.warning("terminal container %s: recreated (%s)", self._name, why)
            self._killed = False
            old, self.container = self.container, None
            if old is not None:  # removed off the caller's path: its processes are dead
                t = threading.Thread(target=_remove_quietly, args=(old,), daemon=True)
                t.start()
                with _removing_lock:
                    _removing[:] = [r for r in _removing if r.is_alive()] + [t]
            self._start()
            self.resets["recreate"] += 1
            return "recreate"

    def end_episode(self, *, kill: bool, limit: int) -> state_.State:
        """The agent's files as data: the container's writable layer (deletions as such) and
        a tmpfs work dir, read from the host after every process of the container is killed
        (`kill`: SIGKILL to its init, which takes its pid namespace with it) unless the
        task's tests use the agent's running services."""
        with self._lock:
            ip = self._inplace
            if ip is None or not ip.pid_alive():
                raise ContainerGone(f"the container of {self._name} is gone or not reachable "
                                    f"from the host (the verifier needs root on the docker "
                                    f"host with overlay2 storage)")
            root = os.open(ip.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            workdir = None
            try:
                if self.storage == "workdir":
                    workdir = _open_below(root, self.workdir)
                if kill:
                    self._kill_init(ip)
                skip = set(state_.NOT_STATE) | {PYTEST_MOUNT}
                skip |= {"/" + p for p in ip.docker_own
                         if not os.path.isdir(os.path.join(ip.upper, p))}
                if workdir is not None:
                    skip.add(self.workdir.rstrip("/"))
                state = state_.capture(ip.upper, "/", limit=limit, overlay=True,
                                       skip=frozenset(skip))
                if workdir is not None:
                    more = state_.capture(f"/proc/self/fd/{workdir}", self.workdir,
                                          limit=limit - state.size)
                    state.entries += more.entries
                    state.dropped += more.dropped
                    state.size += more.size
                return state
            finally:
                os.close(root)
                if workdir is not None:
                    os.close(workdir)

    def _kill_init(self, ip: InPlaceReset) -> None:
        """SIGKILL to the container's init: the kernel kills every process of its pid
        namespace (ptraced, stopped, re-parented ones too); wait until the cgroup is empty."""
        self._killed = True
        try:
            os.kill(ip.init_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 30
        while ip.pid_alive() or (ip.procs_file and _has_pids(ip.procs_file)):
            if time.monotonic() > deadline:
                raise ContainerGone(f"the processes of {self._name} did not die")
            time.sleep(0.002)

    def lay_state(self, state: state_.State) -> None:
        """The agent's state into this (fresh, idle) container, from the host."""
        ip = self._inplace
        if ip is None or not ip.pid_alive():
            raise ContainerGone(f"the verifier's container of {self._name} is not reachable")
        state_.apply(state, ip.root)

    def kill(self) -> None:
        """Every process of the container (its init too): the next reset recreates it."""
        with self._lock:
            if self._inplace is not None and self._inplace.pid_alive():
                self._kill_init(self._inplace)
            elif self.container is not None:
                try:
                    self.container.kill()
                except Exception:  # noqa: BLE001 (already stopped)
                    pass

    def kill_processes(self) -> None:
        """Every process but init and its sleep (the verifier's cut, and before reading logs)."""
        if self._inplace is not None and self._inplace.pid_alive():
            try:
                self._inplace.kill_all()
                return
            except ResetRefused:
                pass
        self.exec(["sh", "-c", _KILL_ALL_INSIDE], timeout_s=30, user="root")

    def _remove(self) -> None:
        if self.container is not None:
            try:
                self.container.remove(force=True)
            except Exception:  # noqa: BLE001 (already gone)
                pass
        self.container = None

    def close(self) -> None:
        with self._lock:
            self._remove()
        _live.discard(self)

    # --- exec and files -----------------------------------------------------------------------

    def exec(self, argv, *, timeout_s: float, user: str | None = None, env=None,
             workdir: str | None = None, max_output_bytes: int = 1 << 20) -> ExecResult:
        """Run `argv` in the container (not in a shell session), output capped, cut at
        `timeout_s` (its process tree is killed then)."""
        import docker
        api = self._client.api
        t0 = time.monotonic()
        try:
            ex = api.exec_create(self.id, argv, stdout=True, stderr=True, tty=False,
                                 user=user or "", environment=dict(env or {}), workdir=workdir)
            sock = api.exec_start(ex["Id"], socket=True)
        except docker.errors.APIError as e:
            raise ContainerGone(f"the task's container cannot run commands: {e}") from None
        raw = getattr(sock, "_sock", sock)
        out = CappedBuffer(max_output_bytes)
        timed_out = _read_frames(raw, out, t0 + timeout_s)
        try:
            sock.close()
        except OSError:
            pass
        exit_code = None
        if timed_out:
            self._kill_exec(api.exec_inspect(ex["Id"]).get("Pid"))
        else:
            for _ in range(200):
                info = api.exec_inspect(ex["Id"])
                if not info.get("Running"):
                    exit_code = info.get("ExitCode")
                    break
                time.sleep(0.005)
        return ExecResult(out.value(), exit_code, timed_out, out.dropped > 0,
                          time.monotonic() - t0)

    def open_terminal(self, argv, *, user=None, env=None, workdir=None):
        """(socket, its wrapper to close): `argv` on a new pseudo-terminal in the container
        (the agent's shell, shell.py), through `docker exec`."""
        api = self._client.api
        ex = api.exec_create(self.id, argv, stdin=True, tty=True, user=user or "",
                             environment=dict(env or {}), workdir=workdir)
        wrapper = api.exec_start(ex["Id"], socket=True, tty=True)
        return getattr(wrapper, "_sock", wrapper), wrapper

    def fresh_dirs(self, paths, mode: int = 0o755) -> None:
        """Remove `paths` (whatever is there: a tree, a file, a symlink) and make each an
        empty directory with `mode`: where the verifier's tests and logs go."""
        if self._inplace is not None:
            try:
                for path in paths:
                    ConfinedRoot(self._inplace.root).fresh_dir(path, mode)
                return
            except OSError as e:
                log.info("terminal: host-side clean-up refused (%s); using docker exec", e)
        quoted = " ".join(f"'{p}'" for p in paths)
        r = self.exec(["sh", "-c", f"rm -rf {quoted} && mkdir -p {quoted} && "
                                   f"chmod {mode:o} {quoted}"], timeout_s=60, user="root")
        if r.exit_code != 0:
            raise ContainerGone(f"cannot prepare {quoted}: {r.text[-300:]}")

    def _kill_exec(self, host_pid: int | None) -> None:
        if self._inplace is not None and host_pid:
            kill_tree(host_pid)
        else:
            self.kill_processes()

    def put_files(self, files) -> None:
        """Copy files in: `files` is [(host path or bytes, absolute container path)]; modes
        (the exec bit) are kept, missing parents are made (0755), owner is root."""
        if self._inplace is not None:
            try:
                return ConfinedRoot(self._inplace.root).write(files)
            except OSError as e:  # a symlink in the way, most likely: docker's way, below
                log.info("terminal: host-side copy refused (%s); using the docker API", e)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for source, dest in files:
                parts = dest.strip("/").split("/")
                if isinstance(source, bytes):
                    info = tarfile.TarInfo("/".join(parts))
                    info.size, info.mode = len(source), 0o644
                    tar.addfile(info, io.BytesIO(source))
                    continue
                tar_add(tar, source, "/".join(parts))
        if not self.container.put_archive("/", buf.getvalue()):
            raise RuntimeError(f"could not copy files into {self._name}'s container")

    def read_files(self, path: str, max_bytes: int = 4 << 20) -> dict[str, bytes]:
        """Regular files at or below `path` in the container ({} if there is nothing), by
        their path relative to `path`'s parent."""
        import docker
        if self._inplace is not None:
            try:
                return ConfinedRoot(self._inplace.root).read_tree(path, max_bytes)
            except OSError as e:
                log.info("terminal: host-side read refused (%s); using the docker API", e)
        try:
            chunks, _ = self.container.get_archive(path)
            data = b"".join(chunks)
        except docker.errors.NotFound:
            return {}
        out, total = {}, 0
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar:
                if member.isreg() and total + member.size <= max_bytes:
                    out[member.name] = tar.extractfile(member).read()
                    total += member.size
        return out


_removing: list[threading.Thread] = []
_removing_lock = threading.Lock()


def wait_removed() -> None:
    """Until the containers being removed in the background are gone."""
    with _removing_lock:
        pending = list(_removing)
    for t in pending:
        t.join()


def _remove_quietly(container) -> None:
    try:
        container.remove(force=True)
    except Exception:  # noqa: BLE001 (already gone)
        pass


def _has_pids(procs_file: str) -> bool:
    try:
        with open(procs_file) as f:
            return bool(f.read().split())
    except OSError:
        return False  # the cgroup is gone with the container


def _open_below(root_fd: int, path: str) -> int:
    """An fd of directory `path` below `root_fd`, no symlink followed."""
    fd = os.dup(root_fd)
    for part in [p for p in path.split("/") if p]:
        try:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _labels() -> dict:
    return {"ptrain-term": str(os.getpid()), "ptrain-term-host": socket.gethostname()}


_no_quota: set[str] = set()  # docker daemons (their ID) that refused storage_opt size
_dir_tars: dict[tuple[str, str], bytes] = {}
_dir_tars_lock = threading.Lock()


def _image_dir_tar(client, image: str, path: str) -> bytes:
    """A tar of `path` as `image` has it (from a created, never started container), once per
    image and path."""
    key = (client.images.get(image).id, path)
    with _dir_tars_lock:
        if key not in _dir_tars:
            c = client.containers.create(image, _KEEP_ALIVE, labels=_labels())
            try:
                chunks, _ = c.get_archive(path)
                _dir_tars[key] = b"".join(chunks)
            finally:
                c.remove(force=True)
        return _dir_tars[key]


def tar_add(tar: tarfile.TarFile, host: str, arcname: str) -> None:
    """Host file `host` into `tar` as `arcname`, mode kept, owned by root."""
    info = tar.gettarinfo(host, arcname=arcname)
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    if info.isreg():
        with open(host, "rb") as f:
            tar.addfile(info, f)
    else:
        tar.addfile(info)


def _read_frames(sock, out: CappedBuffer, deadline: float) -> bool:
    """Docker's multiplexed exec stream (8-byte headers) into `out`; True if `deadline` came
    first."""
    pending = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        sock.settimeout(min(left, 1.0))
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            continue
        except OSError:
            return False
        if not data:
            return False
        pending += data
        while len(pending) >= 8:
            size = int.from_bytes(pending[4:8], "big")
            if len(pending) < 8 + size:
                break
            out.add(pending[8:8 + size])
            pending = pending[8 + size:]


@atexit.register
def _close_all() -> None:
    for c in list(_live):
        c.close()
