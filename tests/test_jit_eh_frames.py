"""The suite runs with XLA:CPU's JIT unwind-table registrations dropped
(tests/native/no_jit_eh_frames.c, loaded by tests/conftest.py): here and in the processes
that tests start. Were they not, the rare libgcc crash that file describes could come back."""

import ctypes
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import conftest


def _dropped() -> int:
    # The library is in the global scope (RTLD_GLOBAL or LD_PRELOAD): found through dlsym.
    fn = ctypes.CDLL(None).ptrain_jit_eh_frames_dropped
    fn.restype = ctypes.c_long
    return fn()


pytestmark = pytest.mark.skipif(conftest.JIT_EH_FRAMES_KEPT is not None,
                                reason=f"not loaded: {conftest.JIT_EH_FRAMES_KEPT}")


def test_a_new_program_s_unwind_tables_never_reach_libgcc():
    before = _dropped()
    y = jax.jit(lambda x: jnp.tanh(x) * 3.0 + 1.0)(jnp.arange(11.0))
    assert _dropped() > before  # XLA's __register_frame call arrived here, not in libgcc
    assert jnp.allclose(y, jnp.tanh(jnp.arange(11.0)) * 3.0 + 1.0)
    with pytest.raises(TypeError):  # errors still unwind and come back as exceptions
        jnp.ones(3).reshape(7)


def test_a_process_a_test_starts_drops_them_too():
    code = ("import ctypes, jax, jax.numpy as jnp\n"
            "jax.jit(lambda x: x * 2)(jnp.ones(5)).block_until_ready()\n"
            "f = ctypes.CDLL(None).ptrain_jit_eh_frames_dropped\n"
            "f.restype = ctypes.c_long\n"
            "print(f())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert int(out.split()[-1]) > 0
