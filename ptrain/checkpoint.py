"""Checkpoints on orbax: params, optimizer state, step, PRNG key and data-iterator state.

One step is one orbax checkpoint with two items: `state` (the arrays, saved sharded) and
`meta` (JSON: the grain iterator state and any small host-side values, such as a KL
coefficient). `aux_state` holds more named array pytrees saved next to the parameters (the
PPO critic's parameters and optimizer state); `host_state` named nested dicts of numpy
arrays that live on the host (rl.interrupt's finished pending batches), restored as numpy
with no target needed (their shapes are in `meta`). Saves are asynchronous; orbax writes each step
into a temporary directory and renames it when complete, so a process killed mid-save leaves
the previous checkpoint intact and the incomplete one is never listed. Restores go onto the
shardings of a target pytree (concrete arrays or `jax.ShapeDtypeStruct`s with `.sharding`),
which may differ from the shardings at save time.

Many processes: every process calls `save` / `restore`; each writes its own shards of the
arrays. Each process's data-iterator state (its own shard of the prompt stream) is gathered
into `meta` at save time and handed back to the same process at restore; a restore on a
different number of processes lands the arrays on the new shardings but cannot resume the
data streams exactly, so `data_state` is then None (and a warning says so).
"""

import dataclasses
import json
import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger("ptrain.checkpoint")


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    params: Any
    opt_state: Any
    rng: Any
    data_state: Any
    extra: dict
    aux_state: dict = dataclasses.field(default_factory=dict)
    host_state: dict = dataclasses.field(default_factory=dict)


def _is_typed_key(x):
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _abstract(tree):
    """ShapeDtypeStructs (with sharding where known) describing the restore target. With many
    processes, a leaf without a global sharding (a PRNG key, an optimizer's step count made
    outside jit) comes back replicated over every device of every process."""
    replicated = None
    if jax.process_count() > 1:
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("all",))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def leaf(x):
        sharding = getattr(x, "sharding", None)
        if replicated is not None and (sharding is None or sharding.is_fully_addressable):
            sharding = replicated
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.tree.map(leaf, tree)


def _gather_json(value) -> list:
    """`value` (JSON-able) of every process, in process order (a collective)."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils
    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    size = int(np.max(multihost_utils.process_allgather(np.int32(data.size))))
    padded = np.zeros(size, np.uint8)
    padded[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in rows]


def _host_local(tree):
    """With many processes, the arrays a process holds whole on its own devices (a PRNG key's
    data, an optimizer's step count made outside jit; not global arrays) as numpy, which
    orbax writes once, from the primary process (it refuses host-local jax arrays)."""
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(
        lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x,
        tree)


_ARRAY = "__array__"  # a host_state leaf in meta: [dtype, shape]


def _host_split(tree, path="host_state"):
    """host_state (nested dicts of numpy arrays) -> (its non-empty arrays, which orbax saves;
    the spec of every array, for meta: orbax refuses zero-size arrays, made again from it)."""
    if isinstance(tree, np.ndarray):
        return (tree if tree.size else None), {_ARRAY: [tree.dtype.str, list(tree.shape)]}
    if not isinstance(tree, dict):
        raise TypeError(f"checkpoint {path}: nested dicts of numpy arrays only, not "
                        f"{type(tree).__name__}")
    arrays, specs = {}, {}
    for name, value in tree.items():
        sub, specs[str(name)] = _host_split(value, f"{path}.{name}")
        if sub is not None and (not isinstance(sub, dict) or sub):
            arrays[str(name)] = sub
    return arrays, specs


def _host_arrays(specs, got=None):
    """The arrays `specs` (from `_host_split`) describe: `got`'s (what orbax restored) where it
    has them, zeros otherwise (the zero-size ones; with no `got`, the restore target)."""
    if _ARRAY in specs:
        dtype, shape = specs[_ARRAY]
        return got if got is not None else np.zeros(shape, np.dtype(dtype))
    return {name: _host_arrays(spec, (got or {}).get(name)) for name, spec in specs.items()}


class Checkpointer:
    """Saves and restores training state under `directory/<step>/`; keeps the last N."""

    def __init__(self, directory, *, max_to_keep=3, async_save=True):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True)
        self._manager = ocp.CheckpointManager(os.path.abspath(directory), options=options,
                                              item_names=("state", "meta"))

    def save(self, step, *, params, opt_state, rng, data_state=None, extra=None,
             aux_state=None, host_state=None):
        """Starts saving `step` (returns before the arrays are written when async).

        aux_state: None or a dict of named array pytrees, restored by name.
        host_state: None or nested dicts of numpy arrays (`Restored.host_state`).
        """
        typed = _is_typed_key(rng)
        state = {"params": params, "opt_state": opt_state,
                 "rng": jax.random.key_data(rng) if typed else rng}
        if aux_state:
            state["aux_state"] = dict(aux_state)
        state = _host_local(state)
        host_arrays, host_specs = _host_split(host_state or {})
        if host_arrays:
            state["host_state"] = host_arrays
        data_states = _gather_json(data_state)
        meta = {"data_state": data_states[0], "data_states": data_states, "extra": extra or {},
                "rng_impl": str(jax.random.key_impl(rng)) if typed else None,
                "aux_state": sorted(aux_state or {}), "host_state": host_specs}
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def latest_step(self):
        """The newest complete step, or None."""
        return self._manager.latest_step()

    def all_steps(self):
        return list(self._manager.all_steps())

    def restore(self, step=None, *, params, opt_state, rng, aux_state=None):
        """Restores `step` (default: the latest complete one) onto the targets' shardings.

        params / opt_state / rng are targets: arrays or ShapeDtypeStructs (with sharding),
        e.g. from `jax.eval_shape`. A typed PRNG key target gets a typed key back.
        aux_state: targets of the named pytrees saved with the step; the names must match.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self._manager.directory}")
        meta = self._manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]
        saved, wanted = meta.get("aux_state", []), sorted(aux_state or {})
        if saved != wanted:
            raise ValueError(
                f"checkpoint step {step} in {self._manager.directory} holds aux state {saved} "
                f"but the restore asks for {wanted}: resume with the config that wrote it "
                "(a run with rl.estimator='gae' saves its critic, one with rl.staleness=1 the "
                "parameters its next batch is generated from), or start a new workdir")
        rng_target = rng
        if _is_typed_key(rng):  # saved as its key data
            data = jax.eval_shape(jax.random.key_data, rng)
            rng_target = jax.ShapeDtypeStruct(data.shape, data.dtype,
                                              sharding=getattr(rng, "sharding", None))
        target = {"params": params, "opt_state": opt_state, "rng": rng_target}
        if aux_state:
            target["aux_state"] = dict(aux_state)
        target = _abstract(target)
        host_specs = meta.get("host_state", {})
        host_target, _ = _host_split(_host_arrays(host_specs))
        if host_target:
            target["host_state"] = host_target  # (numpy targets: restored as numpy)
        state = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target)))["state"]
        rng_out = state["rng"]
        if _is_typed_key(rng):
            rng_out = jax.random.wrap_key_data(rng_out, impl=meta["rng_impl"])
        return Restored(step=step, params=state["params"], opt_state=state["opt_state"],
                        rng=rng_out, data_state=self._data_state(step, meta),
                        extra=meta["extra"],
                        aux_state=state.get("aux_state", {}),
                        host_state=_host_arrays(host_specs, state.get("host_state")))

    def _data_state(self, step, meta):
        """This process's data state (the one state of an older checkpoint)."""
        states = meta.get("data_states", [meta["data_state"]])
        n, i = jax.process_count(), jax.process_index()
        if len(states) == n:
            return states[i]
        log.warning("checkpoint step %d in %s was saved by %d processes, restored by %d: the "
                    "arrays land on the new shardings, but the data streams start afresh "
                    "(their order cannot be resumed exactly on another process count)",
                    step, self._manager.directory, len(states), n)
        return None

    def restore_params(self, step=None, *, params):
        """Only the parameters of `step` (default: the latest), onto `params`' shardings (arrays
        or ShapeDtypeStructs): for export and evaluation, with no optimizer to rebuild."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self._manager.directory}")
        if step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint of step {step} in "
                                    f"{self._manager.directory}; it has {self.all_steps()}")
        target = {"params": _abstract(params)}
        return self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True)))["state"]["params"]

    def aux_keys(self, step=None) -> dict[str, list[str]]:
        """The keys of each aux_state pytree `step` (default: the latest) saved, from its
        metadata (no array is read): e.g. {"ahead_params": ["0", "1"]}."""
        tree = self._state_metadata(step)
        return {name: sorted(map(str, sub)) for name, sub in tree.get("aux_state", {}).items()}

    def _state_metadata(self, step):
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self._manager.directory}")
        metadata = ocp.StandardCheckpointer().metadata(
            os.path.join(os.fspath(self._manager.directory), str(step), "state"))
        tree = getattr(metadata, "item_metadata", metadata)
        return getattr(tree, "tree", tree)

    def param_shapes(self, step=None) -> dict[tuple[str, ...], tuple[int, ...]]:
        """The saved parameters' shapes by path (nnx's trailing "value" dropped), from the
        metadata of `step` (default: the latest): no array is read."""
        tree = self._state_metadata(step)["params"]
        out = {}
        for path, leaf in jax.tree_util.tree_leaves_with_path(
                tree, is_leaf=lambda x: hasattr(x, "shape")):
            names = tuple(str(getattr(k, "key", k)) for k in path)
            out[names[:-1] if names[-1] == "value" else names] = tuple(leaf.shape)
        return out

    def wait(self):
        """Blocks until pending asynchronous saves are complete."""
        self._manager.wait_until_finished()

    def close(self):
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
