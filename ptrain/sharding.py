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

    Each array uses the first `ndim` entries of `axes` (extra dims are replicated). With many
    processes the batch is the global one, the same on every process (each places only the
    shards of its own devices); for each process's own rows use `from_process_local`.
    """
    if mesh is None:
        return jax.tree.map(jax.numpy.asarray, batch)

    def put(x):
        x = np.asarray(x)
        names = tuple(axes[:x.ndim]) + (None,) * max(0, x.ndim - len(axes))
        where = named(mesh, names, x.shape)
        if jax.process_count() == 1:
            return jax.device_put(x, where)
        return jax.make_array_from_callback(x.shape, where, lambda index: x[index])

    return jax.tree.map(put, batch)


# --- Many processes (multi-controller JAX) ---------------------------------------------------
# With N processes each one holds only its own devices' shards. Host data enters the mesh from
# the rows each process owns (`from_process_local`), device results come back either whole on
# every process (`to_host`) or as the rows this process owns (`to_host_local`), and any value
# that steers control flow (a shape, a turn count, a stop decision) is agreed first (`agree`),
# so that every process issues the same programs. With one process these are plain
# device_put / device_get / identity.


def _names(axes: Sequence[str | None], ndim: int) -> tuple:
    return tuple(axes[:ndim]) + (None,) * max(0, ndim - len(axes))


def local_rows(mesh: Mesh, global_rows: int, axes: Sequence[str | None] = ("batch",)) -> slice:
    """The rows of a [global_rows, ...] array (sharded over `axes[0]`) that this process holds.

    Every process loads exactly these rows of the global batch before `from_process_local`.
    Rows replicated over the processes (a batch axis that spans no process boundary, or one
    that does not divide) are all held by every process: slice(0, global_rows).
    """
    sharding = named(mesh, _names(axes, 1), (global_rows,))
    starts = sorted({(idx[0].start or 0, global_rows if idx[0].stop is None else idx[0].stop)
                     for idx in sharding.addressable_devices_indices_map((global_rows,)).values()})
    lo, hi = starts[0][0], starts[0][1]
    for start, stop in starts[1:]:
        if start > hi:
            raise ValueError(f"this process's rows of a {global_rows}-row batch are not "
                             f"contiguous ({starts}); order the mesh's devices by process")
        hi = max(hi, stop)
    return slice(lo, hi)


def from_process_local(batch, mesh: Mesh | None, axes: Sequence[str | None] = ("batch", "seq"),
                       global_rows: int | None = None):
    """Global arrays from each process's own rows (a pytree of [local_b, t, ...] arrays).

    The local rows are the ones `local_rows(mesh, global_rows)` names; every other dimension
    is whole on every process. `global_rows` defaults to local_b x the number of processes
    that hold different rows. With one process this is `shard_batch`.
    """
    if mesh is None or jax.process_count() == 1:
        return shard_batch(batch, mesh, axes)

    def put(x):
        x = np.asarray(x)
        names = _names(axes, x.ndim)
        rows = global_rows
        if rows is None:
            rows = x.shape[0] * _row_groups(mesh, names[0], x.shape[0])
        global_shape = (rows,) + x.shape[1:]
        want = local_rows(mesh, rows, names[:1])
        if x.shape[0] != want.stop - want.start:
            raise ValueError(f"process {jax.process_index()} passed {x.shape[0]} rows but holds "
                             f"rows {want.start}:{want.stop} of {rows}")
        return jax.make_array_from_process_local_data(
            named(mesh, names, global_shape), x, global_shape)

    return jax.tree.map(put, batch)


def row_groups(mesh: Mesh | None, axis: str = "batch") -> int:
    """How many distinct blocks of rows the processes hold for a logical `axis`: the number of
    processes when the batch axes cross every process boundary, 1 when rows are replicated
    over processes (e.g. tensor parallelism over all devices)."""
    if mesh is None or jax.process_count() == 1:
        return 1
    mesh_axes = RULES.get(axis)
    mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
    if not mesh_axes:
        return 1
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    moved = np.moveaxis(procs, [mesh.axis_names.index(a) for a in mesh_axes],
                        range(len(mesh_axes)))
    n = math.prod(mesh.shape[a] for a in mesh_axes)
    along = moved.reshape(n, -1)[:, 0]  # the process of each block, other axes at 0
    return len(set(along.tolist()))


def _row_groups(mesh: Mesh, axis: str | None, local_b: int) -> int:
    """row_groups, or 1 where the global rows would not divide (then `spec` replicates)."""
    if axis is None:
        return 1
    groups = row_groups(mesh, axis)
    mesh_axes = RULES.get(axis)
    mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
    n = math.prod(mesh.shape[a] for a in mesh_axes)
    if n > 1 and (local_b * groups) % n:
        return 1
    return groups


def row_block(mesh: Mesh | None, axis: str = "batch") -> tuple[int, int]:
    """(which block, how many blocks): the block of every global batch's rows that this
    process holds (`local_rows`), of the `row_groups` blocks the processes hold in all. A
    data stream gives each process block `index` of `count` (`ptrain.data.prompt_batches`'
    process_index / process_count); with one process, or rows replicated over processes,
    (0, 1)."""
    count = row_groups(mesh, axis)
    if count == 1:
        return 0, 1
    mesh_axes = RULES.get(axis)
    mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
    n = math.prod(mesh.shape[a] for a in mesh_axes)  # a batch of n rows divides
    return local_rows(mesh, n, (axis,)).start * count // n, count


def gather_objects(value) -> list:
    """`value` (any picklable host object) of every process, in process order (a collective;
    every process calls it). With one process: [value]."""
    if jax.process_count() == 1:
        return [value]
    import pickle

    from jax.experimental import multihost_utils
    data = np.frombuffer(pickle.dumps(value), np.uint8)
    size = int(np.max(multihost_utils.process_allgather(np.int64(data.size))))
    padded = np.zeros(size + 8, np.uint8)
    padded[:8] = np.frombuffer(np.int64(data.size).tobytes(), np.uint8)
    padded[8:8 + data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [pickle.loads(bytes(row[8:8 + int(row[:8].view(np.int64)[0])])) for row in rows]


def gather_blocks(value, mesh: Mesh | None, axis: str = "batch") -> list:
    """`value` of each block of rows (`row_block`), in block order: what the processes that
    hold different rows each have (processes sharing a block send theirs once)."""
    out = {}
    for index, v in gather_objects((row_block(mesh, axis)[0], value)):
        out.setdefault(index, v)
    return [out[i] for i in sorted(out)]


def to_memory(tree, kind: str):
    """Every array of `tree` in memory `kind` of the devices it is on, sharded as it is:
    "device", or "pinned_host" (host memory the devices copy from directly; e.g. a frozen
    model between uses). Raises, naming the kinds there are, where the devices have none."""
    kinds = [m.kind for m in jax.local_devices()[0].addressable_memories()]
    if kind not in kinds:
        raise ValueError(f"memory kind {kind!r} is not on this backend's devices "
                         f"({jax.default_backend()}: {kinds})")
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), tree)


def to_host(tree):
    """Device arrays -> numpy, whole on every process (an all-gather across processes)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def get(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(get, tree)


def to_host_local(tree):
    """Device arrays -> numpy, only the rows (dim 0) this process holds; no communication.

    The inverse of `from_process_local`: rows come back in global order, each once.
    """
    def get(x):
        if not isinstance(x, jax.Array):
            return np.asarray(x)
        if x.ndim == 0:
            return np.asarray(x.addressable_data(0))
        blocks = {}
        for shard in x.addressable_shards:
            rows = shard.index[0] if shard.index else slice(None)
            start = rows.start or 0
            if start not in blocks:
                blocks[start] = np.asarray(shard.data)
        return np.concatenate([blocks[k] for k in sorted(blocks)], axis=0)

    return jax.tree.map(get, tree)


def agree(value, op: str = "max"):
    """The same value on every process: the max / min / sum over processes, or "all"/"any" of a
    bool, or "equal" (raises, naming the processes' values, if they differ).

    For control flow that depends on host data (a padded length, a turn count, whether to
    stop): without it processes would issue different SPMD programs and hang.
    """
    ops = {"max": np.max, "min": np.min, "sum": np.sum, "all": np.all, "any": np.any,
           "equal": None}
    if op not in ops:
        raise ValueError(f"agree: op must be one of {sorted(ops)}, got {op!r}")
    x = np.asarray(value)
    if jax.process_count() == 1:
        gathered = x[None]
    else:
        from jax.experimental import multihost_utils
        dtype = np.int32 if x.dtype == np.bool_ else x.dtype
        gathered = np.asarray(multihost_utils.process_allgather(x.astype(dtype)))
    if op == "equal":
        if not (gathered == gathered[0]).all():
            raise ValueError(f"processes disagree: {gathered.tolist()}")
        out = gathered[0]
    else:
        out = ops[op](gathered, axis=0)
    out = out.astype(x.dtype)
    return out.item() if out.ndim == 0 and not isinstance(value, np.ndarray) else out
