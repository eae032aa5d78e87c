"""Programs that tests run both in one process x 8 devices and in N processes (multiprocess.py).

Each returns plain numpy / Python values so the two runs can be compared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ptrain import sharding


def helpers(rows: int = 16) -> dict:
    """sharding's global-array helpers on three meshes: batch over all devices, over fsdp=2
    (tensor=4 inside a process), and replicated (tensor over all devices)."""
    out = {"process": jax.process_index(), "count": jax.process_count()}
    x_bt = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    lengths_b = np.arange(rows, dtype=np.int32) % 5
    for name, mesh in [("fsdp", sharding.make_mesh(fsdp=-1)),
                       ("fsdp2", sharding.make_mesh(fsdp=2, tensor=-1)),
                       ("tensor", sharding.make_mesh(fsdp=1, tensor=-1))]:
        rs = sharding.local_rows(mesh, rows)
        x, lengths = sharding.from_process_local((x_bt[rs], lengths_b[rs]), mesh,
                                                 global_rows=rows)
        y = jax.jit(lambda a, n: a * 2.0 + a.sum() + n[:, None])(x, lengths)
        out[name] = {"rows": (rs.start, rs.stop), "whole": sharding.to_host(y),
                     "local": sharding.to_host_local(y),
                     "sum": float(sharding.to_host(jnp.sum(y)))}
        # Without global_rows: inferred from how many processes hold different rows.
        again = sharding.from_process_local(x_bt[rs], mesh, axes=("batch", None))
        out[name]["inferred_shape"] = tuple(again.shape)
    # Host values that differ per process, agreed before they steer control flow.
    mine = 3 + 4 * jax.process_index()
    out["max"] = sharding.agree(mine, "max")
    out["min"] = sharding.agree(mine, "min")
    out["sum"] = sharding.agree(mine, "sum")
    out["any"] = sharding.agree(jax.process_index() == 1, "any")
    out["all"] = sharding.agree(jax.process_index() == 1, "all")
    out["vec"] = sharding.agree(np.array([mine, -mine]), "max")
    out["equal"] = sharding.agree(7, "equal")
    try:
        sharding.agree(mine, "equal")
        out["equal_error"] = None
    except ValueError as e:
        out["equal_error"] = str(e)
    return out


def fails_on_one() -> None:
    """Process 1 raises; the harness must report it instead of waiting on process 0."""
    if jax.process_index() == 1:
        1 / 0
    sharding.agree(1, "max")  # process 0 waits here for process 1, which is gone
