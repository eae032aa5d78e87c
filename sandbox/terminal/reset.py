"""The in-place reset of a task container: back to its image's state without docker.

What a fresh `docker run` of the image would give, from the host (root, overlay2 storage):
every process but init and its keep-alive sleep is killed (the container's pids cgroup); each
entry of the container's writable overlay layer is undone through `/proc/<init>/root` (added:
removed; changed or deleted: copied back from the image's layers, merged as overlayfs merges
them); /dev, /dev/shm, /dev/mqueue, the files docker bind-mounts and System V IPC are put back
as they were at start. Every path is walked with lstat, parents before children, after the
processes are dead: a symlink is removed, never followed. Anything unexpected raises
`ResetRefused`, and the container is recreated instead.
"""

import os
import shutil
import signal
import stat
import time

_MOUNTED_FILES = ("HostsPath", "HostnamePath", "ResolvConfPath")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def kill_tree(pid: int) -> None:
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


class ResetRefused(RuntimeError):
    """An in-place reset met something it does not handle: the container is recreated."""


class InPlaceReset:
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
                raise ResetRefused("the container's init started nothing")
            time.sleep(0.001)
        self.keep = {self.init_pid, *_children(self.init_pid)}
        # What docker itself puts in the writable layer (mount points), as it is now.
        self.clean = {}
        self._scan_clean("")
        # Docker's own entries (mount points: /opt/ptrain-pytest, /usr/sbin/docker-init, their
        # parents where the image lacks them) are never removed, only looked into.
        self.docker_own = set(self.clean)
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
            raise ResetRefused("no cgroup to find the container's processes")
        try:
            with open(self.procs_file) as f:
                return [int(p) for p in f.read().split()]
        except OSError as e:
            raise ResetRefused(f"cannot read {self.procs_file}: {e}") from None

    def kill_all(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            others = [p for p in self._pids() if p not in self.keep]
            if not others and not (set(_children(self.init_pid)) - self.keep):
                return
            if time.monotonic() > deadline:
                raise ResetRefused(f"processes {others} did not die")
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
            raise ResetRefused("init's keep-alive child is gone")
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
            if self.clean.get(sub) == (st.st_ino, st.st_ctime_ns) or sub in self.docker_own:
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
                raise ResetRefused(f"/{rel}: a parent is not a directory")
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
            raise ResetRefused(f"/{rel}: cannot restore a file of mode {mode:o}")
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
            raise ResetRefused("/dev is not a directory")
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
                raise ResetRefused(f"/dev/{name} cannot be made again")
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
