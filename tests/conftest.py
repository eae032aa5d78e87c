"""Test set-up: 8 simulated CPU devices, so every mesh axis is exercised.

This must run before anything imports JAX, which is why it lives here.
"""

import os
import sys

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# Most of the suite's CPU is XLA compiling small programs on 8 simulated devices, so LLVM's
# -O0 without its expensive passes, not the default -O2: the same HLO, compiled faster (-O1
# was ~3x faster than -O2: a model's random init 7.4 -> 2.4 CPU s; -O0 a further ~20%:
# test_decode_weights + test_model 114 -> 91 CPU-s, the same 170 compiles, side by side).
# A test whose cost is running, not compiling, asks for -O1 itself (tests/test_closed_loop.py's
# quickstart launch: SFT at -O0 costs ~16% more CPU, 80 steps + 4 RL steps 81 -> 94 CPU-s).
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One compilation cache for the whole test run: xdist's workers and every subprocess a test
# starts (launch.train, launch.eval, the multi-process workers) inherit this variable, so a
# program that another test or process already compiled is read back instead of compiled
# again (each compile on 8 simulated devices costs seconds). The directory is made by the
# first process that loads this file (xdist's controller, before it starts the workers) and
# removed when that process exits; set JAX_COMPILATION_CACHE_DIR to keep one across runs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile
    _cache = tempfile.mkdtemp(prefix="ptrain-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _drop_jit_eh_frames() -> str | None:
    """Loads tests/native/no_jit_eh_frames.c (built here, once per source) ahead of libgcc in
    this process and, by LD_PRELOAD, in every process a test starts; returns why not, or None.

    The suite's workers have crashed in libgcc's unwinder reading the unwind tables of an
    XLA:CPU program that was already gone (the file says how); no compiled program needs them.
    """
    import ctypes
    import hashlib
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.join(here, "native", "no_jit_eh_frames.c")
    if "jaxlib" in sys.modules:
        return "JAX was imported before tests/conftest.py"
    with open(src, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    out_dir = os.path.join(os.path.dirname(here), ".cache", "native")
    lib = os.path.join(out_dir, f"no_jit_eh_frames-{digest}.so")
    if not os.path.exists(lib):
        os.makedirs(out_dir, exist_ok=True)
        tmp = f"{lib}.{os.getpid()}.tmp"
        try:
            r = subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", tmp, src],
                               capture_output=True, text=True)
        except FileNotFoundError:
            return "no C compiler (cc) to build tests/native/no_jit_eh_frames.c"
        if r.returncode != 0:
            return f"cc failed on tests/native/no_jit_eh_frames.c: {r.stderr.strip()[-300:]}"
        os.replace(tmp, lib)
    ctypes.CDLL(lib, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
    preload = os.environ.get("LD_PRELOAD", "").split()
    if lib not in preload:
        os.environ["LD_PRELOAD"] = " ".join([lib, *preload])
    return None


JIT_EH_FRAMES_KEPT = _drop_jit_eh_frames()
if JIT_EH_FRAMES_KEPT:
    import warnings
    warnings.warn(f"XLA:CPU's JIT unwind tables stay registered with libgcc "
                  f"({JIT_EH_FRAMES_KEPT}): the rare worker crash of "
                  f"tests/native/no_jit_eh_frames.c is possible", stacklevel=1)


def _preload_jemalloc() -> None:
    """Every process the tests start (xdist's workers, launch.train, the multi-process workers)
    allocates with jemalloc where the machine has it (`make system-deps` installs it): XLA's
    compiles and small programs spend ~10% less CPU than with glibc's malloc (docs/benchmarks.md,
    "Test suite cost"). This process keeps its allocator: one cannot be swapped in a running
    process. PTRAIN_TEST_MALLOC=glibc turns it off."""
    import ctypes.util
    preload = os.environ.get("LD_PRELOAD", "").split()
    if os.environ.get("PTRAIN_TEST_MALLOC") == "glibc" or any("jemalloc" in p for p in preload):
        return
    lib = ctypes.util.find_library("jemalloc")  # a name in ld.so's cache, or None
    if lib:
        os.environ["LD_PRELOAD"] = " ".join([*preload, lib])


_preload_jemalloc()


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """name -> the directory of a tests/hf_fixtures model (qwen2.5-instruct, qwen2.5-base,
    llama3.1-instruct), built once per test session with no download."""
    built = {}

    def get(name: str) -> str:
        if name not in built:
            pytest.importorskip("torch", reason="torch (CPU) builds the fixture models")
            pytest.importorskip("transformers", reason="pip install '.[test]'")
            import hf_fixtures
            path = str(tmp_path_factory.mktemp(name.replace(".", "_")))
            built[name] = hf_fixtures.build(name, path)
        return built[name]
    return get


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory):
    """The work dir of configs/quickstart.py:short launched once per test run
    (tests/quickstart_run.py; ~200 CPU-s), and the launch's finished process. Its tests are in
    xdist group closed_loop, so one worker runs it once; they copy the dir before changing it."""
    import quickstart_run as qs
    workdir = str(tmp_path_factory.mktemp("quickstart") / "qs")
    return workdir, qs.launch(workdir)


# The order xdist hands out work (`make test` runs `--dist loadgroup --no-loadscope-reorder`,
# so it keeps this order): the longest groups first, so that a long chain of tests bound to one
# worker does not start late and finish alone. Measured in a full suite run (seconds of one
# worker): closed_loop (the quickstart end to end, the colab notebook, byo) ~680, the
# multi-process learner ~550, moe_rl and learner 250-350 each. Then the other groups, most
# tests first (xdist's own default order), then the ungrouped tests in file order.
LONGEST_GROUPS_FIRST = ("closed_loop", "multiprocess_learner", "moe_rl", "learner")


def _group(item):
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return mark.args[0] if mark.args else mark.kwargs.get("name")


def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "dist", "no") != "loadgroup":
        return  # a plain run keeps pytest's order (each module's tests together)
    groups = [_group(item) for item in items]
    sizes = {}
    for g in groups:
        if g is not None:
            sizes[g] = sizes.get(g, 0) + 1

    def rank(i):
        g = groups[i]
        if g is None:
            return (2, 0, i)
        if g in LONGEST_GROUPS_FIRST:
            return (0, LONGEST_GROUPS_FIRST.index(g), i)
        return (1, -sizes[g], g, i)

    items[:] = [items[i] for i in sorted(range(len(items)), key=rank)]


# Every program XLA:CPU compiles keeps its JIT code mapped (~6 mappings a program) until its
# executable is dropped, and jit's caches keep them all: one xdist worker running half the
# suite passed the kernel's vm.max_map_count (65530 here), and LLVM then failed with "Cannot
# allocate memory" / "Failed to materialize symbols" in whichever test came next (a worker
# crash in test_packing, 2026-12-03; three files alone leave ~27k mappings). When a worker
# holds half the limit, its compiled programs are dropped (later tests recompile, from the
# persistent cache where it has them).
def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


_MAP_LIMIT = _map_limit()


def _mappings() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def pytest_runtest_teardown(item, nextitem):
    if _MAP_LIMIT and "jax" in sys.modules and _mappings() > _MAP_LIMIT // 2:
        sys.modules["jax"].clear_caches()
