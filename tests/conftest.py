"""Test set-up: 8 simulated CPU devices, so every mesh axis is exercised.

This must run before anything imports JAX, which is why it lives here.
"""

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


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
