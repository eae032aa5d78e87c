"""ptrain.losses against the published formulas, computed by hand in numpy float64.

Gradients at ties follow the torch convention verl inherits: a clamp passes the gradient at
its bounds, and max/min of two equal values splits it in halves.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ptrain import batch as batch_lib
from ptrain import losses

RTOL, ATOL = 2e-5, 1e-6


def close(actual, expected, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------- advantages

# Groups in shuffled order: 3 (three samples), 7 (two), 9 (a singleton), 5 (all equal).
GROUPS = np.array([3, 7, 3, 9, 5, 3, 5, 7, 5, 5])
REWARDS = np.array([1.0, 0.0, 0.0, 0.7, 0.5, 1.0, 0.5, 2.0, 0.5, 0.5])


def ref_group(rewards, groups, estimator, eps=1e-6):
    out = np.zeros(len(rewards))
    for g in set(groups.tolist()):
        idx = np.flatnonzero(groups == g)
        r, n = rewards[idx], len(idx)
        if estimator == "grpo":
            mean, std = (0.0, 1.0) if n == 1 else (r.mean(), r.std(ddof=1))
            out[idx] = (r - mean) / (std + eps)
        elif estimator == "drgrpo":
            out[idx] = r - (0.0 if n == 1 else r.mean())
        else:  # rloo: minus the mean of the *other* samples
            out[idx] = r if n == 1 else [r[i] - np.delete(r, i).mean() for i in range(n)]
    return out


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_group_advantages(estimator):
    expected = ref_group(REWARDS, GROUPS, estimator)
    close(losses.group_advantages(REWARDS, GROUPS, estimator=estimator), expected)
    # All-equal group -> 0; a singleton keeps its reward (GRPO: over 1 + eps).
    assert np.all(expected[GROUPS == 5] == 0) and abs(expected[3] - 0.7) < 1e-5
    # [b, t] token rewards: the score is their sum; with a mask, broadcast onto valid tokens.
    tok = np.zeros((10, 4))
    tok[:, 0], tok[:, 3] = REWARDS - 0.25, 0.25
    mask = (np.arange(4)[None] < np.arange(10)[:, None] % 4 + 1).astype(np.float32)
    out = losses.group_advantages(tok, GROUPS, estimator=estimator, mask_bt=mask)
    close(out, expected[:, None] * mask)


def test_group_advantages_rejects_unknown():
    with pytest.raises(ValueError, match="estimator"):
        losses.group_advantages(REWARDS, GROUPS, estimator="ppo")


TOK_R = np.array([[0.0, 0.5, 0.0, 1.0, 0.0], [0.2, 0.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 3.0]])
MASK = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.float32)


def ref_whiten(x, mask):
    v = x[mask > 0]
    return np.where(mask > 0, (x - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8), 0.0)


def test_reinforce_pp():
    gamma = 0.9
    ret = np.zeros_like(TOK_R)
    for i in range(3):
        n = int(MASK[i].sum())  # rewards after the last valid token never flow back
        for t in range(n):
            ret[i, t] = sum(gamma ** (k - t) * TOK_R[i, k] for k in range(t, n))
    adv, returns = losses.reinforce_pp_advantages(TOK_R, MASK, gamma=gamma)
    close(np.asarray(returns) * MASK, ret)
    close(adv, ref_whiten(ret, MASK))


def ref_returns_over_actions(rewards, mask, gamma):
    """The published return G_t = sum_{k >= t} gamma^(k - t) r_k on the sequence of the model's
    own tokens (the mask's 1s, in order), scattered back; 0 elsewhere."""
    out = np.zeros_like(rewards)
    for i in range(len(rewards)):
        idx = np.flatnonzero(mask[i])
        r = rewards[i, idx]
        out[i, idx] = [sum(gamma ** (k - j) * r[k] for k in range(j, len(r)))
                       for j in range(len(r))]
    return out


def test_reinforce_pp_multi_turn_returns_pass_through_observations():
    gamma = 0.9
    # Two episodes of turns separated by tool observations (0s), then padding; the final
    # reward sits on the last model token, a per-token reward (KL in the reward) elsewhere.
    mask = np.array([[1, 1, 0, 0, 0, 1, 1, 0, 1, 0, 0],
                     [1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1]], np.float32)
    rewards = np.zeros(mask.shape)
    rewards[0, 8], rewards[1, 10] = 1.0, -2.0
    rewards[0, 1], rewards[1, 4] = -0.1, 0.3
    rewards[0, 3] = 5.0  # on an observation token: not the model's, not counted
    adv, returns = losses.reinforce_pp_advantages(rewards, mask, gamma=gamma)
    expected = ref_returns_over_actions(rewards, mask, gamma)
    close(returns, expected)
    close(adv, ref_whiten(expected, mask))
    # The first turn gets the final reward, discounted by the model tokens after it only.
    close(returns[0, 0], -0.1 * gamma + gamma ** 4 * 1.0)
    assert np.all(np.asarray(returns)[mask == 0] == 0)


def test_reinforce_pp_baseline():
    groups = np.array([0, 0, 1])  # the last sequence is a singleton: baseline 0
    score = TOK_R.sum(-1)
    centred = score - np.array([score[:2].mean(), score[:2].mean(), 0.0])
    expected = ref_whiten(centred[:, None] * MASK, MASK)
    close(losses.reinforce_pp_baseline_advantages(TOK_R, MASK, groups), expected)


def ref_gae(rewards, values, mask, gamma, lam):
    """Direct sums over the valid tokens only (masked tokens are skipped)."""
    adv = np.zeros_like(rewards)
    for i in range(len(rewards)):
        idx = np.flatnonzero(mask[i])
        r, v = rewards[i, idx], np.append(values[i, idx], 0.0)
        delta = r + gamma * v[1:] - v[:-1]
        for j in range(len(idx)):
            adv[i, idx[j]] = sum((gamma * lam) ** (k - j) * delta[k] for k in range(j, len(idx)))
    return adv


def test_gae_with_observation_tokens():
    values = np.array([[0.1, 0.4, -0.2, 0.3, 9.0], [0.0, 0.5, 0.2, 9.0, 9.0],
                       [1.0, 0.2, 0.3, 0.1, 0.6]])
    mask = MASK.copy()
    mask[2, 2] = 0  # a tool observation in the middle of the third sequence
    adv_raw = ref_gae(TOK_R, values, mask, 0.95, 0.9)
    adv, returns = losses.gae(TOK_R, values, mask, gamma=0.95, lam=0.9)
    close(adv, ref_whiten(adv_raw, mask))
    close(np.asarray(returns) * mask, (adv_raw + values) * mask)


def test_whiten_single_token_and_empty_mask_give_zeros():
    x = jnp.array([[3.0, 4.0]])
    assert np.all(np.asarray(losses.masked_whiten(x, jnp.array([[1.0, 0.0]]))) == 0)
    assert np.all(np.asarray(losses.masked_whiten(x, jnp.zeros((1, 2)))) == 0)


# ------------------------------------------------------------------------------- aggregation

X = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, -1.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
XMASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], np.float32)  # last row empty


def ref_agg(x, m, mode, horizon=None):
    rows = [i for i in range(len(x)) if m[i].sum() > 0]
    if mode == "token-mean":
        return (x * m).sum() / m.sum()
    if mode == "seq-mean-token-mean":
        return np.mean([(x[i] * m[i]).sum() / m[i].sum() for i in rows])
    seq = np.mean([(x[i] * m[i]).sum() for i in rows])
    return seq if mode == "seq-mean-token-sum" else seq / (horizon or x.shape[1])


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_agg_loss_values_and_gradients(mode):
    close(losses.agg_loss(X, XMASK, mode), ref_agg(X, XMASK, mode))
    # The aggregation is linear; its gradient is each token's weight.
    eye = np.eye(X.size).reshape(X.size, *X.shape)
    weights = np.array([ref_agg(e, XMASK, mode) for e in eye]).reshape(X.shape)
    close(jax.grad(lambda x: losses.agg_loss(x, XMASK, mode))(jnp.asarray(X, jnp.float32)), weights)
    assert np.all(weights[2] == 0)


def test_agg_loss_global_denominators_and_horizon():
    close(losses.agg_loss(X, XMASK, "token-mean", num_tokens=10), (X * XMASK).sum() / 10)
    close(losses.agg_loss(X, XMASK, "seq-mean-token-sum", num_seqs=4), 10.0 / 4)
    close(losses.agg_loss(X, XMASK, "seq-mean-token-sum-norm", horizon=8), 5.0 / 8)
    with pytest.raises(ValueError, match="agg mode"):
        losses.agg_loss(X, XMASK, "sum")


# ------------------------------------------------------------------------------ policy losses

CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def f32_exp(x):
    return float(jnp.exp(jnp.float32(x)))


def ppo_case():
    """Tokens that hit every branch, including exact ties on all three bounds."""
    r_hi, r_lo, r_dual = f32_exp(0.25), f32_exp(-0.25), f32_exp(1.1)
    log_r = np.array([[0.0, 0.1, 0.5, -0.5, np.log(r_hi), np.log(r_lo)],
                      [0.5, -0.5, 1.1, 1.5, 0.1, 25.0],
                      [0.3, 0.3, 0.3, 0.3, 0.3, 0.3]], np.float32)
    adv = np.array([[1.0, 1.0, 1.0, 1.0, 1.0, -1.0],
                    [-1.0, -2.0, -1.0, -1.0, -1.0, 0.5],
                    [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]], np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]], np.float32)
    old = np.linspace(-3.0, -0.5, 18).reshape(3, 6).astype(np.float32)
    # Exact ties: ratio == 1 + clip_high, 1 - clip_low and the dual-clip constant.
    clip_high, clip_low, dual = r_hi - 1.0, 1.0 - r_lo, r_dual
    log_r[0, 4], log_r[0, 5], log_r[1, 2] = 0.25, -0.25, 1.1
    return (old + log_r).astype(np.float32), old, adv, mask, clip_low, clip_high, dual


def split(a, b, da, db, pick_max):
    """d max(a, b) (or min) with torch's tie rule: half to each side."""
    tie = np.isclose(a, b, rtol=1e-6, atol=0)
    first = (a > b) if pick_max else (a < b)
    return np.where(tie, (da + db) / 2, np.where(first, da, db))


def ref_ppo_tokens(logp, old, adv, lo, hi, dual):
    r = np.exp(np.clip(logp.astype(np.float64) - old, -20, 20))
    inside = (np.isclose(r, lo, rtol=1e-6, atol=0) | (r >= lo)) & \
             (np.isclose(r, hi, rtol=1e-6, atol=0) | (r <= hi))
    inside &= np.abs(logp.astype(np.float64) - old) <= 20
    pg1, pg2 = -adv * r, -adv * np.clip(r, lo, hi)
    d1, d2 = -adv * r * (np.abs(logp - old) <= 20), np.where(inside, -adv * r, 0.0)
    clipped, d_clipped = np.maximum(pg1, pg2), split(pg1, pg2, d1, d2, True)
    pg3 = -adv * dual
    loss = np.where(adv < 0, np.minimum(pg3, clipped), clipped)
    grad = np.where(adv < 0, split(clipped, pg3, d_clipped, 0.0, False), d_clipped)
    return loss, grad, r


def test_ppo_clip_higher_dual_clip_and_boundaries():
    logp, old, adv, mask, clip_low, clip_high, dual = ppo_case()
    loss_tok, grad_tok, r = ref_ppo_tokens(logp, old, adv, 1 - clip_low, 1 + clip_high, dual)
    n = mask.sum()
    fn = lambda lp: losses.policy_loss(lp, old, adv, mask, kind="ppo", clip_low=clip_low,
                                       clip_high=clip_high, dual_clip=dual)
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logp))
    close(loss, (loss_tok * mask).sum() / n)
    close(grad, grad_tok * mask / n)
    # The boundary tokens got the unclipped gradient (torch.clamp passes it at the bound),
    # and the dual-clip tie half of it.
    close(grad[0, 4], -r[0, 4] / n)
    close(grad[1, 2], 0.5 * r[1, 2] / n)
    pg1, pg2 = -adv * r, -adv * np.clip(r, 1 - clip_low, 1 + clip_high)
    close(metrics["pg_clipfrac"], ((pg2 > pg1 + 1e-7) * mask).sum() / n)
    close(metrics["pg_clipfrac_lower"], ((np.maximum(pg1, pg2) > -adv * dual + 1e-6)
                                          & (adv < 0) & (mask > 0)).sum() / n)
    close(metrics["ppo_kl"], (-(np.clip(logp - old, -20, 20)) * mask).sum() / n, rtol=1e-4)


def test_ppo_dual_clip_only_where_advantage_negative():
    logp = jnp.log(jnp.array([[5.0, 5.0]]))  # ratio 5 over an old log-prob of 0
    old, mask = jnp.zeros((1, 2)), jnp.ones((1, 2))
    adv = jnp.array([[-1.0, 1.0]])
    loss_fn = lambda lp, dc: losses.policy_loss(lp, old, adv, mask, dual_clip=dc)[0]
    # A<0: max(-A r, -A clip(r)) = 5 capped at -A c = 3; A>0: max(-5, -1.2) = -1.2 untouched.
    close(loss_fn(logp, 3.0), (3.0 - 1.2) / 2)
    close(loss_fn(logp, None), (5.0 - 1.2) / 2)
    with pytest.raises(ValueError, match="dual_clip"):
        loss_fn(logp, 1.0)


def test_ppo_is_weights_and_aggregation():
    logp, old, adv, mask, clip_low, clip_high, dual = ppo_case()
    loss_tok, grad_tok, _ = ref_ppo_tokens(logp, old, adv, 1 - clip_low, 1 + clip_high, dual)
    w = np.linspace(0.5, 2.0, 18).reshape(3, 6).astype(np.float32)
    for agg in losses.AGG_MODES:
        fn = lambda lp: losses.policy_loss(lp, old, adv, mask, clip_low=clip_low,
                                           clip_high=clip_high, dual_clip=dual, agg=agg,
                                           is_weights=w)[0]
        close(fn(logp), ref_agg(loss_tok * w, mask, agg))
        eye = np.eye(logp.size).reshape(logp.size, *logp.shape)
        weights = np.array([ref_agg(e, mask, agg) for e in eye]).reshape(logp.shape)
        close(jax.grad(fn)(jnp.asarray(logp)), grad_tok * w * weights)


def test_gspo_sequence_ratio():
    old = np.array([[-1.0, -2.0, -0.5, -1.5], [-0.3, -0.7, -1.1, -2.0],
                    [-1.0, -1.0, -1.0, -1.0]], np.float32)
    delta = np.array([[0.1, -0.05, 0.02, 9.0], [0.6, 0.4, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    logp = (old + delta).astype(np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], np.float32)
    adv = np.array([[1.5] * 4, [-0.8] * 4, [1.0] * 4], np.float32)
    s = np.exp([(delta[i] * mask[i]).sum() / max(mask[i].sum(), 1) for i in range(3)])[:, None]
    lo, hi = 0.9997, 1.0004  # GSPO's ratio clip is tight
    pg1, pg2 = -adv * s, -adv * np.clip(s, lo, hi)
    inside = (s >= lo) & (s <= hi)
    tok = np.maximum(pg1, pg2)
    grad_tok = split(pg1, pg2, -adv * s, np.where(inside, -adv * s, 0.0), True)
    fn = lambda lp: losses.policy_loss(lp, old, adv, mask, kind="gspo", clip_low=1 - lo,
                                       clip_high=hi - 1)
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logp))
    rows = [0, 1]
    close(loss, np.mean([(tok[i] * mask[i]).sum() / mask[i].sum() for i in rows]))
    close(grad, np.stack([grad_tok[i] * mask[i] / max(mask[i].sum(), 1) / 2 for i in range(3)]))
    close(metrics["pg_clipfrac"], ((pg2 > pg1) * mask).sum() / mask.sum())
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        losses.policy_loss(logp, old, adv, mask, kind="gspo", agg="token-mean")


def test_cispo():
    logp, old, adv, mask, clip_low, clip_high, _ = ppo_case()
    r = np.exp(np.clip(logp.astype(np.float64) - old, -20, 20))
    cr = np.clip(r, 1 - clip_low, 1 + clip_high)
    n = mask.sum()
    fn = lambda lp: losses.policy_loss(lp, old, adv, mask, kind="cispo", clip_low=clip_low,
                                       clip_high=clip_high)
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(logp))
    close(loss, (-cr * adv * logp * mask).sum() / n)
    close(grad, -cr * adv * mask / n)  # the clipped ratio carries no gradient
    close(metrics["pg_clipfrac"], ((np.abs(r - cr) > 1e-6) * mask).sum() / n)


# --------------------------------------------------------------------------------- value loss

CLIP_V = 0.5


def value_case():
    """Predictions inside the clip range, beyond it on either side with the return on either
    side (so either term can be the larger), exactly on both bounds, a masked token holding
    garbage and a fully masked row. Bounds are exact in float32 (old values are quarters)."""
    old = np.array([[0.25, 0.25, 0.25, 0.25, -1.0, 0.0],
                    [1.0, 1.0, -0.5, -0.5, 0.25, 2.0],
                    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    v = np.array([[0.5, 1.5, 1.5, 0.75, -1.5, 7.0],  # in, out (R above), out (R below), ties
                  [-0.2, 0.1, -2.0, 0.7, 0.0, 1e3],  # below lo (R above, below), in, ...
                  [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]], np.float32)
    ret = np.array([[0.4, 3.0, -1.0, 2.0, 0.0, 0.0],
                    [2.0, -1.0, -0.3, -0.4, 0.2, 0.0],
                    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]], np.float32)
    return v, ret, old, mask


def ref_value_tokens(v, ret, old, c):
    """Per-token max(vf1, vf2) and its derivative in v, float64 (torch tie rules)."""
    v, ret, old = (np.asarray(x, np.float64) for x in (v, ret, old))
    lo, hi = old - c, old + c
    vc = np.maximum(np.minimum(v, hi), lo)
    on_bound = np.isclose(v, hi, rtol=0, atol=1e-7) | np.isclose(v, lo, rtol=0, atol=1e-7)
    dvc = np.where(on_bound, 0.5, np.where((v > lo) & (v < hi), 1.0, 0.0))
    vf1, vf2 = (v - ret) ** 2, (vc - ret) ** 2
    return np.maximum(vf1, vf2), split(vf1, vf2, 2 * (v - ret), 2 * (vc - ret) * dvc, True), \
        vf1, vf2


@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_value_loss_clipped_and_unclipped(agg):
    v, ret, old, mask = value_case()
    tok, grad_tok, vf1, vf2 = ref_value_tokens(v, ret, old, CLIP_V)
    valid = mask > 0
    # The case covers both regions: clipped term larger on some valid tokens, not on others.
    assert (vf2 > vf1)[valid].any() and (vf2 < vf1)[valid].any()
    fn = lambda x: losses.value_loss(x, ret, old, mask, clip_value=CLIP_V, agg=agg)
    (loss, clipfrac), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(v))
    tok, grad_tok = np.where(valid, tok, 0.0), np.where(valid, grad_tok, 0.0)
    close(loss, 0.5 * ref_agg(tok, mask, agg))
    eye = np.eye(v.size).reshape(v.size, *v.shape)
    weights = np.array([ref_agg(e, mask, agg) for e in eye]).reshape(v.shape)
    close(grad, 0.5 * grad_tok * weights)
    close(clipfrac, ((vf2 > vf1) & valid).sum() / valid.sum())
    # On the bounds the clip passes half the gradient and the tied max splits it again.
    if agg == "token-mean":
        n = mask.sum()
        close(grad[0, 3], 0.5 * (0.5 * 2 * (0.75 - 2.0) + 0.5 * 0.5 * 2 * (0.75 - 2.0)) / n)
        close(grad[0, 1], 0.0)  # clipped term wins: no gradient to the prediction


def test_value_loss_global_denominators_and_bad_clip():
    v, ret, old, mask = value_case()
    tok = np.where(mask > 0, ref_value_tokens(v, ret, old, CLIP_V)[0], 0.0)
    loss, _ = losses.value_loss(v, ret, old, mask, clip_value=CLIP_V, num_tokens=20)
    close(loss, 0.5 * tok.sum() / 20)
    # A clip wide enough never binds: the plain squared error.
    loss, clipfrac = losses.value_loss(v, ret, old, mask, clip_value=1e6)
    close(loss, 0.5 * ((v - ret) ** 2 * mask).sum() / mask.sum())
    assert float(clipfrac) == 0.0
    with pytest.raises(ValueError, match="clip_value must be > 0"):
        losses.value_loss(v, ret, old, mask, clip_value=0.0)


def test_explained_variance():
    rng = np.random.default_rng(4)
    ret, val = rng.normal(size=(2, 3, 5))
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], np.float32)
    r, d = ret[mask > 0], (ret - val)[mask > 0]
    close(losses.explained_variance(ret, val, mask),
          1 - d.var(ddof=1) / (r.var(ddof=1) + 1e-5))
    close(losses.explained_variance(ret, ret, mask), 1.0)


# ----------------------------------------------------------------------------------------- KL


@pytest.mark.parametrize("kind", losses.KL_KINDS)
def test_kl_estimators(kind):
    ref = np.array([[-1.0, -2.0, -0.5, -30.0, -1.0]], np.float32)
    logp = np.array([[-1.2, -1.0, -0.5, -1.0, -4.0]], np.float32)  # ref - logp: .2 -1 0 -29 3
    d = logp.astype(np.float64) - ref
    x = np.clip(-d, -20, 20)
    k3 = np.clip(np.exp(x) - x - 1, -10, 10)
    k3_grad = np.where((np.abs(d) <= 20) & (np.abs(np.exp(x) - x - 1) <= 10), 1 - np.exp(x), 0.0)
    table = {"k1": (d, np.ones_like(d)), "abs": (np.abs(d), np.sign(d)), "k2": (d**2 / 2, d),
             "k3": (k3, k3_grad), "k1+": (d, d), "k3+": (k3, d)}
    value, grad = table[kind]
    close(losses.kl(logp, ref, kind), value, rtol=1e-5)
    close(jax.grad(lambda lp: losses.kl(lp, ref, kind).sum())(jnp.asarray(logp)), grad,
          rtol=1e-5)
    assert value[0, 3] == (10.0 if kind.startswith("k3") else value[0, 3])


def test_kl_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kl kind"):
        losses.kl(jnp.zeros(2), jnp.zeros(2), "k4")


def test_kl_in_reward_and_controllers():
    scores = np.array([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]], np.float32)
    logp = np.array([[-1.0, -0.5, -0.2, -9.0], [-0.3, -0.1, -7.0, -7.0]], np.float32)
    ref = np.array([[-1.5, -0.5, -0.1, -1.0], [-0.2, -0.4, -1.0, -1.0]], np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
    kl_tok = (logp - ref) * mask
    rewards, batch_kl = losses.kl_in_reward(scores, logp, ref, mask, coef=0.1)
    close(rewards, scores - 0.1 * kl_tok)
    close(batch_kl, np.mean([kl_tok[i].sum() / mask[i].sum() for i in range(2)]))

    fixed = losses.KLController(0.05)
    assert fixed.update(1.0, 64).value == 0.05
    ctl = losses.KLController(0.1, target=0.02, horizon=1000)
    close(ctl.update(0.021, 64).value, 0.1 * (1 + 0.05 * 64 / 1000))
    close(ctl.update(0.5, 64).value, 0.1 * (1 + 0.2 * 64 / 1000))  # error clipped at +0.2
    close(ctl.update(0.0, 64).value, 0.1 * (1 - 0.2 * 64 / 1000))  # and at -0.2


# ------------------------------------------------------------ importance sampling, DAPO helpers


def test_truncated_is_weights():
    logp = np.array([[-1.0, -0.5, -2.0], [-0.1, -0.2, -0.3]], np.float32)
    rollout = np.array([[-1.5, -0.5, -1.0], [-0.4, -0.1, -5.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    d = logp.astype(np.float64) - rollout
    close(losses.truncated_is_weights(logp, rollout, mask, cap=1.5),
          np.minimum(np.exp(d), 1.5) * mask)
    seq = np.exp((d * mask).sum(-1, keepdims=True))  # row 0: e^-0.5, row 1: e^0.2
    close(losses.truncated_is_weights(logp, rollout, mask, level="sequence", cap=1.1),
          np.minimum(seq, 1.1) * mask)
    grad = jax.grad(lambda lp: losses.truncated_is_weights(lp, rollout, mask).sum())(logp)
    assert np.all(np.asarray(grad) == 0)


def test_overlong_penalty():
    lengths = np.array([10, 12, 14, 16])
    expected = [0.0, 0.0, -0.5 * 2 / 4, -0.5]  # max 16, buffer 4: linear from 12 to 16
    close(losses.overlong_penalty(lengths, max_len=16, buffer_len=4, penalty_factor=0.5),
          expected)
    with pytest.raises(ValueError, match="buffer_len"):
        losses.overlong_penalty(lengths, max_len=16, buffer_len=0)
    # A multi-turn episode measured against its own cap (rollout.max_len), not the per-turn
    # one: 72 tokens of turns and observations against max_len 72 is the full penalty, -1.
    close(losses.overlong_penalty(np.array([40, 64, 72]), max_len=72, buffer_len=16),
          [0.0, -0.5, -1.0])
    with pytest.raises(ValueError, match=r"72 tokens is longer than max_len=48.*rollout.max_len"):
        losses.overlong_penalty(np.array([30, 72]), max_len=48, buffer_len=16)
    jitted = jax.jit(lambda n: losses.overlong_penalty(n, max_len=16, buffer_len=4))
    close(jitted(lengths), [0.0, 0.0, -0.5, -1.0])


def test_filter_overlong_masks_truncated_episodes():
    mask = np.array([[1, 1, 0, 1], [1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
    out = losses.filter_overlong(mask, np.array([False, True, False]))
    close(out, mask * np.array([[1.0], [0.0], [1.0]]))
    # Masked out of the loss: a truncated row's tokens carry no gradient.
    logp = jnp.zeros(mask.shape)
    grad = jax.grad(lambda lp: losses.agg_loss(lp, out, "token-mean"))(logp)
    assert np.all(np.asarray(grad)[1] == 0) and np.all(np.asarray(grad)[0][mask[0] > 0] != 0)


def test_dynamic_sampling_selection_and_accumulation():
    groups1 = np.array([10, 10, 11, 11, 12, 13, 13])
    rewards1 = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])  # 11, 13 all equal; 12 singleton
    keep1 = batch_lib.informative_groups(rewards1, groups1)
    assert keep1.tolist() == [True, True, False, False, True, False, False]
    batch1 = {"group_id": groups1, "reward": rewards1, "text": [f"a{i}" for i in range(7)]}
    acc, full = batch_lib.accumulate_groups(None, batch1, keep1, num_groups=3)
    assert not full and acc["text"] == ["a0", "a1", "a4"]
    groups2 = np.array([20, 20, 21, 21])
    batch2 = {"group_id": groups2, "reward": np.array([0.0, 1.0, 1.0, 0.0]),
              "text": ["b0", "b1", "b2", "b3"]}
    acc, full = batch_lib.accumulate_groups(acc, batch2, np.ones(4, bool), num_groups=3)
    assert full and acc["group_id"].tolist() == [10, 10, 12, 20, 20]
    assert acc["text"] == ["a0", "a1", "a4", "b0", "b1"]
    with pytest.raises(ValueError, match="repeat across generation batches"):
        batch_lib.accumulate_groups(acc, batch1, keep1, num_groups=9)


# ------------------------------------------------------------ log-probs from hidden states


def ref_logprobs(h, w, tok, temperature, softcap, a, b):
    """Dense float64 log-softmax, entropy, and the gradient of sum(a * logp + b * entropy)."""
    h, w = h.astype(np.float64), w.astype(np.float64)
    x = h @ w
    s = softcap * np.tanh(x / softcap) if softcap else x
    z = s / temperature
    z_max = z.max(-1, keepdims=True)
    lse = np.log(np.exp(z - z_max).sum(-1, keepdims=True)) + z_max
    p = np.exp(z - lse)
    logp = np.take_along_axis(z - lse, tok[..., None], -1)[..., 0]
    mean_z = (p * z).sum(-1, keepdims=True)
    ent = lse[..., 0] - mean_z[..., 0]
    onehot = np.eye(w.shape[1])[tok]
    dz = a[..., None] * (onehot - p) - b[..., None] * p * (z - mean_z)
    dx = dz / temperature * ((1 - (s / softcap) ** 2) if softcap else 1.0)
    return logp, ent, dx @ w.T, np.einsum("btd,btv->dv", h, dx)


@pytest.mark.parametrize("temperature,softcap,chunk", [(1.0, None, 4), (0.7, 3.0, 5)])
def test_chunked_logprobs_values_and_gradients(temperature, softcap, chunk):
    rng = np.random.default_rng(0)
    b, t, d, v = 2, 13, 8, 33  # t not a multiple of the chunk: the tail is padded
    h = rng.normal(size=(b, t, d)).astype(np.float32)
    w = rng.normal(size=(d, v)).astype(np.float32)
    tok = rng.integers(0, v, size=(b, t))
    a, bb = rng.normal(size=(b, t)), rng.normal(size=(b, t))
    logp_ref, ent_ref, dh_ref, dw_ref = ref_logprobs(h, w, tok, temperature, softcap, a, bb)

    def f(h, w):
        logp, ent = losses.chunked_logprobs(h, w, tok, chunk=chunk, temperature=temperature,
                                            softcap=softcap, return_entropy=True)
        return (a * logp + bb * ent).sum(), (logp, ent)

    (_, (logp, ent)), (dh, dw) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(h, w)
    assert logp.dtype == jnp.float32 and logp.shape == (b, t)
    close(logp, logp_ref, rtol=1e-5, atol=1e-5)
    close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    close(dh, dh_ref, rtol=1e-4, atol=1e-5)
    close(dw, dw_ref, rtol=1e-4, atol=1e-5)
    # Without entropy: only the log-prob term in the gradient.
    dh_only = jax.grad(lambda h: (a * losses.chunked_logprobs(
        h, w, tok, chunk=chunk, temperature=temperature, softcap=softcap)).sum())(h)
    close(dh_only, ref_logprobs(h, w, tok, temperature, softcap, a, 0 * bb)[2], rtol=1e-4,
          atol=1e-5)


def test_chunked_logprobs_sharded_equals_unsharded():
    """Batch on `data`, vocab on `tensor` (8 simulated devices): same values and gradients."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    rng = np.random.default_rng(4)
    h = rng.normal(size=(4, 6, 8)).astype(np.float32)
    w = rng.normal(size=(8, 16)).astype(np.float32)
    tok = rng.integers(0, 16, size=(4, 6))

    def f(h, w, tok):
        logp, ent = losses.chunked_logprobs(h, w, tok, chunk=4, return_entropy=True)
        return (logp + 0.1 * ent).sum(), logp

    expected = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(h, w, tok)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "tensor"))
    args = jax.device_put((h, w, tok), (NamedSharding(mesh, P("data")),
                                        NamedSharding(mesh, P(None, "tensor")),
                                        NamedSharding(mesh, P("data"))))
    got = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        close(a, np.asarray(b), rtol=1e-5, atol=1e-5)


def all_gather_shapes(hlo_text):
    """The result shapes of the all-gathers in compiled HLO text."""
    return [tuple(int(n) for n in m.group(1).split(",") if n)
            for m in re.finditer(r"= \w+\[([\d,]*)\][^ ]* all-gather\(", hlo_text)]


def test_chunked_logprobs_per_sequence_shard():
    """Time over `sequence` (4) and batch over `fsdp` (2): with the mesh, each shard scores its
    own tokens; values and gradients equal the unsharded ones, and the only all-gather is the
    weight's (FSDP). Without the mesh the scan over chunks gathers the hidden states."""
    from ptrain import sharding

    rng = np.random.default_rng(5)
    b, t, d, v = 2, 64, 24, 40
    h = rng.normal(size=(b, t, d)).astype(np.float32)
    w = rng.normal(size=(d, v)).astype(np.float32)
    tok = rng.integers(0, v, size=(b, t))
    a = rng.normal(size=(b, t)).astype(np.float32)

    def f(h, w, tok, mesh=None):
        logp, ent = losses.chunked_logprobs(h, w, tok, chunk=4, return_entropy=True, mesh=mesh)
        return (a * logp + 0.1 * ent).sum(), (logp, ent)

    expected = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(h, w, tok)
    mesh = sharding.make_mesh(fsdp=2, sequence=4)
    args = (jax.device_put(h, sharding.named(mesh, ("batch", "seq", None), h.shape)),
            jax.device_put(w, sharding.named(mesh, ("embed", "vocab"), w.shape)),
            jax.device_put(tok, sharding.named(mesh, ("batch", "seq"), tok.shape)))
    for m in (mesh, None):
        fn = jax.jit(jax.value_and_grad(lambda h, w, tok: f(h, w, tok, m), argnums=(0, 1),
                                        has_aux=True))
        gathered = all_gather_shapes(fn.lower(*args).compile().as_text())
        if m is None:  # what the mesh argument avoids: [b, t, d] in some layout, gathered
            assert any(d in s and np.prod(s) >= (b // 2) * t * d for s in gathered), gathered
            continue
        assert gathered == [(d, v)], gathered
        got = fn(*args)
        assert got[0][1][0].sharding.spec == jax.sharding.PartitionSpec("fsdp", "sequence")
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            close(x, np.asarray(y), rtol=1e-5, atol=1e-5)


def test_chunked_logprobs_never_materialises_btv():
    b, t, d, v, chunk = 2, 512, 32, 4096, 32
    full_btv_bytes = b * t * v * 4
    args = (jnp.zeros((b, t, d)), jnp.zeros((d, v)), jnp.zeros((b, t), jnp.int32))

    def temp_bytes(fn):
        grad = jax.grad(lambda h, w, tok: fn(h, w, tok).sum(), argnums=(0, 1))
        return jax.jit(grad).lower(*args).compile().memory_analysis().temp_size_in_bytes

    def dense(h, w, tok):
        lp = jax.nn.log_softmax(h @ w, -1)
        return jnp.take_along_axis(lp, tok[..., None], -1)[..., 0]

    chunked = lambda h, w, tok: losses.chunked_logprobs(h, w, tok, chunk=chunk)
    assert temp_bytes(dense) >= full_btv_bytes  # the analysis does see a dense [b, t, v]
    assert temp_bytes(chunked) < full_btv_bytes / 4


# ------------------------------------------- cross-check against verl's own torch functions

VERL_FUNCS = {
    "utils/torch_functional.py": ["masked_sum", "masked_mean", "masked_var", "masked_whiten",
                                  "clip_by_value"],
    "trainer/ppo/core_algos.py": [
        "compute_grpo_outcome_advantage", "compute_rloo_outcome_advantage",
        "compute_reinforce_plus_plus_outcome_advantage", "compute_gae_advantage_return",
        "compute_reinforce_plus_plus_baseline_outcome_advantage", "agg_loss",
        "compute_policy_loss_vanilla", "compute_policy_loss_gspo", "compute_policy_loss_cispo",
        "kl_penalty", "kl_penalty_forward", "AdaptiveKLController", "compute_value_loss"],
    "trainer/ppo/rollout_corr_helper.py": [
        "_parse_rollout_is_threshold", "compute_rollout_correction_weights",
        "compute_is_metrics"],
}


@pytest.fixture(scope="module")
def verl():
    """verl's functions, compiled from its source files (its package needs ray, vllm, ...).

    Set PTRAIN_VERL_SRC to the `verl` directory of an unpacked wheel, e.g.
    `pip install --no-deps --target /tmp/verl_pkg verl==0.9.1` -> /tmp/verl_pkg/verl.
    """
    import ast
    import collections
    import math
    import os
    import types
    import typing

    src = os.environ.get("PTRAIN_VERL_SRC", "")
    if not os.path.isfile(os.path.join(src, "trainer/ppo/core_algos.py")):
        pytest.skip("verl source not available: set PTRAIN_VERL_SRC to a verl package dir")
    torch = pytest.importorskip("torch")

    class AlgoConfig:
        pass

    class ActorConfig(types.SimpleNamespace):
        global_batch_info = {}

        def get(self, key, default=None):
            return getattr(self, key, default)

    ns = {"torch": torch, "np": np, "math": math, "defaultdict": collections.defaultdict,
          "ActorConfig": ActorConfig, "AlgoConfig": AlgoConfig, "DictConfig": dict,
          "SAFETY_BOUND": 20.0, **{k: getattr(typing, k) for k in ("Any", "Optional")}}
    for path, names in VERL_FUNCS.items():
        tree = ast.parse(open(os.path.join(src, path)).read())
        nodes = [n for n in tree.body if getattr(n, "name", None) in names]
        for n in nodes:
            n.decorator_list = []
        exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), ns)
        if path.startswith("utils"):
            ns["verl_F"] = types.SimpleNamespace(**{k: ns[k] for k in names})
    ns["config"] = ActorConfig
    return types.SimpleNamespace(**ns)


def t(x, grad=False):
    import torch
    return torch.tensor(np.asarray(x, np.float32), requires_grad=grad)


def test_verl_advantages(verl):
    rng = np.random.default_rng(1)
    tok = rng.normal(size=(10, 6)).astype(np.float32)
    mask = (np.arange(6)[None] < rng.integers(2, 7, size=(10, 1))).astype(np.float32)
    tok *= mask
    values = rng.normal(size=(10, 6)).astype(np.float32)
    for norm, est in [(True, "grpo"), (False, "drgrpo")]:
        expected, _ = verl.compute_grpo_outcome_advantage(t(tok), t(mask), GROUPS,
                                                          norm_adv_by_std_in_grpo=norm)
        close(losses.group_advantages(tok, GROUPS, estimator=est, mask_bt=mask), expected)
    expected, _ = verl.compute_rloo_outcome_advantage(t(tok), t(mask), GROUPS)
    close(losses.group_advantages(tok, GROUPS, estimator="rloo", mask_bt=mask), expected)
    cfg = verl.config(gamma=0.9)
    exp_adv, exp_ret = verl.compute_reinforce_plus_plus_outcome_advantage(t(tok), t(mask), cfg)
    adv, ret = losses.reinforce_pp_advantages(tok, mask, gamma=0.9)
    close(adv, exp_adv, rtol=1e-5, atol=1e-5)
    close(ret, exp_ret)
    expected, _ = verl.compute_reinforce_plus_plus_baseline_outcome_advantage(
        t(tok), t(mask), GROUPS)
    close(losses.reinforce_pp_baseline_advantages(tok, mask, GROUPS), expected, atol=1e-5)
    exp_adv, exp_ret = verl.compute_gae_advantage_return(t(tok), t(values), t(mask), 0.95, 0.9)
    adv, ret = losses.gae(tok, values, mask, gamma=0.95, lam=0.9)
    close(adv, np.asarray(exp_adv) * mask, rtol=1e-5, atol=1e-5)  # verl leaves padding unmasked
    close(ret, exp_ret, atol=1e-5)


@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo"])
def test_verl_policy_losses(verl, kind):
    logp, old, adv, mask, clip_low, clip_high, dual = ppo_case()
    mask[2, :3] = 1  # verl's GSPO divides by zero on an empty row's log-ratio mean otherwise
    w = np.linspace(0.5, 2.0, 18).reshape(3, 6).astype(np.float32)
    fn = {"ppo": verl.compute_policy_loss_vanilla, "gspo": verl.compute_policy_loss_gspo,
          "cispo": verl.compute_policy_loss_cispo}[kind]
    modes = ["seq-mean-token-mean"] if kind == "gspo" else list(losses.AGG_MODES)
    for agg in modes:
        cfg = verl.config(clip_ratio=0.2, clip_ratio_low=clip_low, clip_ratio_high=clip_high,
                          clip_ratio_c=dual)
        logp_t = t(logp, grad=True)
        ref_loss, ref_metrics = fn(t(old), logp_t, t(adv), t(mask), agg, cfg, t(w))
        ref_loss.backward()
        jax_fn = lambda lp: losses.policy_loss(lp, old, adv, mask, kind=kind, clip_low=clip_low,
                                               clip_high=clip_high, dual_clip=dual, agg=agg,
                                               is_weights=w)
        (loss, metrics), grad = jax.value_and_grad(jax_fn, has_aux=True)(jnp.asarray(logp))
        close(loss, float(ref_loss.detach()), rtol=1e-5)
        close(grad, logp_t.grad.numpy(), rtol=1e-5)
        for k in metrics:
            close(metrics[k], ref_metrics[f"actor/{k}"], rtol=1e-5)


@pytest.mark.parametrize("kind", losses.KL_KINDS)
def test_verl_kl(verl, kind):
    rng = np.random.default_rng(2)
    logp = (rng.normal(size=(4, 8)) * 3).astype(np.float32)
    ref = (rng.normal(size=(4, 8)) * 3).astype(np.float32)
    logp_t = t(logp, grad=True)
    expected = verl.kl_penalty(logp_t, t(ref), kind)
    expected.sum().backward()
    close(losses.kl(logp, ref, kind), expected.detach().numpy(), rtol=1e-5)
    close(jax.grad(lambda lp: losses.kl(lp, ref, kind).sum())(jnp.asarray(logp)),
          logp_t.grad.numpy(), rtol=1e-5)


def test_verl_agg_is_weights_and_kl_controller(verl):
    for mode in losses.AGG_MODES:
        close(losses.agg_loss(X, XMASK, mode), float(verl.agg_loss(t(X), t(XMASK), mode)))
    rng = np.random.default_rng(3)
    logp, rollout = rng.normal(size=(2, 3, 5)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], np.float32)
    for level in ["token", "sequence"]:
        expected, _ = verl.compute_rollout_correction_weights(
            t(logp - rollout), t(mask), rollout_is=level, rollout_is_threshold=1.7)
        close(losses.truncated_is_weights(logp, rollout, mask, level=level, cap=1.7), expected)
    ref_ctl = verl.AdaptiveKLController(0.1, 0.02, 500)
    ctl = losses.KLController(0.1, target=0.02, horizon=500)
    for kl_value in [0.03, 0.01, 0.5, 0.0]:
        ref_ctl.update(kl_value, 32)
        ctl = ctl.update(kl_value, 32)
        close(ctl.value, ref_ctl.value, rtol=1e-12)


def test_verl_value_loss(verl):
    v, ret, old, mask = value_case()
    for agg in losses.AGG_MODES:
        v_t = t(v, grad=True)
        ref_loss, ref_clipfrac = verl.compute_value_loss(v_t, t(ret), t(old), t(mask) > 0,
                                                         CLIP_V, agg)
        ref_loss.backward()
        fn = lambda x: losses.value_loss(x, ret, old, mask, clip_value=CLIP_V, agg=agg)
        (loss, clipfrac), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(v))
        close(loss, float(ref_loss.detach()), rtol=1e-5)
        close(grad, v_t.grad.numpy(), rtol=1e-5)
        close(clipfrac, float(ref_clipfrac))
