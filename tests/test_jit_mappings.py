"""tests/conftest.py drops a worker's compiled programs before their JIT mappings reach the
kernel's vm.max_map_count (the cause of the test_packing worker crash of 2026-12-03)."""

import conftest
import jax
import jax.numpy as jnp
import pytest


@pytest.mark.skipif(not conftest._MAP_LIMIT, reason="no /proc/sys/vm/max_map_count here")
def test_a_worker_near_the_map_limit_drops_its_compiled_programs(monkeypatch):
    before = conftest._mappings()
    kept = [jax.jit(lambda x, i=i: jnp.sin(x * i) @ x.T + i) for i in range(100)]
    for f in kept:
        f(jnp.ones((8, 8))).block_until_ready()
    grown = conftest._mappings()
    assert grown - before >= 100  # each program's code is mapped while it is cached

    conftest.pytest_runtest_teardown(None, None)  # far below the limit: nothing happens
    assert conftest._mappings() >= grown - 10
    monkeypatch.setattr(conftest, "_MAP_LIMIT", 2 * before)  # now past half of it
    conftest.pytest_runtest_teardown(None, None)
    assert conftest._mappings() < before + (grown - before) // 4
    assert float(kept[3](jnp.ones((8, 8)))[0, 0]) == pytest.approx(
        float((jnp.sin(jnp.ones((8, 8)) * 3) @ jnp.ones((8, 8)) + 3)[0, 0]))  # recompiles
