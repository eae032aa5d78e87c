"""Judge cost: a 10-test unit-test judge and a 10-case stdio judge, per backend, against a cold
`python -I -S -c pass` and a plain `print(1+1)` sandbox run measured in the same run.

    python bench/judge_bench.py [--n 40] [--backends process,bwrap,docker]

Prints the median wall time per call, calls/s for one caller and through a Pool, and the ratio
to the cold interpreter. Trials are interleaved (cold, run, judge, ...) so a busy machine
slows all of them alike. The "shipped" rows are the judge's paths for executors other than
sandbox.run, which were also its default before (see the comments in `main`).
"""

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sandbox  # noqa: E402
from sandbox import judge  # noqa: E402

CODE = "def add(a, b):\n    return a + b\n"
TESTS = "".join(f"assert add({i}, {i}) == {2 * i}\n" for i in range(10))
STDIO_CODE = "a, b = map(int, input().split())\nprint(a + b)\n"
CASES = [(f"{i} {i}\n", f"{2 * i}\n") for i in range(10)]


def cold():
    subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=40, help="trials per measurement")
    parser.add_argument("--backends", default="process,bwrap,docker")
    parser.add_argument("--pool-workers", type=int, default=2)
    args = parser.parse_args()
    names = [b for b in args.backends.split(",")
             if sandbox.unavailable_reason(sandbox.pick_backend(b)) is None]
    skipped = sorted(set(args.backends.split(",")) - set(names))
    print(f"backends: {names} (unavailable: {skipped or '-'}); cpus: {os.cpu_count()}")

    for backend in names:
        calls = {
            "cold python -I -S": cold,
            "run print(1+1)": lambda b=backend: sandbox.run("print(1+1)", backend=b),
            "judge 10 unit tests": lambda b=backend: _check(
                judge.unit_tests(CODE, TESTS, backend=b), 10),
            "judge 10 stdio cases": lambda b=backend: _check(
                judge.stdio(STDIO_CODE, CASES, backend=b), 10),
            # The default above forks the zygote (sandbox.run's fork server declares clean
            # memory) and calls the harness its fork server preloaded. Without the preload
            # (any `run=` executor: the harness is shipped and loaded per call):
            "judge 10 unit, shipped": lambda b=backend: _check(judge.unit_tests(
                CODE, TESTS, backend=judge.judge_backend(b), run=functools.partial(
                    sandbox.run, env={"SANDBOX_CLEAN_FORK": "1"})), 10),
            # ... and without the clean-fork declaration (a fresh interpreter as zygote): the
            # default path before both.
            "judge 10 unit, shipped, fresh Z": lambda b=backend: _check(judge.unit_tests(
                CODE, TESTS, backend=judge.judge_backend(b), run=sandbox.run), 10),
            "judge 10 stdio, shipped, fresh Z": lambda b=backend: _check(judge.stdio(
                STDIO_CODE, CASES, backend=judge.judge_backend(b), run=sandbox.run), 10),
        }
        for fn in calls.values():  # warm up: fork servers start, caches fill
            fn()
        times = {k: [] for k in calls}
        for _ in range(args.n):
            for name, fn in calls.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["cold python -I -S"])
        print(f"\n[{backend}]  median ms/call   calls/s (1 caller)   x cold python")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"  {name:32s} {med * 1e3:8.2f}   {1 / med:10.1f}   {med / base:10.2f}")
        for kind, now, before in (
                ("unit", "judge 10 unit tests", "judge 10 unit, shipped, fresh Z"),
                ("stdio", "judge 10 stdio cases", "judge 10 stdio, shipped, fresh Z")):
            ratio = statistics.median(times[now]) / statistics.median(times[before])
            print(f"  {kind} judge now / the path before (shipped, fresh Z): {ratio:.2f}")
        unit = functools.partial(judge.unit_tests, backend=backend)
        with sandbox.Pool(args.pool_workers, backend=backend) as pool:
            list(pool.map(unit, [CODE] * 4, [TESTS] * 4))
            n = 4 * args.n
            start = time.perf_counter()
            reports = list(pool.map(unit, [CODE] * n, [TESTS] * n))
            wall = time.perf_counter() - start
        assert all(r.passed == 10 for r in reports)
        print(f"  judge 10 unit tests through Pool({args.pool_workers}): {n / wall:.1f} judges/s")


def _check(report, want):
    if report.passed != want:
        raise SystemExit(f"benchmark judge failed: {report.feedback}")
    return report


if __name__ == "__main__":
    main()
