"""RL losses, advantage estimators and the value loss as pure JAX functions.

The math follows verl (`verl/trainer/ppo/core_algos.py`, `verl/utils/torch_functional.py`,
`verl/trainer/ppo/rollout_corr_helper.py`, `verl/workers/reward_manager/dapo.py`, release 0.9)
so that results match it number for number, including its conventions at the edges: a
singleton group has mean 0 and std 1, whitening is Bessel-corrected with `rsqrt(var + 1e-8)`,
and the gradient at a clip boundary is the one torch gives (`torch.clamp` passes the gradient
at its bounds; `jnp.clip` passes half, so `_clamp` below is used instead). Where we differ, the
docstring says so.

Shapes: b batch (sequences), t time (response tokens), d model, v vocab. `mask_bt` is 1 on
tokens the model produced and 0 on padding and tool observations.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ptrain import sharding

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "abs", "k2", "k3", "k1+", "k3+")


def _clamp(x, lo=None, hi=None):
    """torch.clamp, gradient included: 1 where lo <= x <= hi (bounds inclusive), else 0."""
    y = jnp.clip(x, lo, hi)
    return jnp.where(y == x, x, jax.lax.stop_gradient(y))


def _sum_t(x_bt, mask_bt):
    # `where`, not a product: padding that holds inf or nan must not leak into the sums.
    return jnp.where(mask_bt > 0, x_bt, 0.0).sum(-1)


def masked_mean(x, mask, axis=None):
    """Mean of `x` over positions where `mask` is 1; 0 where the mask is empty."""
    total = jnp.where(mask > 0, x, 0.0).sum(axis)
    return total / jnp.maximum(mask.sum(axis), 1)


def masked_var(x_bt, mask_bt):
    """Bessel-corrected variance over the valid tokens (verl masked_var(unbiased=True))."""
    n = mask_bt.sum()
    mean = masked_mean(x_bt, mask_bt)
    return masked_mean((x_bt - mean) ** 2, mask_bt) * n / jnp.maximum(n - 1, 1)


def masked_whiten(x_bt, mask_bt):
    """(x - mean) * rsqrt(var + 1e-8) over the valid tokens, Bessel-corrected, 0 on padding.

    verl's `masked_whiten`. verl raises on an empty mask and returns nan for a single valid
    token; here both give zeros.
    """
    mean, var = masked_mean(x_bt, mask_bt), masked_var(x_bt, mask_bt)
    return jnp.where(mask_bt > 0, (x_bt - mean) * jax.lax.rsqrt(var + 1e-8), 0.0)


def _broadcast(adv_b, mask_bt):
    return adv_b if mask_bt is None else adv_b[:, None] * mask_bt


# ---------------------------------------------------------------------------------- advantages


def group_advantages(rewards, group_ids, *, estimator="grpo", eps=1e-6, mask_bt=None):
    """Outcome advantages relative to the other samples of the same prompt (group).

    rewards: [b] sequence scores, or [b, t] token rewards (the score is their sum).
    group_ids: [b] integers; samples of one prompt share an id, in any order.
    estimator:
      "grpo":   (r - mean_g) / (std_g + eps), std unbiased (verl compute_grpo_outcome_advantage);
      "drgrpo": r - mean_g, no std (Dr.GRPO, arXiv 2503.20783; verl norm_adv_by_std_in_grpo=False);
      "rloo":   r - mean of the other samples of the group (verl compute_rloo_outcome_advantage).
    A singleton group uses mean 0 and std 1, so GRPO gives r / (1 + eps) and RLOO gives r.
    Returns [b], or [b, t] (the advantage on every valid token) when `mask_bt` is given.
    Groups are found with a [b, b] comparison: fine for batches of thousands of samples.
    """
    r_b = jnp.asarray(rewards, jnp.float32)
    r_b = r_b.sum(-1) if r_b.ndim == 2 else r_b
    g_b = jnp.asarray(group_ids)
    same_bb = g_b[:, None] == g_b[None, :]
    n_b = same_bb.sum(-1).astype(jnp.float32)
    sum_b = jnp.where(same_bb, r_b[None, :], 0.0).sum(-1)
    alone_b = n_b == 1
    mean_b = jnp.where(alone_b, 0.0, sum_b / n_b)
    if estimator == "grpo":
        sq_b = jnp.where(same_bb, (r_b[None, :] - mean_b[:, None]) ** 2, 0.0).sum(-1)
        std_b = jnp.where(alone_b, 1.0, jnp.sqrt(sq_b / jnp.maximum(n_b - 1, 1)))
        adv_b = (r_b - mean_b) / (std_b + eps)
    elif estimator == "drgrpo":
        adv_b = r_b - mean_b
    elif estimator == "rloo":
        adv_b = jnp.where(alone_b, r_b, (n_b * r_b - sum_b) / jnp.maximum(n_b - 1, 1))
    else:
        raise ValueError(f"estimator={estimator!r}; use 'grpo', 'drgrpo' or 'rloo'")
    return _broadcast(adv_b, mask_bt)


def _reverse_scan(step, init_b, *xs_bt):
    """Runs `step(carry_b, *x_b) -> (carry_b, y_b)` from the last time step to the first."""
    xs_tb = tuple(jnp.swapaxes(x, 0, 1) for x in xs_bt)
    _, y_tb = jax.lax.scan(lambda c, x: step(c, *x), init_b, xs_tb, reverse=True)
    return jnp.swapaxes(y_tb, 0, 1)


def reinforce_pp_advantages(token_rewards_bt, mask_bt, *, gamma=1.0):
    """REINFORCE++ (arXiv 2501.03262): discounted returns, whitened over the batch's tokens.

    The return of a model token is G_t = sum_k gamma^(k - t) r_k over the model's own tokens
    k >= t (mask 1), counted in order: the tokens it did not produce (tool observations in a
    multi-turn episode, padding) are no actions, so the return passes through them unchanged,
    undiscounted, and a reward on them is not counted (the learner puts rewards on the
    model's tokens). So the final answer's reward reaches every earlier turn. On a single
    turn (a prefix mask) this is verl's compute_reinforce_plus_plus_outcome_advantage, whose
    running return restarts after the last valid token. Whitening is Bessel-corrected.
    Returns (advantages_bt, returns_bt).
    """
    r_bt = jnp.asarray(token_rewards_bt, jnp.float32)
    m_bt = jnp.asarray(mask_bt, jnp.float32)

    def step(run_b, r_b, m_b):
        run_b = jnp.where(m_b > 0, r_b + gamma * run_b, run_b)
        return run_b, run_b * m_b

    returns_bt = _reverse_scan(step, jnp.zeros(r_bt.shape[0]), r_bt, m_bt)
    return masked_whiten(returns_bt, m_bt), returns_bt


def reinforce_pp_baseline_advantages(token_rewards_bt, mask_bt, group_ids):
    """REINFORCE++-baseline: score minus its group mean on every token, then whitened.

    verl compute_reinforce_plus_plus_baseline_outcome_advantage (a singleton's mean is 0).
    """
    m_bt = jnp.asarray(mask_bt, jnp.float32)
    centred_bt = group_advantages(token_rewards_bt, group_ids, estimator="drgrpo", mask_bt=m_bt)
    return masked_whiten(centred_bt, m_bt)


def gae(token_rewards_bt, values_bt, mask_bt, *, gamma=1.0, lam=1.0):
    """Generalized advantage estimation (arXiv 1506.02438), advantages whitened.

    verl compute_gae_advantage_return: masked tokens (padding, tool observations) are skipped,
    their value and TD error do not enter the recursion. Returns (advantages_bt, returns_bt),
    returns taken before whitening. Unlike verl the advantages are 0 on masked tokens.
    """
    r_bt, v_bt = jnp.asarray(token_rewards_bt, jnp.float32), jnp.asarray(values_bt, jnp.float32)
    m_bt = jnp.asarray(mask_bt, jnp.float32)

    def step(carry, r_b, v_b, m_b):
        next_v_b, last_b = carry
        delta_b = r_b + gamma * next_v_b - v_b
        new_b = delta_b + gamma * lam * last_b
        next_v_b = v_b * m_b + (1 - m_b) * next_v_b
        last_b = new_b * m_b + (1 - m_b) * last_b
        return (next_v_b, last_b), last_b

    zeros_b = jnp.zeros(r_bt.shape[0])
    adv_bt = _reverse_scan(step, (zeros_b, zeros_b), r_bt, v_bt, m_bt)
    return masked_whiten(adv_bt, m_bt), adv_bt + v_bt


# ------------------------------------------------------------------------------- aggregation


def agg_loss(x_bt, mask_bt, mode, *, num_tokens=None, num_seqs=None, horizon=None):
    """Reduces a per-token loss to a scalar (verl agg_loss).

    token-mean:              sum of valid tokens / number of valid tokens;
    seq-mean-token-sum:      mean over sequences of the per-sequence token sum;
    seq-mean-token-mean:     mean over sequences of the per-sequence token mean;
    seq-mean-token-sum-norm: seq-mean-token-sum / horizon (a constant, default t).
    Sequences with no valid token are excluded from the seq-means. For gradient accumulation,
    pass the whole batch's `num_tokens` / `num_seqs` so that micro-batch losses add up to the
    batch loss (verl's batch_num_tokens / global_batch_size).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"agg mode {mode!r}; use one of {AGG_MODES}")
    mask_bt = jnp.asarray(mask_bt, jnp.float32)
    if mode == "token-mean":
        n = mask_bt.sum() if num_tokens is None else num_tokens
        return _sum_t(x_bt, mask_bt).sum() / jnp.maximum(n, 1)
    count_b = mask_bt.sum(-1)
    seq_b = _sum_t(x_bt, mask_bt)
    if mode == "seq-mean-token-mean":
        seq_b = seq_b / (count_b + 1e-8)
    valid_b = count_b > 0
    n = valid_b.sum() if num_seqs is None else num_seqs
    loss = jnp.where(valid_b, seq_b, 0.0).sum() / jnp.maximum(n, 1)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (mask_bt.shape[-1] if horizon is None else horizon)
    return loss


# ------------------------------------------------------------------------------ policy losses


def policy_loss(logp_bt, old_logp_bt, adv_bt, mask_bt, *, kind="ppo", clip_low=0.2,
                clip_high=0.2, dual_clip=3.0, agg=None, is_weights=None, num_tokens=None,
                num_seqs=None, horizon=None):
    """Clipped policy-gradient loss and its metrics; returns (loss, metrics).

    kind:
      "ppo":   PPO-clip with clip-higher, ratio in [1 - clip_low, 1 + clip_high]; dual-clip
               (arXiv 1912.09729) caps the loss at -A * dual_clip where A < 0 (None: off);
               the log-ratio is clamped to +-20 (verl compute_policy_loss_vanilla).
      "gspo":  sequence-level ratio exp(mean token log-ratio), carried per token with the
               token's own gradient (arXiv 2507.18071; verl compute_policy_loss_gspo); always
               aggregated seq-mean-token-mean.
      "cispo": -sg(clip(ratio)) * A * logp (arXiv 2506.13585; verl compute_policy_loss_cispo).
    agg: an AGG_MODES entry; default token-mean (seq-mean-token-mean for gspo).
    is_weights: truncated importance-sampling weights [b, t] (see `truncated_is_weights`),
      multiplied into the per-token loss before aggregation.
    Metrics: pg_clipfrac, pg_clipfrac_lower (dual-clip), ppo_kl (mean old/new log-ratio).
    """
    if kind == "gspo" and agg not in (None, "seq-mean-token-mean"):
        raise ValueError(f"gspo always aggregates seq-mean-token-mean; got agg={agg!r}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable); got {dual_clip}")
    agg = agg or ("seq-mean-token-mean" if kind == "gspo" else "token-mean")
    mask_bt = jnp.asarray(mask_bt, jnp.float32)
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    log_ratio_bt = logp_bt - old_logp_bt
    zero = jnp.zeros((), jnp.float32)
    if kind in ("ppo", "cispo"):
        log_ratio_bt = _clamp(log_ratio_bt, -20.0, 20.0)
        ratio_bt = jnp.exp(log_ratio_bt)
    if kind == "ppo":
        pg1_bt = -adv_bt * ratio_bt
        pg2_bt = -adv_bt * _clamp(ratio_bt, lo, hi)
        clipped_bt = jnp.maximum(pg1_bt, pg2_bt)
        loss_bt, clipfrac_lower = clipped_bt, zero
        if dual_clip is not None:
            pg3_bt = -adv_bt * dual_clip
            loss_bt = jnp.where(adv_bt < 0, jnp.minimum(pg3_bt, clipped_bt), clipped_bt)
            clipfrac_lower = masked_mean((clipped_bt > pg3_bt) & (adv_bt < 0), mask_bt)
        clipfrac = masked_mean(pg2_bt > pg1_bt, mask_bt)
    elif kind == "gspo":
        seq_log_ratio_b = _sum_t(log_ratio_bt, mask_bt) / jnp.maximum(mask_bt.sum(-1), 1)
        sg = jax.lax.stop_gradient
        log_seq_ratio_bt = logp_bt - sg(logp_bt) + sg(seq_log_ratio_b)[:, None]
        ratio_bt = jnp.exp(_clamp(log_seq_ratio_bt, None, 10.0))
        pg1_bt = -adv_bt * ratio_bt
        pg2_bt = -adv_bt * _clamp(ratio_bt, lo, hi)
        loss_bt = jnp.maximum(pg1_bt, pg2_bt)
        clipfrac, clipfrac_lower = masked_mean(pg2_bt > pg1_bt, mask_bt), zero
    elif kind == "cispo":
        clipped_ratio_bt = jnp.clip(ratio_bt, lo, hi)
        loss_bt = -jax.lax.stop_gradient(clipped_ratio_bt) * adv_bt * logp_bt
        clipfrac, clipfrac_lower = masked_mean(ratio_bt != clipped_ratio_bt, mask_bt), zero
    else:
        raise ValueError(f"policy loss kind={kind!r}; use 'ppo', 'gspo' or 'cispo'")
    if is_weights is not None:
        loss_bt = loss_bt * is_weights
    loss = agg_loss(loss_bt, mask_bt, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                    horizon=horizon)
    metrics = {
        "pg_clipfrac": jax.lax.stop_gradient(clipfrac),
        "pg_clipfrac_lower": jax.lax.stop_gradient(clipfrac_lower),
        "ppo_kl": jax.lax.stop_gradient(masked_mean(-log_ratio_bt, mask_bt)),
    }
    return loss, metrics


# --------------------------------------------------------------------------------- value loss


def value_loss(vpreds_bt, returns_bt, old_values_bt, mask_bt, *, clip_value=0.5,
               agg="token-mean", num_tokens=None, num_seqs=None, horizon=None):
    """PPO's clipped value loss for the critic; returns (loss, clipfrac).

    0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)) with c = clip_value
    (verl compute_value_loss; its critic's cliprange_value defaults to 0.5). The prediction
    is clipped as torch.max(torch.min(v, hi), lo), whose gradient at a bound is split in
    halves, as jnp.minimum / jnp.maximum split it. clipfrac: the fraction of valid tokens
    where the clipped term is larger. num_tokens / num_seqs / horizon as in `agg_loss`.
    """
    if not clip_value > 0:
        raise ValueError(f"clip_value must be > 0 (a large value turns clipping off); got "
                         f"{clip_value}")
    mask_bt = jnp.asarray(mask_bt, jnp.float32)
    vpreds_bt = jnp.asarray(vpreds_bt, jnp.float32)
    old_bt = jax.lax.stop_gradient(jnp.asarray(old_values_bt, jnp.float32))
    returns_bt = jax.lax.stop_gradient(jnp.asarray(returns_bt, jnp.float32))
    clipped_bt = jnp.maximum(jnp.minimum(vpreds_bt, old_bt + clip_value), old_bt - clip_value)
    vf1_bt = (vpreds_bt - returns_bt) ** 2
    vf2_bt = (clipped_bt - returns_bt) ** 2
    loss = 0.5 * agg_loss(jnp.maximum(vf1_bt, vf2_bt), mask_bt, agg, num_tokens=num_tokens,
                          num_seqs=num_seqs, horizon=horizon)
    clipfrac = masked_mean(vf2_bt > vf1_bt, mask_bt)
    return loss, jax.lax.stop_gradient(clipfrac)


def explained_variance(returns_bt, values_bt, mask_bt):
    """1 - var(R - V) / (var(R) + 1e-5) over the valid tokens, variances Bessel-corrected
    (verl's critic/vf_explained_var): 1 when the critic predicts the returns exactly."""
    mask_bt = jnp.asarray(mask_bt, jnp.float32)
    return 1.0 - (masked_var(returns_bt - values_bt, mask_bt)
                  / (masked_var(returns_bt, mask_bt) + 1e-5))


# ----------------------------------------------------------------------------------------- KL


def kl(logp_bt, ref_logp_bt, kind="k1"):
    """Per-token KL(policy || reference) estimates (http://joschu.net/blog/kl-approx.html).

    k1: logp - ref; abs: |logp - ref|; k2: (logp - ref)^2 / 2;
    k3: exp(ref - logp) - (ref - logp) - 1, its input clamped to +-20 and output to +-10;
    k1+, k3+: the value of k1 / k3 with the gradient of k2 (straight-through; verl kl_penalty).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kl kind={kind!r}; use one of {KL_KINDS}")
    diff_bt = logp_bt - ref_logp_bt
    base = kind.rstrip("+")
    if base == "k1":
        value_bt = diff_bt
    elif base == "abs":
        value_bt = diff_bt * jax.lax.stop_gradient(jnp.sign(diff_bt))  # torch.abs: gradient 0 at 0
    elif base == "k2":
        value_bt = 0.5 * diff_bt**2
    else:
        x_bt = _clamp(-diff_bt, -20.0, 20.0)
        value_bt = _clamp(jnp.exp(x_bt) - x_bt - 1.0, -10.0, 10.0)
    if not kind.endswith("+"):
        return value_bt
    k2_bt = 0.5 * diff_bt**2
    return k2_bt - jax.lax.stop_gradient(k2_bt) + jax.lax.stop_gradient(value_bt)


def kl_in_reward(token_scores_bt, logp_bt, ref_logp_bt, mask_bt, *, coef, kind="k1"):
    """Token rewards minus coef * KL (verl apply_kl_penalty); returns (rewards_bt, batch_kl).

    batch_kl, the mean over sequences of each sequence's mean token KL, is what
    `KLController.update` takes.
    """
    mask_bt = jnp.asarray(mask_bt, jnp.float32)
    kl_bt = jnp.where(mask_bt > 0, kl(logp_bt, ref_logp_bt, kind), 0.0)
    batch_kl = masked_mean(kl_bt, mask_bt, axis=-1).mean()
    return token_scores_bt - coef * kl_bt, batch_kl


@dataclasses.dataclass(frozen=True)
class KLController:
    """The KL-in-reward coefficient: fixed when `target` is None, else adaptive.

    Adaptive (Ziegler et al. 2019, arXiv 1909.08593; verl AdaptiveKLController):
    value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon. Frozen: `update`
    returns a new controller, so its `value` can go into a checkpoint.
    """

    value: float
    target: float | None = None
    horizon: float = 10000.0

    def update(self, current_kl, n_steps):
        if self.target is None:
            return self
        error = float(np.clip(float(current_kl) / self.target - 1.0, -0.2, 0.2))
        return dataclasses.replace(self, value=self.value * (1.0 + error * n_steps / self.horizon))


# ------------------------------------------------------------ importance sampling, DAPO helpers


def truncated_is_weights(logp_bt, rollout_logp_bt, mask_bt, *, level="token", cap=2.0):
    """Truncated importance-sampling weights min(pi_train / pi_rollout, cap), no gradient.

    Corrects a rollout/trainer log-prob mismatch or a stale (off-policy) batch (verl
    compute_rollout_correction_weights, TIS mode). level "token": one ratio per token;
    "sequence": the product of the sequence's token ratios on each of its tokens. Log-ratios
    are clamped to +-20 before exp; weights are 0 on masked tokens.
    """
    mask_bt = jnp.asarray(mask_bt, jnp.float32)
    log_ratio_bt = logp_bt - rollout_logp_bt
    if level == "sequence":
        log_ratio_bt = jnp.broadcast_to(_sum_t(log_ratio_bt, mask_bt)[:, None], mask_bt.shape)
    elif level != "token":
        raise ValueError(f"importance-sampling level={level!r}; use 'token' or 'sequence'")
    w_bt = jnp.exp(jnp.clip(log_ratio_bt, -20.0, 20.0)) * mask_bt
    return jax.lax.stop_gradient(jnp.minimum(w_bt, cap))


def overlong_penalty(lengths_b, *, max_len, buffer_len, penalty_factor=1.0):
    """DAPO soft overlong punishment (arXiv 2503.14476; verl DAPORewardManager).

    0 up to max_len - buffer_len tokens, then falling linearly to -penalty_factor at
    max_len. Add it to the task reward. `lengths_b` and `max_len` measure the same thing: an
    episode's tokens after its prompt (`Batch.lengths_b`: model turns and observations)
    against the cap they had (`rollout.max_len` for multi-turn episodes;
    `sampling.max_new_tokens` for a single turn). A length past max_len raises: it was
    measured against another cap (a per-turn one would punish a 72-token episode with -2.5
    against 48).
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len; got {buffer_len}, {max_len}")
    if not isinstance(lengths_b, jax.core.Tracer) and np.size(lengths_b) and \
            np.max(lengths_b) > max_len:
        raise ValueError(f"overlong_penalty: an episode of {int(np.max(lengths_b))} tokens is "
                         f"longer than max_len={max_len}; pass the cap of the whole episode "
                         "(rollout.max_len for multi-turn episodes), not a per-turn one")
    exceed_b = jnp.asarray(lengths_b, jnp.float32) - (max_len - buffer_len)
    return jnp.minimum(-exceed_b / buffer_len * penalty_factor, 0.0)


def filter_overlong(loss_mask_bt, truncated_b):
    """DAPO overlong filtering (arXiv 2503.14476, section 3.4): the loss mask with truncated
    episodes (cut at a length cap before they ended; `truncated_b` True) masked out, so an
    unfinished answer is neither rewarded nor punished for its length."""
    keep_b = 1.0 - jnp.asarray(truncated_b, jnp.float32)
    return jnp.asarray(loss_mask_bt, jnp.float32) * keep_b[:, None]


# ------------------------------------------------------------ log-probs from hidden states


def chunked_logprobs(h_btd, w_dv, tokens_bt, *, chunk=256, temperature=1.0, softcap=None,
                     return_entropy=False, mesh=None):
    """log softmax(z)[tokens] (and the entropy of softmax(z)), z = softcap(h @ w) / temperature.

    h_btd[:, i] is the hidden state that predicts tokens_bt[:, i] (shift before calling).
    Computed `chunk` time steps at a time, with a custom gradient that recomputes each
    chunk's logits, so float32 [b, t, v] exists in neither the forward nor the backward pass.
    softcap: Gemma-style c * tanh(x / c) on the logits, before the temperature.
    mesh: when time divides over its `sequence` axis (> 1), each sequence shard computes its
    own tokens (a shard_map; w_dv is gathered whole, as FSDP gathers every weight, and its
    gradient summed back), so the time-sharded hidden states never move. A scan over a
    sharded time axis would otherwise make XLA gather them (gigabytes at 1M tokens).
    Returns float32 logp_bt, or (logp_bt, entropy_bt) with return_entropy.
    """
    fn = functools.partial(_chunked_local, chunk=chunk, temperature=float(temperature),
                           softcap=softcap, return_entropy=bool(return_entropy))
    spec_btd = None if mesh is None else sharding.spec(("batch", "seq", None), h_btd.shape, mesh)
    if spec_btd is None or spec_btd[1] is None:
        return fn(h_btd, w_dv, tokens_bt)
    spec_bt = P(*spec_btd[:2])
    varying = tuple(a for e in spec_bt if e is not None
                    for a in ((e,) if isinstance(e, str) else e))

    def local(h_btd, w_dv, tokens_bt):
        # Varying like h, so the custom gradient's per-shard dW is psummed on the way out.
        return fn(h_btd, jax.lax.pcast(w_dv, varying, to="varying"), tokens_bt)

    out_specs = (spec_bt, spec_bt) if return_entropy else spec_bt
    return jax.shard_map(local, mesh=mesh, in_specs=(spec_btd, P(), spec_bt),
                         out_specs=out_specs)(h_btd, w_dv, tokens_bt)


def _chunked_local(h_btd, w_dv, tokens_bt, *, chunk, temperature, softcap, return_entropy):
    b, t, d = h_btd.shape
    c = max(1, min(chunk, t))
    n = -(-t // c)
    pad = n * c - t
    h_nbcd = jnp.pad(h_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, d).swapaxes(0, 1)
    tok_nbc = jnp.pad(tokens_bt, ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)
    logp_nbc, ent_nbc = _chunked(temperature, softcap, return_entropy, h_nbcd, w_dv, tok_nbc)
    logp_bt = logp_nbc.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    if not return_entropy:
        return logp_bt
    return logp_bt, ent_nbc.swapaxes(0, 1).reshape(b, n * c)[:, :t]


def _chunk_logits(h_bcd, w_dv, temperature, softcap):
    """Returns (z, s): z the scaled float32 logits, s the soft-capped ones (for the gradient)."""
    s = jnp.einsum("bcd,dv->bcv", h_bcd, w_dv, preferred_element_type=jnp.float32)
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    return s / temperature, s


def _chunk_stats(z_bcv, tok_bc):
    lse_bc = jax.nn.logsumexp(z_bcv, axis=-1)
    p_bcv = jnp.exp(z_bcv - lse_bc[..., None])
    logp_bc = jnp.take_along_axis(z_bcv, tok_bc[..., None], axis=-1)[..., 0] - lse_bc
    mean_z_bc = (p_bcv * z_bcv).sum(-1)
    return logp_bc, lse_bc - mean_z_bc, p_bcv, mean_z_bc


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunked(temperature, softcap, with_entropy, h_nbcd, w_dv, tok_nbc):
    def one(args):
        h_bcd, tok_bc = args
        z_bcv, _ = _chunk_logits(h_bcd, w_dv, temperature, softcap)
        logp_bc, ent_bc, _, _ = _chunk_stats(z_bcv, tok_bc)
        return logp_bc, ent_bc

    return jax.lax.map(one, (h_nbcd, tok_nbc))


def _chunked_fwd(temperature, softcap, with_entropy, h_nbcd, w_dv, tok_nbc):
    out = _chunked(temperature, softcap, with_entropy, h_nbcd, w_dv, tok_nbc)
    return out, (h_nbcd, w_dv, tok_nbc)


def _chunked_bwd(temperature, softcap, with_entropy, res, g):
    h_nbcd, w_dv, tok_nbc = res
    g_logp_nbc, g_ent_nbc = g

    def step(dw_dv, xs):
        h_bcd, tok_bc, gl_bc, ge_bc = xs
        z_bcv, s_bcv = _chunk_logits(h_bcd, w_dv, temperature, softcap)
        _, _, p_bcv, mean_z_bc = _chunk_stats(z_bcv, tok_bc)
        onehot_bcv = jnp.arange(z_bcv.shape[-1]) == tok_bc[..., None]
        dz_bcv = gl_bc[..., None] * (onehot_bcv - p_bcv)
        if with_entropy:  # dH/dz = -p * (z - E_p[z])
            dz_bcv = dz_bcv - ge_bc[..., None] * p_bcv * (z_bcv - mean_z_bc[..., None])
        ds_bcv = dz_bcv / temperature
        if softcap is not None:
            ds_bcv = ds_bcv * (1.0 - (s_bcv / softcap) ** 2)
        ds_bcv = ds_bcv.astype(w_dv.dtype)
        dh_bcd = jnp.einsum("bcv,dv->bcd", ds_bcv, w_dv, preferred_element_type=jnp.float32)
        dw_dv = dw_dv + jnp.einsum("bcd,bcv->dv", h_bcd, ds_bcv,
                                   preferred_element_type=jnp.float32)
        return dw_dv, dh_bcd.astype(h_bcd.dtype)

    dw0 = jnp.zeros_like(w_dv, jnp.float32)  # varying like w inside a shard_map
    dw_dv, dh_nbcd = jax.lax.scan(step, dw0, (h_nbcd, tok_nbc, g_logp_nbc, g_ent_nbc))
    return dh_nbcd, dw_dv.astype(w_dv.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
