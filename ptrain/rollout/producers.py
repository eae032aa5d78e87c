"""The producers of a step's batch (see `ptrain.rollout`): `SingleTurn`, `Tasks`,
`FromFunction`, the sampler they use, and the closed-loop config's episode and verifier
settings."""

from __future__ import annotations

from typing import Any, Protocol

from ptrain import chat
from ptrain import data as data_lib
from ptrain import rewards as rewards_lib
from ptrain import tasks as tasks_lib
from ptrain.batch import Batch
from ptrain.generate import engine_sampler
from ptrain.generate.sampler import Sampler
from ptrain.rollout import agents as agents_lib
from ptrain.rollout.episodes import RolloutConfig, generate, to_batch, verify_episodes
from ptrain.tasks import Task


class Producer(Protocol):
    """What `learner.train` draws a step's batch from (see the module docstring)."""

    def generate(self, params, records: list[dict], key) -> Any: ...

    def score(self, generated) -> Batch: ...


def make_sampler(model, config, tokenizer=None):
    """A sampler for `model` (concrete or abstract: parameters come with each call), with the
    tokenizer's pad id and decode (stop strings) and config.sampling.stop_check_every; with
    config.sampling.engine the rollout engine behind the same `sample` interface (with
    sampling.decode_dtype, decoding its own copy of the weights, `ptrain.generate.decode_weights`)."""
    common = dict(seed=config.seed, pad_id=pad_id(tokenizer),
                  decode=tokenizer.decode if tokenizer is not None else None,
                  stop_check_every=config.sampling.stop_check_every)
    if config.sampling.engine:
        return engine_sampler.EngineSampler(model, slots=config.sampling.engine_slots,
                                            decode_dtype=config.sampling.decode_dtype, **common)
    return Sampler(model, **common)


def pad_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def decode(tokenizer, ids) -> str:
    """Text of token ids; without a tokenizer, the ids themselves (records carry ids)."""
    if tokenizer is None:
        return " ".join(str(int(i)) for i in ids)
    return tokenizer.decode(list(ids))


class SingleTurn:
    """G samples per prompt record, each scored by reward_fn(record, completion_ids,
    completion_text) -> reward, or (reward, feedback text). Rows of prompt i form group i."""

    def __init__(self, config, sampler, *, tokenizer=None, reward_fn=None):
        self.config, self.sampler, self.tokenizer = config, sampler, tokenizer
        self.reward_fn = reward_fn or config.reward_fn
        if self.reward_fn is None:
            raise ValueError("config.reward_fn is not set: give a callable "
                             "reward_fn(record, completion_ids, completion_text)")

    def generate(self, params, records, key):
        c, s = self.config, self.config.sampling
        prompts = [data_lib.record_ids(r, "prompt_ids", "prompt", self.tokenizer)
                   for r in records]
        for record, prompt in zip(records, prompts):
            if len(prompt) > c.data.max_prompt_len:
                raise ValueError(f"prompt {data_lib.short(record)} has {len(prompt)} tokens, "
                                 f"more than data.max_prompt_len={c.data.max_prompt_len}")
        out = self.sampler.sample(
            params, prompts, max_new_tokens=s.max_new_tokens, num_samples=s.num_samples,
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
            stop_token_ids=tuple(s.stop_token_ids), stop_strings=tuple(s.stop_strings),
            key=key, prompt_len=c.data.max_prompt_len, batch_size=len(prompts))
        return records, prompts, out

    def score(self, generated) -> Batch:
        records, prompts, out = generated
        c = self.config
        completions = out.completions()
        rewards, meta = [], []
        for r, completion in enumerate(completions):
            i = out.prompt_index[r]
            text = decode(self.tokenizer, completion)
            reward, feedback = _reward_and_feedback(
                self.reward_fn(records[i], completion, text))
            rewards.append(reward)
            meta.append({"prompt": decode(self.tokenizer, prompts[i]), "completion": text,
                         "feedback": feedback, "finish_reason": out.finish_reasons[r]})
            if isinstance(records[i], dict):  # per-domain metrics, the adaptive draw
                meta[-1].update({k: records[i][name] for k, name in
                                 (("domain", "domain"), ("task_id", "id")) if name in records[i]})
        batch = Batch.from_rows(
            [prompts[i] for i in out.prompt_index], completions,
            [[1] * len(x) for x in completions], [out.logp_temp[r, :len(x)]
                                                   for r, x in enumerate(completions)],
            rewards, out.prompt_index, prompt_len=c.data.max_prompt_len,
            length=c.sampling.max_new_tokens, meta=meta, pad_id=pad_id(self.tokenizer))
        batch.versions_bn = out.versions  # rl.interrupt: each token's policy version
        if out.experts is not None:  # MoE: the sampler's routing, for replay and agreement
            batch.experts_bnlk = out.experts
            batch.prompt_experts_bplk = out.prompt_experts[out.prompt_index]
        return batch


def _reward_and_feedback(value):
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(f"reward_fn returned {value!r}; return a number or "
                             "(reward, feedback)")
        return float(value[0]), value[1]
    return float(value), None


class FromFunction:
    """rollout_fn(params, records, key) -> Batch as a producer: `generate` does it all."""

    def __init__(self, rollout_fn):
        self.rollout_fn = rollout_fn

    def generate(self, params, records, key) -> Batch:
        return self.rollout_fn(params, records, key)

    def score(self, batch: Batch) -> Batch:
        return batch


class Tasks:
    """`ptrain.tasks.Task`s: `generate` runs the model and its tool calls, `score`
    judges the answers in the sandbox pool and packs the rows (the learner may run the two in
    different threads, overlapping batch t's scoring with batch t+1's generation)."""

    def __init__(self, sampler, tokenizer, config, pool, envs=None, vision=None):
        self.sampler, self.tokenizer, self.pool = sampler, tokenizer, pool
        self.envs = dict(envs or {})  # name -> Environment (`generate`'s envs)
        self.vision = vision  # a VL policy's `rollout.images.Vision` (default its model's)
        self.rollout_config = rollout_config(config)
        self.reward_config = reward_config(config)
        self.fmt = chat.FORMATS[config.rollout.chat_format]
        self.prompt_len = config.data.max_prompt_len
        self.length = config.rollout.max_len
        self.pad_id = pad_id(tokenizer)

    def generate(self, params, records, key):
        """records: `ptrain.tasks.Task`s or an environment's own tasks (the closed loop's
        prompt stream serves them), or task records as a ptrain task file holds them (dicts,
        read by `tasks.from_record`: the one conversion, for prompt sources that yield
        records, e.g. data.records_fn)."""
        tasks = []
        for r in records:
            if isinstance(r, dict):
                r = tasks_lib.from_record(r)
            if not all(hasattr(r, name) for name in ("id", "domain", "tools")):
                raise TypeError(f"rollout.Tasks.generate takes ptrain.tasks.Task objects, an "
                                f"environment's own tasks (with id, domain, tools) or task "
                                f"records (dicts); got {type(r).__name__}: {r!r:.80}")
            tasks.append(r)
        return generate(self.sampler, params, tasks, tokenizer=self.tokenizer, key=key,
                        config=self.rollout_config, fmt=self.fmt, pool=self.pool,
                        reward_config=self.reward_config, envs=self.envs, vision=self.vision)

    def score(self, episodes) -> Batch:
        verify_episodes(episodes, pool=self.pool, config=self.reward_config)
        return to_batch(episodes, self.rollout_config, prompt_len=self.prompt_len,
                        length=self.length, tokenizer=self.tokenizer, pad_id=self.pad_id,
                        max_len=self.length)


class Agents:
    """Tasks of agent-driven environments (`Environment.agent`, `rollout.agents`): `generate`
    publishes `params` to the served policy (`server`: `serve.make_server`'s, its service's
    runner) and runs every task's agent program `sampling.num_samples` times against it,
    judged by the task's environment; `score` packs the recorded tokens (`Tasks.score`)."""

    def __init__(self, server, tokenizer, config, envs, pool=None):
        self.server, self.envs, self.pool = server, dict(envs), pool
        for name, env in self.envs.items():
            if env.agent is None:
                raise ValueError(f"environment {name!r} has no agent program "
                                 "(Environment.agent): its tasks go to rollout.Tasks")
        self.num_samples = config.sampling.num_samples
        self.runner = server.RequestHandlerClass.service.runner
        self.packer = Tasks(None, tokenizer, config, pool, envs=envs)

    def generate(self, params, records, key):
        del key  # the server's sequences draw their own keys (ServeConfig.seed)
        tasks = [r if isinstance(r, Task) else tasks_lib.from_record(r) for r in records]
        unknown = sorted({t.domain for t in tasks} - set(self.envs))
        if unknown:
            raise ValueError(f"tasks of domains {unknown} have no agent-driven environment "
                             f"here (known: {sorted(self.envs)})")
        if params is not None:  # this step's weights, one version newer
            self.runner.publish(self.runner.version + 1, params)
        return agents_lib.run_episodes(self.server, tasks, [self.envs[t.domain] for t in tasks],
                                       num_samples=self.num_samples, pool=self.pool,
                                       reward_config=self.packer.reward_config)

    def score(self, episodes) -> Batch:
        return self.packer.score(episodes)


def rollout_config(config, **changes) -> RolloutConfig:
    """The closed-loop config's episode settings (rollout.*, sampling.*, sandbox.backend)."""
    r, s = config.rollout, config.sampling
    fields = dict(
        num_samples=s.num_samples, max_new_tokens=s.max_new_tokens, max_turns=r.max_turns,
        max_attempts=r.max_attempts, attempt_reward=r.attempt_reward, discount=r.discount,
        max_len=r.max_len, max_tool_output_chars=r.max_tool_output_chars,
        tool_timeout_s=r.tool_timeout_s, temperature=s.temperature, top_k=s.top_k,
        top_p=s.top_p, stop_token_ids=tuple(s.stop_token_ids),
        session_backend=config.sandbox.backend)
    fields.update(changes)
    return RolloutConfig(**fields)


def reward_config(config) -> rewards_lib.RewardConfig:
    """The closed-loop config's verifier settings (reward.*, sandbox.backend)."""
    r = config.reward
    return rewards_lib.RewardConfig(partial_credit=r.partial_credit, timeout_s=r.timeout_s,
                                    test_timeout_s=r.test_timeout_s, memory_mb=r.memory_mb,
                                    backend=config.sandbox.backend)
