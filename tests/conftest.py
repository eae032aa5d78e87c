"""Test set-up: 8 simulated CPU devices, so every mesh axis is exercised.

This must run before anything imports JAX, which is why it lives here.
"""

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# LLVM's -O1 instead of -O2 for the CPU code XLA emits: the same HLO, compiled about 3x faster
# (a model's random init: 7.4 -> 2.4 CPU s), running as fast for the suite's tiny models
# (a 2-layer d_model=128 forward+backward: 0.62 vs 0.59 CPU s per step, the same loss).
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=1"
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
