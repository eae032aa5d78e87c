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
    `solution` and answers T's requests (calls, attribute access, operators) with plain data
    (exact builtin types, which T decodes into genuine builtin objects) or opaque
    references, which never compare equal to plain data. For stdin/stdout it runs as
    `__main__` on one case's input; the expected outputs never enter the sandbox.

Z and C import only C-level modules (the solution's own imports are its cost); what only T
needs is imported where T needs it. `split_tests` is shared with the host.
"""

import _signal
import _socket
import binascii
import builtins
import io
import marshal
import operator
import os
import select
import struct
import sys
import time

SOLUTION_FILE = "solution.py"
TESTS_FILE = "tests.py"
REPORT_PREFIX = b"JUDGE-REPORT "
KEY_BYTES = 32
MAX_MESSAGE_BYTES = 32 << 20  # one RPC message; a larger one is a protocol violation
MAX_TEXT = 2000  # chars kept of a message, traceback or output excerpt in the report
MAX_DEPTH = 200  # nesting depth of plain data; deeper values travel as references
BATCH = 64  # items fetched per round trip when T iterates over a solution's iterator
_SOURCES = {}  # file name -> source lines, for tracebacks


# ----------------------------------------------------------------------------------------------
# JSON without the json module (which imports re, enum, ...: milliseconds per solution process)
# ----------------------------------------------------------------------------------------------

def _json_codec():
    def no_default(obj):
        raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")
    try:
        import _json

        class Context:
            strict, object_hook, object_pairs_hook = True, None, None
            parse_float, parse_int = float, int
            parse_constant = {"NaN": float("nan"), "Infinity": float("inf"),
                              "-Infinity": float("-inf")}.__getitem__
            memo = {}

        scan = _json.make_scanner(Context())
        encode = _json.make_encoder(None, no_default, _json.encode_basestring_ascii, None,
                                    ":", ",", False, False, True)

        def dumps(obj):
            return "".join(encode(obj, 0))

        def loads(text):
            try:
                obj, end = scan(text, 0)
            except StopIteration:
                raise ValueError("no JSON value") from None
            if end != len(text):
                raise ValueError("extra data after the JSON value")
            return obj

        sample = [1, -2.5, "é\udc80", None, True, {"#": [float("inf")]}]
        if repr(loads(dumps(sample))) == repr(sample):
            return dumps, loads
    except Exception:  # noqa: BLE001 - another interpreter's _json: use the module
        pass
    import json
    return (lambda obj: json.dumps(obj, separators=(",", ":"), default=no_default)), json.loads


_dumps, _loads = _json_codec()


# ----------------------------------------------------------------------------------------------
# Splitting tests into units (T and the host)
# ----------------------------------------------------------------------------------------------

def _has_assert(node):
    """Whether `node` contains an assert outside nested function and class bodies."""
    import ast
    if isinstance(node, ast.Assert):
        return True
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if _has_assert(child):
            return True
    return False


def _is_pytest_def(stmt):
    import ast
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return stmt.name.startswith("test")
    return isinstance(stmt, ast.ClassDef) and stmt.name.startswith("Test")


def split_tests(source, entry_point=None, style="auto"):
    """Parses test code into (style, units, candidate_name).

    assert style: each top-level statement that contains an `assert` is one test, run after
    the other statements that precede it (where no top-level statement has an assert, each
    bare call such as `check(f)` is a test). With `entry_point`, a HumanEval-style
    `def check(candidate)` is unrolled: its statements are the units and `candidate` is bound
    to the solution's `entry_point`.
    pytest style: each `test*` function and `Test*` class method is a test (expanded at run
    time by `parametrize`); the other module statements are setup, run once.
    Units are (name, [stmts]). Raises ValueError for code that does not parse or has no test.
    """
    import ast
    try:
        module = ast.parse(source, TESTS_FILE)
    except SyntaxError as e:
        raise ValueError(f"the tests do not parse: {e.msg} (line {e.lineno})") from None
    if style == "auto":
        style = "pytest" if any(_is_pytest_def(s) for s in module.body) else "assert"
    if style not in ("assert", "pytest"):
        raise ValueError(f"style must be 'auto', 'assert' or 'pytest', got {style!r}")
    if style == "pytest":
        units = [(s.name, [s]) for s in module.body if _is_pytest_def(s)]
        if not units:
            raise ValueError("the tests define no test* function or Test* class")
        return style, units, None
    lines = source.splitlines()
    body, candidate, pending = module.body, None, []
    check = [s for s in body if isinstance(s, ast.FunctionDef) and s.name == "check"]
    if entry_point is not None and check and check[0].args.args:
        candidate = check[0].args.args[0].arg
        pending = [s for s in body if s is not check[0] and not (
            isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
            and isinstance(s.value.func, ast.Name) and s.value.func.id == "check")]
        body = check[0].body
    calls_are_tests = not any(_has_assert(s) for s in body)
    units = []
    for stmt in body:
        pending.append(stmt)
        if _has_assert(stmt) or calls_are_tests and isinstance(stmt, ast.Expr) and isinstance(
                stmt.value, ast.Call):
            text = lines[stmt.lineno - 1].strip() if stmt.lineno <= len(lines) else ""
            units.append((f"line {stmt.lineno}: {text[:100]}", pending))
            pending = []
    if not units:
        raise ValueError("the tests contain no assert statement (nor a call such as check(f))")
    return style, units, candidate


_CMP = {"Eq": "==", "NotEq": "!=", "Lt": "<", "LtE": "<=", "Gt": ">", "GtE": ">=",
        "In": "in", "NotIn": "not in", "Is": "is", "IsNot": "is not"}
_CMP_FUNCS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
              ">": operator.gt, ">=": operator.ge, "in": lambda a, b: a in b,
              "not in": lambda a, b: a not in b, "is": operator.is_, "is not": operator.is_not}


def _compile_stmts(stmts, lines):
    """Compiles test statements with every `assert` made an explicit check: immune to
    `python -O`, and a failing single comparison reports both values (`assert 5 == 4`)."""
    import ast

    class Rewriter(ast.NodeTransformer):
        def visit_Assert(self, node):
            self.generic_visit(node)
            test = node.test
            if (node.msg is None and isinstance(test, ast.Compare) and len(test.ops) == 1
                    and type(test.ops[0]).__name__ in _CMP):
                op = ast.Constant(_CMP[type(test.ops[0]).__name__])
                new = ast.Expr(ast.Call(ast.Name("__judge_compare__", ast.Load()),
                                        [test.left, op, test.comparators[0]], []))
            else:
                end = min(node.end_lineno or node.lineno, len(lines))
                text = " ".join(lines[i].strip() for i in range(node.lineno - 1, end))
                msg = node.msg if node.msg is not None else ast.Constant(text)
                raise_ = ast.Raise(ast.Call(ast.Name("AssertionError", ast.Load()), [msg], []))
                new = ast.If(ast.UnaryOp(ast.Not(), test), [raise_], [])
            return ast.copy_location(new, node)

    module = ast.Module(body=[Rewriter().visit(s) for s in stmts], type_ignores=[])
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

    def _same_side(self, other):
        return type(other) is _Remote and other._judge_ep is self._judge_ep

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

    def __repr__(self):
        try:
            return self._judge_op("repr")
        except BaseException:  # noqa: B036 - repr is for messages; never fail a report on it
            return "<object of the solution>"

    def __iter__(self):
        it = self._judge_op("iter")
        while True:
            items, done = it._judge_op("next_batch", BATCH)
            yield from items
            if done:
                return

    def __instancecheck__(self, obj):
        return self._same_side(obj) and self._judge_op("isinstance", obj)

    def __subclasscheck__(self, cls):
        return self._same_side(cls) and self._judge_op("issubclass", cls)


def _forward(name, arity, compare=False):
    if compare:
        def method(self, other):
            return self._judge_op(name, other) if self._same_side(other) else NotImplemented
    elif arity == 1:
        def method(self):
            return self._judge_op(name)
    else:
        def method(self, *args):
            return self._judge_op(name, *args)
    method.__name__ = f"__{name}__"
    return method


_BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
           "xor", "lshift", "rshift")
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(_Remote, f"__{_name}__", _forward(_name, 2, compare=True))
for _name in ("hash", "bool", "len", "str", "int", "float", "index", "next", "neg", "pos",
              "abs", "invert"):
    setattr(_Remote, f"__{_name}__", _forward(_name, 1))
for _name in ("format", "contains", "getitem", "setitem", "delitem") + _BINARY + tuple(
        "r" + b for b in _BINARY):
    setattr(_Remote, f"__{_name}__", _forward(_name, 2))

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
# T lets the solution only call, iterate and compare what T hands it (callbacks): attribute
# access would reach `__globals__` and `__code__`, and from there anything in T.
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
        self.generation = generation
        self.on_wait = on_wait  # T: waits for the socket, draining the solution's output
        self.allowed_ops = allowed_ops
        self.before_send = before_send  # C: flushes the solution's prints before each reply
        self.objects = {}
        self.next_id = 0
        self.next_msg = 0

    # -- values ----------------------------------------------------------------------------
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
            return {"#": "dict", "v": [[self.encode(k, d), self.encode(x, d)]
                                       for k, x in v.items()]}
        if t is set or t is frozenset:
            return {"#": t.__name__, "v": [self.encode(x, d) for x in v]}
        if t is bytes or t is bytearray:
            return {"#": t.__name__, "v": binascii.b2a_base64(v, newline=False).decode()}
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
        if tag in ("bytes", "bytearray"):
            data = binascii.a2b_base64(v)
            return data if tag == "bytes" else bytearray(data)
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
        data = _dumps(msg).encode()
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
            msg = _loads(self._recv_exact(n).decode())
        except (ValueError, RecursionError) as e:
            raise ProtocolError(f"message is not valid JSON: {e}") from None
        if type(msg) is not dict:
            raise ProtocolError("message is not an object")
        return msg

    def request(self, head, target, args=(), kwargs=None):
        if target is not None and target._judge_gen != self.generation:
            raise RuntimeError("an object from before the solution was restarted was used")
        self.next_msg += 1
        msg_id = self.next_msg
        self.send({**head, "id": msg_id, "args": [self.encode(a) for a in args],
                   "kwargs": {k: self.encode(v) for k, v in (kwargs or {}).items()}})
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
        """Executes one request from the other side and sends the reply, with the new value
        of each list/dict/set argument the call changed in place."""
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
                now = self.encode(a)
                if now != (msg["args"][i] if type(i) is int else msg["kwargs"][i]):
                    sync.append([i, now])
        if sync:
            reply["sync"] = sync
        try:
            self.send(reply)
        except (ValueError, TypeError, RecursionError, ProtocolError) as e:
            self.send({"re": msg.get("id"), "exc": _describe_exception(e)})


def _sync(obj, new):
    """Applies the other side's in-place change of an argument (`xs.sort()` in a solution)."""
    if type(obj) is not type(new):
        raise TypeError(f"{type(obj).__name__} became {type(new).__name__}")
    if type(obj) in (list, bytearray):
        obj[:] = new
    elif type(obj) in (dict, set):
        obj.clear()
        obj.update(new)


_NAMEDTUPLES = {}
_COLLECTIONS = ("OrderedDict", "Counter", "defaultdict", "deque")


def _encode_known(ep, v, d):
    """Standard-library and numpy values that are data, not behaviour."""
    t = type(v)
    if isinstance(v, tuple) and hasattr(t, "_fields") and all(type(f) is str for f in t._fields):
        return {"#": "namedtuple", "name": t.__name__, "fields": list(t._fields),
                "v": [ep.encode(x, d) for x in v]}
    mod, name = t.__module__, t.__name__
    if mod == "collections" and name in _COLLECTIONS:
        if name == "deque":
            return {"#": "deque", "v": [ep.encode(x, d) for x in v]}
        return {"#": name, "v": [[ep.encode(k, d), ep.encode(x, d)] for k, x in v.items()]}
    if mod in ("decimal", "fractions") and name in ("Decimal", "Fraction"):
        return {"#": name, "v": str(v)}
    if mod == "numpy" and hasattr(v, "tolist"):
        if getattr(v, "ndim", None) == 0 or name != "ndarray":
            return ep.encode(v.item(), d)
        return {"#": "ndarray", "dtype": str(v.dtype), "v": ep.encode(v.tolist(), d)}
    return None


def _decode_known(ep, tag, x):
    import collections
    v = x.get("v")
    if tag == "namedtuple":
        key = (str(x["name"]), tuple(str(f) for f in x["fields"]))
        if key not in _NAMEDTUPLES:
            if len(_NAMEDTUPLES) > 1000:
                raise ProtocolError("too many namedtuple types")
            _NAMEDTUPLES[key] = collections.namedtuple(key[0], key[1], rename=True)
        return _NAMEDTUPLES[key](*[ep.decode(e) for e in v])
    if tag in _COLLECTIONS:
        if tag == "deque":
            return collections.deque(ep.decode(e) for e in v)
        items = {ep.decode(k): ep.decode(e) for k, e in v}
        return collections.defaultdict(None, items) if tag == "defaultdict" else getattr(
            collections, tag)(items)
    if tag in ("Decimal", "Fraction"):
        import decimal
        import fractions
        return (decimal.Decimal if tag == "Decimal" else fractions.Fraction)(str(v))
    if tag == "ndarray":
        import numpy
        return numpy.array(ep.decode(v), dtype=str(x["dtype"]))
    raise ProtocolError(f"unknown value tag {tag!r}")


# ----------------------------------------------------------------------------------------------
# Exceptions and tracebacks
# ----------------------------------------------------------------------------------------------

def _exception_line(e):
    """`ValueError: message`, as Python prints it (SyntaxError with its caret)."""
    t = type(e)
    name = t.__qualname__ if t.__module__ in ("builtins", "__main__", "solution") else (
        f"{t.__module__}.{t.__qualname__}")
    if isinstance(e, SyntaxError) and e.lineno:
        text = (e.text or "").rstrip("\n")
        code = text.lstrip()
        caret = " " * max((e.offset or 1) - 1 - (len(text) - len(code)), 0) + "^"
        return (f'  File "{e.filename}", line {e.lineno}\n    {code}\n    {caret}\n'
                f"{name}: {e.msg}\n")
    try:
        message = str(e)
    except BaseException:  # noqa: B036 - a broken __str__ is the solution's problem
        message = "<unprintable>"
    return f"{name}: {message}\n" if message else f"{name}\n"


def _frames(e, filename):
    """The traceback lines of `e` in `filename` (others are the judge's, or libraries')."""
    out, tb, src = [], e.__traceback__, _SOURCES.get(filename, ())
    while tb is not None:
        code, n = tb.tb_frame.f_code, tb.tb_lineno
        if code.co_filename == filename and n is not None:
            out.append(f'  File "{filename}", line {n}, in {code.co_name}\n')
            if 0 < n <= len(src) and src[n - 1].strip():
                out.append(f"    {src[n - 1].strip()}\n")
        tb = tb.tb_next
    return out


def _user_traceback(e, filename):
    frames = _frames(e, filename)
    head = "Traceback (most recent call last):\n" if frames else ""
    return head + "".join(frames) + _exception_line(e)


def _describe_exception(e):
    message = _exception_line(e).rstrip("\n")
    name = type(e).__qualname__
    message = message[len(name) + 2:] if message.startswith(name + ": ") else message
    return {"types": [c.__name__ for c in type(e).__mro__][:20], "message": _short(message),
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
                mro = (base, RemoteError) if base is not Exception else (RemoteError,)
                # __module__ "builtins": messages read "ValueError: ...", as Python prints.
                _REMOTE_CLASSES[key] = type(names[0], mro, {"__module__": "builtins"})
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
        _close_fds({3} if mode == "unit" else set())
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8",
                                     errors="surrogateescape")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                      errors="surrogateescape")
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True)
        sys.argv = [SOLUTION_FILE]
        _SOURCES[SOLUTION_FILE] = source.splitlines()
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
        sys.stderr.write(_exception_line(syntax_error))
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
    module = type(sys)("solution")
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
        if isinstance(value, type(sys)):
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


# ----------------------------------------------------------------------------------------------
# Z: the zygote
# ----------------------------------------------------------------------------------------------

def _send_fds(sock, data, fds):
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
        code_obj = compile(source, SOLUTION_FILE, "exec")
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
if boot["marshal"]:
    code = marshal.loads(zlib.decompress(binascii.a2b_base64(boot["compiled"])))
else:
    code = compile(zlib.decompress(binascii.a2b_base64(boot["source"])), "judge_harness.py",
                   "exec")
ns = {"__name__": "judge_zygote"}
exec(code, ns)
ns["zygote_entry"](boot)
"""


def zygote_entry(boot):
    """Z started as a fresh interpreter: its control socket is fd 3, the first solution
    process's fds (unit tests) are 4-7."""
    _set_interpreter_limits()
    first = [4, 5, 6, 7] if boot["mode"] == "unit" else None
    _zygote_main(_socket.socket(fileno=3), boot["mode"], boot["code"], first)


def _memfd(data):
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


def _start_zygote(setup, first_fds):
    """(pid, T's control socket) of Z: a fresh interpreter if this run's memory may hold
    secrets (see the module docstring), else a fork made before T reads any secret."""
    t_ctl, z_ctl = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    payload = globals().get("_JUDGE_PAYLOAD", {}).get("judge_harness")
    if os.environ.get("SANDBOX_CLEAN_FORK") == "1" or payload is None or not sys.executable:
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                t_ctl.close()
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                _close_fds({z_ctl.fileno(), *first_fds})
                _zygote_main(z_ctl, setup["mode"], setup["code"], first_fds)
            except BaseException:  # noqa: B036 - nothing may escape a fork
                status = 1
            os._exit(status)
    else:
        import fcntl
        boot = marshal.dumps({"marshal": globals()["_JUDGE_MARSHAL"], "compiled": payload[0],
                              "source": payload[1], "mode": setup["mode"],
                              "code": setup["code"]})
        sources = [_memfd(boot), os.open(os.devnull, os.O_WRONLY), z_ctl.fileno(), *first_fds]
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


# ----------------------------------------------------------------------------------------------
# T: the trusted judge
# ----------------------------------------------------------------------------------------------

_SIGNAL_NAMES = {4: "SIGILL", 6: "SIGABRT", 7: "SIGBUS", 8: "SIGFPE", 9: "SIGKILL",
                 11: "SIGSEGV", 15: "SIGTERM", 24: "SIGXCPU", 25: "SIGXFSZ", 31: "SIGSYS"}


def _status_text(status):
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"killed by signal {_SIGNAL_NAMES.get(sig, sig)}" + (
            " (out of memory?)" if sig == 9 else "")
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
        self.out_open = False
        self.prespawned = None  # (t_sock, out_r) of the solution process Z started unasked
        self.generation = 0
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
        _send_fds(self.ctl, b"spawn", fds)
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


def _bind_solution(ns, ep, names, referenced, candidate, entry_point):
    """Binds the solution's top-level names into the tests' namespace and module `solution`.

    Builtins are never shadowed, and a standard-library module name always means the real
    module: a solution cannot redefine `abs` or `math.isclose` for the tests."""
    module = type(sys)("solution")
    for name, enc in names.items():
        if name.startswith("__") or hasattr(builtins, name):
            continue
        if name in sys.stdlib_module_names or type(enc) is dict and enc.get("#") == "module":
            if name not in referenced:
                continue  # importing costs time; only what the tests name
            value = _import_real(name if name in sys.stdlib_module_names else str(enc["name"]))
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
    remote = getattr(e, "remote_traceback", "")
    if remote:
        tail = "".join(ln for ln in remote.splitlines(True) if not ln.startswith("Traceback"))
    else:
        tail = _exception_line(e)
    head = "Traceback (most recent call last):\n" + "".join(_frames(e, TESTS_FILE))
    return _short(head + tail, 4 * MAX_TEXT)


def _outcome(e, judge, pytest_module):
    """(status, message, traceback) for a test that raised `e`."""
    if isinstance(e, _ImportFailed):
        return ("error", "the solution failed to load: " + str(e.info.get("message", "")),
                str(e.info.get("traceback", "")))
    if isinstance(e, _ChildGone):  # it closed the channel: it is exiting, or soon killed
        status = judge.stop_child(grace_s=0.5)
        how = _status_text(status) if status is not None else "ended"
        return "crashed", f"the solution process {how} during this test", ""
    if pytest_module is not None and isinstance(e, pytest_module.Skipped):
        return "skipped", str(e), ""
    if isinstance(e, ProtocolError):
        judge.stop_child()
    status = "failed" if isinstance(e, AssertionError) else "error"
    return status, _exception_line(e).strip(), _test_traceback(e)


def _run_unit_tests(judge, payload):
    import ast
    source, entry_point = payload["tests"], payload.get("entry_point")
    style, units, candidate = split_tests(source, entry_point, payload.get("style", "auto"))
    lines = source.splitlines()
    _SOURCES[TESTS_FILE] = lines
    tree = ast.parse(source, TESTS_FILE)
    referenced = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    ns = {"__name__": "tests", "__builtins__": builtins, "__judge_compare__": _judge_compare}
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
            _bind_solution(ns, ep, names, referenced, candidate, entry_point)
        code(ns) if kind == "pytest" else exec(code, ns)

    if style == "pytest":
        pytest_module = _load_module("judge_pytest")
        ns["pytest"] = sys.modules["pytest"] = pytest_module.shim()
        queue = [("collect", "module setup", _compile_stmts(tree.body, lines))]
    else:
        queue = [("unit", name, _compile_stmts(stmts, lines)) for name, stmts in units]
    _signal.signal(_signal.SIGALRM, judge.on_alarm)
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
                    outcome = _outcome(e, judge, pytest_module)
            finally:
                judge.armed = False
                _signal.setitimer(_signal.ITIMER_REAL, 0)
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
            queue = [("pytest", tname, fn)
                     for tname, fn in pytest_module.collect(ns, units)] + queue
            continue
        results.append(_result(name, *outcome, excerpt, time.monotonic() - start))
    judge.stop_child(wait=False)
    return {"tests": results}


def _load_module(name):
    """Another module of the judge, from the payload the run was given (or from disk)."""
    payload = globals().get("_JUDGE_PAYLOAD", {}).get(name)
    module = type(sys)(name)
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
    return module


def _result(name, status, message="", tb="", stdout="", duration=0.0):
    return {"name": name, "status": status, "message": _short(message), "traceback": tb,
            "stdout": _short(stdout), "duration_s": round(duration, 6)}


# -- stdin/stdout ------------------------------------------------------------------------------

def _run_stdio(judge, payload):
    cases = []
    for inp, cap in zip(payload["inputs"], payload["output_caps"]):
        left = judge.deadline - time.monotonic()
        if left <= 0.05:
            cases.append({"stdout": "", "stderr": "", "exit_code": None, "signal": None,
                          "timed_out": True, "not_run": True, "duration_s": 0.0,
                          "stdout_truncated": False})
            continue
        cases.append(_run_case(judge, inp, int(cap), min(float(payload["case_timeout_s"]),
                                                         left)))
    return {"cases": cases}


def _run_case(judge, inp, cap, timeout):
    """Runs the solution on one input; returns what it wrote and how it ended."""
    stdin_fd = _memfd(inp.encode("utf-8", "surrogateescape"))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    try:
        pid = judge.spawn([stdin_fd, out_w, err_w])
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
            status = judge.ctl_recv()
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
        "stdout": binascii.b2a_base64(bytes(bufs[out_r]), newline=False).decode(),
        "stdout_truncated": dropped[out_r] > 0,
        "stderr": bytes(bufs[err_r]).decode("utf-8", "replace"),
        "exit_code": None if signaled else os.WEXITSTATUS(status),
        "signal": os.WTERMSIG(status) if signaled else None,
        "timed_out": timed_out,
        "not_run": False,
        "duration_s": round(duration, 6),
    }


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
    return _loads(bytes(_read_exact(fd, n)).decode())


def _set_interpreter_limits():
    if hasattr(sys, "set_int_max_str_digits"):  # big ints travel as JSON digits
        sys.set_int_max_str_digits(0)


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
    _set_interpreter_limits()
    setup = _read_section(0)
    t_sock, c_side, out_r = _child_fds() if setup["mode"] == "unit" else (None, [], None)
    zygote, ctl = _start_zygote(setup, c_side)
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
            report.update(_run_stdio(judge, payload))
    except BaseException as e:  # noqa: B036 - a harness failure is reported, signed
        import traceback
        report["error"] = _short("".join(traceback.format_exception(type(e), e,
                                                                    e.__traceback__)))
    report["output"] = bytes(judge.output).decode("utf-8", "replace")
    report["output_dropped"] = judge.output_dropped
    ctl.close()
    try:
        os.kill(zygote, _signal.SIGKILL)
        os.waitpid(zygote, 0)
    except OSError:
        pass
    import hashlib
    import hmac
    body = _dumps(report).encode()
    mac = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    view = memoryview(REPORT_PREFIX + mac + b" " + body + b"\n")
    while view:
        view = view[os.write(1, view):]


if __name__ == "__main__":
    main()
