"""Isolation backends: how to start a fork server (sandbox/forkserver.py) inside each.

One class per backend (process.py, bwrap.py, docker.py), a frozen dataclass spec that owns
its availability check (`unavailable_reason()`), its start (`start(limits, modules)`, which
returns that backend's `Server` handle) and what the fork server resets after every run
(`reset()`); base.py holds what they share.

- `Process()`: a plain child process. Not a security boundary.
- `Bwrap()`: bubblewrap namespaces, an unprivileged uid of its own per sandbox.
- `Docker()`: a warm container per sandbox.

`resolve("auto")` picks the strongest available: docker, then bwrap, then process.
`backend="bwrap"` and `backend=Bwrap()` mean the same; pass an instance to change its
settings (`Docker(image="my-image:tag")`).
"""

import functools
import logging
import sys

from sandbox.backends.base import BackendUnavailable, Server, server_argv
from sandbox.backends.bwrap import Bwrap, seccomp_filter
from sandbox.backends.docker import Docker, docker_client
from sandbox.backends.preimport import PREIMPORT
from sandbox.backends.process import Process
from sandbox.request import Limits

__all__ = ["BY_NAME", "BackendUnavailable", "Bwrap", "Docker", "Limits", "PREIMPORT", "Process",
           "STRONGEST_FIRST", "Server", "docker_client", "resolve", "seccomp_filter",
           "server_argv", "start", "unavailable_reason"]

log = logging.getLogger("sandbox")

BY_NAME = {"process": Process, "bwrap": Bwrap, "docker": Docker}
STRONGEST_FIRST = ("docker", "bwrap", "process")
_SPECS = tuple(BY_NAME.values())


def resolve(backend):
    """A backend spec from "auto", a name, or a spec instance."""
    if isinstance(backend, _SPECS):
        return backend
    if backend == "auto":
        reasons = {}
        for name in STRONGEST_FIRST:
            spec = BY_NAME[name]()
            reasons[name] = unavailable_reason(spec)
            if reasons[name] is None:
                _log_auto_once(name, tuple((k, v) for k, v in reasons.items() if v))
                return spec
        raise BackendUnavailable(f"no backend can run here: {reasons}")
    if backend in BY_NAME:
        return BY_NAME[backend]()
    raise ValueError(f"unknown backend {backend!r}; use 'auto', one of {sorted(BY_NAME)}, "
                     "or an instance of sandbox.Process/Bwrap/Docker")


@functools.lru_cache(maxsize=None)
def _log_auto_once(name, skipped):
    if skipped:
        log.info("sandbox backend 'auto' uses %r; stronger ones not available: %s", name,
                 dict(skipped))
    else:
        log.info("sandbox backend 'auto' uses %r, the strongest", name)


@functools.lru_cache(maxsize=None)
def unavailable_reason(spec) -> str | None:
    """None if `spec` can run here, else why not (cached per process)."""
    if not isinstance(spec, _SPECS):
        raise TypeError(f"not a backend spec: {spec!r}")
    if sys.platform != "linux":
        return "sandbox backends need Linux"
    return spec.unavailable_reason()


def start(spec, limits: Limits, *, preimport: bool = True) -> Server:
    """Start a fork server in `spec`'s isolation; returns once it is ready to serve."""
    reason = unavailable_reason(spec)
    if reason is not None:
        raise BackendUnavailable(f"backend {spec.name!r} is unavailable: {reason}")
    modules = {"preimport": list(spec.preimport) if preimport else [],
               "preload": [list(p) for p in spec.preload] if preimport else []}
    return spec.start(limits, modules)
