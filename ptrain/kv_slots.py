"""Decode slots over one KV cache: the device side of the rollout engine (ptrain/engine.py).

The state is N slots, each one row of a preallocated cache of S positions with its own
length (`model.KVCache` with a per-row index): a slot holds one sequence, prompt, model
turns and tool observations, left-aligned, so a token's RoPE position is its cache slot.
Four jitted programs act on it; each compiles once per shape, and the shapes come from a
small fixed set (the engine's buckets), so a run compiles a bounded number of programs:

  extend(rows [r], tokens [r, t])  appends tokens to rows (a prompt after a reset, a tool
                                   observation otherwise) and keeps their last logits
  fork(src [c], dst [c])           copies rows: G samples of a prompt share one prefill
  decode(rows [B])                 decodes the live rows among B, on the device, until one
                                   finishes or `max_steps` tokens
  truncate(rows [N])               moves rows back to a shorter length (stop strings)

Row ids equal to N are padding: reads clip, writes drop. Decode gathers only the rows it
runs (a bucket of the live ones), so slots waiting on a tool, and empty slots, cost nothing.

Every sampled token's randomness comes from its sequence's key folded with its index in the
sequence (one uniform, inverse-CDF), so what a request samples does not depend on its slot,
its neighbours or when it arrived. `logp` is the log-prob under the distribution sampled
from (logits / temperature, top-k, top-p; 0 for greedy), `logp_t1` the plain model's.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ptrain import model as model_lib
from ptrain import sampler as sampler_lib

RUNNING, STOP, LENGTH = 0, 1, 2

# Traces of each program (a trace is a compilation): the engine's tests assert that none
# happens after warm-up.
TRACES: collections.Counter = collections.Counter()


@dataclasses.dataclass(frozen=True)
class Settings:
    """The static part of decoding (hashable: part of the compilation key)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: tuple = ()
    pad_id: int = 0


def init_state(config: model_lib.ModelConfig, slots: int, max_len: int,
               max_new_tokens: int) -> dict:
    """N empty slots of `max_len` cache positions; turn outputs up to `max_new_tokens`."""
    cache = model_lib.init_cache(config, slots, max_len)
    cache = cache.replace(index=jnp.zeros(slots, jnp.int32))
    n, m = slots, max_new_tokens
    return {
        "cache": cache,
        "logits_nv": jnp.zeros((n, config.vocab_size), jnp.float32),
        "key_n2": jnp.zeros((n, 2), jnp.uint32),  # the sequence's PRNG key data
        "gen_n": jnp.zeros(n, jnp.int32),  # tokens sampled in the sequence so far
        "count_n": jnp.zeros(n, jnp.int32),  # tokens sampled in the current turn
        "limit_n": jnp.zeros(n, jnp.int32),  # the current turn's cap
        "live_n": jnp.zeros(n, bool),
        "reason_n": jnp.zeros(n, jnp.int32),
        "tokens_nm": jnp.zeros((n, m), jnp.int32),  # the current turn's tokens
        "logp_nm": jnp.zeros((n, m), jnp.float32),
        "logp_t1_nm": jnp.zeros((n, m), jnp.float32),
    }


def _rows(state, rows, mode):
    """The state's rows `rows` (mode "clip" reads; used for gathers)."""
    def take(x, axis):
        return jnp.take(x, rows, axis=axis, mode=mode)
    cache = state["cache"]
    sub = {k: take(v, 0) for k, v in state.items() if k != "cache"}
    sub["cache"] = model_lib.KVCache(take(cache.k_lbske, 1), take(cache.v_lbske, 1),
                                     take(cache.positions_bs, 0), take(cache.segment_ids_bs, 0),
                                     take(cache.index, 0))
    return sub


def _put_rows(state, rows, sub):
    """The state with rows `rows` replaced by `sub` (ids out of range are dropped)."""
    def put(x, y, axis):
        if axis == 0:
            return x.at[rows].set(y.astype(x.dtype), mode="drop")
        return x.at[:, rows].set(y.astype(x.dtype), mode="drop")
    c, s = state["cache"], sub["cache"]
    out = {k: put(v, sub[k], 0) for k, v in state.items() if k != "cache"}
    out["cache"] = model_lib.KVCache(put(c.k_lbske, s.k_lbske, 1), put(c.v_lbske, s.v_lbske, 1),
                                     put(c.positions_bs, s.positions_bs, 0),
                                     put(c.segment_ids_bs, s.segment_ids_bs, 0),
                                     put(c.index, s.index, 0))
    return out


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("state",))
def extend(params, state, rows_r, tokens_rt, lengths_r, reset_r, limit_r, key_r2, *, graphdef):
    """Appends tokens_rt[i, :lengths_r[i]] to row rows_r[i] (after emptying it where reset_r;
    a reset row also takes the key key_r2[i] and restarts its token count), records the
    logits after the last one and makes the row live for a turn of up to limit_r[i] tokens."""
    TRACES["extend"] += 1
    model = nnx.merge(graphdef, params)
    r, t = tokens_rt.shape
    real_r = rows_r < state["live_n"].shape[0]
    sub = _rows(state, rows_r, "clip")
    cache = sub["cache"]
    index_r = jnp.where(reset_r, 0, cache.index)
    seg_rs = jnp.where(reset_r[:, None], 0, cache.segment_ids_bs)
    positions_rt = index_r[:, None] + jnp.arange(t, dtype=jnp.int32)
    seg_rt = (jnp.arange(t)[None, :] < lengths_r[:, None]).astype(jnp.int32)
    cache = model_lib.KVCache(cache.k_lbske, cache.v_lbske, cache.positions_bs, seg_rs, index_r)
    h_rtd, cache = model.hidden(tokens_rt, positions_rt, seg_rt, cache)
    h_rd = h_rtd[jnp.arange(r), jnp.maximum(lengths_r - 1, 0)]
    logits_rv = jnp.einsum("rd,vd->rv", h_rd, model.unembedding_vd(),
                           preferred_element_type=jnp.float32)
    sub.update(
        cache=cache.replace(index=index_r + lengths_r),
        logits_nv=logits_rv,
        key_n2=jnp.where(reset_r[:, None], key_r2, sub["key_n2"]),
        gen_n=jnp.where(reset_r, 0, sub["gen_n"]),
        count_n=jnp.zeros(r, jnp.int32),
        limit_n=limit_r,
        live_n=real_r & (limit_r > 0),
        reason_n=jnp.zeros(r, jnp.int32))
    return _put_rows(state, rows_r, sub)


@functools.partial(jax.jit, donate_argnames=("state",))
def fork(state, src_c, dst_c, key_c2):
    """Row dst_c[i] becomes a copy of row src_c[i] with the key key_c2[i]."""
    TRACES["fork"] += 1
    sub = _rows(state, src_c, "clip")
    sub["key_n2"] = key_c2
    return _put_rows(state, dst_c, sub)


@functools.partial(jax.jit, donate_argnames=("state",))
def truncate(state, rows_n, length_n, gen_n, count_n):
    """Row rows_n[i] keeps its first length_n[i] cache positions and stops (its turn ends
    with a stop string); gen_n / count_n are its token counts at that point."""
    TRACES["truncate"] += 1
    cache = state["cache"]
    index = cache.index.at[rows_n].set(length_n, mode="drop")
    seg = jnp.where(jnp.arange(cache.max_len)[None, :] < index[:, None],
                    cache.segment_ids_bs, 0)
    return dict(state, cache=cache.replace(index=index, segment_ids_bs=seg),
                gen_n=state["gen_n"].at[rows_n].set(gen_n, mode="drop"),
                count_n=state["count_n"].at[rows_n].set(count_n, mode="drop"),
                live_n=state["live_n"].at[rows_n].set(False, mode="drop"),
                reason_n=state["reason_n"].at[rows_n].set(STOP, mode="drop"))


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"),
                   donate_argnames=("state",))
def decode(params, state, rows_b, max_steps, *, graphdef, settings: Settings):
    """Decodes the live rows among rows_b until one of them finishes its turn (a stop token
    or its limit) or `max_steps` steps; returns (state, steps, live row-steps)."""
    TRACES["decode"] += 1
    model = nnx.merge(graphdef, params)
    n = state["live_n"].shape[0]
    sub = _rows(state, rows_b, "clip")
    sub["live_n"] = sub["live_n"] & (rows_b < n)
    b, m = sub["tokens_nm"].shape
    stop_ids = jnp.asarray(settings.stop_token_ids or (-1,), jnp.int32)
    keys_b = jax.random.wrap_key_data(sub["key_n2"])

    def cond(carry):
        s, i, busy, finished = carry
        return (i < max_steps) & jnp.any(s["live_n"]) & ~finished

    def body(carry):
        s, i, busy, _ = carry
        live_b = s["live_n"]
        tok_b, logp_b, logp_t1_b = sample_rows(s["logits_nv"], keys_b, s["gen_n"], settings)
        tok_b = jnp.where(live_b, tok_b, settings.pad_id)
        col_b = jnp.where(live_b, s["count_n"], m)  # m: dropped

        def put(buf_bm, x_b):
            return buf_bm.at[jnp.arange(b), col_b].set(x_b.astype(buf_bm.dtype), mode="drop")

        stopped_b = live_b & jnp.isin(tok_b, stop_ids)
        full_b = live_b & ~stopped_b & (s["count_n"] + 1 >= s["limit_n"])
        cache = s["cache"]
        logits_b1v, cache = model(tok_b[:, None], cache.index[:, None],
                                  live_b[:, None].astype(jnp.int32), cache=cache)
        new = dict(
            s, cache=cache.replace(index=s["cache"].index + live_b),
            logits_nv=logits_b1v[:, 0],
            gen_n=s["gen_n"] + live_b, count_n=s["count_n"] + live_b,
            live_n=live_b & ~stopped_b & ~full_b,
            reason_n=jnp.where(stopped_b, STOP, jnp.where(full_b, LENGTH, s["reason_n"])),
            tokens_nm=put(s["tokens_nm"], tok_b), logp_nm=put(s["logp_nm"], logp_b),
            logp_t1_nm=put(s["logp_t1_nm"], logp_t1_b))
        return new, i + 1, busy + jnp.sum(live_b), jnp.any(stopped_b | full_b)

    zero = jnp.zeros((), jnp.int32)
    sub, steps, busy, _ = jax.lax.while_loop(cond, body, (sub, zero, zero, jnp.array(False)))
    return _put_rows(state, rows_b, sub), steps, busy


def sample_rows(logits_bv, keys_b, gen_b, settings: Settings):
    """One token per row from its own key (folded with gen_b), by inverse CDF; returns
    (tokens, logp under the distribution sampled from, logp at temperature 1)."""
    logp_t1_bv = jax.nn.log_softmax(logits_bv, axis=-1)
    if settings.greedy:
        tok_b = jnp.argmax(logits_bv, axis=-1)
        return tok_b, jnp.zeros(tok_b.shape, jnp.float32), _take(logp_t1_bv, tok_b)
    z_bv = sampler_lib.filter_top_k_top_p(logits_bv / settings.temperature, settings.top_k,
                                          settings.top_p)
    logp_bv = jax.nn.log_softmax(z_bv, axis=-1)
    u_b = jax.vmap(lambda k, g: jax.random.uniform(jax.random.fold_in(k, g)))(keys_b, gen_b)
    cdf_bv = jnp.cumsum(jnp.exp(logp_bv), axis=-1)
    # The first token whose cumulative mass reaches (1 - u) of the total: u in [0, 1), so a
    # zero-probability token is never chosen.
    target_b = (1.0 - u_b) * cdf_bv[:, -1]
    tok_b = jnp.minimum(jnp.sum(cdf_bv < target_b[:, None], axis=-1), logits_bv.shape[-1] - 1)
    return tok_b, _take(logp_bv, tok_b), _take(logp_t1_bv, tok_b)


def _take(x_bv, tok_b):
    return jnp.take_along_axis(x_bv, tok_b[:, None], axis=-1)[:, 0]
