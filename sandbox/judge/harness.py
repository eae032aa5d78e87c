"""The judge's program inside the sandbox: runs a solution against tests, signs the verdict.

`sandbox.judge` sends this file (compiled) as the code of one sandbox run. Three processes, so
that the solution can neither forge the verdict nor read what it is compared against:

  T (this process, trusted) makes itself non-dumpable (same-uid processes without
    CAP_SYS_PTRACE cannot read its memory or open its fds), reads the solution, starts Z, and
    reads the signing key and the tests. It runs the test code itself, in its own
    interpreter, where the solution never ran: patched builtins or modules, a rigged
    `__eq__`, `os._exit`, printed `PASSED` lines cannot touch it. It signs the report
    (HMAC-SHA256 with a per-call key) and writes it to stdout.
  Z (zygote, trusted) forks one solution process C per request and reports how it ended.
    Z is a fresh interpreter (posix_spawn), not a fork of T: T's memory comes from the
    sandbox's fork server, whose heap may hold this run's stdin (the key, the tests) and
    residue of earlier runs. A fork server that guarantees clean memory says so with
    SANDBOX_CLEAN_FORK=1 in the run's environment; then Z is forked from T before T reads
    the key and the tests, which saves an interpreter start.
  C (untrusted) is the solution. For unit tests it executes the solution as module
    `solution` and answers T's requests (calls, attribute access) with plain data (exact
    builtin types, which T decodes into genuine builtin objects: codec.py) or handles to
    its objects, which T can only call, read attributes of and take len() of: comparing,
    arithmetic, `in`, hashing, printing or iterating one is an `unjudgeable` verdict naming
    its type (rpc.Handle). A restarted C never rebinds the tests' own globals. For
    stdin/stdout it runs as `__main__` on one case's input; the expected outputs never
    enter the sandbox. Z and C live in zygote.py.

Z and C import only C-level modules (the solution's own imports are its cost); what only T
needs is imported where T needs it. The tests are split into units by split.py, which the
host shares. The judge's modules reach the sandbox inline (the run's payload) and load each
other through `_load_module`.
"""

import _signal
import _socket
import binascii
import builtins
import marshal
import os
import select
import struct
import sys
import time

REPORT_PREFIX = b"JUDGE-REPORT "
KEY_BYTES = 32


_LOADED = {}


def _load_module(name):
    """Another module of the judge (once per process): from the payload the run was given
    (the bootstrap's globals, see judge/api.py), else from beside this file (on the
    host)."""
    if name in _LOADED:
        return _LOADED[name]
    payload = globals().get("_JUDGE_PAYLOAD", {}).get(name)
    module = type(sys)(name)
    module._load_module = _load_module  # its own imports of the judge's modules
    if payload is None:
        module.__file__ = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
        with open(module.__file__) as f:
            code = compile(f.read(), module.__file__, "exec")
    elif globals().get("_JUDGE_MARSHAL"):
        import zlib
        code = marshal.loads(zlib.decompress(binascii.a2b_base64(payload[0])))
    else:
        import zlib
        code = compile(zlib.decompress(binascii.a2b_base64(payload[1])), name + ".py", "exec")
    exec(code, module.__dict__)
    _LOADED[name] = module
    return module


rpc = _load_module("rpc")
split = _load_module("split")
zygote = _load_module("zygote")


class _Timeout(BaseException):
    """Raised by SIGALRM in T when a test exceeds its time; BaseException so that a test's
    `except Exception` does not swallow it."""


# ----------------------------------------------------------------------------------------------
# T: the trusted judge
# ----------------------------------------------------------------------------------------------

class Judge:
    """T's state: the zygote channel, the live solution process, captured output, the timer.

    A test's time limit is a one-shot SIGALRM whose handler raises `_Timeout`, except inside
    `critical` sections (talking to the zygote), where it only records the timeout: T's
    bookkeeping of which process lives is never torn."""

    def __init__(self, ctl, settings):
        self.ctl = ctl
        self.settings = settings
        self.output = bytearray()  # the solution's stdout+stderr, capped
        self.output_dropped = 0
        self.child = None  # (pid, endpoint, out_fd) of the live solution process (unit mode)
        self.out_open = False
        self.prespawned = None  # (t_sock, out_r) of the solution process Z started unasked
        self.generation = 0  # solution processes started; restarts = generation - 1
        self.unjudgeable = None  # why the current test cannot be judged (Endpoint.strict)
        self.deadline = time.monotonic() + float(settings["time_budget_s"])
        self.critical = 0
        self.armed = False
        self.timed_out = False

    # -- the timer -------------------------------------------------------------------------
    def on_alarm(self, signum, frame):
        self.timed_out = True
        if self.armed and not self.critical:
            self.armed = False
            raise _Timeout()

    def arm(self, seconds):
        self.timed_out, self.armed = False, True
        _signal.setitimer(_signal.ITIMER_REAL, max(seconds, 0.001))

    def leave_critical(self):
        self.critical -= 1
        if not self.critical and self.timed_out and self.armed:
            self.armed = False
            raise _Timeout()

    # -- processes -------------------------------------------------------------------------
    def ctl_recv(self):
        reply = self.ctl.recv(64)
        if not reply:
            raise RuntimeError("the zygote is gone (the solution killed it?)")
        return int(reply)

    def spawn(self, fds):
        """Asks Z for a solution process with fds (stdin, stdout, stderr[, rpc])."""
        zygote.send_fds(self.ctl, b"spawn", fds)
        return self.ctl_recv()

    def reap(self, pid):
        """Kills the solution's process group and returns its wait status (from Z)."""
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, _signal.SIGKILL)
            except OSError:
                pass
        return self.ctl_recv()

    def capture(self, data):
        room = max(int(self.settings["max_output_bytes"]) - len(self.output), 0)
        self.output += data[:room]
        self.output_dropped += max(len(data) - room, 0)

    # -- the live solution process (unit tests) ----------------------------------------------
    def wait_on(self, sock):
        """Blocks until `sock` is readable, draining the solution's output meanwhile."""
        out_fd = self.child[2]
        while True:
            ready, _, _ = select.select([sock, out_fd] if self.out_open else [sock], [], [])
            if out_fd in ready:
                data = os.read(out_fd, 65536)
                self.capture(data) if data else setattr(self, "out_open", False)
            if sock in ready:
                return

    def drain(self):
        if self.child is None or not self.out_open:
            return
        out_fd = self.child[2]
        while select.select([out_fd], [], [], 0)[0]:
            data = os.read(out_fd, 65536)
            if not data:
                self.out_open = False
                return
            self.capture(data)

    def start_child(self):
        """Starts a solution process; returns (endpoint, its namespace listing)."""
        self.critical += 1
        try:
            if self.prespawned is not None:
                (t_sock, out_r), self.prespawned = self.prespawned, None
                pid = self.ctl_recv()
            else:
                t_sock, c_side, out_r = _child_fds()
                try:
                    pid = self.spawn(c_side)
                finally:
                    for fd in c_side:
                        os.close(fd)
            self.generation += 1
            ep = rpc.Endpoint(t_sock, self.generation, self.wait_on, rpc.CALLBACK_OPS,
                              on_unjudgeable=self.record_unjudgeable)
            self.child, self.out_open = (pid, ep, out_r), True
        finally:
            self.leave_critical()
        msg = ep.recv()
        if "import_error" in msg:
            raise _ImportFailed(msg["import_error"])
        if type(msg.get("ready")) is not dict:
            raise rpc.ProtocolError("the solution process sent no namespace")
        return ep, msg["ready"]

    def record_unjudgeable(self, message):
        if self.unjudgeable is None:
            self.unjudgeable = message

    def stop_child(self, wait=True, grace_s=0.0):
        """Kills the live solution process (if any) after `grace_s` to end by itself; returns
        how it ended (if `wait`)."""
        if self.child is None:
            return None
        self.critical += 1
        try:
            pid, ep, out_r = self.child
            self.drain()
            self.child = None
            status = None
            if wait and grace_s > 0 and select.select([self.ctl], [], [], grace_s)[0]:
                status = self.ctl_recv()
            elif wait:
                status = self.reap(pid)
            else:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, _signal.SIGKILL)
                    except OSError:
                        pass
            ep.sock.close()
            os.close(out_r)
        finally:
            self.leave_critical()
        return status


def _child_fds():
    """(T's socket, the solution's [stdin, stdout, stderr, rpc] fds, T's end of its output)."""
    t_sock, c_sock = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    out_r, out_w = os.pipe()
    return t_sock, [os.open(os.devnull, os.O_RDONLY), out_w, os.dup(out_w),
                    c_sock.detach()], out_r


class _ImportFailed(Exception):
    def __init__(self, info):
        super().__init__(info.get("message", ""))
        self.info = info


def _bind_solution(ns, module, bound, ep, names, tests, candidate, entry_point):
    """Binds the solution's top-level names into the tests' namespace and module `solution`
    (the same module object every time, so `import solution` in the tests stays valid).

    Builtins are never shadowed, and a standard-library module name always means the real
    module: a solution cannot redefine `abs` or `math.isclose` for the tests. Which names go
    where is decided by name, from the tests' source (`tests`: split.test_bindings), never by
    comparing values: a name the tests bind themselves (their constants, helpers, fixtures,
    `pytest`) never receives a solution's value, from the first solution process or a
    restarted one. `bound` maps the names this function put into `ns` to their values; one
    the tests have bound to something else since (dynamically, or by a star import), is
    theirs from then on. Aliases the tests made of the solution's names (`from solution
    import f as g`) follow the new solution."""
    owned, aliases, referenced = tests
    owned = owned | {a for a, (name, _) in aliases.items() if a != name}
    for name, value in list(bound.items()):
        if ns.get(name) is not value:
            del bound[name]
    for name in list(vars(module)):
        if not name.startswith("__"):
            delattr(module, name)
    for name, enc in names.items():
        if name.startswith("__") or hasattr(builtins, name):
            continue
        is_module = (type(enc) is list and len(enc) == 1 and type(enc[0]) is list
                     and enc[0][:1] == ["m"])
        if name in sys.stdlib_module_names or is_module:
            if name not in referenced:
                continue  # importing costs time; only what the tests name
            value = _import_real(name if name in sys.stdlib_module_names else str(enc[0][1]))
            if value is None:
                continue
        else:
            value = ep.decode(enc)
        setattr(module, name, value)
        _bind(ns, bound, owned, name, value)
    for name in set(bound) - set(vars(module)) - {candidate}:  # gone from the new solution
        ns.pop(name, None)
        del bound[name]
    sys.modules["solution"] = module
    if candidate is not None:
        value = getattr(module, entry_point, None)
        _bind(ns, bound, owned, candidate, _missing(entry_point) if value is None else value)
    for alias in aliases:
        if alias in ns and alias in owned:  # the tests' alias ran: it follows the solution
            name, imported = aliases[alias]
            for _ in range(len(aliases)):  # g = f, f an alias itself
                if name not in aliases or aliases[name][0] == name:
                    break
                name, imported = aliases[name]
            value = getattr(module, name, None)
            if value is not None and (imported or name in bound):
                ns[alias] = value


def _bind(ns, bound, owned, name, value):
    """`ns[name] = value` unless the tests bind `name` themselves or it is the harness's."""
    if name not in owned and (name not in ns or name in bound):
        ns[name] = bound[name] = value


def _missing(name):
    def missing(*args, **kwargs):
        raise NameError(f"the solution does not define {name!r}")
    return missing


def _import_real(name):
    try:
        __import__(name)
        return sys.modules[name]
    except BaseException:  # noqa: B036 - a missing module just stays unbound
        return None


def _judge_compare(left, op, right):
    if not split.CMP_FUNCS[op](left, right):
        raise AssertionError(f"assert {_repr(left)} {op} {_repr(right)}")


def _repr(value):
    try:
        return rpc.short(repr(value), 300)
    except (RecursionError, ValueError):  # deep data; a huge int
        return f"<{type(value).__name__} too deep or large to print>"


def _test_traceback(e):
    """Frames in the tests, then (for an error raised by the solution) frames in it."""
    remote = getattr(e, "remote_traceback", "")
    if remote:
        tail = "".join(ln for ln in remote.splitlines(True) if not ln.startswith("Traceback"))
    else:
        tail = rpc.exception_line(e)
    head = "Traceback (most recent call last):\n" + "".join(rpc.traceback_lines(e, split.TESTS_FILE))
    return rpc.short(head + tail, 4 * rpc.MAX_TEXT)


def _outcome(e, judge, pytest_module):
    """(status, message, traceback) for a test that raised `e`."""
    if isinstance(e, _ImportFailed):
        return ("error", "the solution failed to load: " + str(e.info.get("message", "")),
                str(e.info.get("traceback", "")))
    if isinstance(e, rpc.ChildGone):  # it closed the channel: it is exiting, or soon killed
        status = judge.stop_child(grace_s=0.5)
        how = zygote.status_text(status) if status is not None else "ended"
        return "crashed", f"the solution process {how} during this test", ""
    if pytest_module is not None and isinstance(e, pytest_module.Skipped):
        return "skipped", str(e), ""
    if isinstance(e, rpc.Unjudgeable):
        return "unjudgeable", str(e), ""
    if isinstance(e, rpc.ProtocolError):
        judge.stop_child()
    status = "failed" if isinstance(e, AssertionError) else "error"
    return status, rpc.exception_line(e).strip(), _test_traceback(e)


def _run_unit_tests(judge, payload):
    import ast
    source, entry_point = payload["tests"], payload.get("entry_point")
    style, units, candidate = split.split_tests(source, entry_point, payload.get("style", "auto"))
    lines = source.splitlines()
    rpc.SOURCES[split.TESTS_FILE] = lines
    tree = ast.parse(source, split.TESTS_FILE)
    referenced = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    owned, aliases, stars = split.test_bindings(tree)
    for star in filter(None, map(_import_real, stars)):  # `from math import *`: the tests'
        owned |= set(getattr(star, "__all__", None) or [n for n in vars(star)
                                                         if not n.startswith("_")])
    ns = {"__name__": "tests", "__builtins__": builtins, "__judge_compare__": _judge_compare}
    module, bound = type(sys)("solution"), {}
    module.__file__ = rpc.SOLUTION_FILE
    import_failure = []
    test_timeout = float(payload["test_timeout_s"])
    pytest_module = None

    def run(kind, code):
        if import_failure:
            raise import_failure[0]
        if judge.child is None:
            try:
                ep, names = judge.start_child()
            except _ImportFailed as e:
                import_failure.append(e)
                judge.stop_child()
                raise
            _bind_solution(ns, module, bound, ep, names, (owned, aliases, referenced),
                           candidate, entry_point)
        code(ns) if kind == "pytest" else exec(code, ns)

    if style == "pytest":
        pytest_module = _load_module("pytest_shim")
        ns["pytest"] = sys.modules["pytest"] = pytest_module.shim()
        queue = [("collect", "module setup", split.compile_units(tree.body, lines))]
    else:
        queue = [("unit", name, split.compile_units(stmts, lines)) for name, stmts in units]
    _signal.signal(_signal.SIGALRM, judge.on_alarm)
    results = []
    while queue:
        kind, name, code = queue.pop(0)
        start = time.monotonic()
        limit = min(test_timeout, judge.deadline - start)
        if limit <= 0.01:
            not_run = [unit for unit, _ in units] if kind == "collect" else [name]
            results += [_result(n, "timeout", "not run: the judge's time budget ran out")
                        for n in not_run]
            continue
        out_mark = len(judge.output)
        outcome = ("passed", "", "")
        judge.unjudgeable = None
        try:
            try:
                judge.arm(limit)
                try:
                    run(kind, code)
                except _Timeout:
                    raise
                except BaseException as e:  # noqa: B036 - any failure is this test's verdict
                    outcome = _outcome(e, judge, pytest_module)
            finally:
                judge.armed = False
                _signal.setitimer(_signal.ITIMER_REAL, 0)
        except _Timeout:
            pass
        if judge.timed_out:
            outcome = ("timeout", f"timed out after {limit:.3g} s", "")
            judge.stop_child()
        elif judge.unjudgeable is not None:  # whatever the test made of it afterwards
            outcome = ("unjudgeable", judge.unjudgeable, "")
        judge.drain()
        excerpt = bytes(judge.output[out_mark:]).decode("utf-8", "replace")
        if kind == "collect":
            if outcome[0] != "passed":  # module setup failed: every test fails with it
                status = "timeout" if outcome[0] == "timeout" else "error"
                results += [_result(unit, status, "module setup failed: " + outcome[1],
                                    outcome[2]) for unit, _ in units]
                break
            queue = [("pytest", tname, fn)
                     for tname, fn in pytest_module.collect(ns, units, owned)] + queue
            continue
        results.append(_result(name, *outcome, excerpt, time.monotonic() - start))
    judge.stop_child(wait=False)
    return {"tests": results, "restarts": max(judge.generation - 1, 0)}


def _result(name, status, message="", tb="", stdout="", duration=0.0):
    return {"name": name, "status": status, "message": rpc.short(message), "traceback": tb,
            "stdout": rpc.short(stdout), "duration_s": round(duration, 6)}


# -- main --------------------------------------------------------------------------------------

def _read_exact(fd, n):
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            raise EOFError(f"stdin ended after {got} of {n} bytes")
        got += k
    return buf


def _read_section(fd):
    (n,) = struct.unpack("<Q", _read_exact(fd, 8))
    return rpc.loads(bytes(_read_exact(fd, n)).decode())


def _make_undumpable():
    """PR_SET_DUMPABLE 0: same-uid processes without CAP_SYS_PTRACE can no longer read this
    process's memory (/proc/pid/mem, ptrace) or open its fds (/proc/pid/fd)."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0
    except Exception:  # noqa: BLE001 - reported in the verdict as `undumpable: false`
        return False


def main():
    undumpable = _make_undumpable()
    cwd = os.getcwd()  # the solution's dir: nothing may be imported from it into T
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != cwd
                   and not os.path.abspath(p).startswith(cwd + os.sep)]
    sys.dont_write_bytecode = True
    zygote.set_interpreter_limits()
    setup = _read_section(0)
    t_sock, c_side, out_r = _child_fds() if setup["mode"] == "unit" else (None, [], None)
    zygote_pid, ctl = zygote.start(setup, c_side, globals().get("_JUDGE_PAYLOAD", {}),
                                     globals().get("_JUDGE_MARSHAL", False))
    key = bytes(_read_exact(0, KEY_BYTES))
    payload = _read_section(0)
    os.close(0)
    judge = Judge(ctl, payload)
    if t_sock is not None:  # Z starts the first solution process at once
        judge.prespawned = (t_sock, out_r)
    report = {"mode": setup["mode"], "undumpable": undumpable, "error": None}
    try:
        if setup["mode"] == "unit":
            report.update(_run_unit_tests(judge, payload))
        else:
            report.update(_load_module("stdio_cases").run(judge, payload))  # (T only)
    except BaseException as e:  # noqa: B036 - a harness failure is reported, signed
        import traceback
        report["error"] = rpc.short("".join(traceback.format_exception(type(e), e,
                                                                    e.__traceback__)))
    report["output"] = bytes(judge.output).decode("utf-8", "replace")
    report["output_dropped"] = judge.output_dropped
    ctl.close()
    try:
        os.kill(zygote_pid, _signal.SIGKILL)
        os.waitpid(zygote_pid, 0)
    except OSError:
        pass
    import hashlib
    import hmac
    body = rpc.dumps(report).encode()
    mac = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    view = memoryview(REPORT_PREFIX + mac + b" " + body + b"\n")
    while view:
        view = view[os.write(1, view):]


if __name__ == "__main__":
    main()
