"""`run()` for one-off runs over warm workers, and `Session` for multi-turn episodes."""

import atexit
import os
import threading
import weakref

from sandbox import backends
from sandbox.request import Request
from sandbox.result import Result
from sandbox.worker import Worker, WorkerError

# Idle warm workers, by (backend spec, limits). `run` takes one (or starts one), runs, and
# puts it back, so concurrent callers (threads, a pool) each get their own.
_idle: dict[tuple, list[Worker]] = {}
_idle_lock = threading.Lock()
_MAX_IDLE_PER_KEY = max(4, 2 * (os.cpu_count() or 1))


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
    worker = _take_idle(key) or Worker(spec, limits)
    try:
        result = worker.run(request)
    except BaseException:
        worker.close()
        raise
    _put_idle(key, worker)
    return result


def _take_idle(key) -> Worker | None:
    with _idle_lock:
        workers = _idle.get(key, [])
        while workers:
            worker = workers.pop()
            if worker.alive:
                return worker
    return None


def _put_idle(key, worker: Worker) -> None:
    if worker.alive:
        with _idle_lock:
            workers = _idle.setdefault(key, [])
            if len(workers) < _MAX_IDLE_PER_KEY:
                workers.append(worker)
                return
    worker.close()


def shutdown() -> None:
    """Close every idle warm worker (also done at interpreter exit)."""
    with _idle_lock:
        workers = [w for ws in _idle.values() for w in ws]
        _idle.clear()
    for worker in workers:
        worker.close()


atexit.register(shutdown)


def warm(n: int = 1, *, backend="auto", memory_mb: int = 512, max_processes: int = 64,
         network: bool = False) -> None:
    """Start `n` workers for these settings (in parallel) and keep them idle, so that the
    next `run` calls and `Session`s with the same settings start at once."""
    spec = backends.resolve(backend)
    limits = backends.Limits(memory_mb=memory_mb, max_processes=max_processes,
                             network=network)
    started, errors = [], []

    def start():
        try:
            started.append(Worker(spec, limits))
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the caller's thread)
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for worker in started:
        _put_idle((spec, limits), worker)
    if errors:
        raise errors[0]


class Session:
    """A sandbox for a multi-turn episode: one work dir (and /tmp) that persists across runs.

    Each `run` is still a fresh process (tree) under the same isolation and limits, killed
    whole when it ends; files stay until the session closes. Closing (or leaving the `with`
    block) empties the work dir, /tmp, /dev/shm and SysV IPC and hands the worker back to the
    warm ones `run` uses; if the caller dies, the worker dies with everything in it. A
    session takes a warm worker when there is one (see `warm`), so it starts at once.

        with sandbox.Session(backend="bwrap") as s:
            s.run("open('a.txt', 'w').write('hi')")
            s.run(command=["cat", "a.txt"]).stdout  # b"hi"
    """

    def __init__(self, *, backend="auto", memory_mb: int = 512, max_processes: int = 64,
                 network: bool = False, files: dict | None = None):
        spec = backends.resolve(backend)
        key = (spec, backends.Limits(memory_mb=memory_mb, max_processes=max_processes,
                                     network=network))
        self._worker = _take_idle(key) or Worker(*key)
        self._finalizer = weakref.finalize(self, _give_back, key, self._worker)
        if files:
            self.write_files(files)

    @property
    def backend(self) -> str:
        return self._worker.backend

    @property
    def worker(self) -> Worker:
        return self._worker

    def run(self, code: str | None = None, *, language: str | None = None,
            command: list[str] | None = None, files: dict | None = None,
            stdin: str | bytes | None = None, timeout_s: float = 10.0,
            return_files: bool = False, env: dict | None = None,
            max_output_bytes: int = 1 << 20, max_file_mb: int = 64, max_open_files: int = 256,
            max_files_bytes: int = 16 << 20) -> Result:
        """Like `sandbox.run`, in this session's work dir; `files` are added to it first."""
        if self.closed:
            raise WorkerError("the session is closed")
        return self._worker.run(Request(
            code=code, language=language, command=command, files=files or {}, stdin=stdin,
            timeout_s=timeout_s, env=env or {}, return_files=return_files,
            max_output_bytes=max_output_bytes, max_file_mb=max_file_mb,
            max_open_files=max_open_files, max_files_bytes=max_files_bytes), keep_state=True)

    def write_files(self, files: dict) -> None:
        """Add or overwrite files (relative path -> str or bytes) in the work dir."""
        self._worker.put_files(Request(code="", files=files).files)

    def read_files(self, max_bytes: int = 16 << 20) -> dict[str, bytes]:
        """The regular files now in the work dir (relative path -> bytes). Raises ValueError
        if they pass `max_bytes` in total."""
        files, truncated = self._worker.read_files(max_bytes)
        if truncated:
            raise ValueError(f"the work dir holds more than max_bytes={max_bytes}; "
                             "raise it to read everything")
        return files

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _give_back(key, worker: Worker) -> None:
    """A closed session's worker: emptied, then warm again for others (or closed)."""
    try:
        worker.reset()
    except WorkerError:
        worker.close()
        return
    _put_idle(key, worker)
