"""Every key a run reads, with its default, and the one checker. Pure data: this module imports
ml_collections and nothing of JAX, so configs in configs/ build on it (`defaults()`, then set
only what the experiment changes).

  defaults()                  the learner's keys: model, data, sampling, rl, critic, kl, dapo,
                              optim, sft, log, checkpoint
  defaults(closed_loop=True)  plus the closed loop's sections: tasks (its environments),
                              rollout, reward, sandbox, eval
  plan_defaults()             a memory plan's keys (launch/plan.py)
  resolve(config)             the static settings of the device programs (`StepSettings`
                              for the RL, critic and SFT updates), resolved once
  check(config)               missing and unknown keys, bad values, with hf_model a model.*
                              key that contradicts config.json, and (given the mesh) batch
                              and sequence dimensions that do not divide their mesh axes

The checks that need the mesh run when the learner has built it (`check_mesh`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import os

import ml_collections

from ptrain import alerts
from ptrain import mesh_checks

ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce++", "reinforce++-baseline", "gae")
CRITIC_INITS = ("policy", "random")
POLICY_LOSSES = ("ppo", "gspo", "cispo")
SCHEDULES = ("cosine", "constant")
CHAT_FORMATS = ("plain", "qwen", "llama3")  # rollout.chat_format: ptrain.chat.FORMATS
# The closed loop's sections, beyond the learner's.
LOOP_SECTIONS = ("tasks", "rollout", "reward", "sandbox", "eval")
# The quickstart's generated environments (tasks.envs' default; ptrain.envs.synthetic)
GENERATED = ("ptrain.envs.code:generated", "ptrain.envs.math:arith",
             "ptrain.envs.files:generated")
SANDBOX_BACKENDS = ("auto", "docker", "bwrap", "process")  # sandbox.pick_backend's names
# lora.targets: the projections adapters may go on (Hugging Face module names, `ptrain.lora`)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ================================================================================ defaults


def _optim(**changes):
    out = dict(lr=1e-6, warmup_steps=0, schedule="cosine",  # SCHEDULES
               min_lr_ratio=0.0, weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8,
               grad_clip=1.0)  # 0: no clipping
    out.update(changes)
    return out


def defaults(*, closed_loop: bool = False) -> ml_collections.ConfigDict:
    """Every key the learner reads (and with closed_loop, the closed loop), with its default.
    `check` rejects missing and unknown keys."""
    c = ml_collections.ConfigDict()
    c.seed = 0  # the one seed: model init, data order, sampling
    c.steps = 100  # RL steps; each draws data.prompts_per_step prompts
    # ModelConfig fields for a randomly initialised model. With hf_model, config.json gives
    # the model; only the run-time keys (attention implementation, block sizes, remat) may
    # differ from it, and a key set here that contradicts it is an error.
    c.model = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                   tie_embeddings=False, rope_theta=10000.0, dtype="float32",
                   param_dtype="float32", remat="none", attention_impl="blockwise",
                   attn_block_q=512, attn_block_k=512,
                   # Mixture of experts (ModelConfig's fields; n_experts=0: dense). The
                   # router's aux and z loss coefficients weight those losses in SFT and RL.
                   n_experts=0, n_experts_per_token=0, d_ff_expert=0, norm_topk_prob=False,
                   moe_layer_step=1, dense_layers=(), n_shared_experts=0,
                   moe_dispatch="dropless", moe_capacity_factor=1.25,
                   router_aux_loss_coef=0.0, router_z_loss_coef=0.0,
                   router_loss_scope="microbatch")
    c.hf_model = ""  # a local Hugging Face model directory to start from
    c.tokenizer = ""  # a local Hugging Face tokenizer directory; "" means records carry ids
    # expert: the MoE experts' axis (tokens reach them by all-to-all; it also holds rows).
    c.mesh = dict(data=1, fsdp=-1, expert=1, sequence=1, tensor=1)
    # Prompts: JSONL/ArrayRecord `sources` (paths or (path, weight)), or `records_fn(seed)`
    # returning a list of dicts (written once to <workdir>/prompts.jsonl). A record holds
    # "prompt_ids" (token ids) or "prompt" (text, with a tokenizer) and whatever the reward
    # function needs.
    c.data = dict(sources=(), records_fn=None, prompts_per_step=8, max_prompt_len=64,
                  on_error="raise")
    # reward_fn(record, completion_ids, completion_text) -> reward, or (reward, feedback text).
    c.reward_fn = None
    # engine: the producers sample through the rollout engine (ptrain/generate/engine.py, continuous
    # batching over engine_slots decode slots) instead of the static sampler. decode_dtype
    # (engine only): "" decodes the learner's weights as they are; "bfloat16" (or "float32")
    # a copy in that dtype resharded for decoding (heads over tensor, no FSDP gathers per
    # token), refreshed after each update (`ptrain.generate.decode_weights`; time/weight_sync_s).
    c.sampling = dict(num_samples=8, max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0,
                      stop_token_ids=(), stop_strings=(), stop_check_every=16, engine=False,
                      engine_slots=32, decode_dtype="")
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
        # Rows per pass of the prepare step (old, reference log-probs and the critic's
        # values), a multiple of sampling.num_samples (verl's log_prob_micro_batch_size);
        # 0: the whole batch in one pass.
        logprob_microbatch_size=0,
        # 0: on-policy. k >= 1: generation runs k batches ahead of the learner (batch t+k is
        # generated at step t from its parameters; each batch is scored in a thread
        # meanwhile), so a batch trains up to k updates late (`ptrain.lookahead`); needs a
        # producer with separate generate/score (see `learner.train`), and tis_cap > 0 to
        # correct the lag (required from k = 2).
        staleness=0,
        # With staleness >= 1 on the engine (sampling.engine=True; SingleTurn, Tasks, a mix
        # of them): the generation in flight switches to the learner's new version when
        # an update ends, at a decode-round boundary, its sequences' caches recomputed under
        # the new weights (with router_replay, routed to the experts each position recorded);
        # each token keeps its behaviour log-prob and version (`ptrain.generate.interrupt`).
        interrupt=False,
        # What a swap does with the held sequences' caches: "recompute" them from each whole
        # sequence under the new weights (AReaL's choice, one prefill per row), or "keep" the
        # old weights' keys and values (no prefill: the new weights go on from them, and the
        # token already drawn from the old weights' last logits stays the old version's).
        interrupt_cache="recompute",
        # MoE: train with the experts the sampler routed each token to (R3), not the
        # learner's own top-k; needs a producer that records routing (every one here does:
        # single-turn, multi-turn Tasks (terminal tasks' too), mixed, and on
        # sampling.engine); rows without it are a clear error (`routing.check_replay`).
        router_replay=False,
    )
    # The value function of rl.estimator="gae" (PPO), ignored otherwise. init "policy": the
    # policy's decoder (verl's default) with a new value head; "random": a fresh decoder
    # (seed + 1). clip_value: verl's cliprange_value. The loss aggregates like the actor's
    # (rl.agg); the optimizer is the critic's own (verl: lr 1e-5, weight decay 0.01, constant).
    c.critic = dict(init="policy", clip_value=0.5,
                    optim=_optim(lr=1e-5, schedule="constant", weight_decay=0.01))
    # KL to the frozen initial policy: coef 0 turns it (and the reference model) off.
    # ref_dtype: the dtype the reference model's parameters are held in ("bfloat16": half
    # the memory of float32 ones; its log-probs are computed in model.dtype as before).
    # ref_offload: held in host memory (jax memory kind "pinned_host") between uses, copied
    # to the devices for each step's prepare pass only.
    c.kl = dict(coef=0.0, kind="k3", in_reward=False,
                target=0.0, horizon=10000.0,  # target > 0: adaptive coefficient (in-reward)
                ref_dtype="float32", ref_offload=False)
    c.dapo = dict(
        overlong_buffer=0,  # > 0: soft overlong penalty over the last N tokens before the max
        overlong_penalty=1.0,
        # The cap an episode's tokens after its prompt are measured against: 0 means
        # sampling.max_new_tokens (one turn); the closed loop uses rollout.max_len (turns and
        # observations; `overlong_max_len`).
        overlong_max_len=0,
        filter_overlong=False,  # True: truncated episodes (cut at a cap) get no loss
        dynamic_sampling=False,  # keep sampling until every group's rewards differ
        max_gen_batches=4,  # cap; the batch is then topped up with uninformative groups
    )
    c.optim = _optim()
    # Supervised warm start (`learner.sft`): records hold prompt_ids + completion_ids (or
    # prompt + completion text with a tokenizer); the loss covers completion tokens only.
    # packing: records back to back in batch_size rows of seq_len tokens (a record that does
    # not fit waits for the next step), segment ids and positions restarting per record,
    # `step.packed_update` (over mesh sequence > 1: model.attention_impl="ring", in `layout`,
    # long_context.LAYOUTS); a record over seq_len is an error unless truncate (its first
    # seq_len tokens). Unpacked, each record is a row of max_prompt_len + max_completion_len.
    c.sft = dict(sources=(), records_fn=None, steps=0, batch_size=8, max_prompt_len=64,
                 max_completion_len=64, microbatch_size=0,
                 checkpoint_every=0,  # 0: checkpoint.every (SFT steps are often much shorter)
                 optim=_optim(lr=1e-3),
                 packing=False, seq_len=1024, truncate=False, layout="contiguous")
    # LoRA (`ptrain.lora`): rank > 0 trains adapters of that rank on the projections whose
    # Hugging Face names match `targets` (fnmatch patterns over LORA_MODULES), scaled
    # alpha / rank; the base is frozen (no gradient, no optimizer state, not in checkpoints)
    # and is the KL reference (adapters off). base_dtype: "" as model.param_dtype (or the
    # brought model's), "bfloat16" halves the frozen base's memory (adapters stay float32),
    # "int8" stores its projections int8 with per-channel scales (`ptrain.quant`).
    # dropout: PEFT's lora_dropout, on the adapters' input in the update's forwards only;
    # experts: adapters per MoE expert too (merged into the expert weights in the forward).
    c.lora = dict(rank=0, alpha=16.0, targets=LORA_MODULES, base_dtype="", dropout=0.0,
                  experts=False)
    # A vision-language hf_model (Qwen2.5-VL, `ptrain.vision`): each learner row's patch
    # budgets, fixed per run (every step the same shapes): its prompt's images
    # (prompt_patches) and its continuation's, tool observations (observation_patches, 0:
    # none); both multiples of the merge unit (4). freeze: no gradient into the vision tower.
    # Ignored for a text-only model.
    c.vision = dict(prompt_patches=1024, observation_patches=0, freeze=True)
    # rollouts_every: rollouts.jsonl gets num_rollouts samples of step 1 and of every
    # rollouts_every-th step (0: none)
    c.log = dict(every=1, rollouts_every=10, num_rollouts=4)
    c.checkpoint = dict(every=10, keep=3, async_save=True)
    # What stops or warns (ptrain/alerts.py): actions "stop" | "warn" | "off", thresholds.
    c.alerts = alerts.defaults()
    if closed_loop:
        _closed_loop_sections(c)
    return c


def _closed_loop_sections(c):
    # The environments (ptrain/envs/, docs/environments.md), each named by import path:
    # {"env": "module:function", "args": {...} (its own, held-out split included), "weight":
    # its sampling weight in RL, "name": another name than its own (optional)}.
    c.tasks = dict(envs=tuple(dict(env=env, args={}, weight=1.0) for env in GENERATED))
    c.rollout = dict(max_turns=3, max_attempts=1, attempt_reward="final", discount=0.5,
                     max_len=72,  # tokens after the prompt (turns, observations, feedback)
                     max_tool_output_chars=1000, tool_timeout_s=5.0,
                     chat_format="plain")  # CHAT_FORMATS
    c.reward = dict(partial_credit=False, timeout_s=10.0, test_timeout_s=2.0, memory_mb=512)
    # backend: "auto" takes the strongest that runs here (docker, bwrap, process; logged once
    # with the reason, `sandbox.pick_backend`); name one to pin it.
    c.sandbox = dict(backend="auto", workers=2,
                     cluster="local",  # "ray": scoring and tool sessions on a Ray fleet
                     address="local")  # with cluster="ray": "local" or a Ray address
    c.eval = dict(n=100,  # held-out tasks per domain (at most the held-out split)
                  sample=False,  # also pass@1, pass@k at the sampling temperature (num_samples)
                  # held-out tasks whose episodes run at once (0: all): bounds the memory of
                  # a long evaluation, and its progress advances after each call
                  tasks_per_call=32)
    from ptrain.envs import adaptive  # (numpy only: the mixture's adaptive sampler)
    c.tasks.adaptive = adaptive.section_defaults()


def plan_defaults() -> ml_collections.ConfigDict:
    """Every key a plan config holds (`ptrain.plan.check_config` checks them)."""
    c = ml_collections.ConfigDict()
    # ModelConfig fields (attention_impl, attn_block_q/k and remat included); the rest keep
    # their ModelConfig defaults.
    c.model = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                   attention_impl="ring", remat="full")
    c.seq_len = 1024  # tokens per sequence (packed documents)
    c.batch = 1  # sequences per step
    c.mesh = dict(data=1, fsdp=1, expert=1, sequence=1, tensor=1)  # no -1: a plan names its devices
    c.layout = "zigzag"  # the token order the data pipeline feeds (long_context.LAYOUTS)
    c.logprob_chunk = 1024  # time steps per chunk of the log-prob computation
    c.optim = _optim(lr=1e-5, schedule="constant", b2=0.95)
    c.budget_gib = 80.0  # usable memory per device
    # `search`: device counts to try (ascending) and compiles per count.
    c.search = dict(device_counts=(8, 16, 32, 64, 128), confirm=2)
    return c


# ================================================================================ checking


def key_diff(ref, config, prefix: str = "") -> tuple[list[str], list[str]]:
    """(missing, unknown) dotted keys of `config` against `ref`, recursively."""
    missing, unknown = [], []
    ref_keys, keys = set(ref.keys()), set(config.keys())
    missing += [prefix + k for k in sorted(ref_keys - keys)]
    unknown += [prefix + k for k in sorted(keys - ref_keys)]
    for k in sorted(ref_keys & keys):
        if isinstance(ref[k], ml_collections.ConfigDict):
            if not isinstance(config[k], ml_collections.ConfigDict):
                missing.append(f"{prefix}{k}.*")
                continue
            m, u = key_diff(ref[k], config[k], f"{prefix}{k}.")
            missing, unknown = missing + m, unknown + u
    return missing, unknown


def check(config, *, closed_loop: bool | None = None) -> None:
    """Raises a ValueError naming every missing or unknown key, or a bad value. closed_loop
    (default: whether the config has a `tasks` section) adds the closed loop's sections."""
    if closed_loop is None:
        closed_loop = "tasks" in config
    _check_keys(config, closed_loop)
    _check_values(config)
    if closed_loop:
        _check_loop_values(config)
    if config.hf_model:
        check_hf_model(config)


def _check_keys(config, closed_loop):
    if closed_loop:
        for name in LOOP_SECTIONS:
            if name not in config:
                raise ValueError(f"config: missing section {name!r} (see "
                                 "ptrain.config.defaults(closed_loop=True))")
    ref = defaults(closed_loop=closed_loop)
    missing, unknown = key_diff(ref, config)
    if missing or unknown:
        where = "defaults(closed_loop=True)" if closed_loop else "defaults()"
        raise ValueError(
            f"config does not match ptrain.config.{where}: "
            + (f"missing keys {missing}" if missing else "")
            + ("; " if missing and unknown else "")
            + (f"unknown keys {unknown}" if unknown else "")
            + ". Build the config on ptrain.config.defaults() and set only existing keys.")


# Counts that must be positive (the closed loop's too), and those that may be 0, with what 0
# means (`_check_sizes`' messages).
_POSITIVE = ("data.prompts_per_step", "data.max_prompt_len", "sampling.num_samples",
             "sampling.max_new_tokens", "rl.ppo_epochs", "rl.num_minibatches",
             "rl.logprob_chunk", "sft.batch_size", "sft.max_prompt_len",
             "sft.max_completion_len", "log.every", "checkpoint.every", "checkpoint.keep")
_LOOP_POSITIVE = ("eval.n", "sandbox.workers", "rollout.max_turns", "rollout.max_attempts",
                  "rollout.max_len")
_ZERO = {"steps": "no RL", "sft.steps": "no SFT",
         "rl.microbatch_size": "the whole minibatch", "rl.logprob_microbatch_size": "one pass",
         "sft.microbatch_size": "the whole batch", "sft.checkpoint_every": "checkpoint.every",
         "log.rollouts_every": "never", "log.num_rollouts": "off"}
_LOOP_ZERO = {"eval.tasks_per_call": "every held-out task at once"}


def _check_sizes(config):
    """Counts and sizes that must be positive (or >= 0): first, so that the checks after
    them may divide by them."""
    loop = "tasks" in config
    positive = _POSITIVE + (_LOOP_POSITIVE if loop else ())
    zero = {**_ZERO, **(_LOOP_ZERO if loop else {})}
    checks = []
    for bound, keys in ((1, positive), (0, tuple(zero))):
        for key in keys:
            value = functools.reduce(lambda section, k: section[k], key.split("."), config)
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= bound
            what = "a positive int" if bound else f"an int >= 0 (0: {zero[key]})"
            checks.append((ok, f"{key}={value!r} must be {what}"))
    _raise_first(checks)


def _check_values(config):
    from ptrain import losses  # the loss modes are the loss module's
    _check_sizes(config)
    rl, s, d = config.rl, config.sampling, config.data
    mb_rows = d.prompts_per_step * s.num_samples // max(rl.num_minibatches, 1)
    micro = rl.microbatch_size
    v = config.vision
    checks = [
        (all(isinstance(n, int) and n >= 0 and n % 4 == 0
             for n in (v.prompt_patches, v.observation_patches)),
         f"vision.prompt_patches={v.prompt_patches!r}, vision.observation_patches="
         f"{v.observation_patches!r}: give patch counts >= 0, multiples of the merge unit (4)"),
        (rl.estimator in ESTIMATORS, f"rl.estimator={rl.estimator!r}; use one of {ESTIMATORS}"),
        (rl.loss in POLICY_LOSSES, f"rl.loss={rl.loss!r}; use one of {POLICY_LOSSES}"),
        (rl.agg in losses.AGG_MODES, f"rl.agg={rl.agg!r}; use one of {losses.AGG_MODES}"),
        (rl.loss != "gspo" or rl.agg == "seq-mean-token-mean",
         "rl.loss='gspo' aggregates seq-mean-token-mean; set rl.agg to it"),
        (config.kl.kind in losses.KL_KINDS, f"kl.kind={config.kl.kind!r}; use {losses.KL_KINDS}"),
        (config.kl.ref_dtype in ("float32", "bfloat16"),
         f"kl.ref_dtype={config.kl.ref_dtype!r}; use 'float32' or 'bfloat16'"),
        (rl.tis_level in ("token", "sequence"), "rl.tis_level must be 'token' or 'sequence'"),
        (s.decode_dtype in ("", "float32", "bfloat16"),
         f"sampling.decode_dtype={s.decode_dtype!r}; use '' (the learner's weights as they "
         "are), 'float32' or 'bfloat16'"),
        (not s.decode_dtype or s.engine,
         f"sampling.decode_dtype={s.decode_dtype!r} is the rollout engine's decode copy: set "
         "sampling.engine=True (or decode_dtype='')"),
        (d.prompts_per_step % rl.num_minibatches == 0,
         f"data.prompts_per_step={d.prompts_per_step} groups must divide into "
         f"rl.num_minibatches={rl.num_minibatches}"),
        (micro == 0 or (micro % s.num_samples == 0 and mb_rows % micro == 0),
         f"rl.microbatch_size={micro} must be a multiple of sampling.num_samples="
         f"{s.num_samples} that divides the minibatch of {mb_rows} rows"),
        (config.sft.microbatch_size == 0
         or config.sft.batch_size % config.sft.microbatch_size == 0,
         "sft.microbatch_size must divide sft.batch_size"),
        (not config.sft.packing or (config.sft.microbatch_size == 0 and config.sft.seq_len > 0
                                    and config.sft.layout in ("contiguous", "zigzag")),
         "sft.packing: sft.seq_len must be > 0, sft.microbatch_size 0 (one packed batch a "
         "step) and sft.layout 'contiguous' or 'zigzag'"),
        (not config.sft.packing or config.sft.layout == "contiguous"
         or config.model.attention_impl == "ring",
         f"sft.layout={config.sft.layout!r} balances ring attention: set "
         "model.attention_impl='ring' or sft.layout='contiguous'"),
        (rl.logprob_microbatch_size == 0 or (
            rl.logprob_microbatch_size % s.num_samples == 0
            and d.prompts_per_step * s.num_samples % rl.logprob_microbatch_size == 0),
         f"rl.logprob_microbatch_size={rl.logprob_microbatch_size} must be a multiple of "
         f"sampling.num_samples={s.num_samples} that divides the batch of "
         f"{d.prompts_per_step * s.num_samples} rows (0: one pass)"),
        (all(o.schedule in SCHEDULES
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
        (0 <= config.dapo.overlong_buffer <= overlong_max_len(config),
         f"dapo.overlong_buffer={config.dapo.overlong_buffer} must be within 0 and the "
         f"episode's cap {overlong_max_len(config)} (" + ("rollout.max_len" if "rollout" in
         config else "dapo.overlong_max_len or sampling.max_new_tokens") + ")"),
        (config.kl.target == 0 or config.kl.in_reward,
         "kl.target (adaptive KL) applies to the KL in the reward: set kl.in_reward=True"),
        (isinstance(rl.staleness, int) and rl.staleness >= 0,
         f"rl.staleness={rl.staleness!r} must be an int >= 0 (0: on-policy)"),
        (rl.staleness < 2 or rl.tis_cap > 0,
         f"rl.staleness={rl.staleness} trains batches up to {rl.staleness} updates late: set "
         "rl.tis_cap > 0 (truncated importance weights against the sampler's log-probs)"),
        (not rl.interrupt or rl.staleness >= 1,
         "rl.interrupt switches a generation running ahead to the new weights: it needs "
         "rl.staleness >= 1 (with 0 nothing is generated during an update)"),
        (not rl.interrupt or config.sampling.engine,
         "rl.interrupt runs on the rollout engine: set sampling.engine=True"),
        (rl.interrupt_cache in ("recompute", "keep"),
         f"rl.interrupt_cache={rl.interrupt_cache!r}: use 'recompute' or 'keep'"),
        (rl.staleness == 0 or not config.dapo.dynamic_sampling,
         "dynamic sampling needs the rewards before the next batch is drawn: set "
         "rl.staleness=0 or dapo.dynamic_sampling=False"),
    ] + _lora_checks(config)
    _raise_first(checks)
    _check_mesh_sizes(config, _fixed_mesh(config.mesh))


def _lora_checks(config):
    lo = config.lora
    unmatched = [p for p in lo.targets
                 if not any(fnmatch.fnmatchcase(m, p) for m in LORA_MODULES)]
    return [
        (isinstance(lo.rank, int) and lo.rank >= 0,
         f"lora.rank={lo.rank!r} must be an int >= 0 (0: full fine-tuning)"),
        (not lo.rank or lo.alpha > 0, f"lora.alpha={lo.alpha} must be > 0"),
        (0 <= lo.dropout < 1, f"lora.dropout={lo.dropout} must be in [0, 1)"),
        (not lo.rank or (lo.targets and not unmatched),
         f"lora.targets {tuple(lo.targets)}: {unmatched or 'none'} match no projection; "
         f"use names or fnmatch patterns over {LORA_MODULES}"),
        (lo.base_dtype in ("", "float32", "bfloat16", "int8"),
         f"lora.base_dtype={lo.base_dtype!r}; use '' (model.param_dtype), 'float32', "
         "'bfloat16' or 'int8'"),
        (not lo.rank or config.rl.estimator != "gae",
         "lora with rl.estimator='gae': the critic has no adapters yet; use a critic-free "
         "estimator (grpo, rloo, reinforce++) or lora.rank=0"),
    ]


def overlong_max_len(config) -> int:
    """What the DAPO overlong penalty measures an episode against: rollout.max_len in the
    closed loop (its turns and observations), else dapo.overlong_max_len or, when 0,
    sampling.max_new_tokens (one turn)."""
    if "rollout" in config:
        return config.rollout.max_len
    return config.dapo.overlong_max_len or config.sampling.max_new_tokens


def _check_loop_values(config):
    from ptrain import envs  # imports each environment's module: errors name the entry
    loaded = envs.load_all(config.tasks.envs, key="tasks.envs")
    from ptrain.envs import adaptive
    adaptive.check_section(config.tasks.adaptive, "tasks.adaptive")
    no_retries = [env.name for env in loaded if not env.turns.retries]
    agentic = [env.name for env in loaded if env.agent is not None]
    _raise_first([
        (not agentic,  # (their episodes need the policy served to the agent program)
         f"tasks.envs: environments {agentic} are agent-driven (an 'agent' entry or "
         "Environment.agent); the closed loop does not serve the policy to agent programs: "
         "train them with a rollout.Agents producer over serve.make_server (docs/agents.md)"),
        (config.rollout.max_attempts == 1 or not no_retries,
         f"environments {no_retries} have no retries with feedback: set "
         "rollout.max_attempts=1"),
        (config.sandbox.backend in SANDBOX_BACKENDS,
         f"sandbox.backend={config.sandbox.backend!r}: use one of {SANDBOX_BACKENDS} (auto: "
         "the strongest that runs here)"),
        (config.rollout.chat_format in CHAT_FORMATS,
         f"rollout.chat_format must be one of {sorted(CHAT_FORMATS)}"),
        (config.rollout.max_attempts == 1 or not config.rl.staleness,
         "self-correction (rollout.max_attempts > 1) scores during the episode: rl.staleness=0"),
        (config.dapo.overlong_max_len in (0, config.rollout.max_len),
         f"dapo.overlong_max_len={config.dapo.overlong_max_len}: the closed loop measures an "
         f"episode against rollout.max_len={config.rollout.max_len}; leave it 0"),
    ])


def _raise_first(checks):
    for ok, message in checks:
        if not ok:
            raise ValueError(f"config: {message}")


def check_hf_model(config) -> None:
    """With hf_model, config.json gives the model: a model.* key other than the run-time
    ones that is set (differs from defaults()) and differs from config.json is an error."""
    from ptrain import model as model_lib
    if not os.path.isfile(os.path.join(config.hf_model, "config.json")):
        raise ValueError(f"config: hf_model={config.hf_model!r} is not a directory with a "
                         "config.json; set hf_model to a local Hugging Face model directory")
    from ptrain.vision import run as vision_run
    ours = vision_run.text_config(config.hf_model)
    base = defaults().model
    for key, value in config.model.items():
        if key in model_lib.RUNTIME_FIELDS or value == base.get(key):
            continue
        theirs = getattr(ours, key, None)
        if key == "vocab_size" and value == 0:  # 0: the tokenizer's / the checkpoint's
            continue
        if value != theirs:
            raise ValueError(
                f"config: model.{key}={value!r} but hf_model's config.json "
                f"({os.path.join(config.hf_model, 'config.json')}) gives {key}={theirs!r}; "
                f"the checkpoint's shapes win: remove model.{key} from the config or set it "
                f"to {theirs!r} (only {', '.join(model_lib.RUNTIME_FIELDS)} may differ)")


def _fixed_mesh(mesh) -> dict[str, int] | None:
    """The mesh's sizes when none is -1 (then they are known before any device is seen)."""
    sizes = {k: int(v) for k, v in mesh.items()}
    return None if any(v < 1 for v in sizes.values()) else sizes


def check_mesh(config, mesh_shape) -> None:
    """Batch and sequence dimensions must divide their mesh axes (`mesh_shape`: axis ->
    size, e.g. a built mesh's `.shape`); weights may still replicate, with a warning."""
    _check_mesh_sizes(config, {k: int(v) for k, v in dict(mesh_shape).items()})


def _check_mesh_sizes(config, sizes):
    if sizes is not None:
        _raise_first([(False, problem) for problem in mesh_checks.problems(config, sizes)])


# ================================================================================ resolved


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The static part of a compiled update (`ptrain.step`; hashable)."""

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
    logprob_microbatch: int = 0  # rows per pass of `prepare` (0: all)
    # Log-probs are of logits / temperature (verl, TRL): the policy the sampler drew from.
    # sampling.temperature for RL; 1 for SFT's likelihood.
    temperature: float = 1.0
    router_replay: bool = False  # MoE: route to the experts the sampler recorded


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What the learner's device programs read from a config, resolved once."""

    rl: StepSettings
    critic: StepSettings | None  # rl.estimator="gae" only
    sft: StepSettings
    updates_per_step: int  # optimizer updates per RL step (epochs x minibatches)


def resolve(config) -> Resolved:
    """The config's step settings (a checked config: see `check`)."""
    c, rl = config, config.rl
    updates = rl.ppo_epochs * rl.num_minibatches
    kl_on = c.kl.coef > 0
    rl_settings = StepSettings(
        kind="rl", group_size=c.sampling.num_samples, estimator=rl.estimator, loss=rl.loss,
        clip_low=rl.clip_low, clip_high=rl.clip_high, dual_clip=rl.dual_clip or None,
        agg=rl.agg, gamma=rl.gamma, lam=rl.lam, clip_value=c.critic.clip_value,
        entropy_coef=rl.entropy_coef, tis_cap=rl.tis_cap, tis_level=rl.tis_level,
        kl_kind=c.kl.kind, kl_loss=kl_on and not c.kl.in_reward,
        kl_in_reward=kl_on and c.kl.in_reward,
        has_old_logp=updates > 1 or (kl_on and c.kl.in_reward), chunk=rl.logprob_chunk,
        epochs=rl.ppo_epochs, minibatches=rl.num_minibatches, microbatch=rl.microbatch_size,
        logprob_microbatch=rl.logprob_microbatch_size,
        temperature=float(c.sampling.temperature), router_replay=bool(rl.router_replay))
    critic = (dataclasses.replace(rl_settings, kind="critic") if rl.estimator == "gae"
              else None)
    sft = StepSettings(kind="sft", chunk=rl.logprob_chunk, microbatch=c.sft.microbatch_size)
    return Resolved(rl=rl_settings, critic=critic, sft=sft, updates_per_step=updates)
