"""Values and calls across the judge's channel between its trusted process and the solution.

Values travel as plain data (judge/codec.py) and are decoded into genuine builtin objects;
any other object stays where it lives and travels as a handle (`Handle`). In T, a handle to a
solution's object can only be called, have its attributes read or set and its len() taken:
every other use is an `Unjudgeable` verdict, so the solution's code never decides anything
about a value the tests compare. Exceptions travel as descriptions and are raised again
as exceptions of the matching builtin type, with the traceback trimmed to the solution.
Imports only C-level modules: a solution process pays nothing for it. See judge/harness.py.
"""

import builtins
import operator
import struct

codec = _load_module("codec")  # noqa: F821 - given by the harness's module loader
ProtocolError, TooLarge, MAX_ITEMS = codec.ProtocolError, codec.TooLarge, codec.MAX_ITEMS

SOLUTION_FILE = "solution.py"
MAX_MESSAGE_BYTES = 32 << 20  # one RPC message; a larger one is a protocol violation
MAX_TEXT = 2000  # chars kept of a message, traceback or output excerpt in the report
SOURCES = {}  # file name -> source lines, for tracebacks


# -- JSON without the json module (it imports re, enum, ...: milliseconds a process) ----------

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


dumps, loads = _json_codec()


# -- plain data and references ------------------------------------------------------------------

class ChildGone(Exception):
    """The solution process ended (crashed, exited, was killed) while T waited on it."""


def short(text, limit=MAX_TEXT):
    text = str(text)
    return text if len(text) <= limit else text[:limit // 2] + " ... " + text[-limit // 2:]



class Unjudgeable(BaseException):
    """T did something to a solution's object that only the solution's own code could answer
    (compare it, do arithmetic on it, test `in`, hash or print it, ...), or the solution
    returned a value too large to cross. The test's verdict is `unjudgeable`. A BaseException,
    so that a test's `except Exception` cannot swallow it (T also records it, see Endpoint)."""


# -- references ---------------------------------------------------------------------------------

# What T may do with a handle to a solution's object: call it (a function, a class, a method),
# read or set an attribute, take len(), ask isinstance/issubclass. Everything else would have
# the solution's code decide about a value the tests compare: unjudgeable.
_T_ALLOWED = frozenset({"call", "getattr", "setattr", "delattr", "len", "isinstance",
                        "issubclass"})


class Handle:
    """An object that lives on the other side of an endpoint.

    In T (`ep.strict`), a handle stands for a solution's function, class or object: it can be
    called, its attributes read and set, its len() taken; what comes back is plain data or
    another handle. Any other use (==, <, +, -, `in`, hash, bool, str, int, iteration,
    indexing, ...) raises `Unjudgeable`, naming the object's type: the solution's code never
    answers a question about a value the tests compare. In C, a handle is a callback of T's
    (T serves only CALLBACK_OPS on it)."""

    __slots__ = ("_judge_ep", "_judge_id", "_judge_gen", "_judge_type")

    def __init__(self, ep, ref_id, type_name="object"):
        object.__setattr__(self, "_judge_ep", ep)
        object.__setattr__(self, "_judge_id", ref_id)
        object.__setattr__(self, "_judge_gen", ep.generation)
        object.__setattr__(self, "_judge_type", short(type_name, 100))

    def _judge_op(self, op, *args):
        ep = self._judge_ep
        if ep.strict and op not in _T_ALLOWED:
            ep.unjudgeable(f"the solution's value of type {self._judge_type!r} cannot be "
                           f"judged ({_WHAT.get(op, op)} would run the solution's code; only "
                           f"plain data is compared: numbers, strings, bytes, containers)")
        return ep.request({"op": op, "ref": self._judge_id}, self, args)

    def _same_side(self, other):
        return type(other) is Handle and other._judge_ep is self._judge_ep

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
        if self._judge_ep.strict:  # for messages: never the solution's code
            return f"<{self._judge_type} object of the solution>"
        return self._judge_op("repr")

    def __iter__(self):
        return self._judge_op("iter")

    def __instancecheck__(self, obj):
        return self._same_side(obj) and self._judge_op("isinstance", obj)

    def __subclasscheck__(self, cls):
        return self._same_side(cls) and self._judge_op("issubclass", cls)


_WHAT = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "hash": "hash()",
         "bool": "truth", "str": "str()", "format": "format()", "contains": "`in`",
         "iter": "iteration", "getitem": "indexing", "int": "int()", "float": "float()",
         "index": "use as an index", "repr": "repr()"}


def _forward(name, arity):
    if arity == 1:
        def method(self):
            return self._judge_op(name)
    else:
        def method(self, *args):
            return self._judge_op(name, *args)
    method.__name__ = f"__{name}__"
    return method


def _compare(name):
    def method(self, other):
        if self._judge_ep.strict or self._same_side(other):
            return self._judge_op(name, other)
        return NotImplemented
    method.__name__ = f"__{name}__"
    return method


_BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
           "xor", "lshift", "rshift")
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(Handle, f"__{_name}__", _compare(_name))
for _name in ("hash", "bool", "len", "str", "int", "float", "index", "next", "neg", "pos",
              "abs", "invert"):
    setattr(Handle, f"__{_name}__", _forward(_name, 1))
for _name in ("format", "contains", "getitem", "setitem", "delitem") + _BINARY + tuple(
        "r" + b for b in _BINARY):
    setattr(Handle, f"__{_name}__", _forward(_name, 2))

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

_MUTABLE = (list, dict, set, bytearray)
# T lets the solution only call, iterate and compare what T hands it (callbacks): attribute
# access would reach `__globals__` and `__code__`, and from there anything in T.
CALLBACK_OPS = frozenset(
    {"call", "iter", "next", "len", "bool", "hash", "eq", "ne", "lt", "le", "gt",
     "ge", "contains", "getitem", "repr", "str", "format", "int", "float", "index"})


class Endpoint:
    """One side of the T <-> C channel: length-prefixed JSON over a stream socket.

    `request` sends one request and serves the other side's nested requests (callbacks) until
    its reply arrives. Values go as plain data (`encode`); objects that are not are kept in
    `objects` and sent as handles. `strict` (T): handles allow only _T_ALLOWED, and
    `on_unjudgeable(message)` records the first misuse of one."""

    def __init__(self, sock, generation=0, on_wait=None, allowed_ops=None, before_send=None,
                 on_unjudgeable=None):
        self.sock = sock
        self.generation = generation
        self.on_wait = on_wait  # T: waits for the socket, draining the solution's output
        self.allowed_ops = allowed_ops
        self.before_send = before_send  # C: flushes the solution's prints before each reply
        self.strict = on_unjudgeable is not None
        self.on_unjudgeable = on_unjudgeable
        self.objects = {}
        self.next_id = 0
        self.next_msg = 0

    def unjudgeable(self, message):
        self.on_unjudgeable(message)
        raise Unjudgeable(message)

    # -- values ----------------------------------------------------------------------------
    def encode(self, v):
        return codec.encode(v, self._ref, self._own)

    def _ref(self, v):
        self.next_id += 1
        self.objects[self.next_id] = v
        return ["h", self.next_id, type(v).__name__]

    def _own(self, v):
        if type(v) is Handle and v._judge_ep is self:
            if v._judge_gen != self.generation:
                raise RuntimeError("an object from before the solution was restarted was used")
            return v._judge_id
        return None

    def decode(self, tokens):
        return codec.decode(tokens, self._handle, self._back)

    def _handle(self, tok):
        return Handle(self, int(tok[1]), str(tok[2]) if len(tok) > 2 else "object")

    def _back(self, ref_id):
        try:
            return self.objects[ref_id]
        except KeyError:
            raise ProtocolError(f"unknown reference {ref_id!r}") from None

    # -- messages --------------------------------------------------------------------------
    def send(self, msg):
        if self.before_send is not None:
            self.before_send()
        data = dumps(msg).encode()
        if len(data) > MAX_MESSAGE_BYTES:
            raise TooLarge(f"message of {len(data)} bytes is over the limit")
        self.sock.sendall(struct.pack("<I", len(data)) + data)

    def _recv_exact(self, n):
        chunks = []
        while n:
            if self.on_wait is not None:
                self.on_wait(self.sock)
            chunk = self.sock.recv(min(n, 1 << 20))
            if not chunk:
                raise ChildGone()
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def recv(self):
        (n,) = struct.unpack("<I", self._recv_exact(4))
        if n > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"message of {n} bytes is over the limit")
        try:
            msg = loads(self._recv_exact(n).decode())
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
            if "unjudgeable" in msg and self.strict:
                self.unjudgeable(short(str(msg["unjudgeable"]), 300))
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
        except TooLarge as e:
            reply = {"re": msg.get("id"), "unjudgeable": f"the solution returned {e}"}
        except BaseException as e:  # noqa: B036 - everything the other side did is data
            reply = {"re": msg.get("id"), "exc": describe_exception(e)}
        sync = []
        try:
            for i, a in list(enumerate(args)) + list(kwargs.items()):
                if type(a) in _MUTABLE:
                    now = self.encode(a)
                    if now != (msg["args"][i] if type(i) is int else msg["kwargs"][i]):
                        sync.append([i, now])
        except TooLarge as e:
            reply = {"re": msg.get("id"), "unjudgeable": f"an argument became {e}"}
        if sync and "unjudgeable" not in reply:
            reply["sync"] = sync
        try:
            self.send(reply)
        except (ValueError, TypeError, RecursionError, ProtocolError) as e:
            self.send({"re": msg.get("id"), "unjudgeable": f"the solution's reply: {e}"
                       if isinstance(e, TooLarge) else None, "exc": describe_exception(e)})


def _sync(obj, new):
    """Applies the other side's in-place change of an argument (`xs.sort()` in a solution)."""
    if type(obj) is not type(new):
        raise TypeError(f"{type(obj).__name__} became {type(new).__name__}")
    if type(obj) in (list, bytearray):
        obj[:] = new
    elif type(obj) in (dict, set):
        obj.clear()
        obj.update(new)


# -- exceptions and tracebacks ------------------------------------------------------------------

def exception_line(e):
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


def traceback_lines(e, filename):
    """The traceback lines of `e` in `filename` (others are the judge's, or libraries')."""
    out, tb, src = [], e.__traceback__, SOURCES.get(filename, ())
    while tb is not None:
        code, n = tb.tb_frame.f_code, tb.tb_lineno
        if code.co_filename == filename and n is not None:
            out.append(f'  File "{filename}", line {n}, in {code.co_name}\n')
            if 0 < n <= len(src) and src[n - 1].strip():
                out.append(f"    {src[n - 1].strip()}\n")
        tb = tb.tb_next
    return out


def user_traceback(e, filename):
    """The traceback of `e` trimmed to the frames in `filename`, then the exception line."""
    lines = traceback_lines(e, filename)
    head = "Traceback (most recent call last):\n" if lines else ""
    return head + "".join(lines) + exception_line(e)


def describe_exception(e):
    message = exception_line(e).rstrip("\n")
    name = type(e).__qualname__
    message = message[len(name) + 2:] if message.startswith(name + ": ") else message
    return {"types": [c.__name__ for c in type(e).__mro__][:20], "message": short(message),
            "traceback": short(user_traceback(e, SOLUTION_FILE), 4 * MAX_TEXT)}


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
