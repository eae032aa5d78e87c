"""Hugging Face checkpoints <-> ptrain: Llama 3.x, Qwen2 / 2.5, Qwen3 and Qwen3-MoE.

`load` reads `config.json` and the `*.safetensors` files of a local directory (one file, or
sharded with `model.safetensors.index.json`) and builds each parameter directly on its
shards: every device reads only its slice of each tensor from a memory map, so the whole
model never sits on one host. Qwen3-MoE's per-expert tensors
(`model.layers.{i}.mlp.experts.{j}.gate_proj.weight`, ...) stack into our [MoE layers, experts,
...] arrays, dense layers' MLPs (`mlp_only_layers`) into the dense stack. `save` writes a directory that `transformers` loads: weights,
config.json, generation_config.json and, given one, the tokenizer with its chat template.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ptrain import moe
from ptrain import safetensors_io
from ptrain import sharding
from ptrain.model import RUNTIME_FIELDS, ModelConfig, Transformer

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
_CLASSES = {family: arch for arch, family in ARCHITECTURES.items()}
_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}


# ----------------------------------------------------------------------------- configs

def read_config(path: str) -> dict:
    """config.json of a local model directory, with a clear error when there is none."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is not a directory; pass a local Hugging Face model "
                                "directory (config.json + *.safetensors)")
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"no config.json in {path!r}: a Hugging Face model directory "
                                "needs config.json next to its *.safetensors files")
    with open(file) as f:
        return json.load(f)


def config_from_hf(hf: dict, *, dtype: str | None = None,
                   param_dtype: str | None = None) -> ModelConfig:
    """ModelConfig from a config.json dict; unsupported features raise, naming the field."""
    archs = hf.get("architectures") or []
    family = ARCHITECTURES.get(archs[0]) if archs else None
    family = family or (hf.get("model_type") if hf.get("model_type") in _CLASSES else None)
    if family is None:
        raise ValueError(f"unsupported architecture {archs or hf.get('model_type')!r}; "
                         f"supported: {', '.join(ARCHITECTURES)}")

    def unsupported(field, value):
        raise ValueError(f"config.json: {field}={value!r} is not supported by ptrain's "
                         f"{family} decoder")

    if hf.get("hidden_act", "silu") != "silu":
        unsupported("hidden_act", hf["hidden_act"])
    if hf.get("mlp_bias"):
        unsupported("mlp_bias", True)
    if hf.get("use_sliding_window"):
        unsupported("use_sliding_window", True)

    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        unsupported("rope_type", rope_type)
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        unsupported("partial_rotary_factor", rope.get("partial_rotary_factor"))
    max_pos = int(hf.get("max_position_embeddings", 8192))
    original = int(rope.get("original_max_position_embeddings",
                            hf.get("original_max_position_embeddings", max_pos)))
    factor = rope.get("factor")
    if factor is None:
        factor = max_pos / original if rope_type == "yarn" else 1.0

    bias = bool(hf.get("attention_bias", False))
    experts = {}
    if family == "qwen3_moe":
        experts = dict(
            n_experts=int(hf.get("num_experts", hf.get("num_local_experts", 0))),
            n_experts_per_token=int(hf["num_experts_per_tok"]),
            d_ff_expert=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_layer_step=int(hf.get("decoder_sparse_step", 1)),
            dense_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()))
    eos = hf.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    ckpt_dtype = _DTYPE_NAMES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
                                  "float32")
    return ModelConfig(
        family=family,
        vocab_size=int(hf["vocab_size"]),
        d_model=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=int(hf["num_attention_heads"]),
        n_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        d_ff=int(hf["intermediate_size"]),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if family == "qwen2" else bias,
        o_bias=False if family == "qwen2" else bias,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        rope_factor=float(factor),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_position=original,
        rope_beta_fast=float(rope.get("beta_fast") or 32.0),
        rope_beta_slow=float(rope.get("beta_slow") or 1.0),
        rope_attention_factor=float(rope.get("attention_factor") or 0.0),
        rope_mscale=float(rope.get("mscale") or 0.0),
        rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        rope_truncate=bool(rope.get("truncate", True)),
        max_position_embeddings=max_pos,
        param_dtype=param_dtype or dtype or ckpt_dtype,
        dtype=dtype or param_dtype or ckpt_dtype,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos,
        **experts,
    )


def config_to_hf(c: ModelConfig) -> dict:
    """A config.json dict that `transformers` reads back into the same architecture."""
    if c.family not in _CLASSES:
        raise ValueError(f"family {c.family!r} has no Hugging Face class; use one of "
                         f"{sorted(_CLASSES)}")
    expected = {"qwen2": (True, False, False)}.get(c.family)
    if c.family == "qwen2" and (c.qkv_bias, c.o_bias, c.qk_norm) != expected:
        raise ValueError("a qwen2 checkpoint has q/k/v biases, no o bias and no q/k norm")
    if c.family != "qwen2" and c.qkv_bias != c.o_bias:
        raise ValueError(f"{c.family}: attention_bias covers q, k, v and o together")
    if c.qk_norm != (c.family in ("qwen3", "qwen3_moe")):
        raise ValueError("q/k norm exists only in qwen3 and qwen3_moe checkpoints")
    if (c.n_experts > 0) != (c.family == "qwen3_moe"):
        raise ValueError(f"family {c.family!r} with n_experts={c.n_experts}: experts exist only "
                         "in qwen3_moe checkpoints (and every qwen3_moe config has them)")
    if c.n_shared_experts:
        raise ValueError("qwen3_moe checkpoints have no shared experts (n_shared_experts=0)")
    rope = {"rope_type": c.rope_type, "rope_theta": c.rope_theta}
    if c.rope_type in ("linear", "llama3", "yarn"):
        rope["factor"] = c.rope_factor
    if c.rope_type == "llama3":
        rope.update(low_freq_factor=c.rope_low_freq_factor,
                    high_freq_factor=c.rope_high_freq_factor,
                    original_max_position_embeddings=c.rope_original_max_position)
    if c.rope_type == "yarn":
        rope.update(original_max_position_embeddings=c.rope_original_max_position,
                    beta_fast=c.rope_beta_fast, beta_slow=c.rope_beta_slow,
                    truncate=c.rope_truncate)
        for key, value in (("attention_factor", c.rope_attention_factor),
                           ("mscale", c.rope_mscale), ("mscale_all_dim", c.rope_mscale_all_dim)):
            if value:
                rope[key] = value
    hf = {
        "architectures": [_CLASSES[c.family]],
        "model_type": c.family,
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_eps,
        "tie_word_embeddings": c.tie_embeddings,
        "rope_parameters": rope,
        "dtype": c.param_dtype,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": (list(c.eos_token_ids) if len(c.eos_token_ids) > 1
                         else (c.eos_token_ids[0] if c.eos_token_ids else None)),
    }
    if c.family != "qwen2":
        hf["attention_bias"] = c.qkv_bias
    if c.n_experts:
        hf.update(num_experts=c.n_experts, num_experts_per_tok=c.n_experts_per_token,
                  moe_intermediate_size=c.d_ff_expert, norm_topk_prob=c.norm_topk_prob,
                  decoder_sparse_step=c.moe_layer_step, mlp_only_layers=list(c.dense_layers),
                  router_aux_loss_coef=c.router_aux_loss_coef)
    return hf


# ----------------------------------------------------------------------------- tensors

@dataclasses.dataclass(frozen=True)
class _Tensor:
    """How one ptrain parameter is stored in a checkpoint.

    `name` has `{i}` for per-layer tensors (stacked on our leading layer axis: the layers
    `layers`, or all of them) and `{j}` for per-expert ones (`experts` of them, stacked on our
    second axis). Linear weights are stored [out, in]; ours is the transpose, reshaped:
    `split` says how many of our (per-layer) dims come from HF's `in` dim. None means the same
    layout, reshaped.
    """

    path: tuple[str, ...]
    name: str
    hf_shape: tuple[int, ...]
    split: int | None = None
    layers: tuple[int, ...] | None = None
    experts: int = 0

    def layer_ids(self, c: ModelConfig) -> tuple[int, ...]:
        return tuple(range(c.n_layers)) if self.layers is None else self.layers

    def names(self, c: ModelConfig) -> list[str]:
        """Every checkpoint name of this tensor, layer-major then expert."""
        if "{i}" not in self.name:
            return [self.name]
        return [self.name.format(i=i, j=j) for i in self.layer_ids(c)
                for j in range(max(self.experts, 1))]


def _tensors(c: ModelConfig) -> list[_Tensor]:
    d, h, k, e, f, v = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size
    layer = "model.layers.{i}."
    out = [_Tensor(("embed",), "model.embed_tokens.weight", (v, d)),
           _Tensor(("final_norm",), "model.norm.weight", (d,))]
    if not c.tie_embeddings:
        out.append(_Tensor(("lm_head",), "lm_head.weight", (v, d)))
    per_layer = [
        ("attn_norm", "input_layernorm.weight", (d,), None),
        ("wq", "self_attn.q_proj.weight", (h * e, d), 1),
        ("wk", "self_attn.k_proj.weight", (k * e, d), 1),
        ("wv", "self_attn.v_proj.weight", (k * e, d), 1),
        ("wo", "self_attn.o_proj.weight", (d, h * e), 2),
        ("mlp_norm", "post_attention_layernorm.weight", (d,), None),
    ]
    if c.qkv_bias:
        per_layer += [("bq", "self_attn.q_proj.bias", (h * e,), None),
                      ("bk", "self_attn.k_proj.bias", (k * e,), None),
                      ("bv", "self_attn.v_proj.bias", (k * e,), None)]
    if c.o_bias:
        per_layer.append(("bo", "self_attn.o_proj.bias", (d,), None))
    if c.qk_norm:
        per_layer += [("q_norm", "self_attn.q_norm.weight", (e,), None),
                      ("k_norm", "self_attn.k_norm.weight", (e,), None)]
    out += [_Tensor(("layers", ours), layer + theirs, shape, split)
            for ours, theirs, shape, split in per_layer]
    kinds = [moe.is_moe_layer(c, i) for i in range(c.n_layers)]
    dense = tuple(i for i, sparse in enumerate(kinds) if not sparse)
    sparse = tuple(i for i, is_sparse in enumerate(kinds) if is_sparse)
    if dense:
        out += [_Tensor(("layers", ours), layer + theirs, shape, 1, dense)
                for ours, theirs, shape in (("w_gate", "mlp.gate_proj.weight", (f, d)),
                                            ("w_up", "mlp.up_proj.weight", (f, d)),
                                            ("w_down", "mlp.down_proj.weight", (d, f)))]
    if sparse:
        n, fe = c.n_experts, c.d_ff_expert
        out.append(_Tensor(("experts", "router"), layer + "mlp.gate.weight", (n, d), 1, sparse))
        expert = layer + "mlp.experts.{j}."
        out += [_Tensor(("experts", ours), expert + theirs, shape, 1, sparse, n)
                for ours, theirs, shape in (("w_gate", "gate_proj.weight", (fe, d)),
                                            ("w_up", "up_proj.weight", (fe, d)),
                                            ("w_down", "down_proj.weight", (d, fe)))]
    return out


def _group_range(slices: tuple[slice, ...], dims: tuple[int, ...]):
    """The flat index range covering a block of a row-major group of dims, and what to apply
    after reshaping it back (only the leading dim's slice is folded into the range)."""
    first = slices[0]
    rest = math.prod(dims[1:])
    start, stop, _ = first.indices(dims[0])
    return slice(start * rest, stop * rest), (slice(None),) + tuple(slices[1:])


def _read_block(array: np.ndarray, t: _Tensor, ours: tuple[int, ...], index) -> np.ndarray:
    """Our block `index` (slices over our per-layer dims) read from the HF array."""
    if t.split is None:
        if len(ours) == len(t.hf_shape):
            return np.asarray(array[index])
        flat, post = _group_range(index, ours)  # a bias [h * e] that we hold as [h, e]
        return np.asarray(array[flat]).reshape((-1,) + ours[1:])[post]
    in_dims, out_dims = ours[:t.split], ours[t.split:]
    in_range, in_post = _group_range(index[:t.split], in_dims)
    out_range, out_post = _group_range(index[t.split:], out_dims)
    block = np.asarray(array[out_range, in_range]).T
    n_in = (in_range.stop - in_range.start) // math.prod(in_dims[1:])
    block = block.reshape((n_in,) + in_dims[1:] + (-1,) + out_dims[1:])
    return block[in_post + out_post]


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _path(key_path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in key_path)


def _normalise(index, ndim: int) -> tuple[slice, ...]:
    index = tuple(index) + (slice(None),) * (ndim - len(index))
    return tuple(i if isinstance(i, slice) else slice(i, i + 1) for i in index)


class _Checkpoint:
    """Name -> memory-mapped array over all the safetensors files of a directory.

    `rename(stored name) -> name` maps a layout's stored names to the names asked for (an
    older transformers' names for the same tensors)."""

    def __init__(self, path: str, rename=None):
        index_file = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index_file):
            with open(index_file) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors in {path!r}; ptrain reads safetensors only (re-save a "
                "PyTorch .bin checkpoint with transformers' save_pretrained)")
        self.where, self.stored = {}, {}
        for name in files:
            file = safetensors_io.File(os.path.join(path, name))
            for key in file.keys():
                ours = rename(key) if rename else key
                self.where[ours] = file
                self.stored[ours] = key

    def array(self, name: str) -> np.ndarray:
        return self.where[name].array(self.stored[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.where[name].shape(self.stored[name])


# ----------------------------------------------------------------------------- load / save

def load(path: str, *, mesh=None, dtype: str | None = None, param_dtype: str | None = None,
         overrides: dict | None = None) -> tuple[Transformer, ModelConfig]:
    """Model and config from a local Hugging Face directory, each tensor placed on its shards.

    `dtype` sets the compute dtype (and the parameter dtype unless `param_dtype` is given);
    both default to the checkpoint's dtype. `overrides`: run-time ModelConfig fields
    (`model.RUNTIME_FIELDS`), e.g. {"attention_impl": "ring", "remat": "full"}.
    """
    overrides = dict(overrides or {})
    fixed = sorted(set(overrides) - set(RUNTIME_FIELDS))
    if fixed:
        raise ValueError(f"hf.load overrides {fixed}: the checkpoint's config.json sets these; "
                         f"only {RUNTIME_FIELDS} may be overridden")
    config = config_from_hf(read_config(path), dtype=dtype, param_dtype=param_dtype)
    config = dataclasses.replace(config, **overrides)
    ckpt = _Checkpoint(path)
    tensors = _tensors(config)
    _check_tensors(ckpt, tensors, config)
    make = lambda: Transformer(config, rngs=nnx.Rngs(0), mesh=mesh)  # noqa: E731
    return build_module(ckpt, tensors, config, make, mesh, config.param_dtype), config


def build_module(ckpt: _Checkpoint, tensors: list[_Tensor], config, make, mesh,
                 param_dtype: str):
    """The module `make()` builds, each parameter read from the checkpoint tensor whose
    `path` names it, on its shards."""
    graphdef, abstract_state = sharding.abstract(make, mesh)
    by_path = {t.path: t for t in tensors}
    param_dtype = np.dtype(jnp.dtype(param_dtype))

    def build(key_path, var):
        leaf = var.get_value()
        t = by_path[_path(key_path)]
        lead = 0 if "{i}" not in t.name else 2 if t.experts else 1  # stacked axes
        ours = leaf.shape[lead:]

        def read(index):
            index = _normalise(index, len(leaf.shape))
            if not lead:
                return _read_block(ckpt.array(t.name), t, ours, index).astype(param_dtype)
            layers = t.layer_ids(config)[index[0]]
            experts = range(*index[1].indices(t.experts)) if t.experts else [0]

            def one(i, j):
                return _read_block(ckpt.array(t.name.format(i=i, j=j)), t, ours, index[lead:])

            blocks = [np.stack([one(i, j) for j in experts]) if t.experts else one(i, 0)
                      for i in layers]
            return np.stack(blocks).astype(param_dtype)

        if mesh is None:
            return var.replace(jnp.asarray(read(())))
        return var.replace(jax.make_array_from_callback(leaf.shape, leaf.sharding, read))

    state = jax.tree_util.tree_map_with_path(build, abstract_state, is_leaf=_is_var)
    return nnx.merge(graphdef, state)


def _check_tensors(ckpt: _Checkpoint, tensors: list[_Tensor], c: ModelConfig) -> None:
    missing, wrong, used = [], [], set()
    for t in tensors:
        for name in t.names(c):
            used.add(name)
            if name not in ckpt.where:
                missing.append(name)
            elif ckpt.shape(name) != t.hf_shape:
                wrong.append(f"{name}: expected {t.hf_shape}, found {ckpt.shape(name)}")
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): "
                         f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
    if wrong:
        raise ValueError("checkpoint tensor(s) with the wrong shape: " + "; ".join(wrong[:10]))
    unused = sorted(set(ckpt.where) - used)
    if unused:
        logging.warning("hf.load: ignoring %d tensor(s) the model does not use: %s",
                        len(unused), ", ".join(unused[:10]))


def save(model, config: ModelConfig, path: str, *, tokenizer=None,
         generation_config: dict | None = None, max_shard_bytes: int = 4 << 30) -> None:
    """Write a directory that `transformers` loads: safetensors (sharded with an index past
    `max_shard_bytes`), config.json, generation_config.json (`generation_config`, by default
    `generation_config_for(config)`) and, given a Hugging Face `tokenizer`, its files and chat
    template.

    `model`: a Transformer, or its parameters as an nnx.State (`nnx.split`, a checkpoint).
    Tensors are gathered one parameter at a time and written one shard at a time; on
    several hosts every process gathers and process 0 writes.
    """
    write(model, _tensors(config), config, config_to_hf(config), path, tokenizer=tokenizer,
          generation_config=(generation_config if generation_config is not None
                             else generation_config_for(config)),
          max_shard_bytes=max_shard_bytes)


def write(model, tensors: list[_Tensor], config, hf_config: dict, path: str, *,
          tokenizer=None, generation_config: dict | None = None,
          max_shard_bytes: int = 4 << 30) -> None:
    """`save` for any layout: the `tensors` of `model`, then config.json (`hf_config`),
    generation_config.json and the tokenizer's files."""
    if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(f"hf.save writes Hugging Face tokenizers; {type(tokenizer).__name__} "
                        "has no save_pretrained (save without tokenizer=)")
    os.makedirs(path, exist_ok=True)
    arrays = _param_arrays(model)
    writer = jax.process_index() == 0
    written: list[tuple[str, list[str]]] = []  # (temporary file, tensor names)
    pending: list[tuple[str, np.ndarray]] = []

    def flush():
        if pending and writer:
            tmp = os.path.join(path, f".shard-{len(written):05d}.safetensors.tmp")
            safetensors_io.write(tmp, pending)
            written.append((tmp, [name for name, _ in pending]))
        pending.clear()

    for t in tensors:
        for name, a in _to_hf(t, _host(arrays[t.path]), config):
            if pending and sum(x.nbytes for _, x in pending) + a.nbytes > max_shard_bytes:
                flush()
            pending.append((name, a))
    flush()
    if writer:
        _finalise(path, written, hf_config)
        _write_json(os.path.join(path, "generation_config.json"), generation_config or {})
        if tokenizer is not None:
            tokenizer.save_pretrained(path)


def _param_arrays(model) -> dict[tuple[str, ...], jax.Array]:
    """Our parameter path -> array, from a Transformer or a state of its parameters."""
    state = nnx.state(model, nnx.Param) if isinstance(model, nnx.Module) else model
    out = {}
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(state, is_leaf=_is_var):
        path = _path(key_path)
        path = path[:-1] if path and path[-1] == "value" else path  # a state of raw arrays
        out[path] = leaf.get_value() if _is_var(leaf) else leaf
    return out


def _to_hf(t: _Tensor, full: np.ndarray, c: ModelConfig):
    """(HF name, HF-layout array) for each layer of one of our parameters."""
    if "{i}" not in t.name:
        layers = [(t.name, full)]
    elif t.experts:
        layers = [(t.name.format(i=i, j=j), full[a, j])
                  for a, i in enumerate(t.layer_ids(c)) for j in range(t.experts)]
    else:
        layers = [(t.name.format(i=i), full[a]) for a, i in enumerate(t.layer_ids(c))]
    for name, ours in layers:
        if t.split is not None:
            ours = ours.reshape(math.prod(ours.shape[:t.split]), -1).T
        yield name, np.ascontiguousarray(ours.reshape(t.hf_shape))


def _finalise(path: str, written: list[tuple[str, list[str]]], hf_config: dict) -> None:
    """Rename the shards to HF's names (replacing an older save), then write the index."""
    index_file = os.path.join(path, "model.safetensors.index.json")
    for stale in os.listdir(path):
        if (stale.startswith("model") and stale.endswith(".safetensors")) or \
                stale == os.path.basename(index_file):
            os.remove(os.path.join(path, stale))
    if len(written) == 1:
        os.replace(written[0][0], os.path.join(path, "model.safetensors"))
    else:
        weight_map = {}
        for i, (tmp, names) in enumerate(written):
            final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
            os.replace(tmp, os.path.join(path, final))
            weight_map.update({name: final for name in names})
        total = sum(os.path.getsize(os.path.join(path, f)) for f in set(weight_map.values()))
        with open(index_file, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    _write_json(os.path.join(path, "config.json"), hf_config)


def _write_json(file: str, obj) -> None:
    tmp = file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, file)


def _host(x: jax.Array) -> np.ndarray:
    """The whole array on this host (gathered across hosts when it spans several)."""
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


# ----------------------------------------------------------------------------- tokenizer

def load_tokenizer(path: str):
    """The Hugging Face tokenizer of a local model directory, with its chat template."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("load_tokenizer needs transformers: pip install 'ptrain[hf]'") from e
    if not any(os.path.exists(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise FileNotFoundError(f"no tokenizer in {path!r}: expected tokenizer.json or "
                                "tokenizer_config.json (save it with tokenizer.save_pretrained)")
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


# ----------------------------------------------------------------------------- generation

def read_generation_config(path: str) -> dict:
    """generation_config.json of a model directory, or {} when it has none."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.exists(file):
        return {}
    with open(file) as f:
        return json.load(f)


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def eos_token_ids(path: str) -> dict[str, tuple[int, ...]]:
    """The eos ids a model directory names, by where they are written (for `chat.stop_ids`)."""
    return {"config.json eos_token_id": _ids(read_config(path).get("eos_token_id")),
            "generation_config.json eos_token_id":
                _ids(read_generation_config(path).get("eos_token_id"))}


def generation_config_for(config: ModelConfig, *, base: dict | None = None,
                          stop_ids=()) -> dict:
    """generation_config.json for an exported model: `base` (the brought model's, whose
    sampling defaults it keeps) with eos_token_id the union of its eos ids, config.json's and
    `stop_ids` (so that `generate` stops where ptrain's sampler stopped: a chat turn of a
    base model ends at <|im_end|>, which no eos field of its own names)."""
    out = dict(base or {})
    out.pop("transformers_version", None)
    eos = []
    for i in (*_ids(out.get("eos_token_id")), *config.eos_token_ids, *stop_ids):
        if int(i) not in eos:
            eos.append(int(i))
    if config.bos_token_id is not None:
        out.setdefault("bos_token_id", config.bos_token_id)
    if eos:
        out["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    return out


def export(params, config: ModelConfig, path: str, *, tokenizer=None,
           base_dir: str | None = None, stop_ids=()) -> None:
    """A trained model as a Hugging Face directory: `params` (a Transformer or its nnx.State)
    and `config`, the tokenizer with its chat template, and a generation_config.json that
    keeps the brought model's (`base_dir`) and stops where the run's sampler stopped."""
    base = read_generation_config(base_dir) if base_dir else None
    save(params, config, path, tokenizer=tokenizer,
         generation_config=generation_config_for(config, base=base, stop_ids=stop_ids))
