"""Qwen2.5-VL checkpoints (`Qwen2_5_VLForConditionalGeneration`) <-> ptrain's VLModel.

The decoder's tensors are ptrain.hf's Qwen2 ones under `model.language_model.`, the tower's
under `model.visual.` (transformers >= 4.52 names; the older `model.layers.*` / `visual.*`
names of the released checkpoints load too). config.json's text fields come from
`text_config` or, in the older flat layout, from its top level; `rope_scaling` /
`rope_parameters` carry the M-RoPE sections. The image processing settings come from
preprocessor_config.json. Loading, sharding and writing reuse ptrain.hf's machinery.
"""

from __future__ import annotations

import dataclasses
import json
import os

from flax import nnx

from ptrain import hf
from ptrain.model import RUNTIME_FIELDS
from ptrain.vision.config import VisionConfig
from ptrain.vision.image_processing import ImageProcessing
from ptrain.vision.vl import VLConfig, VLModel

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
_TEXT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "hidden_act", "rms_norm_eps",
              "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
              "bos_token_id", "eos_token_id", "use_sliding_window", "dtype", "torch_dtype",
              "tie_word_embeddings")


def is_vl(hf_config: dict) -> bool:
    return ARCHITECTURE in (hf_config.get("architectures") or []) or \
        hf_config.get("model_type") == "qwen2_5_vl"


def config_from_hf(d: dict, *, dtype: str | None = None,
                   param_dtype: str | None = None) -> VLConfig:
    """VLConfig from a Qwen2.5-VL config.json dict."""
    if not is_vl(d):
        raise ValueError(f"not a Qwen2.5-VL config (architectures "
                         f"{d.get('architectures')}); expected {ARCHITECTURE}")
    text = {k: d[k] for k in _TEXT_KEYS if k in d}
    text.update(d.get("text_config") or {})
    text["tie_word_embeddings"] = bool(d.get("tie_word_embeddings")
                                       or text.get("tie_word_embeddings"))
    rope = dict(text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {})
    text.pop("rope_scaling", None)
    sections = rope.pop("mrope_section", None)
    if not sections:
        raise ValueError("config.json: Qwen2.5-VL needs rope_scaling.mrope_section")
    if rope.get("rope_type", rope.get("type")) in ("mrope", None):
        rope["rope_type"] = "default"
    rope.pop("type", None)
    rope.setdefault("rope_theta", text.pop("rope_theta", 1e6))
    text.update(architectures=["Qwen2ForCausalLM"], rope_parameters=rope)
    c = hf.config_from_hf(text, dtype=dtype, param_dtype=param_dtype)
    c = c.replace(family="qwen2_5_vl", mrope_section=tuple(sections))
    v = d.get("vision_config") or {}
    vrope = v.get("rope_parameters") or {}
    vision = VisionConfig(
        depth=int(v["depth"]), d_model=int(v["hidden_size"]), n_heads=int(v["num_heads"]),
        d_ff=int(v["intermediate_size"]), out_d=int(v.get("out_hidden_size", c.d_model)),
        patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        window_size=int(v.get("window_size", 112)),
        fullatt_blocks=tuple(v.get("fullatt_block_indexes", ())),
        hidden_act=v.get("hidden_act", "silu"),
        rope_theta=float(vrope.get("rope_theta", 10000.0)),
        tokens_per_second=int(v.get("tokens_per_second", 4)),
        param_dtype=c.param_dtype, dtype=c.dtype)
    return VLConfig(text=c, vision=vision, image_token_id=int(d.get("image_token_id", 151655)),
                    video_token_id=int(d.get("video_token_id", 151656)),
                    vision_start_token_id=int(d.get("vision_start_token_id", 151652)),
                    vision_end_token_id=int(d.get("vision_end_token_id", 151653)))


def config_to_hf(c: VLConfig) -> dict:
    """config.json (transformers' nested layout) for a VLConfig."""
    text = hf.config_to_hf(c.text.replace(family="qwen2"))
    for key in ("architectures", "tie_word_embeddings"):
        text.pop(key)
    text["model_type"] = "qwen2_5_vl_text"
    text["rope_parameters"]["mrope_section"] = list(c.text.mrope_section)
    v = c.vision
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen2_5_vl", "dtype": c.text.param_dtype,
        "tie_word_embeddings": c.text.tie_embeddings,
        "image_token_id": c.image_token_id, "video_token_id": c.video_token_id,
        "vision_start_token_id": c.vision_start_token_id,
        "vision_end_token_id": c.vision_end_token_id,
        "text_config": text,
        "vision_config": {
            "model_type": "qwen2_5_vl_vision", "depth": v.depth, "hidden_size": v.d_model,
            "num_heads": v.n_heads, "intermediate_size": v.d_ff, "out_hidden_size": v.out_d,
            "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
            "in_channels": v.in_channels, "spatial_merge_size": v.spatial_merge_size,
            "window_size": v.window_size, "fullatt_block_indexes": list(v.fullatt_blocks),
            "hidden_act": v.hidden_act, "tokens_per_second": v.tokens_per_second,
            "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}},
    }


def _tensors(c: VLConfig) -> list:
    out = []
    for t in hf._tensors(c.text):
        name = t.name if t.name.startswith("lm_head") else \
            "model.language_model." + t.name[len("model."):]
        layers = t.layer_ids(c.text) if "{i}" in t.name else None
        out.append(dataclasses.replace(t, path=("text",) + t.path, name=name, layers=layers))
    v = c.vision
    d, h, e, f, o, u = v.d_model, v.n_heads, v.head_dim, v.d_ff, v.out_d, v.merge_unit * v.d_model
    T = hf._Tensor
    out.append(T(("vision", "patch_embed"), "model.visual.patch_embed.proj.weight",
                 (d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)))
    block = "model.visual.blocks.{i}."
    layers = tuple(range(v.depth))
    for ours, theirs, shape, split in (
            ("norm1", "norm1.weight", (d,), None), ("norm2", "norm2.weight", (d,), None),
            ("wqkv", "attn.qkv.weight", (3 * d, d), 1), ("bqkv", "attn.qkv.bias", (3 * d,), None),
            ("wo", "attn.proj.weight", (d, h * e), 2), ("bo", "attn.proj.bias", (d,), None),
            ("w_gate", "mlp.gate_proj.weight", (f, d), 1),
            ("b_gate", "mlp.gate_proj.bias", (f,), None),
            ("w_up", "mlp.up_proj.weight", (f, d), 1), ("b_up", "mlp.up_proj.bias", (f,), None),
            ("w_down", "mlp.down_proj.weight", (d, f), 1),
            ("b_down", "mlp.down_proj.bias", (d,), None)):
        out.append(T(("vision", "blocks", ours), block + theirs, shape, split, layers))
    merger = "model.visual.merger."
    out += [T(("vision", "merger", "norm"), merger + "ln_q.weight", (d,)),
            T(("vision", "merger", "w1"), merger + "mlp.0.weight", (u, u), 1),
            T(("vision", "merger", "b1"), merger + "mlp.0.bias", (u,)),
            T(("vision", "merger", "w2"), merger + "mlp.2.weight", (o, u), 1),
            T(("vision", "merger", "b2"), merger + "mlp.2.bias", (o,))]
    return out


def _rename(stored: str) -> str:
    """Older transformers' names (`model.layers.*`, `visual.*`) -> today's."""
    if stored.startswith("visual."):
        return "model." + stored
    if stored.startswith("model.") and not stored.startswith(("model.language_model.",
                                                              "model.visual.")):
        return "model.language_model." + stored[len("model."):]
    return stored


def load(path: str, *, mesh=None, dtype: str | None = None, param_dtype: str | None = None,
         overrides: dict | None = None, vision_overrides: dict | None = None
         ) -> tuple[VLModel, VLConfig]:
    """VLModel and VLConfig from a local Qwen2.5-VL directory. `overrides`: the decoder's
    run-time fields (as hf.load); `vision_overrides`: VisionConfig fields that do not change
    the parameters (attention_impl, remat, freeze)."""
    overrides, vision_overrides = dict(overrides or {}), dict(vision_overrides or {})
    fixed = sorted(set(overrides) - set(RUNTIME_FIELDS))
    vfixed = sorted(set(vision_overrides) - {"attention_impl", "remat", "freeze"})
    if fixed or vfixed:
        raise ValueError(f"vision.hf.load overrides {fixed + vfixed}: the checkpoint sets "
                         f"these; only {RUNTIME_FIELDS} and the tower's attention_impl / "
                         "remat / freeze may be overridden")
    c = config_from_hf(hf.read_config(path), dtype=dtype, param_dtype=param_dtype)
    c = c.replace(text=c.text.replace(**overrides), vision=c.vision.replace(**vision_overrides))
    ckpt = hf._Checkpoint(path, rename=_rename)
    tensors = _tensors(c)
    hf._check_tensors(ckpt, tensors, c.text)
    make = lambda: VLModel(c, rngs=nnx.Rngs(0), mesh=mesh)  # noqa: E731
    return hf.build_module(ckpt, tensors, c.text, make, mesh, c.text.param_dtype), c


def load_image_processing(path: str) -> ImageProcessing:
    """preprocessor_config.json's settings (Qwen2-VL's defaults when there is none)."""
    file = os.path.join(path, "preprocessor_config.json")
    if not os.path.exists(file):
        return ImageProcessing()
    with open(file) as f:
        return ImageProcessing.from_hf(json.load(f))


def save(model, config: VLConfig, path: str, *, image_processing: ImageProcessing | None = None,
         tokenizer=None, generation_config: dict | None = None,
         max_shard_bytes: int = 4 << 30) -> None:
    """A directory transformers loads as Qwen2_5_VLForConditionalGeneration: safetensors,
    config.json, generation_config.json, preprocessor_config.json and the tokenizer."""
    hf.write(model, _tensors(config), config.text, config_to_hf(config), path,
             tokenizer=tokenizer,
             generation_config=(generation_config if generation_config is not None
                                else hf.generation_config_for(config.text)),
             max_shard_bytes=max_shard_bytes)
    import jax
    if jax.process_index() == 0:
        hf._write_json(os.path.join(path, "preprocessor_config.json"),
                       (image_processing or ImageProcessing()).to_hf())


def export(params, config: VLConfig, path: str, *, tokenizer=None, base_dir: str | None = None,
           stop_ids=()) -> None:
    """A trained VL model as a Hugging Face directory, keeping the brought model's
    generation_config.json and image processing (`base_dir`), as hf.export."""
    base = hf.read_generation_config(base_dir) if base_dir else None
    save(params, config, path, tokenizer=tokenizer,
         image_processing=load_image_processing(base_dir) if base_dir else None,
         generation_config=hf.generation_config_for(config.text, base=base, stop_ids=stop_ids))
