"""The device mesh, the logical-axis rules, and parameters born sharded.

Arrays name their dimensions with logical axes ("vocab", "embed", "heads", "batch", ...);
`RULES` below is the one place that maps them onto the mesh axes `data`, `fsdp`, `expert`,
`sequence` and `tensor`. A dimension that does not divide evenly over its mesh axes is
replicated instead (a 2-kv-head model on tensor=4 keeps its kv heads whole), so any model
runs on any mesh; a mesh axis already used by an earlier dimension of the same array is
skipped (an expert weight's "embed" dim does not shard over `expert`, which its "experts"
dim took).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Outermost to innermost (tensor: fastest links, then sequence and the expert all-to-all).
MESH_AXES = ("data", "fsdp", "expert", "sequence", "tensor")

# Logical axis -> mesh axes. Parameters shard their model dim over fsdp x sequence (the
# sequence axis holds different tokens, so for weights it is one more data-parallel axis,
# as in MaxText's context parallelism) and their heads / MLP / vocab dims over tensor;
# activations shard batch over data x fsdp and time over sequence. MoE experts shard over
# `expert`, which holds different tokens too (batch) and, for the other weights, is one more
# FSDP axis (`ptrain.moe`: tokens reach their experts by all-to-all over it).
RULES: Mapping[str, str | tuple[str, ...] | None] = {
    # parameters
    "vocab": "tensor",
    "embed": ("fsdp", "sequence", "expert"),
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "experts": "expert",
    "layers": None,
    # activations
    "batch": ("data", "fsdp", "expert"),
    "seq": "sequence",
}

_warned: set[tuple] = set()


def make_mesh(data: int = 1, fsdp: int = -1, sequence: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None, expert: int = 1) -> Mesh:
    """A mesh with axes (data, fsdp, expert, sequence, tensor); one size may be -1 (all the
    rest)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "expert": expert, "sequence": sequence,
             "tensor": tensor}
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {free}")
    known = math.prod(size for size in sizes.values() if size != -1)
    if any(size == 0 or size < -1 for size in sizes.values()):
        raise ValueError(f"mesh: axis sizes must be positive or -1, got {sizes}")
    if free:
        if len(devices) % known:
            raise ValueError(f"mesh: {len(devices)} devices do not divide by {sizes}")
        sizes[free[0]] = len(devices) // known
    if math.prod(sizes.values()) != len(devices):
        raise ValueError(
            f"mesh: {sizes} needs {math.prod(sizes.values())} devices but {len(devices)} are "
            "available; set one axis to -1 to absorb the rest")
    shape = tuple(sizes[name] for name in MESH_AXES)
    device_grid = np.asarray(devices).reshape(shape)
    return Mesh(device_grid, MESH_AXES)


def mesh_from_config(mesh_config) -> Mesh:
    """From a config section with data/fsdp/sequence/tensor (and optionally expert) sizes."""
    return make_mesh(**{name: int(mesh_config[name]) for name in MESH_AXES
                        if name != "expert" or name in mesh_config})


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes that shard the batch (RULES["batch"] present in `mesh`)."""
    return tuple(a for a in RULES["batch"] if a in mesh.shape)


def spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> P:
    """PartitionSpec for logical `axes` of an array of `shape` (replicating what won't divide)."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    out, used = [], set()
    for name, size in zip(axes, shape):
        mesh_axes = RULES.get(name) if name is not None else None
        if name is not None and name not in RULES:
            raise ValueError(f"unknown logical axis {name!r}; known: {sorted(RULES)}")
        if mesh_axes is None:
            out.append(None)
            continue
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        mesh_axes = tuple(a for a in mesh_axes if mesh.shape.get(a, 1) > 1 and a not in used)
        n = math.prod(mesh.shape[a] for a in mesh_axes)
        if n > 1 and size % n:
            key = (name, size, n)
            if key not in _warned:
                _warned.add(key)
                logging.warning("sharding: %s of size %d does not divide over %s (%d); "
                                "replicating it", name, size, mesh_axes, n)
            out.append(None)
        else:
            used.update(mesh_axes)
            out.append(mesh_axes if len(mesh_axes) > 1 else (mesh_axes[0] if mesh_axes else None))
    return P(*out)


def named(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, spec(axes, shape, mesh))


def constrain(x: jax.Array, axes: Sequence[str | None], mesh: Mesh | None) -> jax.Array:
    """Pin an activation's sharding inside jit; a no-op without a mesh."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named(mesh, axes, x.shape))


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state, mesh: Mesh):
    """The NamedSharding of every variable in an (abstract) nnx state, from its `axes`."""
    def one(var):
        axes = var.get_metadata().get("axes")
        if axes is None:
            raise ValueError(f"variable of shape {var.shape} has no `axes` metadata")
        return var.replace(named(mesh, axes, var.shape))
    return jax.tree.map(one, state, is_leaf=_is_var)


def create_sharded(make: Callable[[], nnx.Module], mesh: Mesh | None) -> nnx.Module:
    """Build a module with every parameter born on its shards (never whole on one device).

    `make` is traced twice: once abstractly (`nnx.eval_shape`) to learn shapes and logical
    axes, once under `jit` with `out_shardings`, so each device only computes its own slice.
    Without a mesh it is still jitted (one compilation instead of one per random op).
    """
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
    shardings = None if mesh is None else state_shardings(abstract_state, mesh)

    def init():
        return nnx.split(make())[1]

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def abstract(make: Callable[[], nnx.Module], mesh: Mesh | None = None):
    """(graphdef, state of ShapeDtypeStructs carrying their shardings): for plans and loading."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    if mesh is None:
        return graphdef, state
    shardings = state_shardings(state, mesh)
    return graphdef, jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)


def shard_batch(batch, mesh: Mesh | None, axes: Sequence[str | None] = ("batch", "seq")):
    """Place a host batch (a pytree of [b, t, ...] arrays) on the mesh, batch over data x fsdp.

    Each array uses the first `ndim` entries of `axes` (extra dims are replicated).
    """
    if mesh is None:
        return jax.tree.map(jax.numpy.asarray, batch)

    def put(x):
        x = np.asarray(x)
        names = tuple(axes[:x.ndim]) + (None,) * max(0, x.ndim - len(axes))
        return jax.device_put(x, named(mesh, names, x.shape))

    return jax.tree.map(put, batch)
