"""Sampling from the decoder: one jitted prefill, then a jitted decode loop over a KV cache.

Token in, token out: prompts are lists of token ids (chat turns, tool observations and all,
already tokenised by the caller) and completions come back as token ids, never re-tokenised.

Prompts of different lengths share a batch, left-padded (segment id 0 marks the pads, and
each row's RoPE positions count only its own tokens). The prefill runs once per prompt; its
cache is then repeated `num_samples` times, so G samples per prompt cost one prefill. The
decode loop is a `lax.while_loop` on the device that stops when every row is done; it comes
back to the host only to check stop strings (every `stop_check_every` tokens, and only when
stop strings are given). Shapes are bucketed (rows and prompt length to powers of two) so a
training run compiles the sampler once.

Every sampled token comes with three log-probs: `logp`, under the distribution it was drawn
from (temperature, top-k, top-p applied; 0 for greedy, a point mass); `logp_temp`, under
log_softmax(logits / temperature) with no top-k / top-p: the policy at the sampling temperature,
which verl and TRL train (the learner's ratio, KL and truncated IS refer to it); and `logp_t1`,
the plain temperature-1 log-prob of the unmodified model. Greedy rows have no temperature:
their `logp_temp` is `logp_t1`.

A mixture-of-experts model's routing is recorded (`record_routing`, on by default for one):
the experts each prompt and each sampled token was sent to in every MoE layer, which the
learner replays in training (router replay, `rl.router_replay`) or compares its own routing
with (`moe/router_agreement`).

A vision-language model (`ptrain.vision.vl.VLModel`) samples from image prompts: `images[i]`
holds prompt i's images (the processor's patches and grids); the prefill encodes each image
once, writes its features at the prompt's placeholder tokens and runs the decoder with M-RoPE
positions; the G samples share the prefill, and decoding continues each row at its last
position + 1 (the rope delta, `ptrain.vision.positions`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ptrain import model as model_lib
from ptrain import sharding
from ptrain.generate.prefill import prefill_shared

FINISH_REASONS = ("stop", "length")
_RUNNING, _STOP, _LENGTH = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Samples:
    """Completions of `sample`, row r belonging to prompt `prompt_index[r]` (prompt-major:
    the G samples of prompt i are rows i*G .. i*G+G-1). Arrays are numpy, padded with
    `pad_id` / 0 after each row's length; stop tokens and stop strings are part of the
    completion."""

    tokens: np.ndarray  # int32 [rows, max_new_tokens]
    logp: np.ndarray  # float32 [rows, max_new_tokens]: under the distribution sampled from
    logp_temp: np.ndarray  # float32 [rows, max_new_tokens]: logits / temperature, no top-k / p
    logp_t1: np.ndarray  # float32 [rows, max_new_tokens]: temperature 1, no top-k / top-p
    lengths: np.ndarray  # int32 [rows]
    finish_reasons: list  # "stop" | "length" per row
    prompt_index: np.ndarray  # int32 [rows]
    # MoE routing (None unless recorded), int16: experts [rows, max_new_tokens, MoE layers,
    # k] of each sampled token (0 after the row's length); prompt_experts [prompts,
    # prompt_len, MoE layers, k] of each left-padded prompt (as `prompt_len` pads it).
    experts: np.ndarray | None = None
    prompt_experts: np.ndarray | None = None
    # rl.interrupt (the engine): the policy version that sampled each token, int32 [rows,
    # max_new_tokens] (ptrain.generate.interrupt.UNSAMPLED after the row's length)
    versions: np.ndarray | None = None

    def completions(self) -> list[list[int]]:
        return [row[:length].tolist() for row, length in zip(self.tokens, self.lengths)]


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The static part of a sampling call (hashable: part of the compilation key)."""

    temperature: float
    top_k: int
    top_p: float
    greedy: bool
    stop_token_ids: tuple
    pad_id: int


class Sampler:
    """Samples completions of token-id prompts from a `model.Transformer`.

    sampler = Sampler(model, seed=0)
    out = sampler.sample(params, [[1, 5, 9], [1, 7]], max_new_tokens=32, num_samples=4,
                         temperature=1.0, top_p=0.95, stop_token_ids=(2,))

    `params` is the model's `nnx.State` (e.g. a learner's current parameters) or the model
    itself. The sampler owns a PRNG key that advances on every call without an explicit `key`;
    `get_state` / `set_state` checkpoint it. `decode(ids) -> str` (a tokenizer's decode) is
    needed only for stop strings. With a mesh, rows are sharded over data x fsdp and heads
    over tensor, like the model.

    Many processes: each passes its own prompts and gets back the samples of those (rows of
    process p follow those of p-1 in the global batch); shapes and stop decisions are agreed
    across processes. Where the mesh replicates rows over processes, every process passes the
    same prompts and gets every sample. With `shared=True` every process passes the same
    (global) prompts, samples its devices' rows of them and gets every sample: the very call
    one process would make (a multi-turn rollout's later turns, an evaluation).
    """

    def __init__(self, model, *, seed: int = 0, pad_id: int = 0,
                 decode: Callable[[Sequence[int]], str] | None = None,
                 stop_check_every: int = 16):
        if stop_check_every < 1:
            raise ValueError(f"stop_check_every must be >= 1, got {stop_check_every}")
        self.graphdef = nnx.graphdef(model)
        self.config: model_lib.ModelConfig = model.config
        self.vl_config = getattr(model, "vl_config", None)  # a VLModel's
        self.mesh = model.mesh
        self.pad_id = int(pad_id)
        self.decode = decode
        self.stop_check_every = int(stop_check_every)
        self.key = jax.random.key(seed)

    def get_state(self) -> np.ndarray:
        """The PRNG key's data, for a checkpoint."""
        return np.asarray(jax.random.key_data(self.key))

    def set_state(self, key_data) -> None:
        self.key = jax.random.wrap_key_data(jnp.asarray(key_data, jnp.uint32))

    def sample(self, params, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
               num_samples: int = 1, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, greedy: bool = False, stop_token_ids: Sequence[int] = (),
               stop_strings: Sequence[str] = (), key=None, prompt_len: int | None = None,
               batch_size: int | None = None, record_routing: bool | None = None,
               shared: bool = False, images: Sequence | None = None) -> Samples:
        """Samples `num_samples` completions of every prompt (see the class docstring).

        key: a typed PRNG key for this call only (the sampler's own key is then left as is);
          the learner passes one per step so that a resumed run draws the same samples.
        prompt_len / batch_size: pad prompts / rows to these sizes (default: the next power
          of two, at least 8 and 1) so that calls with similar shapes share one compilation.
        record_routing: record each token's experts (default: whether the model has experts).
        shared: the prompts are the same on every process (see the class docstring).
        images: per prompt, (patches, grids) from `ptrain.vision.image_processing.preprocess`
          or None (a VLModel only; one process).
        """
        shared = shared and jax.process_count() > 1
        settings = self._settings(temperature, top_k, top_p, greedy, stop_token_ids,
                                  stop_strings, max_new_tokens, num_samples)
        if key is None:
            self.key, key = jax.random.split(self.key)
        if isinstance(params, nnx.Module):
            params = nnx.state(params)
        tokens_bt, lengths_b = self._pad_prompts(prompts, prompt_len, batch_size, shared)
        vision = self._vision(tokens_bt, lengths_b, images)
        rows = len(prompts) * num_samples  # this process's rows (all of them when shared)
        real_b = np.arange(len(tokens_bt)) < len(prompts)
        if shared:
            tokens_bt, lengths_b, real_b = sharding.shard_batch((tokens_bt, lengths_b, real_b),
                                                                self.mesh)
        else:
            tokens_bt, lengths_b, real_b = sharding.from_process_local(
                (tokens_bt, lengths_b, real_b), self.mesh,
                global_rows=len(tokens_bt) * sharding.row_groups(self.mesh))
        to_host = sharding.to_host if shared else sharding.to_host_local
        if record_routing is None:
            record_routing = self.config.n_experts > 0
        if record_routing and not self.config.n_experts:
            raise ValueError("Sampler: record_routing needs a model with experts (n_experts > 0)")
        carry = _prefill(params, tokens_bt, lengths_b, real_b, vision, graphdef=self.graphdef,
                         num_samples=num_samples, max_new_tokens=max_new_tokens,
                         record_routing=bool(record_routing))
        if not stop_strings:
            carry = _decode(params, carry, key, jnp.int32(max_new_tokens),
                            graphdef=self.graphdef, settings=settings)
            return self._finish(carry, rows, num_samples, {}, to_host)
        # Stop strings need the text: decode `stop_check_every` tokens on the device, then
        # look for the strings on the host and mark the rows that hit one as done.
        cut = {}  # row -> length at which a stop string completes
        checked = np.zeros(rows, np.int64)
        limit = 0
        while limit < max_new_tokens:
            limit = min(limit + self.stop_check_every, max_new_tokens)
            carry = _decode(params, carry, key, jnp.int32(limit), graphdef=self.graphdef,
                            settings=settings)
            tokens, lengths, done = to_host(
                (carry["tokens_bn"], carry["lengths_b"], carry["done_b"]))
            done = np.array(done)
            for row in range(rows):
                if row in cut or lengths[row] == checked[row]:
                    continue
                end = _stop_string_end(self.decode, tokens[row, :lengths[row]].tolist(),
                                       int(checked[row]), stop_strings)
                checked[row] = lengths[row]
                if end is not None:
                    cut[row] = end
                    done[row] = True
            if sharding.agree(bool(done.all()), "all"):  # every process stops together
                break
            if shared:
                carry["done_b"] = jax.make_array_from_callback(
                    done.shape, carry["done_b"].sharding, lambda index: done[index])
            else:
                carry["done_b"] = jax.make_array_from_process_local_data(
                    carry["done_b"].sharding, done, carry["done_b"].shape)
        return self._finish(carry, rows, num_samples, cut, to_host)

    def compile(self, params, *, prompts: int, prompt_len: int, max_new_tokens: int,
                num_samples: int = 1, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, greedy: bool = False, stop_token_ids=(),
                record_routing: bool | None = None) -> dict:
        """The two programs `sample` runs for a call of `prompts` prompts padded to
        `prompt_len` tokens, compiled without running them (`params` may be
        ShapeDtypeStructs carrying their shardings): {"sample_prefill": ..., "sample_decode":
        ...}, jax `Compiled` objects. The planner measures their memory (the KV cache is the
        prefill's output and the decode loop's donated carry). Rows are padded to the mesh's
        batch shards as `sample` pads them (one process)."""
        settings = self._settings(temperature, top_k, top_p, greedy, stop_token_ids, (),
                                  max_new_tokens, num_samples)
        if record_routing is None:
            record_routing = self.config.n_experts > 0
        shards = _batch_shards(self.mesh)
        rows = -(-prompts // shards) * shards

        def arg(shape, dtype):
            names = ("batch", "seq")[:len(shape)]
            return jax.ShapeDtypeStruct(shape, dtype, sharding=None if self.mesh is None
                                        else sharding.named(self.mesh, names, shape))

        prefill = _prefill.lower(
            params, arg((rows, prompt_len), jnp.int32), arg((rows,), jnp.int32),
            arg((rows,), jnp.bool_), graphdef=self.graphdef, num_samples=num_samples,
            max_new_tokens=max_new_tokens, record_routing=bool(record_routing)).compile()
        carry = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             prefill.out_info, prefill.output_shardings)
        key = jax.eval_shape(lambda: jax.random.key(0))
        decode = _decode.lower(params, carry, key, jax.ShapeDtypeStruct((), jnp.int32),
                               graphdef=self.graphdef, settings=settings).compile()
        return {"sample_prefill": prefill, "sample_decode": decode}

    def _settings(self, temperature, top_k, top_p, greedy, stop_token_ids, stop_strings,
                  max_new_tokens, num_samples) -> _Settings:
        v = self.config.vocab_size
        checks = [
            (max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {max_new_tokens}"),
            (num_samples >= 1, f"num_samples must be >= 1, got {num_samples}"),
            (greedy or temperature > 0,
             f"temperature must be > 0 (use greedy=True for argmax), got {temperature}"),
            (0 <= top_k <= v, f"top_k must be in [0, vocab_size={v}] (0: off), got {top_k}"),
            (0 < top_p <= 1, f"top_p must be in (0, 1] (1: off), got {top_p}"),
            (all(0 <= t < v for t in stop_token_ids),
             f"stop_token_ids {tuple(stop_token_ids)} must be token ids in [0, {v})"),
            (not stop_strings or self.decode is not None,
             "stop_strings need a decode callable: Sampler(model, decode=tokenizer.decode)"),
            (all(isinstance(s, str) and s for s in stop_strings),
             f"stop_strings must be non-empty strings, got {tuple(stop_strings)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"Sampler: {message}")
        return _Settings(float(temperature), int(top_k), float(top_p), bool(greedy),
                         tuple(int(t) for t in stop_token_ids), self.pad_id)

    def _vision(self, tokens_bt, lengths_b, images):
        """The image prompts' device inputs (ptrain.vision.prompts.prepare), or None for a
        text-only model."""
        if self.vl_config is None:
            if images is not None:
                raise ValueError("Sampler: images given to a text-only model; load a "
                                 "vision-language checkpoint (ptrain.vision.hf.load)")
            return None
        if jax.process_count() > 1:
            raise NotImplementedError("Sampler: image prompts run on one process for now")
        from ptrain.vision import prompts as vision_prompts
        vision = vision_prompts.prepare(tokens_bt, lengths_b, images or [], self.vl_config,
                                        left_pad=True)
        del vision["positions_bt"]  # the prefill derives them from the lengths
        return vision

    def _pad_prompts(self, prompts, prompt_len, batch_size, shared=False):
        """Left-padded prompts [rows, prompt_len] and their lengths; padding rows have length
        1 (one pad token) and are dropped from the results."""
        if not len(prompts):
            raise ValueError("Sampler: no prompts given")
        lengths = [len(p) for p in prompts]
        if min(lengths) == 0:
            raise ValueError(f"Sampler: prompt {lengths.index(0)} is empty; every prompt needs "
                             "at least one token (e.g. BOS)")
        # Shapes are agreed over processes (each pads its own prompts), so that all of them
        # run the same programs; with one process `agree` is the identity.
        longest = sharding.agree(max(lengths), "max")
        prompt_len = prompt_len or max(8, _next_pow2(longest))
        if longest > prompt_len:
            raise ValueError(f"Sampler: a prompt has {longest} tokens, more than "
                             f"prompt_len={prompt_len}")
        groups = 1 if shared else sharding.row_groups(self.mesh)
        shards = max(1, _batch_shards(self.mesh) // groups)  # per process's block of rows
        rows = sharding.agree(max(batch_size or _next_pow2(len(prompts)), len(prompts)), "max")
        rows = -(-rows // shards) * shards
        tokens_bt = np.full((rows, prompt_len), self.pad_id, np.int32)
        lengths_b = np.ones(rows, np.int32)
        for i, p in enumerate(prompts):
            tokens_bt[i, prompt_len - len(p):] = np.asarray(p, np.int32)
            lengths_b[i] = len(p)
        if tokens_bt.min() < 0 or tokens_bt.max() >= self.config.vocab_size:
            raise ValueError(f"Sampler: prompt token ids must be in [0, "
                             f"{self.config.vocab_size}); got {tokens_bt.min()}..{tokens_bt.max()}")
        return tokens_bt, lengths_b

    def _finish(self, carry, rows, num_samples, cut, to_host=sharding.to_host_local) -> Samples:
        tokens, logp, logp_temp, logp_t1, lengths, reasons = to_host(
            (carry["tokens_bn"], carry["logp_bn"], carry["logp_temp_bn"], carry["logp_t1_bn"],
             carry["lengths_b"], carry["reason_b"]))
        tokens, logp, logp_temp, logp_t1, lengths, reasons = (
            np.array(x[:rows]) for x in (tokens, logp, logp_temp, logp_t1, lengths, reasons))
        experts = prompt_experts = None
        if "experts_bnlk" in carry:
            experts, prompt_experts = to_host(
                (carry["experts_bnlk"], carry["prompt_experts_bplk"]))
            experts = np.array(experts[:rows])
            prompt_experts = np.array(prompt_experts[:rows // num_samples])
        for row, end in cut.items():
            lengths[row], reasons[row] = end, _STOP
            tokens[row, end:] = self.pad_id
            logp[row, end:], logp_temp[row, end:], logp_t1[row, end:] = 0.0, 0.0, 0.0
            if experts is not None:
                experts[row, end:] = 0
        reasons = np.where(reasons == _RUNNING, _LENGTH, reasons)
        return Samples(tokens=tokens, logp=logp, logp_temp=logp_temp, logp_t1=logp_t1,
                       lengths=lengths,
                       finish_reasons=[FINISH_REASONS[r - 1] for r in reasons],
                       prompt_index=(np.arange(rows) // num_samples).astype(np.int32),
                       experts=experts, prompt_experts=prompt_experts)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _batch_shards(mesh) -> int:
    if mesh is None:
        return 1
    return int(np.prod([mesh.shape[a] for a in sharding.batch_axes(mesh)]))


def _stop_string_end(decode, ids, checked, stop_strings):
    """The smallest n > checked with a stop string in decode(ids[:n]), or None.

    ids[:checked] is known not to contain one; the text of a longer prefix extends it.
    """
    if not any(s in decode(ids) for s in stop_strings):
        return None
    for n in range(checked + 1, len(ids) + 1):
        text = decode(ids[:n])
        if any(s in text for s in stop_strings):
            return n
    return len(ids)


# ------------------------------------------------------------------------- device programs


def _constrain_rows(tree, mesh):
    """Rows (the leading axis) over data x fsdp; the cache like attention activations."""
    def one(x):
        if isinstance(x, model_lib.KVCache):
            return jax.tree.map(lambda a, s: jax.lax.with_sharding_constraint(a, s), x,
                                model_lib.cache_shardings(x, mesh))
        if x.ndim == 0:
            return x
        return sharding.constrain(x, ("batch",) + (None,) * (x.ndim - 1), mesh)
    if mesh is None:
        return tree
    return {k: one(v) for k, v in tree.items()}


@functools.partial(jax.jit, static_argnames=("graphdef", "num_samples", "max_new_tokens",
                                             "record_routing"))
def _prefill(params, tokens_bt, lengths_b, real_b, vision=None, *, graphdef, num_samples,
             max_new_tokens, record_routing=False):
    """Runs the prompts once and returns the decode loop's initial state, G rows per prompt.
    `vision`: a VLModel's image inputs (Sampler._vision), each image encoded once here."""
    model = nnx.merge(graphdef, params)
    extra = {}
    if vision is not None:
        features_bmd = model.image_features(vision["images"])
        extra = dict(x_btd=model.embed(tokens_bt, features_bmd, vision["dest_bm"]),
                     rope_positions_3bt=vision["rope_3bt"])
    h_bd, cache, routing = prefill_shared(model, tokens_bt, lengths_b, repeats=num_samples,
                                          extra_slots=max_new_tokens, **extra)
    logits_bv = jnp.einsum("bd,vd->bv", h_bd, model.unembedding_vd(),
                           preferred_element_type=jnp.float32)

    def repeat(x):
        return jnp.repeat(x, num_samples, axis=0)

    rows = tokens_bt.shape[0] * num_samples
    carry = {
        "cache": cache,
        "logits_bv": repeat(logits_bv),
        "next_pos_b": repeat(lengths_b).astype(jnp.int32),  # position of the next token
        "i": jnp.zeros((), jnp.int32),  # tokens generated so far
        "tokens_bn": jnp.zeros((rows, max_new_tokens), jnp.int32),
        "logp_bn": jnp.zeros((rows, max_new_tokens), jnp.float32),
        "logp_temp_bn": jnp.zeros((rows, max_new_tokens), jnp.float32),
        "logp_t1_bn": jnp.zeros((rows, max_new_tokens), jnp.float32),
        "lengths_b": jnp.zeros(rows, jnp.int32),
        "done_b": ~repeat(real_b),  # padding rows are done from the start
        "reason_b": jnp.zeros(rows, jnp.int32),
    }
    if vision is not None:  # M-RoPE: a decoded token's rope position is its position + delta
        carry["rope_delta_b"] = repeat(vision["delta_b"]).astype(jnp.int32)
    if record_routing:
        l, k = routing.experts_lbtk.shape[0], routing.experts_lbtk.shape[-1]
        carry["prompt_experts_bplk"] = jnp.moveaxis(routing.experts_lbtk, 0, 2).astype(
            ROUTING_DTYPE)
        carry["experts_bnlk"] = jnp.zeros((rows, max_new_tokens, l, k), ROUTING_DTYPE)
    return _constrain_rows(carry, model.mesh)


ROUTING_DTYPE = jnp.int16  # expert ids as recorded (fewer than 32768 experts)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"), donate_argnames=("carry",))
def _decode(params, carry, key, limit, *, graphdef, settings: _Settings):
    """Decodes until every row is done or `limit` tokens exist (a while_loop on the device)."""
    model = nnx.merge(graphdef, params)
    max_new = carry["tokens_bn"].shape[1]
    stop_ids = jnp.asarray(settings.stop_token_ids or (-1,), jnp.int32)

    def cond(c):
        return (c["i"] < limit) & ~jnp.all(c["done_b"])

    def body(c):
        i, done_b = c["i"], c["done_b"]
        tok_b, logp_b, logp_temp_b, logp_t1_b = sample_logits(
            c["logits_bv"], jax.random.fold_in(key, i), settings)
        tok_b = jnp.where(done_b, settings.pad_id, tok_b)
        live_b = ~done_b

        def put(buf_bn, x_b):
            x_b = jnp.where(live_b, x_b, jnp.zeros((), buf_bn.dtype))
            return jax.lax.dynamic_update_slice(buf_bn, x_b[:, None].astype(buf_bn.dtype),
                                                (0, i))

        stopped_b = live_b & jnp.isin(tok_b, stop_ids)
        full_b = live_b & ~stopped_b & (i + 1 >= max_new)
        ones_b1 = jnp.ones((tok_b.shape[0], 1), jnp.int32)
        rope = None
        if "rope_delta_b" in c:
            rope = (c["next_pos_b"] + c["rope_delta_b"])[:, None]
        h_b1d, cache, routing = model.forward(tok_b[:, None], c["next_pos_b"][:, None],
                                              ones_b1, cache=c["cache"], rope_positions_3bt=rope)
        logits_bv = jnp.einsum("bd,vd->bv", h_b1d[:, 0], model.unembedding_vd(),
                               preferred_element_type=jnp.float32)
        logits_bv = sharding.constrain(logits_bv, ("batch", "vocab"), model.mesh)
        new = {
            "cache": cache,
            "logits_bv": logits_bv,
            "next_pos_b": c["next_pos_b"] + 1,
            "i": i + 1,
            "tokens_bn": put(c["tokens_bn"], tok_b),
            "logp_bn": put(c["logp_bn"], logp_b),
            "logp_temp_bn": put(c["logp_temp_bn"], logp_temp_b),
            "logp_t1_bn": put(c["logp_t1_bn"], logp_t1_b),
            "lengths_b": c["lengths_b"] + live_b,
            "done_b": done_b | stopped_b | full_b,
            "reason_b": jnp.where(stopped_b, _STOP, jnp.where(full_b, _LENGTH, c["reason_b"])),
        }
        if "rope_delta_b" in c:
            new["rope_delta_b"] = c["rope_delta_b"]
        if "experts_bnlk" in c:  # token i's experts, from the forward that consumed it
            e_blk = jnp.where(live_b[:, None, None], jnp.moveaxis(routing.experts_lbtk[:, :, 0],
                                                                  0, 1), 0)
            new["prompt_experts_bplk"] = c["prompt_experts_bplk"]
            new["experts_bnlk"] = jax.lax.dynamic_update_slice(
                c["experts_bnlk"], e_blk[:, None].astype(ROUTING_DTYPE), (0, i, 0, 0))
        return _constrain_rows(new, model.mesh)

    return jax.lax.while_loop(cond, body, carry)


def sample_logits(logits_bv, key, settings: _Settings):
    """One token per row; returns (tokens, logp under the sampled-from distribution, logp of
    logits / temperature, logp at temperature 1). Temperature first, then top-k, then top-p
    on what top-k kept (the order of Hugging Face's logits processors)."""
    logp_t1_bv = jax.nn.log_softmax(logits_bv, axis=-1)
    if settings.greedy:
        return greedy(logits_bv, logp_t1_bv)
    scaled_bv = logits_bv / settings.temperature
    z_bv = filter_top_k_top_p(scaled_bv, settings.top_k, settings.top_p)
    tok_b = jax.random.categorical(key, z_bv, axis=-1)
    return (tok_b, take(jax.nn.log_softmax(z_bv, axis=-1), tok_b),
            take(jax.nn.log_softmax(scaled_bv, axis=-1), tok_b), take(logp_t1_bv, tok_b))


def filter_top_k_top_p(z_bv, top_k: int, top_p: float):
    """Sets to -inf every logit outside the k largest (top_k > 0) and outside the smallest
    set of largest-probability tokens whose mass reaches top_p (top_p < 1). Ties with the
    last kept value are kept."""
    if top_k <= 0 and top_p >= 1.0:
        return z_bv
    k = top_k if top_k > 0 else z_bv.shape[-1]
    sorted_bk, _ = jax.lax.top_k(z_bv, k)  # descending
    keep_bk = jnp.ones(sorted_bk.shape, bool)
    if top_p < 1.0:
        p_bk = jax.nn.softmax(sorted_bk, axis=-1)
        before_bk = jnp.cumsum(p_bk, axis=-1) - p_bk  # mass of the larger tokens
        keep_bk = before_bk < top_p
    n_keep_b = keep_bk.sum(-1)
    threshold_b = jnp.take_along_axis(sorted_bk, n_keep_b[:, None] - 1, axis=-1)
    return jnp.where(z_bv >= threshold_b, z_bv, -jnp.inf)


def greedy(logits_bv, logp_t1_bv):
    """The argmax token of each row, as `sample_logits` returns a sample: its log-prob under
    the distribution sampled from is 0 (a point mass); at temperature 1, twice (greedy has
    no temperature)."""
    tok_b = jnp.argmax(logits_bv, axis=-1)
    logp_t1_b = take(logp_t1_bv, tok_b)
    return tok_b, jnp.zeros(tok_b.shape, jnp.float32), logp_t1_b, logp_t1_b


def take(x_bv, tok_b):
    """Each row's entry at its token: [b, v] -> [b]."""
    return jnp.take_along_axis(x_bv, tok_b[:, None], axis=-1)[:, 0]
