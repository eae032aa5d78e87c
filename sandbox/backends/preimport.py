"""The modules every backend's fork server imports before it forks any run: a run that uses
them starts faster."""

PREIMPORT = (
    "abc", "array", "bisect", "collections", "copy", "dataclasses", "datetime", "decimal",
    "enum", "fractions", "functools", "heapq", "io", "itertools", "json", "math", "operator",
    "pathlib", "random", "re", "statistics", "string", "textwrap", "threading", "traceback",
    "typing", "unittest",
)
