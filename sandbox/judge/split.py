"""Test splitting: the units a judge reports on, and the units compiled with every `assert`
made an explicit check. Shared by the host (`sandbox.judge.unit_tests` names the tests before
the run) and the judge's trusted process T in the sandbox (judge/harness.py).
Standard library only."""

import operator

TESTS_FILE = "tests.py"


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


def test_bindings(tree):
    """(owned, aliases, stars) of the tests' module `tree`, read from its source, never from
    values: `owned`, the names the tests bind in their module namespace themselves (assignments,
    `def`, `class`, imports, loop and `with` targets, `global` names, ..., anywhere they bind
    the tests' globals: module statements, HumanEval's unrolled `check` body); `aliases`,
    {name: (name it stands for, whether by `from solution import`)} for each name the tests
    bind only as an alias (`from solution import f as g`; `g = f` with `f` not the tests'
    own, which follows `f` only where `f` is the solution's). The harness never
    puts a solution's value under an owned name, and after a restart re-binds aliases by
    these names: which object a name holds (a small int, None, True are shared by
    everyone) never decides it. `from module import *` (not the solution) owns every public
    name of the module: `stars` lists those modules, which the harness imports to list
    them. Names the tests bind only dynamically (`globals()[...]`, `exec`) are not seen."""
    import ast
    counts, aliases, stars, todo = {}, {}, [], list(tree.body)

    def bind(name, alias_of=None, imported=False):
        counts[name] = counts.get(name, 0) + 1
        if alias_of is not None:
            aliases[name] = (alias_of, imported)

    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            if not isinstance(node, ast.Lambda):
                bind(node.name)
                if node.name == "check":  # unrolled into module statements (split_tests)
                    todo.extend(node.body)
            for sub in ast.walk(node):  # `global x` anywhere binds the module's x
                if isinstance(sub, ast.Global):
                    for name in sub.names:
                        bind(name)
            continue
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bind(node.id)
        elif isinstance(node, ast.ImportFrom):
            if node.module and node.module != "solution" and not node.level and any(
                    a.name == "*" for a in node.names):
                stars.append(node.module)
            for a in node.names:
                if a.name != "*":
                    solution = node.module == "solution" and not node.level
                    bind(a.asname or a.name, a.name if solution else None, solution)
        elif isinstance(node, ast.Import):
            for a in node.names:
                bind(a.asname or a.name.split(".")[0])
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            bind(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bind(node.rest)
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Name)):
            bind(node.targets[0].id, node.value.id)
            todo.append(node.value)
            continue
        todo.extend(ast.iter_child_nodes(node))
    aliases = {k: v for k, v in aliases.items() if counts[k] == 1 and (
        v[1] or v[0] not in counts or v[0] in aliases)}
    return set(counts) - set(aliases), aliases, stars


CMP = {"Eq": "==", "NotEq": "!=", "Lt": "<", "LtE": "<=", "Gt": ">", "GtE": ">=",
        "In": "in", "NotIn": "not in", "Is": "is", "IsNot": "is not"}
CMP_FUNCS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
              ">": operator.gt, ">=": operator.ge, "in": lambda a, b: a in b,
              "not in": lambda a, b: a not in b, "is": operator.is_, "is not": operator.is_not}


def compile_units(stmts, lines):
    """Compiles test statements with every `assert` made an explicit check: immune to
    `python -O`, and a failing single comparison reports both values (`assert 5 == 4`)."""
    import ast

    class Rewriter(ast.NodeTransformer):
        def visit_Assert(self, node):
            self.generic_visit(node)
            test = node.test
            if (node.msg is None and isinstance(test, ast.Compare) and len(test.ops) == 1
                    and type(test.ops[0]).__name__ in CMP):
                op = ast.Constant(CMP[type(test.ops[0]).__name__])
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
