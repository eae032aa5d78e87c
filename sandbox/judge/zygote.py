"""The judge's zygote Z and solution processes C, inside the sandbox (see judge/harness.py):
Z forks one C per request of T's and reports how it ended; C runs the solution, as module
`solution` answering T's requests (unit tests) or as `__main__` on one input (stdio).
Imports only C-level modules: a solution process pays nothing for it."""

import _signal
import _socket
import builtins
import io
import marshal
import os
import struct
import sys

rpc = _load_module("rpc")  # noqa: F821 - given by the harness's module loader


def close_fds(keep):
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _flush_quietly():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: B036 - a solution may have closed or replaced them
            pass


def _child_main(mode, fds, code_obj, syntax_error, source):
    """Runs in the forked solution process; never returns."""
    status = 1
    try:
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")  # under a shared memory limit, the solution dies first
        except OSError:
            pass
        for fd, target in zip(fds[:3], (0, 1, 2)):
            os.dup2(fd, target)
        if mode == "unit":
            os.dup2(fds[3], 3)
        close_fds({3} if mode == "unit" else set())
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8",
                                     errors="surrogateescape")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                      errors="surrogateescape")
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True)
        sys.argv = [rpc.SOLUTION_FILE]
        rpc.SOURCES[rpc.SOLUTION_FILE] = source.splitlines()
        if mode == "stdio":
            status = _child_stdio(code_obj, syntax_error)
        else:
            status = _child_unit(_socket.socket(fileno=3), code_obj, syntax_error)
    except BaseException:  # noqa: B036 - the exit status says it; nothing may escape a fork
        status = 1
    finally:
        _flush_quietly()
        os._exit(status)


def _child_stdio(code_obj, syntax_error):
    if syntax_error is not None:
        sys.stderr.write(rpc.exception_line(syntax_error))
        return 1
    try:
        exec(code_obj, {"__name__": "__main__", "__builtins__": builtins,
                        "__file__": rpc.SOLUTION_FILE})
    except SystemExit as e:
        if e.code is None or type(e.code) is int:
            return e.code or 0
        sys.stderr.write(f"{e.code}\n")
        return 1
    except BaseException as e:  # noqa: B036 - reported like Python would, trimmed
        sys.stderr.write(rpc.user_traceback(e, rpc.SOLUTION_FILE))
        return 1
    return 0


def _child_unit(sock, code_obj, syntax_error):
    ep = rpc.Endpoint(sock, before_send=_flush_quietly)
    module = type(sys)("solution")
    module.__file__ = rpc.SOLUTION_FILE
    sys.modules["solution"] = module
    try:
        if syntax_error is not None:
            raise syntax_error
        exec(code_obj, module.__dict__)
    except BaseException as e:  # noqa: B036 - a broken solution is a verdict, not a crash
        ep.send({"import_error": rpc.describe_exception(e)})
        return 0
    names = {}
    for name, value in list(module.__dict__.items()):
        if name.startswith("__"):
            continue
        if isinstance(value, type(sys)):
            names[name] = [["m", str(value.__name__)]]
            continue
        try:
            names[name] = ep.encode(value)
        except rpc.TooLarge:  # judged only if the tests use it, as any object that is not data
            names[name] = [ep._ref(value)]
    ep.send({"ready": names})
    while True:
        try:
            msg = ep.recv()
        except rpc.ChildGone:
            return 0
        ep.serve(msg)


# ----------------------------------------------------------------------------------------------
# Z: the zygote
# ----------------------------------------------------------------------------------------------

def send_fds(sock, data, fds):
    sock.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS,
                           struct.pack(f"{len(fds)}i", *fds))])


def _recv_fds(sock, size, max_fds):
    data, ancillary, _, _ = sock.recvmsg(size, _socket.CMSG_SPACE(max_fds * 4))
    fds = []
    for level, kind, raw in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds += struct.unpack(f"{len(raw) // 4}i", raw[:len(raw) // 4 * 4])
    return data, fds


def _zygote_main(ctl, mode, source, first_fds):
    """Forks one solution process per request from T (the first one, if `first_fds`, without
    being asked); reports its pid, then how it ended."""
    # fd 0 held T's stdin or Z's boot data: replace it, so received fds never land on 0-2.
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    code_obj, syntax_error = None, None
    try:
        code_obj = compile(source, rpc.SOLUTION_FILE, "exec")
    except (SyntaxError, ValueError) as e:
        syntax_error = e if isinstance(e, SyntaxError) else SyntaxError(str(e))
    while True:
        if first_fds:
            fds, first_fds = first_fds, None
        else:
            try:
                data, fds = _recv_fds(ctl, 4096, 8)
            except OSError:
                return
            if not data:
                return
        pid = os.fork()
        if pid == 0:
            ctl.close()
            _child_main(mode, fds, code_obj, syntax_error, source)
        for fd in fds:
            os.close(fd)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass  # the child set it itself, or is already gone
        ctl.send(b"%d" % pid)
        _, status = os.waitpid(pid, 0)
        for kill in (os.killpg, os.kill):  # whatever the solution left in its group
            try:
                kill(pid, _signal.SIGKILL)
            except OSError:
                pass
        ctl.send(b"%d" % status)


_ZYGOTE_BOOT = """import sys, marshal, zlib, binascii
boot = marshal.loads(open(0, "rb", closefd=False).read())
compiled, source = boot["payload"]["harness"]
if boot["marshal"]:
    code = marshal.loads(zlib.decompress(binascii.a2b_base64(compiled)))
else:
    code = compile(zlib.decompress(binascii.a2b_base64(source)), "harness.py", "exec")
ns = {"__name__": "judge_zygote", "_JUDGE_PAYLOAD": boot["payload"],
      "_JUDGE_MARSHAL": boot["marshal"]}
exec(code, ns)
ns["_load_module"]("zygote").zygote_entry(boot)
"""


def zygote_entry(boot):
    """Z started as a fresh interpreter: its control socket is fd 3, the first solution
    process's fds (unit tests) are 4-7."""
    set_interpreter_limits()
    first = [4, 5, 6, 7] if boot["mode"] == "unit" else None
    _zygote_main(_socket.socket(fileno=3), boot["mode"], boot["code"], first)


def memfd(data):
    try:
        fd = os.memfd_create("judge")
    except (AttributeError, OSError):  # no memfd (old kernel, seccomp): an unlinked temp file
        import tempfile
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def start(setup, first_fds, payload, use_marshal):
    """(pid, T's control socket) of Z: a fresh interpreter if this run's memory may hold
    secrets (see the module docstring), else a fork made before T reads any secret."""
    t_ctl, z_ctl = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    if (os.environ.get("SANDBOX_CLEAN_FORK") == "1" or "harness" not in payload
            or not sys.executable):
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                t_ctl.close()
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                close_fds({z_ctl.fileno(), *first_fds})
                _zygote_main(z_ctl, setup["mode"], setup["code"], first_fds)
            except BaseException:  # noqa: B036 - nothing may escape a fork
                status = 1
            os._exit(status)
    else:
        import fcntl
        modules = {name: payload[name] for name in ("harness", "rpc", "codec", "split", "zygote")}
        boot = marshal.dumps({"marshal": use_marshal, "payload": modules,
                              "mode": setup["mode"], "code": setup["code"]})
        sources = [memfd(boot), os.open(os.devnull, os.O_WRONLY), z_ctl.fileno(), *first_fds]
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64) for fd in sources]
        targets = [0, 1, 3, 4, 5, 6, 7][:len(high)]
        pid = os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", "-c", _ZYGOTE_BOOT],
                             dict(os.environ),
                             file_actions=[(os.POSIX_SPAWN_DUP2, h, t)
                                           for h, t in zip(high, targets)])
        for fd in high + sources[:2]:
            os.close(fd)
    z_ctl.close()
    for fd in first_fds:
        os.close(fd)
    return pid, t_ctl


def set_interpreter_limits():
    if hasattr(sys, "set_int_max_str_digits"):  # big ints travel as JSON digits
        sys.set_int_max_str_digits(0)


_SIGNAL_NAMES = {4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL",
                 11: "SIGSEGV", 15: "SIGTERM", 24: "SIGXCPU", 25: "SIGXFSZ", 31: "SIGSYS"}


def status_text(status):
    """How a solution process ended, for a test's message."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"killed by signal {_SIGNAL_NAMES.get(sig, sig)}" + (
            " (out of memory?)" if sig == 9 else "")
    return f"exited with code {os.WEXITSTATUS(status)}"
