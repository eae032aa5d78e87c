"""The outcome of one sandboxed run, as plain data that survives JSON.

Everything a program can do ends up in these fields, never in an exception: a timeout, an
out-of-memory kill, a signal, output that is not UTF-8, output that was too long.
"""

import base64
import dataclasses
import signal as signal_lib

_BYTES_FIELDS = ("stdout", "stderr")


@dataclasses.dataclass(frozen=True)
class Result:
    """What happened when the sandbox ran a program.

    Attributes:
      stdout, stderr: the captured bytes, at most `max_output_bytes` each (kept from the
        start); bytes that are not UTF-8 are kept as they are.
      stdout_truncated, stderr_truncated: the program wrote more than was kept.
      exit_code: the exit status of the main process, or None if a signal ended it.
      signal: the number of the signal that ended the main process, or None.
      timed_out: the run hit `timeout_s` and was killed (SIGKILL, so `signal` is 9).
      oom: the run hit its memory limit (killed by the cgroup OOM killer, or an uncaught
        MemoryError under an address-space rlimit).
      duration_s: wall time from the start of the program to the end of its main process.
      backend: the backend that ran it: "process", "bwrap" or "docker".
      files: the regular files left in the work dir (path relative to it -> bytes) when
        `return_files=True` was asked, else None. Symlinks and special files are not
        followed or returned.
      files_truncated: some files were left out because they passed `max_files_bytes`.
      other_files: with `files`, every other entry of the work dir (path -> "directory",
        "symlink", "fifo", "socket" or "device"): what a verifier must see besides the
        regular files (`sandbox.entry_at`).
    """

    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    oom: bool = False
    duration_s: float = 0.0
    backend: str = ""
    files: dict[str, bytes] | None = None
    files_truncated: bool = False
    other_files: dict[str, str] | None = None

    @property
    def ok(self) -> bool:
        """The program ran to the end and exited with status 0."""
        return self.exit_code == 0 and not self.timed_out and not self.oom

    @property
    def status(self) -> str:
        """One word: "ok", "error" (non-zero exit), "timeout", "oom" or "signal"."""
        if self.timed_out:
            return "timeout"
        if self.oom:
            return "oom"
        if self.signal is not None:
            return "signal"
        return "ok" if self.exit_code == 0 else "error"

    @property
    def stdout_text(self) -> str:
        """stdout decoded as UTF-8; undecodable bytes become U+FFFD."""
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def stderr_text(self) -> str:
        """stderr decoded as UTF-8; undecodable bytes become U+FFFD."""
        return self.stderr.decode("utf-8", errors="replace")

    def describe(self) -> str:
        """A short human-readable verdict, e.g. "killed by SIGSEGV" or "timed out after 2.0 s"."""
        if self.timed_out:
            return f"timed out after {self.duration_s:.1f} s"
        if self.oom:
            return "ran out of memory"
        if self.signal is not None:
            try:
                name = signal_lib.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"killed by {name}"
        return f"exited with status {self.exit_code}"

    def to_dict(self) -> dict:
        """A JSON-able dict. Bytes that are valid UTF-8 go under their own name as text
        (`stdout`); other bytes go base64-encoded under the name plus `_b64` (`stdout_b64`).
        Files likewise go to `files` (text) or `files_b64`."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _BYTES_FIELDS:
                out.update(_encode(field.name, value))
            elif field.name == "files":
                if value is not None:
                    out["files"], out["files_b64"] = {}, {}
                    for path, data in value.items():
                        for key, enc in _encode(path, data).items():
                            (out["files_b64"] if key != path else out["files"])[path] = enc
                else:
                    out["files"] = None
            else:
                out[field.name] = value
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Result":
        """The inverse of `to_dict`. Unknown keys are an error (they mean a version skew)."""
        d = dict(d)
        kwargs = {}
        for name in _BYTES_FIELDS:
            kwargs[name] = _decode(d, name)
        files, files_b64 = d.pop("files", None), d.pop("files_b64", None)
        if files is not None or files_b64:
            kwargs["files"] = {p: t.encode("utf-8") for p, t in (files or {}).items()}
            kwargs["files"].update(
                {p: base64.b64decode(b) for p, b in (files_b64 or {}).items()})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"Result.from_dict: unknown keys {sorted(unknown)}; "
                             f"expected some of {sorted(names)} (and *_b64 variants)")
        kwargs.update({k: v for k, v in d.items() if k not in kwargs})
        return cls(**kwargs)


def _encode(name: str, data: bytes) -> dict:
    try:
        return {name: data.decode("utf-8")}
    except UnicodeDecodeError:
        return {f"{name}_b64": base64.b64encode(data).decode("ascii")}


def _decode(d: dict, name: str) -> bytes:
    text, b64 = d.pop(name, None), d.pop(f"{name}_b64", None)
    if text is not None and b64 is not None:
        raise ValueError(f"Result.from_dict: both {name!r} and {name + '_b64'!r} given")
    if b64 is not None:
        return base64.b64decode(b64)
    return (text or "").encode("utf-8")
