"""LoRA: low-rank adapters on the model's projections, the base frozen (Hu et al. 2021).

A targeted weight W (ours: [l, in..., out...], stacked over layers) gets two adapter
parameters, A [l, in..., r] and B [l, r, out...], and the projection becomes

    y = x W + (alpha / r) * ((x A) B)

as PEFT's `lora.Linear` computes it (`lora_B(lora_A(x)) * scaling`). A is drawn like PEFT's
default (Kaiming-uniform, bound 1 / sqrt(fan_in)), B is zero, so a fresh model computes
exactly its base. The adapters are `LoraParam`s (an `nnx.Param` subclass) named
`<weight>_lora_a` / `<weight>_lora_b` next to their weight, with `axes` taken from it (its
input dims' for A, its output dims' for B, the rank replicated), so they are created sharded
as the weight is.

  TARGETS                    HF module name -> our weight (q_proj -> wq, ..., down_proj)
  resolve_targets(patterns)  fnmatch patterns over HF module names -> our weight names
  configure(model_config, section)  the ModelConfig with config.lora's adapters
  adapted(x, w, name, c, key=)  the projection with its adapter (a plain projection without
                             one); with a key and c.lora_dropout, dropout on the adapter's input
  expert_weight(p, name, c)  a MoE layer's expert weight with its per-expert adapters merged
                             in (c.lora_experts; the forward's, as PEFT's target_parameters)
  split(state) / join(...)   (adapters, base) of a model state, and back
  attach(base_state, c)      the state of a base model with fresh adapters (base unchanged)
  disabled(state)            the state with every B zeroed: the base's function, in jit,
                             no second copy of the weights (the RL reference policy)
  merged(state, c)           base weights with W + (alpha / r) A B, no adapters (export;
                             `merge_adapters`: the rollout engine's decode copy)
  save_peft(state, c, path)  a PEFT adapter directory (adapter_config.json +
                             adapter_model.safetensors)
"""

from __future__ import annotations

import fnmatch
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ptrain import projection
from ptrain import quant
from ptrain.config import LORA_MODULES

# Hugging Face module name (`config.LORA_MODULES`) -> our weight.
TARGETS = dict(zip(LORA_MODULES, ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")))
N_IN = quant.N_IN  # our weights with two input dims (heads, head dim); the rest have one
_HF_PREFIX = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
              "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
              "w_down": "mlp.down_proj"}


class LoraParam(nnx.Param):
    """An adapter parameter: trained while the base's `nnx.Param`s stay frozen."""


def resolve_targets(patterns) -> tuple[str, ...]:
    """Our weight names for `patterns` (fnmatch over TARGETS' HF names, e.g. "q_proj",
    "*_proj"); a pattern that matches none is an error."""
    out = []
    for p in patterns:
        hit = [ours for hf, ours in TARGETS.items() if fnmatch.fnmatchcase(hf, p)]
        if not hit:
            raise ValueError(f"lora.targets: {p!r} matches no projection; the projections are "
                             f"{tuple(TARGETS)} (fnmatch patterns allowed, e.g. '*_proj')")
        out += [h for h in hit if h not in out]
    return tuple(ours for ours in TARGETS.values() if ours in out)


def configure(model_config, section):
    """`model_config` with the adapters of a config's `lora` section (rank 0: unchanged)."""
    if not section.rank:
        return model_config
    changes = dict(lora_rank=int(section.rank), lora_alpha=float(section.alpha),
                   lora_targets=resolve_targets(section.targets),
                   lora_dropout=float(section.dropout), lora_experts=bool(section.experts))
    if section.base_dtype == "int8":  # (embeddings, head and norms: model.param_dtype)
        changes["int8_base"] = True
    elif section.base_dtype:
        changes["param_dtype"] = section.base_dtype
    return model_config.replace(**changes)


def float_dtype(section) -> str | None:
    """The dtype to load a brought base in for config.lora (None: as it is; an int8 base is
    loaded as it is, then quantised)."""
    return None if section.base_dtype in ("", "int8") else section.base_dtype


def scale(c) -> float:
    return c.lora_alpha / c.lora_rank


# ============================================================================== parameters


def add_adapters(module, c, rngs: nnx.Rngs, weights: dict, *, lead: int = 1) -> None:
    """Sets `<name>_lora_a` / `_lora_b` on `module` for each of `weights` (name -> its Param)
    that c.lora_targets names; float32 (the base may be in bfloat16). `lead`: the weights'
    leading dims that each have their own adapter (layers; 2 for the experts' [l, E, ...]:
    one adapter per layer and expert)."""
    for name, w in weights.items():
        if name not in c.lora_targets:
            continue
        n_in = N_IN.get(name, 1)
        axes = tuple(w.get_metadata()["axes"])
        ls, ins, outs = w.shape[:lead], w.shape[lead:lead + n_in], w.shape[lead + n_in:]
        r = c.lora_rank
        bound = 1.0 / math.sqrt(math.prod(ins))  # kaiming_uniform_(a=sqrt(5)), PEFT's default
        a = jax.random.uniform(rngs.params(), ls + ins + (r,), jnp.float32, -bound, bound)
        setattr(module, f"{name}_lora_a", LoraParam(a, axes=axes[:lead + n_in] + (None,)))
        setattr(module, f"{name}_lora_b", LoraParam(
            jnp.zeros(ls + (r,) + outs, jnp.float32),
            axes=axes[:lead] + (None,) + axes[lead + n_in:]))


def expert_weight(p: dict, name: str, c):
    """The experts' weight `name` [E, in, out] of one layer with its per-expert adapters
    merged in (W + (alpha / r) A B, PEFT's `target_parameters` on a 3-D expert weight does
    the same), or as it is without them; in the dtype of p's arrays."""
    w = p[name]
    a = p.get(f"{name}_lora_a")
    if a is None:
        return w
    return w + jnp.asarray(scale(c), w.dtype) * jnp.matmul(a, p[f"{name}_lora_b"])


def adapted(x, w: dict, name: str, c, *, mesh=None, key=None):
    """x times w[name] over its input dims, plus its adapter's (alpha / r) (x A) B when the
    layer's parameters `w` hold one. `key` (training forwards only) with c.lora_dropout > 0:
    the adapter sees dropout(x) (PEFT's `lora_B(lora_A(lora_dropout(x)))`), its mask drawn
    from the key and the projection's name; the base projection sees x."""
    n_in = N_IN.get(name, 1)
    y = projection.dense(x, w[name], n_in, mesh=mesh)
    a = w.get(f"{name}_lora_a")
    if a is None:
        return y
    if key is not None and c.lora_dropout > 0:
        x = dropout(x, jax.random.fold_in(key, _KEY_INDEX[name]), c.lora_dropout)
    xa = projection.dense(x, a, n_in, mesh=mesh)
    return y + projection.dense(xa, w[f"{name}_lora_b"], 1, mesh=mesh) * jnp.asarray(
        scale(c), y.dtype)


_KEY_INDEX = {name: i for i, name in enumerate(TARGETS.values())}


def dropout_keep(key, shape, rate: float):
    """The dropout mask: True (kept) with probability 1 - rate, each element independently."""
    return jax.random.bernoulli(key, 1.0 - rate, shape)


def dropout(x, key, rate: float):
    """Inverted dropout as torch's `nn.Dropout` in training: x * mask / (1 - rate)."""
    keep = dropout_keep(key, x.shape, rate)
    return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - rate), x.dtype), jnp.zeros((), x.dtype))


# ================================================================================== states


def is_adapter(x) -> bool:
    return isinstance(x, LoraParam)


def split(state):
    """(adapters, base) of a model state (nnx.State); adapters empty without LoRA."""
    return nnx.split_state(state, LoraParam, ...)


def join(adapters, base):
    return nnx.merge_state(adapters, base)


def has_adapters(state) -> bool:
    return any(is_adapter(v) for v in jax.tree.leaves(state, is_leaf=is_adapter))


def disabled(state):
    """The state with every adapter's B zero: the base model's function (adding zeros), for
    the RL reference log-probs without a second copy of the base. Traceable."""
    def one(path, v):
        if is_adapter(v) and str(path[-1]).endswith("_lora_b"):
            return v.replace(jnp.zeros_like(v.get_value()))
        return v
    return nnx.State.from_flat_path(
        {p: one(p, v) for p, v in nnx.to_flat_state(state)})


def attach(base_state, c, *, seed: int = 0, mesh=None):
    """(graphdef, state) of model config `c` (with lora_rank > 0): `base_state`'s arrays,
    unchanged, and fresh adapters created on their shardings."""
    from ptrain import model as model_lib
    from ptrain import sharding

    def make():
        return model_lib.Transformer(c, rngs=nnx.Rngs(seed), mesh=mesh)

    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    abstract_adapters = split(abstract)[0]
    shardings = (None if mesh is None
                 else sharding.state_shardings(abstract_adapters, mesh))
    # The whole model is built under jit and only its adapters returned: XLA drops the rest.
    adapters = jax.jit(lambda: split(nnx.split(make())[1])[0], out_shardings=shardings)()
    base = split(base_state)[1]  # (adapters already there are replaced)
    if c.int8_base and not quant.is_quantized(base):  # a float base: rounded to int8
        base = quant.quantize_state(base)
    return graphdef, join(adapters, base)


def merged(state, c):
    """(merged state, its config): each adapted weight W + (alpha / r) A B, in W's dtype,
    and no adapters; the config without LoRA. The state may be a Module's or a checkpoint's."""
    return merge_adapters(state, scale(c)), base_config(c)


def merge_adapters(state, lora_scale: float):
    """`state` with each adapted weight W + lora_scale A B (in W's dtype) and no adapters; an
    int8 base (`quant`) is dequantised first (float32 W, no scales)."""
    if quant.is_quantized(state):
        state = quant.dequantize_state(state)
    flat = dict(nnx.to_flat_state(state))
    out = {}
    for path, v in flat.items():
        name = str(path[-1])
        if is_adapter(v):
            continue
        a = flat.get(path[:-1] + (f"{name}_lora_a",))
        if a is not None:
            b = flat[path[:-1] + (f"{name}_lora_b",)]
            w, r = v.get_value(), a.shape[-1]
            lead = a.shape[:2 if str(path[0]) == "experts" else 1]  # (layers[, experts])
            delta = jnp.matmul(a.get_value().reshape(lead + (-1, r)),
                               b.get_value().reshape(lead + (r, -1)))
            w = (w.astype(jnp.float32) + lora_scale * delta.reshape(w.shape)).astype(w.dtype)
            v = v.replace(w)
        out[path] = v
    return nnx.State.from_flat_path(out)


def base_config(c):
    return c.replace(lora_rank=0, lora_alpha=0.0, lora_targets=(), lora_dropout=0.0,
                     lora_experts=False, int8_base=False)


# ==================================================================================== PEFT


def _peft_names(c):
    """(our path, HF module path with {i}, its layer ids) of every adapted dense weight."""
    from ptrain import moe
    dense = tuple(i for i in range(c.n_layers) if not moe.is_moe_layer(c, i))
    out = []
    for name in c.lora_targets:
        ids = dense if name in ("w_gate", "w_up", "w_down") else tuple(range(c.n_layers))
        out.append((("layers", name), f"base_model.model.model.layers.{{i}}.{_HF_PREFIX[name]}",
                    ids))
    return out


def save_peft(state, c, path: str, *, base_model: str = "") -> None:
    """A PEFT LoRA adapter directory: adapter_config.json and adapter_model.safetensors
    (lora_A.weight [r, in], lora_B.weight [out, r] per layer and module), which
    `peft.PeftModel.from_pretrained(base, path)` loads onto the transformers base model."""
    from ptrain import safetensors_io
    from ptrain.hf import _host
    if not c.lora_rank:
        raise ValueError("save_peft: the model has no adapters (lora_rank is 0)")
    if c.lora_experts:
        raise ValueError("save_peft: adapters on MoE experts (lora.experts) have no PEFT export "
                         "yet; export the merged model (lora.merged, launch.export without "
                         "--peft_out)")
    flat = {tuple(str(k) for k in p): v for p, v in nnx.to_flat_state(state)}
    tensors = []
    for (scope, name), hf_name, ids in _peft_names(c):
        a = _host(flat[(scope, f"{name}_lora_a")].get_value())
        b = _host(flat[(scope, f"{name}_lora_b")].get_value())
        for row, i in enumerate(ids):
            prefix = hf_name.format(i=i)
            a_ir = a[row].reshape(-1, c.lora_rank)
            b_ro = b[row].reshape(c.lora_rank, -1)
            tensors.append((f"{prefix}.lora_A.weight", np.ascontiguousarray(a_ir.T, np.float32)))
            tensors.append((f"{prefix}.lora_B.weight", np.ascontiguousarray(b_ro.T, np.float32)))
    if jax.process_index() != 0:
        return
    os.makedirs(path, exist_ok=True)
    safetensors_io.write(os.path.join(path, "adapter_model.safetensors"), tensors,
                         metadata={"format": "pt"})
    hf_targets = sorted(hf for hf, ours in TARGETS.items() if ours in c.lora_targets)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": c.lora_rank,
              "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout, "bias": "none",
              "target_modules": hf_targets, "base_model_name_or_path": base_model,
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "modules_to_save": None}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def checkpointed(params):
    """What a checkpoint holds of the parameters: with adapters the adapters only (the base
    is the config's model, rebuilt on restore), else all of them."""
    return split(params)[0] if has_adapters(params) else params


def restored(saved, params):
    """The parameters from a checkpoint's `checkpointed` part and the run's `params` (its
    base)."""
    return join(saved, split(params)[1]) if has_adapters(params) else saved
