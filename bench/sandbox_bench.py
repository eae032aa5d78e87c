"""Sandbox throughput: median wall time per run and runs/s, per backend, through the fork
server and cold, against a cold `python -I -S -c` measured in the same run.

    python bench/sandbox_bench.py [--runs 200] [--backends process,bwrap,docker]

Workloads: `print(1+1)`, a 10-test unittest file (what judging a solution costs), a 3-turn
Session alone, and the tool episodes of an RL step: many 3-turn Sessions at once, unpinned
(the default: work dirs on the host, runs borrow warm workers) against pinned (a worker per
session) in the same run.
"cold" starts a fresh sandbox per run (for docker: a container per run); "fork server"
forks a warm, pre-started interpreter inside the same isolation. runs/s is measured with one
worker and with 2 workers in parallel (2 threads, as a pool on 2 cores would).
"""

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])

import sandbox  # noqa: E402 (after the path set-up, to run from a checkout)

PRINT = "print(1+1)"
UNITTEST_10 = """
import unittest

def solution(xs):
    return sorted(xs)

class T(unittest.TestCase):
""" + "".join(f"""
    def test_{i}(self):
        self.assertEqual(solution([{i}, 3, 1]), sorted([{i}, 3, 1]))
""" for i in range(10)) + """
unittest.main(argv=['x'], exit=True)
"""


def _time_runs(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _interleaved(fn_a, fn_b, n: int) -> tuple[list[float], list[float]]:
    """Times of a and b run alternately, so both see the same load from the rest of the
    machine (this one is shared; the ratio is what to read)."""
    times_a, times_b = [], []
    for _ in range(n):
        times_a += _time_runs(fn_a, 1)
        times_b += _time_runs(fn_b, 1)
    return times_a, times_b


def _throughput(make_fn, n: int, workers: int) -> float:
    """runs/s of `workers` threads, each with its own `make_fn()` callable, n runs in all."""
    fns = [make_fn() for _ in range(workers)]
    for fn in fns:
        fn()  # warm
    per = n // workers

    def loop(fn):
        for _ in range(per):
            fn()

    threads = [threading.Thread(target=loop, args=(fn,)) for fn in fns]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return per * workers / (time.perf_counter() - start)


def cold_python(python: str, code: str):
    def fn():
        p = subprocess.run([python, "-I", "-S", "-c", code], capture_output=True)
        assert p.returncode == 0, p.stderr
    return fn


def fork_server(backend: str, code: str):
    worker = sandbox.Sandbox(backend)
    _workers.append(worker)

    def fn():
        r = worker.run(sandbox.Request(code=code, timeout_s=30))
        assert r.ok, r
    return fn


def cold_sandbox(backend: str, code: str):
    def fn():
        r = sandbox.run(code, backend=backend, timeout_s=60, fork_server=False)
        assert r.ok, r
    return fn


def session(backend: str, turns: int, pinned: bool):
    """A multi-turn episode: open a Session (warm workers are there), `turns` runs, close."""
    sandbox.warm(1, backend=backend)

    def fn():
        with sandbox.Session(backend=backend, pinned=pinned) as s:
            for i in range(turns):
                r = s.run(f"import os\nopen('turn{i}', 'w').write('x')\n"
                          "print(len(os.listdir('.')))", timeout_s=30)
                assert r.ok and r.stdout == f"{i + 1}\n".encode(), r
    return fn


def concurrent_step(backend: str, n: int, turns: int, pinned: bool,
                    threads: int) -> tuple[float, int]:
    """The tool episodes of one RL step, as ptrain/rollout/episodes.py runs them: `n` Sessions opened
    one after the other (each with its task's files), `turns` turns in which every session
    runs one program (spread over `threads` threads), then all closed. Returns the wall time
    and the most workers alive at once."""
    peak = [0]

    def turn(job):
        i, s, t = job
        r = s.run(f"import os\nopen('turn{t}', 'w').write(open('task.txt').read())\n"
                  "print(len(os.listdir('.')))", timeout_s=30)
        assert r.ok and r.stdout == f"{t + 2}\n".encode(), r
        peak[0] = max(peak[0], len(sandbox.live_sandboxes()))

    start = time.perf_counter()
    sessions = [sandbox.Session(backend=backend, pinned=pinned, files={"task.txt": str(i)})
                for i in range(n)]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for t in range(turns):
            list(pool.map(turn, [(i, s, t) for i, s in enumerate(sessions)]))
    for i, s in enumerate(sessions):
        assert s.read_files()["turn0"] == str(i).encode()
        s.close()
    return time.perf_counter() - start, peak[0]


def concurrent_rows(backend: str, n: int, turns: int, steps: int, threads: int) -> list:
    """Pinned vs unpinned sessions, `steps` + 1 RL steps each: the first from no warm
    worker, the others alternating between the modes (they share the warm workers)."""
    first, later = {}, {True: [], False: []}
    for pinned in (True, False):
        sandbox.shutdown()
        first[pinned] = concurrent_step(backend, n, turns, pinned, threads)
    for _ in range(steps):
        for pinned in (True, False):
            later[pinned].append(concurrent_step(backend, n, turns, pinned, threads))
    base = statistics.median(wall for wall, _ in later[True])
    rows = []
    for pinned in (True, False):
        wall = statistics.median(w for w, _ in later[pinned])
        peak = max(p for _, p in later[pinned] + [first[pinned]])
        rows.append((backend, "pinned" if pinned else "unpinned", first[pinned][0] / n,
                     wall / n, peak, wall / base))
    return rows


def cold_pythons(python: str, code: str, n: int):
    one = cold_python(python, code)

    def fn():
        for _ in range(n):
            one()
    return fn


_workers: list = []


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="runs per warm measurement")
    parser.add_argument("--cold-runs", type=int, default=20, help="runs per cold sandbox")
    parser.add_argument("--backends", default="process,bwrap,docker")
    parser.add_argument("--sessions", type=int, default=40, help="concurrent sessions per step")
    parser.add_argument("--session-steps", type=int, default=3, help="steps per session mode")
    parser.add_argument("--threads", type=int, default=8, help="threads running tool calls")
    args = parser.parse_args()
    python = "/usr/bin/python3" if sys.platform == "linux" else sys.executable
    rows = []
    load_before = os.getloadavg()[0]
    for label, code in (("print(1+1)", PRINT), ("unittest x10", UNITTEST_10)):
        base = cold_python(python, code)
        base_times = _time_runs(base, args.runs // 4)
        base_med = statistics.median(base_times)
        base_tp = _throughput(lambda: cold_python(python, code), args.runs, 2)
        rows.append((label, f"cold `{python} -I -S -c`", base_med, base_med, 1.0,
                     1 / statistics.mean(base_times), base_tp))
        for backend in args.backends.split(","):
            reason = sandbox.unavailable_reason(sandbox.pick_backend(backend))
            if reason is not None:
                print(f"# {backend}: skipped ({reason})")
                continue
            warm = fork_server(backend, code)
            warm()
            warm_times, base_times = _interleaved(warm, base, args.runs)
            med, bmed = statistics.median(warm_times), statistics.median(base_times)
            tp1 = 1 / statistics.mean(_time_runs(warm, args.runs // 2))
            tp2 = _throughput(lambda: fork_server(backend, code), args.runs, 2)
            rows.append((label, f"{backend} fork server", med, bmed, med / bmed, tp1, tp2))
            cold = cold_sandbox(backend, code)
            cold_times, base_times = _interleaved(cold, base, args.cold_runs)
            cmed, bmed = statistics.median(cold_times), statistics.median(base_times)
            rows.append((label, f"{backend} cold (fresh sandbox per run)", cmed, bmed,
                         cmed / bmed, 1 / statistics.mean(cold_times), None))
        for worker in _workers:
            worker.close()
        _workers.clear()
    turns = 3
    base = cold_pythons(python, PRINT, turns)
    available = [b for b in args.backends.split(",")
                 if sandbox.unavailable_reason(sandbox.pick_backend(b)) is None]
    for backend in available:
        for pinned in (False, True):
            episode = session(backend, turns, pinned)
            episode()
            times, base_times = _interleaved(episode, base, args.runs // 4)
            med, bmed = statistics.median(times), statistics.median(base_times)
            mode = "pinned" if pinned else "unpinned"
            rows.append((f"Session, {turns} turns", f"{backend} {mode} (warm) vs {turns} cold "
                         "pythons", med, bmed, med / bmed, 1 / statistics.mean(times), None))
    concurrent = [row for backend in available for row in concurrent_rows(
        backend, args.sessions, turns, args.session_steps, args.threads)]
    print(f"# {os.cpu_count()} cores, load average {load_before:.1f} before and "
          f"{os.getloadavg()[0]:.1f} after; runs={args.runs}, cold runs={args.cold_runs}")
    print("# each path ran interleaved with cold python runs; the ratio is of the two medians")
    print("| workload | path | median ms | cold python ms (same loop) | x cold python "
          "| runs/s (1 worker) | runs/s (2 workers) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, path, med, bmed, ratio, tp1, tp2 in rows:
        fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        print(f"| {label} | {path} | {med * 1e3:.1f} | {bmed * 1e3:.1f} | {ratio:.2f} "
              f"| {fmt(tp1)} | {fmt(tp2)} |")
    print(f"\n# {args.sessions} concurrent {turns}-turn sessions per RL step (opened one after "
          f"the other, each turn's runs over {args.threads} threads, then closed); first step "
          f"from no warm worker, then {args.session_steps} steps per mode, alternating")
    print("| backend | sessions | first step ms/episode | later steps ms/episode (median) "
          "| peak live workers | x pinned (later steps) |")
    print("|---|---|---:|---:|---:|---:|")
    for backend, mode, first, later, peak, ratio in concurrent:
        print(f"| {backend} | {mode} | {first * 1e3:.1f} | {later * 1e3:.1f} | {peak} "
              f"| {ratio:.2f} |")
    sandbox.shutdown()


if __name__ == "__main__":
    main()
