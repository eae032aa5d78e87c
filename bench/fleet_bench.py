"""Scoring throughput on a Ray fleet against the local pool, measured in the same run.

    python bench/fleet_bench.py [--requests 200] [--workers 4] [--nodes 2] [--repeats 3]

Workload: judging solutions with `sandbox.judge.unit_tests` (what an RL step's rewards cost),
half passing, half failing, through `sandbox.Pool(workers)` on this machine and through
`sandbox.fleet.pool(workers)` on a `ray.cluster_utils.Cluster` of `nodes` nodes (all on this
machine: the number is the fleet's own overhead, Ray's scheduling and object transfer, not
the gain of more machines). Prints requests/s of each, median over repeats with the spread,
and the ratio fleet / local.
"""

import argparse
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])

import sandbox  # noqa: E402 (after the path set-up, to run from a checkout)
from sandbox import fleet  # noqa: E402

GOOD = "def add(a, b):\n    return a + b\n"
BAD = "def add(a, b):\n    return a - b\n"
TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(0, 0) == 0\n"


def throughput(pool, n: int) -> float:
    start = time.perf_counter()
    futures = [pool.unit_tests(GOOD if i % 2 else BAD, TESTS, timeout_s=10) for i in range(n)]
    reports = [f.result() for f in futures]
    elapsed = time.perf_counter() - start
    assert sum(r.all_passed for r in reports) == n // 2, "wrong verdicts"
    return n / elapsed


def measure(pool, n: int, repeats: int) -> list[float]:
    throughput(pool, max(8, n // 10))  # warm: actors started, judge fork servers up
    return [throughput(pool, n) for _ in range(repeats)]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    with sandbox.Pool(args.workers, backend=args.backend) as pool:
        local = measure(pool, args.requests, args.repeats)
    cpus = -(-args.workers // args.nodes)
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=cpus, object_store_memory=80 << 20, include_dashboard=False))
    for _ in range(args.nodes - 1):
        cluster.add_node(num_cpus=cpus, object_store_memory=80 << 20)
    started = fleet.connect(cluster.address)
    try:
        cluster.wait_for_nodes()
        with fleet.pool(args.workers, backend=args.backend) as pool:
            ray_rates = measure(pool, args.requests, args.repeats)
    finally:
        fleet.disconnect(started)
        cluster.shutdown()

    def show(name, rates):
        print(f"{name:>28}: {statistics.median(rates):7.1f} requests/s "
              f"(min {min(rates):.1f}, max {max(rates):.1f}, {len(rates)} repeats)")
    show(f"local pool, {args.workers} workers", local)
    show(f"Ray fleet, {args.nodes} nodes x {cpus} CPUs", ray_rates)
    print(f"{'ratio fleet / local':>28}: {statistics.median(ray_rates) / statistics.median(local):.2f}x"
          f" ({args.requests} unit-test judgements per repeat, backend={args.backend})")


if __name__ == "__main__":
    main()
