"""What a `cad` build + measurement costs on a warm CAD sandbox against a cold interpreter.

    python bench/cad_bench.py [--backend=bwrap] [--runs=10]

Prints, for one plate-with-holes script: the median build and build + measurement on the warm
fork server (CadQuery preimported), the median of a cold `python -I -c "import cadquery;
<script>; export"` of the same script (the baseline), their ratio (target <= 0.1x), and runs
per second with two builds in flight (two cores). Medians over --runs.
"""

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sandbox import cad  # noqa: E402

SCRIPT = """import cadquery as cq
result = (cq.Workplane("XY").box(40, 30, 5).faces(">Z").workplane()
          .rect(30, 20, forConstruction=True).vertices().hole(4))
"""
COLD = SCRIPT + """cq.exporters.export(result.val(), "part.stl", tolerance=0.05, angularTolerance=0.1)
"""


def _median_s(fn, runs):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    spec = cad.spec(args.backend)
    print(f"backend {spec.name}, python {spec.python}")
    _, report, files = cad.build(SCRIPT, backend=spec)  # starts the warm sandbox
    assert report and report["ok"], report
    target = {"part": files["out/part.stl"]}
    build_s = _median_s(lambda: cad.build(SCRIPT, backend=spec), args.runs)
    full_s = _median_s(lambda: cad.build_and_measure(SCRIPT, target, backend=spec), args.runs)
    measure_s = _median_s(lambda: cad.measure(target, target, render=False, backend=spec),
                          args.runs)
    render_s = _median_s(lambda: cad.measure(target, None, render=True, backend=spec),
                         args.runs)
    with tempfile.TemporaryDirectory() as d:
        cold_s = _median_s(lambda: subprocess.run([spec.python, "-I", "-c", COLD], cwd=d,
                                                  check=True), max(3, args.runs // 3))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        start = time.perf_counter()
        list(pool.map(lambda _: cad.build_and_measure(SCRIPT, target, backend=spec),
                      range(2 * args.runs)))
        per_s = 2 * args.runs / (time.perf_counter() - start)
    print(f"warm build:                      {build_s * 1e3:8.0f} ms")
    print(f"warm measurement (IoU, Chamfer): {measure_s * 1e3:8.0f} ms")
    print(f"warm measurement + render:       {render_s * 1e3:8.0f} ms")
    print(f"warm build + measurement:        {full_s * 1e3:8.0f} ms")
    print(f"cold python -c 'import cadquery; build; export': {cold_s * 1e3:8.0f} ms")
    print(f"ratio warm build / cold: {build_s / cold_s:.3f}x (target <= 0.1x)")
    print(f"build + measurement, two in flight: {per_s:.2f} runs/s")


if __name__ == "__main__":
    main()
