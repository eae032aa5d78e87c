"""Deprecated: `sandbox.worker` is now `sandbox.sandbox` (removed in the next release).

`Worker` is `sandbox.Sandbox` and `WorkerError` is `sandbox.SandboxError`: in sandbox/ a
"worker" is now only one of a `Pool`'s processes or Ray actors.
"""

import warnings

from sandbox import sandbox as _sandbox

_RENAMED = {"Worker": "Sandbox", "WorkerError": "SandboxError"}


def __getattr__(name):
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(f"sandbox.worker.{name} is deprecated: use sandbox.{new}",
                      DeprecationWarning, stacklevel=2)
        return getattr(_sandbox, new)
    return getattr(_sandbox, name)
