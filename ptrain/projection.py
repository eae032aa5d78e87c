"""Projections of token activations: one place that decides how [b, t, ...] x weight runs.

A projection is one 2-D matmul over the flattened tokens: XLA:CPU lowers the weight gradient
of a [b, t, ...] einsum (two contracting dims) through slow transposing copies
(bench/rl_bench.py's trunk: value and gradient 9.4x the forward's time, 5.6x flattened).
Where the mesh shards the time axis, flattening would gather the activations, so there it
stays a [b, t] contraction.
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def dense(x, w, n_in: int = 1, mesh=None):
    """x [b, t, i...] times w [i..., o...] over the n_in dims they share: [b, t, o...]."""
    if mesh is not None and mesh.shape.get("sequence", 1) > 1:
        return jnp.tensordot(x, w, n_in)
    lead, i = x.shape[:x.ndim - n_in], math.prod(x.shape[x.ndim - n_in:])
    y = x.reshape(-1, i) @ w.reshape(i, -1)
    return y.reshape(lead + w.shape[n_in:])
