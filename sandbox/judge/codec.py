"""The plain-data codec of the judge's channel: what a value is when it crosses between the
trusted process T and the solution process C (see judge/harness.py).

Only data crosses: None, bool, int, float, str, bytes, bytearray, complex, range, list,
tuple, dict, set, frozenset, their dict views, namedtuples, OrderedDict, Counter,
defaultdict, deque, Decimal, Fraction, numpy arrays and scalars (exact types; subclasses are
not data), and iterators, drained on the sending side into their items. The receiver builds
genuine builtin objects from it, so nothing done to a decoded value runs the sender's code.
Anything else goes as a handle token that the endpoint (judge/rpc.py's Endpoint) turns into an
object whose uses it restricts. Imports only C-level modules.
"""

import binascii
import gc


class ProtocolError(Exception):
    """The other side sent something that is not a valid message."""


# A value travels as a flat list of tokens in pre-order: a scalar (None, bool, int, float, str)
# is itself; anything else is a short list [tag, ...], and a container's tag gives how many
# values follow that belong to it. Encoding and decoding are loops over an explicit stack, so
# data of any depth crosses (no recursion limit); MAX_ITEMS bounds the size, and a value that
# contains itself is refused.

MAX_ITEMS = 1 << 20  # tokens of one value
_CONTAINERS = {"l": list, "t": tuple, "s": set, "fs": frozenset}
_TAGS = {**{v: k for k, v in _CONTAINERS.items()}, dict: "d"}
_SCALAR_TYPES = frozenset({type(None), bool, int, float, str})
_COLLECTIONS = ("OrderedDict", "Counter", "defaultdict", "deque")
_ITERATORS = frozenset(type(x).__name__ for x in (
    iter([]), iter(()), iter(""), iter(range(0)), iter(set()), iter({}), (x for x in ()),
    map(int, ()), filter(None, ()), zip(), enumerate(()), reversed([]), iter({}.values()),
    iter({}.items()), iter(b""), iter(range(1 << 70))))


class TooLarge(ValueError):
    """A value of more than MAX_ITEMS tokens (or a cycle): it cannot cross as data."""


def encode(value, make_ref, own=None):
    """See `_encode`; the cyclic GC is paused meanwhile (the many small token lists would
    make it walk the growing output again and again)."""
    return _no_gc(_encode, value, make_ref, own)


def _no_gc(fn, *args):
    was = gc.isenabled()
    gc.disable()
    try:
        return fn(*args)
    finally:
        if was:
            gc.enable()


def _encode(value, make_ref, own):
    """`value` as tokens. `make_ref(obj)` -> token for an object that is not plain data (C: a
    handle; T: a reference to a callback); `own(obj)` -> the id of an object of the other
    side's that it sent us (it goes back as ["k", id]), or None."""
    out, stack, path = [], [value], set()  # path: ids of the containers being encoded
    while stack:
        v = stack.pop()
        t = type(v)
        if v is None or t is bool or t is int or t is float or t is str:
            out.append(v)
        elif t is _End:
            path.discard(v.id)
        elif t is list or t is tuple or t is set or t is frozenset or t is dict:
            out.append([_TAGS[t], len(v)])
            if t is not dict and all(map(_SCALAR_TYPES.__contains__, map(type, v))):
                out.extend(v)  # the common case, without a round through the stack
                continue
            if id(v) in path:
                raise TooLarge("a value that contains itself (a cycle)")
            path.add(id(v))
            stack.append(_End(id(v)))
            if t is dict:
                _push_pairs(stack, v.items())
            else:
                stack.extend(reversed(list(v)))
        elif t is bytes or t is bytearray:
            out.append(["b" if t is bytes else "ba", binascii.b2a_base64(v, newline=False)
                        .decode()])
        elif t is complex:
            out.append(["c", v.real, v.imag])
        elif t is range:
            out.append(["r", v.start, v.stop, v.step])
        elif t.__name__ in ("dict_keys", "dict_values", "dict_items") and t.__module__ == (
                "builtins"):
            items = list(v)
            out.append([t.__name__, len(items)])
            stack.extend(reversed(items))
        elif own is not None and own(v) is not None:
            out.append(["k", own(v)])
        else:
            known = _known(v, stack)
            out.append(known if known is not None else make_ref(v))
        if len(out) + len(stack) > MAX_ITEMS:
            raise TooLarge(f"a value of more than {MAX_ITEMS} items")
    return out


class _End:
    """Pushed after a container's items: the encoder has left it (for cycle detection)."""
    __slots__ = ("id",)

    def __init__(self, ident):
        self.id = ident


def _push_pairs(stack, items):
    for k, x in reversed(list(items)):
        stack.append(x)
        stack.append(k)


def _known(v, stack):
    """The token of a standard-library or numpy value that is data (its parts pushed), an
    iterator drained into its items, or None."""
    t = type(v)
    mod, name = t.__module__, t.__name__
    if mod == "builtins" and name in _ITERATORS or mod == "itertools":
        items = []
        for x in v:
            items.append(x)
            if len(items) > MAX_ITEMS:
                raise TooLarge(f"an iterator of more than {MAX_ITEMS} items")
        stack.extend(reversed(items))
        return ["it", len(items)]
    if isinstance(v, tuple) and hasattr(t, "_fields") and all(type(f) is str for f in t._fields):
        stack.extend(reversed(list(tuple.__iter__(v))))
        return ["nt", name, list(t._fields), len(v)]
    if mod == "collections" and name in _COLLECTIONS:
        if name == "deque":
            stack.extend(reversed(list(v)))
        else:
            _push_pairs(stack, dict.items(v))
        return ["C", name, len(v)]
    if mod in ("decimal", "fractions") and name in ("Decimal", "Fraction"):
        return [name, str(v)]
    if mod == "numpy" and hasattr(v, "tolist"):
        stack.append(v.tolist())
        return ["np", str(v.dtype) if name == "ndarray" and v.ndim else ""]
    return None


_NAMEDTUPLES = {}


def decode(tokens, ref, back):
    return _no_gc(_decode, tokens, ref, back)


def _decode(tokens, ref, back):
    """The value of `tokens` (from `encode`). `ref(token)` -> the object standing for the
    other side's object; `back(id)` -> our own object that went over and came back."""
    if type(tokens) is not list or not tokens:
        raise ProtocolError("a value is a non-empty list of tokens")
    stack, done = [], None  # frames: [token, items still wanted, items]
    for tok in tokens:
        if done is not None:
            raise ProtocolError("tokens after the end of a value")
        value, frame = tok, None
        if type(tok) is list:
            value, frame = _atom(tok, ref, back)
        elif type(tok) is dict:
            raise ProtocolError("a token is a scalar or a list")
        if frame is not None and frame[1] > 0:
            stack.append(frame)
            continue
        if frame is not None:
            value = _build(frame)
        while True:
            if not stack:
                done = (value,)
                break
            top = stack[-1]
            top[2].append(value)
            top[1] -= 1
            if top[1]:
                break
            stack.pop()
            value = _build(top)
    if done is None:
        raise ProtocolError("a value ended early")
    return done[0]


def _atom(tok, ref, back):
    """(value, None) for a token that stands alone, or (None, frame) for a container."""
    tag = tok[0] if tok else None
    try:
        if tag in _CONTAINERS or tag in ("d", "it", "dict_keys", "dict_values", "dict_items",
                                         "nt", "C", "np"):
            n = tok[-1] if tag != "np" else 1
            if type(n) is not int or n < 0 or n > MAX_ITEMS:
                raise ProtocolError(f"bad item count in {tag!r}")
            if tag == "d":
                n *= 2
            if tag == "C" and tok[1] != "deque":
                n *= 2
            return None, [tok, n, []]
        if tag in ("b", "ba"):
            data = binascii.a2b_base64(tok[1])
            return (data if tag == "b" else bytearray(data)), None
        if tag == "c":
            return complex(float(tok[1]), float(tok[2])), None
        if tag == "r":
            return range(int(tok[1]), int(tok[2]), int(tok[3])), None
        if tag in ("Decimal", "Fraction"):
            import decimal
            import fractions
            return (decimal.Decimal if tag == "Decimal" else fractions.Fraction)(str(tok[1])), None
        if tag == "h":
            return ref(tok), None
        if tag == "k":
            return back(int(tok[1])), None
    except (TypeError, ValueError, IndexError, ArithmeticError, binascii.Error) as e:
        raise ProtocolError(f"bad {tag!r} token: {e}") from None
    raise ProtocolError(f"unknown value tag {tag!r}")


def _build(frame):
    tok, _, items = frame
    tag = tok[0]
    try:
        if tag in _CONTAINERS:
            return _CONTAINERS[tag](items)
        if tag == "d":
            return dict(zip(items[0::2], items[1::2]))
        if tag == "it":
            return iter(items)
        if tag == "dict_keys":
            return dict.fromkeys(items).keys()
        if tag == "dict_values":
            return dict(enumerate(items)).values()
        if tag == "dict_items":
            return dict(items).items()
        if tag == "nt":
            key = (str(tok[1]), tuple(str(f) for f in tok[2]))
            if key not in _NAMEDTUPLES:
                if len(_NAMEDTUPLES) > 1000:
                    raise ProtocolError("too many namedtuple types")
                import collections
                _NAMEDTUPLES[key] = collections.namedtuple(key[0], key[1], rename=True)
            return _NAMEDTUPLES[key](*items)
        if tag == "C":
            import collections
            if tok[1] == "deque":
                return collections.deque(items)
            pairs = dict(zip(items[0::2], items[1::2]))
            if tok[1] == "defaultdict":
                return collections.defaultdict(None, pairs)
            return getattr(collections, str(tok[1]) if tok[1] in _COLLECTIONS else "Counter")(
                pairs)
        if tag == "np":
            import numpy
            return numpy.array(items[0], dtype=str(tok[1])) if tok[1] else numpy.array(
                items[0])[()]
    except (TypeError, ValueError) as e:  # unhashable keys, a bad dtype, wrong arity
        raise ProtocolError(f"bad {tag!r} value: {e}") from None
    raise ProtocolError(f"unknown value tag {tag!r}")
