"""Memory plans: compile the training step for a mesh that need not exist.

The model is built abstractly (parameters and optimizer state as ShapeDtypeStructs born
sharded), the step is lowered and compiled over a simulated mesh (XLA's host platform with N
devices: `launch/plan.py` sets `--xla_force_host_platform_device_count`), and per-device
memory comes from `compiled.memory_analysis()`. This module has no step of its own: it
compiles the functions of `ptrain.step` that the learner runs.

  compile_plan     `step.packed_update` (a plan config, `ptrain.config.plan_defaults`):
                   packed documents of `seq_len` tokens, ring attention over `sequence`,
                   token-mean next-token loss, AdamW from `step.make_optimizer`; FLOPs from
                   `compiled.cost_analysis()`. It is packed SFT's step (`learner.sft` with
                   sft.packing), compiled through the same `step.jit_packed_update`; the
                   batch is `packing.packed_batch`'s. The RL and unpacked SFT updates run
                   each prompt through a KV cache that is not sharded over time, so at long
                   context (configs/long_context_1m.py) packed SFT is the step to plan.
  compile_rl_step  the learner's own RL step for a learner config (`ptrain.config.defaults`,
                   e.g. configs/grpo_toy.py with its mesh sizes named): the sampler's
                   prefill and decode loop (`Sampler.compile`), `step.prepare`, then
                   `step.update` for the critic (rl.estimator="gae") and the policy, through
                   `step.jit_update` as `learner.train` calls them; the memory of policy,
                   optimizer, reference, critic, KV cache, the engines' decode copy
                   (sampling.decode_dtype) and activations.
  search           "what mesh do I need for N tokens of model M": ranks candidate meshes
                   with `estimate` (ptrain/plan_estimate.py) and confirms the best with
                   compiles of `compile_plan` against a budget; `search_rl_step` the same
                   walk over `compile_rl_step` for a learner config.

The numbers are those of XLA's CPU compiler, which schedules and fuses differently from the
GPU and TPU compilers and widens some bfloat16 buffers to float32 (the layer scan's saved
inputs among them): for bfloat16 compute they are an upper bound. Keep headroom anyway.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import time

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

import long_context
from ptrain import config as config_lib
from ptrain import critic as critic_lib
from ptrain import model as model_lib
from ptrain import moe
from ptrain import packing
from ptrain import sharding
from ptrain import step as step_lib
from ptrain.generate import decode_weights
from ptrain.plan_estimate import estimate

GIB = 1 << 30


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
                                     sharding=bt) for k in packing.BATCH_KEYS}
    return graphdef, params, opt_state, batch, tx


def compile_plan(mc, mesh_shape, *, seq_len, batch, optim, chunk, layout="contiguous",
                 budget_gib=None) -> dict:
    """Compiles `step.packed_update` for `mesh_shape` and returns the per-device report (bytes)."""
    check_shapes(mc, mesh_shape, seq_len=seq_len, batch=batch, layout=layout)
    mesh = make_mesh(mesh_shape)
    t0 = time.perf_counter()
    graphdef, params, opt_state, batch_in, tx = abstract_inputs(
        mc, mesh, seq_len=seq_len, batch=batch, optim=optim)
    step = step_lib.jit_packed_update(graphdef, tx, mesh, chunk)  # packed SFT's program
    key = jax.random.key(0) if mc.lora_dropout else None  # (LoRA dropout's masks)
    compiled = step.lower(params, opt_state, batch_in, key).compile()
    seconds = time.perf_counter() - t0
    memory = _memory(compiled)
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


def _memory(compiled) -> dict:
    """Per-device bytes of a compiled program; peak = arguments + outputs - aliased (donated
    buffers reused) + temporaries + code."""
    m = compiled.memory_analysis()
    memory = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
              "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
              "generated_code": m.generated_code_size_in_bytes,
              "xla_peak": m.peak_memory_in_bytes}
    memory["peak"] = (memory["arguments"] + memory["outputs"] - memory["aliased"]
                      + memory["temporaries"] + memory["generated_code"])
    return memory


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


# ===================================================================== the learner's RL step


def compile_rl_step(config, mesh_shape, *, budget_gib=None) -> dict:
    """Compiles the RL step of a learner config (checked as `learner.train` checks it) for
    `mesh_shape` and returns the per-device report (bytes).

    The programs are the learner's, in the order a step runs them: the sampler's prefill and
    decode loop (`Sampler.compile`), `step.prepare`, then `step.jit_update` with the config's
    resolved settings for the critic (rl.estimator="gae") and the policy, on abstract inputs
    of the step's shapes (data.prompts_per_step x sampling.num_samples rows, prompts of
    data.max_prompt_len tokens, continuations of rollout.max_len tokens in the closed loop,
    sampling.max_new_tokens otherwise), each batch input the previous program's output. The
    sampling call is a single-turn step's (the prompts, G samples each) or, in the closed
    loop, a later turn's (every history, up to max_prompt_len + rollout.max_len tokens): the
    largest cache. "step_peak" is the largest program peak plus what stays live beside it
    (optimizer state, reference policy, the other model); "memory" names its parts.
    """
    from ptrain import learner as learner_lib  # the learner's model (hf_model or not)
    from ptrain.generate import sampler as sampler_lib
    config_lib.check(config)
    mesh = make_mesh(mesh_shape)
    config_lib.check_mesh(config, mesh.shape)
    mc, resolved = learner_lib.model_config(config), config_lib.resolve(config)
    t0 = time.perf_counter()
    optim = dict(total_steps=config.steps, updates_per_step=resolved.updates_per_step)
    policy = _abstract_state(lambda: model_lib.Transformer(mc, rngs=nnx.Rngs(0), mesh=mesh),
                             mesh, step_lib.make_optimizer(config.optim, **optim)[0])
    critic = None
    if resolved.critic is not None:
        critic = _abstract_state(lambda: critic_lib.Critic(mc, rngs=nnx.Rngs(0), mesh=mesh),
                                 mesh, step_lib.make_optimizer(config.critic.optim, **optim)[0])
    # The learner's copy of the params (with LoRA none: the base, adapters off, is the reference).
    ref = policy["params"] if config.kl.coef > 0 and not mc.lora_rank else None
    held_ref = None if config.kl.ref_offload else ref  # offloaded: on the host between uses
    # sampling.decode_dtype: the engines' inference copy (ptrain/generate/decode_weights.py), made at a
    # step's first generation and kept until the next step's: live beside every program.
    copy = (abstract_decode_copy(policy["params"], config.sampling.decode_dtype, mesh)
            if config.sampling.decode_dtype else None)
    critic_state = critic and (critic["params"], critic["opt_state"])
    rows = config.data.prompts_per_step * config.sampling.num_samples
    length = config.rollout.max_len if "rollout" in config else config.sampling.max_new_tokens
    batch = rl_batch(mesh, rows=rows, prompt_len=config.data.max_prompt_len, length=length,
                     routing=(moe.n_moe_layers(mc), mc.n_experts_per_token)
                     if mc.n_experts else None)
    kl = jax.ShapeDtypeStruct((), jnp.float32)

    programs, live = {}, {}
    s = config.sampling
    if "rollout" in config:  # a later turn: every episode's history so far, one sample each
        call = dict(prompts=rows, num_samples=1, prompt_len=max(8, _next_pow2(
            config.data.max_prompt_len + config.rollout.max_len)))
    else:
        call = dict(prompts=config.data.prompts_per_step, num_samples=s.num_samples,
                    prompt_len=config.data.max_prompt_len)
    sampler = sampler_lib.Sampler(nnx.merge(policy["graphdef"], policy["params"]))
    sampling = sampler.compile(policy["params"], **call, max_new_tokens=s.max_new_tokens,
                               temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                               stop_token_ids=tuple(s.stop_token_ids))
    kv_cache = _outputs(sampling["sample_prefill"])["cache"]
    for name, compiled in sampling.items():
        programs[name] = _memory(compiled)
        live[name] = [policy["opt_state"], held_ref, critic_state, copy]
    prepare = step_lib.prepare.lower(
        policy["params"], ref, critic and critic["params"], batch, kl,
        graphdef=policy["graphdef"], critic_graphdef=critic and critic["graphdef"],
        s=resolved.rl).compile()
    prepared = _outputs(prepare)[0]  # (batch, metrics)
    programs["prepare"] = _memory(prepare)
    live["prepare"] = [policy["opt_state"], critic and critic["opt_state"], copy]
    for name, state, settings, other in (
            ("critic_update", critic, resolved.critic, policy),
            ("update", policy, resolved.rl, critic)):
        if state is None:
            continue
        fn = step_lib.jit_update(state["graphdef"], settings, state["tx"], mesh)
        key = jax.random.key(0) if mc.lora_dropout and name == "update" else None
        compiled = fn.lower(state["params"], state["opt_state"], prepared, kl, key).compile()
        programs[name] = _memory(compiled)
        live[name] = [held_ref, other and (other["params"], other["opt_state"]), copy]
    peaks = {n: programs[n]["peak"] + _device_bytes(live[n]) for n in programs}
    peak_program = max(peaks, key=peaks.get)
    report = {
        "mesh": {a: int(mesh.shape[a]) for a in sharding.MESH_AXES}, "devices": mesh.size,
        "rows": rows, "prompt_len": config.data.max_prompt_len, "length": length,
        "sampling_call": {**call, "max_new_tokens": s.max_new_tokens,
                          "engine": bool(s.engine)},
        "programs": programs, "step_peak": peaks[peak_program],
        "params_bytes": _device_bytes(policy["params"]),
        # LoRA: the adapters' bytes (what the optimizer state mirrors); else every parameter's.
        "trainable_bytes": _device_bytes(step_lib.split_trainable(policy["params"])[0]),
        "opt_state_bytes": _device_bytes(policy["opt_state"]),
        "reference_bytes": _device_bytes(ref),
        "critic_bytes": _device_bytes(critic_state),
        "kv_cache_bytes": _device_bytes(kv_cache),
        "decode_copy_bytes": _device_bytes(copy),
        "batch_bytes": _device_bytes(batch),
        # What the peak is made of: the state that lives through the step, the cache if the
        # peak is a sampling program, and the peak program's temporaries (activations and
        # XLA's scratch); the rest is that program's other inputs and outputs.
        "memory": {"peak_program": peak_program,
                   "policy": _device_bytes(policy["params"]),
                   "optimizer": _device_bytes(policy["opt_state"]),
                   "reference": _device_bytes(ref if peak_program == "prepare" else held_ref),
                   "critic": _device_bytes(critic_state),
                   "kv_cache": _device_bytes(kv_cache) if peak_program in sampling else 0,
                   "decode_copy": _device_bytes(copy),
                   "activations": programs[peak_program]["temporaries"]},
        "compile_s": round(time.perf_counter() - t0, 1),
    }
    if budget_gib is not None:
        report["budget_bytes"] = int(budget_gib * GIB)
        report["fits"] = report["step_peak"] <= report["budget_bytes"]
    return report


def abstract_decode_copy(params, dtype: str, mesh):
    """The decode copy `decode_weights.decode_copy(params, dtype, mesh)` makes, as
    ShapeDtypeStructs: floating-point arrays in `dtype`, placed by `decode_shardings`."""
    dt = jnp.dtype(dtype)
    return jax.tree.map(
        lambda x, where: jax.ShapeDtypeStruct(
            x.shape, dt if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, sharding=where),
        params, decode_weights.decode_shardings(params, mesh))


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def rl_batch(mesh, *, rows, prompt_len, length, routing=None) -> dict:
    """The device batch of `step.prepare` (`batch.Batch.arrays()`) as ShapeDtypeStructs placed
    as `sharding.shard_batch` places it (rows over the batch axes, time over `seq`). routing:
    (MoE layers, experts per token) of a mixture-of-experts model, whose sampler records each
    token's experts (`experts_bnlk`, `prompt_experts_bplk`)."""
    shapes = {"prompt_bp": ((rows, prompt_len), jnp.int32), "prompt_lens_b": ((rows,), jnp.int32),
              "tokens_bn": ((rows, length), jnp.int32), "lengths_b": ((rows,), jnp.int32),
              "loss_mask_bn": ((rows, length), jnp.float32),
              "rollout_logp_bn": ((rows, length), jnp.float32),
              "rewards_b": ((rows,), jnp.float32), "group_ids_b": ((rows,), jnp.int32)}
    if routing is not None:
        shapes["experts_bnlk"] = ((rows, length, *routing), jnp.int32)
        shapes["prompt_experts_bplk"] = ((rows, prompt_len, *routing), jnp.int32)
    names = ("batch", "seq", None, None)
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.named(
        mesh, names[:len(shape)], shape)) for k, (shape, dtype) in shapes.items()}


def _abstract_state(make, mesh, tx) -> dict:
    """graphdef, params and opt_state (ShapeDtypeStructs with the learner's shardings), tx;
    with LoRA the optimizer state is the adapters' (`step.split_trainable`)."""
    graphdef, params = sharding.abstract(make, mesh)
    trainable = step_lib.split_trainable(params)[0]
    shardings = step_lib.opt_state_shardings(tx, trainable, jax.tree.map(
        lambda x: x.sharding, trainable), mesh)
    opt_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             jax.eval_shape(tx.init, trainable), shardings)
    return {"graphdef": graphdef, "params": params, "opt_state": opt_state, "tx": tx}


def _outputs(compiled):
    """A compiled program's outputs as ShapeDtypeStructs with the shardings it produces."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        compiled.out_info, compiled.output_shardings)


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
    answer, smaller, compiled = _walk(ranked, lambda mesh: compile_plan(
        mc, mesh, seq_len=seq_len, batch=batch, optim=optim, chunk=chunk, layout=layout,
        budget_gib=budget_gib), budget=budget, confirm=confirm, peak=lambda r: r["memory"]["peak"])
    return {
        "model": model_lib.describe(mc), "seq_len": seq_len, "batch": batch, "layout": layout,
        "budget_bytes": budget, "answer": answer, "smaller": smaller, "compiled": compiled,
        "ranking": {str(n): [{"mesh": m, "estimate": e} for e, m in ranked[n]]
                    for n in ranked},
    }


def search_rl_step(config, *, budget_gib, device_counts, confirm=2) -> dict:
    """`search` for a learner config: the smallest device count with a mesh whose RL step
    (`compile_rl_step`: the sampler's programs, step.prepare and step.update as
    `learner.train` runs them) fits `budget_gib` per device.

    Candidates are the meshes of `candidate_meshes` for the step's rows and tokens (prompt +
    continuation) that the learner accepts (`config.check_mesh`: the microbatches divide),
    ranked by `estimate` (the update's activations and state) plus the reference policy and
    the critic; the walk and the compiles are `search`'s."""
    from ptrain import learner as learner_lib
    config_lib.check(config)
    mc = learner_lib.model_config(config)
    budget = int(budget_gib * GIB)
    have = len(jax.devices())
    if not device_counts or max(device_counts) > have:
        raise ValueError(f"search: device_counts {list(device_counts)} must be given and go up "
                         f"to at most the {have} devices JAX has; run launch/plan.py (it "
                         "simulates them)")
    rows = config.data.prompts_per_step * config.sampling.num_samples
    length = config.rollout.max_len if "rollout" in config else config.sampling.max_new_tokens
    tokens = config.data.max_prompt_len + length
    extra = (1 if config.kl.coef > 0 else 0) + (3 if config.rl.estimator == "gae" else 0)
    ranked = {}
    for n in sorted(device_counts):
        scored = []
        for mesh in candidate_meshes(mc, n, seq_len=tokens, batch=rows, layout="contiguous"):
            try:
                config_lib.check_mesh(config, mesh)
            except ValueError:
                continue
            e = estimate(mc, mesh, seq_len=tokens, batch=rows, chunk=config.rl.logprob_chunk)
            scored.append((e["total"] + extra * e["state"] // 4, mesh))  # + ref, critic
        if scored:
            ranked[n] = sorted(scored, key=lambda x: (x[0], x[1]["tensor"]))
    if not ranked:
        raise ValueError(f"search: no mesh of {list(device_counts)} devices suits {rows} rows "
                         f"(and the config's microbatches), {tokens} tokens and "
                         f"{mc.n_kv_heads} kv heads")
    answer, smaller, compiled = _walk(
        ranked, lambda mesh: compile_rl_step(config, mesh, budget_gib=budget_gib),
        budget=budget, confirm=confirm, peak=lambda r: r["step_peak"])
    return {
        "model": model_lib.describe(mc), "seq_len": tokens, "batch": rows,
        "layout": "contiguous", "budget_bytes": budget, "answer": answer, "smaller": smaller,
        "compiled": compiled,
        "ranking": {str(n): [{"mesh": m, "estimate": e} for e, m in ranked[n]]
                    for n in ranked},
    }


def _walk(ranked, compile_mesh, *, budget, confirm, peak):
    """The walk of `search` over device counts (`ranked`: count -> [(estimate, mesh)], best
    first): start one count below the first whose best estimate fits, go up until a compile
    fits, then down while the smaller count fits too. Returns (the answer: the fitting
    report with the lowest `peak`, or None; the reports of the next smaller count; every
    report compiled)."""
    counts = list(ranked)
    compiled: dict[int, list[dict]] = {}

    def fits(i):
        n = counts[i]
        if n not in compiled:
            compiled[n] = []
            for _, mesh in ranked[n][:confirm]:
                logging.info("plan: compiling %s", mesh)
                compiled[n].append(compile_mesh(mesh))
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
        answer = min((r for r in compiled[counts[i]] if r["fits"]), key=peak)
    smaller = compiled.get(counts[i - 1], []) if 0 < i <= len(counts) else []
    return answer, smaller, [r for n in sorted(compiled) for r in compiled[n]]


# ============================================================================ from a config


def run(config, *, do_search=False, budget_gib=None, device_counts=None, confirm=None) -> dict:
    """The config's plan (its mesh compiled), or with do_search its mesh search. A learner
    config (one with an `rl` section) plans its RL step: on its mesh (`compile_rl_step`), or
    searched over `device_counts` against `budget_gib` (`search_rl_step`; a plan config
    reads them and `confirm` from itself unless they are given)."""
    if "rl" in config:
        if do_search:
            if budget_gib is None or not device_counts:
                raise ValueError("a learner config's mesh search needs a budget and device "
                                 "counts: launch/plan.py --search --budget_gib=80 "
                                 "--device_counts=8,16,32")
            return search_rl_step(config, budget_gib=budget_gib,
                                  device_counts=tuple(device_counts), confirm=confirm or 2)
        sizes = dict(config.mesh)
        if min(sizes.values()) < 1:
            raise ValueError(f"a plan names its devices: config.mesh is {sizes}; give every "
                             "axis a size (no -1), e.g. --config.mesh.fsdp=8")
        from ptrain import learner as learner_lib
        return {"model": model_lib.describe(learner_lib.model_config(config)),
                **compile_rl_step(config, sizes)}
    check_config(config)
    mc = model_config(config)
    common = dict(seq_len=config.seq_len, batch=config.batch, optim=config.optim,
                  chunk=config.logprob_chunk, layout=config.layout,
                  budget_gib=config.budget_gib if budget_gib is None else budget_gib)
    if do_search:
        return search(mc, **common, device_counts=tuple(
            device_counts or config.search.device_counts),
            confirm=confirm or config.search.confirm)
    return {"model": model_lib.describe(mc),
            **compile_plan(mc, dict(config.mesh), **common)}


def summary(result) -> str:
    """A few readable lines (GiB, or MiB below 0.01 GiB) for a `run` result."""
    gib = lambda x: f"{x / GIB:.2f} GiB" if x >= GIB / 100 else f"{x / 2**20:.2f} MiB"  # noqa
    def one(r):
        mesh = " x ".join(f"{a}={n}" for a, n in r["mesh"].items() if n > 1) or "1 device"
        fit = "" if "fits" not in r else (" fits" if r["fits"] else " does NOT fit")
        if "programs" in r:  # the RL step
            parts = ", ".join(f"{name} {gib(m['peak'])}" for name, m in r["programs"].items())
            return (f"{r['devices']:>5} devices ({mesh}): RL step peak {gib(r['step_peak'])}"
                    f"{fit} in {r['memory']['peak_program']} ({r['rows']} rows x "
                    f"{r['prompt_len']} + {r['length']} tokens; program peaks: {parts}); "
                    f"params {gib(r['params_bytes'])}, optimizer {gib(r['opt_state_bytes'])}, "
                    f"reference {gib(r['reference_bytes'])}, critic {gib(r['critic_bytes'])}, "
                    f"sampler KV cache {gib(r['kv_cache_bytes'])}, "
                    + (f"decode copy {gib(r['decode_copy_bytes'])}, "
                       if r["decode_copy_bytes"] else "") + "activations "
                    f"{gib(r['memory']['activations'])}; compiled in {r['compile_s']} s")
        m = r["memory"]
        return (f"{r['devices']:>5} devices ({mesh}): peak {gib(m['peak'])}{fit} = "
                f"arguments {gib(m['arguments'])} + outputs {gib(m['outputs'])} - aliased "
                f"{gib(m['aliased'])} + temporaries {gib(m['temporaries'])}; params "
                f"{gib(r['params_bytes'])}, optimizer {gib(r['opt_state_bytes'])}; estimate "
                f"{gib(r['estimate']['total'])}; model FLOPs {r['model_flops']:.3g} per step; "
                f"compiled in {r['compile_s']} s")

    if "answer" not in result:
        return one(result)
    lines = [f"budget {gib(result['budget_bytes'])} per device, {result['seq_len']} "
             f"tokens x batch {result['batch']}:"]
    lines += ["  " + one(r) for r in result["compiled"]]
    answer = result["answer"]
    lines.append(f"answer: {one(answer)}" if answer else
                 "answer: nothing fits; add device counts or lower the memory")
    return "\n".join(lines)


def write_json(result, path) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
