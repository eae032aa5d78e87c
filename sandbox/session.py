"""`run()` for one-off runs over warm workers, and `Session` for multi-turn episodes.

Warm workers are shared per (backend spec, limits): `run` and an unpinned Session's turns
borrow one that is idle (or start one) for the length of one run and hand it back emptied.
At most `MAX_WORKERS_PER_KEY` are lent or idle at once per key; a run that finds them all
busy waits for one to come back rather than start a sandbox more. Pinned sessions hold a
worker of their own for their whole life, outside that bound.
"""

import atexit
import logging
import os
import threading
import weakref

from sandbox import backends
from sandbox.request import Request
from sandbox.result import Result
from sandbox.worker import Worker, WorkerError
from sandbox.workdir import WorkDir

log = logging.getLogger("sandbox")

# Workers lent for a run or idle, per key (a caller may change it before its first run).
# About the number of runs a host can usefully run at once; more would only queue for CPUs.
MAX_WORKERS_PER_KEY = max(8, 4 * (os.cpu_count() or 1))
_idle: dict[tuple, list[Worker]] = {}
_lent: dict[tuple, int] = {}
_changed = threading.Condition()  # guards _idle and _lent; notified when either shrinks
_started: "weakref.WeakSet[Worker]" = weakref.WeakSet()  # every worker made here, for counts


def run(code: str | None = None, *, language: str | None = None,
        command: list[str] | None = None, files: dict | None = None,
        stdin: str | bytes | None = None, timeout_s: float = 10.0, memory_mb: int = 512,
        network: bool = False, backend="auto", return_files: bool = False,
        env: dict | None = None, max_processes: int = 64, max_output_bytes: int = 1 << 20,
        max_file_mb: int = 64, max_open_files: int = 256, max_files_bytes: int = 16 << 20,
        fork_server: bool = True) -> Result:
    """Run `code` (in `language`: "python", the default, or "bash") or `command` (an argv
    list) in a fresh work dir holding `files`, in isolation, and return what happened.

    Never raises for anything the program does (see `Result`). Raises ValueError/TypeError
    for bad arguments, `BackendUnavailable` if `backend` cannot run here, and `WorkerError`
    if the sandbox itself failed (safe to retry).

    fork_server=True (the default) runs it through a warm fork server of `backend`: a fork
    of a pre-started interpreter, no interpreter or sandbox start-up per run. False starts a
    fresh sandbox (process tree / bwrap namespaces / container) for this run alone.
    """
    request = Request(
        code=code, language=language, command=command, files=files or {}, stdin=stdin,
        timeout_s=timeout_s, env=env or {}, return_files=return_files,
        max_output_bytes=max_output_bytes, max_file_mb=max_file_mb,
        max_open_files=max_open_files, max_files_bytes=max_files_bytes)
    spec = backends.resolve(backend)
    limits = backends.Limits(memory_mb=memory_mb, max_processes=max_processes,
                             network=network)
    if not fork_server:
        with Worker(spec, limits, preimport=False) as worker:
            return worker.run(request)
    key = (spec, limits)
    worker = _borrow(key)
    try:
        result = worker.run(request)
    except BaseException as e:
        _hand_back(key, worker, keep=isinstance(e, ValueError))  # files it could not lay out
        raise
    _hand_back(key, worker)
    return result


def _borrow(key) -> Worker:
    """An idle worker for one run, or a new one while fewer than MAX_WORKERS_PER_KEY are lent
    or idle; otherwise waits for one to come back. Pair with `_hand_back`."""
    with _changed:  # an RLock: _take_idle and _unlend take it again
        while True:
            worker = _take_idle(key)
            if worker is not None or _lent.get(key, 0) < MAX_WORKERS_PER_KEY:
                _lent[key] = _lent.get(key, 0) + 1
                break
            _changed.wait()
    if worker is not None:
        return worker
    try:
        return _new_worker(key)
    except BaseException:
        _unlend(key)
        raise


def _hand_back(key, worker: Worker, *, keep: bool = True) -> None:
    """A borrowed worker, emptied by its run: idle again (or closed if it is dead, if
    keep=False, or if the idle ones fill the bound already)."""
    with _changed:
        _unlend(key)
        if keep and _park(key, worker):
            return
    worker.close()


def _unlend(key) -> None:
    """One fewer worker lent for `key` (handed back, kept by a session, or never started)."""
    with _changed:
        _lent[key] -= 1
        _changed.notify()


def _new_worker(key) -> Worker:
    worker = Worker(*key)
    with _changed:
        _started.add(worker)
    return worker


def _take_idle(key) -> Worker | None:
    with _changed:
        workers = _idle.get(key, [])
        while workers:
            worker = workers.pop()
            if worker.alive:
                return worker
    return None


def _put_idle(key, worker: Worker) -> None:
    with _changed:
        if _park(key, worker):
            _changed.notify()
            return
    worker.close()


def _park(key, worker: Worker) -> bool:
    """Under `_changed`: make `worker` idle if it is alive and the bound allows."""
    idle = _idle.setdefault(key, [])
    if worker.alive and len(idle) + _lent.get(key, 0) < MAX_WORKERS_PER_KEY:
        idle.append(worker)
        return True
    return False


def shutdown() -> None:
    """Close every idle warm worker (also done at interpreter exit)."""
    with _changed:
        workers = [w for ws in _idle.values() for w in ws]
        _idle.clear()
        _changed.notify_all()
    for worker in workers:
        worker.close()


atexit.register(shutdown)


def live_workers() -> list[Worker]:
    """The workers `run`, `warm` and `Session` started that are still alive: idle, lent for
    a run, or held by a pinned session."""
    with _changed:
        return [w for w in list(_started) if w.alive]


def warm(n: int = 1, *, backend="auto", memory_mb: int = 512, max_processes: int = 64,
         network: bool = False) -> None:
    """Start `n` workers for these settings (in parallel; at most MAX_WORKERS_PER_KEY stay)
    and keep them idle, so that the next `run` calls and `Session`s with the same settings
    start at once."""
    spec = backends.resolve(backend)
    key = (spec, backends.Limits(memory_mb=memory_mb, max_processes=max_processes,
                                 network=network))
    started, errors = [], []

    def start():
        try:
            started.append(_new_worker(key))
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the caller's thread)
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for worker in started:
        _put_idle(key, worker)
    if errors:
        raise errors[0]


class Session:
    """A sandbox for a multi-turn episode: one work dir that persists across runs.

    Each `run` is a fresh process (tree) under the same isolation and limits, killed whole
    when it ends; the work dir's files, directories, symlinks and fifos (with their modes and
    mtimes) stay until the session closes.

    Unpinned (the default), the session holds no worker: its work dir lives on the host
    between runs, and each run borrows any warm worker, lays the work dir in, runs, collects
    it back and hands the worker back emptied, so that many sessions share as many workers as
    run at the same moment. /tmp, /dev/shm, SysV IPC and hard links between files do not
    persist. A work dir that grows past `max_state_bytes` of files or `max_state_files`
    entries (or cannot be read whole) stays in its worker instead, which the session then
    keeps for the rest of its life (`pinned` turns True, and the log says why): nothing is
    lost.

    pinned=True takes a worker for the whole session: /tmp, /dev/shm and SysV IPC persist
    too. Closing empties it and hands it back to the warm ones `run` uses.

    Either way, closing (or leaving the `with` block) removes everything, and if the caller
    dies, the workers die with all in them.

        with sandbox.Session(backend="bwrap") as s:
            s.run("open('a.txt', 'w').write('hi')")
            s.run(command=["cat", "a.txt"]).stdout  # b"hi"
    """

    def __init__(self, *, backend="auto", memory_mb: int = 512, max_processes: int = 64,
                 network: bool = False, files: dict | None = None, pinned: bool = False,
                 max_state_bytes: int = 16 << 20, max_state_files: int = 10_000):
        for name, value in (("max_state_bytes", max_state_bytes),
                            ("max_state_files", max_state_files)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        spec = backends.resolve(backend)
        self._key = (spec, backends.Limits(memory_mb=memory_mb, max_processes=max_processes,
                                           network=network))
        self._caps = {"max_bytes": max_state_bytes, "max_files": max_state_files}
        self._lock = threading.Lock()  # one operation at a time: each moves the work dir
        self._workdir = WorkDir()
        self._held: list[Worker] = []  # the worker of a pinned session
        self._finalizer = weakref.finalize(self, _release, self._key, self._held)
        if pinned:
            self._held.append(_take_idle(self._key) or _new_worker(self._key))
        if files:
            self.write_files(files)

    @property
    def backend(self) -> str:
        return self._key[0].name

    @property
    def pinned(self) -> bool:
        """Whether the session holds a worker (asked for, or its work dir outgrew the caps)."""
        return bool(self._held)

    @property
    def worker(self) -> Worker | None:
        """The worker a pinned session holds; None for an unpinned one."""
        return self._held[0] if self._held else None

    def run(self, code: str | None = None, *, language: str | None = None,
            command: list[str] | None = None, files: dict | None = None,
            stdin: str | bytes | None = None, timeout_s: float = 10.0,
            return_files: bool = False, env: dict | None = None,
            max_output_bytes: int = 1 << 20, max_file_mb: int = 64, max_open_files: int = 256,
            max_files_bytes: int = 16 << 20) -> Result:
        """Like `sandbox.run`, in this session's work dir; `files` are added to it first."""
        request = Request(
            code=code, language=language, command=command, files=files or {}, stdin=stdin,
            timeout_s=timeout_s, env=env or {}, return_files=return_files,
            max_output_bytes=max_output_bytes, max_file_mb=max_file_mb,
            max_open_files=max_open_files, max_files_bytes=max_files_bytes)
        with self._lock:
            self._check_open()
            if self._held:
                return self._held[0].run(request, keep_state=True)
            return self._unpinned(lambda w: w.run_in(self._workdir, request, **self._caps))

    def write_files(self, files: dict) -> None:
        """Add or overwrite files (relative path -> str or bytes) in the work dir. Raises
        ValueError (and changes nothing) if one cannot be written, e.g. through a symlink
        that leads out of the work dir."""
        files = dict(Request(code="", files=files).files)
        with self._lock:
            self._check_open()
            if self._held:
                return self._held[0].put_files(files)
            added = self._workdir.with_files(files)
            if added is not None:  # nothing there that a write could trip on
                self._workdir = added
                return None
            self._unpinned(lambda w: (None, w.put_in(self._workdir, files, **self._caps)))
        return None

    def read_files(self, max_bytes: int = 16 << 20) -> dict[str, bytes]:
        """The regular files now in the work dir (relative path -> bytes). Raises ValueError
        if they pass `max_bytes` in total."""
        with self._lock:
            self._check_open()
            if self._held:
                files, truncated = self._held[0].read_files(max_bytes)
            else:
                files = self._workdir.files()
                truncated = sum(map(len, files.values())) > max_bytes
        if truncated:
            raise ValueError(f"the work dir holds more than max_bytes={max_bytes}; "
                             "raise it to read everything")
        return files

    def close(self) -> None:
        """Remove the work dir (and empty and hand back a pinned session's worker)."""
        with self._lock:
            self._finalizer()
            self._workdir = None

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise WorkerError("the session is closed")

    def _unpinned(self, step):
        """One operation on a borrowed worker: `step(worker)` -> (result, new WorkDir or
        None if the work dir stayed in the worker, which the session then keeps)."""
        worker = _borrow(self._key)
        try:
            result, workdir = step(worker)
        except BaseException as e:
            # The work dir is unchanged; a worker that merely refused the files is clean.
            _hand_back(self._key, worker, keep=isinstance(e, ValueError))
            raise
        if workdir is None:
            log.warning("sandbox: a session's work dir outgrew what is collected between "
                        "runs; the session keeps its %s worker from now on", worker.backend)
            _unlend(self._key)
            self._held.append(worker)
        else:
            _hand_back(self._key, worker)
        self._workdir = workdir
        return result


def _release(key, held: list[Worker]) -> None:
    """A closed session's worker, if it holds one: emptied, then warm again for others (or
    closed)."""
    for worker in held:
        try:
            worker.reset()
        except WorkerError:
            worker.close()
            continue
        _put_idle(key, worker)
    held.clear()
