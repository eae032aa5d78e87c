"""Recorded MoE routing on the host: what the sampler routed each token of an episode to, in
the batch's columns, for router replay (rl.router_replay) and the agreement metrics.

A batch carries it as `Batch.prompt_experts_bplk` (each row's prompt, left-padded like
`prompt_bp`) and `Batch.experts_bnlk` (each continuation token), int [.., MoE layers, k].
`UNRECORDED` (-1) marks a token whose experts no sampler forward chose: left padding, and in a
multi-turn episode the observation tokens after its last model turn (no forward of the
sampler ever consumed them). Replay routes such a token to the learner's own top-k
(`moe.route`) and the agreement metrics leave it out; `check_replay` refuses a batch where a
token that a trained log-prob depends on is unrecorded.

Multi-turn episodes (`rollout.Tasks`): every model turn is one sampler call over the
episode's history, whose prefill routes the history (`Samples.prompt_experts`) and whose
decode routes each sampled token (`Samples.experts`). A token is recorded once, by the first
forward that consumed it: the prompt by the first turn's prefill, a model turn's tokens by the
decode steps that sampled them, an observation by the next turn's prefill (`record`). Later
prefills route earlier tokens again; with the same parameters they choose the same experts up
to near-ties of float rounding (what an engine that keeps the KV cache would reuse is the
first routing, which is the one kept).
"""

from __future__ import annotations

import numpy as np

UNRECORDED = -1
COLUMNS = ("experts_bnlk", "prompt_experts_bplk")


def record(chunks: list, samples, row: int, history_len: int, n_new: int) -> None:
    """Appends to `chunks` (an episode's recorded routing, [tokens, MoE layers, k] pieces
    that cover its first tokens) what sampler call `samples` routed for row `row`: the
    history tokens not recorded yet (from the call's prefill; the history had `history_len`
    tokens) and the `n_new` sampled tokens kept."""
    if samples.experts is None:
        return
    prompt_plk = samples.prompt_experts[samples.prompt_index[row]]
    done = sum(len(c) for c in chunks)
    if not 0 <= done <= history_len <= prompt_plk.shape[0]:
        raise ValueError(f"routing: {done} tokens recorded of a {history_len}-token history "
                         f"whose prefill routed {prompt_plk.shape[0]} positions")
    chunks.append(prompt_plk[prompt_plk.shape[0] - history_len + done:])
    chunks.append(samples.experts[row, :n_new])


def pack(batch, episodes) -> None:
    """Sets `batch`'s routing columns (laid out like its prompt_bp / tokens_bn) from each
    row's recorded pieces: `episodes` holds (pieces, history length, prompt length) per row,
    pieces as `record` leaves them. Nothing is set when no row recorded any."""
    pieces = [c for chunks, _, _ in episodes for c in chunks]
    if not pieces:
        return
    b, p = batch.prompt_bp.shape
    n = batch.tokens_bn.shape[1]
    shape = pieces[0].shape[1:]
    prompt = np.full((b, p, *shape), UNRECORDED, np.int16)
    tokens = np.full((b, n, *shape), UNRECORDED, np.int16)
    for i, (chunks, length, pl) in enumerate(episodes):
        h = np.full((length, *shape), UNRECORDED, np.int16)
        if chunks:
            recorded = np.concatenate(chunks)[:length]
            h[:len(recorded)] = recorded
        prompt[i, p - pl:] = h[:pl]
        tokens[i, :length - pl] = h[pl:]
    batch.prompt_experts_bplk, batch.experts_bnlk = prompt, tokens


def concat(parts, n: int) -> dict:
    """The routing columns of several batches' rows in one (continuations widened to `n`
    columns, `mixed_producer.concat`): {} when no part recorded any; a part without routing
    (a producer that does not record it) is UNRECORDED throughout."""
    have = [e for e in parts if e.experts_bnlk is not None]
    if not have:
        return {}
    shape = have[0].experts_bnlk.shape[2:]
    prompt, tokens = [], []
    for e in parts:
        b, p = e.prompt_bp.shape
        if e.experts_bnlk is None:
            prompt.append(np.full((b, p, *shape), UNRECORDED, np.int16))
            tokens.append(np.full((b, n, *shape), UNRECORDED, np.int16))
            continue
        widen = n - e.experts_bnlk.shape[1]
        prompt.append(e.prompt_experts_bplk.astype(np.int16))
        tokens.append(np.pad(e.experts_bnlk.astype(np.int16),
                             ((0, 0), (0, widen), (0, 0), (0, 0)),
                             constant_values=UNRECORDED))
    return {"prompt_experts_bplk": np.concatenate(prompt),
            "experts_bnlk": np.concatenate(tokens)}


def check_replay(batch) -> None:
    """With rl.router_replay: every token a trained log-prob depends on (each row's prompt
    and its continuation up to its last trained token) must have recorded experts."""
    if batch.experts_bnlk is None or batch.prompt_experts_bplk is None:
        raise ValueError("rl.router_replay: the batch carries no recorded routing "
                         "(Batch.experts_bnlk, prompt_experts_bplk); its producer does not "
                         "record the sampler's (the single-turn, multi-turn and mixed "
                         "producers and the engine do), or set "
                         "rl.router_replay=False")
    b, p = batch.prompt_bp.shape
    n = batch.tokens_bn.shape[1]
    mask_bn = batch.loss_mask_bn > 0
    last_b = np.where(mask_bn.any(1), n - 1 - np.argmax(mask_bn[:, ::-1], axis=1), -1)
    needed_bn = np.arange(n)[None, :] <= last_b[:, None]
    needed_bp = (np.arange(p)[None, :] >= p - batch.prompt_lens_b[:, None]) & (
        last_b[:, None] >= 0)
    missing_b = ((batch.experts_bnlk[:, :, 0, 0] < 0) & needed_bn).any(1) | (
        (batch.prompt_experts_bplk[:, :, 0, 0] < 0) & needed_bp).any(1)
    if missing_b.any():
        rows = np.flatnonzero(missing_b)
        domains = sorted({str(batch.meta[i].get("domain", "?")) for i in rows
                          if i < len(batch.meta)})
        raise ValueError(f"rl.router_replay: {len(rows)} rows (first {rows[:5].tolist()}, "
                         f"domains {domains}) train on tokens without recorded routing; "
                         "their producer does not record the sampler's; set "
                         "rl.router_replay=False or train without it")
