"""A running container's files, from the host, without following a symlink.

The host (root) reaches a container's file system through `/proc/<init pid>/root`; the
agent's processes may still run there, and a symlink it leaves (or swaps in meanwhile) must not
lead a host-side write or read out of the container. So each path is opened one component at
a time, relative to its parent's file descriptor, with O_NOFOLLOW; whatever is in the way
raises OSError, and the caller goes through the docker API instead.
"""

import contextlib
import ctypes
import errno
import functools
import io
import os
import shutil
import stat
import tarfile


@contextlib.contextmanager
def fs_identity(ident: tuple[int, int] | None):
    """File-system uid and gid (uid, gid) of this thread for the block (None: unchanged).
    A bwrap box's tmpfs belongs to its user namespace: an inode made there must have an
    owner mapped in it (the box's host uid), or the kernel refuses it (EOVERFLOW)."""
    if ident is None:
        yield
        return
    libc = _libc()
    old_gid, old_uid = libc.setfsgid(ident[1]), libc.setfsuid(ident[0])
    try:
        yield
    finally:
        libc.setfsuid(old_uid)
        libc.setfsgid(old_gid)


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _as_owner(method):
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with fs_identity(self.as_user):
            return method(self, *args, **kwargs)
    return wrapped


class ConfinedRoot:
    """Paths below a running container's root, from the host: each component is opened
    relative to its parent's fd with O_NOFOLLOW, so a symlink (even one that a live process
    swaps in meanwhile) is never followed; what is in the way raises OSError."""

    _DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

    def __init__(self, root: str, as_user: tuple[int, int] | None = None):
        """`as_user`: (host uid, gid) that makes (and owns) what is written; None: root."""
        self.root, self.as_user = root, as_user

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

    @_as_owner
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
        items = []  # the host's files are read as ourselves, then written as the owner
        for source, dest in files:
            if isinstance(source, bytes):
                items.append((source, 0o644, dest))
                continue
            st = os.lstat(source)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{source}: only regular files are copied this way")
            with open(source, "rb") as f:
                items.append((f.read(), stat.S_IMODE(st.st_mode), dest))
        self._write(items)

    @_as_owner
    def _write(self, items) -> None:
        for data, mode, dest in items:
            *parents, name = self._parts(dest)
            fd = self._open_dirs(parents, create=True)
            try:
                out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                              | os.O_CLOEXEC, 0o600, dir_fd=fd)
            finally:
                os.close(fd)
            try:
                if self.as_user is None:
                    os.fchown(out, 0, 0)
                os.fchmod(out, mode)
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view):]
            finally:
                os.close(out)

    def refill(self, path: str, tar_bytes: bytes) -> None:
        """Directory `path` emptied, then the members of `tar_bytes` (as get_archive names
        them: below `path`'s own name) made in it: directories, regular files and symlinks,
        with their owner, mode and times (a link is made, never followed: a member below one
        raises); any other kind of member raises OSError."""
        top = self._parts(path)
        fd = self._open_dirs(top, create=False)
        try:
            for name in os.listdir(fd):
                if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    shutil.rmtree(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)
        dirs = []  # (parts, mtime): set last, once their contents are made
        with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
            for m in tar:
                parts = [p for p in m.name.split("/") if p not in ("", ".")]
                if not parts or ".." in parts:
                    raise OSError(f"{m.name!r}: not a plain relative path")
                rel = parts[1:]  # below the directory's own name
                if not rel or m.isdir():
                    if rel:
                        pfd = self._open_dirs(top + rel[:-1], create=False)
                        try:
                            os.mkdir(rel[-1], 0o700, dir_fd=pfd)
                        finally:
                            os.close(pfd)
                    dfd = self._open_dirs(top + rel, create=False)
                    try:
                        os.fchown(dfd, m.uid, m.gid)
                        os.fchmod(dfd, m.mode)
                    finally:
                        os.close(dfd)
                    dirs.append((rel, m.mtime))
                    continue
                pfd = self._open_dirs(top + rel[:-1], create=False)
                try:
                    if m.isreg():
                        out = os.open(rel[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL
                                      | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
                        try:
                            view = memoryview(tar.extractfile(m).read())
                            while view:
                                view = view[os.write(out, view):]
                            os.fchown(out, m.uid, m.gid)
                            os.fchmod(out, m.mode)
                            os.utime(out, (m.mtime, m.mtime))
                        finally:
                            os.close(out)
                    elif m.issym():
                        os.symlink(m.linkname, rel[-1], dir_fd=pfd)
                        os.chown(rel[-1], m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
                        os.utime(rel[-1], (m.mtime, m.mtime), dir_fd=pfd,
                                 follow_symlinks=False)
                    else:
                        raise OSError(f"{m.name!r}: a member of type {m.type!r}")
                finally:
                    os.close(pfd)
        for rel, mtime in reversed(dirs):
            dfd = self._open_dirs(top + rel, create=False)
            try:
                os.utime(dfd, (mtime, mtime))
            finally:
                os.close(dfd)

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
