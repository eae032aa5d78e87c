"""`run()` for one-off runs over warm sandboxes, and `Session` for multi-turn episodes.

Warm sandboxes are shared per (backend spec, limits): `run` and an unpinned Session's turns
borrow one that is idle (or start one) for the length of one run and hand it back emptied.
At most `MAX_SANDBOXES_PER_KEY` are lent or idle at once per key; a run that finds them all
busy waits for one to come back rather than start a sandbox more. Pinned sessions hold a
sandbox of their own for their whole life, outside that bound.
"""

import logging
import threading
import warnings
import weakref

from sandbox import backends, warm_sandboxes
from sandbox.request import Limits, Request, from_options, options_doc
from sandbox.result import Result
from sandbox.sandbox import Sandbox, SandboxError
from sandbox.workdir import WorkDir

log = logging.getLogger("sandbox")

def run(code: str | None = None, *, backend="auto", fork_server: bool = True,
        **options) -> Result:
    """Run `code` (in `language`: "python", the default, or "bash") or `command` (an argv
    list) in a fresh work dir holding `files`, in isolation, and return what happened.

    Never raises for anything the program does (see `Result`). Raises ValueError/TypeError
    for bad arguments, `BackendUnavailable` if `backend` cannot run here, and `SandboxError`
    if the sandbox itself failed (safe to retry).

    fork_server=True (the default) runs it through a warm fork server of `backend`: a fork
    of a pre-started interpreter, no interpreter or sandbox start-up per run. False starts a
    fresh sandbox (process tree / bwrap namespaces / container) for this run alone.

    options (the fields of `Request` and `Limits`, declared there once):
    """
    request, limits = from_options({"code": code, **options})
    spec = backends.pick_backend(backend)
    if not fork_server:
        with Sandbox(spec, limits, preimport=False) as sandbox:
            return sandbox.run(request)
    key = (spec, limits)
    sandbox = warm_sandboxes.borrow(key)
    try:
        result = sandbox.run(request)
    except BaseException as e:
        warm_sandboxes.hand_back(key, sandbox, keep=isinstance(e, ValueError))  # files it could not lay out
        raise
    warm_sandboxes.hand_back(key, sandbox)
    return result


class Session:
    """A sandbox for a multi-turn episode: one work dir that persists across runs.

    Each `run` is a fresh process (tree) under the same isolation and limits, killed whole
    when it ends; the work dir's files, directories, symlinks and fifos (with their modes and
    mtimes) stay until the session closes.

    Unpinned (the default), the session holds no sandbox: its work dir lives on the host
    between runs, and each run borrows any warm sandbox, lays the work dir in, runs, collects
    it back and hands the sandbox back emptied, so that many sessions share as many sandboxes as
    run at the same moment. /tmp, /dev/shm, SysV IPC and hard links between files do not
    persist. A work dir that grows past `max_state_bytes` of files or `max_state_files`
    entries (or cannot be read whole) stays in its sandbox instead, which the session then
    keeps for the rest of its life (`pinned` turns True, and the log says why): nothing is
    lost.

    pinned=True takes a sandbox for the whole session: /tmp, /dev/shm and SysV IPC persist
    too. Closing empties it and hands it back to the warm ones `run` uses.

    Either way, closing (or leaving the `with` block) removes everything, and if the caller
    dies, the sandboxes die with all in them.

        with sandbox.Session(backend="bwrap") as s:
            s.run("open('a.txt', 'w').write('hi')")
            s.run(command=["cat", "a.txt"]).stdout  # b"hi"
    """

    def __init__(self, *, backend="auto", files: dict | None = None, pinned: bool = False,
                 max_state_bytes: int = 16 << 20, max_state_files: int = 10_000, **limits):
        for name, value in (("max_state_bytes", max_state_bytes),
                            ("max_state_files", max_state_files)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        spec = backends.pick_backend(backend)
        self._key = (spec, Limits(**limits))
        self._caps = {"max_bytes": max_state_bytes, "max_files": max_state_files}
        self._lock = threading.Lock()  # one operation at a time: each moves the work dir
        self._workdir = WorkDir()
        self._held: list[Sandbox] = []  # the sandbox of a pinned session
        self._finalizer = weakref.finalize(self, _release, self._key, self._held)
        if pinned:
            self._held.append(warm_sandboxes.take_idle(self._key) or warm_sandboxes.new_sandbox(self._key))
        if files:
            self.write_files(files)

    @property
    def backend(self) -> str:
        return self._key[0].name

    @property
    def pinned(self) -> bool:
        """Whether the session holds a sandbox (asked for, or its work dir outgrew the caps)."""
        return bool(self._held)

    @property
    def sandbox(self) -> Sandbox | None:
        """The sandbox a pinned session holds; None for an unpinned one."""
        return self._held[0] if self._held else None

    @property
    def worker(self) -> Sandbox | None:
        """Deprecated alias of `sandbox` (a "worker" is now only a pool's process or actor)."""
        warnings.warn("Session.worker is deprecated: use Session.sandbox", DeprecationWarning,
                      stacklevel=2)
        return self.sandbox

    def run(self, code: str | None = None, **options) -> Result:
        """Like `sandbox.run`, in the session's work dir; `files` are added to it first.
        options (the fields of `Request`; the session's Limits are fixed at its start):
        """
        request, _ = from_options({"code": code, **options}, with_limits=False)
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
        return self.listing(max_bytes)[0]

    def listing(self, max_bytes: int = 16 << 20) -> tuple[dict[str, bytes], dict[str, str]]:
        """(`read_files`, the kind of every other entry: `Result.other_files`): all that is
        in the work dir, for a verifier (`sandbox.entry_at`)."""
        with self._lock:
            self._check_open()
            if self._held:
                files, others, truncated = self._held[0].read_files(max_bytes)
            else:
                files, others = self._workdir.files(), self._workdir.others()
                truncated = sum(map(len, files.values())) > max_bytes
        if truncated:
            raise ValueError(f"the work dir holds more than max_bytes={max_bytes}; "
                             "raise it to read everything")
        return files, others

    def close(self) -> None:
        """Remove the work dir (and empty and hand back a pinned session's sandbox)."""
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
            raise SandboxError("the session is closed")

    def _unpinned(self, step):
        """One operation on a borrowed sandbox: `step(sandbox)` -> (result, new WorkDir or
        None if the work dir stayed in the sandbox, which the session then keeps)."""
        sandbox = warm_sandboxes.borrow(self._key)
        try:
            result, workdir = step(sandbox)
        except BaseException as e:
            # The work dir is unchanged; a sandbox that merely refused the files is clean.
            warm_sandboxes.hand_back(self._key, sandbox, keep=isinstance(e, ValueError))
            raise
        if workdir is None:
            log.warning("sandbox: a session's work dir outgrew what is collected between "
                        "runs; the session keeps its %s sandbox from now on", sandbox.backend)
            warm_sandboxes.unlend(self._key)
            self._held.append(sandbox)
        else:
            warm_sandboxes.hand_back(self._key, sandbox)
        self._workdir = workdir
        return result


def _release(key, held: list[Sandbox]) -> None:
    """A closed session's sandbox, if it holds one: emptied, then warm again for others (or
    closed)."""
    for sandbox in held:
        try:
            sandbox.reset()
        except SandboxError:
            sandbox.close()
            continue
        warm_sandboxes.put_idle(key, sandbox)
    held.clear()


run.__doc__ += options_doc()
Session.run.__doc__ += options_doc(indent="          ")
Session.__doc__ += ("\n    Limits (fixed for the session's life, the fields of `Limits`):\n"
                    + options_doc(Limits.__dataclass_fields__.values(), "      "))
