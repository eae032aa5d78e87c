"""The warm-sandbox registry (`sandbox.warm` is its public face, `warm()`; hence the name): idle sandboxes kept per (backend spec, limits), lent one run at a
time to `sandbox.run` and unpinned sessions' turns, and handed back emptied.

At most `MAX_SANDBOXES_PER_KEY` are lent or idle at once per key; a borrower that finds them all
busy waits for one to come back rather than start a sandbox more. Pinned sessions hold a
sandbox of their own for their whole life, outside that bound.
"""

import atexit
import os
import threading
import warnings
import weakref

from sandbox import backends
from sandbox.request import Limits
from sandbox.sandbox import Sandbox

# Sandboxes lent for a run or idle, per key (a caller may change it before its first run).
# About the number of runs a host can usefully run at once; more would only queue for CPUs.
MAX_SANDBOXES_PER_KEY = max(8, 4 * (os.cpu_count() or 1))
_idle: dict[tuple, list[Sandbox]] = {}
_lent: dict[tuple, int] = {}
_changed = threading.Condition()  # guards _idle and _lent; notified when either shrinks
_started: "weakref.WeakSet[Sandbox]" = weakref.WeakSet()  # every sandbox made here, for counts


def borrow(key) -> Sandbox:
    """An idle sandbox for one run, or a new one while fewer than MAX_SANDBOXES_PER_KEY are lent
    or idle; otherwise waits for one to come back. Pair with `hand_back`."""
    with _changed:  # an RLock: take_idle and unlend take it again
        while True:
            sandbox = take_idle(key)
            if sandbox is not None or _lent.get(key, 0) < MAX_SANDBOXES_PER_KEY:
                _lent[key] = _lent.get(key, 0) + 1
                break
            _changed.wait()
    if sandbox is not None:
        return sandbox
    try:
        return new_sandbox(key)
    except BaseException:
        unlend(key)
        raise


def hand_back(key, sandbox: Sandbox, *, keep: bool = True) -> None:
    """A borrowed sandbox, emptied by its run: idle again (or closed if it is dead, if
    keep=False, or if the idle ones fill the bound already)."""
    with _changed:
        unlend(key)
        if keep and _park(key, sandbox):
            return
    sandbox.close()


def unlend(key) -> None:
    """One fewer sandbox lent for `key` (handed back, kept by a session, or never started)."""
    with _changed:
        _lent[key] -= 1
        _changed.notify()


def new_sandbox(key) -> Sandbox:
    sandbox = Sandbox(*key)
    with _changed:
        _started.add(sandbox)
    return sandbox


def take_idle(key) -> Sandbox | None:
    with _changed:
        sandboxes = _idle.get(key, [])
        while sandboxes:
            sandbox = sandboxes.pop()
            if sandbox.alive:
                return sandbox
    return None


def put_idle(key, sandbox: Sandbox) -> None:
    with _changed:
        if _park(key, sandbox):
            _changed.notify()
            return
    sandbox.close()


def _park(key, sandbox: Sandbox) -> bool:
    """Under `_changed`: make `sandbox` idle if it is alive and the bound allows."""
    idle = _idle.setdefault(key, [])
    if sandbox.alive and len(idle) + _lent.get(key, 0) < MAX_SANDBOXES_PER_KEY:
        idle.append(sandbox)
        return True
    return False


def shutdown() -> None:
    """Close every idle warm sandbox (also done at interpreter exit)."""
    with _changed:
        sandboxes = [w for ws in _idle.values() for w in ws]
        _idle.clear()
        _changed.notify_all()
    for sandbox in sandboxes:
        sandbox.close()


atexit.register(shutdown)


def live_sandboxes() -> list[Sandbox]:
    """The sandboxes `run`, `warm` and `Session` started that are still alive: idle, lent for
    a run, or held by a pinned session."""
    with _changed:
        return [w for w in list(_started) if w.alive]


def warm(n: int = 1, *, backend="auto", **limits) -> None:
    """Start `n` sandboxes for these settings (in parallel; at most MAX_SANDBOXES_PER_KEY stay)
    and keep them idle, so that the next `run` calls and `Session`s with the same settings
    start at once. `limits`: the fields of `Limits` (memory_mb, max_processes, network)."""
    spec = backends.pick_backend(backend)
    key = (spec, Limits(**limits))
    started, errors = [], []

    def start():
        try:
            started.append(new_sandbox(key))
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the caller's thread)
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for sandbox in started:
        put_idle(key, sandbox)
    if errors:
        raise errors[0]


def __getattr__(name):
    if name == "MAX_WORKERS_PER_KEY":  # the name before sandboxes and pool workers were told apart
        warnings.warn("MAX_WORKERS_PER_KEY is deprecated: use MAX_SANDBOXES_PER_KEY (setting the "
                      "old name has no effect)", DeprecationWarning, stacklevel=2)
        return MAX_SANDBOXES_PER_KEY
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
