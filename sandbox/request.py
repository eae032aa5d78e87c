"""What to run and under which per-run limits: validated once, on the caller's side.

A bad argument raises ValueError/TypeError here, before anything starts, with what to fix.
"""

import base64
import dataclasses
import math
import posixpath
from collections.abc import Mapping, Sequence

LANGUAGES = ("python", "bash")


def option(default=dataclasses.MISSING, *, doc: str, json: tuple, cap: str | None = None,
           default_factory=dataclasses.MISSING):
    """A run option: a dataclass field of `Request` (per run) or `backends.Limits` (per
    sandbox), declared once. `doc` says what it does; `json` are the JSON types a service
    accepts for it; `cap` names the server's configured maximum for it (sandbox.server).
    `sandbox.run`, `Session`, the server and docs/sandbox.md all derive from these."""
    meta = {"doc": doc, "json": json, "cap": cap}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


_NUM = (int, float)


@dataclasses.dataclass(frozen=True)
class Request:
    """One run. `code` in `language`, or `command` (an argv list), never both."""

    code: str | None = option(None, doc="the program's source", json=(str,))
    language: str | None = option(None, doc='"python" (the default with `code`) or "bash"',
                                  json=(str,))
    command: tuple[str, ...] | None = option(
        None, doc="an argv list to execute instead of `code`", json=(list,))
    files: Mapping[str, bytes] = option(
        doc="relative path -> str or bytes, laid into the work dir first", json=(dict,),
        default_factory=dict)
    stdin: bytes | None = option(None, doc="the program's standard input", json=(str,))
    timeout_s: float = option(10.0, doc="wall-clock limit; the run is killed at it",
                              json=_NUM, cap="max_timeout_s")
    env: Mapping[str, str] = option(doc="environment variables added for the run",
                                    json=(dict,), default_factory=dict)
    return_files: bool = option(False, doc="return the work dir's regular files",
                                json=(bool,))
    max_output_bytes: int = option(1 << 20, doc="bytes kept of stdout and of stderr",
                                   json=(int,), cap="max_output_bytes")
    max_file_mb: int = option(64, doc="largest file the run may write (RLIMIT_FSIZE)",
                              json=(int,), cap="max_file_mb")
    max_open_files: int = option(256, doc="open files per process (RLIMIT_NOFILE)",
                                 json=(int,), cap="max_open_files")
    max_files_bytes: int = option(16 << 20, doc="bytes of files returned (return_files)",
                                  json=(int,), cap="max_files_bytes")

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if (self.code is None) == (self.command is None):
            raise ValueError("give exactly one of `code` (with `language`) or `command` "
                             "(an argv list such as ['pytest', '-q'])")
        if self.code is not None:
            if not isinstance(self.code, str):
                raise TypeError(f"`code` must be a str, got {type(self.code).__name__}")
            set_("language", self.language or "python")
            if self.language not in LANGUAGES:
                raise ValueError(f"language {self.language!r} is not supported; use one of "
                                 f"{LANGUAGES}, or pass an argv list as `command`")
        else:
            if self.language is not None:
                raise ValueError("`language` goes with `code`; a `command` is run as given")
            if isinstance(self.command, (str, bytes)) or not isinstance(self.command, Sequence):
                raise TypeError("`command` must be a list of strings (argv), e.g. "
                                "['bash', '-c', 'ls']; for a shell line use code=..., "
                                "language='bash'")
            if not self.command or not all(isinstance(a, str) for a in self.command):
                raise ValueError(f"`command` must be a non-empty list of str, got "
                                 f"{self.command!r}")
            set_("command", tuple(self.command))
        set_("files", _check_files(self.files))
        if isinstance(self.stdin, str):
            set_("stdin", self.stdin.encode("utf-8"))
        elif self.stdin is not None and not isinstance(self.stdin, bytes):
            raise TypeError(f"`stdin` must be str, bytes or None, got "
                            f"{type(self.stdin).__name__}")
        if (not isinstance(self.timeout_s, (int, float)) or not math.isfinite(self.timeout_s)
                or self.timeout_s <= 0):
            raise ValueError(f"`timeout_s` must be a positive number, got {self.timeout_s!r}")
        set_("env", _check_env(self.env))
        for name in ("max_output_bytes", "max_file_mb", "max_open_files", "max_files_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}")
        if self.max_open_files < 16:
            raise ValueError("`max_open_files` below 16 leaves no room for the interpreter")

    def to_dict(self) -> dict:
        """A JSON-able dict, in the convention of `Result.to_dict`: file contents and stdin
        that are UTF-8 go as text (`files`, `stdin`), others base64 (`files_b64`,
        `stdin_b64`)."""
        d = dataclasses.asdict(self)
        d["command"] = list(self.command) if self.command is not None else None
        d["env"] = dict(self.env)
        d["files"], d["files_b64"] = {}, {}
        for path, data in self.files.items():
            try:
                d["files"][path] = data.decode("utf-8")
            except UnicodeDecodeError:
                d["files_b64"][path] = base64.b64encode(data).decode("ascii")
        if self.stdin is not None:
            try:
                d["stdin"] = self.stdin.decode("utf-8")
            except UnicodeDecodeError:
                d["stdin"], d["stdin_b64"] = None, base64.b64encode(self.stdin).decode()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Request":
        """The inverse of `to_dict`; what a service builds from a JSON body. Unknown keys
        and bad values are errors that say what to fix."""
        if not isinstance(d, dict):
            raise TypeError(f"a request must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        files = dict(d.pop("files", None) or {})
        for path, b64 in (d.pop("files_b64", None) or {}).items():
            files[path] = _b64(b64, f"files_b64[{path!r}]")
        stdin_b64 = d.pop("stdin_b64", None)
        if stdin_b64 is not None:
            if d.get("stdin") is not None:
                raise ValueError("give `stdin` or `stdin_b64`, not both")
            d["stdin"] = _b64(stdin_b64, "stdin_b64")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown request keys {sorted(unknown)}; expected some of "
                             f"{sorted(names | {'files_b64', 'stdin_b64'})}")
        return cls(files=files, **d)

    def to_wire(self) -> tuple[dict, list[bytes]]:
        """What a sandbox is sent: a JSON-able dict (sizes in place of stdin and file
        contents) and the raw bytes it announces, in order: stdin, then the files."""
        d = dataclasses.asdict(self)
        d["command"] = list(self.command) if self.command is not None else None
        d["files"] = [[path, len(data)] for path, data in self.files.items()]
        d["env"] = dict(self.env)
        d["stdin"] = None if self.stdin is None else len(self.stdin)
        return d, ([self.stdin] if self.stdin is not None else []) + list(self.files.values())


@dataclasses.dataclass(frozen=True)
class Limits:
    """Limits fixed for the life of a sandbox (per-run limits live in the Request)."""
    memory_mb: int = option(512, doc="memory of the run (cgroup, else RLIMIT_AS)",
                            json=(int,), cap="max_memory_mb")
    max_processes: int = option(64, doc="processes and threads of the run at once",
                                json=(int,), cap="max_processes")
    network: bool = option(False, doc="keep the host's network (else none)", json=(bool,),
                           cap="allow_network")

    def __post_init__(self):
        if not isinstance(self.memory_mb, int) or self.memory_mb < 16:
            raise ValueError(f"`memory_mb` must be an int >= 16, got {self.memory_mb!r}")
        if not isinstance(self.max_processes, int) or self.max_processes < 1:
            raise ValueError(f"`max_processes` must be an int >= 1, got "
                             f"{self.max_processes!r}")
        if not isinstance(self.network, bool):
            raise TypeError(f"`network` must be a bool, got {self.network!r}")


OPTIONS = dataclasses.fields(Request) + dataclasses.fields(Limits)
_DICTS = ("files", "env")  # None means empty, as `sandbox.run(files=None)` always allowed


def from_options(options: dict, *, with_limits: bool = True) -> tuple[Request, Limits | None]:
    """The Request (and, `with_limits`, the Limits) that keyword options of `sandbox.run` /
    `Session.run` describe; an unknown option is a TypeError listing the known ones."""
    request_names = {f.name for f in dataclasses.fields(Request)}
    limit_names = {f.name for f in dataclasses.fields(Limits)} if with_limits else set()
    unknown = set(options) - request_names - limit_names
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; the options are "
                        f"{sorted(request_names | limit_names)} (sandbox.request.OPTIONS)")
    per_run = {k: v for k, v in options.items()
               if k in request_names and not (k in _DICTS and v is None)}
    limits = Limits(**{k: v for k, v in options.items() if k in limit_names})
    return Request(**per_run), (limits if with_limits else None)


def options_doc(fields=OPTIONS, indent: str = "      ") -> str:
    """One line per option: `name=default: what it does` (for docstrings)."""
    lines = []
    for f in fields:
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"{indent}{f.name}={default!r}: {f.metadata['doc']}")
    return "\n".join(lines)


def options_table() -> str:
    """The options as the markdown table of docs/sandbox.md (a test keeps it in step)."""
    rows = ["| option | default | per | server maximum | what it does |",
            "|---|---|---|---|---|"]
    for f in OPTIONS:
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        per = "run" if f in dataclasses.fields(Request) else "sandbox"
        cap = f"`{f.metadata['cap']}`" if f.metadata["cap"] else ""
        rows.append(f"| `{f.name}` | `{default!r}` | {per} | {cap} | {f.metadata['doc']} |")
    return "\n".join(rows)


def _b64(text, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"`{what}` is not valid base64: {e}") from None


def check_path(path: str) -> str:
    """A relative path inside the work dir, normalised; anything else is a ValueError."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"file path must be a non-empty str without NUL, got {path!r}")
    norm = posixpath.normpath(path)
    if posixpath.isabs(path) or norm == "." or norm.split("/")[0] == "..":
        raise ValueError(f"file path {path!r} must be relative and stay inside the work dir")
    return norm


def _check_files(files) -> dict[str, bytes]:
    if not isinstance(files, Mapping):
        raise TypeError(f"`files` must map relative paths to str or bytes, got "
                        f"{type(files).__name__}")
    out = {}
    for path, content in files.items():
        norm = check_path(path)
        if isinstance(content, str):
            content = content.encode("utf-8")
        elif not isinstance(content, bytes):
            raise TypeError(f"content of file {path!r} must be str or bytes, got "
                            f"{type(content).__name__}")
        if norm in out:
            raise ValueError(f"file path {path!r} given twice (after normalisation)")
        out[norm] = content
    for path in out:  # "a" as a file and "a/b" below it cannot both exist.
        parent = posixpath.dirname(path)
        while parent:
            if parent in out:
                raise ValueError(f"{parent!r} is given as a file and as a directory of "
                                 f"{path!r}")
            parent = posixpath.dirname(parent)
    return out


def _check_env(env) -> dict[str, str]:
    if not isinstance(env, Mapping):
        raise TypeError(f"`env` must be a mapping of str to str, got {type(env).__name__}")
    for key, value in env.items():
        if (not isinstance(key, str) or not isinstance(value, str) or not key
                or "=" in key or "\0" in key + value):
            raise ValueError(f"bad environment entry {key!r}={value!r}: names and values "
                             "must be str, names non-empty without '=', no NUL anywhere")
    return dict(env)
