"""Isolation backends: how to start a fork server (sandbox/forkserver.py) inside each.

One class per backend (process.py, bwrap.py, docker.py), a frozen dataclass spec that owns
its availability check (`unavailable_reason()`), its start (`start(limits, modules)`, which
returns that backend's `Server` handle) and what the fork server resets after every run
(`reset()`); base.py holds what they share.

- `Process()`: a plain child process. Not a security boundary.
- `Bwrap()`: bubblewrap namespaces, an unprivileged uid of its own per sandbox.
- `Docker()`: a warm container per sandbox.

`pick_backend("auto")` picks the strongest available: docker, then bwrap, then process, but
never process for a root caller (`auto_refusal`: as root it is no boundary at all, not even
for the judge's verdict); `backend="process"` still asks for it by name.
`backend="bwrap"` and `backend=Bwrap()` mean the same; pass an instance to change its
settings (`Docker(image="my-image:tag")`). Every `backend=` argument of the package goes
through `pick_backend`, the one place a backend's name becomes its spec.
"""

import functools
import logging
import os
import sys

from sandbox.backends.base import BackendUnavailable, Server, server_argv
from sandbox.backends.bwrap import Bwrap, seccomp_filter
from sandbox.backends.docker import Docker, docker_client
from sandbox.backends.preimport import PREIMPORT
from sandbox.backends.process import Process
from sandbox.request import Limits

__all__ = ["BackendUnavailable", "Bwrap", "Docker", "Limits", "PREIMPORT", "Process",
           "STRONGEST_FIRST", "Server", "auto_refusal", "docker_client", "pick_backend",
           "seccomp_filter", "server_argv", "start", "unavailable_reason"]

log = logging.getLogger("sandbox")

STRONGEST_FIRST = (Docker, Bwrap, Process)  # the spec classes, as "auto" tries them
_SPECS = STRONGEST_FIRST


def pick_backend(backend="auto"):
    """The backend spec to run on: `backend` itself if it is a spec (`Process()`, `Bwrap()`,
    `Docker(image=...)`), a default one of that name ("process", "bwrap", "docker"), or for
    "auto" the strongest that can run here (docker, then bwrap, then process)."""
    if isinstance(backend, _SPECS):
        return backend
    if backend == "auto":
        return strongest([spec_class() for spec_class in STRONGEST_FIRST])
    for spec_class in _SPECS:
        if backend == spec_class.name:
            return spec_class()
    raise ValueError(f"unknown backend {backend!r}; use 'auto', one of "
                     f"{sorted(c.name for c in _SPECS)}, or an instance of "
                     "sandbox.Process/Bwrap/Docker")


def strongest(specs, *, what: str = "") -> object:
    """The first of `specs` (strongest first) that "auto" may pick and that runs here, logged
    once with the reasons of those skipped; BackendUnavailable naming every reason if none
    does. `what`: the runs they are for, in the messages (e.g. "CAD")."""
    reasons = {}
    for spec in specs:
        reasons[spec.name] = auto_refusal(spec) or unavailable_reason(spec)
        if reasons[spec.name] is None:
            _log_auto_once(spec.name, tuple((k, v) for k, v in reasons.items() if v))
            return spec
    raise BackendUnavailable(f"no backend can run {what + ' ' if what else ''}here: {reasons}")


def __getattr__(name):
    """Deprecated names, for one release: `resolve` (now `pick_backend`: "resolve" is
    ptrain.config's word for turning a config into settings) and `BY_NAME`."""
    import warnings
    if name == "resolve":
        warnings.warn("sandbox.backends.resolve is deprecated: use pick_backend",
                      DeprecationWarning, stacklevel=2)
        return pick_backend
    if name == "BY_NAME":
        warnings.warn("sandbox.backends.BY_NAME is deprecated: pick_backend(name) makes the "
                      "spec of a name", DeprecationWarning, stacklevel=2)
        return {c.name: c for c in _SPECS}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def auto_refusal(spec) -> str | None:
    """Why "auto" never picks `spec` on this machine, though it may run here; else None. A
    root caller's `process` runs are root on the host: they can read the judge's signing key
    and tests from its trusted process's memory (ptrace, /proc/<pid>/mem) and forge a verdict
    (docs/sandbox.md). Asked for by name, it still runs."""
    if isinstance(spec, Process) and os.geteuid() == 0:
        return ("not picked by 'auto' for a root caller: runs would be root on the host and "
                "could forge the judge's verdicts (install bubblewrap or docker: bash "
                "sandbox/setup_host.sh; or pass backend='process' to accept that)")
    return None


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
