"""Decode slots over one KV cache: the device side of the rollout engine (ptrain/generate/engine.py).

The state is N slots, each one row of a preallocated cache of S positions with its own
length (`index_n`): a slot holds one sequence, prompt, model turns and tool observations,
left-aligned, so a token's RoPE position is its cache position. Keys and values lie
slot-major and head-major, [layers, slots, kv heads, positions, head dim], the layout a
one-token query reads without a transposed copy (the model's [l, b, s, k, e] cache costs
XLA a transposed copy of every layer's cache per decode step).
Five jitted programs act on it; each compiles once per shape, and the shapes come from a
small fixed set (the engine's buckets), so a run compiles a bounded number of programs:

  extend(rows [r], tokens [r, t])  appends tokens to rows (a prompt after a reset, a tool
                                   observation otherwise) and keeps their last logits
  fork(src [c], dst [c])           copies rows: G samples of a prompt share one prefill
  decode(rows [B])                 decodes the live rows among B, many steps on the device,
                                   until enough rows finished to refill (or half the bucket
                                   would hold the live ones) or `max_steps` tokens; each
                                   step's attention reads only the blocks of positions the
                                   longest live row needs, and writes in place
  truncate(rows [N])               moves rows back to a shorter length (stop strings)
  recompute(rows [r], tokens [r, t]) rebuilds rows' cache from their whole sequences under
                                   new weights, their turn state kept (an interruption)

Row ids equal to N are padding: reads clip, writes drop. Decode gathers only the rows it
runs (a bucket of the live ones), once per call, so slots waiting on a tool, and empty
slots, cost nothing; the bucket of every slot decodes the state where it lies. Decode and
extend run the model's own layer functions (`model.layer_qkv`, `model.layer_out`) around
their cache writes and blockwise attention (`forward_tokens`), so neither copies a row's
whole cache: their cost grows with the tokens and the positions they reach, not with S
(before, a prompt's prefill gathered and transposed its rows' whole cache for
`model.forward`: 6.5x slower at S = 2048 than at 128). `recompute` still does.

A mixture-of-experts model's routing is recorded where the state has `experts_nslk`
(`init_state(record_routing=True)`): the experts each cache position's token was sent to in
every MoE layer, written by the forward that consumed it (extend for prompts and
observations, the decode step for sampled tokens), so a slot's positions 0..index-1 hold
its sequence's routing as the engine ran it.

Every sampled token's randomness comes from its sequence's key folded with its index in the
sequence (one uniform, inverse-CDF), so what a request samples does not depend on its slot,
its neighbours or when it arrived. `logp` is the log-prob under the distribution sampled
from (logits / temperature, then top-k, then top-p; 0 for greedy), `logp_temp` under logits /
temperature alone (the policy a learner's forward computes; the plain model's for greedy),
`logp_t1` the plain model's.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ptrain import model as model_lib
from ptrain import moe
from ptrain import rope as rope_lib
from ptrain.generate import sampler as sampler_lib

ROUTING_DTYPE = sampler_lib.ROUTING_DTYPE

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


def cache_layout(max_len: int, block: int = 128) -> tuple[int, int]:
    """(cache positions, attention block): decode attends in blocks of `block` positions
    (fewer when max_len is shorter), so the cache is max_len rounded up to whole blocks."""
    block = min(block, max_len)
    return -(-max_len // block) * block, block


def init_state(config: model_lib.ModelConfig, slots: int, max_len: int,
               max_new_tokens: int, *, record_routing: bool = False) -> dict:
    """N empty slots of `max_len` cache positions; turn outputs up to `max_new_tokens`.

    Keys and values are slot-major and head-major, [layers, slots, kv heads, positions,
    head dim]: a decode step's attention reads them as they lie (no transposed copy).
    record_routing (a MoE model): each position's experts, [slots, positions, MoE layers,
    k] int16."""
    n, m = slots, max_new_tokens
    s, _ = cache_layout(max_len)
    shape = (config.n_layers, n, config.n_kv_heads, s, config.head_dim)
    routing = {}
    if record_routing:
        routing["experts_nslk"] = jnp.zeros(
            (n, s, moe.n_moe_layers(config), config.n_experts_per_token), ROUTING_DTYPE)
    return {**routing,
        "k_lnkse": jnp.zeros(shape, config.dtype),
        "v_lnkse": jnp.zeros(shape, config.dtype),
        "index_n": jnp.zeros(n, jnp.int32),  # the next cache position to write (the length)
        "logits_nv": jnp.zeros((n, config.vocab_size), jnp.float32),
        "key_n2": jnp.zeros((n, 2), jnp.uint32),  # the sequence's PRNG key data
        "gen_n": jnp.zeros(n, jnp.int32),  # tokens sampled in the sequence so far
        "count_n": jnp.zeros(n, jnp.int32),  # tokens sampled in the current turn
        "limit_n": jnp.zeros(n, jnp.int32),  # the current turn's cap
        "live_n": jnp.zeros(n, bool),
        "reason_n": jnp.zeros(n, jnp.int32),
        "tokens_nm": jnp.zeros((n, m), jnp.int32),  # the current turn's tokens
        "logp_nm": jnp.zeros((n, m), jnp.float32),
        "logp_temp_nm": jnp.zeros((n, m), jnp.float32),
        "logp_t1_nm": jnp.zeros((n, m), jnp.float32),
    }


_CACHE = ("k_lnkse", "v_lnkse")  # row axis 1; every other entry's is 0


def _rows(state, rows):
    """The state's rows `rows` (ids out of range read the last row)."""
    return {k: jnp.take(v, rows, axis=1 if k in _CACHE else 0, mode="clip")
            for k, v in state.items()}


def _put_rows(state, rows, sub):
    """The state with rows `rows` replaced by `sub` (ids out of range are dropped)."""
    def put(k, x, y):
        y = y.astype(x.dtype)
        if k in _CACHE:
            return x.at[:, rows].set(y, mode="drop")
        return x.at[rows].set(y, mode="drop")
    return {k: put(k, v, sub[k]) for k, v in state.items()}


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("state",))
def extend(params, state, rows_r, tokens_rt, lengths_r, reset_r, limit_r, key_r2, *, graphdef):
    """Appends tokens_rt[i, :lengths_r[i]] to row rows_r[i] (after emptying it where reset_r;
    a reset row also takes the key key_r2[i] and restarts its token count), records the
    logits after the last one and makes the row live for a turn of up to limit_r[i] tokens.
    The rows are written where they lie in the state, and the new tokens attend over the
    blocks their positions reach: the cost grows with the tokens, not with max_len."""
    TRACES["extend"] += 1
    model = nnx.merge(graphdef, params)
    r, t = tokens_rt.shape
    n, s = state["live_n"].shape[0], state["k_lnkse"].shape[3]
    real_r = rows_r < n
    index_r = jnp.where(reset_r, 0, state["index_n"].at[rows_r].get(mode="clip"))
    positions_rt = index_r[:, None] + jnp.arange(t, dtype=jnp.int32)
    valid_rt = real_r[:, None] & (jnp.arange(t)[None, :] < lengths_r[:, None])
    h_rtd, k, v, experts_lrtk = forward_tokens(model, tokens_rt, positions_rt, valid_rt,
                                               state["k_lnkse"], state["v_lnkse"],
                                               rows_b=rows_r)
    out = dict(state, k_lnkse=k, v_lnkse=v)
    if "experts_nslk" in state:  # each appended token's experts at its cache position
        at_rt = jnp.where(valid_rt, positions_rt, s)  # s: dropped
        out["experts_nslk"] = state["experts_nslk"].at[rows_r[:, None], at_rt].set(
            jnp.moveaxis(experts_lrtk, 0, 2).astype(ROUTING_DTYPE), mode="drop")
    h_rd = h_rtd[jnp.arange(r), jnp.maximum(lengths_r - 1, 0)]
    h_rd = model_lib.rms_norm(h_rd, model.final_norm[...].astype(model.config.dtype),
                              model.config.rms_eps)
    logits_rv = jnp.einsum("rd,vd->rv", h_rd, model.unembedding_vd(),
                           preferred_element_type=jnp.float32)
    rows = {"index_n": index_r + lengths_r, "logits_nv": logits_rv,
            "key_n2": jnp.where(reset_r[:, None], key_r2,
                                state["key_n2"].at[rows_r].get(mode="clip")),
            "gen_n": jnp.where(reset_r, 0, state["gen_n"].at[rows_r].get(mode="clip")),
            "count_n": jnp.zeros(r, jnp.int32), "limit_n": limit_r,
            "live_n": real_r & (limit_r > 0), "reason_n": jnp.zeros(r, jnp.int32)}
    for name, x in rows.items():
        out[name] = state[name].at[rows_r].set(x.astype(state[name].dtype), mode="drop")
    return out


@functools.partial(jax.jit, static_argnames=("graphdef", "replay"), donate_argnames=("state",))
def recompute(params, state, rows_r, tokens_rt, lengths_r, *, graphdef, replay=False):
    """Rebuilds rows rows_r's cache from their whole sequences tokens_rt[i, :lengths_r[i]]
    under `params` (new weights at an interruption, ptrain/generate/interrupt.py) and the logits after
    the last token; the turn's state (key, counts, live, the turn's tokens) is kept, so a row
    decoding mid-turn goes on where it was, now with these weights.

    With recorded routing (a MoE model) each position's experts become the new weights'
    choice; with `replay` (rl.router_replay) every position is instead routed to the experts
    it recorded, which are kept: the forward the learner will replay over this prefix."""
    TRACES["recompute"] += 1
    model = nnx.merge(graphdef, params)
    r, t = tokens_rt.shape
    sub = _rows(state, rows_r)
    s = sub["k_lnkse"].shape[3]
    slots_rs = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (r, s))
    zero_r = jnp.zeros(r, jnp.int32)
    cache = model_lib.KVCache(sub["k_lnkse"].transpose(0, 1, 3, 2, 4),
                              sub["v_lnkse"].transpose(0, 1, 3, 2, 4), slots_rs,
                              jnp.zeros((r, s), jnp.int32), zero_r)
    positions_rt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (r, t))
    seg_rt = (jnp.arange(t)[None, :] < lengths_r[:, None]).astype(jnp.int32)
    replay_lrtk = None
    if replay:
        if "experts_nslk" not in sub:
            raise ValueError("recompute(replay=True) needs recorded routing (a MoE model's "
                             "engine with record_routing)")
        replay_lrtk = jnp.moveaxis(sub["experts_nslk"][:, :t], 2, 0).astype(jnp.int32)
    h_rtd, cache, routing = model.forward(tokens_rt, positions_rt, seg_rt, cache,
                                          replay_lbtk=replay_lrtk)
    h_rd = h_rtd[jnp.arange(r), jnp.maximum(lengths_r - 1, 0)]
    if "experts_nslk" in sub and not replay:  # the new weights' routing of every position
        at_rt = jnp.where(seg_rt > 0, positions_rt, s)
        sub["experts_nslk"] = sub["experts_nslk"].at[jnp.arange(r)[:, None], at_rt].set(
            jnp.moveaxis(routing.experts_lbtk, 0, 2).astype(ROUTING_DTYPE), mode="drop")
    sub.update(k_lnkse=cache.k_lbske.transpose(0, 1, 3, 2, 4),
               v_lnkse=cache.v_lbske.transpose(0, 1, 3, 2, 4), index_n=lengths_r,
               logits_nv=jnp.einsum("rd,vd->rv", h_rd, model.unembedding_vd(),
                                    preferred_element_type=jnp.float32))
    return _put_rows(state, rows_r, sub)


@functools.partial(jax.jit, donate_argnames=("state",))
def fork(state, src_c, dst_c, key_c2):
    """Row dst_c[i] becomes a copy of row src_c[i] with the key key_c2[i]."""
    TRACES["fork"] += 1
    sub = _rows(state, src_c)
    sub["key_n2"] = key_c2
    return _put_rows(state, dst_c, sub)


@functools.partial(jax.jit, donate_argnames=("state",))
def truncate(state, rows_n, length_n, gen_n, count_n):
    """Row rows_n[i] keeps its first length_n[i] cache positions and stops (its turn ends
    with a stop string); gen_n / count_n are its token counts at that point."""
    TRACES["truncate"] += 1
    return dict(state, index_n=state["index_n"].at[rows_n].set(length_n, mode="drop"),
                gen_n=state["gen_n"].at[rows_n].set(gen_n, mode="drop"),
                count_n=state["count_n"].at[rows_n].set(count_n, mode="drop"),
                live_n=state["live_n"].at[rows_n].set(False, mode="drop"),
                reason_n=state["reason_n"].at[rows_n].set(STOP, mode="drop"))


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"),
                   donate_argnames=("state",))
def decode(params, state, rows_b, max_steps, refill_at, min_live, *, graphdef,
           settings: Settings):
    """Decodes the live rows among rows_b, many steps per call, on the device. Returns after
    `max_steps` steps, when no row is live, when `refill_at` rows have finished their turn
    (their slots can take waiting requests) or when fewer than `min_live` rows are live (a
    smaller bucket would hold them); returns (state, steps, live row-steps)."""
    TRACES["decode"] += 1
    model = nnx.merge(graphdef, params)
    n = state["live_n"].shape[0]
    # The bucket of every slot decodes the state where it lies: gathering its rows and
    # scattering them back would copy the whole cache each call (a cost that grows with
    # max_len, not with the tokens decoded). Only rows_b's rows are live in it.
    whole = rows_b.shape[0] == n
    if whole:
        member_n = jnp.zeros(n, bool).at[rows_b].set(True, mode="drop")
        sub = dict(state, live_n=state["live_n"] & member_n)
    else:
        sub = _rows(state, rows_b)
        sub["live_n"] = sub["live_n"] & (rows_b < n)
    b, m = sub["tokens_nm"].shape
    stop_ids = jnp.asarray(settings.stop_token_ids or (-1,), jnp.int32)
    keys_b = jax.random.wrap_key_data(sub["key_n2"])
    _, block = cache_layout(sub["k_lnkse"].shape[3])

    def cond(carry):
        s, i, busy, finished = carry
        live = jnp.sum(s["live_n"])
        return (i < max_steps) & (live > 0) & (finished < refill_at) & (live >= min_live)

    def body(carry):
        s, i, busy, finished = carry
        live_b = s["live_n"]
        tok_b, logp_b, logp_temp_b, logp_t1_b = sample_rows(s["logits_nv"], keys_b, s["gen_n"],
                                                             settings)
        tok_b = jnp.where(live_b, tok_b, settings.pad_id)
        col_b = jnp.where(live_b, s["count_n"], m)  # m: dropped

        def put(buf_bm, x_b):
            return buf_bm.at[jnp.arange(b), col_b].set(x_b.astype(buf_bm.dtype), mode="drop")

        stopped_b = live_b & jnp.isin(tok_b, stop_ids)
        full_b = live_b & ~stopped_b & (s["count_n"] + 1 >= s["limit_n"])
        logits_bv, k, v, experts_blk = decode_step(model, tok_b, s["index_n"], live_b,
                                                   s["k_lnkse"], s["v_lnkse"], block)
        routing = {}
        if "experts_nslk" in s:  # the sampled token's experts at its cache position
            at_b = jnp.where(live_b, s["index_n"], s["experts_nslk"].shape[1])
            routing["experts_nslk"] = s["experts_nslk"].at[jnp.arange(b), at_b].set(
                experts_blk.astype(ROUTING_DTYPE), mode="drop")
        new = dict(
            s, **routing, k_lnkse=k, v_lnkse=v, index_n=s["index_n"] + live_b, logits_nv=logits_bv,
            gen_n=s["gen_n"] + live_b, count_n=s["count_n"] + live_b,
            live_n=live_b & ~stopped_b & ~full_b,
            reason_n=jnp.where(stopped_b, STOP, jnp.where(full_b, LENGTH, s["reason_n"])),
            tokens_nm=put(s["tokens_nm"], tok_b), logp_nm=put(s["logp_nm"], logp_b),
            logp_temp_nm=put(s["logp_temp_nm"], logp_temp_b),
            logp_t1_nm=put(s["logp_t1_nm"], logp_t1_b))
        return (new, i + 1, busy + jnp.sum(live_b),
                finished + jnp.sum(stopped_b | full_b))

    zero = jnp.zeros((), jnp.int32)
    sub, steps, busy, _ = jax.lax.while_loop(cond, body, (sub, zero, zero, zero))
    if whole:  # rows outside rows_b keep their state
        return dict(sub, live_n=jnp.where(member_n, sub["live_n"], state["live_n"])), steps, busy
    return _put_rows(state, rows_b, sub), steps, busy


def decode_step(model, tok_b, pos_b, live_b, k_lbkse, v_lbkse, block: int):
    """One token per row through the model (`forward_tokens`), its keys and values written
    at cache position pos_b. Returns (logits [b, v] float32, k, v, the MoE layers' experts
    [b, MoE layers, k] or None)."""
    c = model.config
    x_b1d, k_lbkse, v_lbkse, e_lb1k = forward_tokens(model, tok_b[:, None], pos_b[:, None],
                                                     live_b[:, None], k_lbkse, v_lbkse,
                                                     block=block)
    h_bd = model_lib.rms_norm(x_b1d[:, 0], model.final_norm[...].astype(c.dtype), c.rms_eps)
    logits_bv = jnp.einsum("bd,vd->bv", h_bd, model.unembedding_vd(),
                           preferred_element_type=jnp.float32)
    experts_blk = None if e_lb1k is None else jnp.moveaxis(e_lb1k[:, :, 0], 0, 1)
    return logits_bv, k_lbkse, v_lbkse, experts_blk


def forward_tokens(model, tok_bt, pos_bt, valid_bt, k_lnkse, v_lnkse, *, rows_b=None,
                   block: int | None = None):
    """t tokens of each row through the model (its own layer functions, model.layer_qkv
    and model.layer_out) on the slot cache: row i is cache row rows_b[i] (default: i), its
    valid tokens' keys and values are written at their positions pos_bt (the others are
    dropped) and each query attends to its row's positions 0..its own, online over blocks
    of `block` positions up to the furthest valid one (a short row costs only the blocks
    the longest one needs). Returns (hidden states [b, t, d] before the final norm, k, v,
    the MoE layers' experts [MoE layers, b, t, k] or None)."""
    c = model.config
    rope = rope_lib.rope_tables(c)
    s = k_lnkse.shape[3]
    block = block or cache_layout(s)[1]
    at_bt = jnp.where(valid_bt, pos_bt, s)  # s: dropped
    n_blocks = jnp.max(jnp.where(valid_bt, pos_bt, 0)) // block + 1
    row_b1 = (jnp.arange(tok_bt.shape[0]) if rows_b is None else rows_b)[:, None]
    x_btd = model.embed_tokens(tok_bt)
    experts = []  # per MoE stage: [its layers, b, t, k]
    for is_moe, lo, hi, _, p in model.stages():
        def layer(carry, xs, is_moe=is_moe):
            x_btd, k_all, v_all = carry
            p, l = xs
            w = model_lib.cast_layer(p, c)
            q_bthe, k_btke, v_btke = model_lib.layer_qkv(w, x_btd, pos_bt, c=c, rope=rope)
            k_all = k_all.at[l, row_b1, :, at_bt].set(k_btke.astype(k_all.dtype), mode="drop")
            v_all = v_all.at[l, row_b1, :, at_bt].set(v_btke.astype(v_all.dtype), mode="drop")
            o_bthe = _attend(q_bthe, k_all, v_all, l, rows_b, pos_bt, n_blocks, block)
            x_btd, stats = model_lib.layer_out(w, x_btd, o_bthe, c=c, mesh=None,
                                               valid_bt=valid_bt.astype(jnp.int32),
                                               is_moe=is_moe)
            return (x_btd, k_all, v_all), (stats["experts_btk"] if is_moe else None)

        (x_btd, k_lnkse, v_lnkse), e_lbtk = jax.lax.scan(
            layer, (x_btd, k_lnkse, v_lnkse), (p, jnp.arange(lo, hi)))
        if is_moe:
            experts.append(e_lbtk)
    return x_btd, k_lnkse, v_lnkse, jnp.concatenate(experts) if experts else None


def _attend(q_bthe, k_lnkse, v_lnkse, l, rows_b, pos_bt, n_blocks, block: int):
    """Softmax attention of each query over its row's cache positions 0..pos_bt of layer
    l (row i is cache row rows_b[i]; None: row i), online over `n_blocks` blocks (float32
    scores, as attention.reference_attention). A row's t queries and each kv head's group
    of query heads form one axis q, so that one token per row is the plain decode dot."""
    b, t, h, e = q_bthe.shape
    n, kh = k_lnkse.shape[1], k_lnkse.shape[2]
    g = h // kh
    q_bkqe = q_bthe.reshape(b, t, kh, g, e).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, e)
    scale = e ** -0.5

    def one(j, carry):
        m_bkq, den_bkq, acc_bkqe = carry
        start = j * block
        k_nkse = jax.lax.dynamic_slice(k_lnkse, (l, 0, 0, start, 0), (1, n, kh, block, e))[0]
        v_nkse = jax.lax.dynamic_slice(v_lnkse, (l, 0, 0, start, 0), (1, n, kh, block, e))[0]
        if rows_b is not None:  # (a block of every row, then the rows': never whole rows)
            k_nkse = jnp.take(k_nkse, rows_b, axis=0, mode="clip")
            v_nkse = jnp.take(v_nkse, rows_b, axis=0, mode="clip")
        s_bkqs = jnp.einsum("bkqe,bkse->bkqs", q_bkqe, k_nkse,
                            preferred_element_type=jnp.float32) * scale
        seen_bts = start + jnp.arange(block)[None, None, :] <= pos_bt[:, :, None]
        s_bkqs = jnp.where(seen_bts[:, None, :, None, :], s_bkqs.reshape(b, kh, t, g, block),
                           -jnp.inf).reshape(b, kh, t * g, block)
        m_new = jnp.maximum(m_bkq, jnp.max(s_bkqs, axis=-1))
        p_bkqs = jnp.exp(s_bkqs - m_new[..., None])
        fix = jnp.exp(m_bkq - m_new)
        acc_bkqe = acc_bkqe * fix[..., None] + jnp.einsum(
            "bkqs,bkse->bkqe", p_bkqs.astype(v_nkse.dtype), v_nkse,
            preferred_element_type=jnp.float32)
        return m_new, den_bkq * fix + jnp.sum(p_bkqs, axis=-1), acc_bkqe

    # Position 0 is in every row's first block, so the running max is finite after it.
    init = (jnp.full((b, kh, t * g), jnp.finfo(jnp.float32).min, jnp.float32),
            jnp.zeros((b, kh, t * g), jnp.float32), jnp.zeros((b, kh, t * g, e), jnp.float32))
    _, den_bkq, acc_bkqe = jax.lax.fori_loop(0, n_blocks, one, init)
    out_bkqe = acc_bkqe / jnp.where(den_bkq > 0, den_bkq, 1.0)[..., None]
    out_btkge = out_bkqe.reshape(b, kh, t, g, e).transpose(0, 2, 1, 3, 4)
    return out_btkge.reshape(b, t, h, e).astype(q_bthe.dtype)


def sample_rows(logits_bv, keys_b, gen_b, settings: Settings):
    """One token per row from its own key (folded with gen_b), by inverse CDF; returns
    (tokens, logp under the distribution sampled from, logp of logits / temperature, logp at
    temperature 1), as `sampler.sample_logits` does: temperature, then top-k, then top-p."""
    logp_t1_bv = jax.nn.log_softmax(logits_bv, axis=-1)
    if settings.greedy:
        return sampler_lib.greedy(logits_bv, logp_t1_bv)
    scaled_bv = logits_bv / settings.temperature
    z_bv = sampler_lib.filter_top_k_top_p(scaled_bv, settings.top_k, settings.top_p)
    logp_bv = jax.nn.log_softmax(z_bv, axis=-1)
    # Without top-k / top-p the sampled-from distribution is logits / temperature itself.
    logp_temp_bv = logp_bv if z_bv is scaled_bv else jax.nn.log_softmax(scaled_bv, axis=-1)
    u_b = jax.vmap(lambda k, g: jax.random.uniform(jax.random.fold_in(k, g)))(keys_b, gen_b)
    cdf_bv = jnp.cumsum(jnp.exp(logp_bv), axis=-1)
    # The first token whose cumulative mass reaches (1 - u) of the total: u in [0, 1), so a
    # zero-probability token is never chosen.
    target_b = (1.0 - u_b) * cdf_bv[:, -1]
    tok_b = jnp.minimum(jnp.sum(cdf_bv < target_b[:, None], axis=-1), logits_bv.shape[-1] - 1)
    logp_b = sampler_lib.take(logp_bv, tok_b)
    logp_temp_b = logp_b if logp_temp_bv is logp_bv else sampler_lib.take(logp_temp_bv, tok_b)
    return tok_b, logp_b, logp_temp_b, sampler_lib.take(logp_t1_bv, tok_b)
