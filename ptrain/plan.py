"""Memory plans: compile the long-context training step for a mesh that need not exist.

`compile_plan` builds the model abstractly (parameters and optimizer state as
ShapeDtypeStructs born sharded), lowers and compiles the real training step over a simulated
mesh (XLA's host platform with N devices: `launch/plan.py` sets
`--xla_force_host_platform_device_count`) and reports per-device memory from
`compiled.memory_analysis()` and FLOPs from `compiled.cost_analysis()`. `search` answers
"what mesh do I need for N tokens of model M": it ranks candidate meshes with `estimate` and
confirms the best with compiles against a per-device budget.

The step is `ptrain.step.packed_update` (this module has no step of its own): packed
documents of `seq_len` tokens, token-mean next-token loss (`losses.chunked_logprobs`, per
sequence shard), AdamW from `step.make_optimizer`. The learner's RL and SFT updates
(`step.update`) run each prompt through a KV cache that is not sharded over time, so at long
context the packed update, which runs the whole sequence through ring attention, is the one
to plan.

The numbers are those of XLA's CPU compiler, which schedules and fuses differently from the
GPU and TPU compilers and widens some bfloat16 buffers to float32 (the layer scan's saved
inputs among them): for bfloat16 compute they are an upper bound. Keep headroom anyway.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import long_context
from ptrain import config as config_lib
from ptrain import model as model_lib
from ptrain import moe
from ptrain import sharding
from ptrain import step as step_lib

GIB = 1 << 30
BATCH_KEYS = ("tokens_bt", "positions_bt", "segment_ids_bt", "targets_bt", "loss_mask_bt")


# ==================================================================================== config


def defaults() -> ml_collections.ConfigDict:
    """Every key a plan config holds (`ptrain.config.plan_defaults`); `check_config` rejects
    missing and unknown ones."""
    return config_lib.plan_defaults()


def check_config(config) -> None:
    """Raises a ValueError naming missing or unknown keys, or a bad value."""
    missing, unknown = config_lib.key_diff(defaults(), config)
    missing = [k for k in missing if not k.startswith("model.")]  # ModelConfig defaults
    fields = {f.name for f in dataclasses.fields(model_lib.ModelConfig)}
    unknown = [k for k in unknown if not (k.startswith("model.") and k[6:] in fields)]
    if missing or unknown:
        problems = ([f"missing keys {missing}"] if missing else []) + (
            [f"unknown keys {unknown}"] if unknown else [])
        raise ValueError(f"plan config does not match ptrain.plan.defaults(): "
                         f"{'; '.join(problems)}. model.* takes ModelConfig fields: "
                         f"{sorted(fields)}")
    mc = model_config(config)  # ModelConfig checks its own values
    if min(config.mesh.values()) < 1:
        raise ValueError(f"mesh sizes must be positive (a plan names its devices, no -1); "
                         f"got {dict(config.mesh)}")
    check_shapes(mc, dict(config.mesh), seq_len=config.seq_len, batch=config.batch,
                 layout=config.layout)
    counts = list(config.search.device_counts)
    if not counts or counts != sorted(set(counts)) or counts[0] < 1:
        raise ValueError(f"search.device_counts must be ascending positive integers; got "
                         f"{counts}")
    if config.search.confirm < 1 or config.budget_gib <= 0:
        raise ValueError("search.confirm must be >= 1 and budget_gib > 0")


def model_config(config) -> model_lib.ModelConfig:
    return model_lib.ModelConfig(**config.model.to_dict())


def check_shapes(mc, mesh_shape, *, seq_len, batch, layout) -> None:
    """The sequence must split over the mesh's `sequence` axis in `layout`; batch positive."""
    if seq_len < 1 or batch < 1:
        raise ValueError(f"seq_len and batch must be positive; got {seq_len}, {batch}")
    if layout != "contiguous" and mc.attention_impl != "ring":
        raise ValueError(f"layout {layout!r} balances ring attention; with attention_impl="
                         f"{mc.attention_impl!r} use layout 'contiguous'")
    long_context.layout_permutation(seq_len, layout, mesh_shape.get("sequence", 1))


# ======================================================================= the packed batch


def packed_batch(tokens_bt, segment_ids_bt, *, layout="contiguous", shards=1):
    """The host batch of `step.packed_update` from packed documents (segment id 0: padding).

    Positions restart at each document; the target of a token is the next token of its
    document (the loss mask is 0 at a document's last token and on padding). The arrays are
    then put in `layout` over `shards` sequence shards; positions travel with the tokens.
    """
    tokens_bt, seg_bt = np.asarray(tokens_bt, np.int32), np.asarray(segment_ids_bt, np.int32)
    if tokens_bt.shape != seg_bt.shape or tokens_bt.ndim != 2:
        raise ValueError(f"tokens {tokens_bt.shape} and segment ids {seg_bt.shape} must be "
                         "the same [batch, time] shape")
    t = tokens_bt.shape[1]
    idx_bt = np.broadcast_to(np.arange(t), tokens_bt.shape)
    new_doc_bt = np.ones(tokens_bt.shape, bool)
    new_doc_bt[:, 1:] = seg_bt[:, 1:] != seg_bt[:, :-1]
    positions_bt = idx_bt - np.maximum.accumulate(np.where(new_doc_bt, idx_bt, 0), axis=1)
    same_next_bt = np.zeros(tokens_bt.shape, bool)
    same_next_bt[:, :-1] = seg_bt[:, 1:] == seg_bt[:, :-1]
    batch = {"tokens_bt": tokens_bt, "positions_bt": positions_bt.astype(np.int32),
             "segment_ids_bt": seg_bt, "targets_bt": np.roll(tokens_bt, -1, axis=1),
             "loss_mask_bt": ((seg_bt > 0) & same_next_bt).astype(np.float32)}
    return {k: long_context.reorder(x, layout, shards, axis=1) for k, x in batch.items()}


# ======================================================================== compiled plans


def make_mesh(mesh_shape) -> jax.sharding.Mesh:
    """The first prod(sizes) devices as a (data, fsdp, sequence, tensor) mesh."""
    sizes = {a: int(mesh_shape.get(a, 1)) for a in sharding.MESH_AXES}
    unknown = set(mesh_shape) - set(sharding.MESH_AXES)
    if unknown or min(sizes.values()) < 1:
        raise ValueError(f"mesh {dict(mesh_shape)}: give positive sizes for axes of "
                         f"{sharding.MESH_AXES}")
    n, have = math.prod(sizes.values()), len(jax.devices())
    if n > have:
        raise ValueError(
            f"mesh {sizes} needs {n} devices but JAX has {have}: run launch/plan.py (it "
            f"simulates them) or set XLA_FLAGS=--xla_force_host_platform_device_count={n} "
            "before JAX is imported")
    return sharding.make_mesh(**sizes, devices=jax.devices()[:n])


def abstract_inputs(mc, mesh, *, seq_len, batch, optim):
    """(graphdef, params, opt_state, batch, tx): ShapeDtypeStructs carrying their shardings."""
    graphdef, params = sharding.abstract(
        lambda: model_lib.Transformer(mc, rngs=nnx.Rngs(0), mesh=mesh), mesh)
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    tx, _ = step_lib.make_optimizer(optim, total_steps=1)
    opt_shardings = step_lib.opt_state_shardings(tx, params, param_shardings, mesh)
    opt_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             jax.eval_shape(tx.init, params), opt_shardings)
    bt = sharding.named(mesh, ("batch", "seq"), (batch, seq_len))
    batch = {k: jax.ShapeDtypeStruct((batch, seq_len),
                                     jnp.float32 if k == "loss_mask_bt" else jnp.int32,
                                     sharding=bt) for k in BATCH_KEYS}
    return graphdef, params, opt_state, batch, tx


def jit_step(graphdef, tx, mesh, params, opt_state, *, chunk):
    """`step.packed_update` jitted with the state's shardings in and out, the state donated."""
    shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
    replicated = NamedSharding(mesh, P())
    return jax.jit(functools.partial(step_lib.packed_update, graphdef=graphdef, tx=tx, chunk=chunk),
                   out_shardings=(*shardings, replicated), donate_argnums=(0, 1))


def compile_plan(mc, mesh_shape, *, seq_len, batch, optim, chunk, layout="contiguous",
                 budget_gib=None) -> dict:
    """Compiles `step.packed_update` for `mesh_shape` and returns the per-device report (bytes)."""
    check_shapes(mc, mesh_shape, seq_len=seq_len, batch=batch, layout=layout)
    mesh = make_mesh(mesh_shape)
    t0 = time.perf_counter()
    graphdef, params, opt_state, batch_in, tx = abstract_inputs(
        mc, mesh, seq_len=seq_len, batch=batch, optim=optim)
    step = jit_step(graphdef, tx, mesh, params, opt_state, chunk=chunk)
    compiled = step.lower(params, opt_state, batch_in).compile()
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    memory = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
              "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
              "generated_code": m.generated_code_size_in_bytes,
              "xla_peak": m.peak_memory_in_bytes}
    memory["peak"] = (memory["arguments"] + memory["outputs"] - memory["aliased"]
                      + memory["temporaries"] + memory["generated_code"])
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    report = {
        "mesh": {a: int(mesh.shape[a]) for a in sharding.MESH_AXES}, "devices": mesh.size,
        "seq_len": seq_len, "batch": batch, "layout": layout, "logprob_chunk": chunk,
        "memory": memory,
        "params_bytes": _device_bytes(params), "opt_state_bytes": _device_bytes(opt_state),
        "batch_bytes": _device_bytes(batch_in),
        # XLA's count, per device: it counts each loop body once (layers, chunks, attention
        # blocks), so it is a lower bound; model_flops is the whole step's useful work.
        "xla_flops_per_device": float(cost.get("flops", 0.0)),
        "model_flops": model_flops(mc, seq_len=seq_len, batch=batch),
        "estimate": estimate(mc, mesh_shape, seq_len=seq_len, batch=batch, chunk=chunk),
        "compile_s": round(seconds, 1),
    }
    if budget_gib is not None:
        report["budget_bytes"] = int(budget_gib * GIB)
        report["fits"] = memory["peak"] <= report["budget_bytes"]
    return report


def _device_bytes(tree) -> int:
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def model_flops(mc, *, seq_len, batch) -> float:
    """Training FLOPs of one step without recomputation: 6 x matmul parameters x tokens (the
    active ones: a token passes k of the experts), plus causal attention, 6 x layers x heads
    x head_dim x seq_len^2 per sequence."""
    matmul_params = mc.n_active_params - (0 if mc.tie_embeddings else mc.vocab_size * mc.d_model)
    attention = 6.0 * mc.n_layers * mc.n_heads * mc.head_dim * seq_len ** 2
    return batch * (6.0 * matmul_params * seq_len + attention)


# ================================================================= the analytic estimate


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


# ============================================================================ the search


def candidate_meshes(mc, devices, *, seq_len, batch, layout) -> list[dict]:
    """Every (data, fsdp, expert, sequence, tensor) split of `devices` that the step can use
    well: the batch divides over data x fsdp x expert (else each device would compute the
    same rows; over expert alone it may not, the MoE layer then splits the replicated tokens
    itself), the experts over expert (a dense model: expert = 1), the kv heads over tensor
    (else they are repeated), and the sequence over `sequence` in `layout` (only ring
    attention shards the sequence)."""
    out = []
    divisors = [x for x in range(1, devices + 1) if devices % x == 0]
    experts = [x for x in divisors if mc.n_experts and mc.n_experts % x == 0] or [1]
    for data, fsdp, sequence, expert in itertools.product(divisors, divisors, divisors,
                                                          experts):
        if devices % (data * fsdp * sequence * expert):
            continue
        tensor = devices // (data * fsdp * sequence * expert)
        chunks = sequence * (2 if layout == "zigzag" else 1)
        rows = batch % (data * fsdp * expert) == 0 or (data * fsdp == 1 and expert > 1)
        if (not rows or mc.n_kv_heads % tensor or seq_len % chunks
                or (sequence > 1 and mc.attention_impl != "ring")):
            continue
        out.append(dict(data=data, fsdp=fsdp, sequence=sequence, tensor=tensor,
                        expert=expert))
    return out


def search(mc, *, seq_len, batch, optim, chunk, layout, budget_gib, device_counts,
           confirm=2) -> dict:
    """The smallest device count (of `device_counts`) with a mesh whose compiled peak fits
    `budget_gib`, and the compiles that show the next smaller count does not.

    Candidates of each count are ranked by `estimate`; the best `confirm` of a count are
    compiled until one fits. The walk starts one count below the first whose best estimate
    fits, goes up until a compile fits, then down while the smaller count fits too.
    """
    budget = int(budget_gib * GIB)
    have = len(jax.devices())
    if max(device_counts) > have:
        raise ValueError(f"search: device_counts go up to {max(device_counts)} but JAX has "
                         f"{have} devices; run launch/plan.py (it simulates them)")
    ranked = {}
    for n in sorted(device_counts):
        meshes = candidate_meshes(mc, n, seq_len=seq_len, batch=batch, layout=layout)
        scored = [(estimate(mc, m, seq_len=seq_len, batch=batch, chunk=chunk)["total"], m)
                  for m in meshes]
        if scored:
            ranked[n] = sorted(scored, key=lambda x: (x[0], x[1]["tensor"]))
    if not ranked:
        raise ValueError(f"search: no mesh of {list(device_counts)} devices suits batch "
                         f"{batch}, seq_len {seq_len} ({layout}) and {mc.n_kv_heads} kv heads")
    counts = list(ranked)
    compiled: dict[int, list[dict]] = {}

    def fits(i):
        n = counts[i]
        if n not in compiled:
            compiled[n] = []
            for _, mesh in ranked[n][:confirm]:
                logging.info("plan: compiling %s", mesh)
                compiled[n].append(compile_plan(mc, mesh, seq_len=seq_len, batch=batch,
                                                optim=optim, chunk=chunk, layout=layout,
                                                budget_gib=budget_gib))
                if compiled[n][-1]["fits"]:
                    break
        return any(r["fits"] for r in compiled[n])

    i = next((j for j, n in enumerate(counts) if ranked[n][0][0] <= budget), len(counts) - 1)
    i = max(i - 1, 0)
    while i < len(counts) and not fits(i):
        i += 1
    while 0 < i < len(counts) and fits(i - 1):
        i -= 1
    answer = None
    if i < len(counts):
        answer = min((r for r in compiled[counts[i]] if r["fits"]),
                     key=lambda r: r["memory"]["peak"])
    return {
        "model": model_lib.describe(mc), "seq_len": seq_len, "batch": batch, "layout": layout,
        "budget_bytes": budget, "answer": answer,
        "smaller": compiled.get(counts[i - 1], []) if 0 < i <= len(counts) else [],
        "compiled": [r for n in sorted(compiled) for r in compiled[n]],
        "ranking": {str(n): [{"mesh": m, "estimate": e} for e, m in ranked[n]]
                    for n in counts},
    }


# ============================================================================ from a config


def run(config, *, do_search=False) -> dict:
    """The config's plan (its mesh compiled), or with do_search its mesh search."""
    check_config(config)
    mc = model_config(config)
    common = dict(seq_len=config.seq_len, batch=config.batch, optim=config.optim,
                  chunk=config.logprob_chunk, layout=config.layout,
                  budget_gib=config.budget_gib)
    if do_search:
        return search(mc, **common, device_counts=tuple(config.search.device_counts),
                      confirm=config.search.confirm)
    return {"model": model_lib.describe(mc),
            **compile_plan(mc, dict(config.mesh), **common)}


def summary(result) -> str:
    """A few readable lines (GiB) for a `run` result."""
    def one(r):
        m, gib = r["memory"], lambda x: f"{x / GIB:.2f}"
        mesh = " x ".join(f"{a}={n}" for a, n in r["mesh"].items() if n > 1) or "1 device"
        fit = "" if "fits" not in r else (" fits" if r["fits"] else " does NOT fit")
        return (f"{r['devices']:>5} devices ({mesh}): peak {gib(m['peak'])} GiB{fit} = "
                f"arguments {gib(m['arguments'])} + outputs {gib(m['outputs'])} - aliased "
                f"{gib(m['aliased'])} + temporaries {gib(m['temporaries'])}; params "
                f"{gib(r['params_bytes'])}, optimizer {gib(r['opt_state_bytes'])}; estimate "
                f"{gib(r['estimate']['total'])}; model FLOPs {r['model_flops']:.3g} per step; "
                f"compiled in {r['compile_s']} s")

    if "answer" not in result:
        return one(result)
    lines = [f"budget {result['budget_bytes'] / GIB:.1f} GiB per device, {result['seq_len']} "
             f"tokens x batch {result['batch']}:"]
    lines += ["  " + one(r) for r in result["compiled"]]
    answer = result["answer"]
    lines.append(f"answer: {one(answer)}" if answer else
                 "answer: nothing fits; add device counts or lower the memory")
    return "\n".join(lines)


def write_json(result, path) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
