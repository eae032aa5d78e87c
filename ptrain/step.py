"""The learner's device programs: pure functions of (graphdef, params, batch), jitted.

  token_logprobs  log p(token | everything before it) and its entropy for every continuation
                  token of a `ptrain.batch.Batch`: each group's prompt runs once
                  (`ptrain.generate.prefill`), its KV cache repeated for the G continuations
  token_values    the critic's value of the state before each continuation token
  prepare         one step's device batch: old and reference log-probs, KL in the reward,
                  advantages (and with GAE the critic's values and returns)
  update          all optimizer updates of a step (epochs x minibatches, gradients
                  accumulated over microbatches), for the policy ("rl"), the critic
                  ("critic") or supervised training ("sft"): `jit_update`
  packed_update   one AdamW step on packed sequences (documents back to back, ring attention
                  over `sequence`): packed SFT (`learner.sft` with sft.packing), and the
                  long-context step `ptrain.plan` compiles, both through `jit_packed_update`

LoRA (`ptrain.lora`, parameters holding `LoraParam`s): the updates differentiate with respect
to the adapters only and the optimizer state mirrors them (`split_trainable`); the base
passes through unchanged, and `prepare` takes the base (adapters zeroed) as the reference.
With LoRA dropout the updates take a key (the step's, `dropout_keys`): each update and each
microbatch folds in its index, so the masks differ across them and are a function of
(key, batch) only; `prepare` (old and reference log-probs) and sampling run without dropout.

The static settings of each program are a `ptrain.config.StepSettings` (`config.resolve`).
Shapes are fixed by the config, so every program compiles once.

Mixture of experts: the losses add the router's load-balancing and z losses (the model
config's coefficients, `moe.router_loss`) and report `moe/*` metrics (per-expert load,
dropped assignments); with `router_replay` the forwards route each token to the experts the
sampler recorded (the batch's `experts_bnlk`, `prompt_experts_bplk`), and where the batch
has them `moe/router_agreement` is the share of the sampler's assignments the learner's
router chose too over continuation tokens, `moe/router_agreement_prompt` over the prompts
(per layer: `..._l`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ptrain import lora
from ptrain import losses
from ptrain import moe
from ptrain import sharding
from ptrain.config import StepSettings
from ptrain.generate.prefill import prefill_shared
from ptrain.vision import vl


# ================================================================================ optimizer


def make_optimizer(optim, *, total_steps: int, updates_per_step: int = 1):
    """AdamW with warmup then cosine decay (or constant), and global-norm clipping.

    The schedule is in RL steps (each makes `updates_per_step` optimizer updates).
    Returns (optax transformation, schedule(step) -> learning rate).
    """
    if optim.schedule == "cosine":
        main = optax.cosine_decay_schedule(optim.lr, max(total_steps - optim.warmup_steps, 1),
                                           alpha=optim.min_lr_ratio)
    else:
        main = optax.constant_schedule(optim.lr)
    schedule = main  # (no warmup: no zero-length linear schedule, which optax warns about)
    if optim.warmup_steps:
        warmup = optax.linear_schedule(0.0, optim.lr, optim.warmup_steps)
        schedule = optax.join_schedules([warmup, main], [optim.warmup_steps])

    def per_update(count):
        # Always a function of the traced count, even for a constant schedule: with a
        # count-free learning rate the update program hung on 2 processes x 4 CPU devices
        # (gloo; 1 x 8 ran), tests/test_multiprocess.py's learner run.
        return schedule(count // updates_per_step) + 0.0 * count

    parts = [optax.clip_by_global_norm(optim.grad_clip)] if optim.grad_clip > 0 else []
    parts.append(optax.adamw(per_update, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                             weight_decay=optim.weight_decay))
    return optax.chain(*parts), schedule


def opt_state_shardings(tx, params, param_shardings, mesh):
    """Shardings of tx.init(params) (found abstractly): moments like the parameters they
    mirror, counters replicated."""
    abstract = jax.eval_shape(tx.init, params)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return optax.tree_map_params(tx, lambda _, s: s, abstract, param_shardings,
                                 transform_non_params=lambda _: replicated)


# ================================================================================ log-probs


def token_logprobs(graphdef, params, batch, *, group_size=1, chunk=256, temperature=1.0,
                   replay=False, return_routing=False, dropout_key=None):
    """log p(token | everything before it) of every continuation token, and the entropy of
    that distribution ([b, n] each), computed in chunks (never float32 [b, n, v]); p is the
    softmax of logits / temperature, the distribution the sampler drew from (before top-k /
    top-p): so the ratio, KL, entropy and truncated IS refer to the sampled policy.

    Each group's prompt runs once (rows 0, G, 2G, ... hold the prompts); its KV cache is
    repeated for the G continuations, so gradients from all G reach the one prompt forward.
    replay: route to the batch's recorded experts. return_routing: also the MoE `Routing`s
    (prompts', continuations') or (None, None), as a third element. dropout_key: LoRA
    dropout's (the update's forwards), None for none.
    """
    model = nnx.merge(graphdef, params)
    tokens_bn = batch["tokens_bn"]
    h_gd, h_bnd, routing = _continuation_hidden(model, batch, group_size, replay=replay,
                                                dropout_key=dropout_key)
    # Token j is predicted by the hidden state before it: the prompt's last for j = 0, else
    # the row's state j - 1. The int32 targets shift, not the (time-sharded) hidden states,
    # so with sequence parallelism each shard scores its own tokens.
    w_dv = model.unembedding_vd().T
    next_bn = jnp.pad(tokens_bn[:, 1:], ((0, 0), (0, 1)))
    logp_bn, ent_bn = losses.chunked_logprobs(h_bnd, w_dv, next_bn, chunk=chunk,
                                              temperature=temperature, return_entropy=True,
                                              mesh=model.mesh)
    first_b1 = losses.chunked_logprobs(jnp.repeat(h_gd, group_size, axis=0)[:, None], w_dv,
                                       tokens_bn[:, :1], temperature=temperature,
                                       return_entropy=True)
    out = tuple(jnp.concatenate([a_b1, a_bn[:, :-1]], axis=1)
                for a_b1, a_bn in zip(first_b1, (logp_bn, ent_bn)))
    return out + (routing,) if return_routing else out


def token_values(critic_graphdef, critic_params, batch, *, group_size=1):
    """The critic's value of the state before each continuation token, float32 [b, n]: for
    token j, the value at the prompt's last token (j = 0) or at the row's token j - 1, the
    alignment of `token_logprobs` (verl's values[:, -response_length - 1:-1])."""
    critic = nnx.merge(critic_graphdef, critic_params)
    h_gd, h_bnd, _ = _continuation_hidden(critic.decoder, batch, group_size)
    first_b = jnp.repeat(critic.values(h_gd), group_size)
    return jnp.concatenate([first_b[:, None], critic.values(h_bnd)[:, :-1]], axis=1)


def _continuation_hidden(model, batch, group_size, *, replay=False, dropout_key=None):
    """Final hidden states of each group's prompt (its last token, [b / G, d]) and of every
    continuation token ([b, n, d]), and the MoE routing of each (prompts', continuations';
    None without experts); the prompt runs once, its KV cache repeated G times. replay:
    route every token to the experts the batch recorded."""
    tokens_bn, lengths_b = batch["tokens_bn"], batch["lengths_b"]
    n = tokens_bn.shape[1]
    replay_prompt = replay_tokens = None
    if replay:
        replay_prompt, replay_tokens = _recorded_routing(model.config, batch, group_size)
    positions_bn = batch["prompt_lens_b"][:, None] + jnp.arange(n)[None, :]
    # A VLModel's image prompts (the batch's vision_* arrays): features merged, M-RoPE.
    prompt_kw, continuation_kw = vl.learner_inputs(model, batch, group_size, positions_bn)
    if dropout_key is not None:  # (the prompts' forward and the continuations' own masks)
        prompt_kw["dropout_key"] = jax.random.fold_in(dropout_key, 0)
        continuation_kw["dropout_key"] = jax.random.fold_in(dropout_key, 1)
    h_gd, cache, prompt_routing = prefill_shared(
        model, batch["prompt_bp"][::group_size], batch["prompt_lens_b"][::group_size],
        repeats=group_size, extra_slots=n, replay_lbtk=replay_prompt, **prompt_kw)
    valid_bn = (jnp.arange(n)[None, :] < lengths_b[:, None]).astype(jnp.int32)
    h_bnd, _, routing = model.forward(tokens_bn, positions_bn, valid_bn, cache,
                                      replay_lbtk=replay_tokens, **continuation_kw)
    return h_gd, h_bnd, (prompt_routing, routing)


def _recorded_routing(model_config, batch, group_size):
    """The batch's recorded experts as `model.forward` takes them: [MoE layers, b / G, p, k]
    for the prompts and [MoE layers, b, n, k] for the continuations."""
    if not model_config.n_experts:
        raise ValueError("rl.router_replay needs a mixture-of-experts model (n_experts > 0)")
    if "experts_bnlk" not in batch or "prompt_experts_bplk" not in batch:
        raise ValueError("rl.router_replay: the batch carries no recorded routing "
                         "(Batch.experts_bnlk, prompt_experts_bplk); the producer must record "
                         "the sampler's (Samples.experts, as the single-turn, multi-turn and "
                         "mixed producers do), or set rl.router_replay=False")
    prompt = batch["prompt_experts_bplk"][::group_size].astype(jnp.int32)
    return jnp.moveaxis(prompt, 2, 0), jnp.moveaxis(batch["experts_bnlk"].astype(jnp.int32), 2, 0)


def _moe_metrics(model_config, routing, batch, group_size, *, replayed, scale=1.0):
    """`moe/*` metrics of one forward (prompts and continuations pooled) and, where the batch
    recorded the sampler's routing, the router agreement: over continuation tokens
    (`moe/router_agreement`, the tokens whose log-probs are trained) and over each group's
    prompt (`moe/router_agreement_prompt`, whose keys and values every continuation attends
    to); per layer as `..._l`."""
    prompt_routing, tokens_routing = routing
    pooled = moe.add(prompt_routing, tokens_routing)
    if pooled is None:
        return {}
    out = {k: scale * v for k, v in moe.metrics(pooled).items()}
    if "experts_bnlk" in batch:
        valid_bn = jnp.arange(batch["tokens_bn"].shape[1])[None, :] < batch["lengths_b"][:, None]
        p = batch["prompt_bp"].shape[1]
        valid_gp = jnp.arange(p)[None, :] >= p - batch["prompt_lens_b"][::group_size, None]
        recorded_prompt, recorded = _recorded_routing(model_config, batch, group_size)
        for name, r, rec, valid in (("", tokens_routing, recorded, valid_bn),
                                    ("_prompt", prompt_routing, recorded_prompt, valid_gp)):
            agree_l = moe.agreement_l(r, rec, valid, replayed=replayed)
            out[f"moe/router_agreement{name}_l"] = scale * agree_l
            out[f"moe/router_agreement{name}"] = scale * jnp.mean(agree_l)
    return out


def _last_token_onehot(mask_bn):
    """1 on the last token of each row where the mask is 1 (the sequence reward goes there)."""
    n = mask_bn.shape[1]
    last_b = n - 1 - jnp.argmax(mask_bn[:, ::-1] > 0, axis=1)
    return (jnp.arange(n)[None, :] == last_b[:, None]) & (mask_bn.sum(-1, keepdims=True) > 0)


# ================================================================================== prepare


@functools.partial(jax.jit, static_argnames=("graphdef", "critic_graphdef", "s"))
def prepare(params, ref_params, critic_params, batch, kl_coef, *, graphdef, critic_graphdef,
             s: StepSettings):
    mask_bn = batch["loss_mask_bn"]
    model = nnx.merge(graphdef, params)  # (for its mesh and config only)
    mesh = model.mesh
    logp = functools.partial(token_logprobs, graphdef, batch=batch, group_size=s.group_size,
                             chunk=s.chunk, temperature=s.temperature, replay=s.router_replay)
    out, metrics = dict(batch), {}
    old_bn = None
    if s.has_old_logp:
        if s.logprob_microbatch:  # (dense models only: the Learner checks)
            old_bn = _microbatched(lambda x: logp(params, batch=x)[0], batch, s, mesh)
            routing = (None, None)
        else:
            old_bn, _, routing = logp(params, return_routing=True)
        out["old_logp_bn"] = old_bn
        metrics["rollout/logp_mismatch"] = losses.masked_mean(
            jnp.abs(old_bn - batch["rollout_logp_bn"]), mask_bn)
        agreement = _moe_metrics(model.config, routing, batch, s.group_size,
                                 replayed=s.router_replay)
        metrics.update({k: v for k, v in agreement.items() if "agreement" in k})
    if s.kl_loss or s.kl_in_reward:
        if ref_params is None and lora.has_adapters(params):  # LoRA: the base is the reference
            ref_params = lora.disabled(params)
        out["ref_logp_bn"] = _microbatched(lambda x: logp(ref_params, batch=x)[0], batch, s,
                                           mesh)
    scores_bn = jnp.where(_last_token_onehot(mask_bn), batch["rewards_b"][:, None], 0.0)
    if s.kl_in_reward:
        scores_bn, batch_kl = losses.kl_in_reward(scores_bn, old_bn, out["ref_logp_bn"], mask_bn,
                                                  coef=kl_coef, kind=s.kl_kind)
        metrics["kl/in_reward"] = batch_kl
    if s.estimator in ("grpo", "drgrpo", "rloo"):
        adv_bn = losses.group_advantages(scores_bn, batch["group_ids_b"], estimator=s.estimator,
                                         mask_bt=mask_bn)
    elif s.estimator == "reinforce++":
        adv_bn = losses.reinforce_pp_advantages(scores_bn, mask_bn, gamma=s.gamma)[0]
    elif s.estimator == "reinforce++-baseline":
        adv_bn = losses.reinforce_pp_baseline_advantages(scores_bn, mask_bn,
                                                         batch["group_ids_b"])
    else:  # gae: the critic's values before the update are the old values of its loss
        values_bn = _microbatched(lambda x: token_values(
            critic_graphdef, critic_params, x, group_size=s.group_size), batch, s, mesh)
        adv_bn, returns_bn = losses.gae(scores_bn, values_bn, mask_bn, gamma=s.gamma, lam=s.lam)
        out["old_values_bn"], out["returns_bn"] = values_bn, returns_bn
        metrics["critic/values_mean"] = losses.masked_mean(values_bn, mask_bn)
        metrics["critic/returns_mean"] = losses.masked_mean(returns_bn, mask_bn)
        metrics["critic/vf_explained_var"] = losses.explained_variance(returns_bn, values_bn,
                                                                       mask_bn)
    out["adv_bn"] = adv_bn
    metrics["adv/mean"] = losses.masked_mean(adv_bn, mask_bn)
    metrics["adv/abs_mean"] = losses.masked_mean(jnp.abs(adv_bn), mask_bn)
    return out, metrics


def _microbatched(fn, batch, s: StepSettings, mesh):
    """fn(batch) -> [b, ...], in passes of s.logprob_microbatch rows (a scan; one pass when
    0), so that a pass holds one microbatch's activations and prompt KV cache, not the whole
    batch's (verl's log_prob_micro_batch_size). Groups are dealt out in turn (group j to pass
    j % k), so each device keeps its own rows, as in `update`."""
    b, g = batch["tokens_bn"].shape[0], s.group_size
    if not s.logprob_microbatch or s.logprob_microbatch >= b:
        return fn(batch)
    k = b // s.logprob_microbatch  # passes
    micro = s.logprob_microbatch // g  # groups per pass

    def split(x):  # [b, ...] -> [k, micro * g, ...]
        rest = x.shape[1:]
        x = jnp.swapaxes(x.reshape((micro, k, g) + rest), 0, 1).reshape((k, micro * g) + rest)
        return sharding.constrain(x, (None, "batch") + (None,) * len(rest), mesh)

    def merge(y):  # [k, micro * g, ...] -> [b, ...]
        rest = y.shape[2:]
        return jnp.swapaxes(y.reshape((k, micro, g) + rest), 0, 1).reshape((b,) + rest)

    return merge(jax.lax.map(fn, {name: split(x) for name, x in batch.items()}))


# =================================================================================== update


def _rl_loss(params, x, num_tokens, num_seqs, kl_coef, router_totals=None, key=None, *,
             graphdef, s: StepSettings):
    """The loss of one microbatch, normalised by the whole minibatch's token and sequence
    counts, so that microbatch losses (and gradients) add up to the minibatch's.
    router_totals: the minibatch's (load_le, tokens_l) for the global router losses; key:
    the microbatch's LoRA dropout key or None."""
    mask_bn = x["loss_mask_bn"]
    logp_bn, ent_bn, routing = token_logprobs(
        graphdef, params, x, group_size=s.group_size, chunk=s.chunk, temperature=s.temperature,
        replay=s.router_replay, return_routing=True, dropout_key=key)
    share = mask_bn.sum() / jnp.maximum(num_tokens, 1)  # this microbatch's share of the tokens
    agg = functools.partial(losses.agg_loss, mask_bt=mask_bn, mode=s.agg, num_tokens=num_tokens,
                            num_seqs=num_seqs)
    # MoE: the router's aux and z losses of this microbatch's forward, weighted by its share
    # of the minibatch's tokens (so the microbatches' terms add up to a token-weighted mean);
    # with router_loss_scope="global", its terms of the minibatch's losses (`moe.global_terms`).
    model_config = nnx.merge(graphdef, params).config
    moe_metrics = _moe_metrics(model_config, routing, x, s.group_size, replayed=s.router_replay,
                               scale=share)
    if s.has_old_logp or s.kind == "sft":  # agreement: where the mismatch is measured
        moe_metrics = {k: v for k, v in moe_metrics.items() if "agreement" not in k}
    router_loss = share * moe.router_loss(moe.add(*routing), model_config)
    if router_totals is not None:
        aux, z = moe.global_terms(moe.add(*routing), *router_totals)
        router_loss = (model_config.router_aux_loss_coef * aux
                       + model_config.router_z_loss_coef * z)
        moe_metrics.update({"moe/aux_loss": aux, "moe/z_loss": z})
    if s.kind == "sft":
        nll = -agg(logp_bn)
        return nll + router_loss, {"sft/loss": nll,
                                   "sft/entropy": share * losses.masked_mean(ent_bn, mask_bn),
                                   **moe_metrics}
    old_bn = x["old_logp_bn"] if s.has_old_logp else jax.lax.stop_gradient(logp_bn)
    is_w = None
    metrics = {}
    if s.tis_cap > 0:
        is_w = losses.truncated_is_weights(old_bn, x["rollout_logp_bn"], mask_bn,
                                           level=s.tis_level, cap=s.tis_cap)
        metrics["tis/weight_mean"] = share * losses.masked_mean(is_w, mask_bn)
    pg_loss, pg_metrics = losses.policy_loss(
        logp_bn, old_bn, x["adv_bn"], mask_bn, kind=s.loss, clip_low=s.clip_low,
        clip_high=s.clip_high, dual_clip=s.dual_clip, agg=s.agg, is_weights=is_w,
        num_tokens=num_tokens, num_seqs=num_seqs)
    loss = pg_loss + router_loss
    metrics.update(moe_metrics)
    metrics.update({f"actor/{k}": share * v for k, v in pg_metrics.items()})
    metrics["actor/pg_loss"] = pg_loss
    if not s.has_old_logp:
        metrics["rollout/logp_mismatch"] = share * losses.masked_mean(
            jnp.abs(old_bn - x["rollout_logp_bn"]), mask_bn)
    if s.kl_loss:
        kl_loss = agg(losses.kl(logp_bn, x["ref_logp_bn"], s.kl_kind))
        loss = loss + kl_coef * kl_loss
        metrics["kl/loss"] = kl_loss
    if s.kl_loss or s.kl_in_reward:
        metrics["kl/k1"] = share * losses.masked_mean(
            jax.lax.stop_gradient(logp_bn) - x["ref_logp_bn"], mask_bn)
    entropy = agg(ent_bn)
    if s.entropy_coef:
        loss = loss - s.entropy_coef * entropy
    metrics["actor/entropy"] = jax.lax.stop_gradient(entropy)
    return loss, metrics


def _critic_loss(params, x, num_tokens, num_seqs, kl_coef, router_totals=None, key=None, *,
                 graphdef, s: StepSettings):
    """The clipped value loss of one microbatch, normalised like `_rl_loss`."""
    del kl_coef, router_totals, key
    mask_bn = x["loss_mask_bn"]
    vpreds_bn = token_values(graphdef, params, x, group_size=s.group_size)
    share = mask_bn.sum() / jnp.maximum(num_tokens, 1)
    loss, clipfrac = losses.value_loss(vpreds_bn, x["returns_bn"], x["old_values_bn"], mask_bn,
                                       clip_value=s.clip_value, agg=s.agg,
                                       num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, {"critic/vf_clipfrac": share * clipfrac,
                  "critic/vpred_mean": share * losses.masked_mean(
                      jax.lax.stop_gradient(vpreds_bn), mask_bn)}


def update(params, opt_state, batch, kl_coef, key=None, *, graphdef, s: StepSettings, tx,
           mesh):
    """All optimizer updates of one step: epochs x minibatches, each minibatch's gradient
    accumulated over microbatches (a scan, so the program does not grow with their number).

    Groups (G consecutive rows) are dealt out in turn: group j goes to minibatch j % m and to
    microbatch (j // m) % k of it. Each device keeps its own rows (the split moves no data
    between devices) and the minibatches do not depend on the microbatch size.

    MoE with router_loss_scope="global" and k > 1 microbatches: a forward pass over the
    minibatch first counts its assignments per expert, so that the aux and z losses (and
    their gradients) are the whole minibatch's (`moe.global_terms`), not a sum of the
    microbatches' own; sums over data shards are global in either scope.

    key: LoRA dropout's (None: none); update u's microbatch j draws its masks from
    `dropout_keys(key, u, k)[j]`.
    """
    mask_bn = batch["loss_mask_bn"]
    b, g = mask_bn.shape[0], s.group_size
    m = s.minibatches
    micro = (s.microbatch or b // m) // g  # groups per microbatch
    k = b // g // m // micro

    def split(x):  # [b, ...] -> [m, k, micro * g, ...], sharded like b was
        rest = x.shape[1:]
        x = x.reshape((micro, k, m, g) + rest)
        x = jnp.transpose(x, (2, 1, 0, 3) + tuple(range(4, x.ndim)))
        x = x.reshape((m, k, micro * g) + rest)
        return sharding.constrain(x, (None, None, "batch") + (None,) * len(rest), mesh)

    split = {name: split(x) for name, x in batch.items() if name != "rewards_b"}
    loss_fn, prefix, loss_key = ((_critic_loss, "critic", "critic/vf_loss")
                                 if s.kind == "critic" else (_rl_loss, "optim", "optim/loss"))
    trainable, frozen = split_trainable(params)
    grad_fn = jax.value_and_grad(
        lambda t, *args: loss_fn(join_trainable(t, frozen), *args, graphdef=graphdef, s=s),
        has_aux=True)

    model_config = None if s.kind == "critic" else nnx.merge(graphdef, params).config
    totals = (model_config is not None and k > 1 and model_config.n_experts > 0
              and model_config.router_loss_scope == "global")

    def minibatch(carry, i_and_u):
        params, opt_state = carry  # (the trainable ones)
        i, u = i_and_u  # (minibatch, update)
        mb = jax.tree.map(lambda x: x[i], split)
        mb_mask = mb["loss_mask_bn"]
        num_tokens = mb_mask.sum()
        num_seqs = (mb_mask.sum(-1) > 0).sum()
        keys_k = dropout_keys(key, u, k)
        router_totals = (_router_totals(join_trainable(params, frozen), mb, keys_k, graphdef, s)
                         if totals else None)

        def accumulate(grads, x_and_key):
            x, key_j = x_and_key
            (loss, metrics), g = grad_fn(params, x, num_tokens, num_seqs, kl_coef,
                                         router_totals, key_j)
            return jax.tree.map(jnp.add, grads, g), {loss_key: loss, **metrics}

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, metrics = jax.lax.scan(accumulate, zeros, (mb, keys_k))
        metrics = jax.tree.map(lambda v: v.sum(0), metrics)
        metrics[f"{prefix}/grad_norm"] = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), metrics

    order = jnp.tile(jnp.arange(m), s.epochs)
    (trainable, opt_state), metrics = jax.lax.scan(minibatch, (trainable, opt_state),
                                                   (order, jnp.arange(m * s.epochs)))
    trainable, opt_state = _as_they_came(trainable, opt_state, tx, mesh)
    return join_trainable(trainable, frozen), opt_state, jax.tree.map(lambda v: v.mean(0),
                                                                      metrics)


def dropout_keys(key, update_index, k: int):
    """The LoRA dropout keys of an update's k microbatches ([k] keys; None without a key)."""
    if key is None:
        return None
    key_u = jax.random.fold_in(key, update_index)
    return jax.vmap(lambda j: jax.random.fold_in(key_u, j))(jnp.arange(k))


def split_trainable(params):
    """(what the optimizer updates, what stays frozen): with LoRA (`ptrain.lora`) the
    adapters and the base, which gets no gradient and no optimizer state; else all the
    parameters and None."""
    if lora.has_adapters(params):
        return lora.split(params)
    return params, None


def join_trainable(trainable, frozen):
    return trainable if frozen is None else lora.join(trainable, frozen)


def _as_they_came(params, opt_state, tx, mesh):
    """The updated (trainable) state sharded by its `axes`, as it came in: left to the
    partitioner, some leaves come out sharded otherwise (norm scales over fsdp), and every
    program that takes them (sampler, prepare, the update) would compile a second time at
    step 2."""
    if mesh is None:
        return params, opt_state
    shardings = sharding.state_shardings(params, mesh)
    params = jax.lax.with_sharding_constraint(params, shardings)
    return params, jax.lax.with_sharding_constraint(
        opt_state, opt_state_shardings(tx, params, shardings, mesh))


def _router_totals(params, mb, keys_k, graphdef, s: StepSettings):
    """(assignments per MoE layer and expert, valid tokens per MoE layer) of a minibatch's
    forwards ([k, rows, ...]: one per microbatch, as the loss runs them, with their LoRA
    dropout keys `keys_k`), no gradient."""
    model = nnx.merge(graphdef, jax.lax.stop_gradient(params))

    def one(x_and_key):
        x, key = x_and_key
        r = moe.add(*_continuation_hidden(model, x, s.group_size, replay=s.router_replay,
                                          dropout_key=key)[2])
        return r.load_le, r.tokens_l

    load_kle, tokens_kl = jax.lax.map(one, (mb, keys_k))
    return load_kle.sum(0), tokens_kl.sum(0)


@functools.cache
def jit_update(graphdef, settings, tx, mesh):
    """`update` jitted for these static arguments (cached), params and opt_state donated."""
    return jax.jit(functools.partial(update, graphdef=graphdef, s=settings, tx=tx, mesh=mesh),
                   donate_argnums=(0, 1))


# ============================================================================ packed update


def packed_update(params, opt_state, batch, key=None, *, graphdef, tx, chunk, mesh=None):
    """One AdamW step on packed sequences (`ptrain.packing.packed_batch`): token-mean negative
    log-likelihood of the targets where loss_mask_bt is 1, plus for a MoE the router's aux
    and z losses (`moe.router_loss`, the model config's coefficients) over every document
    token (segment id > 0: padding is neither dispatched nor counted), pooled over the whole
    packed batch as transformers' `load_balancing_loss_func` pools a batch under its
    attention mask. Returns (params, opt_state, {"loss": the NLL, "grad_norm"}, and for a
    MoE "optim/loss" (NLL + router losses) and the `moe/*` metrics of `moe.metrics`); with a
    mesh the state comes out sharded as it came in. key: LoRA dropout's, or None."""

    trainable, frozen = split_trainable(params)

    def loss_fn(trainable):
        model = nnx.merge(graphdef, join_trainable(trainable, frozen))
        h_btd, _, routing = model.forward(batch["tokens_bt"], batch["positions_bt"],
                                          batch["segment_ids_bt"], dropout_key=key)
        logp_bt = losses.chunked_logprobs(h_btd, model.unembedding_vd().T, batch["targets_bt"],
                                          chunk=chunk, mesh=model.mesh)
        nll = -losses.masked_mean(logp_bt, batch["loss_mask_bt"])
        if routing is None:
            return nll, {"loss": nll}
        loss = nll + moe.router_loss(routing, model.config)
        return loss, {"loss": nll, "optim/loss": loss, **moe.metrics(routing)}

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    metrics = {**metrics, "grad_norm": optax.global_norm(grads)}
    trainable, opt_state = _as_they_came(optax.apply_updates(trainable, updates), opt_state,
                                         tx, mesh)
    return join_trainable(trainable, frozen), opt_state, metrics


@functools.cache
def jit_packed_update(graphdef, tx, mesh, chunk):
    """`packed_update` jitted for these static arguments (cached), params and opt_state
    donated: the one program packed SFT (`learner.sft` with sft.packing) runs and
    `ptrain.plan.compile_plan` compiles."""
    return jax.jit(functools.partial(packed_update, graphdef=graphdef, tx=tx, chunk=chunk,
                                     mesh=mesh), donate_argnums=(0, 1))
