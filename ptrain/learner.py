"""The RL learner: prompts -> samples -> rewards -> advantages -> PPO updates -> logs, checkpoints.

`train(config, workdir)` is the loop, read top to bottom. Its stages are public so that other
loops (multi-turn tool episodes, sandbox rewards, overlapped scoring) reuse them:

  rollout  `Learner.rollout(params, records, key) -> Episodes`: the default single-turn producer
           (sampler, G samples per prompt, then `config.reward_fn`); replace it by passing
           `rollout_fn` to `train`.
  prepare  `Learner.prepare(params, episodes, kl_coef) -> batch`: on the device, the log-probs
           of the current and reference policies, KL in the reward, advantages.
  update   `Learner.update(params, opt_state, batch) -> params, opt_state, metrics`: PPO epochs
           over minibatches, gradients accumulated over microbatches, one jitted call.

PPO with a learned value function (rl.estimator="gae") adds a critic: the policy's decoder with
a scalar value head (`ptrain/critic.py`), its own parameters and optimizer (config.critic).
`prepare` then takes `critic_params` (old values, GAE advantages and returns) and
`Learner.update_critic` trains it on the same minibatches and epochs as the actor (verl updates
the critic, then the actor).

`sft(config, workdir)` trains on (prompt, completion) pairs with the loss on completion tokens
only, as a warm start; `train(..., params=...)` continues from its result.

Randomness is explicit: the key of step s is fold_in(key(seed), s), so a run resumed from a
checkpoint draws what the uninterrupted run drew. Shapes are fixed by the config (prompt and
completion lengths, batch sizes), so every program compiles once.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from ptrain import checkpoint as checkpoint_lib
from ptrain import critic as critic_lib
from ptrain import data as data_lib
from ptrain import losses
from ptrain import metrics as metrics_lib
from ptrain import model as model_lib
from ptrain import sampler as sampler_lib
from ptrain import sharding

ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce++", "reinforce++-baseline", "gae")
CRITIC_INITS = ("policy", "random")
POLICY_LOSSES = ("ppo", "gspo", "cispo")


# ==================================================================================== config


def defaults() -> ml_collections.ConfigDict:
    """Every key the learner reads, with its default. Configs in configs/ spell out all of them
    (they import nothing of ours); `check_config` rejects missing and unknown keys."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # the one seed: model init, data order, sampling
    c.steps = 100  # RL steps; each draws data.prompts_per_step prompts
    # ModelConfig fields for a randomly initialised model; with hf_model only the
    # model.RUNTIME_FIELDS among them apply (attention implementation, block sizes, remat).
    c.model = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                   tie_embeddings=False, rope_theta=10000.0, dtype="float32",
                   param_dtype="float32", remat="none", attention_impl="blockwise",
                   attn_block_q=512, attn_block_k=512)
    c.hf_model = ""  # a local Hugging Face model directory to start from
    c.tokenizer = ""  # a local Hugging Face tokenizer directory; "" means records carry ids
    c.mesh = dict(data=1, fsdp=-1, sequence=1, tensor=1)
    # Prompts: JSONL/ArrayRecord `sources` (paths or (path, weight)), or `records_fn(seed)`
    # returning a list of dicts (written once to <workdir>/prompts.jsonl). A record holds
    # "prompt_ids" (token ids) or "prompt" (text, with a tokenizer) and whatever the reward
    # function needs.
    c.data = dict(sources=(), records_fn=None, prompts_per_step=8, max_prompt_len=64,
                  on_error="raise")
    # reward_fn(record, completion_ids, completion_text) -> reward, or (reward, feedback text).
    c.reward_fn = None
    c.sampling = dict(num_samples=8, max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0,
                      stop_token_ids=(), stop_strings=(), stop_check_every=16)
    c.rl = dict(
        estimator="grpo",  # ESTIMATORS
        loss="ppo",  # POLICY_LOSSES
        clip_low=0.2, clip_high=0.2,  # clip-higher (DAPO): clip_high=0.28
        dual_clip=3.0,  # 0: off
        agg="token-mean",  # losses.AGG_MODES; gspo needs seq-mean-token-mean
        ppo_epochs=1, num_minibatches=1,
        # Rows per gradient-accumulation step, a multiple of sampling.num_samples (groups
        # stay whole: their prompt is computed once); 0: the whole minibatch.
        microbatch_size=0,
        gamma=1.0,  # discount (reinforce++, gae)
        lam=1.0,  # GAE lambda (gae)
        entropy_coef=0.0,
        tis_cap=0.0,  # truncated importance sampling against the sampler's log-probs; 0: off
        tis_level="token",  # token | sequence
        logprob_chunk=256,  # time steps per chunk of the log-prob computation
        # 0: on-policy. 1: batch t is scored (in the sandbox) while batch t+1 is generated
        # from the same parameters, so batch t+1 trains one update late; needs a producer
        # with separate generate/score (see `train`) and tis_cap > 0 to correct for it.
        staleness=0,
    )
    # The value function of rl.estimator="gae" (PPO), ignored otherwise. init "policy": the
    # policy's decoder (verl's default) with a new value head; "random": a fresh decoder
    # (seed + 1). clip_value: verl's cliprange_value. The loss aggregates like the actor's
    # (rl.agg); the optimizer is the critic's own (verl: lr 1e-5, weight decay 0.01, constant).
    c.critic = dict(init="policy", clip_value=0.5,
                    optim=dict(lr=1e-5, warmup_steps=0, schedule="constant", min_lr_ratio=0.0,
                               weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0))
    # KL to the frozen initial policy: coef 0 turns it (and the reference model) off.
    c.kl = dict(coef=0.0, kind="k3", in_reward=False,
                target=0.0, horizon=10000.0)  # target > 0: adaptive coefficient (in-reward)
    c.dapo = dict(
        overlong_buffer=0,  # > 0: soft overlong penalty over the last N tokens before the max
        overlong_penalty=1.0,
        dynamic_sampling=False,  # keep sampling until every group's rewards differ
        max_gen_batches=4,  # cap; the batch is then topped up with uninformative groups
    )
    c.optim = dict(lr=1e-6, warmup_steps=0, schedule="cosine",  # cosine | constant
                   min_lr_ratio=0.0, weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8,
                   grad_clip=1.0)  # 0: no clipping
    # Supervised warm start (`sft`): records hold prompt_ids + completion_ids (or prompt +
    # completion text with a tokenizer); the loss covers completion tokens only.
    c.sft = dict(sources=(), records_fn=None, steps=0, batch_size=8, max_prompt_len=64,
                 max_completion_len=64, microbatch_size=0,
                 checkpoint_every=0,  # 0: checkpoint.every (SFT steps are often much shorter)
                 optim=dict(lr=1e-3, warmup_steps=0, schedule="cosine", min_lr_ratio=0.0,
                            weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, grad_clip=1.0))
    c.log = dict(every=1, rollouts_every=10, num_rollouts=4)
    c.checkpoint = dict(every=10, keep=3, async_save=True)
    return c


def check_config(config: ml_collections.ConfigDict) -> None:
    """Raises a ValueError naming every missing or unknown key, or a bad value."""
    missing, unknown = _key_diff(defaults(), config, "")
    if missing or unknown:
        raise ValueError(
            "config does not match ptrain.learner.defaults(): "
            + (f"missing keys {missing}" if missing else "")
            + ("; " if missing and unknown else "")
            + (f"unknown keys {unknown}" if unknown else "")
            + ". Spell out every key of defaults() in the config file.")
    rl, s, d = config.rl, config.sampling, config.data
    mb_rows = d.prompts_per_step * s.num_samples // max(rl.num_minibatches, 1)
    micro = rl.microbatch_size
    checks = [
        (rl.estimator in ESTIMATORS, f"rl.estimator={rl.estimator!r}; use one of {ESTIMATORS}"),
        (rl.loss in POLICY_LOSSES, f"rl.loss={rl.loss!r}; use one of {POLICY_LOSSES}"),
        (rl.agg in losses.AGG_MODES, f"rl.agg={rl.agg!r}; use one of {losses.AGG_MODES}"),
        (rl.loss != "gspo" or rl.agg == "seq-mean-token-mean",
         "rl.loss='gspo' aggregates seq-mean-token-mean; set rl.agg to it"),
        (config.kl.kind in losses.KL_KINDS, f"kl.kind={config.kl.kind!r}; use {losses.KL_KINDS}"),
        (rl.tis_level in ("token", "sequence"), "rl.tis_level must be 'token' or 'sequence'"),
        (config.steps >= 0 and rl.ppo_epochs >= 1 and rl.num_minibatches >= 1,
         "steps must be >= 0, rl.ppo_epochs and rl.num_minibatches >= 1"),
        (d.prompts_per_step % rl.num_minibatches == 0,
         f"data.prompts_per_step={d.prompts_per_step} groups must divide into "
         f"rl.num_minibatches={rl.num_minibatches}"),
        (micro == 0 or (micro % s.num_samples == 0 and mb_rows % micro == 0),
         f"rl.microbatch_size={micro} must be a multiple of sampling.num_samples="
         f"{s.num_samples} that divides the minibatch of {mb_rows} rows"),
        (config.sft.microbatch_size == 0
         or config.sft.batch_size % config.sft.microbatch_size == 0,
         "sft.microbatch_size must divide sft.batch_size"),
        (all(o.schedule in ("cosine", "constant")
             for o in (config.optim, config.sft.optim, config.critic.optim)),
         "optim.schedule (and sft.optim's, critic.optim's) must be 'cosine' or 'constant'"),
        (rl.estimator != "gae" or (0 <= rl.gamma <= 1 and 0 <= rl.lam <= 1),
         f"rl.estimator='gae' needs 0 <= rl.gamma <= 1 and 0 <= rl.lam <= 1; got "
         f"gamma={rl.gamma}, lam={rl.lam}"),
        (config.critic.init in CRITIC_INITS,
         f"critic.init={config.critic.init!r}; use one of {CRITIC_INITS}"),
        (config.critic.clip_value > 0,
         f"critic.clip_value={config.critic.clip_value} must be > 0 (large: no clipping)"),
        (not (d.sources and d.records_fn), "set data.sources or data.records_fn, not both"),
        (config.dapo.max_gen_batches >= 1, "dapo.max_gen_batches must be >= 1"),
        (config.kl.target == 0 or config.kl.in_reward,
         "kl.target (adaptive KL) applies to the KL in the reward: set kl.in_reward=True"),
        (rl.staleness in (0, 1), "rl.staleness must be 0 (on-policy) or 1 (overlapped)"),
        (rl.staleness == 0 or not config.dapo.dynamic_sampling,
         "dynamic sampling needs the rewards before the next batch is drawn: set "
         "rl.staleness=0 or dapo.dynamic_sampling=False"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(f"config: {message}")


def _key_diff(ref, config, prefix):
    missing, unknown = [], []
    ref_keys, keys = set(ref.keys()), set(config.keys())
    missing += [prefix + k for k in sorted(ref_keys - keys)]
    unknown += [prefix + k for k in sorted(keys - ref_keys)]
    for k in sorted(ref_keys & keys):
        if isinstance(ref[k], ml_collections.ConfigDict):
            if not isinstance(config[k], ml_collections.ConfigDict):
                missing.append(f"{prefix}{k}.*")
                continue
            m, u = _key_diff(ref[k], config[k], f"{prefix}{k}.")
            missing, unknown = missing + m, unknown + u
    return missing, unknown


def make_optimizer(optim, *, total_steps: int, updates_per_step: int = 1):
    """AdamW with warmup then cosine decay (or constant), and global-norm clipping.

    The schedule is in RL steps (each makes `updates_per_step` optimizer updates).
    Returns (optax transformation, schedule(step) -> learning rate).
    """
    warmup = optax.linear_schedule(0.0, optim.lr, optim.warmup_steps)
    if optim.schedule == "cosine":
        main = optax.cosine_decay_schedule(optim.lr, max(total_steps - optim.warmup_steps, 1),
                                           alpha=optim.min_lr_ratio)
    else:
        main = optax.constant_schedule(optim.lr)
    schedule = optax.join_schedules([warmup, main], [optim.warmup_steps])

    def per_update(count):
        return schedule(count // updates_per_step)

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


# ================================================================================== episodes


@dataclasses.dataclass
class Episodes:
    """A batch of finished episodes on the host (numpy): one row per sample, G rows per group.

    A row is its group's prompt (left-padded to a fixed width, identical for the G rows of a
    group, which are consecutive) and the row's continuation: everything after the prompt
    (model turns and, in multi-turn episodes, tool observations), right-padded. Per-token
    arrays are aligned with `tokens_bn`: column j describes continuation token j, whose
    log-prob is that of the token given everything before it. `loss_mask_bn` is 1 only on
    tokens the model produced and is trained on (never on observations or padding).

    The learner runs each group's prompt once and continues it G times through the KV cache,
    as the sampler does, so a long prompt costs one forward and one backward per group.
    `meta` is host-only (texts, feedback, domain) and never goes to the device.
    """

    prompt_bp: np.ndarray  # int32 [b, p]: the group's prompt, left-padded
    prompt_lens_b: np.ndarray  # int32 [b]
    tokens_bn: np.ndarray  # int32 [b, n]: the continuation, right-padded
    lengths_b: np.ndarray  # int32 [b]: tokens in the continuation
    loss_mask_bn: np.ndarray  # float32 [b, n]
    rollout_logp_bn: np.ndarray  # float32 [b, n]: the sampler's temperature-1 log-probs
    rewards_b: np.ndarray  # float32 [b]
    group_ids_b: np.ndarray  # int32 [b]
    meta: list = dataclasses.field(default_factory=list)  # one dict per row

    @classmethod
    def from_rows(cls, prompts, continuations, loss_masks, rollout_logps, rewards, group_ids,
                  *, prompt_len, length, meta=None, pad_id=0) -> Episodes:
        """Packs per-row lists (prompt ids; continuation ids with one 0/1 loss-mask value and
        one log-prob each) into arrays of `prompt_len` and `length` columns."""
        b = len(prompts)
        out = cls(prompt_bp=np.full((b, prompt_len), pad_id, np.int32),
                  prompt_lens_b=np.zeros(b, np.int32),
                  tokens_bn=np.full((b, length), pad_id, np.int32),
                  lengths_b=np.zeros(b, np.int32),
                  loss_mask_bn=np.zeros((b, length), np.float32),
                  rollout_logp_bn=np.zeros((b, length), np.float32),
                  rewards_b=np.asarray(rewards, np.float32).reshape(b),
                  group_ids_b=np.asarray(group_ids, np.int32).reshape(b),
                  meta=list(meta) if meta is not None else [{} for _ in range(b)])
        rows = zip(prompts, continuations, loss_masks, rollout_logps)
        for i, (prompt, tok, mask, logp) in enumerate(rows):
            p, n = len(prompt), len(tok)
            if not 0 < p <= prompt_len:
                raise ValueError(f"episode {i}: its prompt has {p} tokens; it needs 1 to "
                                 f"prompt_len={prompt_len}")
            if n > length:
                raise ValueError(f"episode {i} continues its prompt with {n} tokens, more than "
                                 f"the length {length}; raise the cap or cut the episode")
            if len(mask) != n or len(logp) != n:
                raise ValueError(f"episode {i}: {n} tokens but {len(mask)} mask values and "
                                 f"{len(logp)} log-probs; give one per token")
            out.prompt_bp[i, prompt_len - p:], out.prompt_lens_b[i] = prompt, p
            out.tokens_bn[i, :n], out.lengths_b[i] = tok, n
            out.loss_mask_bn[i, :n], out.rollout_logp_bn[i, :n] = mask, logp
        return out

    @classmethod
    def from_histories(cls, tokens, loss_masks, rollout_logps, rewards, group_ids, *,
                       prompt_lens, prompt_len, length, meta=None, pad_id=0) -> Episodes:
        """Like `from_rows`, from whole histories (prompt included): row i's first
        prompt_lens[i] tokens are its prompt, the rest its continuation."""
        split = [(list(t[:p]), list(t[p:]), list(m[p:]), list(lp[p:]))
                 for t, m, lp, p in zip(tokens, loss_masks, rollout_logps, prompt_lens)]
        for i, (t, m, p) in enumerate(zip(tokens, loss_masks, prompt_lens)):
            if any(m[:p]):
                raise ValueError(f"episode {i}: its loss mask is 1 inside the prompt (the "
                                 f"first {p} tokens); prompt tokens are never trained on")
        prompts, continuations, masks, logps = zip(*split) if split else ((),) * 4
        return cls.from_rows(prompts, continuations, masks, logps, rewards, group_ids,
                             prompt_len=prompt_len, length=length, meta=meta, pad_id=pad_id)

    def __len__(self):
        return len(self.tokens_bn)

    def columns(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def arrays(self) -> dict[str, np.ndarray]:
        """What goes to the device."""
        return {k: v for k, v in self.columns().items() if k != "meta"}

    def check_groups(self, group_size: int) -> None:
        """Groups must be G consecutive rows with one id and one prompt."""
        b = len(self)
        if b % group_size:
            raise ValueError(f"{b} episodes do not form groups of {group_size}")
        for name, what in (("group_ids_b", "group id"), ("prompt_bp", "prompt")):
            x = getattr(self, name).reshape((b // group_size, group_size, -1))
            if not (x == x[:, :1]).all():
                raise ValueError(f"episodes: the {group_size} consecutive rows of a group must "
                                 f"share their {what}; keep each prompt's samples together")


# =================================================================================== learner


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The static part of the compiled steps (hashable)."""

    kind: str  # "rl" | "sft" | "critic"
    group_size: int = 1  # rows sharing one prompt
    estimator: str = "grpo"
    loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = 3.0
    agg: str = "token-mean"
    gamma: float = 1.0
    lam: float = 1.0
    clip_value: float = 0.5
    entropy_coef: float = 0.0
    tis_cap: float = 0.0
    tis_level: str = "token"
    kl_kind: str = "k3"
    kl_loss: bool = False
    kl_in_reward: bool = False
    has_old_logp: bool = False
    chunk: int = 256
    epochs: int = 1
    minibatches: int = 1
    microbatch: int = 0


class Learner:
    """The static context of a run (mesh, model graph, optimizer, sampler, compiled steps)
    and its stages. Parameters and optimizer state are passed in and out, never kept."""

    def __init__(self, config, *, mesh=None, params=None, tokenizer=None):
        """mesh: default from config.mesh. params: initial parameters (default: the config's
        model); they are donated to the first update. tokenizer: default config.tokenizer."""
        check_config(config)
        self.config = c = config
        self.mesh = sharding.mesh_from_config(c.mesh) if mesh is None else mesh
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(c.tokenizer)
        self.model_config = model_config(c)
        if params is None:
            self.graphdef, self.initial_params = nnx.split(build_model(c, self.mesh))
        else:  # e.g. the result of `sft`, placed like a fresh model
            self.graphdef, abstract = sharding.abstract(lambda: model_lib.Transformer(
                self.model_config, rngs=nnx.Rngs(0), mesh=self.mesh), self.mesh)
            self.initial_params = jax.device_put(params, jax.tree.map(
                lambda x: x.sharding, abstract) if self.mesh is not None else None)
        self.pad_id = _pad_id(self.tokenizer)
        rl, s = c.rl, c.sampling
        updates = rl.ppo_epochs * rl.num_minibatches
        self.tx, self.schedule = make_optimizer(c.optim, total_steps=c.steps,
                                                updates_per_step=updates)
        kl_on = c.kl.coef > 0
        self.settings = _Settings(
            kind="rl", group_size=s.num_samples, estimator=rl.estimator, loss=rl.loss,
            clip_low=rl.clip_low, clip_high=rl.clip_high, dual_clip=rl.dual_clip or None,
            agg=rl.agg, gamma=rl.gamma, lam=rl.lam, clip_value=c.critic.clip_value,
            entropy_coef=rl.entropy_coef,
            tis_cap=rl.tis_cap, tis_level=rl.tis_level, kl_kind=c.kl.kind,
            kl_loss=kl_on and not c.kl.in_reward, kl_in_reward=kl_on and c.kl.in_reward,
            has_old_logp=updates > 1 or (kl_on and c.kl.in_reward), chunk=rl.logprob_chunk,
            epochs=rl.ppo_epochs, minibatches=rl.num_minibatches,
            microbatch=rl.microbatch_size)
        # PPO's value function (rl.estimator="gae"): own parameters (`init_critic`),
        # optimizer and settings.
        self.critic_graphdef = None
        if rl.estimator == "gae":
            self.critic_graphdef = nnx.split(nnx.eval_shape(lambda: critic_lib.Critic(
                self.model_config, rngs=nnx.Rngs(0), mesh=self.mesh)))[0]
            self.critic_tx, self.critic_schedule = make_optimizer(
                c.critic.optim, total_steps=c.steps, updates_per_step=updates)
            self.critic_settings = dataclasses.replace(self.settings, kind="critic")
        self.sft_tx, self.sft_schedule = make_optimizer(c.sft.optim, total_steps=c.sft.steps)
        self.sft_settings = _Settings(kind="sft", chunk=rl.logprob_chunk,
                                      microbatch=c.sft.microbatch_size)
        # The reference policy is a copy: the live parameters are donated to each update.
        self.ref_params = jax.tree.map(jnp.copy, self.initial_params) if kl_on else None
        self.sampler = sampler_lib.Sampler(
            nnx.merge(self.graphdef, self.initial_params), seed=c.seed, pad_id=self.pad_id,
            decode=self.decode if self.tokenizer is not None else None,
            stop_check_every=s.stop_check_every)

    # ------------------------------------------------------------------ state

    def init_opt_state(self, params, tx=None):
        """Optimizer state (default `tx`: the policy's), sharded like the parameters it
        mirrors (the critic's: `init_opt_state(critic_params, learner.critic_tx)`)."""
        tx = tx or self.tx
        shardings = None
        if self.mesh is not None:
            param_shardings = jax.tree.map(lambda x: x.sharding, params)
            shardings = opt_state_shardings(tx, params, param_shardings, self.mesh)
        return jax.jit(tx.init, out_shardings=shardings)(params)

    def init_critic(self):
        """Fresh critic parameters (rl.estimator="gae"), sharded like the policy's: the
        decoder of `initial_params` (critic.init="policy"; call this before they are donated
        to an update) or a random one (seed + 1), and a new value head."""
        c = self.config
        if self.critic_graphdef is None:
            raise ValueError(f"rl.estimator={c.rl.estimator!r} has no critic; use 'gae'")
        policy = self.initial_params if c.critic.init == "policy" else None
        return critic_lib.init(self.model_config, seed=c.seed + 1, mesh=self.mesh,
                               policy_params=policy)[1]

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            return " ".join(str(int(i)) for i in ids)
        return self.tokenizer.decode(list(ids))

    def encode(self, record, ids_key, text_key) -> list[int]:
        """Token ids of a record's field: `ids_key` (ids), or `text_key` with the tokenizer."""
        if ids_key in record:
            return [int(t) for t in record[ids_key]]
        if self.tokenizer is None or text_key not in record:
            raise ValueError(f"record {_short(record)} has no {ids_key!r}; give token ids, or "
                             f"{text_key!r} text and config.tokenizer")
        return list(self.tokenizer.encode(record[text_key]))

    # ------------------------------------------------------------------ stages

    def rollout(self, params, records, key, *, reward_fn=None) -> Episodes:
        """The default single-turn producer: G samples per prompt, each scored by reward_fn
        (default config.reward_fn). Rows of prompt i form group i."""
        c, s = self.config, self.config.sampling
        reward_fn = reward_fn or c.reward_fn
        if reward_fn is None:
            raise ValueError("config.reward_fn is not set: give a callable "
                             "reward_fn(record, completion_ids, completion_text)")
        prompts = [self.encode(r, "prompt_ids", "prompt") for r in records]
        for record, prompt in zip(records, prompts):
            if len(prompt) > c.data.max_prompt_len:
                raise ValueError(f"prompt {_short(record)} has {len(prompt)} tokens, more than "
                                 f"data.max_prompt_len={c.data.max_prompt_len}")
        out = self.sampler.sample(
            params, prompts, max_new_tokens=s.max_new_tokens, num_samples=s.num_samples,
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
            stop_token_ids=tuple(s.stop_token_ids), stop_strings=tuple(s.stop_strings),
            key=key, prompt_len=c.data.max_prompt_len, batch_size=len(prompts))
        completions = out.completions()
        rewards, meta = [], []
        for r, completion in enumerate(completions):
            i = out.prompt_index[r]
            text = self.decode(completion)
            reward, feedback = _reward_and_feedback(reward_fn(records[i], completion, text))
            rewards.append(reward)
            meta.append({"prompt": self.decode(prompts[i]), "completion": text,
                         "feedback": feedback, "finish_reason": out.finish_reasons[r]})
        return Episodes.from_rows(
            [prompts[i] for i in out.prompt_index], completions,
            [[1] * len(x) for x in completions], [out.logp_t1[r, :len(x)]
                                                   for r, x in enumerate(completions)],
            rewards, out.prompt_index, prompt_len=c.data.max_prompt_len,
            length=s.max_new_tokens, meta=meta, pad_id=self.pad_id)

    def prepare(self, params, episodes: Episodes, kl_coef: float = 0.0, *,
                critic_params=None):
        """Device batch for `update`: advantages, log-probs of the current (when needed) and
        reference policies, KL in the reward; with rl.estimator="gae", the critic's values
        (`critic_params`), GAE advantages and returns. Returns (batch, metrics)."""
        if (critic_params is None) != (self.critic_graphdef is None):
            raise ValueError("prepare: pass critic_params exactly when rl.estimator='gae' "
                             f"(here {self.settings.estimator!r})")
        episodes.check_groups(self.settings.group_size)
        batch = sharding.shard_batch(episodes.arrays(), self.mesh)
        return _prepare(params, self.ref_params, critic_params, batch, jnp.float32(kl_coef),
                        graphdef=self.graphdef, critic_graphdef=self.critic_graphdef,
                        s=self.settings)

    def update(self, params, opt_state, batch, kl_coef: float = 0.0):
        """PPO epochs over minibatches; the inputs are donated. Returns (params, opt_state,
        metrics) with metrics averaged over the optimizer updates."""
        fn = _jit_update(self.graphdef, self.settings, self.tx, self.mesh)
        return fn(params, opt_state, batch, jnp.float32(kl_coef))

    def update_critic(self, critic_params, critic_opt_state, batch):
        """The critic's clipped value-loss updates on the minibatches and epochs of `update`
        (optimizer `critic_tx`); the inputs but the batch are donated. Returns (critic_params,
        critic_opt_state, metrics) with metrics averaged over the updates."""
        fn = _jit_update(self.critic_graphdef, self.critic_settings, self.critic_tx, self.mesh)
        return fn(critic_params, critic_opt_state, batch, jnp.float32(0.0))

    def sft_update(self, params, opt_state, episodes: Episodes):
        """One supervised step (optimizer `sft_tx`) on the loss-masked tokens; the inputs are
        donated. metrics["sft/loss"] is the loss before the update."""
        fn = _jit_update(self.graphdef, self.sft_settings, self.sft_tx, self.mesh)
        batch = sharding.shard_batch(episodes.arrays(), self.mesh)
        return fn(params, opt_state, batch, jnp.float32(0.0))


@functools.cache
def _jit_update(graphdef, settings, tx, mesh):
    return jax.jit(functools.partial(_update, graphdef=graphdef, s=settings, tx=tx, mesh=mesh),
                   donate_argnums=(0, 1))


def _runtime_overrides(config) -> dict:
    """With hf_model, config.model's run-time keys still apply (model.RUNTIME_FIELDS)."""
    return {k: config.model[k] for k in model_lib.RUNTIME_FIELDS if k in config.model}


def model_config(config) -> model_lib.ModelConfig:
    if config.hf_model:
        from ptrain import hf
        return dataclasses.replace(hf.config_from_hf(hf.read_config(config.hf_model)),
                                   **_runtime_overrides(config))
    return model_lib.ModelConfig(**config.model.to_dict())


def build_model(config, mesh) -> model_lib.Transformer:
    """The config's model, born sharded: loaded from hf_model, or initialised from the seed."""
    if config.hf_model:
        from ptrain import hf
        return hf.load(config.hf_model, mesh=mesh, overrides=_runtime_overrides(config))[0]
    return model_lib.init(model_config(config), seed=config.seed, mesh=mesh)


def _load_tokenizer(path):
    if not path:
        return None
    from ptrain import hf
    return hf.load_tokenizer(path)


def _pad_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def _reward_and_feedback(value):
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(f"reward_fn returned {value!r}; return a number or "
                             "(reward, feedback)")
        return float(value[0]), value[1]
    return float(value), None


def _short(record, n=80):
    text = json.dumps(record, default=str)
    return text if len(text) <= n else text[:n] + "...}"


# ------------------------------------------------------------------------- device programs


def token_logprobs(graphdef, params, batch, *, group_size=1, chunk=256):
    """log p(token | everything before it) of every continuation token, and the entropy of
    that distribution ([b, n] each), computed in chunks (never float32 [b, n, v]).

    Each group's prompt runs once (rows 0, G, 2G, ... hold the prompts); its KV cache is
    repeated for the G continuations, so gradients from all G reach the one prompt forward.
    """
    model = nnx.merge(graphdef, params)
    tokens_bn = batch["tokens_bn"]
    h_gd, h_bnd = _continuation_hidden(model, batch, group_size)
    # Token j is predicted by the hidden state before it: the prompt's last for j = 0, else
    # the row's state j - 1. The int32 targets shift, not the (time-sharded) hidden states,
    # so with sequence parallelism each shard scores its own tokens.
    w_dv = model.unembedding_vd().T
    next_bn = jnp.pad(tokens_bn[:, 1:], ((0, 0), (0, 1)))
    logp_bn, ent_bn = losses.chunked_logprobs(h_bnd, w_dv, next_bn, chunk=chunk,
                                              return_entropy=True, mesh=model.mesh)
    first_b1 = losses.chunked_logprobs(jnp.repeat(h_gd, group_size, axis=0)[:, None], w_dv,
                                       tokens_bn[:, :1], return_entropy=True)
    return tuple(jnp.concatenate([a_b1, a_bn[:, :-1]], axis=1)
                 for a_b1, a_bn in zip(first_b1, (logp_bn, ent_bn)))


def token_values(critic_graphdef, critic_params, batch, *, group_size=1):
    """The critic's value of the state before each continuation token, float32 [b, n]: for
    token j, the value at the prompt's last token (j = 0) or at the row's token j - 1, the
    alignment of `token_logprobs` (verl's values[:, -response_length - 1:-1])."""
    critic = nnx.merge(critic_graphdef, critic_params)
    h_gd, h_bnd = _continuation_hidden(critic.decoder, batch, group_size)
    first_b = jnp.repeat(critic.values(h_gd), group_size)
    return jnp.concatenate([first_b[:, None], critic.values(h_bnd)[:, :-1]], axis=1)


def _continuation_hidden(model, batch, group_size):
    """Final hidden states of each group's prompt (its last token, [b / G, d]) and of every
    continuation token ([b, n, d]); the prompt runs once, its KV cache repeated G times."""
    tokens_bn, lengths_b = batch["tokens_bn"], batch["lengths_b"]
    n = tokens_bn.shape[1]
    h_gd, cache = sampler_lib.prefill_shared(
        model, batch["prompt_bp"][::group_size], batch["prompt_lens_b"][::group_size],
        repeats=group_size, extra_slots=n)
    valid_bn = (jnp.arange(n)[None, :] < lengths_b[:, None]).astype(jnp.int32)
    positions_bn = batch["prompt_lens_b"][:, None] + jnp.arange(n)[None, :]
    h_bnd, _ = model.hidden(tokens_bn, positions_bn, valid_bn, cache)
    return h_gd, h_bnd


def _last_token_onehot(mask_bn):
    """1 on the last token of each row where the mask is 1 (the sequence reward goes there)."""
    n = mask_bn.shape[1]
    last_b = n - 1 - jnp.argmax(mask_bn[:, ::-1] > 0, axis=1)
    return (jnp.arange(n)[None, :] == last_b[:, None]) & (mask_bn.sum(-1, keepdims=True) > 0)


@functools.partial(jax.jit, static_argnames=("graphdef", "critic_graphdef", "s"))
def _prepare(params, ref_params, critic_params, batch, kl_coef, *, graphdef, critic_graphdef,
             s: _Settings):
    mask_bn = batch["loss_mask_bn"]
    logp = functools.partial(token_logprobs, graphdef, batch=batch, group_size=s.group_size,
                             chunk=s.chunk)
    out, metrics = dict(batch), {}
    old_bn = logp(params)[0] if s.has_old_logp else None
    if old_bn is not None:
        out["old_logp_bn"] = old_bn
        metrics["rollout/logp_mismatch"] = losses.masked_mean(
            jnp.abs(old_bn - batch["rollout_logp_bn"]), mask_bn)
    if s.kl_loss or s.kl_in_reward:
        out["ref_logp_bn"] = logp(ref_params)[0]
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
        values_bn = token_values(critic_graphdef, critic_params, batch, group_size=s.group_size)
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


def _rl_loss(params, x, num_tokens, num_seqs, kl_coef, *, graphdef, s: _Settings):
    """The loss of one microbatch, normalised by the whole minibatch's token and sequence
    counts, so that microbatch losses (and gradients) add up to the minibatch's."""
    mask_bn = x["loss_mask_bn"]
    logp_bn, ent_bn = token_logprobs(graphdef, params, x, group_size=s.group_size,
                                     chunk=s.chunk)
    share = mask_bn.sum() / jnp.maximum(num_tokens, 1)  # this microbatch's share of the tokens
    agg = functools.partial(losses.agg_loss, mask_bt=mask_bn, mode=s.agg, num_tokens=num_tokens,
                            num_seqs=num_seqs)
    if s.kind == "sft":
        loss = -agg(logp_bn)
        return loss, {"sft/loss": loss,
                      "sft/entropy": share * losses.masked_mean(ent_bn, mask_bn)}
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
    loss = pg_loss
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


def _critic_loss(params, x, num_tokens, num_seqs, kl_coef, *, graphdef, s: _Settings):
    """The clipped value loss of one microbatch, normalised like `_rl_loss`."""
    del kl_coef
    mask_bn = x["loss_mask_bn"]
    vpreds_bn = token_values(graphdef, params, x, group_size=s.group_size)
    share = mask_bn.sum() / jnp.maximum(num_tokens, 1)
    loss, clipfrac = losses.value_loss(vpreds_bn, x["returns_bn"], x["old_values_bn"], mask_bn,
                                       clip_value=s.clip_value, agg=s.agg,
                                       num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, {"critic/vf_clipfrac": share * clipfrac,
                  "critic/vpred_mean": share * losses.masked_mean(
                      jax.lax.stop_gradient(vpreds_bn), mask_bn)}


def _update(params, opt_state, batch, kl_coef, *, graphdef, s: _Settings, tx, mesh):
    """All optimizer updates of one step: epochs x minibatches, each minibatch's gradient
    accumulated over microbatches (a scan, so the program does not grow with their number).

    Groups (G consecutive rows) are dealt out in turn: group j goes to minibatch j % m and to
    microbatch (j // m) % k of it. Each device keeps its own rows (the split moves no data
    between devices) and the minibatches do not depend on the microbatch size.
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
    grad_fn = jax.value_and_grad(functools.partial(loss_fn, graphdef=graphdef, s=s),
                                 has_aux=True)

    def minibatch(carry, i):
        params, opt_state = carry
        mb = jax.tree.map(lambda x: x[i], split)
        mb_mask = mb["loss_mask_bn"]
        num_tokens = mb_mask.sum()
        num_seqs = (mb_mask.sum(-1) > 0).sum()

        def accumulate(grads, x):
            (loss, metrics), g = grad_fn(params, x, num_tokens, num_seqs, kl_coef)
            return jax.tree.map(jnp.add, grads, g), {loss_key: loss, **metrics}

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, metrics = jax.lax.scan(accumulate, zeros, mb)
        metrics = jax.tree.map(lambda v: v.sum(0), metrics)
        metrics[f"{prefix}/grad_norm"] = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), metrics

    order = jnp.tile(jnp.arange(m), s.epochs)
    (params, opt_state), metrics = jax.lax.scan(minibatch, (params, opt_state), order)
    return params, opt_state, jax.tree.map(lambda v: v.mean(0), metrics)


# ================================================================================ the loop


def train(config, workdir, *, params=None, rollout_fn=None, producer=None, mesh=None,
          tokenizer=None):
    """Runs RL from the config; resumes from the latest checkpoint in `workdir`.

    params: initial parameters (e.g. from `sft`); default: the config's model.
    rollout_fn(params, records, key) -> Episodes replaces the default single-turn rollout
      (`Learner.rollout`); records are one batch of data.prompts_per_step prompt records.
    producer: instead of rollout_fn, an object with `generate(params, records, key)` (the
      device part: sampling, tool calls) and `score(generated) -> Episodes` (verdicts from
      the sandbox). With rl.staleness=1, batch t is scored in a thread while batch t+1 is
      generated, so the accelerator does not wait for the sandbox.
    tokenizer: default config.tokenizer.
    Returns the final parameters.
    """
    # ---------------------------------------------------------------- set-up
    c = config
    learner = Learner(c, mesh=mesh, params=params, tokenizer=tokenizer)
    if rollout_fn is not None and producer is not None:
        raise ValueError("give rollout_fn or producer, not both")
    if c.rl.staleness and producer is None:
        raise ValueError("rl.staleness=1 overlaps scoring with generation: pass a producer "
                         "with separate generate() and score()")
    if producer is not None:
        def rollout_fn(params, records, key):
            return producer.score(producer.generate(params, records, key))
    rollout_fn = rollout_fn or learner.rollout
    os.makedirs(workdir, exist_ok=True)
    prompts = _prompt_stream(c.data, c.data.prompts_per_step, c.seed, workdir, "prompts",
                             on_error=c.data.on_error)
    root_key = jax.random.key(c.seed)
    kl_ctl = losses.KLController(c.kl.coef, target=c.kl.target or None, horizon=c.kl.horizon)

    # ---------------------------------------------------------------- restore or start
    params = learner.initial_params
    opt_state = learner.init_opt_state(params)
    critic = None  # PPO's value function: {"params": ..., "opt_state": ...}
    if learner.critic_graphdef is not None:
        critic_params = learner.init_critic()
        critic = {"params": critic_params,
                  "opt_state": learner.init_opt_state(critic_params, learner.critic_tx)}
    ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       max_to_keep=c.checkpoint.keep,
                                       async_save=c.checkpoint.async_save)
    start, data_state = 0, None
    if ckpt.latest_step() is not None:
        restored = ckpt.restore(params=params, opt_state=opt_state, rng=root_key,
                                aux_state=critic and {"critic": critic})
        start, params, opt_state = restored.step, restored.params, restored.opt_state
        critic = restored.aux_state.get("critic")
        data_state = restored.data_state
        kl_ctl = dataclasses.replace(kl_ctl, value=restored.extra["kl_coef"])
        logging.info("resumed from step %d", start)
    batches = prompts.iterator(data_state)
    writer = metrics_lib.MetricsWriter(workdir, total_steps=c.steps, start_step=start)
    scorer = concurrent.futures.ThreadPoolExecutor(1) if c.rl.staleness else None
    ahead = None  # staleness 1: batch t+1, generated while batch t is scored

    for step in range(start + 1, c.steps + 1):
        t0 = time.perf_counter()
        key = jax.random.fold_in(root_key, step)

        # ------------------------------------------------------------ rollouts
        if c.rl.staleness:
            # Batch t was generated last step (from the parameters before that update);
            # score it while batch t+1 is generated from the current parameters.
            if ahead is None:  # the first step of a run (or of a resumed run)
                ahead = producer.generate(params, next(batches), key)
            scoring = scorer.submit(producer.score, ahead)
            data_state = batches.get_state()  # batch t drawn, t+1 not yet
            if step < c.steps:
                ahead = producer.generate(params, next(batches),
                                          jax.random.fold_in(root_key, step + 1))
            # (collect_episodes draws nothing here: the batch is the one just scored.)
            episodes, gen_metrics = collect_episodes(lambda records, attempt: scoring.result(),
                                                     iter([None]), c)
        else:
            # With DAPO dynamic sampling, groups whose rewards are all equal carry no signal:
            # sample more prompts until the batch is full of informative groups (or the cap).
            episodes, gen_metrics = collect_episodes(
                lambda records, attempt: rollout_fn(params, records,
                                                    jax.random.fold_in(key, attempt)),
                batches, c)
            data_state = batches.get_state()
        t1 = time.perf_counter()

        # ------------------------------------------------------------ advantages, update
        batch, prep_metrics = learner.prepare(params, episodes, kl_ctl.value,
                                              critic_params=critic and critic["params"])
        critic_metrics = {}
        if critic is not None:  # verl: the critic, then the actor, on the same minibatches
            critic_params, critic_opt, critic_metrics = learner.update_critic(
                critic["params"], critic["opt_state"], batch)
            critic = {"params": critic_params, "opt_state": critic_opt}
            critic_metrics["critic/lr"] = learner.critic_schedule(step - 1)
        params, opt_state, upd_metrics = learner.update(params, opt_state, batch, kl_ctl.value)
        prep_metrics, upd_metrics, critic_metrics = jax.device_get(
            (prep_metrics, upd_metrics, critic_metrics))
        if c.kl.coef > 0 and c.kl.in_reward:
            kl_ctl = kl_ctl.update(prep_metrics["kl/in_reward"], n_steps=len(episodes))
        t2 = time.perf_counter()

        # ------------------------------------------------------------ log
        if step % c.log.every == 0 or step == c.steps:
            writer.write(step, {
                **gen_metrics, **prep_metrics, **critic_metrics, **upd_metrics,
                "optim/lr": float(learner.schedule(step - 1)), "kl/coef": kl_ctl.value,
                "time/rollout_s": t1 - t0, "time/update_s": t2 - t1, "time/step_s": t2 - t0,
            })
        if c.log.rollouts_every and step % c.log.rollouts_every == 0:
            writer.write_rollouts(step, rollout_samples(episodes, c.log.num_rollouts))

        # ------------------------------------------------------------ checkpoint
        # (With staleness 1 the saved data state is the one before batch t+1 was drawn: a
        # resumed run draws it again and generates it from the restored parameters.)
        if step % c.checkpoint.every == 0 or step == c.steps:
            ckpt.save(step, params=params, opt_state=opt_state, rng=root_key,
                      data_state=data_state, extra={"kl_coef": kl_ctl.value},
                      aux_state=critic and {"critic": critic})

    if scorer is not None:
        scorer.shutdown()
    ckpt.wait()
    ckpt.close()
    writer.plot()
    writer.close()
    return params


def collect_episodes(rollout, batches, config):
    """Calls rollout(records, attempt) on prompt batches until the step's batch is full.

    Without dynamic sampling: one call. With it: rows of groups whose rewards are all equal
    are dropped and more prompts are drawn, up to dapo.max_gen_batches calls; a batch still
    short is topped up with dropped groups (their advantage is 0) and the count is logged.
    The DAPO overlong penalty is added to the rewards first. Returns (Episodes, metrics).
    """
    c = config
    n_groups = c.data.prompts_per_step
    acc, full, all_rewards, last = None, False, [], None
    calls = 0
    for attempt in range(c.dapo.max_gen_batches if c.dapo.dynamic_sampling else 1):
        episodes = rollout(next(batches), attempt)
        calls += 1
        _check_episodes(episodes, c)
        if c.dapo.overlong_buffer:
            lengths_b = episodes.loss_mask_bn.sum(-1)
            episodes.rewards_b = episodes.rewards_b + np.asarray(losses.overlong_penalty(
                lengths_b, max_len=c.sampling.max_new_tokens, buffer_len=c.dapo.overlong_buffer,
                penalty_factor=c.dapo.overlong_penalty))
        # Group ids unique across the calls of this step.
        _, local = np.unique(episodes.group_ids_b, return_inverse=True)
        episodes.group_ids_b = (attempt * len(episodes) + local).astype(np.int32)
        all_rewards.append(episodes.rewards_b)
        last = episodes
        if not c.dapo.dynamic_sampling:
            acc, full = episodes.columns(), True
            break
        keep = losses.informative_groups(episodes.rewards_b, episodes.group_ids_b)
        acc, full = losses.accumulate_groups(acc, episodes.columns(), keep, num_groups=n_groups,
                                             group_key="group_ids_b")
        if full:
            break
    rewards = np.concatenate(all_rewards)
    metrics = {"reward/mean": rewards.mean(), "reward/std": rewards.std(),
               "reward/max": rewards.max(), "reward/min": rewards.min()}
    if c.dapo.dynamic_sampling:
        filler = 0
        if not full:
            before = len(set(np.asarray(acc["group_ids_b"]).tolist()))
            keep = losses.informative_groups(last.rewards_b, last.group_ids_b)
            acc, full = losses.accumulate_groups(acc, last.columns(), ~keep, num_groups=n_groups,
                                                 group_key="group_ids_b")
            filler = len(set(np.asarray(acc["group_ids_b"]).tolist())) - before
        if not full:
            raise ValueError("dynamic sampling could not fill the batch: a rollout returned "
                             f"fewer than data.prompts_per_step={n_groups} groups")
        metrics.update({"dapo/gen_batches": calls, "dapo/uninformative_groups": filler,
                        "reward/batch_mean": np.mean(acc["rewards_b"])})
    episodes = Episodes(**acc)
    mask = episodes.loss_mask_bn
    metrics["response/length_mean"] = mask.sum(-1).mean()
    metrics["response/length_max"] = mask.sum(-1).max()
    reasons = [m.get("finish_reason") for m in episodes.meta]
    if any(r is not None for r in reasons):
        metrics["response/clip_ratio"] = np.mean([r == "length" for r in reasons])
    metrics.update(domain_metrics(episodes))
    return episodes, metrics


def domain_metrics(episodes: Episodes) -> dict[str, float]:
    """Per-domain means when the rows' meta name a domain: reward/<domain>/mean, and the
    numeric episode fields a producer reports (pass rate, turns, tool calls and errors)."""
    fields = ("passed", "turns", "tool_calls", "tool_errors", "attempts")
    by_domain: dict[str, list[int]] = {}
    for i, meta in enumerate(episodes.meta):
        if "domain" in meta:
            by_domain.setdefault(meta["domain"], []).append(i)
    out = {}
    for domain, rows in sorted(by_domain.items()):
        out[f"reward/{domain}/mean"] = float(np.mean(episodes.rewards_b[rows]))
        for field in fields:
            values = [episodes.meta[i][field] for i in rows if field in episodes.meta[i]]
            if values:
                out[f"episode/{domain}/{field}"] = float(np.mean(values))
    return out


def _check_episodes(episodes, config):
    rows = config.data.prompts_per_step * config.sampling.num_samples
    if not isinstance(episodes, Episodes):
        raise TypeError(f"rollout_fn must return an Episodes, got {type(episodes).__name__}")
    if len(episodes) != rows:
        raise ValueError(f"rollout_fn returned {len(episodes)} rows; the batch shape is fixed "
                         f"at data.prompts_per_step * sampling.num_samples = {rows}")


def rollout_samples(episodes: Episodes, n: int) -> list[dict]:
    """The first n rows as rollouts.jsonl samples (prompt, completion, reward, feedback...)."""
    out = []
    for i in range(min(n, len(episodes))):
        meta = episodes.meta[i] if i < len(episodes.meta) else {}
        out.append({"prompt": meta.get("prompt", ""), "completion": meta.get("completion", ""),
                    **meta, "reward": float(episodes.rewards_b[i]),
                    "group": int(episodes.group_ids_b[i])})
    return out


def _prompt_stream(data, batch_size, seed, workdir, name, *, on_error):
    """A `ptrain.data` stream over the config's sources, or over records_fn(seed) written to
    <workdir>/<name>.jsonl (so that the run's data is on disk next to its logs)."""
    sources = list(data.sources)
    if data.records_fn is not None:
        path = os.path.join(workdir, f"{name}.jsonl")
        metrics_lib.write_jsonl(data.records_fn(seed), path)
        sources = [path]
    if not sources:
        section = "sft" if name == "sft" else "data"
        raise ValueError(f"no {name}: set {section}.sources (JSONL / ArrayRecord files) or "
                         f"{section}.records_fn")
    return data_lib.prompt_batches(sources, batch_size=batch_size, seed=seed,
                                   on_error=on_error)


# ======================================================================================= SFT


def sft_episodes(learner: Learner, records, *, prompt_len, length) -> Episodes:
    """(prompt, completion) records as rows with the loss mask on the completion only.

    A record may carry `completion_mask` (0/1 per completion token): a multi-turn
    demonstration is trained on the model's turns, not on the tool observations in between.
    """
    prompts = [learner.encode(r, "prompt_ids", "prompt") for r in records]
    completions = [learner.encode(r, "completion_ids", "completion") for r in records]
    masks = [list(r.get("completion_mask", [1] * len(c))) for r, c in zip(records, completions)]
    return Episodes.from_rows(prompts, completions, masks,
                              [[0.0] * len(c) for c in completions], np.zeros(len(records)),
                              np.arange(len(records)), prompt_len=prompt_len, length=length,
                              pad_id=learner.pad_id)


def sft(config, workdir, *, params=None, mesh=None, tokenizer=None):
    """Supervised training on config.sft's (prompt, completion) records: token-mean negative
    log-likelihood of the completion tokens. Resumes from `workdir`; returns the parameters."""
    # ---------------------------------------------------------------- set-up
    c, sc = config, config.sft
    learner = Learner(c, mesh=mesh, params=params, tokenizer=tokenizer)
    os.makedirs(workdir, exist_ok=True)
    records = _prompt_stream(sc, sc.batch_size, c.seed, workdir, "sft", on_error="raise")
    # ---------------------------------------------------------------- restore or start
    params = learner.initial_params
    opt_state = learner.init_opt_state(params, learner.sft_tx)
    ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       max_to_keep=c.checkpoint.keep,
                                       async_save=c.checkpoint.async_save)
    root_key, start, data_state = jax.random.key(c.seed), 0, None
    if ckpt.latest_step() is not None:
        restored = ckpt.restore(params=params, opt_state=opt_state, rng=root_key)
        start, params, opt_state = restored.step, restored.params, restored.opt_state
        data_state = restored.data_state
    batches = records.iterator(data_state)
    writer = metrics_lib.MetricsWriter(workdir, total_steps=sc.steps, start_step=start)

    for step in range(start + 1, sc.steps + 1):
        t0 = time.perf_counter()
        try:
            episodes = sft_episodes(learner, next(batches), prompt_len=sc.max_prompt_len,
                                    length=sc.max_completion_len)
        except ValueError as e:  # name the keys of the SFT section, not the RL ones
            raise ValueError(f"SFT step {step}: {e} (prompt_len is sft.max_prompt_len="
                             f"{sc.max_prompt_len}, the length sft.max_completion_len="
                             f"{sc.max_completion_len})") from None
        params, opt_state, metrics = learner.sft_update(params, opt_state, episodes)
        if step % c.log.every == 0 or step == sc.steps:
            metrics = jax.device_get(metrics)
            writer.write(step, {"sft/loss": metrics["sft/loss"],
                                "sft/entropy": metrics["sft/entropy"],
                                "sft/grad_norm": metrics["optim/grad_norm"],
                                "optim/lr": float(learner.sft_schedule(step - 1)),
                                "time/step_s": time.perf_counter() - t0})
        if step % (sc.checkpoint_every or c.checkpoint.every) == 0 or step == sc.steps:
            ckpt.save(step, params=params, opt_state=opt_state, rng=root_key,
                      data_state=batches.get_state())
    ckpt.wait()
    ckpt.close()
    writer.close()
    return params
