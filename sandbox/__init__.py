"""sandbox: run untrusted code in isolation and get back an honest, structured result.

Pure host Python: no JAX, nothing from ptrain. Usable, testable and deployable on its own.

    import sandbox
    r = sandbox.run("print(1 + 1)", timeout_s=2, memory_mb=256)
    r.ok, r.stdout, r.backend              # True, b"2\\n", "bwrap"
    sandbox.run(command=["pytest", "-q"], files={"test_a.py": src}, backend="docker")
    with sandbox.Session() as s:           # multi-turn: the work dir persists across runs
        s.run("open('a', 'w').write('x')"); s.run(command=["cat", "a"]).stdout  # b"x"

Public API
  run(code=None, *, backend="auto", fork_server=True, **options) -> Result
      options: the fields of `Request` (per run: language, command, files, stdin, timeout_s,
      env, return_files, max_output_bytes, max_file_mb, max_open_files, max_files_bytes)
      and of `Limits` (per sandbox: memory_mb, max_processes, network), each declared once
      there with its default and meaning (`sandbox.request.OPTIONS`; the table in
      docs/sandbox.md is generated from them)
  Session(*, backend="auto", files=None, pinned=False, max_state_bytes=16 MiB,
          max_state_files=10000, **limits)
      .run(code=None, **options) -> Result (options: the fields of `Request`),
      .write_files(files), .read_files(max_bytes) -> dict[str, bytes], .listing(max_bytes)
      -> (files, other_files), .close(), .backend,
      .pinned, .sandbox: unpinned, the work dir lives on the host between runs and each run
      borrows a warm sandbox; pinned, it holds one sandbox (and /tmp) for its life
  warm(n, *, backend, **limits): start n idle sandboxes now
  live_sandboxes() -> list[Sandbox]: those run/warm/Session started that are alive (at most
      warm_sandboxes.MAX_SANDBOXES_PER_KEY idle or lent per settings, plus one per pinned
      session)
  Sandbox(backend, Limits(memory_mb, max_processes, network))
      .run(Request(...), keep_state=False) -> Result, .reset(), .close(), .alive,
      .processes(): one warm fork server in one backend's isolation (what run() keeps idle
      and lends, and a pinned Session holds; one run at a time per sandbox)
  Request(code=..., ...): the validated per-run arguments of run(); .to_dict() and
      Request.from_dict() for JSON (same text / *_b64 convention as Result)
  Process(), Bwrap(), Docker(image=...): backend specs; "auto" = strongest available
  pick_backend(backend="auto") -> spec: the spec of a name, a spec itself, or for "auto" the
      strongest available; unavailable_reason(spec) -> None | str; shutdown()
  Pool(workers, ...): a queue over `workers` worker processes (or Ray actors), each calling
      run() or a judge in its own warm sandboxes; judge, tools: services over run() (HTTP:
      sandbox.server). "Worker" means only a pool's process or actor.
  Errors: ValueError/TypeError (bad arguments), BackendUnavailable, SandboxError (the sandbox
  failed, not the program: safe to retry), WorkerLost (a pool's request lost its worker on
  every attempt). Nothing the program does raises.
  Deprecated aliases (removed in the next release; they warn): Worker (Sandbox), WorkerError
  (SandboxError), live_workers (live_sandboxes), resolve (pick_backend), Session.worker
  (.sandbox), the modules sandbox.worker (sandbox.sandbox) and sandbox.warm_workers
  (sandbox.warm_sandboxes).

Result fields (a frozen dataclass; `to_dict()` / `Result.from_dict()` round-trip via JSON)
  stdout, stderr: bytes       captured output, each capped at max_output_bytes; non-UTF-8
                              bytes survive (`stdout_text` / `stderr_text` decode them with
                              U+FFFD replacement)
  stdout_truncated, stderr_truncated: bool   more was written than kept
  exit_code: int | None       exit status of the main process; None if a signal ended it
  signal: int | None          the signal that ended the main process
  timed_out: bool             killed (SIGKILL) at timeout_s
  oom: bool                   hit the memory limit (cgroup OOM kill or MemoryError)
  duration_s: float           wall time of the main process
  backend: str                "process", "bwrap" or "docker": which one really ran it
  files: dict[str, bytes] | None   regular files left in the work dir (return_files=True)
  files_truncated: bool       some files were left out (over max_files_bytes)
  other_files: dict[str, str] | None   every other entry (directory, symlink, fifo, socket,
                              device) by path; entry_at(files, other_files, path) is what a
                              verifier must see at a path (None only for nothing at all)
  ok / status / describe()    exit 0 / "ok"|"error"|"timeout"|"oom"|"signal" / a sentence
  to_dict(): bytes that are UTF-8 go as text under their name ("stdout"), others as base64
  under name + "_b64" ("stdout_b64"); files as "files" (text) and "files_b64".

What each backend guarantees, and what it does not: docs/sandbox.md.
"""

from sandbox import judge, tools
from sandbox.backends import (BackendUnavailable, Bwrap, Docker, Process, pick_backend,
                              unavailable_reason)
from sandbox.pool import Pool, PoolFull, WorkerLost
from sandbox.request import Limits, Request
from sandbox.result import Result
from sandbox.sandbox import Sandbox, SandboxError
from sandbox.session import Session, run
from sandbox.warm_sandboxes import live_sandboxes, shutdown, warm
from sandbox.workdir import entry_at

__all__ = [
    "BackendUnavailable", "Bwrap", "Docker", "Limits", "Pool", "PoolFull", "Process", "Request",
    "Result", "Sandbox", "SandboxError", "Session", "WorkerLost", "judge", "live_sandboxes",
    "entry_at", "pick_backend", "run", "shutdown", "tools", "unavailable_reason", "warm",
]

# Deprecated names (a "worker" is now only a pool's process or Ray actor), for one release.
_RENAMED = {"Worker": "Sandbox", "WorkerError": "SandboxError", "live_workers": "live_sandboxes",
            "resolve": "pick_backend"}


def __getattr__(name):
    if name in ("worker", "warm_workers"):  # the deprecated modules (each warns on import)
        import importlib
        return importlib.import_module(f"sandbox.{name}")
    if name in _RENAMED:
        import warnings
        warnings.warn(f"sandbox.{name} is deprecated: use sandbox.{_RENAMED[name]}",
                      DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module 'sandbox' has no attribute {name!r}")
