"""A persistent shell in a task's container: what the agent types into.

One interactive bash (sh where the image has no bash) on a pseudo-terminal, started with
`docker exec` (bwrap: `nsenter`; `Container.open_terminal`, `bwrap.Box.open_terminal`): `cd`, exported variables, functions and background jobs survive from one
command to the next. Each command goes in as one line of printable ASCII (its bytes are
escaped, so a control character in it cannot signal the terminal), is `eval`ed with stdin from
/dev/null (a command that waits for input ends instead of hanging), and is followed by a
marker with a fresh nonce and the exit status. The terminal has no echo, no output processing
and no line-length limit (`stty -echo -icanon -opost`).

A command still running at its timeout gets Ctrl-C, like a terminal; if the shell does not
come back, its foreground job is killed, and if even that fails the shell is restarted (the
result says so: its state is lost).
"""

import dataclasses
import secrets
import time

from sandbox.terminal.container import Container
from sandbox.terminal.exec_output import CappedBuffer

_GRACE_S = 5.0
_START_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class ShellResult:
    output: str            # what the terminal showed (stdout and stderr), capped
    exit_code: int | None  # None when the command was cut or the shell was lost
    timed_out: bool
    truncated: bool
    duration_s: float
    restarted: bool = False  # the shell was started anew: cwd, variables and jobs are gone


def _bash_quote(command: str) -> str:
    """`command` as a bash $'...' word of printable ASCII."""
    out = []
    for b in command.encode("utf-8", "surrogateescape"):
        c = chr(b)
        out.append(c if 0x20 <= b < 0x7f and c not in "\\'" else f"\\x{b:02x}")
    return "$'" + "".join(out) + "'"


def _sh_quote(command: str) -> str:
    """`command` for a POSIX sh: printf's octal escapes, decoded by printf itself."""
    body = "".join(c if c.isascii() and c.isalnum() else f"\\{b:03o}"
                   for b in command.encode("utf-8", "surrogateescape") for c in [chr(b)])
    return f"\"$(printf '{body}_')\""  # the "_" keeps trailing newlines; removed below


class Shell:
    """`run(command, timeout_s)` in one long-lived shell session of `container`."""

    def __init__(self, container: Container, *, user: str | None = None, env=None,
                 workdir: str | None = None, max_output_bytes: int = 32 << 10):
        self.container = container
        self.user, self.env, self.workdir = user, dict(env or {}), workdir
        self.max_output_bytes = max_output_bytes
        self._sock = None
        self._pending = b""
        self._start()

    def _start(self) -> None:
        env = {"TERM": "dumb", **self.env}
        argv = ["/bin/sh", "-c", "if command -v bash >/dev/null 2>&1; then exec bash "
                "--noediting -i; else exec sh -i; fi"]
        self._sock, self._wrapper = self.container.open_terminal(
            argv, user=self.user, env=env, workdir=self.workdir)
        self._pending = b""
        nonce = secrets.token_hex(8)
        self._send("stty -echo -icanon -opost -ixon 2>/dev/null; PS1=''; PS2=''; PS4='+ '; "
                   "unset PROMPT_COMMAND HISTFILE; [ -n \"$BASH_VERSION\" ] && set +o history; "
                   f"printf '\\036{nonce} %s %s\\036' \"$$\" \"${{BASH_VERSION:+bash}}\"\n")
        found, before, after = self._read_marker(nonce, time.monotonic() + _START_TIMEOUT_S,
                                                 CappedBuffer(1 << 16))
        if found is None:
            self.close()
            raise RuntimeError(f"the shell in the task's container did not start: "
                               f"{before.decode('utf-8', 'replace')[-500:]!r}")
        pid, _, kind = found.partition(" ")
        self.pid, self.bash = int(pid), kind == "bash"
        self._pending = after

    # --- I/O ----------------------------------------------------------------------------------

    def _send(self, text: str) -> None:
        self._sock.sendall(text.encode("ascii"))

    def _read_marker(self, nonce: str, deadline: float, out: CappedBuffer):
        """Read until \\036<nonce> <payload>\\036: (payload, bytes not yet in `out`, bytes
        after the marker); payload None at the deadline or at the end of the stream."""
        tag = b"\x1e" + nonce.encode() + b" "
        buf = self._pending
        self._pending = b""
        while True:
            start = buf.find(tag)
            if start >= 0:
                end = buf.find(b"\x1e", start + len(tag))
                if end >= 0:
                    out.add(buf[:start])
                    return buf[start + len(tag):end].decode(), b"", buf[end + 1:]
            # Everything that cannot be the start of a marker is output already.
            keep = max(0, len(buf) - 64) if start < 0 else start
            out.add(buf[:keep])
            buf = buf[keep:]
            left = deadline - time.monotonic()
            if left <= 0:
                return None, buf, b""
            self._sock.settimeout(min(left, 1.0))  # (poll inside: no select() fd limit)
            try:
                data = self._sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            if not data:
                self._sock = None
                return None, buf, b""
            buf += data

    # --- commands -----------------------------------------------------------------------------

    def run(self, command: str, timeout_s: float) -> ShellResult:
        """Run `command` (any shell text, several lines included) and wait for it, at most
        `timeout_s` seconds."""
        t0 = time.monotonic()
        out = CappedBuffer(self.max_output_bytes)
        restarted = False
        if self._sock is None:
            self._start()
            restarted = True
            out.add(b"[a new shell was started: the previous one had exited]\n")
        nonce = secrets.token_hex(8)
        word = _bash_quote(command) if self.bash else _sh_quote(command)
        line = (f"eval {word} </dev/null" if self.bash else
                f"__c={word}; eval \"${{__c%_}}\" </dev/null")
        try:
            self._send(f"{line}; printf '\\036{nonce} %s\\036' \"$?\"\n")
        except OSError:
            self._sock = None
            return self._lost(out, t0, restarted)
        found, rest, after = self._read_marker(nonce, t0 + timeout_s, out)
        if found is not None:
            self._pending = after
            return ShellResult(out.value().decode("utf-8", "replace"), int(found), False,
                               out.dropped > 0, time.monotonic() - t0, restarted)
        out.add(rest)
        if self._sock is None:  # the shell exited (the command ran `exit`)
            return self._lost(out, t0, restarted)
        return self._interrupt(out, t0, restarted)

    def _interrupt(self, out: CappedBuffer, t0: float, restarted: bool) -> ShellResult:
        """Ctrl-C; then kill the foreground job; then start a new shell."""
        for step in ("interrupt", "kill"):
            nonce = secrets.token_hex(8)
            try:
                if step == "interrupt":
                    self._sock.sendall(b"\x03")
                else:
                    self._kill_foreground()
                self._send(f"printf '\\036{nonce} %s\\036' \"$?\"\n")
            except OSError:
                break
            found, rest, after = self._read_marker(nonce, time.monotonic() + _GRACE_S, out)
            if found is not None:
                self._pending = after
                out.add(b"\n[cut at the time limit]\n")
                return ShellResult(out.value().decode("utf-8", "replace"), None, True,
                                   out.dropped > 0, time.monotonic() - t0, restarted)
            out.add(rest)
            if self._sock is None:
                break
        self.close()
        self._start()
        out.add(b"\n[cut at the time limit; the shell did not respond and was restarted: its "
                b"working directory, variables and jobs are gone]\n")
        return ShellResult(out.value().decode("utf-8", "replace"), None, True, out.dropped > 0,
                           time.monotonic() - t0, True)

    def _kill_foreground(self) -> None:
        """SIGKILL the terminal's foreground process group, unless it is the shell's own."""
        script = (f'read -r s < /proc/{self.pid}/stat; set -- ${{s##*) }}; '
                  f'[ "$6" -gt 0 ] && [ "$6" != "$3" ] && kill -9 "-$6"')
        self.container.exec(["sh", "-c", script], timeout_s=10, user="root")

    def _lost(self, out: CappedBuffer, t0: float, restarted: bool) -> ShellResult:
        out.add(b"\n[the shell exited]\n")
        self.close()
        return ShellResult(out.value().decode("utf-8", "replace"), None, False,
                           out.dropped > 0, time.monotonic() - t0, restarted)

    def close(self) -> None:
        """End the session: the socket closes and the shell gets SIGHUP (its jobs with it,
        unless they were started with nohup or setsid)."""
        for s in (self._sock, getattr(self, "_wrapper", None)):
            try:
                if s is not None:
                    s.close()
            except OSError:
                pass
        self._sock = None
