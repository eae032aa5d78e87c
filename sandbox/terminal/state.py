"""The agent's final file-system state, as plain data, for the verifier's fresh box.

When an episode ends, the agent's box is killed (its pid namespace) and what it left on disk is
read from the host, without following a symlink (each directory opened relative to its parent
with O_NOFOLLOW), into a `State`: a list of `Entry`s. The verifier's box, fresh from the task's
image, receives that state and nothing else. The policy (docs/terminal.md, "The agent's state"):

- regular files: their bytes, permission bits and sticky bit (setuid and setgid are cleared),
  owner and group, mtime; hard links become separate copies;
- directories: permission bits and sticky bit (setgid cleared), owner, group;
- symbolic links: recreated as links with the same target text (the host never follows one;
  inside the verifier's box they resolve as in the agent's);
- deletions (docker's overlay whiteouts) and replaced directories (opaque ones): applied;
- extended attributes (any namespace), FIFOs, sockets and device files: not carried (listed
  in `State.dropped`);
- the verifier's own trusted paths (`TRUSTED`: the shells and python3 the verifier runs, the
  interpreter's standard library, the dynamic loader's configuration and shared libraries
  outside site-/dist-packages, and the verifier's /tests, /logs and pytest mount): not carried,
  listed; on bwrap the agent cannot change them in the first place (read-only base).
"""

from __future__ import annotations

import dataclasses
import errno
import fnmatch
import os
import stat

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

# What the verifier runs is the image's, never the agent's (paths without the leading /).
TRUSTED = (
    "bin/sh", "bin/bash", "bin/dash", "usr/bin/sh", "usr/bin/bash", "usr/bin/dash",
    "bin/python*", "usr/bin/python*", "usr/local/bin/python*",
    "usr/lib/python3*", "usr/local/lib/python3*",  # the stdlib (site-/dist-packages excepted)
    "etc/ld.so.preload", "etc/ld.so.conf", "etc/ld.so.conf.d", "etc/ld.so.cache",
    "lib*/ld-linux*", "usr/lib*/ld-linux*", "lib*/*/ld-linux*", "usr/lib*/*/ld-linux*",
    "lib*/*.so*", "lib*/*/*.so*", "usr/lib*/*.so*", "usr/lib*/*/*.so*",
    "usr/local/lib/*.so*", "usr/local/lib/*/*.so*",
    "etc/python3*", "usr/lib/python3/dist-packages/sitecustomize.py",
    "tests", "logs", "opt/ptrain-pytest", "proc", "sys", "dev", ".dockerenv",
    "etc/hosts", "etc/hostname", "etc/resolv.conf",
)
_PACKAGES = ("site-packages", "dist-packages")
# Not the agent's state: the kernel's, the runtime's and the verifier's.
NOT_STATE = frozenset({"/proc", "/dev", "/sys", "/tests", "/logs", "/.dockerenv"})


def trusted(path: str) -> bool:
    """Whether `path` (absolute) is one of the verifier's trusted paths or below one."""
    parts = path.strip("/").split("/")
    if any(p in _PACKAGES for p in parts) and not path.endswith("sitecustomize.py"):
        return False  # packages the task installs are the agent's to change
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        if any(fnmatch.fnmatchcase(prefix, pat) for pat in TRUSTED):
            return True
    return False


@dataclasses.dataclass(frozen=True)
class Entry:
    path: str             # absolute, inside the box
    kind: str             # "file", "dir", "symlink", "delete" or "opaque" (emptied, then a dir)
    mode: int = 0
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    data: bytes = b""     # a file's bytes, a link's target


@dataclasses.dataclass
class State:
    entries: list = dataclasses.field(default_factory=list)
    dropped: list = dataclasses.field(default_factory=list)   # (path, why)
    size: int = 0

    def add(self, entry: Entry, limit: int) -> None:
        self.size += len(entry.data) + 256
        if self.size > limit:
            raise StateTooLarge(f"the agent's files exceed {limit >> 20} MiB")
        self.entries.append(entry)


class StateTooLarge(RuntimeError):
    """The agent left more than the verifier takes (the task's storage bound)."""


def _mode(st) -> int:
    return stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID)


def _is_whiteout(st) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(fd: int) -> bool:
    for name in ("trusted.overlay.opaque", "user.overlay.opaque"):
        try:
            if os.getxattr(fd, name) == b"y":
                return True
        except OSError:
            pass
    return False


def capture(root: str, box: str, *, limit: int, overlay: bool = False,
            skip=frozenset(), uid_of=lambda u: u) -> State:
    """Read the tree at the host directory `root` (an upper dir, or `/proc/self/fd/N` of a
    held box root or work dir), which is `box` in the box, into a State.

    `overlay`: `root` is docker's overlay upper dir (whiteouts are deletions, opaque dirs
    replace). Otherwise the tree is taken whole: `box` (or, for "/", each directory at its
    top) is an "opaque" entry, so the verifier's copy is replaced, what the agent deleted
    included; the walk stays on its file system.
    `skip`: box paths left out (mount points the runtime made); `uid_of`: host uid -> box uid.
    """
    state = State()
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(top)
        if not overlay and box != "/":
            state.add(Entry(box, "opaque", _mode(st), uid_of(st.st_uid), uid_of(st.st_gid),
                            st.st_mtime_ns), limit)
        _walk(top, box, st.st_dev, state, limit, overlay, skip, uid_of,
              whole=not overlay and box == "/")
    finally:
        os.close(top)
    return state


def _walk(dfd, box, dev, state, limit, overlay, skip, uid_of, whole=False) -> None:
    """`whole`: the directories here replace the verifier's ("opaque")."""
    for name in sorted(os.listdir(dfd)):
        path = (box.rstrip("/") + "/" + name)
        if path in skip:
            continue
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed meanwhile (a service task's live processes)
        if trusted(path):
            if not (overlay and stat.S_ISDIR(st.st_mode)):
                state.dropped.append((path, "a trusted path of the verifier"))
                continue
        owner = (uid_of(st.st_uid), uid_of(st.st_gid))
        if overlay and _is_whiteout(st):
            state.add(Entry(path, "delete"), limit)
        elif stat.S_ISDIR(st.st_mode):
            if st.st_dev != dev:
                continue  # a mount point (a bind mount of the runtime's)
            try:
                fd = os.open(name, _DIR, dir_fd=dfd)
            except (FileNotFoundError, NotADirectoryError, OSError):
                continue
            try:
                opaque = whole or (overlay and _is_opaque(fd))
                if not (overlay and trusted(path)):
                    state.add(Entry(path, "opaque" if opaque else "dir", _mode(st), *owner,
                                    st.st_mtime_ns), limit)
                _walk(fd, path, dev, state, limit, overlay, skip, uid_of)
            finally:
                os.close(fd)
        elif stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(name, dir_fd=dfd)
            except OSError:
                continue
            state.add(Entry(path, "symlink", 0o777, *owner, st.st_mtime_ns,
                            os.fsencode(target)), limit)
        elif stat.S_ISREG(st.st_mode):
            if st.st_size + state.size > limit:
                raise StateTooLarge(f"the agent's files exceed {limit >> 20} MiB")
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             dir_fd=dfd)
            except OSError:
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                chunks, left = [], limit - state.size
                while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
                    chunks.append(chunk)
                    left -= len(chunk)
            finally:
                os.close(fd)
            state.add(Entry(path, "file", _mode(st), *owner, st.st_mtime_ns,
                            b"".join(chunks)), limit)
        else:
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket"
                    if stat.S_ISSOCK(st.st_mode) else "a device file")
            state.dropped.append((path, f"{kind} is not carried"))


def _remove(dfd: int, name: str, dev: int) -> None:
    """Remove `name` below `dfd` (a tree too), never crossing into another mount."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dfd)
        return
    if st.st_dev != dev:
        raise OSError(errno.EBUSY, f"{name} is a mount point")
    fd = os.open(name, _DIR, dir_fd=dfd)
    try:
        _empty(fd, dev)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dfd)


def _empty(fd: int, dev: int) -> None:
    for child in os.listdir(fd):
        try:
            _remove(fd, child, dev)
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                raise  # a mount point below stays (the runtime's), and so its parents


def apply(state: State, root: str, *, uid_of=lambda u: u) -> None:
    """Lay `state` into the (fresh, idle) box whose root is the host directory `root`.
    `uid_of`: box uid -> host uid of the files made."""
    rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        dev = os.fstat(rfd).st_dev
        dirs = []
        for e in state.entries:
            *parents, name = [p for p in e.path.split("/") if p]
            pfd = _parent(rfd, parents)
            try:
                if e.kind == "delete":
                    _remove(pfd, name, dev)
                    continue
                st = None
                try:
                    st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                except FileNotFoundError:
                    pass
                if e.kind in ("dir", "opaque"):
                    if st is not None and not stat.S_ISDIR(st.st_mode):
                        os.unlink(name, dir_fd=pfd)
                        st = None
                    if st is None:
                        os.mkdir(name, 0o700, dir_fd=pfd)
                    if e.kind == "opaque" and st is not None:
                        fd = os.open(name, _DIR, dir_fd=pfd)
                        try:
                            _empty(fd, os.fstat(fd).st_dev)
                        finally:
                            os.close(fd)
                    dirs.append(e)  # owner and mode once everything below is in
                    continue
                if st is not None:
                    _remove(pfd, name, dev)
                if e.kind == "symlink":
                    os.symlink(os.fsdecode(e.data), name, dir_fd=pfd)
                    _own(pfd, name, uid_of(e.uid), uid_of(e.gid))
                    continue
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600, dir_fd=pfd)
                try:
                    view = memoryview(e.data)
                    while view:
                        view = view[os.write(fd, view):]
                    _own(fd, None, uid_of(e.uid), uid_of(e.gid))
                    os.fchmod(fd, e.mode)
                    os.utime(fd, ns=(e.mtime_ns, e.mtime_ns))
                finally:
                    os.close(fd)
            finally:
                if pfd != rfd:
                    os.close(pfd)
        for e in reversed(dirs):  # children before parents: a 0555 dir is filled first
            *parents, name = [p for p in e.path.split("/") if p] or ["."]
            pfd = _parent(rfd, parents)
            try:
                fd = os.open(name, _DIR, dir_fd=pfd)
                try:
                    if os.fstat(fd).st_dev == dev:  # never the runtime's mounts
                        _own(fd, None, uid_of(e.uid), uid_of(e.gid))
                        os.fchmod(fd, e.mode)
                finally:
                    os.close(fd)
            finally:
                if pfd != rfd:
                    os.close(pfd)
    finally:
        os.close(rfd)


def _own(fd: int, name: str | None, uid: int, gid: int) -> None:
    """chown, where the owner differs (made under the box's own fs uid, it usually does not)."""
    st = os.stat(name, dir_fd=fd, follow_symlinks=False) if name else os.fstat(fd)
    if (st.st_uid, st.st_gid) != (uid, gid):
        if name:
            os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
        else:
            os.fchown(fd, uid, gid)


def _parent(rfd: int, parents) -> int:
    fd = rfd
    for p in parents:
        try:
            nxt = os.open(p, _DIR, dir_fd=fd)
        except FileNotFoundError:
            os.mkdir(p, 0o755, dir_fd=fd)
            nxt = os.open(p, _DIR, dir_fd=fd)
        except (NotADirectoryError, OSError) as e:
            if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            os.unlink(p, dir_fd=fd)
            os.mkdir(p, 0o755, dir_fd=fd)
            nxt = os.open(p, _DIR, dir_fd=fd)
        if fd != rfd:
            os.close(fd)
        fd = nxt
    return fd


