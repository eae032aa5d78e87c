"""One decoder for Llama 3 / 3.1 / 3.2, Qwen2 / 2.5 and Qwen3 checkpoints, in Flax NNX.

The module only holds parameters; the forward pass is plain functions over arrays. Layers are
stacked on a leading axis and run under `jax.lax.scan` (optionally rematerialised), so compile
time does not grow with depth. The KV cache is a pytree carried through the same scan.

Shape letters used in names:
  b batch    t query time    s key/value time (cache slots)    d model width
  h query heads    k key/value heads    g query heads per kv head (h = k * g)    e head dim
  f MLP hidden    v vocab    l layers
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from ptrain import attention
from ptrain import lora
from ptrain import moe
from ptrain import quant
from ptrain.rope import apply_rope, rope_tables
from ptrain import sharding

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
REMAT_POLICIES = ("none", "full", "dots")
DTYPES = ("float32", "bfloat16")


# ModelConfig fields that choose how the model runs, not what its parameters are: they may
# differ from a checkpoint's (hf.load overrides, the learner's config.model with hf_model).
RUNTIME_FIELDS = ("attention_impl", "attn_block_q", "attn_block_k", "remat", "moe_dispatch",
                  "moe_capacity_factor", "router_aux_loss_coef", "router_z_loss_coef",
                  "router_loss_scope")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and numerics of a decoder. `hf.config_from_hf` builds one from config.json.

    `family` (llama | qwen2 | qwen3 | qwen3_moe) only names the Hugging Face class on export;
    the architecture itself is fully described by the flags (biases, q/k norm, tying, RoPE,
    experts).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    head_dim: int = 0  # 0: d_model // n_heads
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 / 2.5
    o_bias: bool = False  # Llama with attention_bias=True
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    # RoPE. `rope_type` picks how the inverse frequencies are rescaled for long context.
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0  # linear, llama3, yarn
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_position: int = 8192  # llama3, yarn: the pre-training context
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_attention_factor: float = 0.0  # yarn: 0 means derived from rope_factor (and mscales)
    rope_mscale: float = 0.0  # yarn (DeepSeek style), 0: unused
    rope_mscale_all_dim: float = 0.0  # yarn, 0: unused
    rope_truncate: bool = True  # yarn
    # M-RoPE (Qwen2.5-VL): the rotary frequencies split into temporal / height / width
    # sections (pairs of head dims each, summing to head_dim / 2), each section rotated by its
    # own position; () is ordinary 1-D RoPE. `forward` takes the 3-D positions as
    # `rope_positions_3bt` (ptrain/vision/positions.py computes them).
    mrope_section: tuple[int, ...] = ()
    max_position_embeddings: int = 8192
    family: str = "llama"
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype; norms, softmax and RoPE always run in float32
    remat: str = "none"  # none | full | dots (save matmul outputs, recompute the rest)
    # attention.IMPLS: reference | blockwise | ring | cudnn. Blockwise is as fast as the dense
    # reference on short sequences and 2-10x faster from 512 tokens on (O(t) memory).
    attention_impl: str = "blockwise"
    attn_block_q: int = 512  # blockwise / ring block sizes (queries, keys)
    attn_block_k: int = 512
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (`ptrain.moe`, Qwen3-MoE); n_experts = 0 is a dense decoder.
    n_experts: int = 0
    n_experts_per_token: int = 0  # top-k
    d_ff_expert: int = 0  # each expert's hidden size (HF moe_intermediate_size)
    norm_topk_prob: bool = False  # renormalise the k routing weights to sum to 1
    moe_layer_step: int = 1  # layer i is sparse when (i + 1) % step == 0 (decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP of d_ff (mlp_only_layers)
    n_shared_experts: int = 0  # DeepSeek-style always-on experts (one MLP of n * d_ff_expert)
    moe_dispatch: str = "dropless"  # moe.DISPATCHES: dropless | capacity | dense
    moe_capacity_factor: float = 1.25  # capacity dispatch only
    router_aux_loss_coef: float = 0.0  # load-balancing loss weight in the training loss
    router_z_loss_coef: float = 0.0  # router z-loss weight
    # What the aux and z losses pool over (`moe.ROUTER_LOSS_SCOPES`): each microbatch's
    # forward, or the optimizer step's whole batch ("global": all its microbatches).
    router_loss_scope: str = "microbatch"
    # LoRA (`ptrain.lora`): rank 0 is none; else adapters of this rank on the weights
    # `lora_targets` names (ours: wq, wk, wv, wo, w_gate, w_up, w_down), scaled alpha / rank.
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()
    lora_dropout: float = 0.0  # on the adapters' input, in forwards given a dropout_key only
    lora_experts: bool = False  # also per-expert adapters on the MoE experts' targeted weights
    int8_base: bool = False  # the frozen base's projections int8 + per-channel scales (`quant`)

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))
        object.__setattr__(self, "mrope_section", tuple(int(i) for i in self.mrope_section))
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        checks = [
            (self.n_heads % self.n_kv_heads == 0,
             f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"),
            (self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}"),
            (not self.mrope_section or (len(self.mrope_section) == 3
                                        and 2 * sum(self.mrope_section) == self.head_dim),
             f"mrope_section {self.mrope_section} must be 3 sections summing to head_dim / 2 "
             f"({self.head_dim // 2})"),
            (self.rope_type in ROPE_TYPES,
             f"rope_type {self.rope_type!r} is not supported; use one of {ROPE_TYPES}"),
            (self.remat in REMAT_POLICIES,
             f"remat {self.remat!r} is not supported; use one of {REMAT_POLICIES}"),
            (self.param_dtype in DTYPES, f"param_dtype must be one of {DTYPES}"),
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}"),
            (self.attention_impl in attention.IMPLS,
             f"attention_impl {self.attention_impl!r} is not one of {attention.IMPLS}"),
            (self.lora_rank >= 0 and (not self.lora_rank or (
                self.lora_alpha > 0 and self.lora_targets
                and set(self.lora_targets) <= set(lora.TARGETS.values()))),
             f"LoRA: rank {self.lora_rank} must be >= 0, and with rank > 0 alpha "
             f"({self.lora_alpha}) > 0 and targets {self.lora_targets} a non-empty subset of "
             f"{tuple(lora.TARGETS.values())}"),
            (0.0 <= self.lora_dropout < 1.0, f"lora_dropout {self.lora_dropout} not in [0, 1)"),
            (not self.lora_experts or (self.n_experts and self.lora_rank and not self.lora_dropout
                                       and {"w_gate", "w_up", "w_down"} & set(self.lora_targets)),
             "lora.experts needs a MoE model, lora.rank > 0, one of gate_proj / up_proj / "
             "down_proj in lora.targets and lora.dropout=0 (expert adapters are merged into the "
             "expert weights in the forward, where dropout on their input cannot apply: PEFT "
             "refuses lora_dropout on expert parameters too)"),
            (not self.int8_base or self.lora_rank, "an int8 base is frozen: it needs LoRA"),
        ] + moe.check_config(self)
        for ok, message in checks:
            if not ok:
                raise ValueError(f"ModelConfig: {message}")

    @property
    def n_params(self) -> int:
        d, e, f, v = self.d_model, self.head_dim, self.d_ff, self.vocab_size
        attn = d * e * (2 * self.n_heads + 2 * self.n_kv_heads)
        per_layer = attn + 2 * d
        if self.qkv_bias:
            per_layer += e * (self.n_heads + 2 * self.n_kv_heads)
        if self.qk_norm:
            per_layer += 2 * e
        embeddings = v * d * (1 if self.tie_embeddings else 2)
        n_dense = self.n_layers - moe.n_moe_layers(self)
        return (self.n_layers * per_layer + n_dense * 3 * d * f + moe.n_params(self)[0]
                + embeddings + d)

    @property
    def n_active_params(self) -> int:
        """Parameters a token passes through (the k routed experts, not all of them)."""
        total, active = moe.n_params(self)
        return self.n_params - total + active

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer, preallocated for `s` slots.

    Slots are filled left to right from `index`. `segment_ids_bs` is 0 for empty (or padding)
    slots, which attention masks out; `positions_bs` holds each slot's RoPE position, so left
    padding and packed documents need no special cases. `index` is a scalar (every row
    writes at the same slot) or int32 [b], one write position per row (the rollout engine's
    decode slots, each at its own length); per-row writes past `max_len` are dropped.
    """

    k_lbske: jax.Array
    v_lbske: jax.Array
    positions_bs: jax.Array
    segment_ids_bs: jax.Array
    index: jax.Array  # int32 scalar or [b]: the next slot to write

    @property
    def max_len(self) -> int:
        return self.k_lbske.shape[2]


def init_cache(config: ModelConfig, batch: int, max_len: int, *, mesh=None) -> KVCache:
    """An empty cache of `max_len` slots, sharded like attention activations when given a mesh."""
    shape = (config.n_layers, batch, max_len, config.n_kv_heads, config.head_dim)
    dtype = jnp.dtype(config.dtype)
    cache = KVCache(
        k_lbske=jnp.zeros(shape, dtype),
        v_lbske=jnp.zeros(shape, dtype),
        positions_bs=jnp.zeros((batch, max_len), jnp.int32),
        segment_ids_bs=jnp.zeros((batch, max_len), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )
    if mesh is None:
        return cache
    return jax.device_put(cache, cache_shardings(cache, mesh))


def cache_shardings(cache: KVCache, mesh) -> KVCache:
    kv = sharding.named(mesh, ("layers", "batch", None, "kv_heads", None), cache.k_lbske.shape)
    bs = sharding.named(mesh, ("batch", None), cache.positions_bs.shape)
    return KVCache(kv, kv, bs, bs, sharding.named(mesh, (), ()))


def _param(rngs: nnx.Rngs, shape, axes, dtype, init: str = "normal") -> nnx.Param:
    if init == "normal":
        value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    else:
        value = jnp.zeros(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), axes=axes)


class Layers(nnx.Module):
    """All decoder layers' parameters, stacked on a leading `l` axis (names follow HF's)."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs):
        l, d, h, k, e, f = c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff
        n_dense = l - moe.n_moe_layers(c)  # the dense MLPs stack over dense layers only
        dt = jnp.dtype(c.param_dtype)
        self.attn_norm = _param(rngs, (l, d), ("layers", None), dt, "ones")
        self.wq = _param(rngs, (l, d, h, e), ("layers", "embed", "heads", None), dt)
        self.wk = _param(rngs, (l, d, k, e), ("layers", "embed", "kv_heads", None), dt)
        self.wv = _param(rngs, (l, d, k, e), ("layers", "embed", "kv_heads", None), dt)
        self.wo = _param(rngs, (l, h, e, d), ("layers", "heads", None, "embed"), dt)
        if c.qkv_bias:
            self.bq = _param(rngs, (l, h, e), ("layers", "heads", None), dt, "zeros")
            self.bk = _param(rngs, (l, k, e), ("layers", "kv_heads", None), dt, "zeros")
            self.bv = _param(rngs, (l, k, e), ("layers", "kv_heads", None), dt, "zeros")
        if c.o_bias:
            self.bo = _param(rngs, (l, d), ("layers", None), dt, "zeros")
        if c.qk_norm:
            self.q_norm = _param(rngs, (l, e), ("layers", None), dt, "ones")
            self.k_norm = _param(rngs, (l, e), ("layers", None), dt, "ones")
        self.mlp_norm = _param(rngs, (l, d), ("layers", None), dt, "ones")
        if n_dense:
            self.w_gate = _param(rngs, (n_dense, d, f), ("layers", "embed", "mlp"), dt)
            self.w_up = _param(rngs, (n_dense, d, f), ("layers", "embed", "mlp"), dt)
            self.w_down = _param(rngs, (n_dense, f, d), ("layers", "mlp", "embed"), dt)

    def arrays(self) -> dict[str, jax.Array]:
        """The stacked arrays by name, for the scanned layer function."""
        return {name: var[...] for name, var in vars(self).items() if isinstance(var, nnx.Param)}


class Transformer(nnx.Module):
    """Decoder-only transformer. Build sharded with `sharding.create_sharded` or `hf.load`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, mesh=None):
        c = config
        self.config = c
        self.mesh = mesh  # only used for activation sharding constraints; None = no constraints
        dt = jnp.dtype(c.param_dtype)
        self.embed = _param(rngs, (c.vocab_size, c.d_model), ("vocab", "embed"), dt)
        self.layers = Layers(c, rngs)
        if c.n_experts:
            self.experts = moe.Experts(c, rngs, _param)
        self.final_norm = _param(rngs, (c.d_model,), (None,), dt, "ones")
        if not c.tie_embeddings:
            self.lm_head = _param(rngs, (c.vocab_size, c.d_model), ("vocab", "embed"), dt)
        if c.int8_base:  # (after the draws: the same base, rounded)
            quant.quantize_module(self.layers, lead=1)
            if c.n_experts:
                quant.quantize_module(self.experts, lead=2)
        if c.lora_rank:  # after every weight, so the base draws what it draws without LoRA
            lora.add_adapters(self.layers, c, rngs, {
                n: v for n, v in vars(self.layers).items() if isinstance(v, nnx.Param)})
            if c.lora_experts:  # one adapter per layer and expert
                lora.add_adapters(self.experts, c, rngs, {
                    n: getattr(self.experts, n) for n in _DENSE_MLP}, lead=2)

    def unembedding_vd(self) -> jax.Array:
        """The output projection [vocab, d] (the embedding itself when tied)."""
        w = self.embed if self.config.tie_embeddings else self.lm_head
        return w[...].astype(self.config.dtype)

    def embed_tokens(self, tokens_bt):
        """Input embeddings [b, t, d] in the compute dtype."""
        # FSDP gathers the table (as it does every weight) so the lookup stays local.
        embed_vd = sharding.constrain(self.embed[...], (None, None), self.mesh)
        x_btd = jnp.take(embed_vd, tokens_bt, axis=0).astype(self.config.dtype)
        return sharding.constrain(x_btd, ("batch", "seq", None), self.mesh)

    def stages(self):
        """Runs of layers of one kind (moe.stages): (is_moe, lo, hi, offset, parameters of
        layers lo..hi stacked, with their MLP's), each run one scan."""
        c = self.config
        params = self.layers.arrays()
        mlps = {False: {k: params.pop(k) for k in list(params)
                        if quant.base_name(k) in _DENSE_MLP},
                True: self.experts.arrays() if c.n_experts else {}}
        out = []
        for is_moe, lo, hi, offset in moe.stages(c):
            p = {name: _rows(a, lo, hi) for name, a in params.items()}
            p.update({name: _rows(a, offset, offset + hi - lo) for name, a in mlps[is_moe].items()})
            out.append((is_moe, lo, hi, offset, p))
        return out

    def __call__(self, tokens_bt, positions_bt=None, segment_ids_bt=None, cache=None):
        """Float32 logits [b, t, v]; with a cache, `(logits, updated_cache)`."""
        h_btd, new_cache = self.hidden(tokens_bt, positions_bt, segment_ids_bt, cache)
        logits_btv = jnp.einsum("btd,vd->btv", h_btd, self.unembedding_vd(),
                                preferred_element_type=jnp.float32)
        logits_btv = sharding.constrain(logits_btv, ("batch", "seq", "vocab"), self.mesh)
        return logits_btv if cache is None else (logits_btv, new_cache)

    def hidden(self, tokens_bt, positions_bt=None, segment_ids_bt=None, cache=None):
        """Final-normed hidden states [b, t, d] in the compute dtype, and the updated cache.

        Losses use this with `unembedding_vd()` to compute token log-probs in chunks, so that
        float32 [b, t, v] is never materialised.
        """
        h_btd, new_cache, _ = self.forward(tokens_bt, positions_bt, segment_ids_bt, cache)
        return h_btd, new_cache

    def forward(self, tokens_bt, positions_bt=None, segment_ids_bt=None, cache=None, *,
                replay_lbtk=None, x_btd=None, rope_positions_3bt=None, dropout_key=None):
        """(hidden states as `hidden`, the updated cache, a `moe.Routing` or None).

        `replay_lbtk` [MoE layers, b, t, k]: experts to route each token to instead of the
        router's top-k (router replay: a rollout's recorded `Routing.experts_lbtk`).
        `x_btd`: input embeddings to use instead of the tokens' (image features merged in,
        ptrain/vision/vl.py). `rope_positions_3bt`: M-RoPE positions (config.mrope_section);
        `positions_bt` then still orders the tokens for the causal mask and the cache.
        `dropout_key`: a training forward's key for LoRA dropout (config.lora_dropout; each
        layer folds in its index); None (sampling, old and reference log-probs): no dropout.
        """
        c = self.config
        b, t = tokens_bt.shape
        start = jnp.zeros((), jnp.int32) if cache is None else cache.index
        if positions_bt is None:
            first = start[:, None] if jnp.ndim(start) == 1 else start
            positions_bt = jnp.broadcast_to(first + jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones((b, t), jnp.int32)
        positions_bt = positions_bt.astype(jnp.int32)
        segment_ids_bt = segment_ids_bt.astype(jnp.int32)
        if replay_lbtk is not None:
            expected = (moe.n_moe_layers(c), b, t, c.n_experts_per_token)
            if tuple(replay_lbtk.shape) != expected:
                raise ValueError(f"replay_lbtk has shape {tuple(replay_lbtk.shape)}; this model "
                                 f"and batch need {expected} (MoE layers, batch, time, k)")

        if x_btd is None:
            x_btd = self.embed_tokens(tokens_bt)
        layer = functools.partial(
            _layer, c=c, mesh=self.mesh, rope=rope_tables(c), q_pos_bt=positions_bt,
            q_seg_bt=segment_ids_bt, start=start, rope_pos=rope_positions_3bt)
        if cache is None:
            kw = dict(kv_pos_bs=positions_bt, kv_seg_bs=segment_ids_bt)
        else:
            kv_pos_bs = write_rows(cache.positions_bs, positions_bt, start)
            kv_seg_bs = write_rows(cache.segment_ids_bs, segment_ids_bt, start)
            kw = dict(kv_pos_bs=kv_pos_bs, kv_seg_bs=kv_seg_bs)
            k_lbske, v_lbske = cache.k_lbske, cache.v_lbske
            k_parts, v_parts = [], []

        # Layers run in stages of one kind (dense or MoE MLP), each stage one scan.
        routing = []
        keys_l = (None if dropout_key is None or not c.lora_dropout
                  else jax.vmap(lambda i: jax.random.fold_in(dropout_key, i))(
                      jnp.arange(c.n_layers)))
        for is_moe, lo, hi, offset, p in self.stages():
            replay = (None if replay_lbtk is None or not is_moe
                      else _rows(replay_lbtk, offset, offset + hi - lo))
            replay = (replay, None if keys_l is None else _rows(keys_l, lo, hi))
            fn = _remat(c.remat, functools.partial(layer, is_moe=is_moe))
            if cache is None:
                def step(x_btd, p_and_r):
                    p, (r, dk) = p_and_r
                    x_btd, _, stats = fn(p, x_btd, None, replay_btk=r, dropout_key=dk, **kw)
                    return x_btd, stats

                x_btd, stats = jax.lax.scan(step, x_btd, (p, replay))
            elif t == 1:
                # Decoding: the stacked cache rides in the carry and each layer writes its
                # slot in place (scanned as xs/ys, the whole cache would be copied per token).
                def step(carry, xs):
                    x_btd, k_all, v_all = carry
                    p, l, (r, dk) = xs
                    x_btd, (k_all, v_all, _), stats = fn(p, x_btd, (k_all, v_all, l),
                                                         replay_btk=r, dropout_key=dk, **kw)
                    return (x_btd, k_all, v_all), stats

                (x_btd, k_lbske, v_lbske), stats = jax.lax.scan(
                    step, (x_btd, k_lbske, v_lbske), (p, jnp.arange(lo, hi), replay))
            else:
                # Prefill and training: per-layer slices in and out. (Differentiating through
                # a carried cache would save the whole stack once per layer.)
                def step(x_btd, xs):
                    p, (k, v), (r, dk) = xs
                    x_btd, (k, v, _), stats = fn(p, x_btd, (k, v, None), replay_btk=r,
                                                 dropout_key=dk, **kw)
                    return x_btd, (k, v, stats)

                x_btd, (k, v, stats) = jax.lax.scan(
                    step, x_btd, (p, (_rows(k_lbske, lo, hi), _rows(v_lbske, lo, hi)), replay))
                k_parts.append(k)
                v_parts.append(v)
            if is_moe:
                routing.append(moe.routing_from_stats(stats))
        if cache is None:
            new_cache = None
        else:
            if t != 1:
                k_lbske, v_lbske = (_concat(k_parts), _concat(v_parts))
            new_cache = KVCache(k_lbske, v_lbske, kw["kv_pos_bs"], kw["kv_seg_bs"], start + t)

        h_btd = rms_norm(x_btd, self.final_norm[...].astype(c.dtype), c.rms_eps)
        return h_btd, new_cache, moe.concat(routing)


_DENSE_MLP = ("w_gate", "w_up", "w_down")


def _rows(a, lo: int, hi: int):
    """a[lo:hi] along the layer axis (the array itself when that is all of it)."""
    return a if (lo, hi) == (0, a.shape[0]) else a[lo:hi]


def _concat(parts):
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def init(config: ModelConfig, *, seed: int = 0, mesh=None) -> Transformer:
    """A randomly initialised model, its parameters born sharded on `mesh` (if given)."""
    return sharding.create_sharded(
        lambda: Transformer(config, rngs=nnx.Rngs(seed), mesh=mesh), mesh)


def _remat(policy: str, fn):
    if policy == "none":
        return fn
    if policy == "full":
        return jax.checkpoint(fn, prevent_cse=False)
    return jax.checkpoint(fn, prevent_cse=False,
                          policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)


def _layer(p, x_btd, kv, *, c: ModelConfig, mesh, rope, q_pos_bt, q_seg_bt, kv_pos_bs,
           kv_seg_bs, start, is_moe=False, replay_btk=None, rope_pos=None, dropout_key=None):
    """One pre-norm decoder layer: (x, kv, MoE routing statistics or None). `kv`: None, or
    (k cache, v cache, l) with this layer's cache slices (l None) or every layer's stacked
    cache and this layer's index l. `dropout_key`: this layer's LoRA dropout key or None."""
    w = cast_layer(p, c)
    q_bthe, k_btke, v_btke = layer_qkv(w, x_btd, q_pos_bt if rope_pos is None else rope_pos,
                                       c=c, rope=rope, mesh=mesh, key=dropout_key)
    if kv is None:
        k_bske, v_bske = k_btke, v_btke
    else:
        k_cache, v_cache, l = kv
        if l is None:  # this layer's cache [b, s, k, e]
            k_bske = write_rows(k_cache, k_btke.astype(k_cache.dtype), start)
            v_bske = write_rows(v_cache, v_btke.astype(v_cache.dtype), start)
            kv = (k_bske, v_bske, None)
        else:  # every layer's cache [l, b, s, k, e], written in place at (l, :, start)
            k_cache = write_rows(k_cache, k_btke.astype(k_cache.dtype), start, layer=l)
            v_cache = write_rows(v_cache, v_btke.astype(v_cache.dtype), start, layer=l)
            k_bske, v_bske = k_cache[l], v_cache[l]
            kv = (k_cache, v_cache, l)
    o_bthe = attention.attend(
        q_bthe, k_bske, v_bske,
        q_positions_bt=q_pos_bt, q_segment_ids_bt=q_seg_bt,
        kv_positions_bs=kv_pos_bs, kv_segment_ids_bs=kv_seg_bs,
        impl=c.attention_impl, mesh=mesh, block_q=c.attn_block_q, block_k=c.attn_block_k)
    x_btd, stats = layer_out(w, x_btd, o_bthe, c=c, mesh=mesh, valid_bt=q_seg_bt,
                             is_moe=is_moe, replay_btk=replay_btk, key=dropout_key)
    return x_btd, kv, stats


def cast_layer(p, c: ModelConfig) -> dict:
    """One layer's parameters in the compute dtype (an int8 base's dequantised)."""
    return quant.dequantized_layer(p, jnp.dtype(c.dtype))


def layer_qkv(w, x_btd, pos_bt, *, c: ModelConfig, rope, mesh=None, key=None):
    """The first half of a layer (`w` from `cast_layer`): queries [b, t, h, e], keys and
    values [b, t, k, e] after the norm, biases, q/k norms and RoPE (`pos_bt` [b, t], or
    [3, b, t] M-RoPE positions with config.mrope_section); `key`: LoRA dropout's. The
    rollout engine (ptrain/generate/kv_slots.py) calls it with its own cache and attention."""
    h_btd = rms_norm(x_btd, w["attn_norm"], c.rms_eps)
    q_bthe = lora.adapted(h_btd, w, "wq", c, mesh=mesh, key=key)
    k_btke = lora.adapted(h_btd, w, "wk", c, mesh=mesh, key=key)
    v_btke = lora.adapted(h_btd, w, "wv", c, mesh=mesh, key=key)
    if c.qkv_bias:
        q_bthe, k_btke, v_btke = q_bthe + w["bq"], k_btke + w["bk"], v_btke + w["bv"]
    if c.qk_norm:
        q_bthe = rms_norm(q_bthe, w["q_norm"], c.rms_eps)
        k_btke = rms_norm(k_btke, w["k_norm"], c.rms_eps)
    q_bthe = apply_rope(q_bthe, pos_bt, *rope)
    k_btke = apply_rope(k_btke, pos_bt, *rope)
    return sharding.constrain(q_bthe, ("batch", "seq", "heads", None), mesh), k_btke, v_btke


def layer_out(w, x_btd, o_bthe, *, c: ModelConfig, mesh, valid_bt, is_moe=False,
              replay_btk=None, key=None):
    """The second half of a layer: the attention output `o_bthe` projected and added, then
    the MLP (dense, or MoE routing the tokens where valid_bt != 0): (x, routing stats)."""
    attn_btd = lora.adapted(o_bthe, w, "wo", c, mesh=mesh, key=key)
    if c.o_bias:
        attn_btd = attn_btd + w["bo"]
    x_btd = sharding.constrain(x_btd + attn_btd, ("batch", "seq", None), mesh)

    h_btd = rms_norm(x_btd, w["mlp_norm"], c.rms_eps)
    stats = None
    if is_moe:
        mlp_btd, stats = moe.block(w, h_btd, valid_bt, c, mesh, replay_btk)
    else:
        gate_btf = lora.adapted(h_btd, w, "w_gate", c, mesh=mesh, key=key)
        up_btf = lora.adapted(h_btd, w, "w_up", c, mesh=mesh, key=key)
        act_btf = sharding.constrain(jax.nn.silu(gate_btf) * up_btf, ("batch", "seq", "mlp"),
                                     mesh)
        mlp_btd = lora.adapted(act_btf, w, "w_down", c, mesh=mesh, key=key)
    x_btd = x_btd + mlp_btd
    return sharding.constrain(x_btd, ("batch", "seq", None), mesh), stats


def write_rows(buf, x_bt, start, *, layer=None):
    """`buf` ([b, s, ...], or [l, b, s, ...] with `layer`) with x [b, t, ...] written at slot
    `start` of each row: one slice for a scalar start, a scatter for per-row starts [b]
    (writes past the end are dropped, never clamped onto earlier slots)."""
    if jnp.ndim(start) == 0:
        if layer is None:
            return jax.lax.dynamic_update_slice(buf, x_bt, (0, start) + (0,) * (buf.ndim - 2))
        return jax.lax.dynamic_update_slice(buf, x_bt[None],
                                            (layer, 0, start) + (0,) * (buf.ndim - 3))
    b, t = x_bt.shape[:2]
    rows_b1 = jnp.arange(b)[:, None]
    slots_bt = start[:, None] + jnp.arange(t)
    if layer is None:
        return buf.at[rows_b1, slots_bt].set(x_bt, mode="drop")
    return buf.at[layer, rows_b1, slots_bt].set(x_bt, mode="drop")


def rms_norm(x, weight, eps: float):
    """RMSNorm as in Llama/Qwen: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def param_count(model: Transformer) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def describe(config: ModelConfig) -> dict[str, Any]:
    """A JSON-able summary (for logs and plans)."""
    return {**dataclasses.asdict(config), "n_params": config.n_params}
