"""Terminal-task environments: the warm container's reset against a fresh `docker run`, and
oracle episodes per second with warm containers against a fresh container per episode.

    python bench/terminal_bench.py [--reps 20] [--concurrency 16] [--rounds 3]

1. Per-episode overhead. A container of a bundled task's image is dirtied as an episode
   leaves it (files written, changed and deleted across the image, a background server, the
   tests and logs the verifier copies in), then brought back to the image's state: in place
   (`Container.reset()`: kill, undo the overlay layer, a few ms) or the way a harness without
   reset does it: remove the container and `docker run` a new one (timed as "rm + run", and
   the run alone). Interleaved, the same dirt before each.
2. Throughput. Rounds of `--concurrency` concurrent oracle episodes, with a harness that
   resets warm containers against one that starts a fresh container for every episode;
   rounds alternate between the two. Two workloads: the bundled tasks in turn (their own
   tests, mostly pytest, dominate), and a minimal Harbor task (`echo` solution, a one-line
   test.sh): what the environment itself costs per episode.
3. bwrap against docker (`--backends`, where bwrap and its base are there): on the minimal
   task, interleaved, the per-episode reset after the same dirt in the files both allow
   (docker in place vs bwrap's new sandbox), a command through `exec` (`true`), and a command
   in the agent's persistent shell (`Shell.run("true")`).
Prints medians, the spread (min-max) and the ratios measured in this run.
"""

import argparse
import concurrent.futures
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])

from sandbox import terminal  # noqa: E402 (after the path set-up, to run from a checkout)

TASKS_DIR = terminal.BUNDLED_TASKS
DIRT = ("mkdir -p /app/out /opt/tool && for i in $(seq 50); do echo $i > /app/out/f$i; done; "
        "echo x >> /etc/bash.bashrc; rm -f /usr/bin/bc; cp -r /usr/share/misc /tmp/misc; "
        "mkdir -p /tests /logs/verifier && echo 1 > /logs/verifier/reward.txt; "
        "nohup python3 -m http.server 8111 --bind 127.0.0.1 >/dev/null 2>&1 & sleep 0.2")


MINIMAL = {
    "instruction.md": "Write ok to /app/ok.\n",
    "task.toml": "[verifier]\ntimeout_sec = 60\n\n[agent]\ntimeout_sec = 60\n\n"
                 "[environment]\nmemory_mb = 256\nallow_internet = false\n",
    "environment/Dockerfile": "FROM ptrain-term-base:latest\nWORKDIR /app\n",
    "tests/test.sh": "grep -qx ok /app/ok && echo 1 > /logs/verifier/reward.txt || "
                     "echo 0 > /logs/verifier/reward.txt\n",
    "solution/solve.sh": "echo ok > /app/ok\n",
}


def minimal_task(root: str):
    for rel, text in MINIMAL.items():
        path = os.path.join(root, "minimal", rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return terminal.load_task(os.path.join(root, "minimal"))


def spread(xs, unit=1e3, fmt="{:.1f}"):
    xs = [x * unit for x in xs]
    return (f"{fmt.format(statistics.median(xs))} "
            f"({fmt.format(min(xs))}-{fmt.format(max(xs))})")


def bench_reset(task, reps: int) -> dict:
    with terminal.Harness() as h:
        image, limits = h.image(task), h.limits(task)
        warm = terminal.Container(image, limits, name="bench-warm", pytest_dir=h.pytest_dir)
        fresh = terminal.Container(image, limits, name="bench-fresh", pytest_dir=h.pytest_dir,
                                   reset="recreate")
        if warm.reset_mode != "inplace":
            print("note: in-place reset unavailable here; both sides recreate")
        inplace_s, rm_run_s, run_s = [], [], []
        try:
            for _ in range(reps):
                for c, times in ((warm, inplace_s), (fresh, rm_run_s)):
                    r = c.exec(["bash", "-c", DIRT], timeout_s=60, user="root")
                    assert r.exit_code == 0, r.text
                    t0 = time.perf_counter()
                    c.reset()
                    times.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                extra = terminal.Container(image, limits, name="bench-run",
                                           pytest_dir=h.pytest_dir, reset="recreate")
                run_s.append(time.perf_counter() - t0)
                extra.close()
        finally:
            warm.close()
            fresh.close()
    return {"inplace": inplace_s, "rm_run": rm_run_s, "run": run_s}


# What both backends let an episode do (bwrap's /usr and /etc are read-only).
DIRT_FILES = ("mkdir -p /app/out /opt/tool && for i in $(seq 50); do echo $i > /app/out/f$i; "
              "done; cp -r /usr/share/misc /tmp/misc; mkdir -p /tests /logs/verifier && "
              "echo 1 > /logs/verifier/reward.txt; "
              "nohup python3 -m http.server 8111 --bind 127.0.0.1 >/dev/null 2>&1 & sleep 0.2")


def bench_backends(task, reps: int) -> dict:
    """{(backend, what): [seconds]}: the reset after an episode's dirt, an exec, the
    episode's shell starting, a command in it."""
    from sandbox.terminal.shell import Shell
    out = {}
    harnesses = {"docker": terminal.Harness(), "bwrap": terminal.Harness(backend="bwrap")}
    boxes, shells = {}, {}
    try:
        for name, h in harnesses.items():
            boxes[name] = h.acquire(task)
        for _ in range(reps):
            for name, box in boxes.items():
                r = box.exec(["bash", "-c", DIRT_FILES], timeout_s=60, user="root")
                assert r.exit_code == 0, r.text
                t0 = time.perf_counter()
                box.reset()
                out.setdefault((name, "reset"), []).append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                assert box.exec(["true"], timeout_s=30).exit_code == 0
                out.setdefault((name, "exec"), []).append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                shells[name] = Shell(box)
                out.setdefault((name, "shell start"), []).append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                assert shells[name].run("true", 30).exit_code == 0
                out.setdefault((name, "command"), []).append(time.perf_counter() - t0)
                shells.pop(name).close()
    finally:
        for sh in shells.values():
            sh.close()
        for box in boxes.values():
            box.close()
        for h in harnesses.values():
            h.close()
    return out


def bench_throughput(tasks, concurrency: int, rounds: int) -> dict:
    results = {"auto": [], "recreate": []}
    harnesses = {mode: terminal.Harness(reset=mode, max_idle=concurrency) for mode in results}
    plan = [tasks[i % len(tasks)] for i in range(concurrency)]
    try:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            for mode, h in harnesses.items():  # images, and the first containers
                list(pool.map(lambda t: terminal.run_attempt(h, t, terminal.oracle, 0), plan))
            for _ in range(rounds):
                for mode, h in harnesses.items():
                    t0 = time.perf_counter()
                    rows = list(pool.map(lambda t: terminal.run_attempt(
                        h, t, terminal.oracle, 0)[0], plan))
                    elapsed = time.perf_counter() - t0
                    bad = [r["task"] for r in rows if r["reward"] != 1.0]
                    assert not bad, f"oracle failed: {bad}"
                    results[mode].append(len(rows) / elapsed)
    finally:
        for h in harnesses.values():
            h.close()
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-reset", action="store_true")
    ap.add_argument("--backends", action="store_true", help="bwrap against docker")
    args = ap.parse_args()
    loaded = terminal.load_tasks(TASKS_DIR)
    tasks = list(loaded.tasks)
    hello = next(t for t in tasks if t.name == "hello-file")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")

    if args.backends:
        with tempfile.TemporaryDirectory(prefix="ptrain-term-bench-") as tmp:
            b = bench_backends(minimal_task(tmp), args.reps)
        print(f"\nbwrap against docker on the minimal task, ms, median (min-max) of "
              f"{args.reps}, interleaved:")
        for what in ("reset", "exec", "shell start", "command"):
            ratio = statistics.median(b[("bwrap", what)]) / statistics.median(
                b[("docker", what)])
            print(f"  {what:11s} docker {spread(b[('docker', what)])}   "
                  f"bwrap {spread(b[('bwrap', what)])}   bwrap / docker {ratio:.3f}x")

    if not args.skip_reset:
        r = bench_reset(hello, args.reps)
        med = {k: statistics.median(v) for k, v in r.items()}
        print(f"\nper-episode reset of a dirtied container, ms, median (min-max) of "
              f"{args.reps}:")
        print(f"  in-place reset      {spread(r['inplace'])}")
        print(f"  docker rm + run     {spread(r['rm_run'])}")
        print(f"  docker run alone    {spread(r['run'])}")
        print(f"  ratio in-place / run alone: {med['inplace'] / med['run']:.3f}x   "
              f"in-place / (rm + run): {med['inplace'] / med['rm_run']:.3f}x")

    if not args.skip_throughput:
        with tempfile.TemporaryDirectory(prefix="ptrain-term-bench-") as tmp:
            workloads = [(f"the {len(tasks)} bundled tasks in turn", tasks),
                         ("a minimal task (the environment's own cost)", [minimal_task(tmp)])]
            for title, workload in workloads:
                t = bench_throughput(workload, args.concurrency, args.rounds)
                print(f"\n{args.concurrency} concurrent oracle episodes, {title}, episodes/s, "
                      f"median (min-max) of {args.rounds} rounds:")
                print(f"  warm containers, reset    {spread(t['auto'], 1, '{:.2f}')}")
                print(f"  fresh container each      {spread(t['recreate'], 1, '{:.2f}')}")
                ratio = statistics.median(t["auto"]) / statistics.median(t["recreate"])
                print(f"  ratio: {ratio:.2f}x")
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
