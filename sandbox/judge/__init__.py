"""Judge a solution: unit tests (assert- or pytest-style) or stdin/stdout cases.

The package: `api` (what callers use, re-exported here), and the judge's program inside the
sandbox: `harness` (the trusted process T), `zygote` (Z and the solution processes C), `rpc`
(the T <-> C channel), `codec` (the plain data that crosses it), `split` (tests into units,
shared with the host) and `pytest_shim` (the pytest subset T offers the tests).
"""

from sandbox.judge.api import (JUDGE_PREIMPORT, STATUSES, Report, TestResult, build_stdin,
                               compare_output, feedback_text, harness_code, judge_backend,
                               parse_report, preload_source, stdio, unit_tests)

__all__ = ["JUDGE_PREIMPORT", "STATUSES", "Report", "TestResult", "build_stdin",
           "compare_output", "feedback_text", "harness_code", "judge_backend", "parse_report",
           "preload_source", "stdio", "unit_tests"]
