"""A sandbox: one fork server in one backend's isolation, serving one run at a time.

`sandbox.run` keeps idle sandboxes warm and `sandbox.Session` owns one; a pool runs many. The
sandbox turns what the fork server reports into a `Result` and adds what only the host can see
(OOM kills counted by the cgroup). If the server dies or stops answering, the sandbox is
closed and `SandboxError` raised: that is the sandbox failing, not the program, and the one
case a caller may retry.
"""

import json
import logging
import struct
import threading
import weakref

from sandbox import backends, forkserver
from sandbox.request import Request
from sandbox.result import Result
from sandbox.workdir import WorkDir

log = logging.getLogger("sandbox")

# The fork server enforces each timeout itself; the host gives up on it only after this much
# more (a wedged server, a stopped container).
_WATCHDOG_GRACE_S = 10.0


class SandboxError(RuntimeError):
    """The sandbox died or stopped answering (not something the program did, unless
    the backend is `process`, which is not a security boundary). Safe to retry."""


class Sandbox:
    """A fork server inside `backend` with sandbox-wide `limits`.

    preimport=False starts a bare interpreter (a cold, one-off sandbox). `runs` counts the
    runs served (a pool may recycle sandboxes by it)."""

    def __init__(self, backend="auto", limits: backends.Limits | None = None, *,
                 preimport: bool = True):
        self.spec = backends.pick_backend(backend)
        self.limits = limits or backends.Limits()
        self._lock = threading.Lock()
        self._handle = backends.start(self.spec, self.limits, preimport=preimport)
        # Stops the server if the sandbox is dropped without close() (it would also stop on
        # its own once the socket closes, but the cgroups and locks are ours to release).
        self._finalizer = weakref.finalize(self, self._handle.stop)
        self.runs = 0

    @property
    def backend(self) -> str:
        return self.spec.name

    @property
    def alive(self) -> bool:
        return self._handle is not None

    def run(self, request: Request, *, keep_state: bool = False) -> Result:
        """Run one request. Raises SandboxError if the sandbox failed, ValueError if the files
        cannot be laid out; everything the program does comes back in the Result.

        Afterwards every process of the run is killed, and the work dir, /tmp, /dev/shm and
        SysV IPC objects are emptied, unless keep_state=True (a pinned session's turn: then
        only the processes go; `reset()` empties the rest)."""
        reply, blobs, oom = self._send("run", *request.to_wire(), _run_header(request, {
            "keep_state": keep_state}), request.timeout_s + _WATCHDOG_GRACE_S)
        return _to_result(reply, blobs, self.backend, oom)

    def run_in(self, workdir: WorkDir, request: Request, *, max_bytes: int,
               max_files: int) -> tuple[Result, WorkDir | None]:
        """Run `request` in `workdir` (laid into the empty work dir first, the request's files
        on top) and collect the work dir back afterwards (an unpinned session's turn). Returns
        the Result and the new WorkDir, or None if the work dir passed `max_bytes` of files or
        `max_files` entries (or could not be read whole): then it stays in this sandbox, as
        after keep_state=True, and the caller holds on to the sandbox. Raises as `run`."""
        wire, parts = _in_workdir(workdir, *request.to_wire(), n_stdin=request.stdin is not None)
        collect = {"max_bytes": max_bytes, "max_files": max_files}
        reply, blobs, oom = self._send("run", wire, parts, _run_header(request, {
            "collect": collect}), request.timeout_s + _WATCHDOG_GRACE_S)
        state = _take_state(reply, blobs)
        return _to_result(reply, blobs, self.backend, oom), state

    def reset(self) -> None:
        """Empty the work dir, /tmp, /dev/shm and SysV IPC, as after a run without
        keep_state; a sandbox that cannot be cleaned is closed (SandboxError)."""
        with self._lock:
            clean = self._call({"op": "reset"}, b"", _WATCHDOG_GRACE_S)[0]["clean"]
        if not clean:
            self.close()
            raise SandboxError(f"the {self.backend} sandbox could not be cleaned; closed it")

    def put_files(self, files: dict[str, bytes]) -> None:
        """Write files into the work dir (pinned sessions); the work dir is kept."""
        self._send("put", _put_wire(files), list(files.values()), {"keep_state": True},
                   _WATCHDOG_GRACE_S)

    def put_in(self, workdir: WorkDir, files: dict[str, bytes], *, max_bytes: int,
               max_files: int) -> WorkDir | None:
        """Lay in `workdir`, write `files` over it, and collect it back (as `run_in`, with
        nothing run)."""
        wire, parts = _in_workdir(workdir, _put_wire(files), list(files.values()), n_stdin=0)
        reply, blobs, _ = self._send("put", wire, parts, {
            "collect": {"max_bytes": max_bytes, "max_files": max_files}}, _WATCHDOG_GRACE_S)
        return _take_state(reply, blobs)

    def read_files(self, max_bytes: int) -> tuple[dict[str, bytes], dict[str, str], bool]:
        """The regular files in the work dir, the kinds of its other entries (`Result.
        other_files`), and whether some passed `max_bytes`."""
        with self._lock:
            reply, blobs = self._call({"op": "files", "max_bytes": max_bytes}, b"",
                                      _WATCHDOG_GRACE_S)
        return (dict(zip(reply["files"], blobs)), dict(reply["other_files"]),
                reply["files_truncated"])

    def processes(self) -> list[int]:
        """Host pids of every process in the sandbox besides the fork server and the child it
        keeps parked for the next run: what a run left behind (for checks)."""
        with self._lock:
            parked = self._call({"op": "status"}, b"", _WATCHDOG_GRACE_S)[0]["parked"]
            pids = self._live_handle().processes()
        return [p for p in pids if _namespace_pid(p) != parked]

    @property
    def server_pid(self) -> int | None:
        return self._handle.server_pid if self._handle else None

    def close(self) -> None:
        """Stop the server and remove all it made (processes, dirs, cgroups); idempotent."""
        self._handle = None
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _live_handle(self):
        if self._handle is None:
            raise SandboxError(f"the {self.backend} sandbox is closed")
        return self._handle

    def _send(self, op: str, wire: dict, parts: list[bytes], header: dict, timeout_s: float):
        """A run or put: the JSON part of the request and its raw bytes, as the fork server's
        child reads them (forkserver.lay_in). Returns the reply, its blobs, and whether the
        cgroup counted an OOM kill meanwhile (None where it cannot know)."""
        body = json.dumps(wire, separators=(",", ":")).encode()
        payload = b"".join([struct.pack(">Q", len(body)), body, *parts])
        with self._lock:
            handle = self._live_handle()
            oom_before = handle.oom_kills()
            reply, blobs = self._call({"op": op, "payload": len(payload), **header}, payload,
                                      timeout_s)
            oom_after = handle.oom_kills()
            handle.after_run()
            self.runs += op == "run"
        if not reply.pop("clean", True):
            log.warning("sandbox: the %s sandbox could not clean up after a run; closing it",
                        self.backend)
            self.close()
        if "error" in reply:
            if reply["error"].startswith("sandbox: "):  # the sandbox failed, not the request
                self.close()
                raise SandboxError(f"the {self.backend} sandbox failed: {reply['error'][9:]}")
            raise ValueError(reply["error"])
        oom = None if oom_before is None or oom_after is None else oom_after > oom_before
        return reply, blobs, oom

    def _call(self, header: dict, payload: bytes, timeout_s: float):
        """Send a header frame and its payload; returns the reply header and its blobs."""
        handle = self._live_handle()
        try:
            handle.sock.settimeout(timeout_s)
            handle.sock.sendall(forkserver.frame(header) + payload)
            reply = forkserver.recv_frame(handle.sock)
            blobs = [_recv_exactly(handle.sock, n) for n in (reply or {}).get("blobs", [])]
        except (OSError, EOFError, ValueError) as e:
            reply, why = None, f"{type(e).__name__}: {e}"
        else:
            why = "it closed the connection"
        if reply is None:
            self._handle = None
            self._finalizer.detach()
            handle.kill()
            raise SandboxError(f"the {self.backend} sandbox failed ({why})")
        return reply, blobs


def _recv_exactly(sock, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the sandbox closed the connection inside a reply")
        got += k
    return bytes(buf)


def _namespace_pid(pid: int) -> int | None:
    """`pid` as its own PID namespace sees it (the innermost NSpid)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except OSError:
        pass
    return None


def _run_header(request: Request, extra: dict) -> dict:
    return {"timeout_s": request.timeout_s, "max_output_bytes": request.max_output_bytes,
            "return_files": request.return_files,
            "max_files_bytes": request.max_files_bytes, **extra}


def _put_wire(files: dict[str, bytes]) -> dict:
    return {"put": True, "stdin": None, "files": [[p, len(d)] for p, d in files.items()]}


def _in_workdir(workdir: WorkDir, wire: dict, parts: list[bytes], *, n_stdin: int):
    """A run's or put's `wire` and raw `parts` with `workdir` laid in first: its entries as
    `state`, its pending files ahead of the request's; the raw bytes go stdin, state, files."""
    entries, pending, state_parts = workdir.to_wire()
    wire = {**wire, "state": entries, "files": pending + wire["files"]}
    return wire, parts[:n_stdin] + state_parts + parts[n_stdin:]


def _take_state(reply: dict, blobs: list[bytes]) -> WorkDir | None:
    """The collected work dir (its blob is the last), or None if the sandbox kept it."""
    if "state" not in reply:
        log.info("sandbox: a session's work dir stays in its sandbox: %s", reply["state_kept"])
        return None
    if reply.get("state_skipped"):
        log.warning("sandbox: a session's work dir lost what cannot be carried between runs "
                    "(sockets, device nodes): %s", ", ".join(map(str, reply["state_skipped"])))
    return WorkDir.from_reply(reply["state"], blobs.pop())


def _to_result(reply: dict, blobs: list[bytes], backend: str, oom: bool | None) -> Result:
    stdout, stderr = blobs[0], blobs[1]
    files = dict(zip(reply["files"], blobs[2:])) if "files" in reply else None
    oom = bool(oom)
    if not oom and not reply["timed_out"] and reply["exit_code"] not in (None, 0):
        # Under an address-space rlimit (no cgroup) Python fails with MemoryError instead.
        lines = stderr.rstrip().rsplit(b"\n", 1)
        oom = bool(lines) and lines[-1].startswith(b"MemoryError")
    return Result(
        stdout=stdout, stderr=stderr, stdout_truncated=reply["stdout_truncated"],
        stderr_truncated=reply["stderr_truncated"], exit_code=reply["exit_code"],
        signal=reply["signal"], timed_out=reply["timed_out"], oom=oom,
        duration_s=reply["duration_s"], backend=backend, files=files,
        files_truncated=reply.get("files_truncated", False),
        other_files=dict(reply["other_files"]) if "other_files" in reply else None)
