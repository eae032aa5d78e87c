"""The analytic memory estimate of a training step per device, to rank meshes before
compiling them (`ptrain.plan.search`, `search_rl_step`); `plan.estimate` is this function.
A formula, not a measurement: the compiles in ptrain/plan.py are the measurement."""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh

from ptrain import model as model_lib
from ptrain import moe
from ptrain import sharding


@functools.lru_cache(maxsize=8)
def _param_axes(mc):
    """(shape, logical axes, dtype) of every parameter, found abstractly (no devices)."""
    state = nnx.state(nnx.eval_shape(lambda: model_lib.Transformer(mc, rngs=nnx.Rngs(0))))
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return tuple((tuple(x.shape), tuple(x.get_metadata()["axes"]), x.dtype) for x in leaves)


def estimate(mc, mesh_shape, *, seq_len, batch, chunk) -> dict:
    """Per-device bytes from a formula, to rank meshes before compiling (`search`).

    state        parameters, gradients (parameter dtype) and Adam's two moments, each leaf
                 sharded by `sharding.RULES` (exact);
    stash        what the layer scan keeps for the backward pass, per layer and local token:
                 remat full: the layer input (d); dots: also the matmul outputs
                 (3d + (h + 2k)e/T + 2f/T); none: all intermediates (~5d + 3(h+2k)e/T + 3f/T);
    layer        one layer's recomputed activations and their cotangents (2x the `none`
                 stash) plus float32 norm temporaries (4d), for the layer being differentiated;
    ring         key/value blocks in flight and their float32 gradients, and the float32
                 scores of a (block_q x block_k) tile per local head;
    weights      one layer's weights gathered (forward and backward, compute dtype) and its
                 float32 gradient before the reduce-scatter; the embedding and unembedding
                 gathered whole with float32 gradients;
    logits       float32 logits, probabilities and their gradient for one chunk;
    dispatch     MoE layers: each local token's k expert rows in and out (compute dtype),
                 their SwiGLU hidden (k x 3 f_e / T), float32 router logits and
                 probabilities; dropless over expert > 1 sends a worst-case buffer (n x k rows
                 per destination, so x expert); the stash keeps the MoE layer's rows too.
    T = tensor; local tokens = batch / (data x fsdp x expert) x seq_len / sequence (a
    dimension that does not divide is replicated, as `sharding.spec` does; a batch
    replicated over expert is split by the MoE layer itself, `ptrain.moe`).
    """
    sizes = {a: int(mesh_shape.get(a, 1)) for a in sharding.MESH_AXES}
    mesh = AbstractMesh(tuple(sizes.values()), sharding.MESH_AXES)
    c = mc
    ep = sizes["expert"]
    b_l = _local(batch, sizes["data"] * sizes["fsdp"] * ep)
    t_l = _local(seq_len, sizes["sequence"])
    tp = sizes["tensor"]
    cb, pb = jnp.dtype(c.dtype).itemsize, jnp.dtype(c.param_dtype).itemsize
    d, e, f, v, layers = c.d_model, c.head_dim, c.d_ff, c.vocab_size, c.n_layers
    h, k = c.n_heads / tp, max(c.n_kv_heads / tp, 1)  # local heads; kv heads repeat up to T
    f = f / tp
    tokens = b_l * t_l

    params = sum(_shard_elems(shape, sharding.spec(axes, shape, mesh), sizes)
                 * jnp.dtype(dtype).itemsize for shape, axes, dtype in _param_axes(c))
    n_moe = moe.n_moe_layers(c)
    # A MoE layer's MLP width per token: k experts (and the shared ones) instead of d_ff.
    f_moe = (c.n_experts_per_token * c.d_ff_expert + moe.d_ff_shared(c)) / tp
    stash_none = 5 * d + 3 * (h + 2 * k) * e + 3 * f
    stash_none_moe = 5 * d + 3 * (h + 2 * k) * e + 3 * f_moe + 2 * c.n_experts_per_token * d
    stashes = [{"full": d, "dots": 3 * d + (h + 2 * k) * e + 2 * g, "none": none}[c.remat]
               for g, none in ((f, stash_none), (f_moe, stash_none_moe))]
    attn_params = d * e * (2 * c.n_heads + 2 * c.n_kv_heads)
    layer_params = (attn_params + 3 * d * c.d_ff) / tp
    if n_moe:  # one MoE layer's local experts, gathered over fsdp
        experts_local = c.n_experts // ep if c.n_experts % ep == 0 else c.n_experts
        layer_params = max(layer_params, (attn_params + 3 * d * (
            experts_local * c.d_ff_expert + moe.d_ff_shared(c))) / tp + d * c.n_experts)
    tables = (1 if c.tie_embeddings else 2) * v * d
    moe_tokens = tokens / ep if ep > 1 and b_l == batch and batch % ep else tokens
    sends = ep if c.moe_dispatch == "dropless" and ep > 1 else 1
    dispatch = 0 if not n_moe else moe_tokens * (
        c.n_experts_per_token * (2 * sends * d + 3 * c.d_ff_expert / tp) * cb * 2
        + c.n_experts * 4 * 3)
    out = {
        "state": 4 * params,
        "stash": tokens * ((layers - n_moe) * stashes[0] + n_moe * stashes[1]) * cb,
        "layer": tokens * (2 * stash_none * cb + 4 * d * 4),
        "ring": tokens * 2 * k * e * (2 * cb + 2 * 4) + b_l * h * c.attn_block_q
        * c.attn_block_k * 4 * 3,
        "weights": layer_params * (2 * cb + 4) + tables * (pb + 4),
        "logits": b_l * min(chunk, t_l) * v * 4 * 3,
        "dispatch": dispatch,
    }
    out = {name: int(x) for name, x in out.items()}
    out["total"] = sum(out.values())
    return out


def _local(size, shards):
    """Elements of a dimension per device: split if it divides, else replicated."""
    return size // shards if size % shards == 0 else size


def _shard_elems(shape, spec, sizes):
    n = 1
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else entry)
        n *= dim // math.prod(sizes[a] for a in axes)
    return n
