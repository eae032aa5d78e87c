"""The loops: RL (`train`) and supervised warm start (`sft`), each read top to bottom.

One RL step enters each room once:

  data      a batch of prompt records (`ptrain.data`)
  rollout   a `rollout.Producer` turns them into a `batch.Batch`: `generate` (sampler, tool
            calls) then `score` (reward_fn or sandbox verdicts); the default producer is
            `rollout.SingleTurn` with config.reward_fn
  collect   `batch.Collector`: DAPO overlong shaping, dynamic sampling (it says when the
            learner should call the producer again), group filling, metrics
  prepare   `step.prepare` on the device: log-probs of the current and reference policies,
            KL in the reward, advantages (with rl.estimator="gae", the critic's values)
  update    `step.update`: the critic's updates, then the actor's (PPO epochs over
            minibatches, gradients accumulated over microbatches, one jitted call each)
  log, checkpoint

`Learner` holds the static context of a run (mesh, model graph, optimizers, step settings,
the frozen reference policy) and calls the jitted programs of `ptrain.step`; parameters and
optimizer state are passed in and out, never kept. The config is checked and resolved once
(`ptrain.config`).

`sft(config, workdir)` trains on (prompt, completion) pairs with the loss on completion tokens
only, as a warm start; `train(..., params=...)` continues from its result.

Randomness is explicit: the key of step s is fold_in(key(seed), s), so a run resumed from a
checkpoint draws what the uninterrupted run drew. Shapes are fixed by the config (prompt and
completion lengths, batch sizes), so every program compiles once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from ptrain import alerts as alerts_lib
from ptrain import batch as batch_lib
from ptrain import checkpoint as checkpoint_lib
from ptrain import config as config_lib
from ptrain import critic as critic_lib
from ptrain import data as data_lib
from ptrain import lookahead as lookahead_lib
from ptrain import lora
from ptrain import losses
from ptrain import metrics as metrics_lib
from ptrain import mixture
from ptrain import model as model_lib
from ptrain import packing
from ptrain import prompt_streams
from ptrain import rollout as rollout_lib
from ptrain import routing
from ptrain import run_record
from ptrain import sharding
from ptrain import step as step_lib
from ptrain.batch import Batch
from ptrain.generate import engine_sampler
from ptrain.vision import run as vision_run


# ==================================================================================== config


def defaults() -> ml_collections.ConfigDict:
    """Every key the learner reads, with its default (`ptrain.config.defaults`)."""
    return config_lib.defaults()


def check_config(config: ml_collections.ConfigDict) -> None:
    """Raises a ValueError naming every missing or unknown key, or a bad value
    (`ptrain.config.check`)."""
    config_lib.check(config)


# =================================================================================== learner


class Learner:
    """The static context of a run (mesh, model graph, optimizers, step settings, reference
    policy) and its device stages; parameters and optimizer state pass in and out."""

    def __init__(self, config, *, mesh=None, params=None, tokenizer=None):
        """mesh: default from config.mesh. params: initial parameters (default: the config's
        model); they are donated to the first update. tokenizer: default config.tokenizer."""
        check_config(config)
        self.config = c = config
        self.mesh = sharding.mesh_from_config(c.mesh) if mesh is None else mesh
        if self.mesh is not None:
            config_lib.check_mesh(c, self.mesh.shape)
        if tokenizer is None and c.tokenizer:
            from ptrain import hf
            tokenizer = hf.load_tokenizer(c.tokenizer)
        self.tokenizer = tokenizer
        self.model_config = model_config(c)
        if params is None:
            self.graphdef, self.initial_params = nnx.split(build_model(c, self.mesh))
        else:  # e.g. the result of `sft`, placed like a fresh model
            self.graphdef, abstract = sharding.abstract(
                lambda: new_model(c, self.mesh, self.model_config), self.mesh)
            if self.model_config.lora_rank and not lora.has_adapters(params):
                params = lora.attach(params, self.model_config, seed=c.seed,
                                     mesh=self.mesh)[1]  # (a base model's: fresh adapters)
            self.initial_params = jax.device_put(params, jax.tree.map(
                lambda x: x.sharding, abstract) if self.mesh is not None else None)
        self.pad_id = rollout_lib.pad_id(self.tokenizer)
        self.vision = vision_run.vision(c, vision_run.vl_config(c, self.model_config))  # (VL)
        resolved = config_lib.resolve(c)
        updates = resolved.updates_per_step
        self.settings, self.sft_settings = resolved.rl, resolved.sft
        if self.settings.logprob_microbatch and self.model_config.n_experts:
            raise ValueError("rl.logprob_microbatch_size is not yet supported with experts "
                             "(MoE router metrics need the whole batch); set it to 0")
        self.tx, self.schedule = step_lib.make_optimizer(c.optim, total_steps=c.steps,
                                                         updates_per_step=updates)
        # PPO's value function (rl.estimator="gae"): own parameters (`init_critic`),
        # optimizer and settings.
        self.critic_graphdef = None
        if resolved.critic is not None:
            self.critic_graphdef = nnx.split(nnx.eval_shape(lambda: critic_lib.Critic(
                self.model_config, rngs=nnx.Rngs(0), mesh=self.mesh)))[0]
            self.critic_tx, self.critic_schedule = step_lib.make_optimizer(
                c.critic.optim, total_steps=c.steps, updates_per_step=updates)
            self.critic_settings = resolved.critic
        self.sft_tx, self.sft_schedule = step_lib.make_optimizer(c.sft.optim,
                                                                 total_steps=c.sft.steps)
        # The reference policy is a copy (the live parameters are donated to each update),
        # in kl.ref_dtype; with kl.ref_offload in host memory between prepare passes. With
        # LoRA it is the frozen base itself, adapters off (`step.prepare`): no copy.
        self.ref_params = (reference_params(self.initial_params, c.kl.ref_dtype)
                           if c.kl.coef > 0 and not self.model_config.lora_rank else None)
        if self.ref_params is not None and c.kl.ref_offload:
            self.ref_params = sharding.to_memory(self.ref_params, "pinned_host")

    # ------------------------------------------------------------------ state

    def init_opt_state(self, params, tx=None):
        """Optimizer state (default `tx`: the policy's), sharded like the parameters it
        mirrors (the critic's: `init_opt_state(critic_params, learner.critic_tx)`)."""
        tx = tx or self.tx
        params = step_lib.split_trainable(params)[0]  # (LoRA: the adapters only)
        shardings = None
        if self.mesh is not None:
            param_shardings = jax.tree.map(lambda x: x.sharding, params)
            shardings = step_lib.opt_state_shardings(tx, params, param_shardings, self.mesh)
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

    def encode(self, record, ids_key, text_key) -> list[int]:
        """Token ids of a record's field: `ids_key` (ids), or `text_key` with the tokenizer."""
        return data_lib.record_ids(record, ids_key, text_key, self.tokenizer)

    # ------------------------------------------------------------------ stages

    def prepare(self, params, episodes: Batch, kl_coef: float = 0.0, *,
                critic_params=None):
        """Device batch for `update`: advantages, log-probs of the current (when needed) and
        reference policies, KL in the reward; with rl.estimator="gae", the critic's values
        (`critic_params`), GAE advantages and returns. Returns (batch, metrics). With many
        processes `episodes` is the global batch (`batch.Collector` gathers it), the same on
        every process; each places only its own devices' rows."""
        if (critic_params is None) != (self.critic_graphdef is None):
            raise ValueError("prepare: pass critic_params exactly when rl.estimator='gae' "
                             f"(here {self.settings.estimator!r})")
        episodes.check_groups(self.settings.group_size)
        if self.settings.router_replay:
            routing.check_replay(episodes)
        batch = sharding.shard_batch(episodes.arrays(), self.mesh)
        ref = self.ref_params  # (kl.ref_offload: on the devices for this pass only)
        if ref is not None and self.config.kl.ref_offload:
            ref = sharding.to_memory(ref, "device")
        return step_lib.prepare(params, ref, critic_params, batch,
                                jnp.float32(kl_coef), graphdef=self.graphdef,
                                critic_graphdef=self.critic_graphdef, s=self.settings)

    def update(self, params, opt_state, batch, kl_coef: float = 0.0, step: int = 0):
        """PPO epochs over minibatches; the inputs are donated. Returns (params, opt_state,
        metrics) with metrics averaged over the optimizer updates. `step` picks the LoRA
        dropout masks (`dropout_key`)."""
        fn = step_lib.jit_update(self.graphdef, self.settings, self.tx, self.mesh)
        return fn(params, opt_state, batch, jnp.float32(kl_coef), self.dropout_key(step))

    def dropout_key(self, step: int):
        """The LoRA dropout key of a step (None without lora.dropout): a function of the seed
        and the step only, so a resumed run draws the masks the uninterrupted one drew."""
        if not self.model_config.lora_dropout:
            return None
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.config.seed), step),
                                  0x10DA)

    def update_critic(self, critic_params, critic_opt_state, batch):
        """The critic's clipped value-loss updates on the minibatches and epochs of `update`
        (optimizer `critic_tx`); the inputs but the batch are donated. Returns (critic_params,
        critic_opt_state, metrics) with metrics averaged over the updates."""
        fn = step_lib.jit_update(self.critic_graphdef, self.critic_settings, self.critic_tx,
                                 self.mesh)
        return fn(critic_params, critic_opt_state, batch, jnp.float32(0.0))

    def sft_update(self, params, opt_state, episodes: Batch, step: int = 0):
        """One supervised step (optimizer `sft_tx`) on the loss-masked tokens; the inputs are
        donated. metrics["sft/loss"] is the loss before the update. With many processes
        `episodes` are this process's rows (its block of the global batch, `prompt_streams.prompt_stream`)."""
        fn = step_lib.jit_update(self.graphdef, self.sft_settings, self.sft_tx, self.mesh)
        blocks = sharding.row_block(self.mesh)[1]
        batch = sharding.from_process_local(episodes.arrays(), self.mesh,
                                            global_rows=len(episodes) * blocks)
        return fn(params, opt_state, batch, jnp.float32(0.0), self.dropout_key(step))

    def sft_packed_update(self, params, opt_state, batch, step: int = 0):
        """One supervised step on a packed batch (`packing.packed_batch`: the global batch,
        the same on every process, which places its devices' rows): `step.jit_packed_update`,
        the program `ptrain.plan` compiles; the inputs are donated. metrics["loss"] is the
        loss before the update."""
        fn = step_lib.jit_packed_update(self.graphdef, self.sft_tx, self.mesh,
                                        self.sft_settings.chunk)
        return fn(params, opt_state, sharding.shard_batch(batch, self.mesh),
                  self.dropout_key(step))


def reference_params(params, dtype: str = "float32"):
    """The frozen reference policy's parameters: a copy of `params` (sharded as they are),
    their floating-point arrays in `dtype` (kl.ref_dtype; "bfloat16" halves the memory of
    float32 ones)."""
    def one(x):
        if dtype != "float32" and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return jnp.copy(x)
    return jax.tree.map(one, params)


def _runtime_overrides(config) -> dict:
    """With hf_model, config.model's run-time keys still apply (model.RUNTIME_FIELDS)."""
    return {k: config.model[k] for k in model_lib.RUNTIME_FIELDS if k in config.model}


def model_config(config) -> model_lib.ModelConfig:
    """The run's ModelConfig (with config.lora's adapters, `lora.configure`); a
    vision-language hf_model's decoder (`ptrain.vision.run`)."""
    if config.hf_model:
        return lora.configure(dataclasses.replace(
            vision_run.text_config(config.hf_model), **_runtime_overrides(config)),
            config.lora)
    return lora.configure(model_lib.ModelConfig(**config.model.to_dict()), config.lora)


def new_model(config, mesh, model_cfg=None):
    """The config's model class instantiated (for abstract shapes: `nnx.eval_shape`): a
    Transformer, or a VLModel for a vision-language hf_model."""
    model_cfg = model_cfg or model_config(config)
    vl = vision_run.vl_config(config, model_cfg)
    return vision_run.new(vl, mesh) if vl is not None else model_lib.Transformer(
        model_cfg, rngs=nnx.Rngs(0), mesh=mesh)


def build_model(config, mesh) -> model_lib.Transformer:
    """The config's model, born sharded: loaded from hf_model (a VLModel for a Qwen2.5-VL
    directory), or initialised from the seed (with LoRA the base as it would be without,
    and fresh adapters)."""
    if config.hf_model:
        from ptrain import hf
        if vision_run.is_vl_dir(config.hf_model):
            return vision_run.build(config, mesh, _runtime_overrides(config),
                                    config.lora.base_dtype or None)
        model = hf.load(config.hf_model, mesh=mesh, overrides=_runtime_overrides(config),
                        param_dtype=lora.float_dtype(config.lora))[0]
        c = model_config(config)
        if not c.lora_rank:
            return model
        return nnx.merge(*lora.attach(nnx.state(model), c, seed=config.seed, mesh=mesh))
    return model_lib.init(model_config(config), seed=config.seed, mesh=mesh)


# ================================================================================ the loop


def train(config, workdir, *, params=None, rollout_fn=None, producer=None, mesh=None,
          tokenizer=None, prompt_sources=None, adaptive=None):
    """Runs RL from the config; resumes from the latest checkpoint in `workdir`.

    params: initial parameters (e.g. from `sft`); default: the config's model.
    producer: a `rollout.Producer`, `generate(params, records, key)` (the device part:
      sampling, tool calls) and `score(generated) -> Batch` (rewards, verdicts from the
      sandbox); records are one batch of data.prompts_per_step prompt records. With
      rl.staleness=k > 0, batch t+k is generated at step t in a thread, while update t
      runs, and each batch is scored in another thread meanwhile, so the accelerator does
      not wait for the sandbox (`ptrain.lookahead`). Default: `rollout.SingleTurn` with
      config.reward_fn.
    rollout_fn(params, records, key) -> Batch: instead of a producer, one function
      (`rollout.FromFunction`).
    tokenizer: default config.tokenizer.
    prompt_sources: instead of config.data.sources, (records, weight) pairs of records in
      memory, served to the producer as they are (the closed loop's `ptrain.tasks.Task`s);
      the stream and its checkpointed state are those of the files written from them.
    adaptive: a tasks.adaptive section (`envs.adaptive.section_defaults`); enabled (a mode
      other than "off", or a task filter), each source is one environment and the step's
      prompts are drawn per environment by the verdicts of the steps before
      (`mixture.AdaptiveDraw`); None or disabled: the sources' static mixture.
    Returns the final parameters.
    """
    # ---------------------------------------------------------------- set-up
    c = config
    learner = Learner(c, mesh=mesh, params=params, tokenizer=tokenizer)
    if rollout_fn is not None and producer is not None:
        raise ValueError("give rollout_fn or producer, not both")
    if c.rl.staleness and rollout_fn is not None:
        raise ValueError("rl.staleness > 0 overlaps scoring with generation: pass a producer "
                         "with separate generate() and score() (the default, "
                         "rollout.SingleTurn, has them), not one rollout_fn")
    if rollout_fn is not None:
        producer = rollout_lib.FromFunction(rollout_fn)
    elif producer is None:
        producer = rollout_lib.SingleTurn(c, rollout_lib.make_sampler(
            nnx.merge(learner.graphdef, learner.initial_params), c, learner.tokenizer),
            tokenizer=learner.tokenizer)
    engines = engine_sampler.find(producer)  # sampling.engine: their metrics each step
    os.makedirs(workdir, exist_ok=True)
    run_record.ensure(c, workdir)  # (launch/export.py reads it; closed_loop.run wrote it)
    prompts = prompt_streams.step_prompts(c, workdir, sources=prompt_sources, adaptive=adaptive,
                           mesh=learner.mesh)
    draw = isinstance(prompts, mixture.AdaptiveDraw)
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
    # With staleness k a checkpoint of step t also holds the parameters batches t+1 .. t+k
    # were generated from, so that a resumed run generates the very batches the
    # uninterrupted one did (`ptrain.lookahead`).
    k = c.rl.staleness
    aux = {"critic": critic} if critic else {}
    start, data_state, ahead_params = 0, None, [params] * min(k, c.steps)
    ahead_batches = None  # rl.interrupt: a checkpoint's pending batches, finished
    monitor = alerts_lib.Monitor(alerts_lib.AlertConfig.from_config(c.alerts))
    if ckpt.latest_step() is not None:
        if k and not c.rl.interrupt:
            aux["ahead_params"] = lookahead_lib.restore_template(
                lora.checkpointed(params), len(ckpt.aux_keys().get("ahead_params", ())))
        restored = ckpt.restore(params=lora.checkpointed(params), opt_state=opt_state, rng=root_key,
                                aux_state={n: v for n, v in aux.items() if v} or None)
        start, opt_state = restored.step, restored.opt_state
        params, base = lora.restored(restored.params, params), params
        critic = restored.aux_state.get("critic")
        saved = restored.aux_state.get("ahead_params") or {}
        ahead_params = [lora.restored(saved[str(j)], base) for j in range(len(saved))]
        data_state = restored.data_state
        kl_ctl = dataclasses.replace(kl_ctl, value=restored.extra["kl_coef"])
        monitor.restore(restored.extra.get("alerts"))
        ahead_batches = lookahead_lib.restore_batches(restored.extra, restored.host_state)
        logging.info("resumed from step %d", start)
    batches = prompts.iterator(data_state)
    writer = metrics_lib.MetricsWriter(workdir, total_steps=c.steps, start_step=start,
                                       desc="rl")
    ahead = (lookahead_lib.LookAhead(k, producer, batches, root_key, steps=c.steps,
                                     save_every=c.checkpoint.every,
                                     interrupt=c.rl.interrupt,
                                     replay=c.rl.router_replay,
                                     keep_cache=c.rl.interrupt_cache == "keep") if k else None)

    watchdog = alerts_lib.Watchdog(c.alerts.stall_minutes, c.alerts.stall).start()
    try:
        for step in range(start + 1, c.steps + 1):
            t0 = time.perf_counter()
            key = jax.random.fold_in(root_key, step)

            # ------------------------------------------------------------ rollouts
            # The producer's calls, made here; `batch.Collector` shapes them into the step's
            # batch and says when it is full (with DAPO dynamic sampling, groups whose rewards
            # are all equal carry no signal: more prompts until it holds informative ones).
            collector = batch_lib.Collector(c, mesh=learner.mesh)
            stale_metrics = {}
            if k:
                # Batch t was generated from the parameters of k steps ago (scored since, in
                # a thread); batch t+k is generated now from a copy of the current ones, in
                # the generation thread, while this thread updates.
                if step == start + 1:  # the first step of a run (or of a resumed run)
                    ahead.start(step, ahead_params, finished=ahead_batches, current=params)
                    ahead_params = ahead_batches = None
                collector.add(ahead.next(step, params))
            else:
                if draw:
                    batches.at(step)
                while collector.wants_more():
                    generated = producer.generate(params, next(batches),
                                                  jax.random.fold_in(key, collector.calls))
                    collector.add(producer.score(generated))
                data_state = batches.get_state()
            episodes, gen_metrics = collector.result()
            if draw:  # every call's global batch (the groups DAPO drops too): every process
                batches.observe(step, collector.added)  # observes the same verdicts
                gen_metrics.update(batches.metrics())
            if k:  # over the step's (global) batch: with many processes, every process's rows
                stale_metrics = lookahead_lib.metrics(episodes, step, k, ahead.waited_s)
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
            params, opt_state, upd_metrics = learner.update(params, opt_state, batch, kl_ctl.value,
                                                            step)
            if k:  # rl.interrupt: the generation in flight switches to version `step`
                ahead.publish(step, params)
            prep_metrics, upd_metrics, critic_metrics = sharding.to_host(
                (prep_metrics, upd_metrics, critic_metrics))
            if c.kl.coef > 0 and c.kl.in_reward:
                kl_ctl = kl_ctl.update(prep_metrics["kl/in_reward"], n_steps=len(episodes))
            t2 = time.perf_counter()

            # ------------------------------------------------------------ log
            step_metrics = {
                **gen_metrics, **stale_metrics, **prep_metrics, **critic_metrics, **upd_metrics,
                **engine_sampler.step_metrics(engines),
                "optim/lr": float(learner.schedule(step - 1)), "kl/coef": kl_ctl.value,
                "time/rollout_s": t1 - t0, "time/update_s": t2 - t1, "time/step_s": t2 - t0,
            }
            fired = monitor.check(step, step_metrics)  # every step, logged or not
            if step % c.log.every == 0 or step == c.steps or fired:
                writer.write(step, {**step_metrics, **alerts_lib.as_metrics(fired)})
            if c.log.rollouts_every and (step % c.log.rollouts_every == 0 or step == 1):
                writer.write_rollouts(step, batch_lib.rollout_samples(episodes, c.log.num_rollouts))

            # ------------------------------------------------------------ checkpoint
            # (With staleness k the saved data state is the one before batch t+1 was drawn: a
            # resumed run draws it again and generates t+1 .. t+k as this run did.)
            alerts_lib.raise_on_stop(fired)  # before this step's checkpoint: the last is good
            watchdog.beat(step)
            if step % c.checkpoint.every == 0 or step == c.steps:
                aux, saved, host = ({"critic": critic} if critic else {}), {}, {}
                if k:  # (rl.interrupt: the pending batches, finished)
                    data_state, ahead_saved = ahead.state()
                    aux["ahead_params"] = ahead_saved and {
                        j: lora.checkpointed(p) for j, p in ahead_saved.items()}
                    saved, host = ahead.saved_batches()
                aux = {n: v for n, v in aux.items() if v}
                if draw:  # (with the observations made since data_state was taken)
                    data_state = batches.complete(data_state)
                ckpt.save(step, params=lora.checkpointed(params), opt_state=opt_state, rng=root_key,
                          data_state=data_state, aux_state=aux or None, host_state=host or None,
                          extra={"kl_coef": kl_ctl.value, "alerts": monitor.state(), **saved})

    finally:
        watchdog.close()
        if ahead is not None:
            ahead.close()
    ckpt.wait()
    ckpt.close()
    writer.plot()
    writer.close()
    return params


# ======================================================================================= SFT


def sft_episodes(learner: Learner, records, *, prompt_len, length) -> Batch:
    """(prompt, completion) records as rows with the loss mask on the completion only.

    A record may carry `completion_mask` (0/1 per completion token): a multi-turn
    demonstration is trained on the model's turns, not on the tool observations in between,
    and `images` (paths, in prompt order) for a vision-language model: the rows carry them
    (`vision_run.sft_arrays`, padded to vision.prompt_patches).
    """
    prompts = [learner.encode(r, "prompt_ids", "prompt") for r in records]
    completions = [learner.encode(r, "completion_ids", "completion") for r in records]
    masks = [list(r.get("completion_mask", [1] * len(c))) for r, c in zip(records, completions)]
    batch = Batch.from_rows(prompts, completions, masks,
                            [[0.0] * len(c) for c in completions], np.zeros(len(records)),
                            np.arange(len(records)), prompt_len=prompt_len, length=length,
                            pad_id=learner.pad_id)
    return vision_run.sft_arrays(batch, records, learner.vision)


def sft_document(learner: Learner, record):
    """A (prompt, completion) record as one packed document: (token ids, loss weights), the
    weights 0 on the prompt, the record's completion_mask (default 1) on the completion."""
    if record.get("images"):
        raise ValueError("sft.packing with records that show images (the charts environment's "
                         "demonstrations): packed rows carry no images yet; set sft.packing=False")
    prompt = learner.encode(record, "prompt_ids", "prompt")
    completion = learner.encode(record, "completion_ids", "completion")
    mask = list(record.get("completion_mask", [1] * len(completion)))
    return list(prompt) + list(completion), [0.0] * len(prompt) + [float(m) for m in mask]


def _packed_sft(learner: Learner, records, state):
    """sft.packing's stream and the function from its rows to a step's packed batch: the
    global one (sft.batch_size rows), packed alike on every process from the whole record
    stream, since where a record lands depends on every record before it (so N processes
    train on the rows one process would)."""
    sc, mesh = learner.config.sft, learner.mesh
    packer = packing.Packer(records, lambda r: sft_document(learner, r), state=state,
                            rows=sc.batch_size, seq_len=sc.seq_len, truncate=sc.truncate)
    shards = 1 if mesh is None else mesh.shape["sequence"]

    def next_batch():
        tokens_bt, seg_bt, weights_bt, docs = packer.next_rows()
        batch = packing.packed_batch(tokens_bt, seg_bt, weights_bt, layout=sc.layout,
                                     shards=shards)
        return batch, {"sft/documents": docs, "sft/fill": float((seg_bt > 0).mean())}

    return packer, next_batch


def sft(config, workdir, *, params=None, mesh=None, tokenizer=None):
    """Supervised training on config.sft's (prompt, completion) records: token-mean negative
    log-likelihood of the completion tokens. Resumes from `workdir`; returns the parameters.
    With sft.packing, records go back to back in sft.batch_size rows of sft.seq_len tokens
    (`ptrain.packing`) through `step.packed_update`, the long-context plans' step."""
    # ---------------------------------------------------------------- set-up
    c, sc = config, config.sft
    learner = Learner(c, mesh=mesh, params=params, tokenizer=tokenizer)
    os.makedirs(workdir, exist_ok=True)
    # (Packed: every process reads the whole stream, `_packed_sft`; else its block.)
    records = prompt_streams.prompt_stream(sc, sc.batch_size, c.seed, workdir, "sft", on_error="raise",
                             mesh=None if sc.packing else learner.mesh)
    # ---------------------------------------------------------------- restore or start
    params = learner.initial_params
    opt_state = learner.init_opt_state(params, learner.sft_tx)
    ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       max_to_keep=c.checkpoint.keep,
                                       async_save=c.checkpoint.async_save)
    root_key, start, data_state = jax.random.key(c.seed), 0, None
    if ckpt.latest_step() is not None:
        restored = ckpt.restore(params=lora.checkpointed(params), opt_state=opt_state, rng=root_key)
        start, opt_state = restored.step, restored.opt_state
        params = lora.restored(restored.params, params)
        data_state = restored.data_state
    if sc.packing:
        batches, next_packed = _packed_sft(learner, records, data_state)
    else:
        batches = records.iterator(data_state)
    writer = metrics_lib.MetricsWriter(workdir, total_steps=sc.steps, start_step=start,
                                       desc="sft")

    monitor = alerts_lib.Monitor(alerts_lib.AlertConfig.from_config(c.alerts))
    for step in range(start + 1, sc.steps + 1):
        t0 = time.perf_counter()
        if sc.packing:
            batch, step_metrics = next_packed()
            params, opt_state, metrics = learner.sft_packed_update(params, opt_state, batch, step)
            metrics = sharding.to_host(metrics)
            step_metrics.update({"sft/loss": metrics["loss"],
                                 "sft/grad_norm": metrics["grad_norm"],
                                 **{k: v for k, v in metrics.items() if k.startswith("moe/")}})
        else:
            try:
                episodes = sft_episodes(learner, next(batches), prompt_len=sc.max_prompt_len,
                                        length=sc.max_completion_len)
            except ValueError as e:  # name the keys of the SFT section, not the RL ones
                raise ValueError(f"SFT step {step}: {e} (prompt_len is sft.max_prompt_len="
                                 f"{sc.max_prompt_len}, the length sft.max_completion_len="
                                 f"{sc.max_completion_len})") from None
            params, opt_state, metrics = learner.sft_update(params, opt_state, episodes, step)
            metrics = sharding.to_host(metrics)
            step_metrics = {"sft/loss": metrics["sft/loss"],
                            "sft/entropy": metrics["sft/entropy"],
                            "sft/grad_norm": metrics["optim/grad_norm"],
                            **{k: v for k, v in metrics.items() if k.startswith("moe/")}}
        step_metrics.update({"optim/lr": float(learner.sft_schedule(step - 1)),
                             "time/step_s": time.perf_counter() - t0})
        fired = monitor.check(step, step_metrics)
        if step % c.log.every == 0 or step == sc.steps or fired:
            writer.write(step, {**step_metrics, **alerts_lib.as_metrics(fired)})
        alerts_lib.raise_on_stop(fired)  # before this step's checkpoint: the last is good
        if step % (sc.checkpoint_every or c.checkpoint.every) == 0 or step == sc.steps:
            ckpt.save(step, params=lora.checkpointed(params), opt_state=opt_state, rng=root_key,
                      data_state=batches.get_state())
    ckpt.wait()
    ckpt.close()
    writer.close()
    return params
