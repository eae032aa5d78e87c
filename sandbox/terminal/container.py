"""A task container: started once from its image, reset to the image's state between episodes.

The container runs `sleep infinity` under docker's init (which reaps orphans). Between
episodes `reset()` brings it back to what a fresh `docker run` of the image would give:

- "inplace" (root on the docker host, overlay2 storage, the default where possible): every
  process but init and its sleep is killed (their cgroup, read on the host); each entry of the
  container's writable overlay layer is undone through the container's root (`/proc/PID/root`):
  an added file is removed, a changed or deleted one is copied back from the image's layers; the
  mounts docker adds (/dev, /dev/shm, /dev/mqueue, /etc/hosts, /etc/hostname, /etc/resolv.conf)
  and System V IPC are put back as they were at start. No docker API call: a few ms for what an
  episode usually touches (bench/terminal_bench.py measures it against a fresh `docker run`).
- "recreate" (anywhere else, and whenever an in-place reset meets anything it does not expect:
  the container died, a parent of an entry is a symlink, a process does not die): the
  container is removed and started anew from the image.

Every path below the container's root is walked with lstat, parents before children, after the
processes are dead: a symlink the agent left (to / or anything on the host) is removed, never
followed. Files are copied in and out through the docker API (`put_archive`/`get_archive`),
which resolves paths inside the container.
"""

import atexit
import dataclasses
import errno
import io
import logging
import os
import shutil
import signal
import stat
import tarfile
import threading
import time
import uuid
import weakref

log = logging.getLogger("sandbox.terminal")

PYTEST_MOUNT = "/opt/ptrain-pytest"
_KEEP_ALIVE = ["sleep", "infinity"]
# Dropped on top of docker's defaults: raw sockets, device nodes, audit writes, file caps.
_CAP_DROP = ["NET_RAW", "MKNOD", "AUDIT_WRITE", "SETFCAP"]
_MOUNTED_FILES = ("HostsPath", "HostnamePath", "ResolvConfPath")
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


@dataclasses.dataclass(frozen=True)
class ExecResult:
    output: bytes          # stdout and stderr, interleaved, capped (head and tail kept)
    exit_code: int | None  # None when it was cut
    timed_out: bool
    truncated: bool
    duration_s: float

    @property
    def text(self) -> str:
        return self.output.decode("utf-8", "replace")


class CappedBuffer:
    """Keeps the first `head` bytes and the last `limit - head` bytes of a stream."""

    def __init__(self, limit: int, head: int | None = None):
        self.limit, self.head_limit = limit, min(limit, head if head is not None else limit // 4)
        self.head, self.tail = bytearray(), bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        over = len(self.tail) - (self.limit - self.head_limit)
        if over > 0:
            del self.tail[:over]
            self.dropped += over

    def value(self) -> bytes:
        if not self.dropped:
            return bytes(self.head + self.tail)
        return bytes(self.head) + f"\n[... {self.dropped} bytes left out ...]\n".encode() \
            + bytes(self.tail)


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


class ContainerGone(RuntimeError):
    """The container stopped (the agent killed its init's child, or it ran out of memory)."""


class Container:
    """A started task container. `reset="auto"` resets in place where this host allows it."""

    def __init__(self, image: str, limits: Limits = Limits(), *, env=(), name: str = "task",
                 pytest_dir: str | None = None, reset: str = "auto", client=None):
        if reset not in ("auto", "inplace", "recreate"):
            raise ValueError(f"reset must be 'auto', 'inplace' or 'recreate', got {reset!r}")
        self.image, self.limits, self.env = image, limits, dict(env)
        self._name, self._pytest_dir, self._want = name, pytest_dir, reset
        self._client = client or docker_client()
        self._lock = threading.Lock()
        self.container = None
        self.resets = {"inplace": 0, "recreate": 0}
        self._start()
        _live.add(self)

    # --- life cycle ---------------------------------------------------------------------------

    def _start(self) -> None:
        slug = "".join(c if c.isalnum() else "-" for c in self._name.lower())[:40]
        volumes = {}
        if self._pytest_dir:
            volumes[self._pytest_dir] = {"bind": PYTEST_MOUNT, "mode": "ro"}
        self.container = self._client.containers.run(
            self.image, _KEEP_ALIVE, detach=True, init=True,
            name=f"ptrain-term-{slug}-{uuid.uuid4().hex[:8]}",
            network_mode="host" if self.limits.network else "none",
            hostname=None if self.limits.network else "task",
            mem_limit=f"{self.limits.memory_mb}m", memswap_limit=f"{self.limits.memory_mb}m",
            nano_cpus=int(min(self.limits.cpus, os.cpu_count() or 1) * 1e9),
            pids_limit=self.limits.pids, cap_drop=_CAP_DROP, environment=self.env,
            volumes=volumes, labels={"ptrain-term": str(os.getpid())})
        try:
            self.container.reload()
            attrs = self.container.attrs
            self.workdir = attrs["Config"].get("WorkingDir") or "/"
            self.user = attrs["Config"].get("User") or ""
            self._inplace = None
            if self._want != "recreate":
                reason = self._host_access(attrs)
                if reason is None:
                    self._inplace = _InPlace(attrs)
                elif self._want == "inplace":
                    raise RuntimeError(f"in-place reset is not possible here: {reason}")
                else:
                    log.info("terminal containers are recreated between episodes: %s", reason)
        except BaseException:
            self._remove()
            raise

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
    def reset_mode(self) -> str:
        return "inplace" if self._inplace is not None else "recreate"

    def reset(self) -> str:
        """Back to the image's state; returns how ("inplace" or "recreate")."""
        with self._lock:
            if self._inplace is not None:
                try:
                    if self._inplace.pid_alive():
                        self._inplace.reset()
                        self.resets["inplace"] += 1
                        return "inplace"
                    why = "the container stopped"
                except (_Unexpected, OSError) as e:
                    why = str(e)
                log.warning("terminal container %s: recreated (%s)", self._name, why)
            self._remove()
            self._start()
            self.resets["recreate"] += 1
            return "recreate"

    def kill_processes(self) -> None:
        """Every process but init and its sleep (the verifier's cut, and before reading logs)."""
        if self._inplace is not None and self._inplace.pid_alive():
            try:
                self._inplace.kill_all()
                return
            except _Unexpected:
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

    def fresh_dirs(self, paths, mode: int = 0o755) -> None:
        """Remove `paths` (whatever is there: a tree, a file, a symlink) and make each an
        empty directory with `mode`: where the verifier's tests and logs go."""
        if self._inplace is not None:
            try:
                for path in paths:
                    _Confined(self._inplace.root).fresh_dir(path, mode)
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
            _kill_tree(host_pid)
        else:
            self.kill_processes()

    def put_files(self, files) -> None:
        """Copy files in: `files` is [(host path or bytes, absolute container path)]; modes
        (the exec bit) are kept, missing parents are made (0755), owner is root."""
        if self._inplace is not None:
            try:
                return _Confined(self._inplace.root).write(files)
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
                return _Confined(self._inplace.root).read_tree(path, max_bytes)
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


class _Confined:
    """Paths below a running container's root, from the host: each component is opened
    relative to its parent's fd with O_NOFOLLOW, so a symlink (even one that a live process
    swaps in meanwhile) is never followed; what is in the way raises OSError."""

    _DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

    def __init__(self, root: str):
        self.root = root

    def _parts(self, path: str) -> list[str]:
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if not parts or ".." in parts:
            raise OSError(f"not a plain absolute path: {path!r}")
        return parts

    def _open_dirs(self, parts, create: bool, replace: bool = False) -> int:
        """An fd of the directory `parts` below the root; `create` makes what is missing
        (0755), `replace` also puts a directory where a symlink or a file was."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in parts:
                if create:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                try:
                    nxt = os.open(part, self._DIR, dir_fd=fd)
                except OSError as e:
                    if not replace or e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    os.unlink(part, dir_fd=fd)
                    os.mkdir(part, 0o755, dir_fd=fd)
                    nxt = os.open(part, self._DIR, dir_fd=fd)
                os.close(fd)
                fd = nxt
            return fd
        except BaseException:
            os.close(fd)
            raise

    def fresh_dir(self, path: str, mode: int) -> None:
        """An empty directory at `path` (real directories all the way), whatever was there."""
        *parents, name = self._parts(path)
        fd = self._open_dirs(parents, create=True, replace=True)
        try:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(name, dir_fd=fd)  # fd-based: it follows no symlink either
                else:
                    os.unlink(name, dir_fd=fd)
            os.mkdir(name, 0o700, dir_fd=fd)
            leaf = os.open(name, self._DIR, dir_fd=fd)
            try:
                os.fchmod(leaf, mode)
            finally:
                os.close(leaf)
        finally:
            os.close(fd)

    def write(self, files) -> None:
        for source, dest in files:
            *parents, name = self._parts(dest)
            if isinstance(source, bytes):
                data, mode = source, 0o644
            else:
                st = os.lstat(source)
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(f"{source}: only regular files are copied this way")
                with open(source, "rb") as f:
                    data, mode = f.read(), stat.S_IMODE(st.st_mode)
            fd = self._open_dirs(parents, create=True)
            try:
                out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                              | os.O_CLOEXEC, 0o600, dir_fd=fd)
            finally:
                os.close(fd)
            try:
                os.fchown(out, 0, 0)
                os.fchmod(out, mode)
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view):]
            finally:
                os.close(out)

    def read_tree(self, path: str, max_bytes: int) -> dict[str, bytes]:
        """Regular files below directory `path` (or the file `path`), named as
        get_archive names them: relative to `path`'s parent."""
        parts = self._parts(path)
        try:
            fd = self._open_dirs(parts[:-1], create=False)
        except FileNotFoundError:
            return {}
        out: dict[str, bytes] = {}
        try:
            self._read_into(fd, parts[-1], parts[-1], out, [max_bytes])
        finally:
            os.close(fd)
        return out

    def _read_into(self, dir_fd: int, name: str, rel: str, out: dict, left: list):
        """`left[0]`: the bytes still allowed, shared by the whole walk."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(name, self._DIR, dir_fd=dir_fd)
            try:
                for entry in sorted(os.listdir(fd)):
                    self._read_into(fd, entry, f"{rel}/{entry}", out, left)
            finally:
                os.close(fd)
        elif stat.S_ISREG(st.st_mode) and st.st_size <= left[0]:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=dir_fd)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return
                chunks = []
                while left[0] > 0:
                    chunk = os.read(fd, min(left[0], 1 << 20))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    left[0] -= len(chunk)
                out[rel] = b"".join(chunks)
            finally:
                os.close(fd)


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


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything below it (host pids), until none is left."""
    for _ in range(50):
        tree, todo = [], [pid]
        while todo:
            p = todo.pop()
            tree.append(p)
            todo.extend(_children(p))
        alive = False
        for p in tree:
            try:
                os.kill(p, signal.SIGKILL)
                alive = True
            except ProcessLookupError:
                pass
        if not alive:
            return
        time.sleep(0.002)


class _Unexpected(RuntimeError):
    """An in-place reset met something it does not handle: the container is recreated."""


class _InPlace:
    """The host-side view of one container, and the in-place reset."""

    def __init__(self, attrs):
        self.init_pid = attrs["State"]["Pid"]
        data = attrs["GraphDriver"]["Data"]
        self.upper = data["UpperDir"]
        self.lowers = [p for p in (data.get("LowerDir") or "").split(":") if p]
        self.root = f"/proc/{self.init_pid}/root"
        self.procs_file = self._procs_file()
        deadline = time.monotonic() + 10
        while not _children(self.init_pid):  # init starts its sleep
            if time.monotonic() > deadline:
                raise _Unexpected("the container's init started nothing")
            time.sleep(0.001)
        self.keep = {self.init_pid, *_children(self.init_pid)}
        # What docker itself puts in the writable layer (mount points), as it is now.
        self.clean = {}
        self._scan_clean("")
        self.dev = self._dev_entries()
        self.mounted = {}
        for key in _MOUNTED_FILES:
            path = attrs.get(key)
            if path and os.path.isfile(path):
                with open(path, "rb") as f:
                    self.mounted[path] = f.read()
        self.nsenter = shutil.which("nsenter") and shutil.which("ipcrm")

    def pid_alive(self) -> bool:
        try:
            with open(f"/proc/{self.init_pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False

    def _procs_file(self) -> str | None:
        try:
            with open(f"/proc/{self.init_pid}/cgroup") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        for line in lines:  # cgroup v1's pids controller, else the v2 hierarchy
            _, controllers, path = line.split(":", 2)
            if "pids" in controllers.split(","):
                candidate = f"/sys/fs/cgroup/pids{path}/cgroup.procs"
                if os.path.isfile(candidate):
                    return candidate
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                    candidate = f"{base}{path}/cgroup.procs"
                    if os.path.isfile(candidate):
                        return candidate
        return None

    def _pids(self) -> list[int]:
        if self.procs_file is None:
            raise _Unexpected("no cgroup to find the container's processes")
        try:
            with open(self.procs_file) as f:
                return [int(p) for p in f.read().split()]
        except OSError as e:
            raise _Unexpected(f"cannot read {self.procs_file}: {e}") from None

    def kill_all(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            others = [p for p in self._pids() if p not in self.keep]
            if not others and not (set(_children(self.init_pid)) - self.keep):
                return
            if time.monotonic() > deadline:
                raise _Unexpected(f"processes {others} did not die")
            for p in others:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.001)

    # --- the reset ----------------------------------------------------------------------------

    def reset(self) -> None:
        self.kill_all()
        if set(_children(self.init_pid)) != self.keep - {self.init_pid}:
            raise _Unexpected("init's keep-alive child is gone")
        self._undo("")
        self._reset_dev()
        for path, data in self.mounted.items():
            with open(path, "rb") as f:
                same = f.read() == data
            if not same:
                with open(path, "wb") as f:
                    f.write(data)
        if self.nsenter:  # posix_spawn (vfork): a fork of a big process costs 10x more
            pid = os.posix_spawnp("nsenter", ["nsenter", "-t", str(self.init_pid), "-i",
                                              "ipcrm", "-a"], {"PATH": os.environ.get(
                                                  "PATH", "/usr/bin:/bin")})
            os.waitpid(pid, 0)

    def _key(self, rel: str):
        st = os.lstat(os.path.join(self.upper, rel))
        return st.st_ino, st.st_ctime_ns

    def _scan_clean(self, rel: str) -> None:
        """Remember the writable layer's entries at `rel` and below as clean."""
        path = os.path.join(self.upper, rel) if rel else self.upper
        for entry in os.scandir(path):
            sub = os.path.join(rel, entry.name) if rel else entry.name
            st = entry.stat(follow_symlinks=False)
            self.clean[sub] = (st.st_ino, st.st_ctime_ns)
            if stat.S_ISDIR(st.st_mode):
                self._scan_clean(sub)

    def _undo(self, rel: str) -> None:
        """Undo what the writable layer holds at `rel`'s children, parents first."""
        path = os.path.join(self.upper, rel) if rel else self.upper
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            sub = os.path.join(rel, entry.name) if rel else entry.name
            st = entry.stat(follow_symlinks=False)
            is_dir = stat.S_ISDIR(st.st_mode)
            if self.clean.get(sub) == (st.st_ino, st.st_ctime_ns):
                if is_dir:
                    self._undo(sub)
                continue
            low = self._lower(sub)
            if _is_whiteout(st):  # deleted from the image
                if low is not None:
                    self._replace(sub, low)
                continue
            if low is None:  # added
                self._remove(sub)
                continue
            low_st = os.lstat(low)
            if is_dir and stat.S_ISDIR(low_st.st_mode) and not _is_opaque(entry.path):
                self._fix_meta(sub, low_st)
                self._undo(sub)
            else:  # changed, or a directory emptied and made again (opaque)
                self._replace(sub, low)

    def _target(self, rel: str) -> str:
        """`rel` below the container's root, refusing a parent that is not a real directory."""
        path = self.root
        parts = rel.split("/")
        for part in parts[:-1]:
            path = os.path.join(path, part)
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise _Unexpected(f"/{rel}: a parent is not a directory")
        return os.path.join(path, parts[-1])

    def _remove(self, rel: str) -> None:
        path = self._target(rel)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)

    def _replace(self, rel: str, low: str) -> None:
        self._remove(rel)
        self._copy(low, rel)

    def _copy(self, src: str, rel: str) -> None:
        """The image's `src` (a lower-layer path) to `rel` in the container, a tree for a
        directory (its entries merged over the layers), owner, mode, times and xattrs kept."""
        st = os.lstat(src)
        dst = self._target(rel)
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            os.mkdir(dst, 0o700)
            for name in self._lower_names(rel):
                child = self._lower(f"{rel}/{name}")
                if child is not None:
                    self._copy(child, f"{rel}/{name}")
        elif stat.S_ISREG(mode):
            with open(src, "rb") as fin, open(dst, "xb") as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
        elif stat.S_ISLNK(mode):
            os.symlink(os.readlink(src), dst)
        elif stat.S_ISFIFO(mode):
            os.mkfifo(dst)
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            os.mknod(dst, mode, st.st_rdev)
        else:
            raise _Unexpected(f"/{rel}: cannot restore a file of mode {mode:o}")
        self._fix_meta(rel, st, force=True)
        if not stat.S_ISLNK(mode):
            for name in os.listxattr(src, follow_symlinks=False):
                if not name.startswith("trusted.overlay."):
                    os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False),
                                follow_symlinks=False)
        self.clean[rel] = self._key(rel)

    def _fix_meta(self, rel: str, want: os.stat_result, force: bool = False) -> None:
        path = self._target(rel)
        have = os.lstat(path)
        if force or (have.st_uid, have.st_gid) != (want.st_uid, want.st_gid):
            os.chown(path, want.st_uid, want.st_gid, follow_symlinks=False)
        if stat.S_ISLNK(want.st_mode):
            return
        if force or stat.S_IMODE(have.st_mode) != stat.S_IMODE(want.st_mode):
            os.chmod(path, stat.S_IMODE(want.st_mode))
        if force:
            os.utime(path, ns=(want.st_atime_ns, want.st_mtime_ns), follow_symlinks=False)

    # --- the image's layers, merged as overlayfs merges them ---------------------------------

    def _lower(self, rel: str) -> str | None:
        """The host path of the image's `rel` (top-most layer that has it), or None."""
        parts = rel.split("/")
        for layer in self.lowers:
            path, hidden_below = layer, False
            for part in parts[:-1]:
                path = os.path.join(path, part)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    break
                if _is_whiteout(st) or not stat.S_ISDIR(st.st_mode):
                    return None
                hidden_below = hidden_below or _is_opaque(path)
            else:
                path = os.path.join(path, parts[-1])
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    pass
                else:
                    return None if _is_whiteout(st) else path
            if hidden_below:
                return None
        return None

    def _lower_names(self, rel: str) -> list[str]:
        """The names in the image's directory `rel`, merged over the layers."""
        names, hidden = set(), set()
        parts = rel.split("/")
        for layer in self.lowers:
            path, opaque = layer, False
            for part in parts:
                path = os.path.join(path, part)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    path = None
                    break
                if _is_whiteout(st) or not stat.S_ISDIR(st.st_mode):
                    return sorted(names)  # hides `rel` in every layer below
                opaque = opaque or _is_opaque(path)
            if path is not None:
                for entry in os.scandir(path):
                    if entry.name in hidden or entry.name in names:
                        continue
                    if _is_whiteout(entry.stat(follow_symlinks=False)):
                        hidden.add(entry.name)
                    else:
                        names.add(entry.name)
            if opaque:
                break
        return sorted(names)

    # --- docker's mounts ----------------------------------------------------------------------

    def _dev_entries(self) -> dict[str, tuple]:
        out = {}
        for entry in os.scandir(os.path.join(self.root, "dev")):
            st = entry.stat(follow_symlinks=False)
            link = os.readlink(entry.path) if stat.S_ISLNK(st.st_mode) else None
            out[entry.name] = (st.st_mode, st.st_rdev, link)
        return out

    def _reset_dev(self) -> None:
        dev = os.path.join(self.root, "dev")
        if not stat.S_ISDIR(os.lstat(dev).st_mode):
            raise _Unexpected("/dev is not a directory")
        now = self._dev_entries()
        for name in set(now) | set(self.dev):
            have, want = now.get(name), self.dev.get(name)
            if want == have:
                continue
            path = os.path.join(dev, name)
            if have is not None and want is not None and stat.S_ISDIR(have[0]) \
                    and stat.S_ISDIR(want[0]):
                os.chmod(path, stat.S_IMODE(want[0]))  # pts, shm, mqueue: mounts, wiped below
                continue
            if have is not None:
                if stat.S_ISDIR(have[0]):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            if want is None:
                continue
            mode, rdev, link = want
            if link is not None:
                os.symlink(link, path)
            elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                os.mknod(path, mode, rdev)
                os.chmod(path, stat.S_IMODE(mode))  # mknod's mode passed through our umask
            else:
                raise _Unexpected(f"/dev/{name} cannot be made again")
        for sub in ("shm", "mqueue"):
            path = os.path.join(dev, sub)
            if os.path.isdir(path) and not os.path.islink(path):
                for entry in os.scandir(path):
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.unlink(entry.path)


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError:
        return False


@atexit.register
def _close_all() -> None:
    for c in list(_live):
        c.close()
