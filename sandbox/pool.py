"""A pool of sandbox workers: bounded queue, concurrency, deadlines, retries, futures.

    with sandbox.Pool(4, backend="bwrap") as pool:
        fut = pool.run(code="print(1+1)", timeout_s=2)           # Future[Result]
        reports = pool.map(judge.unit_tests, codes, tests)       # any picklable function
        report = await pool.acall(judge.stdio, code, cases)      # asyncio

Each worker is a process of its own (or a Ray actor, `cluster="ray"`) that calls the function
it is sent, typically `sandbox.run` or a judge, which keep warm sandboxes (fork servers) inside that worker.
`submit` blocks while `queue_size` requests wait (backpressure; `submit_nowait` raises
`PoolFull` instead). A request is retried, on a fresh worker, when its worker died, hung past
its deadline, or the sandbox under it failed (`sandbox.SandboxError`), at most `max_retries`
times; a program that merely failed is a result, never retried. A request's deadline is its
`timeout_s` keyword argument (the sandbox's convention; `default_timeout_s` without one) plus
`grace_s`. Shutdown stops every worker and what it started.
"""

import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import math
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading

log = logging.getLogger("sandbox")

_FRAME = struct.Struct("<Q")


class PoolFull(Exception):
    """`submit_nowait` found the queue full: try again later (an HTTP 503)."""


class WorkerLost(RuntimeError):
    """The request's worker died (or hung, or its sandbox failed) on every attempt."""


class _WorkerDied(Exception):
    """Internal: the worker cannot answer this request."""


@dataclasses.dataclass
class _Item:
    future: concurrent.futures.Future
    fn: object
    args: tuple
    kwargs: dict
    deadline_s: float
    attempts: int = 0


class Pool(concurrent.futures.Executor):
    """`workers` concurrent workers behind a queue of at most `queue_size` waiting requests.

    backend: the default sandbox backend of `run`, `unit_tests` and `stdio` (and warmed up in
    each worker at start). cluster: "local" (worker processes on this machine) or "ray"
    (Ray actors wherever the connected cluster places them, `ray_options` passed to
    `.options()`; call `ray.init` first)."""

    def __init__(self, workers: int = 2, *, backend="auto", queue_size: int | None = None,
                 max_retries: int = 2, grace_s: float = 30.0, default_timeout_s: float = 300.0,
                 cluster: str = "local", ray_options: dict | None = None, warm: bool = True):
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        queue_size = 4 * workers if queue_size is None else queue_size
        if not isinstance(queue_size, int) or queue_size < 1:
            raise ValueError(f"queue_size must be a positive int, got {queue_size!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if cluster not in ("local", "ray"):
            raise ValueError(f"cluster must be 'local' or 'ray', got {cluster!r}")
        if cluster == "ray":
            _ray()  # fails now, with the fix, if ray is missing or not initialised
        self.backend = backend
        self.workers = workers
        self.queue_size = queue_size
        self.max_retries = max_retries
        self.grace_s = float(grace_s)
        self.default_timeout_s = float(default_timeout_s)
        self.cluster = cluster
        self._ray_options = dict(ray_options or {})
        self._warm = (backend,) if warm else ()
        self._cond = threading.Condition()
        self._pending = collections.deque()
        self._closed = False
        self._live = {}  # slot -> worker
        self._stats = dict.fromkeys(
            ("submitted", "completed", "retried", "worker_starts", "worker_deaths"), 0)
        self._threads = [threading.Thread(target=self._slot_loop, args=(slot,), daemon=True,
                                          name=f"sandbox-pool-{slot}")
                         for slot in range(workers)]
        for t in self._threads:
            t.start()

    # -- submitting --------------------------------------------------------------------------
    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        """Queue `fn(*args, **kwargs)` for a worker; blocks while the queue is full."""
        return self._put(fn, args, kwargs, block=True)

    def submit_nowait(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        """Like `submit`, but raises `PoolFull` instead of waiting for room."""
        return self._put(fn, args, kwargs, block=False)

    async def acall(self, fn, /, *args, **kwargs):
        """The asyncio form: awaits room in the queue (without blocking the loop), then the
        result."""
        import asyncio
        try:
            future = self.submit_nowait(fn, *args, **kwargs)
        except PoolFull:
            loop = asyncio.get_running_loop()
            future = await loop.run_in_executor(
                None, functools.partial(self.submit, fn, *args, **kwargs))
        return await asyncio.wrap_future(future)

    def run(self, code=None, **kwargs) -> concurrent.futures.Future:
        """`sandbox.run(code, **kwargs)` in a worker, on the pool's backend by default."""
        from sandbox.session import run
        return self.submit(run, code, **{"backend": self.backend, **kwargs})

    def unit_tests(self, code, tests, **kwargs) -> concurrent.futures.Future:
        """`sandbox.judge.unit_tests` in a worker, on the pool's backend by default."""
        from sandbox.judge import unit_tests
        return self.submit(unit_tests, code, tests, **{"backend": self.backend, **kwargs})

    def stdio(self, code, cases, **kwargs) -> concurrent.futures.Future:
        """`sandbox.judge.stdio` in a worker, on the pool's backend by default."""
        from sandbox.judge import stdio
        return self.submit(stdio, code, cases, **{"backend": self.backend, **kwargs})

    def _put(self, fn, args, kwargs, block):
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        timeout = kwargs.get("timeout_s", self.default_timeout_s)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
            timeout = self.default_timeout_s  # let fn report the bad argument
        elif not math.isfinite(timeout) or timeout <= 0:  # no deadline could be kept
            raise ValueError(f"`timeout_s` must be a finite positive number, got {timeout!r}")
        item = _Item(concurrent.futures.Future(), fn, args, kwargs, float(timeout) + self.grace_s)
        with self._cond:
            while not self._closed and len(self._pending) >= self.queue_size:
                if not block:
                    raise PoolFull(f"{len(self._pending)} requests are waiting "
                                   f"(queue_size={self.queue_size})")
                self._cond.wait()
            if self._closed:
                raise RuntimeError("cannot submit to a pool that is shut down")
            self._pending.append(item)
            self._stats["submitted"] += 1
            self._cond.notify_all()
        return item.future

    # -- state -------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counts: submitted, completed, retried, worker_starts, worker_deaths; and queued."""
        with self._cond:
            return {**self._stats, "queued": len(self._pending)}

    def worker_pids(self) -> list[int]:
        """Pids of the live workers (Ray actors' processes with cluster="ray")."""
        with self._cond:
            return [w.pid for w in self._live.values() if w.pid is not None]

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting requests; run what is queued (or cancel it, `cancel_futures`), then
        stop every worker. With wait=True, returns when all workers are gone."""
        with self._cond:
            self._closed = True
            if cancel_futures:
                while self._pending:
                    self._pending.popleft().future.cancel()
            self._cond.notify_all()
        if wait:
            for t in self._threads:
                t.join()

    # -- the slots ---------------------------------------------------------------------------
    def _next(self):
        with self._cond:
            while not self._pending:
                if self._closed:
                    return None
                self._cond.wait()
            item = self._pending.popleft()
            self._cond.notify_all()
            return item

    def _slot_loop(self, slot):
        worker = None
        try:
            try:
                worker = self._start_worker(slot)  # warm before the first request
            except Exception as e:  # noqa: BLE001 - the first request retries and reports it
                log.warning("sandbox pool: worker %d did not start: %s", slot, e)
            while True:
                item = self._next()
                if item is None:
                    return
                if not item.future.set_running_or_notify_cancel():
                    continue
                worker = self._serve(slot, worker, item)
        finally:
            if worker is not None:
                worker.close()
            with self._cond:
                self._live.pop(slot, None)

    def _serve(self, slot, worker, item):
        """Runs `item` to exactly one outcome; returns the worker to keep (or None)."""
        from sandbox.sandbox import SandboxError
        while True:
            error = None
            try:
                if worker is None:
                    worker = self._start_worker(slot)
                ok, value = worker.call(item.fn, item.args, item.kwargs, item.deadline_s)
                if not ok and isinstance(value, SandboxError):
                    error = f"its sandbox failed: {value}"
            except _WorkerDied as e:
                error = f"its worker died: {e}"
                if worker is not None:
                    worker.kill()
                worker = None
                with self._cond:
                    self._stats["worker_deaths"] += 1
                    self._live.pop(slot, None)
            except BaseException as e:  # noqa: BLE001 - a worker that cannot start
                ok, value = False, e
            if error is None:
                (item.future.set_result if ok else item.future.set_exception)(value)
                with self._cond:
                    self._stats["completed"] += 1
                return worker
            item.attempts += 1
            if item.attempts > self.max_retries:
                item.future.set_exception(WorkerLost(
                    f"gave up after {item.attempts} attempts; last: {error}"))
                with self._cond:
                    self._stats["completed"] += 1
                return worker
            log.warning("sandbox pool: retrying a request (%s)", error)
            with self._cond:
                self._stats["retried"] += 1

    def _start_worker(self, slot):
        if self.cluster == "ray":
            worker = _RayWorker(self._ray_options, self._warm)
        else:
            worker = _ProcessWorker(self._warm)
        with self._cond:
            self._live[slot] = worker
            self._stats["worker_starts"] += 1
            closed = self._closed and not self._pending
        if closed:  # shut down while it started: nothing will use it
            worker.close()
        return worker

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown(wait=True)


# ----------------------------------------------------------------------------------------------
# Local workers: one process each, requests and replies as pickles over a socket
# ----------------------------------------------------------------------------------------------

def _send(sock, obj):
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_FRAME.pack(len(data)) + data)


def _recv(sock):
    header = _recv_exact(sock, _FRAME.size)
    return pickle.loads(_recv_exact(sock, _FRAME.unpack(header)[0]))


def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the connection")
        buf += chunk
    return bytes(buf)


class _ProcessWorker:
    """A `python -c ...` child running `_worker_main`, talking over a socketpair."""

    def __init__(self, warm):
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "import sandbox.pool as p; p._worker_main()",
                 str(child.fileno())],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env,
                start_new_session=True)
        finally:
            child.close()
        self.pid = self.proc.pid
        self.sock = parent
        self.ids = itertools.count()
        _send(self.sock, ("warm", warm))

    def call(self, fn, args, kwargs, deadline_s):
        """One request and its reply. Each reply carries its request's id: a reply to any
        other request is an error (the worker is replaced), never an answer to this one;
        and once a request is sent, any failure replaces the worker, so that no reply is
        left unread for the next caller."""
        req_id = next(self.ids)
        data = pickle.dumps((req_id, fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.sock.settimeout(None)
            self.sock.sendall(_FRAME.pack(len(data)) + data)
            self.sock.settimeout(deadline_s)
            got_id, ok, value = _recv(self.sock)
        except socket.timeout:
            raise _WorkerDied(f"no answer within its deadline of {deadline_s:.0f} s") from None
        except Exception as e:  # noqa: BLE001 - the stream is out of step: never reuse it
            code = self.proc.poll()
            why = f"exit status {code}" if code is not None else f"{type(e).__name__}: {e}"
            raise _WorkerDied(why) from None
        if got_id != req_id:
            raise _WorkerDied(f"it answered request {got_id!r} to request {req_id}")
        return ok, value

    def kill(self):
        """SIGKILL the worker; its sandboxes die with it (their servers see the socket close,
        and each was started with a parent-death signal)."""
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        self.sock.close()

    def close(self):
        """Ask the worker to stop (it closes its sandboxes); kill it if it does not."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


def _worker_main():
    """The worker process: serve (id, fn, args, kwargs) until the pool closes the socket."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool decides when workers stop
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        _, warm = _recv(sock)
        _warm_up(warm)
        while True:
            try:
                req_id, fn, args, kwargs = _recv(sock)
            except EOFError:
                return
            _send(sock, (req_id, *_call(fn, args, kwargs)))
    finally:
        import sandbox
        sandbox.shutdown()


def _call(fn, args, kwargs):
    """(True, value) or (False, exception), always picklable."""
    try:
        ok, value = True, fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - the caller's future gets it
        ok, value = False, e
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001
        ok, value = False, RuntimeError(f"the result of {fn!r} cannot be pickled: {e!r}; "
                                        f"it was {value!r:.200}")
    return ok, value


def _warm_up(backends):
    """Start the warm fork servers (plain runs and judge runs) before the first request."""
    import sandbox
    from sandbox import judge
    for backend in backends:
        try:
            sandbox.run("pass", backend=backend, timeout_s=30)
            sandbox.run("pass", backend=judge.judge_backend(backend), timeout_s=30)
        except Exception as e:  # noqa: BLE001 - the first real request will report it
            log.warning("sandbox pool: could not warm up backend %r: %s", backend, e)


def _die_with_parent():
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PDEATHSIG
    except Exception:  # noqa: BLE001 - then the closed socket stops it
        pass
    if os.getppid() == 1:
        os._exit(0)


# ----------------------------------------------------------------------------------------------
# Ray workers: one actor each
# ----------------------------------------------------------------------------------------------

def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("cluster='ray' needs ray: pip install 'ptrain[ray]'") from None
    if not ray.is_initialized():
        raise RuntimeError("cluster='ray' needs a connected Ray: call ray.init() first")
    return ray


class _RayActor:
    """The Ray actor: the same `_call` as a local worker, in a process Ray manages."""

    def __init__(self, sys_path, warm):
        for p in reversed(sys_path):
            if p not in sys.path:
                sys.path.insert(0, p)
        _warm_up(warm)

    def pid(self):
        return os.getpid()

    def call(self, fn, args, kwargs):
        return _call(fn, args, kwargs)


class _RayWorker:
    def __init__(self, options, warm):
        ray = _ray()
        cls = ray.remote(_RayActor).options(**{"num_cpus": 1, "max_restarts": 0, **options})
        self.actor = cls.remote([p for p in sys.path if p], warm)
        self.pid = None
        try:
            self.pid = ray.get(self.actor.pid.remote(), timeout=120)
        except Exception as e:  # noqa: BLE001
            self.kill()
            raise _WorkerDied(f"the Ray actor did not start: {e}") from None

    def call(self, fn, args, kwargs, deadline_s):
        ray = _ray()
        ref = self.actor.call.remote(fn, args, kwargs)
        try:
            return tuple(ray.get(ref, timeout=deadline_s))
        except ray.exceptions.GetTimeoutError:
            raise _WorkerDied(f"no answer within its deadline of {deadline_s:.0f} s") from None
        except ray.exceptions.RayError as e:  # the actor died, its node went away, ...
            raise _WorkerDied(f"{type(e).__name__}: {str(e)[:300]}") from None

    def kill(self):
        try:
            _ray().kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def close(self):
        self.kill()
