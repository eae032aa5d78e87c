"""The judge's program inside the sandbox: runs a solution against tests, signs the verdict.

`sandbox.judge` sends this file as the code of one sandbox run. Three processes, so that the
solution can neither forge the verdict nor read what it is compared against:

  T (this process, trusted) makes itself non-dumpable (same-uid processes without
    CAP_SYS_PTRACE cannot read its memory or open its fds), reads the solution, forks Z, and
    only then reads the signing key and the tests. It runs the test code itself, in its own
    interpreter, where the solution never ran: patched builtins or modules, a rigged `__eq__`,
    `os._exit`, printed `PASSED` lines cannot touch it. It signs the report (HMAC-SHA256 with
    a key that never exists in a solution process) and writes it to stdout.
  Z (zygote, trusted, holds no secret) forks one solution process C per request and reports
    how it ended.
  C (untrusted) is the solution. For unit tests it executes the solution as module `solution`
    and then answers T's requests (calls, attribute access, operators) with plain data
    (exact builtin types, decoded by T into genuine builtin objects) or opaque references,
    which never compare equal to plain data. For stdin/stdout it runs as `__main__` on one
    case's input; the expected outputs never enter the sandbox (the host compares).

Stdlib only; runs under whatever interpreter the backend provides. `split_tests` is shared with
the host (`sandbox.judge`), so both count the same tests.
"""

import ast
import base64
import builtins
import collections
import hashlib
import hmac
import io
import json
import linecache
import operator
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
import types

SOLUTION_FILE = "solution.py"
TESTS_FILE = "tests.py"
REPORT_PREFIX = b"JUDGE-REPORT "
KEY_BYTES = 32
MAX_MESSAGE_BYTES = 32 << 20  # one RPC message; a larger one is a protocol violation
MAX_TEXT = 2000  # chars kept of a message, traceback or output excerpt in the report
MAX_DEPTH = 200  # nesting depth of plain data; deeper values travel as references
BATCH = 64  # items fetched per round trip when T iterates over a solution's iterator


# ----------------------------------------------------------------------------------------------
# Splitting tests into units (shared with the host)
# ----------------------------------------------------------------------------------------------

def _has_assert(node):
    """Whether `node` contains an assert outside nested function and class bodies."""
    if isinstance(node, ast.Assert):
        return True
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if _has_assert(child):
            return True
    return False


def _is_test_stmt(stmt):
    if _has_assert(stmt):
        return True
    # A bare call such as `check(f)` is a test too; a docstring is not.
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)


def detect_style(module):
    for stmt in module.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name.startswith(
                "test"):
            return "pytest"
        if isinstance(stmt, ast.ClassDef) and stmt.name.startswith("Test"):
            return "pytest"
    return "assert"


def split_tests(source, entry_point=None, style="auto"):
    """Parses test code into (style, setup_stmts, units, candidate_name).

    assert style: each top-level statement that contains an `assert` (or is a bare call like
    `check(f)`) is one test, run after the non-test statements that precede it. With
    `entry_point`, a HumanEval-style `def check(candidate)` is unrolled: its statements are
    the units and `candidate` is bound to the solution's `entry_point`.
    pytest style: each `test*` function and `Test*` class method is a test (expanded at run
    time by `parametrize`); the other module statements are setup, run once.
    Units are (name, [stmts]). Raises ValueError for code that does not parse or has no test.
    """
    try:
        module = ast.parse(source, TESTS_FILE)
    except SyntaxError as e:
        raise ValueError(f"the tests do not parse: {e.msg} (line {e.lineno})") from None
    if style == "auto":
        style = detect_style(module)
    if style not in ("assert", "pytest"):
        raise ValueError(f"style must be 'auto', 'assert' or 'pytest', got {style!r}")
    lines = source.splitlines()
    if style == "pytest":
        setup = [s for s in module.body if not _is_pytest_def(s)]
        units = [(s.name, [s]) for s in module.body if _is_pytest_def(s)]
        if not units:
            raise ValueError("the tests define no test* function or Test* class")
        return style, setup, units, None
    body, candidate, prelude = module.body, None, []
    check = [s for s in body if isinstance(s, ast.FunctionDef) and s.name == "check"]
    if entry_point is not None and check and check[0].args.args:
        candidate = check[0].args.args[0].arg
        prelude = [s for s in body if s is not check[0] and not _calls_check(s)]
        body = check[0].body
    units, pending = [], list(prelude)
    for stmt in body:
        pending.append(stmt)
        if _is_test_stmt(stmt):
            text = lines[stmt.lineno - 1].strip() if stmt.lineno <= len(lines) else ""
            units.append((f"line {stmt.lineno}: {text[:100]}", pending))
            pending = []
    if not units:
        raise ValueError("the tests contain no assert statement (nor a call such as check(f))")
    return style, [], units, candidate


def _is_pytest_def(stmt):
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return stmt.name.startswith("test")
    return isinstance(stmt, ast.ClassDef) and stmt.name.startswith("Test")


def _calls_check(stmt):
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == "check")


class _AssertRewriter(ast.NodeTransformer):
    """Turns every `assert` into an explicit check: immune to `python -O`, and a failing
    single comparison reports both values (`assert 5 == 4`)."""

    def __init__(self, lines):
        self.lines = lines

    def visit_Assert(self, node):
        self.generic_visit(node)
        text = " ".join(
            self.lines[i].strip()
            for i in range(node.lineno - 1, min(node.end_lineno or node.lineno, len(self.lines))))
        test = node.test
        if (node.msg is None and isinstance(test, ast.Compare) and len(test.ops) == 1
                and type(test.ops[0]) in _CMP_NAMES):
            call = ast.Call(
                func=ast.Name("__judge_compare__", ast.Load()),
                args=[test.left, ast.Constant(_CMP_NAMES[type(test.ops[0])]),
                      test.comparators[0]],
                keywords=[])
            new = ast.Expr(call)
        else:
            msg = node.msg if node.msg is not None else ast.Constant(text)
            new = ast.If(
                test=ast.UnaryOp(ast.Not(), test),
                body=[ast.Raise(ast.Call(ast.Name("AssertionError", ast.Load()), [msg], []),
                                None)],
                orelse=[])
        return ast.copy_location(new, node)


_CMP_NAMES = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">",
              ast.GtE: ">=", ast.In: "in", ast.NotIn: "not in", ast.Is: "is",
              ast.IsNot: "is not"}
_CMP_FUNCS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
              ">": operator.gt, ">=": operator.ge, "in": lambda a, b: a in b,
              "not in": lambda a, b: a not in b, "is": operator.is_, "is not": operator.is_not}


def _compile_stmts(stmts, lines):
    module = ast.Module(body=[_AssertRewriter(lines).visit(s) for s in stmts], type_ignores=[])
    ast.fix_missing_locations(module)
    return compile(module, TESTS_FILE, "exec")


# ----------------------------------------------------------------------------------------------
# Plain data <-> JSON, and references to objects on the other side
# ----------------------------------------------------------------------------------------------

class ProtocolError(Exception):
    """The other side sent something that is not a valid message."""


class _ChildGone(Exception):
    """The solution process ended (crashed, exited, was killed) while T waited on it."""


class _Timeout(BaseException):
    """Raised by SIGALRM in T when a test exceeds its time; BaseException so that a test's
    `except Exception` does not swallow it."""


def _short(text, limit=MAX_TEXT):
    text = str(text)
    return text if len(text) <= limit else text[:limit // 2] + " ... " + text[-limit // 2:]


class _Remote:
    """A reference to an object that lives on the other side of an endpoint.

    Calls, attribute access and operators travel as requests; results come back as plain data
    or as new references. Equality or ordering against anything but a reference from the same
    endpoint is NotImplemented, so a reference never equals plain data (an object whose
    `__eq__` is always True cannot pass `== expected`)."""

    __slots__ = ("_judge_ep", "_judge_id", "_judge_gen")

    def __init__(self, ep, ref_id):
        object.__setattr__(self, "_judge_ep", ep)
        object.__setattr__(self, "_judge_id", ref_id)
        object.__setattr__(self, "_judge_gen", ep.generation)

    def _judge_op(self, op, *args):
        return self._judge_ep.request({"op": op, "ref": self._judge_id}, self, args)

    def __getattr__(self, name):
        if name.startswith("_judge"):
            raise AttributeError(name)
        return self._judge_op("getattr", name)

    def __setattr__(self, name, value):
        self._judge_op("setattr", name, value)

    def __delattr__(self, name):
        self._judge_op("delattr", name)

    def __call__(self, *args, **kwargs):
        return self._judge_ep.request({"op": "call", "ref": self._judge_id}, self, args, kwargs)

    def _same_side(self, other):
        return type(other) is _Remote and other._judge_ep is self._judge_ep

    def __eq__(self, other):
        return self._judge_op("eq", other) if self._same_side(other) else NotImplemented

    def __ne__(self, other):
        return self._judge_op("ne", other) if self._same_side(other) else NotImplemented

    def __lt__(self, other):
        return self._judge_op("lt", other) if self._same_side(other) else NotImplemented

    def __le__(self, other):
        return self._judge_op("le", other) if self._same_side(other) else NotImplemented

    def __gt__(self, other):
        return self._judge_op("gt", other) if self._same_side(other) else NotImplemented

    def __ge__(self, other):
        return self._judge_op("ge", other) if self._same_side(other) else NotImplemented

    def __hash__(self):
        return self._judge_op("hash")

    def __bool__(self):
        return self._judge_op("bool")

    def __len__(self):
        return self._judge_op("len")

    def __repr__(self):
        try:
            return self._judge_op("repr")
        except BaseException:  # noqa: B036 - repr is for messages; never fail a report on it
            return "<object of the solution>"

    def __str__(self):
        return self._judge_op("str")

    def __format__(self, spec):
        return self._judge_op("format", spec)

    def __int__(self):
        return self._judge_op("int")

    def __float__(self):
        return self._judge_op("float")

    def __index__(self):
        return self._judge_op("index")

    def __contains__(self, item):
        return self._judge_op("contains", item)

    def __getitem__(self, key):
        return self._judge_op("getitem", key)

    def __setitem__(self, key, value):
        self._judge_op("setitem", key, value)

    def __delitem__(self, key):
        self._judge_op("delitem", key)

    def __iter__(self):
        it = self._judge_op("iter")
        while True:
            items, done = it._judge_op("next_batch", BATCH)
            yield from items
            if done:
                return

    def __next__(self):
        return self._judge_op("next")

    def __instancecheck__(self, obj):
        return self._same_side(obj) and self._judge_op("isinstance", obj)

    def __subclasscheck__(self, cls):
        return self._same_side(cls) and self._judge_op("issubclass", cls)


def _binary(name):
    def forward(self, other):
        return self._judge_op(name, other)
    forward.__name__ = f"__{name}__"
    return forward


def _unary(name):
    def forward(self):
        return self._judge_op(name)
    forward.__name__ = f"__{name}__"
    return forward


_BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
           "xor", "lshift", "rshift")
for _name in _BINARY:
    setattr(_Remote, f"__{_name}__", _binary(_name))
    setattr(_Remote, f"__r{_name}__", _binary("r" + _name))
for _name in ("neg", "pos", "abs", "invert"):
    setattr(_Remote, f"__{_name}__", _unary(_name))

# The operations one side may ask of an object the other side holds a reference to.
_OPS = {
    "getattr": getattr, "setattr": setattr, "delattr": delattr,
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
    "gt": operator.gt, "ge": operator.ge, "hash": hash, "bool": bool, "len": len,
    "repr": repr, "str": str, "format": format, "int": int, "float": float,
    "index": operator.index, "contains": operator.contains, "getitem": operator.getitem,
    "setitem": operator.setitem, "delitem": operator.delitem, "iter": iter, "next": next,
    "isinstance": lambda cls, obj: isinstance(obj, cls),
    "issubclass": lambda cls, sub: issubclass(sub, cls),
    "neg": operator.neg, "pos": operator.pos, "abs": abs, "invert": operator.invert,
}
for _name in _BINARY:
    _fn = getattr(operator, _name + "_" if _name in ("and", "or") else _name)
    _OPS[_name] = _fn
    _OPS["r" + _name] = (lambda f: lambda a, b: f(b, a))(_fn)


def _next_batch(it, n):
    items = []
    for _ in range(n):
        try:
            items.append(next(it))
        except StopIteration:
            return items, True
    return items, False


_OPS["next_batch"] = _next_batch
_MUTABLE = (list, dict, set, bytearray)
_CALLBACK_OPS = frozenset(
    {"call", "iter", "next", "next_batch", "len", "bool", "hash", "eq", "ne", "lt", "le", "gt",
     "ge", "contains", "getitem", "repr", "str", "format", "int", "float", "index"})


class Endpoint:
    """One side of the T <-> C channel: length-prefixed JSON over a stream socket.

    `request` sends one request and serves the other side's nested requests (callbacks) until
    its reply arrives. Objects that are not plain data are kept in `objects` and sent as
    references."""

    def __init__(self, sock, generation=0, on_wait=None, allowed_ops=None, before_send=None):
        self.sock = sock
        self.before_send = before_send  # C: flush the solution's prints before each reply
        self.generation = generation
        # T lets the solution only call, iterate and compare what T hands it (callbacks):
        # attribute access would reach `__globals__`, `__code__` and from there anything.
        self.allowed_ops = allowed_ops
        self.objects = {}
        self.next_id = 0
        self.next_msg = 0
        self.on_wait = on_wait  # T: called with the socket to wait on (drains output, deadlines)

    # -- encoding --------------------------------------------------------------------------
    def encode(self, v, depth=0):
        t = type(v)
        if v is None or t is bool or t is int or t is float or t is str:
            return v
        if depth > MAX_DEPTH:
            return self._ref(v)
        d = depth + 1
        if t is list:
            return [self.encode(x, d) for x in v]
        if t is tuple:
            return {"#": "tuple", "v": [self.encode(x, d) for x in v]}
        if t is dict:
            return {"#": "dict", "v": [[self.encode(k, d), self.encode(x, d)] for k, x in v.items()]}
        if t is set or t is frozenset:
            return {"#": t.__name__, "v": [self.encode(x, d) for x in v]}
        if t is bytes or t is bytearray:
            return {"#": t.__name__, "v": base64.b64encode(v).decode()}
        if t is complex:
            return {"#": "complex", "v": [v.real, v.imag]}
        if t is range:
            return {"#": "range", "v": [v.start, v.stop, v.step]}
        if t is _Remote and v._judge_ep is self:
            if v._judge_gen != self.generation:
                raise RuntimeError("an object from before the solution was restarted was used")
            return {"#": "back", "id": v._judge_id}
        known = _encode_known(self, v, d)
        return known if known is not None else self._ref(v)

    def _ref(self, v):
        self.next_id += 1
        self.objects[self.next_id] = v
        return {"#": "ref", "id": self.next_id}

    def decode(self, x):
        t = type(x)
        if t is list:
            return [self.decode(e) for e in x]
        if t is not dict:
            return x
        tag, v = x.get("#"), x.get("v")
        if tag == "tuple":
            return tuple(self.decode(e) for e in v)
        if tag == "dict":
            return {self.decode(k): self.decode(e) for k, e in v}
        if tag == "set":
            return {self.decode(e) for e in v}
        if tag == "frozenset":
            return frozenset(self.decode(e) for e in v)
        if tag == "bytes":
            return base64.b64decode(v)
        if tag == "bytearray":
            return bytearray(base64.b64decode(v))
        if tag == "complex":
            return complex(float(v[0]), float(v[1]))
        if tag == "range":
            return range(int(v[0]), int(v[1]), int(v[2]))
        if tag == "ref":
            return _Remote(self, int(x["id"]))
        if tag == "back":
            try:
                return self.objects[int(x["id"])]
            except KeyError:
                raise ProtocolError(f"unknown reference {x['id']!r}") from None
        return _decode_known(self, tag, x)

    # -- messages --------------------------------------------------------------------------
    def send(self, msg):
        if self.before_send is not None:
            self.before_send()
        data = json.dumps(msg, separators=(",", ":")).encode("utf-8", "surrogatepass")
        if len(data) > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message of {len(data)} bytes is over the limit")
        self.sock.sendall(struct.pack("<I", len(data)) + data)

    def _recv_exact(self, n):
        chunks = []
        while n:
            if self.on_wait is not None:
                self.on_wait(self.sock)
            chunk = self.sock.recv(min(n, 1 << 20))
            if not chunk:
                raise _ChildGone()
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def recv(self):
        (n,) = struct.unpack("<I", self._recv_exact(4))
        if n > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message of {n} bytes is over the limit")
        try:
            msg = json.loads(self._recv_exact(n).decode("utf-8", "surrogatepass"))
        except (ValueError, RecursionError) as e:
            raise ProtocolError(f"message is not valid JSON: {e}") from None
        if type(msg) is not dict:
            raise ProtocolError("message is not an object")
        return msg

    def request(self, head, target, args=(), kwargs=None):
        self.next_msg += 1
        msg_id = self.next_msg
        enc_args = [self.encode(a) for a in args]
        enc_kwargs = {k: self.encode(v) for k, v in (kwargs or {}).items()}
        if target is not None and target._judge_gen != self.generation:
            raise RuntimeError("an object from before the solution was restarted was used")
        self.send({**head, "id": msg_id, "args": enc_args, "kwargs": enc_kwargs})
        while True:
            msg = self.recv()
            if "op" in msg:
                self.serve(msg)
                continue
            if msg.get("re") != msg_id:
                raise ProtocolError("reply to an unknown request")
            try:
                for i, new in msg.get("sync", ()):
                    _sync(args[i] if type(i) is int else kwargs[i], self.decode(new))
            except (TypeError, ValueError, KeyError, IndexError) as e:
                raise ProtocolError(f"bad argument update: {e}") from None
            if "exc" in msg:
                raise _remote_exception(msg["exc"])
            return self.decode(msg.get("ok"))

    def serve(self, msg):
        """Executes one request from the other side and sends the reply."""
        args, kwargs = [], {}
        try:
            op = msg["op"]
            if self.allowed_ops is not None and op not in self.allowed_ops:
                raise PermissionError(f"operation {op!r} is not allowed on the judge's objects")
            target = self.objects[msg["ref"]]
            args = [self.decode(a) for a in msg["args"]]
            kwargs = {str(k): self.decode(v) for k, v in msg["kwargs"].items()}
            value = target(*args, **kwargs) if op == "call" else _OPS[op](target, *args)
            reply = {"re": msg["id"], "ok": self.encode(value)}
        except BaseException as e:  # noqa: B036 - everything the other side did is data
            reply = {"re": msg.get("id"), "exc": _describe_exception(e)}
        sync = []
        for i, a in list(enumerate(args)) + list(kwargs.items()):
            if type(a) in _MUTABLE:
                sent = msg["args"][i] if type(i) is int else msg["kwargs"][i]
                now = self.encode(a)
                if now != sent:
                    sync.append([i, now])
        if sync:
            reply["sync"] = sync
        self.send(reply)


def _sync(obj, new):
    """Applies the other side's in-place changes of an argument (`xs.sort()` in a solution)."""
    if type(obj) is list and type(new) is list:
        obj[:] = new
    elif type(obj) is dict and type(new) is dict or type(obj) is set and type(new) is set:
        obj.clear()
        obj.update(new)
    elif type(obj) is bytearray and type(new) is bytearray:
        obj[:] = new


_NAMEDTUPLES = {}


def _encode_known(ep, v, d):
    """Standard-library and numpy values that are data, not behaviour."""
    t = type(v)
    if isinstance(v, tuple) and hasattr(t, "_fields") and all(type(f) is str for f in t._fields):
        return {"#": "namedtuple", "name": t.__name__, "fields": list(t._fields),
                "v": [ep.encode(x, d) for x in v]}
    mod = t.__module__
    if mod == "collections":
        if t is collections.OrderedDict or t is collections.Counter or (
                t is collections.defaultdict):
            return {"#": t.__name__, "v": [[ep.encode(k, d), ep.encode(x, d)]
                                           for k, x in v.items()]}
        if t is collections.deque:
            return {"#": "deque", "v": [ep.encode(x, d) for x in v]}
    if mod in ("decimal", "fractions") and t.__name__ in ("Decimal", "Fraction"):
        return {"#": t.__name__, "v": str(v)}
    if mod == "numpy" and hasattr(v, "tolist"):
        if getattr(v, "ndim", None) == 0 or t.__name__ != "ndarray":
            return ep.encode(v.item(), d)
        return {"#": "ndarray", "dtype": str(v.dtype), "v": ep.encode(v.tolist(), d)}
    return None


def _decode_known(ep, tag, x):
    v = x.get("v")
    if tag == "namedtuple":
        key = (str(x["name"]), tuple(str(f) for f in x["fields"]))
        if key not in _NAMEDTUPLES and len(_NAMEDTUPLES) > 1000:
            raise ProtocolError("too many namedtuple types")
        if key not in _NAMEDTUPLES:
            _NAMEDTUPLES[key] = collections.namedtuple(key[0], key[1], rename=True)
        return _NAMEDTUPLES[key](*[ep.decode(e) for e in v])
    if tag in ("OrderedDict", "Counter", "defaultdict"):
        cls = getattr(collections, tag)
        items = [(ep.decode(k), ep.decode(e)) for k, e in v]
        return cls(None, items) if tag == "defaultdict" else cls(dict(items))
    if tag == "deque":
        return collections.deque(ep.decode(e) for e in v)
    if tag == "Decimal":
        import decimal
        return decimal.Decimal(str(v))
    if tag == "Fraction":
        import fractions
        return fractions.Fraction(str(v))
    if tag == "ndarray":
        import numpy
        return numpy.array(ep.decode(v), dtype=str(x["dtype"]))
    raise ProtocolError(f"unknown value tag {tag!r}")


# ----------------------------------------------------------------------------------------------
# Exceptions across the channel
# ----------------------------------------------------------------------------------------------

def _user_traceback(e, filename):
    """The traceback of `e`, keeping only frames in `filename`, then the exception line."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == filename]
    lines = traceback.format_list(frames)
    tail = "".join(traceback.format_exception_only(type(e), e))
    head = "Traceback (most recent call last):\n" if lines else ""
    return head + "".join(lines) + tail


def _describe_exception(e):
    names = [c.__name__ for c in type(e).__mro__]
    try:
        message = str(e)
    except BaseException:  # noqa: B036 - a broken __str__ is the solution's problem
        message = "<unprintable>"
    if isinstance(e, SyntaxError):  # keep the caret line of SyntaxError in the message
        message = "".join(traceback.format_exception_only(type(e), e)).strip()
    return {"types": names[:20], "message": _short(message),
            "traceback": _short(_user_traceback(e, SOLUTION_FILE), 4 * MAX_TEXT)}


class RemoteError(Exception):
    """Mixed into exceptions raised by the solution; carries its trimmed traceback."""

    remote_traceback = ""


_REMOTE_CLASSES = {}


def _remote_exception(info):
    """A T-side exception of a matching builtin type (so `pytest.raises(ValueError)` and
    `except KeyError` in tests work). BaseException-only types (SystemExit) become plain
    errors: a solution must never stop the judge."""
    names = [str(n) for n in info.get("types", [])] or ["Exception"]
    message = str(info.get("message", ""))
    bases = [getattr(builtins, n, None) for n in names]
    bases = [b for b in bases if isinstance(b, type) and issubclass(b, Exception)] + [Exception]
    for base in bases:
        key = (names[0], base)
        try:
            if key not in _REMOTE_CLASSES:
                _REMOTE_CLASSES[key] = type(names[0], (base, RemoteError),
                                            {"__module__": "solution"})
            exc = _REMOTE_CLASSES[key](message)
        except Exception:  # noqa: BLE001 - a base with another constructor: try the next
            continue
        exc.remote_traceback = str(info.get("traceback", ""))
        return exc
    raise ProtocolError("unusable exception description")


# ----------------------------------------------------------------------------------------------
# C: the solution process
# ----------------------------------------------------------------------------------------------

def _close_fds(keep):
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _child_main(spawn, fds, code_obj, syntax_error, source):
    """Runs in the forked solution process; never returns."""
    status = 1
    try:
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")  # under a shared memory limit, the solution dies first
        except OSError:
            pass
        stdin_fd, out_fd, err_fd = fds[0], fds[1], fds[2]
        os.dup2(stdin_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        rpc_fd = None
        if spawn["mode"] == "unit":
            rpc_fd = os.dup2(fds[3], 3)
        _close_fds({3} if rpc_fd is not None else set())
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8",
                                     errors="surrogateescape")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                      errors="surrogateescape", write_through=False)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True)
        sys.argv = [SOLUTION_FILE]
        linecache.cache[SOLUTION_FILE] = (len(source), None, source.splitlines(True),
                                          SOLUTION_FILE)
        if spawn["mode"] == "stdio":
            status = _child_stdio(code_obj, syntax_error)
        else:
            status = _child_unit(socket.socket(fileno=3), code_obj, syntax_error)
    except BaseException:  # noqa: B036 - the exit status says it; nothing may escape a fork
        status = 1
    finally:
        _flush_quietly()
        os._exit(status)


def _child_stdio(code_obj, syntax_error):
    if syntax_error is not None:
        sys.stderr.write("".join(traceback.format_exception_only(type(syntax_error),
                                                                 syntax_error)))
        return 1
    try:
        exec(code_obj, {"__name__": "__main__", "__builtins__": builtins,
                        "__file__": SOLUTION_FILE})
    except SystemExit as e:
        if e.code is None or type(e.code) is int:
            return e.code or 0
        sys.stderr.write(f"{e.code}\n")
        return 1
    except BaseException as e:  # noqa: B036 - reported like Python would, trimmed
        sys.stderr.write(_user_traceback(e, SOLUTION_FILE))
        return 1
    return 0


def _child_unit(sock, code_obj, syntax_error):
    ep = Endpoint(sock, before_send=_flush_quietly)
    module = types.ModuleType("solution")
    module.__file__ = SOLUTION_FILE
    sys.modules["solution"] = module
    try:
        if syntax_error is not None:
            raise syntax_error
        exec(code_obj, module.__dict__)
    except BaseException as e:  # noqa: B036 - a broken solution is a verdict, not a crash
        ep.send({"import_error": _describe_exception(e)})
        return 0
    names = {}
    for name, value in list(module.__dict__.items()):
        if name.startswith("__"):
            continue
        if isinstance(value, types.ModuleType):
            names[name] = {"#": "module", "name": value.__name__}
        else:
            names[name] = ep.encode(value)
    ep.send({"ready": names})
    while True:
        try:
            msg = ep.recv()
        except _ChildGone:
            return 0
        ep.serve(msg)


def _flush_quietly():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: B036 - a solution may have closed or replaced them
            pass


# ----------------------------------------------------------------------------------------------
# Z: the zygote
# ----------------------------------------------------------------------------------------------

def _zygote_main(ctl, setup, first_fds):
    """Forks one solution process per request from T (the first one, if `first_fds`, without
    being asked); reports its pid, then how it ended."""
    # Drop T's stdin (the key and tests follow in it); keep fd 0 taken, so that received fds
    # never land on 0-2 where a solution process puts its own.
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    source = setup["code"]
    code_obj, syntax_error = None, None
    try:
        code_obj = compile(source, SOLUTION_FILE, "exec")
    except (SyntaxError, ValueError) as e:
        syntax_error = e if isinstance(e, SyntaxError) else SyntaxError(str(e))
    while True:
        if first_fds:
            spawn, fds, first_fds = {"mode": setup["mode"]}, first_fds, None
        else:
            try:
                data, fds, _, _ = socket.recv_fds(ctl, 4096, 8)
            except OSError:
                return
            if not data:
                return
            spawn = json.loads(data)
        pid = os.fork()
        if pid == 0:
            ctl.close()
            _child_main(spawn, fds, code_obj, syntax_error, source)
        for fd in fds:
            os.close(fd)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass  # the child set it itself, or is already gone
        ctl.send(json.dumps({"pid": pid}).encode())
        _, status = os.waitpid(pid, 0)
        try:
            os.killpg(pid, signal.SIGKILL)  # whatever the solution left in its group
        except OSError:
            pass
        ctl.send(json.dumps({"status": status}).encode())


# ----------------------------------------------------------------------------------------------
# T: the trusted judge
# ----------------------------------------------------------------------------------------------

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
    return json.loads(bytes(_read_exact(fd, n)))


def _make_undumpable():
    """PR_SET_DUMPABLE 0: same-uid processes without CAP_SYS_PTRACE can no longer read this
    process's memory (/proc/pid/mem, ptrace) or open its fds (/proc/pid/fd)."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0
    except Exception:  # noqa: BLE001 - reported in the verdict as `undumpable: false`
        return False


def _status_text(status):
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
        return f"killed by signal {name}" + (" (out of memory?)" if sig == 9 else "")
    return f"exited with code {os.WEXITSTATUS(status)}"


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
        self.prespawned = None  # (t_sock, out_r) of the solution process Z started unasked
        self.out_open = False
        self.generation = 0
        self.deadline = time.monotonic() + float(settings["time_budget_s"])
        self.critical = 0
        self.armed = False
        self.timed_out = False

    # -- the timer ---------------------------------------------------------------------------
    def on_alarm(self, signum, frame):
        self.timed_out = True
        if self.armed and not self.critical:
            self.armed = False
            raise _Timeout()

    def arm(self, seconds):
        self.timed_out, self.armed = False, True
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))

    def leave_critical(self):
        self.critical -= 1
        if not self.critical and self.timed_out and self.armed:
            self.armed = False
            raise _Timeout()

    # -- processes -------------------------------------------------------------------------
    def _ctl_recv(self, key):
        reply = self.ctl.recv(4096)
        if not reply:
            raise RuntimeError("the zygote is gone (the solution killed it?)")
        return json.loads(reply)[key]

    def spawn(self, mode, fds):
        """Asks Z for a solution process with fds (stdin, stdout, stderr[, rpc])."""
        socket.send_fds(self.ctl, [json.dumps({"mode": mode}).encode()], fds)
        return self._ctl_recv("pid")

    def reap(self, pid):
        """Kills the solution's process group and returns its wait status (from Z)."""
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return self._ctl_recv("status")

    def capture(self, data):
        room = max(int(self.settings["max_output_bytes"]) - len(self.output), 0)
        self.output += data[:room]
        self.output_dropped += max(len(data) - room, 0)

    # -- the live solution process (unit tests) ----------------------------------------------
    def wait_on(self, sock):
        """Blocks until `sock` is readable, draining the solution's output meanwhile."""
        out_fd = self.child[2]
        while True:
            fds = [sock, out_fd] if self.out_open else [sock]
            ready, _, _ = select.select(fds, [], [])
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
                pid = self._ctl_recv("pid")
            else:
                t_sock, c_side = _child_fds()
                out_r = c_side.pop()
                try:
                    pid = self.spawn("unit", c_side[:4])
                finally:
                    for fd in c_side[:4]:
                        os.close(fd)
            self.generation += 1
            ep = Endpoint(t_sock, self.generation, self.wait_on, _CALLBACK_OPS)
            self.child, self.out_open = (pid, ep, out_r), True
        finally:
            self.leave_critical()
        msg = ep.recv()
        if "import_error" in msg:
            raise _ImportFailed(msg["import_error"])
        if type(msg.get("ready")) is not dict:
            raise ProtocolError("the solution process sent no namespace")
        return ep, msg["ready"]

    def stop_child(self, wait=True):
        """Kills the live solution process (if any); returns how it ended (if `wait`)."""
        if self.child is None:
            return None
        self.critical += 1
        try:
            pid, ep, out_r = self.child
            self.drain()
            self.child = None
            if wait:
                status = self.reap(pid)
            else:
                status = None
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            ep.sock.close()
            os.close(out_r)
        finally:
            self.leave_critical()
        return status


def _child_fds():
    """T's socket, then the solution's [stdin, stdout, stderr, rpc socket] fds, then T's end of
    the output pipe (last)."""
    t_sock, c_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    out_r, out_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    return t_sock, [null, out_w, os.dup(out_w), c_sock.detach(), out_r]


class _ImportFailed(Exception):
    def __init__(self, info):
        super().__init__(info.get("message", ""))
        self.info = info


def _bind_solution(ns, ep, names, referenced, candidate, entry_point):
    """Binds the solution's top-level names into the tests' namespace and module `solution`.

    Builtins are never shadowed, and a standard-library module name always means the real
    module: a solution cannot redefine `abs` or `math.isclose` for the tests."""
    module = types.ModuleType("solution")
    for name, enc in names.items():
        if name.startswith("__") or hasattr(builtins, name):
            continue
        if name in sys.stdlib_module_names or type(enc) is dict and enc.get("#") == "module":
            if name not in referenced:
                continue  # importing costs time; only what the tests name
            real = name if name in sys.stdlib_module_names else str(enc.get("name"))
            value = _import_real(real)
            if value is None:
                continue
        else:
            value = ep.decode(enc)
        setattr(module, name, value)
        ns[name] = value
    sys.modules["solution"] = module
    if candidate is not None:
        ns[candidate] = getattr(module, entry_point, None) or _missing(entry_point)


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
    if not _CMP_FUNCS[op](left, right):
        raise AssertionError(f"assert {_short(repr(left), 300)} {op} {_short(repr(right), 300)}")


def _test_traceback(e):
    """Frames in the tests, then (for an error raised by the solution) frames in it."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == TESTS_FILE]
    remote = getattr(e, "remote_traceback", "")
    if remote:
        body = [ln for ln in remote.splitlines(True) if not ln.startswith("Traceback")]
        tail = "".join(body)
    else:
        tail = "".join(traceback.format_exception_only(type(e), e))
    head = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
    return _short(head + tail, 4 * MAX_TEXT)


def _outcome(e, judge):
    """(status, message, traceback) for a test that raised `e`."""
    if isinstance(e, _ImportFailed):
        return ("error", "the solution failed to load: " + str(e.info.get("message", "")),
                str(e.info.get("traceback", "")))
    if isinstance(e, _ChildGone):
        status = judge.stop_child()
        how = _status_text(status) if status is not None else "ended"
        return "crashed", f"the solution process {how} during this test", ""
    if isinstance(e, _Skipped):
        return "skipped", str(e), ""
    if isinstance(e, ProtocolError):
        judge.stop_child()
    status = "failed" if isinstance(e, AssertionError) else "error"
    message = "".join(traceback.format_exception_only(type(e), e)).strip()
    return status, message, _test_traceback(e)


def _run_unit_tests(judge, payload):
    source, entry_point = payload["tests"], payload.get("entry_point")
    style, _, units, candidate = split_tests(source, entry_point, payload.get("style", "auto"))
    lines = source.splitlines()
    linecache.cache[TESTS_FILE] = (len(source), None, source.splitlines(True), TESTS_FILE)
    tree = ast.parse(source, TESTS_FILE)
    referenced = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    ns = {"__name__": "tests", "__builtins__": builtins, "__judge_compare__": _judge_compare}
    import_failure = []
    test_timeout = float(payload["test_timeout_s"])

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
            _bind_solution(ns, ep, names, referenced, candidate, entry_point)
        code(ns) if kind == "pytest" else exec(code, ns)

    if style == "pytest":
        ns["pytest"] = sys.modules["pytest"] = _pytest_shim()
        queue = [("collect", "module setup", _compile_stmts(tree.body, lines))]
    else:
        queue = [("unit", name, _compile_stmts(stmts, lines)) for name, stmts in units]
    signal.signal(signal.SIGALRM, judge.on_alarm)
    results = []
    while queue:
        kind, name, code = queue.pop(0)
        start = time.monotonic()
        limit = min(test_timeout, judge.deadline - start)
        if limit <= 0.01:
            results.append(_result(name, "timeout", "not run: the judge's time budget ran out"))
            continue
        out_mark = len(judge.output)
        outcome = ("passed", "", "")
        try:
            try:
                judge.arm(limit)
                try:
                    run(kind, code)
                except _Timeout:
                    raise
                except BaseException as e:  # noqa: B036 - any failure is this test's verdict
                    outcome = _outcome(e, judge)
            finally:
                judge.armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Timeout:
            pass
        if judge.timed_out:
            outcome = ("timeout", f"timed out after {limit:.3g} s", "")
            judge.stop_child()
        judge.drain()
        excerpt = bytes(judge.output[out_mark:]).decode("utf-8", "replace")
        if kind == "collect":
            if outcome[0] != "passed":  # module setup failed: every test fails with it
                status = "timeout" if outcome[0] == "timeout" else "error"
                results += [_result(unit, status, "module setup failed: " + outcome[1],
                                    outcome[2]) for unit, _ in units]
                break
            queue = [("pytest", tname, fn) for tname, fn in _collect_pytest(ns, units)] + queue
            continue
        results.append(_result(name, *outcome, excerpt, time.monotonic() - start))
    judge.stop_child(wait=False)
    return {"tests": results}


def _result(name, status, message="", tb="", stdout="", duration=0.0):
    return {"name": name, "status": status, "message": _short(message), "traceback": tb,
            "stdout": _short(stdout), "duration_s": round(duration, 6)}


# -- a pytest subset, so pytest-style tests run without importing pytest ----------------------

class _Skipped(Exception):
    pass


class _Failed(AssertionError):
    pass


class _Raises:
    def __init__(self, expected, match=None):
        self.expected, self.match, self.value = expected, match, None

    def __enter__(self):
        return self

    def __exit__(self, etype, value, tb):
        if etype is None:
            raise _Failed(f"DID NOT RAISE {self.expected!r}")
        if not issubclass(etype, self.expected):
            return False
        if self.match is not None:
            import re
            if not re.search(self.match, str(value)):
                raise _Failed(f"regex {self.match!r} does not match {str(value)!r}")
        self.value = value
        return True


def _raises(expected, *args, match=None, **kwargs):
    ctx = _Raises(expected, match)
    if args:
        with ctx:
            args[0](*args[1:], **kwargs)
        return ctx
    return ctx


class _Approx:
    def __init__(self, expected, rel=None, abs=None):  # noqa: A002 - pytest's signature
        self.expected, self.rel, self.abs = expected, rel, abs

    def _close(self, actual, expected):
        if type(actual) not in (int, float, complex, bool) or type(expected) not in (
                int, float, complex, bool):
            return actual == expected if type(actual) is type(expected) else False
        rel = 1e-6 if self.rel is None else self.rel
        tol_abs = 1e-12 if self.abs is None else self.abs
        if actual == expected:
            return True
        return builtins.abs(actual - expected) <= max(rel * builtins.abs(expected), tol_abs)

    def __eq__(self, actual):
        exp = self.expected
        if type(exp) in (list, tuple):
            return (type(actual) in (list, tuple) and len(actual) == len(exp)
                    and all(self._close(a, e) for a, e in zip(actual, exp)))
        if type(exp) is dict:
            return (type(actual) is dict and actual.keys() == exp.keys()
                    and all(self._close(actual[k], exp[k]) for k in exp))
        return self._close(actual, exp)

    def __repr__(self):
        return f"approx({self.expected!r})"


class _Mark:
    def __getattr__(self, name):
        def mark(*args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs and name != "parametrize":
                return _apply_mark(args[0], name, (), {})
            return lambda fn: _apply_mark(fn, name, args, kwargs)
        return mark


def _apply_mark(fn, name, args, kwargs):
    marks = list(getattr(fn, "__judge_marks__", []))
    marks.append((name, args, kwargs))
    fn.__judge_marks__ = marks
    return fn


def _skip(reason=""):
    raise _Skipped(reason)


def _fail(reason=""):
    raise _Failed(reason)


def _fixture(fn=None, **_kwargs):
    if fn is None:
        return lambda f: _fixture(f)
    fn.__judge_fixture__ = True
    return fn


def _pytest_shim():
    shim = types.ModuleType("pytest")
    shim.raises, shim.approx, shim.mark = _raises, _Approx, _Mark()
    shim.skip, shim.fail, shim.fixture = _skip, _fail, _fixture
    return shim


def _collect_pytest(ns, units):
    """Yields (name, run(ns)) for each test function, parametrize expanded, in file order."""
    for unit_name, _ in units:
        obj = ns.get(unit_name)
        if isinstance(obj, type):
            for attr in sorted(vars(obj), key=lambda a: _lineno(getattr(obj, a))):
                if attr.startswith("test") and callable(getattr(obj, attr)):
                    fn = getattr(obj, attr)
                    yield from _expand(f"{unit_name}::{attr}", fn, obj)
        elif callable(obj):
            yield from _expand(unit_name, obj, None)


def _lineno(fn):
    return getattr(getattr(fn, "__code__", None), "co_firstlineno", 0)


def _expand(name, fn, cls):
    import itertools
    cases = [((), {})]
    for mark, args, kwargs in reversed(getattr(fn, "__judge_marks__", [])):
        if mark in ("skip", "skipif") and (mark == "skip" or (args and args[0])):
            reason = kwargs.get("reason", "")
            yield name, (lambda r: lambda ns: _skip(r))(reason)
            return
        if mark != "parametrize":
            continue
        argnames, values = args[0], list(args[1])
        names = [a.strip() for a in argnames.split(",")] if isinstance(argnames, str) else list(
            argnames)
        params = [(tuple(v) if len(names) > 1 else (v,)) for v in values]
        cases = [(ids + (str(i),), {**bound, **dict(zip(names, p))})
                 for (ids, bound), (i, p) in itertools.product(cases, enumerate(params))]
    for ids, bound in cases:
        label = f"{name}[{'-'.join(ids)}]" if ids else name
        yield label, (lambda b: lambda ns: _call_test(fn, cls, b, ns))(bound)


def _call_test(fn, cls, bound, ns):
    import inspect
    params = list(inspect.signature(fn).parameters)
    if cls is not None:
        params = params[1:]
    kwargs, finalizers = dict(bound), []
    for p in params:
        if p in kwargs:
            continue
        fixture = ns.get(p)
        if not getattr(fixture, "__judge_fixture__", False):
            raise TypeError(f"fixture {p!r} is not available (the judge supports "
                            "parametrize and fixtures defined in the test file)")
        value = fixture()
        if isinstance(value, types.GeneratorType):
            finalizers.append(value)
            value = next(value)
        kwargs[p] = value
    try:
        if cls is not None:
            instance = cls()
            if hasattr(instance, "setup_method"):
                instance.setup_method(fn)
            fn(instance, **kwargs)
        else:
            fn(**kwargs)
    finally:
        for gen in finalizers:
            next(gen, None)


# -- stdin/stdout ------------------------------------------------------------------------------

def _run_stdio(judge, payload):
    cases = []
    case_timeout = float(payload["case_timeout_s"])
    for inp, cap in zip(payload["inputs"], payload["output_caps"]):
        start = time.monotonic()
        left = judge.deadline - start
        if left <= 0.05:
            cases.append({"stdout": "", "stderr": "", "exit_code": None, "signal": None,
                          "timed_out": True, "not_run": True, "duration_s": 0.0,
                          "stdout_truncated": False})
            continue
        cases.append(_run_case(judge, inp, int(cap), min(case_timeout, left)))
    return {"cases": cases}


def _run_case(judge, inp, cap, timeout):
    """Runs the solution on one input; returns what it wrote and how it ended."""
    data = inp.encode("utf-8", "surrogateescape")
    try:
        stdin_fd = os.memfd_create("stdin")
    except (AttributeError, OSError):  # no memfd (old kernel, seccomp): an unlinked temp file
        import tempfile
        with tempfile.TemporaryFile() as f:
            stdin_fd = os.dup(f.fileno())
    view = memoryview(data)
    while view:
        view = view[os.write(stdin_fd, view):]
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    try:
        pid = judge.spawn("stdio", [stdin_fd, out_w, err_w])
    finally:
        for fd in (stdin_fd, out_w, err_w):
            os.close(fd)
    bufs = {out_r: bytearray(), err_r: bytearray()}
    caps = {out_r: cap, err_r: 4 * MAX_TEXT}
    dropped = {out_r: 0, err_r: 0}

    def read(fd):
        chunk = os.read(fd, 65536)
        room = max(caps[fd] - len(bufs[fd]), 0)
        bufs[fd] += chunk[:room]
        dropped[fd] += max(len(chunk) - room, 0)
        return chunk

    open_fds, status, timed_out = [out_r, err_r], None, False
    deadline = start + timeout
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select(open_fds + [judge.ctl], [], [], left)
        for fd in ready:
            if fd is not judge.ctl and not read(fd):
                open_fds.remove(fd)
        if dropped[out_r]:
            break  # over its output cap: the answer is wrong anyway, stop it now
        if judge.ctl in ready:
            status = judge._ctl_recv("status")
    if status is None:
        status = judge.reap(pid)
    duration = time.monotonic() - start
    for fd in open_fds:  # what is already written; grandchildren may hold the pipes open
        while select.select([fd], [], [], 0)[0] and read(fd):
            pass
    os.close(out_r)
    os.close(err_r)
    signaled = os.WIFSIGNALED(status)
    return {
        "stdout": base64.b64encode(bytes(bufs[out_r])).decode(),
        "stdout_truncated": dropped[out_r] > 0,
        "stderr": bytes(bufs[err_r]).decode("utf-8", "replace"),
        "exit_code": None if signaled else os.WEXITSTATUS(status),
        "signal": os.WTERMSIG(status) if signaled else None,
        "timed_out": timed_out,
        "not_run": False,
        "duration_s": round(duration, 6),
    }


# -- main --------------------------------------------------------------------------------------

def _sanitize_path():
    """The work dir is the solution's: nothing may be imported from it into T."""
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != cwd
                   and not os.path.abspath(p).startswith(cwd + os.sep)]
    sys.dont_write_bytecode = True


def main():
    undumpable = _make_undumpable()
    _sanitize_path()
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)
    setup = _read_section(0)
    ctl, z_ctl = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # Unit tests: Z starts the first solution process at once, while T reads the tests.
    t_sock, c_side = _child_fds() if setup["mode"] == "unit" else (None, [])
    zygote = os.fork()
    if zygote == 0:
        ctl.close()
        status = 0
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            _close_fds({z_ctl.fileno(), 2, *c_side[:4]})
            _zygote_main(z_ctl, setup, c_side[:4])
        except BaseException:  # noqa: B036 - nothing may escape a fork
            status = 1
        os._exit(status)
    z_ctl.close()
    for fd in c_side[:4]:
        os.close(fd)
    # Only now, with no solution process able to inherit them, read the key and the tests.
    key = bytes(_read_exact(0, KEY_BYTES))
    payload = _read_section(0)
    os.close(0)
    judge = Judge(ctl, payload)
    if t_sock is not None:
        judge.prespawned = (t_sock, c_side[4])
    report = {"mode": setup["mode"], "undumpable": undumpable, "error": None}
    try:
        if setup["mode"] == "unit":
            report.update(_run_unit_tests(judge, payload))
        else:
            report.update(_run_stdio(judge, payload))
    except BaseException as e:  # noqa: B036 - a harness failure is reported, signed
        report["error"] = _short("".join(traceback.format_exception(type(e), e,
                                                                    e.__traceback__)))
    report["output"] = bytes(judge.output).decode("utf-8", "replace")
    report["output_dropped"] = judge.output_dropped
    ctl.close()
    try:
        os.kill(zygote, signal.SIGKILL)
        os.waitpid(zygote, 0)
    except OSError:
        pass
    body = json.dumps(report, separators=(",", ":")).encode()
    mac = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    data = REPORT_PREFIX + mac + b" " + body + b"\n"
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


if __name__ == "__main__":
    main()
