"""Episodes of environments' tasks: the `Episode` record, the one turn loop (per-turn
sampler, or the rollout engine's slots), verdicts from each task's environment, and `to_batch`.

Token in, token out. An episode's history is a list of token ids that only ever grows: the
prompt (rendered by the chat format, `ptrain.chat`, through the tokenizer's own template),
then each model turn exactly as sampled (its end-of-turn token included), then each tool
observation (or retry feedback) rendered by the chat format and encoded on its own. Nothing is
re-tokenised, so the log-probs the sampler reported are those of the very tokens the learner
trains on, and the loss mask is 1 exactly on the tokens the model produced.

A turn ends at the format's end-of-turn token (Qwen's <|im_end|>, Llama 3's <|eot_id|>), or,
in the plain format (no turn token), at the closing tag of a tool call or at the eos. The
turn's calls (`chat.parse_tool_calls`: several Hermes calls per turn, or Llama 3's one) run
in order in the episode's session (its environment's `open_session`, e.g. a terminal task's
container with a persistent shell; else a `sandbox.Session`: one work dir per episode, kept
across its turns, removed after it) with its environment's tools, and their outputs come
back as one observation. A malformed call (not JSON, no name, an unknown or disallowed tool)
becomes an error observation the model can learn from, never an exception. A verifier sees
the answer turn's text without special tokens (`chat.verifier_text`): the stop token is
trained on, never judged.

Self-correction: after a final answer fails its verifier, the feedback is appended and the
model tries again, up to `max_attempts`; `attempt_reward` says how attempts make a reward.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import sandbox
from sandbox import fleet

from ptrain import chat
from ptrain import rewards as rewards_lib
from ptrain import routing as routing_lib
from ptrain import sharding
from ptrain import tasks as tasks_lib
from ptrain.batch import Batch
from ptrain.envs import base as envs_base
from ptrain.envs import verdict as verdict_lib
from ptrain.generate import engine_sampler
from ptrain.rollout import images as images_lib
from ptrain.rollout import turns
from ptrain.tasks import Task


ATTEMPT_REWARDS = ("final", "first", "mean", "discounted")
FINISHES = ("answered", "truncated", "max_turns", "max_len",  # Episode.finish
            "vision_token")  # (a VL policy sampled an image marker: `images.observe`)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    num_samples: int = 8  # G episodes per task (one prefill)
    max_new_tokens: int = 64  # per model turn
    max_turns: int = 4  # model turns per attempt (tool calls + the final answer)
    max_attempts: int = 1  # self-correction: tries per episode
    attempt_reward: str = "final"  # ATTEMPT_REWARDS
    discount: float = 0.5  # "discounted": reward of a pass at attempt k is discount**(k-1)
    max_len: int = 512  # tokens after the prompt: model turns, observations, feedback
    max_tool_output_chars: int = 1000
    tool_timeout_s: float = 5.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    session_backend: str = "auto"

    def __post_init__(self):
        if self.attempt_reward not in ATTEMPT_REWARDS:
            raise ValueError(f"attempt_reward={self.attempt_reward!r}; use {ATTEMPT_REWARDS}")
        if min(self.num_samples, self.max_new_tokens, self.max_turns, self.max_attempts) < 1:
            raise ValueError("num_samples, max_new_tokens, max_turns, max_attempts must be >= 1")
        if self.max_new_tokens > self.max_len:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} exceeds the episode's "
                             f"max_len={self.max_len} (tokens after the prompt)")


@dataclasses.dataclass
class Episode:
    """One episode on the host. `tokens`, `mask` and `logp` are aligned: token i was produced
    by the model iff mask[i] == 1, in which case logp[i] is its log-prob under the sampled
    policy (logits / temperature, `Samples.logp_temp`).
    `finish`: answered (a turn without calls), truncated (an answer cut at max_new_tokens,
    judged as it is), max_turns, max_len (out of room), vision_token (a vision-language
    policy sampled an image marker token in a turn that called tools: `images.observe`).
    """

    task: Task
    group_id: int
    tokens: list[int]
    mask: list[int]
    logp: list[float]
    prompt_len: int
    answers: list[str] = dataclasses.field(default_factory=list)  # the final text per attempt
    verdicts: list = dataclasses.field(default_factory=list)  # an envs.Verdict per attempt
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    finish: str = ""  # FINISHES
    session: Any = None  # where its tools run: a sandbox.Session, or its env's open_session's
    closed: bool = True  # the last model turn ended with its sampled end-of-turn token
    # MoE: the experts the sampler routed the first tokens to (`ptrain.routing.record`)
    routing: list = dataclasses.field(default_factory=list)
    # rl.interrupt (the engine): the policy version of each token (aligned with `tokens`;
    # ptrain.generate.interrupt.UNSAMPLED where mask is 0), or None
    versions: list | None = None
    env: envs_base.Environment | None = None  # the task's environment (its tools, verifier)
    # a vision-language policy's: the images of `tokens` in order, (patches, grid) each, and
    # the run's `images.Vision` (None: a text-only policy)
    images: list = dataclasses.field(default_factory=list)
    vision: images_lib.Vision | None = None

    @property
    def attempts(self) -> int:
        return len(self.answers)

    def reward(self, config: RolloutConfig) -> float:
        if not self.verdicts:
            return 0.0
        rewards = [v.reward for v in self.verdicts]
        if config.attempt_reward == "final":
            return rewards[-1]
        if config.attempt_reward == "first":
            return rewards[0]
        if config.attempt_reward == "mean":
            return float(np.mean(rewards))
        passed = next((k for k, v in enumerate(self.verdicts) if v.passed), None)
        return 0.0 if passed is None else config.discount ** passed

    def text(self, decode) -> str:
        """The whole episode after the prompt, as text (for logs)."""
        return decode(self.tokens[self.prompt_len:])


# ----------------------------------------------------------------------------- rendering

def render_prompt(task: Task, tokenizer, fmt: chat.ChatFormat = chat.PLAIN,
                  env: envs_base.Environment | None = None) -> list[int]:
    """The task's prompt ids, ending where the model's first turn begins: its environment's
    `prompt_ids`, or `chat.render_prompt` (the tokenizer's chat template with the schemas of
    the task's tools, or plain text)."""
    env = env or builtin(task.domain)
    if env.prompt_ids is not None:
        return list(env.prompt_ids(task, tokenizer, fmt))
    return chat.render_prompt(fmt, tokenizer, prompt=task.prompt, messages=task.messages,
                              tools=[env.tool(name) for name in task.tools])


def render_prompts(tasks, envs, tokenizer, fmt, vision=None):
    """(prompt ids per task, images per task): `render_prompt`, or for a vision-language
    policy (`vision`, a `rollout.images.Vision`) and a task with prompt images, the chat
    template with the images' placeholders expanded (`images.render_prompt`)."""
    images_lib.check(tasks, envs, vision)
    ids, images = [], []
    for task, env in zip(tasks, envs):
        if vision is not None and images_lib.task_images(task):
            p, im = images_lib.render_prompt(task, tokenizer, fmt, env, vision)
            images_lib.check_budget(task, im, vision)
        else:
            p, im = render_prompt(task, tokenizer, fmt, env), []
        ids.append(p)
        images.append(im)
    return ids, images


def builtin(name: str) -> envs_base.Environment:
    """The environment of tasks with built-in verifiers and the sandbox's tools (what a task
    needs without one of its own: `generate` uses it for domains `envs` does not name)."""
    return envs_base.Environment(
        name=name, tasks=lambda ctx: envs_base.Splits((), ()), verify=rewards_lib.verify_all,
        tools=envs_base.sandbox_tools_named(*tasks_lib.TOOLS),
        opens_session=rewards_lib.needs_session)


def _environments(tasks, envs) -> list[envs_base.Environment]:
    envs = dict(envs or {})
    for task in tasks:
        if task.domain not in envs:
            envs[task.domain] = builtin(task.domain)
    return [envs[task.domain] for task in tasks]


# ----------------------------------------------------------------------------- episodes

def generate(sampler, params, tasks: Sequence[Task], *, tokenizer, key,
             config: RolloutConfig = RolloutConfig(), fmt: chat.ChatFormat = chat.PLAIN,
             pool=None, reward_config: rewards_lib.RewardConfig = rewards_lib.RewardConfig(),
             first_group_id: int = 0, verify_now: bool | None = None,
             envs=None, vision: images_lib.Vision | None = None) -> list[Episode]:
    """Runs `num_samples` episodes of every task; rows are task-major (task i owns rows
    i*G .. i*G+G-1, group id `first_group_id + i`). `envs`: the tasks' environments by name
    (their tools, prompts and verifiers); a domain it does not name has `builtin`'s.
    `vision`: a vision-language policy's image settings (default: its model's,
    `images.of`); prompts with images and tools that return images (`rollout.images`) need
    one, and a text-only policy given such tasks is refused here, before any generation.

    Verdicts come from `verify_episodes` (the sandbox pool); with one attempt they can be
    left to the caller (`verify_now=False`) so that judging overlaps the next generation.
    Sessions of episodes that are not judged yet stay open until `verify_episodes` closes
    them.

    Many processes: each passes its own tasks and runs (tools, verdicts) its own episodes;
    every model turn is one sampler call over the episodes of all processes, in process
    order (`sample_across`), so turn counts, shapes and stops are the same everywhere and equal
    what one process holding every task would sample.

    With an EngineSampler (sampling.engine=True) the episodes run on the rollout engine
    instead, each in its own slot across turns and attempts, its observations prefilled
    alone (`engine_sampler.run_episodes`); with many processes each runs its own episodes on
    its own engine, in no step with the others.
    """
    c = config
    verify_now = c.max_attempts > 1 if verify_now is None else verify_now
    if c.max_attempts > 1 and not verify_now:
        raise ValueError("self-correction (max_attempts > 1) needs verdicts during the episode")
    task_envs = _environments(tasks, envs)
    vision = images_lib.of(sampler, vision)
    prompts, prompt_images = render_prompts(tasks, task_envs, tokenizer, fmt, vision)
    episodes = [Episode(task=task, group_id=first_group_id + i, tokens=list(prompt),
                        mask=[0] * len(prompt), logp=[0.0] * len(prompt),
                        prompt_len=len(prompt), env=env, images=list(pictures), vision=vision)
                for i, (task, prompt, env, pictures) in enumerate(
                    zip(tasks, prompts, task_envs, prompt_images))
                for _ in range(c.num_samples)]
    if vision is not None and isinstance(sampler, engine_sampler.EngineSampler):
        raise NotImplementedError("a vision-language policy's episodes run on the per-turn "
                                  "sampler for now (sampling.engine=False)")
    try:
        open_sessions(episodes, pool, c)
        if isinstance(sampler, engine_sampler.EngineSampler):  # episodes keep their slots
            engine_sampler.run_episodes(
                sampler, params, episodes, prompts, key, tokenizer, fmt, c,
                verify=lambda es: verify_episodes(es, pool=pool, config=reward_config,
                                                  close_sessions=False),
                verify_now=verify_now)
        else:
            _run_attempts(sampler, params, episodes, prompts, key, tokenizer, fmt, c,
                          pool=pool, reward_config=reward_config, verify_now=verify_now)
    except BaseException:
        close(episodes)
        raise
    if verify_now:
        close(episodes)
    return episodes


def open_sessions(episodes, pool, c) -> None:
    """Each episode's session, where its tools run: its environment's `open_session`, or a
    `sandbox.Session` (on a Ray fleet pool the sessions run there too: their work dirs
    travel with each turn); opened concurrently."""
    make_session = sandbox.Session if pool is None else fleet.session_factory(pool)

    def open_one(e):
        if e.env.open_session is not None:
            e.session = e.env.open_session(e.task)
        elif e.env.opens_session(e.task):
            e.session = make_session(backend=c.session_backend,
                                     files=dict(e.task.files) or None)
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as threads:
        list(threads.map(open_one, episodes))


def _run_attempts(sampler, params, episodes, prompts, key, tokenizer, fmt, c, *, pool,
                  reward_config, verify_now):
    """The static sampler's episodes: each attempt's turns in step across the batch (and
    across processes), retry feedback appended to the episodes an attempt failed."""
    keys = iter(jax.random.split(key, c.max_attempts * c.max_turns))
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as threads:
        for attempt in range(c.max_attempts):
            active = [e for e in episodes if attempt == 0 or (
                e.verdicts and not e.verdicts[-1].passed and
                e.finish in ("answered", "truncated") and not images_lib.sampled_marker(e))]
            if not sharding.agree(bool(active), "any"):  # none left on any process
                break
            if attempt > 0:
                for e in active:
                    turns.append(e, tokenizer, chat.feedback(fmt, e.verdicts[-1].feedback,
                                                        closed=e.closed), c)
                active = [e for e in active if e.finish != "max_len"]
            _run_attempt(sampler, params, active, keys, tokenizer, fmt, c, threads,
                         first=attempt == 0, prompts=prompts)
            if verify_now:
                verify_episodes(active, pool=pool, config=reward_config,
                                close_sessions=False)


def sample_across(sampler, params, histories, *, num_samples=1, **kwargs):
    """sampler.sample of this process's histories, in one call over every process's (each
    holding its devices' rows of it, `shared`): returns this process's rows (maybe none).
    With one process, sampler.sample itself. Every process must call it, with or without
    histories of its own (the episode loops agree on that with `sharding.agree`)."""
    if jax.process_count() == 1:
        return sampler.sample(params, histories, num_samples=num_samples, **kwargs)
    mesh = getattr(sampler, "mesh", None)
    blocks = sharding.gather_blocks([list(h) for h in histories], mesh)
    everyone = [h for block in blocks for h in block]
    out = sampler.sample(params, everyone, num_samples=num_samples, shared=True, **kwargs)
    mine = sharding.row_block(mesh)[0]
    start = sum(len(b) for b in blocks[:mine]) * num_samples
    rows = slice(start, start + len(histories) * num_samples)
    prompts = slice(start // num_samples, start // num_samples + len(histories))
    return dataclasses.replace(
        out, tokens=out.tokens[rows], logp=out.logp[rows], logp_temp=out.logp_temp[rows],
        logp_t1=out.logp_t1[rows], lengths=out.lengths[rows],
        finish_reasons=out.finish_reasons[rows],
        prompt_index=out.prompt_index[rows] - start // num_samples,
        experts=None if out.experts is None else out.experts[rows],
        prompt_experts=None if out.prompt_experts is None else out.prompt_experts[prompts])


def _run_attempt(sampler, params, episodes, keys, tokenizer, fmt, c, threads, *, first,
                 prompts):
    """Model turns until each episode answers (a turn without a tool call) or hits a cap."""
    stop_ids, stop_strings = turns.turn_stops(
        fmt, tokenizer, c.stop_token_ids,
        tools=sharding.agree(any(e.task.tools for e in episodes), "any"))
    text = turns.TurnText.of(tokenizer, fmt, c)
    vision = next((e.vision for e in episodes), None)
    active = list(episodes)
    for turn in range(c.max_turns):
        if not sharding.agree(bool(active), "any"):  # none left on any process
            return
        kwargs = dict(max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_k=c.top_k,
                      top_p=c.top_p, greedy=c.greedy, stop_token_ids=stop_ids,
                      stop_strings=stop_strings, key=next(keys))
        if first and turn == 0:  # one prefill per task, G samples each (its images too)
            kwargs.update(images_lib.sample_kwargs([e.images for e in active[::c.num_samples]],
                                                   vision))
            samples = sample_across(sampler, params, prompts, num_samples=c.num_samples, **kwargs)
        else:
            kwargs.update(images_lib.sample_kwargs([e.images for e in active], vision))
            samples = sample_across(sampler, params, [e.tokens for e in active], **kwargs)
        calls = []
        for row, e in enumerate(active):
            n = int(samples.lengths[row])
            room = c.max_len - (len(e.tokens) - e.prompt_len)
            new = samples.tokens[row, :min(n, room)].tolist()
            routing_lib.record(e.routing, samples, row, len(e.tokens), len(new))
            found = turns.take_turn(e, new, samples.logp_temp[row, :len(new)].tolist(), text,
                                    cut=n > room,
                                    hit_length=samples.finish_reasons[row] == "length")
            if found:
                calls.append((e, found))
        # Run this turn's tool calls (episodes concurrently, an episode's calls in order),
        # each episode's outputs appended as one observation.
        outputs = threads.map(lambda ec: [turns.call_tool(ec[0], call, c) for call in ec[1]],
                              calls)
        active = [e for (e, _), out in zip(calls, outputs)
                  if turns.observe(e, out, tokenizer, fmt, c)]
    for e in active:  # out of turns without a final answer
        e.finish = "max_turns"
        e.answers.append("")


def verify_episodes(episodes: Sequence[Episode], *, pool=None,
                    config: rewards_lib.RewardConfig = rewards_lib.RewardConfig(),
                    close_sessions: bool = True) -> None:
    """Judges each episode's latest answer by its environment (adds a verdict, checked:
    `judge`), then removes the work dirs."""
    todo = [e for e in episodes if len(e.verdicts) < len(e.answers)]
    by_env: dict = {}
    for e in todo:
        env = e.env or builtin(e.task.domain)
        by_env.setdefault(env.name, (env, []))[1].append(e)
    for env, mine in by_env.values():
        verdicts = judge(env, [e.task for e in mine], [e.answers[-1] for e in mine],
                         pool=pool, sessions=[e.session for e in mine], config=config)
        for e, v in zip(mine, verdicts):
            e.verdicts.append(v)
    if close_sessions:
        close(episodes)


def judge(env: envs_base.Environment, tasks, answers, **kwargs) -> list:
    """env.verify's verdicts, one per answer, each checked (`envs.verdict.check`: a reward
    that is not a finite number, a rubric whose weights do not sum to 1, is an error naming
    the environment)."""
    out = list(env.verify(tasks, answers, **kwargs))
    if len(out) != len(answers):
        raise ValueError(f"environment {env.name!r}: verify returned {len(out)} verdicts for "
                         f"{len(answers)} answers")
    return [verdict_lib.check(v, env=env.name) for v in out]


def close(episodes: Sequence[Episode]) -> None:
    """Closes the episodes' sessions (removes their work dirs; a terminal task's container
    is reset and kept warm), concurrently."""
    def close_one(e):
        if e.session is not None:
            e.session.close()
            e.session = None
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as threads:
        list(threads.map(close_one, episodes))


def to_batch(episodes: Sequence[Episode], config: RolloutConfig, *, prompt_len: int,
             length: int, tokenizer=None, pad_id: int = 0, max_len=None,
             vision: images_lib.Vision | None = None) -> Batch:
    """The episodes as a `batch.Batch`: each history split at its prompt, its reward (from
    its verdicts, `Episode.reward`) in `rewards_b`, the last verdict's passed, feedback,
    error type and rubric components in its row's meta (with a tokenizer, also the prompt and
    completion texts);
    a MoE's recorded routing (`ptrain.routing.pack`); `max_len`: the episodes' cap
    (`Batch.max_len_b`). A vision-language policy's rows carry their images
    (`images.attach`: the patch budgets of `vision`, default the episodes' own, fixed per
    run so that every step has the same shapes)."""
    meta = []
    for e in episodes:
        last = e.verdicts[-1] if e.verdicts else None
        row = {"task_id": e.task.id, "domain": e.task.domain, "turns": e.turns,
               "attempts": e.attempts, "tool_calls": e.tool_calls,
               "tool_errors": e.tool_errors, "finish": e.finish,
               "passed": bool(last and last.passed),
               "feedback": last.feedback if last else "",
               "error_type": last.error_type if last else ""}
        if last is not None and last.components:  # a rubric's parts, for the metrics
            row["components"] = {k: float(v) for k, v in last.components.items()}
        if tokenizer is not None:
            row["prompt"] = tokenizer.decode(e.tokens[:e.prompt_len])
            row["completion"] = tokenizer.decode(e.tokens[e.prompt_len:])
        meta.append(row)
    batch = Batch.from_histories(
        [e.tokens for e in episodes], [e.mask for e in episodes], [e.logp for e in episodes],
        [e.reward(config) for e in episodes], [e.group_id for e in episodes],
        prompt_lens=[e.prompt_len for e in episodes], prompt_len=prompt_len, length=length,
        meta=meta, pad_id=pad_id, max_len=max_len)
    routing_lib.pack(batch, [(e.routing, len(e.tokens), e.prompt_len) for e in episodes])
    if episodes and all(e.versions is not None for e in episodes):  # rl.interrupt
        batch.versions_bn = np.full(batch.tokens_bn.shape, -1, np.int32)
        for i, e in enumerate(episodes):
            v = e.versions[e.prompt_len:]
            batch.versions_bn[i, :len(v)] = v
    vision = vision or next((e.vision for e in episodes if e.vision is not None), None)
    if vision is not None:
        batch = images_lib.attach(batch, episodes, vision)
    return batch
