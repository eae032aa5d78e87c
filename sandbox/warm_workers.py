"""The warm-worker registry (`sandbox.warm` is its public face, `warm()`; hence the name): idle workers kept per (backend spec, limits), lent one run at a
time to `sandbox.run` and unpinned sessions' turns, and handed back emptied.

At most `MAX_WORKERS_PER_KEY` are lent or idle at once per key; a borrower that finds them all
busy waits for one to come back rather than start a sandbox more. Pinned sessions hold a
worker of their own for their whole life, outside that bound.
"""

import atexit
import os
import threading
import weakref

from sandbox import backends
from sandbox.request import Limits
from sandbox.worker import Worker

# Workers lent for a run or idle, per key (a caller may change it before its first run).
# About the number of runs a host can usefully run at once; more would only queue for CPUs.
MAX_WORKERS_PER_KEY = max(8, 4 * (os.cpu_count() or 1))
_idle: dict[tuple, list[Worker]] = {}
_lent: dict[tuple, int] = {}
_changed = threading.Condition()  # guards _idle and _lent; notified when either shrinks
_started: "weakref.WeakSet[Worker]" = weakref.WeakSet()  # every worker made here, for counts


def borrow(key) -> Worker:
    """An idle worker for one run, or a new one while fewer than MAX_WORKERS_PER_KEY are lent
    or idle; otherwise waits for one to come back. Pair with `hand_back`."""
    with _changed:  # an RLock: take_idle and unlend take it again
        while True:
            worker = take_idle(key)
            if worker is not None or _lent.get(key, 0) < MAX_WORKERS_PER_KEY:
                _lent[key] = _lent.get(key, 0) + 1
                break
            _changed.wait()
    if worker is not None:
        return worker
    try:
        return new_worker(key)
    except BaseException:
        unlend(key)
        raise


def hand_back(key, worker: Worker, *, keep: bool = True) -> None:
    """A borrowed worker, emptied by its run: idle again (or closed if it is dead, if
    keep=False, or if the idle ones fill the bound already)."""
    with _changed:
        unlend(key)
        if keep and _park(key, worker):
            return
    worker.close()


def unlend(key) -> None:
    """One fewer worker lent for `key` (handed back, kept by a session, or never started)."""
    with _changed:
        _lent[key] -= 1
        _changed.notify()


def new_worker(key) -> Worker:
    worker = Worker(*key)
    with _changed:
        _started.add(worker)
    return worker


def take_idle(key) -> Worker | None:
    with _changed:
        workers = _idle.get(key, [])
        while workers:
            worker = workers.pop()
            if worker.alive:
                return worker
    return None


def put_idle(key, worker: Worker) -> None:
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


def warm(n: int = 1, *, backend="auto", **limits) -> None:
    """Start `n` workers for these settings (in parallel; at most MAX_WORKERS_PER_KEY stay)
    and keep them idle, so that the next `run` calls and `Session`s with the same settings
    start at once. `limits`: the fields of `Limits` (memory_mb, max_processes, network)."""
    spec = backends.resolve(backend)
    key = (spec, Limits(**limits))
    started, errors = [], []

    def start():
        try:
            started.append(new_worker(key))
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the caller's thread)
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for worker in started:
        put_idle(key, worker)
    if errors:
        raise errors[0]
