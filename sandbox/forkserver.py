"""The fork server: a pre-started interpreter that runs inside a backend's isolation.

This file must stay one stdlib-only module: its source is sent inline as the `-c` program of
the sandbox's interpreter (nothing of ours is on the sandbox's file system), which is why it
is the one module allowed past the 600-line house rule.

It is started once per sandbox (by `sandbox/backends.py`, as `python3 -I -X utf8 -c <this
source> <config json>`), imports common modules, then serves runs one at a time over a
socket. Each run gets a fresh child, forked after the previous run was cleaned up and parked
(own session, run cgroup joined) until its request comes; it then sets its rlimits and either
runs the Python code in-process (no interpreter start: the fast path) or execs the command.
When the main process ends or the timeout passes, every other process of the run is killed
(the server is PID 1 of its PID namespace under bwrap and docker, so `kill(-1)` reaches them
all; under the process backend it kills the run cgroup or, without one, its descendants as a
child subreaper), the scratch directories are wiped, and the result goes back.

What a run sends and prints never enters this process's heap, where the next run's child
(a fork of it) could find it: the request payload goes from the socket to the child, output
from the pipes to memfds and the files and memfds to the socket, all through one reusable
buffer that is zeroed after every run (or by sendfile). Only sizes, statuses and file names
pass through Python objects here.

Standard library only, Python >= 3.8 syntax: it runs on whatever python3 the sandbox image
has. Wire format, both ways: a frame (4-byte big-endian length + UTF-8 JSON header), then
raw bytes whose sizes the header gives (`payload` to the server; `blobs` back).
"""

import atexit
import builtins
import gc
import json
import linecache
import os
import resource
import select
import signal
import socket
import stat
import struct
import sys
import time
import traceback
import types

_MAX_FRAME = 1 << 30
_READ_CHUNK = 1 << 16


def frame(obj):
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    return struct.pack(">I", len(data)) + data


def send_frame(sock, obj):
    sock.sendall(frame(obj))


def recv_frame(sock):
    """The next frame, or None at a clean end of stream."""
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    (size,) = struct.unpack(">I", head)
    if size > _MAX_FRAME:
        raise ValueError("frame of %d bytes is too large" % size)
    body = _recv_exact(sock, size)
    if body is None:
        raise EOFError("stream ended inside a frame")
    return json.loads(body.decode("utf-8"))


def _recv_exact(sock, n):
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            if got == 0:
                return None
            raise EOFError("stream ended inside a frame")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# The one buffer run data passes through in this process (zeroed after every run).
_BUF = bytearray(1 << 18)
_VIEW = memoryview(_BUF)
_ZEROS = bytes(len(_BUF))
_dirty = [0]  # how much of the buffer holds data since it was last zeroed


def _used(n):
    _dirty[0] = max(_dirty[0], n)
    return n


def _zero_buffer():
    _VIEW[:_dirty[0]] = _ZEROS[:_dirty[0]]
    _dirty[0] = 0


def _send_file(sock_fd, fd, size):
    """Send `size` bytes of `fd` from its start (kernel to kernel); zeros if it is short."""
    offset = 0
    while offset < size:
        sent = os.sendfile(sock_fd, fd, offset, size - offset)
        if not sent:
            _write_all(sock_fd, _ZEROS[:min(size - offset, len(_ZEROS))])
            sent = min(size - offset, len(_ZEROS))
        offset += sent


def _send_reply(sock_fd, head, blobs):
    """The reply header and its blobs (fd, size): in one write through the buffer when they
    fit in it (one wake-up for the host), else by sendfile."""
    total = sum(size for _, size in blobs)
    if total > len(_BUF):
        _write_all(sock_fd, head)
        for fd, size in blobs:
            _send_file(sock_fd, fd, size)
        return
    at = 0
    for fd, size in blobs:
        done = 0
        while done < size:
            got = os.preadv(fd, [_VIEW[at + done:at + size]], done)
            if not got:  # shorter than listed: the rest stays zero
                break
            done += got
        at += size
    rest = [memoryview(head), _VIEW[:_used(total)]]
    while rest:
        sent = os.writev(sock_fd, rest)
        while rest and sent >= len(rest[0]):
            sent -= len(rest[0])
            rest.pop(0)
        if rest:
            rest[0] = rest[0][sent:]


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# ---------------------------------------------------------------------------------------------
# Process control
# ---------------------------------------------------------------------------------------------

def _prctl(option, value):
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except Exception:  # noqa: BLE001 (no ctypes in a minimal image: carry on without)
        return False


_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36


def _exit_status(status):
    """(exit_code, signal) from a wait status."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return None, None


def _reap_nohang(statuses):
    """Reap every exited child without blocking; record their statuses."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        statuses[pid] = status


class Killer:
    """Kills every process of the current run except the server itself."""

    def __init__(self, cfg):
        self.pid1 = os.getpid() == 1
        self.cgroup_procs = cfg.get("cgroup_procs")
        if not self.pid1:
            _prctl(_PR_SET_CHILD_SUBREAPER, 1)

    def kill_all(self, statuses, limit_s=10.0):
        """Kill and reap everything; returns False if processes were left after `limit_s`."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if not self._kill_round():
                _reap_nohang(statuses)
                if not self._remaining():
                    return True
            _reap_nohang(statuses)
            time.sleep(0.0005)
        return False

    def _kill_round(self):
        """Signal everything once; True if something was signalled."""
        if self.pid1:
            try:
                os.kill(-1, signal.SIGKILL)
                return True
            except ProcessLookupError:
                return False
        pids = self._remaining()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return bool(pids)

    def _remaining(self):
        me = os.getpid()
        if self.pid1:
            try:
                os.kill(-1, 0)
                return [-1]
            except ProcessLookupError:
                return []
        if self.cgroup_procs:
            with open(self.cgroup_procs) as f:
                return [p for p in map(int, f.read().split()) if p != me]
        return _children_of(me)


def _children_of(ppid):
    """Live (non-zombie) children of `ppid`, from /proc."""
    try:
        with open("/proc/self/task/%d/children" % ppid) as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        pass  # a kernel without CONFIG_PROC_CHILDREN: scan every process
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == ppid and fields[0] != b"Z":
            out.append(int(name))
    return out


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------

def _inside(root, rel):
    """`root/rel`, refusing any path that resolves outside `root` (e.g. through a symlink a
    previous run of the session left there)."""
    path = os.path.join(root, rel)
    real_root = os.path.realpath(root)
    if not os.path.realpath(path).startswith(real_root + os.sep):
        raise ValueError("path %r leaves the work dir" % rel)
    return path


def _pump(src, dst, n):
    """Copy `n` bytes from fd `src` to fd `dst` through the buffer (never a Python object)."""
    while n:
        got = _used(os.readv(src, [_VIEW[:min(n, len(_BUF))]]))
        if not got:
            raise EOFError("the request ended early")
        _write_all(dst, _VIEW[:got])
        n -= got


def lay_in(fd, root, req):
    """Read the raw part of a request from `fd`: its stdin into a memfd (returned, or
    /dev/null), a session's work dir (`state`), then its `files`, each straight from the
    socket to its destination through the buffer, which is zeroed afterwards: no byte of it
    becomes a Python object of the run's process (the judge forks from it, see
    judge/harness.py)."""
    try:
        if req["stdin"] is None:
            stdin = os.open(os.devnull, os.O_RDONLY)
        else:
            stdin = _memfd("stdin")
            _pump(fd, stdin, req["stdin"])
            os.lseek(stdin, 0, os.SEEK_SET)
        if req.get("state"):
            lay_state(fd, root, req["state"])
        for rel, size in req["files"]:
            path = _inside(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            out = open_regular(path)
            try:
                _pump(fd, out, size)
            finally:
                os.close(out)
        return stdin
    finally:
        _zero_buffer()


def open_regular(path):
    """`path` opened to be written over, refusing anything but a regular file: a FIFO, socket
    or device a run left there is never opened blocking (O_NONBLOCK: a FIFO without a reader
    fails at once, one with a reader is refused after the open) nor written to."""
    try:
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno in (6, 40):  # ENXIO (a FIFO or socket), ELOOP (a symlink)
            raise ValueError("%r is not a regular file (a fifo, socket or symlink a run "
                             "left); remove it first" % (os.path.basename(path),)) from None
        raise
    st = os.fstat(out)
    if not stat.S_ISREG(st.st_mode):
        os.close(out)
        raise ValueError("%r is not a regular file (a fifo or device a run left); remove it "
                         "first" % (os.path.basename(path),))
    os.ftruncate(out, 0)
    os.set_blocking(out, True)
    return out


def lay_state(fd, root, entries):
    """Recreate a work dir from `collect_state`'s entries (parents before children) into the
    empty `root`, file contents read from `fd`: directories, files and fifos with their modes
    and mtimes, then symlinks (last: no entry is laid through one)."""
    dirs, links = [], []
    for entry in entries:
        rel, kind, mode, mtime = entry[:4]
        path = os.path.join(root, rel)
        if rel == ".":
            if mode != stat.S_IMODE(os.stat(root).st_mode):
                dirs.insert(0, (root, mode, None))
        elif kind == "d":
            os.mkdir(path, 0o700)
            dirs.append((path, mode, mtime))
        elif kind == "f":
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                _pump(fd, out, entry[4])
                os.fchmod(out, mode)
                os.utime(out, ns=(mtime, mtime))
            finally:
                os.close(out)
        elif kind == "p":
            os.mkfifo(path, 0o600)
            os.chmod(path, mode)
            os.utime(path, ns=(mtime, mtime))
        elif kind == "l":
            links.append((path, entry[4], mtime))
        else:
            raise ValueError("unknown work dir entry %r" % (kind,))
    for path, target, mtime in links:
        os.symlink(target, path)
        os.utime(path, ns=(mtime, mtime), follow_symlinks=False)
    for path, mode, mtime in reversed(dirs):  # deepest first: a read-only dir is filled
        os.chmod(path, mode)
        if mtime is not None:
            os.utime(path, ns=(mtime, mtime))


def collect_state(root, max_bytes, max_entries):
    """The work dir as entries [path, kind, mode, mtime_ns(, size | symlink target)] in an
    order `lay_state` can replay (kind: d, f, l, p; sockets and device nodes are left out;
    the first, ".", is the work dir itself, for its mode)
    and its regular files [(path, size)] in entry order; or (None, None, why) when its files
    and names pass `max_bytes` or its entries `max_entries`, or it cannot be read whole (the
    modes changed to read it are put back then). Names and symlink targets are the only
    part of it that become Python objects here: they count towards `max_bytes`, and the
    walk stops as soon as a cap is passed."""
    entries, files, total, changed = [], [], 0, []
    skipped = _SKIPPED
    del skipped[:]
    stack = [""]
    try:
        mode = stat.S_IMODE(os.stat(root).st_mode)
        entries.append([".", "d", mode, 0])  # its mode only (docker's /work is root's)
        if mode & 0o700 != 0o700:
            os.chmod(root, mode | 0o700)
            changed.append((root, mode))
        while stack:
            top = stack.pop()
            with os.scandir(os.path.join(root, top) if top else root) as found:
                for item in found:
                    rel = os.path.join(top, item.name) if top else item.name
                    st = item.stat(follow_symlinks=False)
                    mode, mtime = stat.S_IMODE(st.st_mode), st.st_mtime_ns
                    need, total = 0, total + len(rel) + 64
                    if stat.S_ISDIR(st.st_mode):
                        entries.append([rel, "d", mode, mtime])
                        stack.append(rel)
                        need = 0o700
                    elif stat.S_ISREG(st.st_mode):
                        entries.append([rel, "f", mode, mtime, st.st_size])
                        files.append((rel, st.st_size))
                        total += st.st_size
                        need = 0o400
                    elif stat.S_ISLNK(st.st_mode):
                        if total + st.st_size <= max_bytes:  # the target's length
                            entries.append([rel, "l", 0, mtime, os.readlink(item.path)])
                        total += st.st_size
                    elif stat.S_ISFIFO(st.st_mode):
                        entries.append([rel, "p", mode, mtime])
                    elif len(skipped) < 100:  # a socket or device node: cannot cross
                        skipped.append(rel)
                    if total > max_bytes or len(entries) > max_entries:
                        return _put_back(changed, "its files and names pass max_state_bytes"
                                         "=%d or its entries max_state_files=%d"
                                         % (max_bytes, max_entries))
                    if mode & need != need:
                        os.chmod(item.path, mode | need)
                        changed.append((item.path, mode))
    except OSError as e:
        return _put_back(changed, "it cannot be read whole (%s)" % (e,))
    return entries, files, None


_SKIPPED = []  # the sockets and devices the last collect_state left out (the first 100)


def _put_back(changed, why):
    for path, mode in reversed(changed):
        try:
            os.chmod(path, mode)
        except OSError:
            pass
    return None, None, why


def list_files(root, max_bytes):
    """[(relative path, size)] of the regular files under `root` (no symlinks followed; in
    each directory its files by name, then its subdirectories), up to `max_bytes` in total
    (with the other entries' names); [[relative path, kind]] of every other entry
    (`_kind`: directory, symlink, fifo, socket, device), so that a verifier sees all that is
    there; whether some were left out (past `max_bytes`, or unreadable); and the modes
    opened up to read them, [(path, mode)], to put back (`_put_back`) once they are
    stashed."""
    files, others, total, truncated, changed = [], [], 0, False, []
    stack = [""]
    while stack:
        top = stack.pop()
        try:
            with os.scandir(os.path.join(root, top) if top else root) as found:
                items = sorted(found, key=lambda item: item.name)
            subdirs = []
            for item in items:
                st = item.stat(follow_symlinks=False)
                rel = os.path.join(top, item.name) if top else item.name
                if not stat.S_ISREG(st.st_mode):
                    total += len(rel) + 16
                    if total > max_bytes:
                        truncated = True
                        continue
                    others.append([rel, _kind(st.st_mode)])
                if stat.S_ISDIR(st.st_mode):
                    need = 0o500
                    subdirs.append(rel)
                elif stat.S_ISREG(st.st_mode) and total + st.st_size <= max_bytes:
                    need = 0o400
                    total += st.st_size
                    files.append((os.path.join(top, item.name) if top else item.name,
                                  st.st_size))
                else:
                    truncated = truncated or stat.S_ISREG(st.st_mode)
                    continue
                mode = stat.S_IMODE(st.st_mode)
                if mode & need != need:
                    os.chmod(item.path, mode | need)
                    changed.append((item.path, mode))
            stack.extend(reversed(subdirs))
        except OSError:
            truncated = True  # a directory it cannot read (deeper than PATH_MAX, ...)
    return files, others, truncated, changed


def _kind(mode):
    """The kind of a work dir entry that is not a regular file, as a verifier names it."""
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "device"


def stash_files(root, files):
    """Copy `files` (from list_files) one after the other into a memfd, kernel to kernel,
    so that they can be sent after the work dir is wiped. Returns (fd, total size, whether
    every file was read in full: one that could not be is sent as zeros)."""
    store, total, whole = _memfd("files"), 0, True
    for rel, size in files:
        try:
            fd = os.open(os.path.join(root, rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since it was listed
                os.close(fd)
                raise OSError("not a regular file")
        except OSError:
            fd, whole = os.open(os.devnull, os.O_RDONLY), False
        try:
            copied = 0
            while copied < size:
                n = os.sendfile(store, fd, copied, size - copied)
                if not n:  # shorter than it was listed: pad, the host expects `size`
                    _write_all(store, _ZEROS[:min(size - copied, len(_ZEROS))])
                    n, whole = min(size - copied, len(_ZEROS)), False
                copied += n
        finally:
            os.close(fd)
        total += size
    return store, total, whole


def wipe(path):
    """Remove everything inside `path`, also what a run made hard to remove (dirs without
    permissions, trees deeper than PATH_MAX or the recursion limit); True if `path` is empty
    afterwards. Walks by directory fds (one open at a time, names relative to it) and a stack
    of names, so neither depth nor path length limits it; never follows a symlink."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError:
        return False
    stack = [[None, _clear_dir(fd)]]  # [name in the parent, subdirectories left to remove]
    while stack:
        name, subdirs = stack[-1]
        if subdirs:
            sub = subdirs.pop()
            try:
                os.chmod(sub, 0o700, dir_fd=fd)
            except OSError:
                pass
            try:
                child = os.open(sub, flags, dir_fd=fd)
            except OSError:
                continue
            os.close(fd)
            fd = child
            stack.append([sub, _clear_dir(fd)])
            continue
        stack.pop()
        if name is None:
            break
        parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = parent
        try:
            os.rmdir(name, dir_fd=fd)
        except OSError:
            pass
    try:
        with os.scandir(fd) as left:
            return next(left, None) is None
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_tree(path):
    """Remove `path` and all under it (see `wipe`); True if it is gone."""
    wipe(path)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _clear_dir(fd):
    """Unlink everything in the directory `fd` but its subdirectories; their names."""
    subdirs = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.name)
                    else:
                        os.unlink(entry.name, dir_fd=fd)
                except OSError:
                    pass
    except OSError:
        pass
    return subdirs


def _root_state(path):
    """(mode, (atime_ns, mtime_ns)) of a scratch dir as the sandbox started it."""
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), (st.st_atime_ns, st.st_mtime_ns)


def _clear_root(path, times):
    """Remove the extended attributes a run can set (user.*, ACLs) from the scratch dir
    `path` and put its times back; False if one stays. (security.* and trusted.* need
    capabilities a run lacks; an SELinux label is the host's.) Where the dir is not the
    sandbox's own (docker's /dev/shm is root's), a run could set neither, and its times stay
    as the wipe left them; its ctime always does (the kernel sets it)."""
    for name in _run_xattrs(path):
        try:
            os.removexattr(path, name, follow_symlinks=False)
        except OSError:
            pass
    try:
        os.utime(path, ns=times, follow_symlinks=False)
    except OSError:
        pass
    return not _run_xattrs(path)


def _run_xattrs(path):
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return []  # no xattrs on this file system
    return [n for n in names if n.startswith(("user.", "system.posix_acl_"))]


def remove_posix_mqueues(path):
    """Remove the POSIX message queues a run left (`path`: the IPC namespace's mqueue fs)."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        try:
            os.unlink(os.path.join(path, name))
        except OSError:
            pass


def remove_sysv_ipc():
    """Remove SysV shared memory, semaphores and message queues a run left in this IPC
    namespace (they would outlive its processes)."""
    libc = None
    for name in ("shm", "sem", "msg"):
        try:
            with open("/proc/sysvipc/" + name) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            ident = int(line.split()[1])
            if libc is None:
                import ctypes
                libc = ctypes.CDLL(None, use_errno=True)
            if name == "sem":
                libc.semctl(ident, 0, 0)  # IPC_RMID = 0
            else:
                getattr(libc, name + "ctl")(ident, 0, None)


# ---------------------------------------------------------------------------------------------
# The child
# ---------------------------------------------------------------------------------------------

def _child(cfg, out_w, err_w, ctl):
    """In the forked child: isolate and join the run cgroup, then wait (parked) for the
    request, lay out its files, limit, and run it. Never returns."""
    try:
        # First: all the run starts is limited. The run cgroup's cgroup.procs files are open
        # in the server, by fds the host opened (the run never sees a writable cgroup file:
        # one would let it move other processes, the server too, into or out of a cgroup).
        for join_fd in cfg.get("join_cgroup_fds", ()):
            os.write(join_fd, b"0")
        os.setsid()
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(ctl, 3)
        os.closerange(4, os.sysconf("SC_OPEN_MAX"))
        if cfg.get("oom_adj"):  # the OOM killer picks the run, not the server
            try:
                _set_oom_score_adj()
            except OSError as e:
                _write_all(3, ("sandbox: cannot set the run's oom_score_adj: %s" % (e,))
                           .encode())
                os._exit(126)
        env = {"PATH": cfg["path"], "HOME": cfg["workdir"], "TMPDIR": cfg["tmpdir"],
               "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        os.environ.clear()
        os.environ.update(env)
        req = _read_request(3)
        try:
            stdin_fd = lay_in(3, cfg["workdir"], req)
        except (OSError, ValueError) as e:
            _write_all(3, ("cannot lay out the files: %s" % (e,)).encode())
            os._exit(126)
        if req.get("put"):  # a session's files, nothing to run
            os._exit(0)
        os.close(3)
        os.dup2(stdin_fd, 0)
        os.close(stdin_fd)
        _set_rlimits(cfg, req)
        os.chdir(cfg["workdir"])
        if req["env"]:
            os.environ.update(req["env"])
            env.update(req["env"])
        if req["code"] is not None and req["language"] == "python":
            _run_python(req["code"], cfg["workdir"])
        if req["code"] is not None:
            argv = ["bash", "-c", req["code"]]
        else:
            argv = req["command"]
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as e:
            os.write(2, ("sandbox: cannot execute %r: %s\n" % (argv[0], e.strerror)).encode())
            os._exit(127 if isinstance(e, FileNotFoundError) else 126)
    except BaseException as e:  # noqa: BLE001 (a child must never return into the server)
        try:
            os.write(2, ("sandbox: child set-up failed: %r\n" % (e,)).encode())
        finally:
            os._exit(126)


def _set_oom_score_adj():
    """oom_score_adj 1000 for this run child, checked after the write. The child inherits the
    server's non-dumpable flag, which makes its /proc files root's (EACCES): dumpable again
    first (its memory is the run's own)."""
    _prctl(_PR_SET_DUMPABLE, 1)
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    with open("/proc/self/oom_score_adj") as f:
        got = f.read().strip()
    if got != "1000":
        raise OSError("oom_score_adj is %s after writing 1000" % got)


def _read_request(fd):
    """The request's JSON part (code, names, sizes; never stdin or file contents, which
    follow it raw and are read by `lay_in`)."""
    _read_exact(fd, 8)  # the size of the whole payload
    (size,) = struct.unpack(">Q", _read_exact(fd, 8))
    return json.loads(_read_exact(fd, size).decode("utf-8"))


def _read_exact(fd, n):
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the server went away")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _set_rlimits(cfg, req):
    timeout = req["timeout_s"]
    limits = [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_FSIZE, req["max_file_mb"] << 20),
        (resource.RLIMIT_NOFILE, req["max_open_files"]),
    ]
    cpu = int(timeout) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if cfg.get("nproc"):
        limits.append((resource.RLIMIT_NPROC, cfg["nproc"]))
    if cfg.get("address_space_mb"):
        limits.append((resource.RLIMIT_AS, cfg["address_space_mb"] << 20))
    for which, value in limits:
        resource.setrlimit(which, (value, value))


def _run_python(code, workdir):
    """Run `code` as the __main__ of this (forked) interpreter, the way `python main.py`
    would, then exit with the status Python would."""
    filename = "main.py"
    sys.argv = [filename]
    sys.path.insert(0, workdir)
    sys.dont_write_bytecode = True  # no __pycache__ in the work dir (the server runs with -I)
    main = types.ModuleType("__main__")
    main.__file__ = filename
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    status = 0
    try:
        compiled = compile(code, filename, "exec")
    except SyntaxError:
        exc_type, exc, _ = sys.exc_info()
        _report(exc_type, exc.with_traceback(None), None)
        compiled, status = None, 1
    if compiled is not None:
        try:
            exec(compiled, main.__dict__)
        except SystemExit as e:
            status = _system_exit_status(e)
        except BaseException:  # noqa: BLE001 (the program's exception, reported as Python does)
            exc_type, exc, tb = sys.exc_info()
            _report(exc_type, exc.with_traceback(tb.tb_next), tb.tb_next)  # skip our frame
            status = 1
            if exc_type is KeyboardInterrupt:
                status = -signal.SIGINT
    os._exit(_shutdown(status))


def _report(exc_type, exc, tb):
    """Print an uncaught exception as the interpreter would. The default hook is replaced by
    the traceback module, which reads the program's source from linecache (it is not on
    disk); a hook the program installed is honoured."""
    if sys.excepthook is sys.__excepthook__:
        traceback.print_exception(exc_type, exc, tb)
    else:
        sys.excepthook(exc_type, exc, tb)


def _system_exit_status(e):
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:  # noqa: BLE001
        pass
    return 1


def _shutdown(status):
    """What the interpreter does at exit: join non-daemon threads, atexit, flush."""
    threading = sys.modules.get("threading")
    try:
        if threading is not None:
            threading._shutdown()
    except BaseException:  # noqa: BLE001
        pass
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            status = status or 120
    if status < 0:  # died of a signal, like CPython after KeyboardInterrupt
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status


# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------

class Capture:
    """Drains a pipe into a memfd through the buffer, keeping the first `limit` bytes and
    counting the rest."""

    def __init__(self, fd, limit):
        self.fd, self.limit = fd, limit
        self.kept, self.truncated = 0, False
        self.store = _memfd("out")

    def read(self):
        """Read what is there: "eof" at end of stream, "empty" if nothing is there yet."""
        try:
            got = _used(os.readv(self.fd, [_VIEW]))
        except BlockingIOError:
            return "empty"
        if not got:
            return "eof"
        keep = min(got, self.limit - self.kept)
        self.truncated = self.truncated or keep < got
        if keep:
            _write_all(self.store, _VIEW[:keep])
            self.kept += keep
        return "data"


def _memfd(name):
    try:
        return os.memfd_create(name)
    except (AttributeError, OSError):
        import tempfile
        fd, path = tempfile.mkstemp()
        os.unlink(path)
        return fd


class Parked:
    """A child forked ahead of its run (after the previous run ended and was cleaned up),
    parked on a socket until the request comes: the fork and the set-up common to all runs
    are off the critical path of the next run."""

    def __init__(self, cfg):
        self.out_r, out_w = os.pipe()
        self.err_r, err_w = os.pipe()
        self.ctl, child_ctl = socket.socketpair()
        self.pid = os.fork()
        if self.pid == 0:
            _child(cfg, out_w, err_w, child_ctl.fileno())
        for fd in (out_w, err_w):
            os.close(fd)
        child_ctl.close()
        try:
            self.pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self.pidfd = None

    def start(self, chan_fd, size):
        """Pass the request payload (`size` bytes on the host socket) to the child. The
        payload is always consumed, so that the stream stays in step even if the child is
        gone (the run then reports how it ended). The buffer is zeroed at once: the payload
        (a judge's key and tests in its stdin) is not in the server's memory while it runs."""
        ctl, alive = self.ctl.fileno(), True
        try:
            _write_all(ctl, struct.pack(">Q", size))
        except (BrokenPipeError, ConnectionResetError):
            alive = False
        left = size
        try:
            while left:
                got = _used(os.readv(chan_fd, [_VIEW[:min(left, len(_BUF))]]))
                if not got:
                    raise EOFError("stream ended inside a payload")
                left -= got
                if alive:
                    try:
                        _write_all(ctl, _VIEW[:got])
                    except (BrokenPipeError, ConnectionResetError):
                        alive = False
        finally:
            _zero_buffer()

    def setup_error(self):
        """What the child reported if it could not set the run up (None if nothing)."""
        self.ctl.setblocking(False)
        try:
            data = self.ctl.recv(1 << 16)
        except OSError:
            data = b""
        self.ctl.close()
        return data.decode("utf-8", "replace") if data else None


def run_one(cfg, header, chan, killer, parked):
    """Run one request in the parked child: hand it the payload, collect, kill what is left.
    Returns the result header, the fds of the captured stdout and stderr, and whether the
    host went away."""
    statuses = {}
    pid, pidfd = parked.pid, parked.pidfd
    chan_fd = chan.fileno()
    outs = {parked.out_r: Capture(parked.out_r, header["max_output_bytes"]),
            parked.err_r: Capture(parked.err_r, header["max_output_bytes"])}
    start = time.monotonic()
    parked.start(chan_fd, header["payload"])
    for fd in outs:
        os.set_blocking(fd, False)
    poller = select.poll()
    for fd in outs:
        poller.register(fd, select.POLLIN)
    poller.register(chan_fd, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    deadline = start + header["timeout_s"]
    timed_out = host_gone = False
    end = None
    while end is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        wait_ms = remaining * 1000 if pidfd is not None else min(remaining * 1000, 2)
        for fd, _ in poller.poll(max(1, int(wait_ms + 0.999))):
            if fd in outs and outs[fd].read() == "eof":
                poller.unregister(fd)
            elif fd == chan_fd:
                host_gone = True
        if host_gone:
            break
        _reap_nohang(statuses)
        if pid in statuses:
            end = time.monotonic()
    clean = killer.kill_all(statuses)
    if end is None:
        end = time.monotonic()
    _reap_nohang(statuses)
    if pidfd is not None:
        os.close(pidfd)
    # Every writer is dead now; what is left in the pipes is the tail of the output.
    for fd, cap in outs.items():
        while cap.read() == "data":
            pass
        os.close(fd)
    error = parked.setup_error()
    out, err = outs[parked.out_r], outs[parked.err_r]
    if error is not None:
        os.close(out.store)
        os.close(err.store)
        return {"error": error}, [], host_gone
    exit_code, sig = _exit_status(statuses[pid]) if pid in statuses else (None, None)
    result = {
        "stdout_truncated": out.truncated, "stderr_truncated": err.truncated,
        "exit_code": exit_code, "signal": sig, "timed_out": timed_out,
        "duration_s": end - start, "clean": clean,
    }
    return result, [(out.store, out.kept), (err.store, err.kept)], host_gone


def run_put(cfg, header, chan, killer, parked):
    """A session's `put`: the parked child lays out the files and exits."""
    parked.start(chan.fileno(), header["payload"])
    statuses, deadline = {}, time.monotonic() + _PUT_TIMEOUT_S
    while parked.pid not in statuses and time.monotonic() < deadline:  # bounded, always
        _reap_nohang(statuses)
        time.sleep(0.0005)
    killer.kill_all(statuses)
    for fd in (parked.out_r, parked.err_r) + ((parked.pidfd,) if parked.pidfd else ()):
        os.close(fd)
    error = parked.setup_error()
    if error is None and parked.pid not in statuses:
        error = "writing the files did not finish in %g s" % _PUT_TIMEOUT_S
    return {"error": error} if error else {"ok": True}


_PUT_TIMEOUT_S = 8.0  # the host gives up on a put after 10 s (sandbox._WATCHDOG_GRACE_S)


def reset(cfg, modes):
    """Back to a clean state after a run: scratch dirs emptied, and what a run may have set
    on them put back (`modes`: from `_root_state`: mode, times, no extended attributes),
    SysV IPC objects removed. False if that failed."""
    clean = True
    for path in cfg["wipe"]:
        mode, times = modes[path]
        try:
            os.chmod(path, mode)
        except OSError:
            pass
        clean = wipe(path) and clean
        clean = _clear_root(path, times) and clean
    if cfg.get("sysv_ipc"):
        remove_sysv_ipc()
    if cfg.get("mqueue"):
        remove_posix_mqueues(cfg["mqueue"])
    return clean


def _return_files(cfg, max_bytes, result, blobs, sizes):
    """The work dir's regular files into the reply: names in `files`, contents as blobs;
    every other entry's name and kind in `other_files`."""
    files, others, truncated, changed = list_files(cfg["workdir"], max_bytes)
    fd, total, whole = stash_files(cfg["workdir"], files)
    _put_back(changed, None)
    result["files"] = [name for name, _ in files]
    result["other_files"] = others
    result["files_truncated"] = truncated or not whole
    blobs.append((fd, total))
    sizes += [size for _, size in files]


def _collect(cfg, caps, result, blobs, sizes):
    """A session's work dir after its run, to go back to the host: its entries in the reply
    (`state`) and its files as one more blob; True if so, False (and why in `state_kept`)
    when it is too large or unreadable, and so stays where it is."""
    entries, files, why = collect_state(cfg["workdir"], caps["max_bytes"], caps["max_files"])
    if entries is not None:
        fd, total, whole = stash_files(cfg["workdir"], files)
        if whole:
            result["state"] = entries
            if _SKIPPED:
                result["state_skipped"] = list(_SKIPPED)
            blobs.append((fd, total))
            sizes.append(total)
            return True
        os.close(fd)
        why = "a file of it could not be read"
    result["state_kept"] = why
    return False


# ---------------------------------------------------------------------------------------------
# The server loop
# ---------------------------------------------------------------------------------------------

def _connect(cfg):
    if "fd" in cfg["channel"]:
        return socket.socket(fileno=cfg["channel"]["fd"])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(cfg["channel"]["connect"])
    return sock


def serve(cfg):
    chan = _connect(cfg)
    _prctl(_PR_SET_DUMPABLE, 0)  # no ptrace, no /proc/<pid>/{environ,mem,fd} for the runs
    for name in cfg.get("preimport", ()):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 (a module the image lacks is simply not pre-imported)
            pass
    for name, source in cfg.get("preload", ()):  # trusted code of the host's (the judge's)
        module = types.ModuleType(name)
        sys.modules[name] = module
        exec(compile(source, name + ".py", "exec"), module.__dict__)
    killer = Killer(cfg)
    for path in [cfg["workdir"]] + list(cfg["wipe"]):
        os.makedirs(path, exist_ok=True)
    modes = {path: _root_state(path) for path in cfg["wipe"]}
    gc.collect()
    if hasattr(gc, "freeze"):
        gc.freeze()  # keep the children's copy-on-write pages shared
    # No child yet: the host moves this process into its cgroup once it reads "ready".
    parked = None
    send_frame(chan, {"ready": True, "pid": os.getpid(), "python": sys.version.split()[0]})
    while True:
        try:
            msg = recv_frame(chan)
        except (OSError, EOFError, ValueError):
            msg = None
        if msg is None or msg.get("op") == "exit":
            break
        op, blobs, sizes = msg.get("op"), [], []
        if op in ("run", "put"):
            child, parked = parked or Parked(cfg), None
            if op == "run":
                result, blobs, host_gone = run_one(cfg, msg, chan, killer, child)
                if host_gone:
                    break
            else:
                result = run_put(cfg, msg, chan, killer, child)
            sizes = [size for _, size in blobs]
            done = "error" not in result
            if done and msg.get("return_files"):
                _return_files(cfg, msg["max_files_bytes"], result, blobs, sizes)
            keep = msg.get("keep_state")
            if done and msg.get("collect"):
                keep = not _collect(cfg, msg["collect"], result, blobs, sizes)
            if not keep and not reset(cfg, modes):
                result["clean"] = False  # the host replaces this sandbox
        elif op == "reset":
            result = {"clean": reset(cfg, modes)}
        elif op == "files":
            result = {}
            _return_files(cfg, msg["max_bytes"], result, blobs, sizes)
        elif op == "status":
            result = {"parked": parked.pid if parked else None}
        else:
            result = {"error": "unknown op %r" % (op,)}
        result["blobs"] = sizes
        try:
            _send_reply(chan.fileno(), frame(result), blobs)
        except OSError:
            break
        finally:
            for fd, _ in blobs:
                os.close(fd)
        _zero_buffer()  # nothing of this run stays in memory the next child inherits
        if parked is None:
            parked = Parked(cfg)  # the next run's child, forked while the host reads this
    killer.kill_all({})
    for path in cfg.get("remove_on_exit", ()):
        remove_tree(path)


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
