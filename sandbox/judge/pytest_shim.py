"""A pytest subset for the judge's pytest-style tests, so they run without importing pytest.

Runs in the judge's trusted process only (see judge/harness.py): `shim()` is the module the
tests get as `pytest` (raises, approx, mark.parametrize/skip, skip, fail, fixture), `collect`
expands the test functions. Fixtures are those defined in the test file: a name the tests
bind themselves, holding a function of theirs (never a solution's name or object).
"""

import builtins
import inspect
import itertools
import re
import types


class Skipped(Exception):
    """pytest.skip() or a skip mark: the test is not counted."""


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
    raise Skipped(reason)


def _fail(reason=""):
    raise _Failed(reason)


def _fixture(fn=None, **_kwargs):
    if fn is None:
        return lambda f: _fixture(f)
    fn.__judge_fixture__ = True
    return fn


def shim():
    module = types.ModuleType("pytest")
    module.raises, module.approx, module.mark = _raises, _Approx, _Mark()
    module.skip, module.fail, module.fixture = _skip, _fail, _fixture
    return module


def collect(ns, units, owned):
    """Yields (name, run(ns)) for each test function, parametrize expanded, in file order.
    `owned`: the names the tests bind themselves (split.test_bindings); only those, holding
    the tests' own functions and classes, are tests or fixtures."""
    for unit_name, _ in units:
        obj = ns.get(unit_name) if unit_name in owned else None
        if not _tests_own(obj, ns):  # the module setup did not define it (or not as a def)
            yield unit_name, _not_defined(unit_name)
        elif isinstance(obj, type):
            for attr in sorted(vars(obj), key=lambda a: _lineno(getattr(obj, a))):
                if attr.startswith("test") and callable(getattr(obj, attr)):
                    fn = getattr(obj, attr)
                    yield from _expand(f"{unit_name}::{attr}", fn, obj, owned)
        else:
            yield from _expand(unit_name, obj, None, owned)


def _not_defined(name):
    def run(ns):
        raise NameError(f"the tests' module setup did not define {name!r} as a test")
    return run


def _tests_own(obj, ns):
    """Whether `obj` is a function or class the tests' code made (its globals are theirs)."""
    if type(obj) is types.FunctionType:
        return obj.__globals__ is ns
    return type(obj) is type and getattr(obj, "__module__", None) == ns.get("__name__")


def _lineno(fn):
    return getattr(getattr(fn, "__code__", None), "co_firstlineno", 0)


def _expand(name, fn, cls, owned):
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
    if not cases:  # as pytest: a test over an empty parameter set is skipped
        yield name, lambda ns: _skip("got empty parameter set")
    for ids, bound in cases:
        label = f"{name}[{'-'.join(ids)}]" if ids else name
        yield label, (lambda b: lambda ns: _call_test(fn, cls, b, ns, owned))(bound)


def _call_test(fn, cls, bound, ns, owned):
    params = list(inspect.signature(fn).parameters)
    if cls is not None:
        params = params[1:]
    kwargs, finalizers = dict(bound), []
    for p in params:
        if p in kwargs:
            continue
        fixture = ns.get(p) if p in owned else None
        if not (_tests_own(fixture, ns) and getattr(fixture, "__judge_fixture__", False)):
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
