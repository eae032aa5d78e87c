"""An int8 frozen base for LoRA (`lora.base_dtype="int8"`, ModelConfig.int8_base).

The projection weights (q, k, v, o, gate, up, down; the MoE experts' too) are stored int8
with one float32 scale per output channel (symmetric, absmax over the input dims / 127) and
dequantised to the compute dtype in the forward (`model.cast_layer`); embeddings, the output
head and norms keep model.param_dtype. The base is frozen (LoRA trains the adapters in
float32), so no gradient ever reaches an int8 array.

  quantize(w, lead, n_in)   (int8 values, float32 scales [lead..., 1..., out...]) of a weight
  dequantize(q, s, dtype)   q * s in dtype
  quantize_module(m, lead)  a Module's projection Params replaced by int8 + `<name>_scale`
  quantize_state(state)     the same on a model's state (a float base loaded from a checkpoint)
  dequantize_state(state)   float32 weights again, no scales (merged exports, decode copies)
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
N_IN = {"wo": 2}  # weights with two input dims (heads, head dim)
SUFFIX = "_scale"


def quantize(w, lead: int, n_in: int):
    """(int8 [w's shape], float32 scales with w's input dims reduced to 1): round(w / s)
    with s = max |w| over the input dims / 127 (1 where that is 0)."""
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=tuple(range(lead, lead + n_in)), keepdims=True)
    s = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(w / s), -127, 127).astype(jnp.int8), s


def dequantize(q, s, dtype):
    return (q.astype(jnp.float32) * s).astype(dtype)


def _lead(path) -> int:
    return 2 if str(path[0]) == "experts" else 1  # (layers[, experts])


def _pair(w: nnx.Param, lead: int, n_in: int):
    q, s = quantize(w.get_value(), lead, n_in)
    axes = tuple(w.get_metadata()["axes"])
    scale_axes = axes[:lead] + (None,) * n_in + axes[lead + n_in:]
    return nnx.Param(q, axes=axes), nnx.Param(s, axes=scale_axes)


def quantize_module(module, lead: int) -> None:
    """Replaces `module`'s projection Params (WEIGHTS) by int8 ones and `<name>_scale`s."""
    for name in WEIGHTS:
        if isinstance(getattr(module, name, None), nnx.Param):
            q, s = _pair(getattr(module, name), lead, N_IN.get(name, 1))
            setattr(module, name, q)
            setattr(module, name + SUFFIX, s)


def quantize_state(state):
    """A float model state (no scales yet) with its projection weights int8 and scaled."""
    out = {}
    for path, v in nnx.to_flat_state(state):
        name = str(path[-1])
        if name in WEIGHTS and str(path[0]) in ("layers", "experts"):
            out[path], out[path[:-1] + (name + SUFFIX,)] = _pair(v, _lead(path),
                                                                 N_IN.get(name, 1))
        else:
            out[path] = v
    return nnx.State.from_flat_path(out)


def is_quantized(state) -> bool:
    return any(str(p[-1]).endswith(SUFFIX) for p, _ in nnx.to_flat_state(state))


def dequantize_state(state):
    """The state with every int8 weight float32 (q * s) and no scales."""
    flat = dict(nnx.to_flat_state(state))
    out = {}
    for path, v in flat.items():
        name = str(path[-1])
        if name.endswith(SUFFIX) and name[:-len(SUFFIX)] in WEIGHTS:
            continue
        s = flat.get(path[:-1] + (name + SUFFIX,))
        out[path] = v if s is None else v.replace(
            dequantize(v.get_value(), s.get_value(), jnp.float32))
    return nnx.State.from_flat_path(out)


def base_name(key: str) -> str:
    """The weight a layer array's key belongs to (w_gate for w_gate, w_gate_scale,
    w_gate_lora_a)."""
    key = key.split("_lora_")[0]
    return key[:-len(SUFFIX)] if key.endswith(SUFFIX) else key


def dequantized_layer(p: dict, dtype) -> dict:
    """One layer's arrays in `dtype`, int8 weights dequantised with their scales (dropped)."""
    out = {}
    for name, a in p.items():
        if name.endswith(SUFFIX) and name[:-len(SUFFIX)] in p:
            continue
        s = p.get(name + SUFFIX)
        out[name] = a.astype(dtype) if s is None else dequantize(a, s, dtype)
    return out

