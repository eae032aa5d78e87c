"""The rollout engine (ptrain/engine.py) behind the producers (`sampling.engine=True`).

`EngineSampler.sample` has `sampler.Sampler.sample`'s interface (prompts in, `Samples` out):
the single-turn producer runs either. `EngineSampler.run` takes the engine's own requests,
each with an `on_turn` callback, and `run_episodes` is the multi-turn producer's path
(rollout.generate with an EngineSampler): each episode keeps its slot and cache across
turns (an observation is a prefill of its own tokens only), the G samples of a task share
its prompt's prefill, and each episode goes on as soon as its tools return, whatever the
others do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ptrain import chat
from ptrain import interrupt
from ptrain import model as model_lib
from ptrain import rewards as rewards_lib
from ptrain import routing
from ptrain import sampler as sampler_lib
from ptrain import turns
from ptrain.engine import Engine, Request, Trajectory, buckets


class EngineSampler:
    """One engine per decoding settings and shape (each compiles once, on first use; see
    `engine()`). Request i of a `sample` call draws from fold_in(key, i): greedy outputs
    equal the static sampler's, sampled ones come from other (per-request) randomness.
    top-k / top-p are not supported yet (the engine records the log-prob at the sampling
    temperature only without them). An MoE model's routing is recorded as the engine ran
    each token (`Samples.experts`, `prompt_experts`; `Trajectory.experts`)."""

    def __init__(self, model: model_lib.Transformer, *, slots: int = 32, seed: int = 0,
                 pad_id: int = 0, decode: Callable | None = None, stop_check_every: int = 16):
        self.model, self.slots, self.pad_id = model, int(slots), int(pad_id)
        self.decode, self.stop_check_every = decode, int(stop_check_every)
        self.key = jax.random.key(seed)
        self.engines = {}

    def engine(self, *, max_len: int, max_new_tokens: int, num_samples: int = 1,
               temperature: float = 1.0, greedy: bool = False, stop_token_ids=(),
               stop_strings=(), token_buckets: Sequence[int] | None = None) -> Engine:
        """The engine for these settings (made on first use, then kept)."""
        settings = (int(max_len), int(max_new_tokens), max(self.slots, int(num_samples)),
                    float(temperature), bool(greedy), tuple(stop_token_ids),
                    tuple(stop_strings), tuple(token_buckets or buckets(max_len, 16)))
        if settings not in self.engines:
            self.engines[settings] = Engine(
                self.model, slots=settings[2], max_len=max_len, max_new_tokens=max_new_tokens,
                temperature=temperature, greedy=greedy, stop_token_ids=stop_token_ids,
                stop_strings=stop_strings, decode=self.decode,
                stop_check_every=self.stop_check_every, pad_id=self.pad_id,
                token_buckets=settings[7], record_routing=self.model.config.n_experts > 0)
        return self.engines[settings]

    def run(self, params, requests: Sequence[Request], *, max_len: int, max_new_tokens: int,
            temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
            greedy: bool = False, stop_token_ids=(), stop_strings=()) -> list[Trajectory]:
        """The engine's `generate` on these requests (multi-turn through their on_turn):
        max_len is the most tokens a sequence may hold (its prompt included), the cache's
        length; prompts and observations are prefilled in buckets of powers of two."""
        _check(top_k, top_p)
        params, live = interrupt.unwrap(params)
        engine = self.engine(max_len=max_len, max_new_tokens=max_new_tokens,
                             num_samples=max(r.num_samples for r in requests),
                             temperature=temperature, greedy=greedy,
                             stop_token_ids=stop_token_ids, stop_strings=stop_strings)
        return engine.generate(params, requests, live=live)

    def sample(self, params, prompts, *, max_new_tokens: int, num_samples: int = 1,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               greedy: bool = False, stop_token_ids=(), stop_strings=(), key=None,
               prompt_len: int | None = None, batch_size: int | None = None,
               record_routing: bool | None = None, shared: bool = False):
        del batch_size  # the engine's rows are its slots
        _check(top_k, top_p, shared=shared)
        params, live = interrupt.unwrap(params)  # rl.interrupt: versions per token
        if record_routing and not self.model.config.n_experts:
            raise ValueError("EngineSampler: record_routing needs a model with experts "
                             "(n_experts > 0)")
        if key is None:
            self.key, key = jax.random.split(self.key)
        longest = max(len(p) for p in prompts)
        prompt_len = prompt_len or max(8, 1 << (longest - 1).bit_length())
        if longest > prompt_len:
            raise ValueError(f"sampling.engine: a prompt has {longest} tokens, more than "
                             f"prompt_len={prompt_len}")
        engine = self.engine(max_len=prompt_len + max_new_tokens, max_new_tokens=max_new_tokens,
                             num_samples=num_samples, temperature=temperature, greedy=greedy,
                             stop_token_ids=stop_token_ids, stop_strings=stop_strings,
                             token_buckets=(prompt_len,))
        trajs = engine.generate(params, [
            Request(p, key=jax.random.fold_in(key, i), num_samples=num_samples)
            for i, p in enumerate(prompts)], live=live)
        n = len(trajs)
        tokens = np.full((n, max_new_tokens), self.pad_id, np.int32)
        logp, logp_t1 = (np.zeros((n, max_new_tokens), np.float32) for _ in range(2))
        for r, t in enumerate(trajs):
            k = len(t.turns[0])
            tokens[r, :k] = t.turns[0]
            logp[r, :k], logp_t1[r, :k] = t.logp[t.prompt_len:], t.logp_t1[t.prompt_len:]
        versions = None
        if live is not None:
            versions = np.full((n, max_new_tokens), interrupt.UNSAMPLED, np.int32)
            for r, t in enumerate(trajs):
                versions[r, :len(t.turns[0])] = interrupt.token_versions(
                    t, t.prompt_len, t.prompt_len + len(t.turns[0]))
        experts = prompt_experts = None
        if trajs and trajs[0].experts is not None and record_routing is not False:
            experts, prompt_experts = _routing(trajs, len(prompts), prompt_len, max_new_tokens)
        # Without top-k / top-p the sampled-from distribution is logits / temperature; greedy
        # rows have no temperature (as the static sampler's).
        return sampler_lib.Samples(
            experts=experts, prompt_experts=prompt_experts, versions=versions,
            tokens=tokens, logp=logp, logp_temp=logp_t1.copy() if greedy else logp.copy(),
            logp_t1=logp_t1, lengths=np.array([len(t.turns[0]) for t in trajs], np.int32),
            finish_reasons=["length" if t.finish_reasons[0] == "max_len" else
                            t.finish_reasons[0] for t in trajs],
            prompt_index=np.array([t.request for t in trajs], np.int32))


def _routing(trajs, n_prompts, prompt_len, max_new_tokens):
    """`Samples.experts` [rows, max_new_tokens, MoE layers, k] (0 after a row's length) and
    `prompt_experts` [prompts, prompt_len, ...] (left-padded, -1 on padding) of single-turn
    trajectories."""
    shape = trajs[0].experts.shape[1:]
    experts = np.zeros((len(trajs), max_new_tokens, *shape), np.int16)
    prompt_experts = np.full((n_prompts, prompt_len, *shape), routing.UNRECORDED, np.int16)
    for r, t in enumerate(trajs):
        turn = t.experts[t.prompt_len:]
        experts[r, :len(turn)] = turn
        if t.sample == 0:
            prompt_experts[t.request, prompt_len - t.prompt_len:] = t.experts[:t.prompt_len]
    return experts, prompt_experts


def run_episodes(sampler: EngineSampler, params, episodes, prompts, key, tokenizer, fmt, c,
                 *, pool, reward_config, verify_now: bool) -> None:
    """rollout.generate's episodes (task i's G at i*G ..., prompts[i] its prompt; c its
    RolloutConfig) on the engine (sampling.engine=True): a task's G episodes share
    its prompt's prefill, and each keeps its slot and cache across turns and attempts: the
    observation (or retry feedback) after a turn is prefilled alone, never the history, and
    an episode's next turn starts as soon as its own tools (or verdict) come back, whatever
    the others do. Turns, calls, caps and retries are rollout._run_attempt's (ptrain/turns.py):
    greedily the episodes equal the per-turn path's token for token. Verdicts (with
    verify_now) come per episode as its attempt ends, not per batch."""
    stop_ids, stop_strings = turns.turn_stops(fmt, tokenizer, c.stop_token_ids,
                                              tools=any(e.task.tools for e in episodes))
    text = turns.TurnText.of(tokenizer, fmt, c)
    lock = threading.Lock()  # on_turn runs in the engine's threads: one at a time encodes
    taken = [0] * len(episodes)  # model turns in the episode's current attempt

    def on_turn(traj):
        i = traj.request * c.num_samples + traj.sample
        e, new, hit_length = episodes[i], traj.turns[-1], traj.finish_reasons[-1] != "stop"
        logp = logp_temp(traj, c.greedy)[len(traj.tokens) - len(new):]
        with lock:  # cut: the turn stopped at the episode's room, not at max_new_tokens
            calls = turns.take_turn(e, new, logp, text, hit_length=hit_length,
                                    cut=hit_length and len(new) < c.max_new_tokens)
        taken[i] += 1
        if calls:
            outputs = [turns.call_tool(e, call, c) for call in calls]
            before = len(e.tokens)
            with lock:
                ok = turns.observe(e, outputs, tokenizer, fmt, c)
            if ok and taken[i] < c.max_turns:
                return e.tokens[before:]
            if ok:
                e.finish = "max_turns"
                e.answers.append("")
        if not verify_now:  # the attempt ended
            return None
        e.verdicts += rewards_lib.verify_all([e.task], [e.answers[-1]], pool=pool,
                                             sessions=[e.session], config=reward_config)
        if (e.verdicts[-1].passed or e.attempts >= c.max_attempts
                or e.finish not in ("answered", "truncated")):
            return None
        before = len(e.tokens)
        with lock:
            turns.append(e, tokenizer,
                         chat.feedback(fmt, e.verdicts[-1].feedback, closed=e.closed), c)
        taken[i] = 0
        return None if e.finish == "max_len" else e.tokens[before:]

    requests = [Request(prompt, key=jax.random.fold_in(key, i), num_samples=c.num_samples,
                        on_turn=on_turn, max_len=len(prompt) + c.max_len)
                for i, prompt in enumerate(prompts)]
    longest = max(map(len, prompts))
    trajs = sampler.run(params, requests,
                        max_len=max(16, 1 << (longest - 1).bit_length()) + c.max_len,
                        max_new_tokens=c.max_new_tokens, temperature=c.temperature,
                        top_k=c.top_k, top_p=c.top_p, greedy=c.greedy,
                        stop_token_ids=stop_ids, stop_strings=stop_strings)
    for traj in trajs:  # MoE: each token's experts as the engine ran it (`routing.pack`)
        if traj.experts is not None:
            episodes[traj.request * c.num_samples + traj.sample].routing = [traj.experts]


def logp_temp(traj: Trajectory, greedy: bool) -> list[float]:
    """The trajectory's log-probs under the distribution sampled from (`Samples.logp_temp`'s
    meaning): logits / temperature, or the plain model's for greedy decoding."""
    return traj.logp_t1 if greedy else traj.logp


def _check(top_k, top_p, *, shared=False):
    if shared or jax.process_count() > 1:
        raise ValueError("sampling.engine runs on one process only; set "
                         "sampling.engine=False for a multi-process run")
    if top_k or top_p < 1.0:
        raise ValueError("sampling.engine: top_k / top_p are not supported by the engine "
                         "yet; set sampling.engine=False or top_k=0, top_p=1.0")
