"""Token layouts over sequence shards, for causal load balancing in ring attention.

With causal attention and the plain (contiguous) layout, the shard holding the end of the
sequence does all the work while the first one idles. Reordering the batch once fixes that:
  - contiguous: shard i holds chunk i of n (no reordering);
  - zigzag: the sequence is cut into 2n chunks and shard i holds chunks i and 2n-1-i;
  - striped: shard i holds tokens i, i+n, i+2n, ...
Positions travel with the tokens (`reorder` the positions too, or use `layout_permutation`,
which is exactly the reordered arange), so RoPE and the causal mask use the true positions.
"""

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "zigzag", "striped")


def layout_permutation(t, layout, shards):
    """Indices perm [t] with reorder(x)[i] = x[perm[i]]; also the reordered positions."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if shards < 1:
        raise ValueError(f"shards must be positive; got {shards}")
    chunks = 2 * shards if layout == "zigzag" else shards
    if t % chunks:
        raise ValueError(f"layout {layout!r} over {shards} shards needs a length divisible by "
                         f"{chunks}; got {t}: pad the sequence")
    idx = np.arange(t)
    if layout == "contiguous":
        return idx
    if layout == "striped":
        return idx.reshape(t // shards, shards).T.reshape(-1)
    halves = idx.reshape(chunks, t // chunks)
    order = np.stack([np.arange(shards), chunks - 1 - np.arange(shards)], axis=1).reshape(-1)
    return halves[order].reshape(-1)


def reorder(x, layout, shards, axis=1):
    """Puts the tokens of x (time on `axis`) into `layout` over `shards` sequence shards."""
    perm = layout_permutation(x.shape[axis], layout, shards)
    return _take(x, perm, axis)


def restore(x, layout, shards, axis=1):
    """Inverse of `reorder`."""
    perm = layout_permutation(x.shape[axis], layout, shards)
    return _take(x, np.argsort(perm), axis)


def _take(x, idx, axis):
    if isinstance(x, np.ndarray):
        return np.take(x, idx, axis=axis)
    x = jnp.asarray(x)
    index = (slice(None),) * (axis % x.ndim) + (jnp.asarray(idx, jnp.int32),)
    # Keeps x's sharding; on Explicit mesh axes JAX needs to be told so.
    return x.at[index].get(out_sharding=jax.typeof(x).sharding)
