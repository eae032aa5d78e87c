"""RL episodes on terminal tasks: the shell agent in many task containers at once, rewarded
by each task's own verifier.

    producer = TerminalProducer(sampler, tokenizer, harness=h, fmt=chat.PLAIN, stop_ids=...,
                                config=TerminalRolloutConfig(num_samples=8), prompt_len=32)
    episodes = producer.score(producer.generate(params, records, key))   # batch.Batch

`generate` opens `num_samples` episodes of every task (a clean warm container and a fresh
shell each, `sandbox.terminal.Harness`), then runs the turns of all of them in lockstep: one
`Sampler.sample` call per turn for every episode still going (batched on the device), then
each episode's tool calls in its own shell, concurrently (`ShellAgent.step`: the same parsing
and rendering as the evaluation's agent). `score` runs every episode's verifier (the task's
tests, copied in only now), closes the episodes (their containers are reset and kept warm)
and packs the token histories for the learner: the loss mask is 1 on the model's tokens
only, the log-probs are the sampler's, the reward is the verifier's, the rows' meta carry the
domain ("terminal"), pass, turns, tool calls and how the episode ended (per-domain metrics:
`batch.domain_metrics`). A record names its task by directory: {"task_dir": PATH}; rows of
task i form group `first_group_id + i`.

With rl.interrupt (`params` an `interrupt.Live`, on the rollout engine) every turn's call
gets the same Live: a weight update published while a turn decodes switches it at its next
decode round (the engine recomputes the rows' caches), one published while the episodes'
tools run switches the next turn before its prefill, and a swap advances the Live, so each
turn starts from the newest version the generation took (never an older one; each turn
prefills its whole history under the weights it samples with, so no cache mixes versions).
Each token keeps the log-prob it was sampled with and its version (`Rollout.versions`,
`Batch.versions_bn`; UNSAMPLED on the prompt and the tool results).

Many processes: each opens and steps the episodes of its own records; every turn is one
sampler call over the histories of all processes (`rollout.sample_across`), made while any
episode on any process is still going, so all processes issue the same programs and sample
what one process holding every record would. `evaluate` runs this process's block of the
held-out tasks; `terminal_env.evaluate` gathers the verdicts.

The learner's producer interface (`generate(params, records, key)`, `score(generated) ->
Batch`) is all this module needs of the training loop.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import jax
import numpy as np

from ptrain import batch as batch_lib
from ptrain import chat
from ptrain.envs.verdict import Verdict
from ptrain import rollout as rollout_lib
from ptrain import routing
from ptrain import sharding
from ptrain.envs.terminal import agent as terminal_agent
from ptrain.generate import interrupt


@dataclasses.dataclass(frozen=True)
class TerminalRolloutConfig:
    num_samples: int = 8  # episodes per task (a GRPO group)
    max_new_tokens: int = 64  # per model turn
    max_turns: int = 4
    max_len: int = 256  # tokens after the prompt: turns and tool results
    max_output_chars: int = 500  # of a command's output, in the observation
    call_timeout_s: float = 20.0
    temperature: float = 1.0
    greedy: bool = False
    threads: int = 16  # episodes opened, stepped and verified at once
    system: str = terminal_agent.SYSTEM  # "" for a small model trained on bare instructions

    def __post_init__(self):
        if min(self.num_samples, self.max_new_tokens, self.max_turns, self.threads) < 1:
            raise ValueError("num_samples, max_new_tokens, max_turns and threads must be >= 1")
        if self.max_new_tokens > self.max_len:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} exceeds max_len="
                             f"{self.max_len} (tokens after the prompt)")


@dataclasses.dataclass
class Rollout:
    task: object  # sandbox.terminal.Task
    group_id: int
    episode: object  # sandbox.terminal.Episode (open until `verify_rollouts`)
    tokens: terminal_agent.Tokens | None = None
    done: bool = False
    result: object = None  # sandbox.terminal.VerifierResult: what the task's tests gave
    verdict: Verdict | None = None  # the learner's form of it (`verdict`)
    error: str = ""  # the harness could not run this episode (it scores 0)
    turns: int = 0  # kept from the episode when it closes
    tool_calls: int = 0
    # MoE: the experts the sampler routed the first tokens to (`ptrain.routing.record`)
    routing: list = dataclasses.field(default_factory=list)
    # rl.interrupt: the policy version of each token (aligned with tokens.ids;
    # interrupt.UNSAMPLED where the model did not sample it), or None
    versions: list | None = None
    domain: str = "terminal"  # the environment's name (the rows' meta)


class _Tasks:
    """Terminal tasks by directory, each loaded once."""

    def __init__(self):
        self._by_dir, self._lock = {}, threading.Lock()

    def get(self, task_dir: str):
        from sandbox import terminal
        with self._lock:
            if task_dir not in self._by_dir:
                self._by_dir[task_dir] = terminal.load_task(task_dir)
            return self._by_dir[task_dir]


def generate(sampler, params, tasks, *, harness, agent: terminal_agent.ShellAgent, key,
             config: TerminalRolloutConfig, first_group_id: int = 0,
             pool: concurrent.futures.Executor, domains=None) -> list[Rollout]:
    """`config.num_samples` episodes of every task, their agent turns done (see the module
    docstring); the episodes stay open for `verify_rollouts`. `domains`: each task's
    environment name (default "terminal")."""
    c = config
    domains = domains or ["terminal"] * len(tasks)
    specs = [(task, first_group_id + i, domain)
             for i, (task, domain) in enumerate(zip(tasks, domains))
             for _ in range(c.num_samples)]

    def open_one(spec):
        task, group, domain = spec
        try:
            return Rollout(task, group, harness.episode(task), domain=domain)
        except Exception as e:  # noqa: BLE001 (no environment: this episode scores 0)
            return Rollout(task, group, None, done=True, error=f"{type(e).__name__}: {e}",
                           domain=domain)

    rollouts = list(pool.map(open_one, specs))
    interruptible = isinstance(params, interrupt.Live)  # rl.interrupt: each token's version
    try:
        for r in rollouts:
            if r.episode is not None:
                r.tokens = agent.start(r.episode)
            else:  # the group's prompt all the same, nothing after it
                ids = terminal_agent.render_prompt(agent.fmt, agent.tokenizer,
                                                   r.task.instruction, agent.system)
                r.tokens = terminal_agent.Tokens(ids, [0] * len(ids), [0.0] * len(ids),
                                                 len(ids), finish="error")
            if interruptible:
                r.versions = [interrupt.UNSAMPLED] * len(r.tokens.ids)
        for turn in range(c.max_turns):
            active = [r for r in rollouts if not r.done]
            if not sharding.agree(bool(active), "any"):  # none left on any process
                break
            samples = rollout_lib.sample_across(
                sampler, params, [r.tokens.ids for r in active],
                max_new_tokens=c.max_new_tokens, temperature=c.temperature, greedy=c.greedy,
                stop_token_ids=agent.stop_ids, key=jax.random.fold_in(key, turn))
            if interruptible and samples.versions is None:
                raise ValueError("rl.interrupt: the terminal producer's sampler recorded no "
                                 "per-token policy versions; sample on the rollout engine "
                                 "(sampling.engine=True)")

            def step(row):
                r = active[row]
                n = int(samples.lengths[row])
                before = len(r.tokens.ids)  # the history this call's prefill routed
                kept = min(n, c.max_len - (before - r.tokens.prompt_len))  # as step keeps
                routing.record(r.routing, samples, row, before, max(kept, 0))
                r.done = agent.step(r.episode, r.tokens, samples.tokens[row, :n].tolist(),
                                    samples.logp_temp[row, :n].tolist())
                if r.versions is not None:  # the turn's kept tokens, then its observation
                    sampled = sum(r.tokens.mask[before:])
                    r.versions += samples.versions[row, :sampled].tolist() + [
                        interrupt.UNSAMPLED] * (len(r.tokens.ids) - before - sampled)
            list(pool.map(step, range(len(active))))
        for r in rollouts:
            if not r.done:
                r.done, r.tokens.finish = True, "max_turns"
    except BaseException:
        close(rollouts, pool)
        raise
    return rollouts


def verify_rollouts(rollouts: list[Rollout], pool: concurrent.futures.Executor) -> None:
    """Each episode's verdict (the task's tests), then the episodes are closed."""
    def verify(r):
        if r.episode is None:
            return
        try:
            r.result = r.episode.verify()
            r.verdict = verdict(r.result)
        except Exception as e:  # noqa: BLE001 (a container that died: reward 0, with why)
            r.error = f"{type(e).__name__}: {e}"
    try:
        list(pool.map(verify, rollouts))
    finally:
        close(rollouts, pool)


def close(rollouts, pool) -> None:
    def close_one(r):
        if r.episode is not None:
            r.turns, r.tool_calls = r.episode.turns, r.episode.tool_calls
            try:
                r.episode.close()
            except Exception:  # noqa: BLE001 (the harness drops a container it cannot reset)
                pass
            r.episode = None
    list(pool.map(close_one, rollouts))


def reward(r: Rollout) -> float:
    return float(r.verdict.reward) if r.verdict is not None else 0.0


def passed(r: Rollout) -> bool:
    return bool(r.verdict is not None and r.verdict.passed)


def verdict(result) -> Verdict:
    """A task verifier's result (`sandbox.terminal.VerifierResult`: this domain's judge
    report) as the learner's `Verdict`: its reward and pass, the fraction of its tests
    that passed (the reward where no pytest ran), its feedback, and an error type ("" when
    solved; "timeout", "verifier_error" when the tests gave no usable result, else the first
    failing test's status, or "wrong_answer")."""
    tests = result.tests
    ok = sum(s in ("PASSED", "XFAIL") for s in tests.values())
    fraction = ok / len(tests) if tests else float(result.reward)
    if result.passed:
        error_type = ""
    elif result.timed_out:
        error_type = "timeout"
    elif result.error:
        error_type = "verifier_error"
    else:
        bad = [s for s in tests.values() if s in ("FAILED", "ERROR")]
        error_type = bad[0].lower() if bad else "wrong_answer"
    return Verdict(float(result.reward), bool(result.passed), fraction,
                           result.feedback, error_type)


def to_batch(rollouts: list[Rollout], *, tokenizer, prompt_len: int, length: int,
             pad_id: int = 0, max_len=None) -> batch_lib.Batch:
    """The rollouts (after `verify_rollouts`) as a `batch.Batch`, as `rollout.to_batch` packs
    the other domains' episodes: each history split at its prompt, the verdict's reward in
    `rewards_b`, its passed, feedback and error type in the row's meta (with the domain,
    turns, tool calls, how the episode ended, the harness's error, the prompt and completion
    texts), the sampler's recorded MoE routing (`ptrain.routing.pack`); `max_len`: the
    episodes' cap (`Batch.max_len_b`)."""
    meta = []
    for r in rollouts:
        t, v = r.tokens, r.verdict
        meta.append({"task_id": r.task.name, "domain": r.domain, "passed": passed(r),
                     "turns": r.turns, "tool_calls": r.tool_calls, "finish": t.finish,
                     "error": r.error or (r.result.error if r.result else "") or "",
                     "error_type": v.error_type if v else "harness_error",
                     "feedback": (v.feedback[:500] if v else r.error),
                     "prompt": tokenizer.decode(t.ids[:t.prompt_len]),
                     "completion": tokenizer.decode(t.ids[t.prompt_len:])})
    out = batch_lib.Batch.from_histories(
        [r.tokens.ids for r in rollouts], [r.tokens.mask for r in rollouts],
        [r.tokens.logp for r in rollouts], [reward(r) for r in rollouts],
        [r.group_id for r in rollouts], prompt_lens=[r.tokens.prompt_len for r in rollouts],
        prompt_len=prompt_len, length=length, meta=meta, pad_id=pad_id, max_len=max_len)
    routing.pack(out, [(r.routing, len(r.tokens.ids), r.tokens.prompt_len) for r in rollouts])
    if rollouts and all(r.versions is not None for r in rollouts):  # rl.interrupt
        out.versions_bn = np.full(out.tokens_bn.shape, interrupt.UNSAMPLED, np.int32)
        for i, r in enumerate(rollouts):
            v = r.versions[r.tokens.prompt_len:][:length]
            out.versions_bn[i, :len(v)] = v
    return out


class TerminalProducer:
    """The learner's producer on terminal task records ({"task_dir": PATH}): `generate` on
    the device and in the containers, `score` by the verifiers (see the module docstring)."""

    def __init__(self, sampler, tokenizer, *, harness, fmt: chat.ChatFormat, stop_ids,
                 config: TerminalRolloutConfig, prompt_len: int, pad_id: int = 0):
        self.sampler, self.tokenizer, self.harness = sampler, tokenizer, harness
        self.config, self.prompt_len, self.pad_id = config, prompt_len, pad_id
        self.agent = terminal_agent.ShellAgent(
            None, tokenizer, fmt, stop_ids=stop_ids, max_turns=config.max_turns,
            max_len=config.max_len, max_output_chars=config.max_output_chars,
            call_timeout_s=config.call_timeout_s, system=config.system)
        self.pool = concurrent.futures.ThreadPoolExecutor(config.threads)
        self.tasks = _Tasks()

    def generate(self, params, records, key, *, config: TerminalRolloutConfig | None = None):
        """records: the environment's tasks (with `task_dir` and `domain`), or their
        records ({"task_dir": PATH, "domain": NAME})."""
        records = [r if isinstance(r, dict) else r.to_record() for r in records]
        for r in records:
            if "task_dir" not in r:
                raise ValueError(f"a terminal record names its task directory as "
                                 f"'task_dir'; got keys {sorted(r)}")
        tasks = [self.tasks.get(r["task_dir"]) for r in records]
        return generate(self.sampler, params, tasks, harness=self.harness, agent=self.agent,
                        key=key, config=config or self.config, pool=self.pool,
                        domains=[r.get("domain", "terminal") for r in records])

    def score(self, rollouts):
        verify_rollouts(rollouts, self.pool)
        return to_batch(rollouts, tokenizer=self.tokenizer, prompt_len=self.prompt_len,
                        length=self.config.max_len, pad_id=self.pad_id,
                        max_len=self.config.max_len)

    def evaluate(self, params, task_dirs, key, *,
                 config: TerminalRolloutConfig | None = None) -> list[Rollout]:
        """`config.num_samples` scored episodes per task (task-major); by default greedy,
        one per task: the held-out pass rate is mean(passed(r))."""
        config = config or dataclasses.replace(self.config, num_samples=1, greedy=True)
        rollouts = self.generate(params, [{"task_dir": d} for d in task_dirs], key,
                                 config=config)
        verify_rollouts(rollouts, self.pool)
        return rollouts

    def close(self):
        self.pool.shutdown()
