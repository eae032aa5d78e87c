"""The rollout engine's inference weights (`sampling.decode_dtype`): a copy of the policy
cast (bfloat16) and resharded for decoding, refreshed after each update (weight sync).

  decode_copy(params, "bfloat16", mesh)  the copy: floating-point arrays cast; on a mesh
                                         placed by `decode_shardings`
  decode_shardings(params, mesh)         the model's shardings with the model dim ("embed")
                                         whole on every device: heads, kv heads, MLP and
                                         vocab over `tensor`, experts over `expert`, nothing
                                         over fsdp, so a decode step gathers no weights
  local_mesh()                           this process's devices (heads over `tensor`): where
                                         each process of a multi-process run decodes its
                                         own whole copy, independently of the others
  DecodeWeights(dtype)                   one copy, shared by a sampler's engines: `get(params)`
                                         makes it again unless `params` are the very arrays
                                         it was made from (so the first generation after an
                                         update syncs, and a step's other calls, e.g. each
                                         turn of a terminal episode or each dynamic-sampling
                                         call, reuse it); its syncs and their seconds counted

The learner's parameters are never mutated in place (each update returns new arrays and
donates the old), so "the same arrays" means "the same weights". The copy is held by weak
references to the arrays it came from: it keeps no learner memory alive.
"""

from __future__ import annotations

import time
import weakref

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from ptrain import lora
from ptrain import sharding


def decode_copy(params, dtype: str, mesh=None, lora_scale: float | None = None):
    """The decode copy of `params` (a Module or its state): floating-point arrays cast to
    `dtype`, and with a mesh resharded by `decode_shardings`; ready when it returns.
    Parameters spread over several processes are gathered whole onto each first (a
    collective: every process calls it), for a `mesh` of this process's devices. LoRA
    (`lora_scale`: alpha / rank): the adapters merged into their weights first, so the copy
    is the base model's shape and a decode step runs no adapter matmul."""
    params = nnx.state(params) if isinstance(params, nnx.Module) else params
    if mesh is not None and not spans_processes(mesh):
        params = jax.tree.map(_whole_here, params)
    if lora_scale is not None and lora.has_adapters(params):
        params = lora.merge_adapters(params, lora_scale)
    dtype = jnp.dtype(dtype)
    cast = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                        else x, params)
    if mesh is not None:
        cast = jax.device_put(cast, decode_shardings(cast, mesh))
    return jax.block_until_ready(cast)


def decode_shardings(params, mesh):
    """Shardings for decoding: like the model's, but the model dim whole on every device
    (heads, MLP and vocab over `tensor`), so a decode step gathers no weights."""
    def one(var):
        axes = tuple(None if a == "embed" else a for a in var.get_metadata()["axes"])
        return var.replace(sharding.named(mesh, axes, var.shape))
    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def local_mesh():
    """This process's devices, heads (and MLP, vocab) over `tensor`, nothing over fsdp: the
    mesh each process decodes its own copy on, so its engine runs no collective and needs
    no other process to decode in step with it."""
    return sharding.make_mesh(data=1, fsdp=1, tensor=-1, devices=jax.local_devices())


def spans_processes(mesh) -> bool:
    return len({d.process_index for d in mesh.devices.flat}) > 1


def _whole_here(x):
    """x as a whole host array on this process when other processes hold parts of it."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return multihost_utils.process_allgather(x, tiled=True)
    return x


def mesh_of(params):
    """The mesh the parameters (a Module or its state) are placed on (their first
    NamedSharding's), or None."""
    for x in jax.tree.leaves(_state(params)):
        if isinstance(getattr(x, "sharding", None), NamedSharding):
            return x.sharding.mesh
    return None


def _ref(x):
    try:
        return weakref.ref(x)
    except TypeError:  # not weakly referable (a Python scalar): never "the same"
        return lambda: None


class DecodeWeights:
    """The decode copy of whatever parameters `get` was last given (see the module
    docstring). mesh: where to place it; default the parameters' own mesh. lora_scale:
    LoRA's alpha / rank, the adapters merged into the copy (`decode_copy`)."""

    def __init__(self, dtype: str, mesh=None, lora_scale: float | None = None):
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"decode_dtype must be float32 or bfloat16, got {dtype!r}")
        self.dtype, self.mesh, self.lora_scale = dtype, mesh, lora_scale
        self.params = None
        self.syncs, self.sync_s = 0, 0.0  # totals
        self._source = []  # weak references to the leaves the copy was made from

    def current(self, params) -> bool:
        """Whether the copy is of these very arrays."""
        leaves = jax.tree.leaves(_state(params))
        return (self.params is not None and len(leaves) == len(self._source)
                and all(r() is x for r, x in zip(self._source, leaves)))

    def get(self, params):
        """The copy of `params`, synced first unless it is `current`."""
        if not self.current(params):
            self.sync(params)
        return self.params

    def sync(self, params) -> float:
        """Makes the copy from `params` (the old one is dropped first, so the two are never
        held at once); returns its seconds."""
        start = time.perf_counter()
        state = _state(params)
        self.params, self._source = None, []
        self.params = decode_copy(state, self.dtype, self.mesh or mesh_of(state),
                                  self.lora_scale)
        self._source = [_ref(x) for x in jax.tree.leaves(state)]
        seconds = time.perf_counter() - start
        self.syncs += 1
        self.sync_s += seconds
        return seconds


def _state(params):
    return nnx.state(params) if isinstance(params, nnx.Module) else params
