"""The rollout engine (ptrain/generate/engine.py) behind the producers (`sampling.engine=True`).

`EngineSampler.sample` has `sampler.Sampler.sample`'s interface (prompts in, `Samples` out):
the single-turn producer runs either. `EngineSampler.run` takes the engine's own requests,
each with an `on_turn` callback, and `run_episodes` is the multi-turn producer's path
(rollout.generate with an EngineSampler): each episode keeps its slot and cache across
turns (an observation is a prefill of its own tokens only), the G samples of a task share
its prompt's prefill, and each episode goes on as soon as its tools return, whatever the
others do.

With `decode_dtype` ("bfloat16", sampling.decode_dtype) the engines decode one copy of the
policy, cast and resharded for decoding (`ptrain.generate.decode_weights`), shared by all of them and
refreshed whenever a call brings other parameters than the copy's (after each update: the
weight sync). `take_counters` / `step_metrics` give the learner each step's engine metrics.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ptrain import chat
from ptrain import model as model_lib
from ptrain import routing
from ptrain import sharding
from ptrain.rollout import turns
from ptrain.generate import decode_weights
from ptrain.generate import interrupt
from ptrain.generate import sampler as sampler_lib
from ptrain.generate.buckets import buckets
from ptrain.generate.engine import Engine, Request, Trajectory


class EngineSampler:
    """One engine per decoding settings and shape (each compiles once, on first use; see
    `engine()`). Request i of a `sample` call draws from fold_in(key, i): greedy outputs
    equal the static sampler's, sampled ones come from other (per-request) randomness, from
    the same distribution (temperature, then top-k, then top-p). An MoE model's routing is
    recorded as the engine ran each token (`Samples.experts`, `prompt_experts`;
    `Trajectory.experts`).

    decode_dtype: None (or ""), the engines decode the parameters each call brings, as they
    are; "bfloat16" (or "float32"), a decode copy (see the module docstring) on `mesh`
    (default: the parameters' own).

    Many processes: each process decodes its own whole copy of the policy on its own devices
    (`decode_weights.local_mesh`; in the parameters' dtype unless decode_dtype says another),
    gathered from the learner's sharded parameters at each weight sync (a collective: every
    process samples after each update), so its engine runs its own prompts and episodes
    without waiting on the others. Request i of a process draws from fold_in(key, first + i),
    first the number of requests of the row blocks before its own (`sharding.row_block`):
    the keys one process holding every prompt would use."""

    def __init__(self, model: model_lib.Transformer, *, slots: int = 32, seed: int = 0,
                 pad_id: int = 0, decode: Callable | None = None, stop_check_every: int = 16,
                 decode_dtype: str | None = None, mesh=None):
        self.model, self.slots, self.pad_id = model, int(slots), int(pad_id)
        self.decode, self.stop_check_every = decode, int(stop_check_every)
        self.key = jax.random.key(seed)
        self.engines = {}
        self.decode_dtype = decode_dtype or None
        if jax.process_count() > 1:  # each process its own copy on its own devices
            self.decode_dtype = self.decode_dtype or model.config.param_dtype
            if mesh is None or decode_weights.spans_processes(mesh):
                mesh = decode_weights.local_mesh()
        self.weights = (decode_weights.DecodeWeights(self.decode_dtype, mesh)
                        if self.decode_dtype else None)
        self._taken = collections.Counter()  # totals at the last take_counters

    def engine(self, *, max_len: int, max_new_tokens: int, num_samples: int = 1,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               greedy: bool = False, stop_token_ids=(), stop_strings=(),
               token_buckets: Sequence[int] | None = None) -> Engine:
        """The engine for these settings (made on first use, then kept)."""
        settings = (int(max_len), int(max_new_tokens), max(self.slots, int(num_samples)),
                    float(temperature), bool(greedy), tuple(stop_token_ids),
                    tuple(stop_strings), tuple(token_buckets or buckets(max_len, 16)),
                    int(top_k), float(top_p))
        if settings not in self.engines:
            self.engines[settings] = Engine(
                self.model, slots=settings[2], max_len=max_len, max_new_tokens=max_new_tokens,
                temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
                stop_token_ids=stop_token_ids,
                stop_strings=stop_strings, decode=self.decode,
                stop_check_every=self.stop_check_every, pad_id=self.pad_id,
                token_buckets=settings[7], record_routing=self.model.config.n_experts > 0,
                decode_dtype=self.decode_dtype)
        return self.engines[settings]

    def sync_weights(self, params) -> float:
        """Refreshes the decode copy from `params` now (a call with other parameters than
        the copy's does it anyway); returns its seconds. Without decode_dtype: 0."""
        return 0.0 if self.weights is None else self.weights.sync(params)

    def _generate(self, engine: Engine, params, requests, live=None) -> list[Trajectory]:
        if self.weights is None:
            return engine.generate(params, requests, live=live)
        engine.params = self.weights.get(params)  # synced if params are new
        if not requests:  # (the sync above is a collective with many processes)
            engine.params = None
            return []
        try:  # (an interruption syncs the engine's own copy: Engine.sync_weights)
            return engine.generate(None, requests, live=live)
        finally:
            engine.params = None  # the copy is held once (a sync drops it before the next)

    def take_counters(self) -> tuple[dict, dict]:
        """(counts, peaks) since the last call, summed over the engines: tokens, decode
        seconds and steps, row steps, prefill tokens, tool waits, queue sums (`Engine.
        counters`), and the weight syncs with their seconds; peaks: the largest queue
        lengths. Safe while a generation runs in another thread (rl.staleness)."""
        totals, peaks = collections.Counter(), collections.Counter()
        for engine in list(self.engines.values()):
            t, p = engine.counters()
            totals.update(t)
            for name, value in p.items():
                peaks[name] = max(peaks[name], value)
        if self.weights is not None:
            totals.update(weight_syncs=self.weights.syncs, weight_sync_s=self.weights.sync_s)
        counts = {k: v - self._taken[k] for k, v in totals.items()}
        self._taken = totals
        return counts, dict(peaks)

    def run(self, params, requests: Sequence[Request], *, max_len: int, max_new_tokens: int,
            temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
            greedy: bool = False, stop_token_ids=(), stop_strings=()) -> list[Trajectory]:
        """The engine's `generate` on these requests (multi-turn through their on_turn):
        max_len is the most tokens a sequence may hold (its prompt included), the cache's
        length; prompts and observations are prefilled in buckets of powers of two."""
        params, live = interrupt.unwrap(params)
        _check(live)
        engine = self.engine(max_len=max_len, max_new_tokens=max_new_tokens,
                             num_samples=max([r.num_samples for r in requests], default=1),
                             temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
                             stop_token_ids=stop_token_ids, stop_strings=stop_strings)
        return self._generate(engine, params, requests, live=live)

    def sample(self, params, prompts, *, max_new_tokens: int, num_samples: int = 1,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
               greedy: bool = False, stop_token_ids=(), stop_strings=(), key=None,
               prompt_len: int | None = None, batch_size: int | None = None,
               record_routing: bool | None = None, shared: bool = False):
        del batch_size  # the engine's rows are its slots
        params, live = interrupt.unwrap(params)  # rl.interrupt: versions per token
        _check(live)
        if record_routing and not self.model.config.n_experts:
            raise ValueError("EngineSampler: record_routing needs a model with experts "
                             "(n_experts > 0)")
        if key is None:
            self.key, key = jax.random.split(self.key)
        first = first_request(len(prompts), params, shared)
        longest = max([len(p) for p in prompts], default=1)
        prompt_len = prompt_len or max(8, 1 << (longest - 1).bit_length())
        if longest > prompt_len:
            raise ValueError(f"sampling.engine: a prompt has {longest} tokens, more than "
                             f"prompt_len={prompt_len}")
        engine = self.engine(max_len=prompt_len + max_new_tokens, max_new_tokens=max_new_tokens,
                             num_samples=num_samples, temperature=temperature, top_k=top_k,
                             top_p=top_p, greedy=greedy, stop_token_ids=stop_token_ids,
                             stop_strings=stop_strings, token_buckets=(prompt_len,))
        trajs = self._generate(engine, params, [
            Request(p, key=jax.random.fold_in(key, first + i), num_samples=num_samples)
            for i, p in enumerate(prompts)], live=live)
        n = len(trajs)
        tokens = np.full((n, max_new_tokens), self.pad_id, np.int32)
        logp, logp_temp, logp_t1 = (np.zeros((n, max_new_tokens), np.float32) for _ in range(3))
        for r, t in enumerate(trajs):
            k, p = len(t.turns[0]), t.prompt_len
            tokens[r, :k] = t.turns[0]
            logp[r, :k], logp_temp[r, :k] = t.logp[p:], t.logp_temp[p:]
            logp_t1[r, :k] = t.logp_t1[p:]
        versions = None
        if live is not None:
            versions = np.full((n, max_new_tokens), interrupt.UNSAMPLED, np.int32)
            for r, t in enumerate(trajs):
                versions[r, :len(t.turns[0])] = interrupt.token_versions(
                    t, t.prompt_len, t.prompt_len + len(t.turns[0]))
        experts = prompt_experts = None
        if trajs and trajs[0].experts is not None and record_routing is not False:
            experts, prompt_experts = _routing(trajs, len(prompts), prompt_len, max_new_tokens)
        return sampler_lib.Samples(
            experts=experts, prompt_experts=prompt_experts, versions=versions,
            tokens=tokens, logp=logp, logp_temp=logp_temp, logp_t1=logp_t1,
            lengths=np.array([len(t.turns[0]) for t in trajs], np.int32),
            finish_reasons=["length" if t.finish_reasons[0] == "max_len" else
                            t.finish_reasons[0] for t in trajs],
            prompt_index=np.array([t.request for t in trajs], np.int32))


QUEUES = ("waiting", "live", "on_tools")  # Engine.queues()
COUNTS = ("tokens", "decode_s", "decode_steps", "busy_row_steps", "bucket_row_steps",
          "slot_steps", "rounds", "prefill_tokens", "tool_wait_s", "weight_syncs",
          "weight_sync_s", "interruptions", "interrupted_rows", "recompute_tokens",
          *(f"queue_{q}_sum" for q in QUEUES))


def find(producer) -> list[EngineSampler]:
    """The EngineSamplers a producer samples through, each once: its `sampler` and those of
    the producers it holds (`producers`, MixedProducer's), which may share one."""
    found, todo = {}, [producer]
    while todo:
        p = todo.pop()
        sampler = getattr(p, "sampler", None)
        if isinstance(sampler, EngineSampler):
            found[id(sampler)] = sampler
        todo += list(getattr(p, "producers", {}).values())
    return list(found.values())


def step_metrics(samplers: Sequence[EngineSampler]) -> dict:
    """What the engines did since the last call (the learner calls it once a step): tokens
    decoded and their rate over the decode time (`engine/tokens_per_s`), slot occupancy (busy
    rows over slots x decode steps; `bucket_occupancy` over the rows the decode calls ran),
    prefill tokens, queue lengths per scheduling round (mean, max), the seconds the device had
    nothing to do but wait on tools (`time/tool_wait_s`) and the weight syncs
    (`time/weight_sync_s`: 0 without a decode copy); with rl.interrupt the swaps
    (`engine/interruptions`, `interrupted_rows`, `recompute_tokens`). Counts are summed over
    processes (and queue maxima maxed: `sharding.agree`), so every process logs the same
    numbers. With rl.staleness > 0 a step's window holds parts of the generations that
    overlap it."""
    if not samplers:
        return {}
    counts, peaks = collections.Counter(), collections.Counter()
    for sampler in samplers:
        c, p = sampler.take_counters()
        counts.update(c)
        for q in QUEUES:
            peaks[q] = max(peaks[q], p.get(q, 0))
    total = dict(zip(COUNTS, sharding.agree(
        np.array([counts.get(k, 0) for k in COUNTS], np.float64), "sum").tolist()))
    top = dict(zip(QUEUES, sharding.agree(
        np.array([peaks[q] for q in QUEUES], np.float64), "max").tolist()))
    out = {"engine/tokens": total["tokens"], "engine/prefill_tokens": total["prefill_tokens"],
           "engine/decode_s": total["decode_s"], "engine/weight_syncs": total["weight_syncs"],
           "time/weight_sync_s": total["weight_sync_s"], "time/tool_wait_s": total["tool_wait_s"]}
    if total["decode_s"]:
        out["engine/tokens_per_s"] = total["tokens"] / total["decode_s"]
    if total["interruptions"]:  # rl.interrupt: swaps, the rows they caught, their prefill
        for name in ("interruptions", "interrupted_rows", "recompute_tokens"):
            out[f"engine/{name}"] = total[name]
    if total["slot_steps"]:
        out["engine/slot_occupancy"] = total["busy_row_steps"] / total["slot_steps"]
        out["engine/bucket_occupancy"] = total["busy_row_steps"] / total["bucket_row_steps"]
    for q in QUEUES:
        if total["rounds"]:
            out[f"engine/queue_{q}_mean"] = total[f"queue_{q}_sum"] / total["rounds"]
        out[f"engine/queue_{q}_max"] = top[q]
    return out


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
                 *, verify, verify_now: bool) -> None:
    """rollout.generate's episodes (task i's G at i*G ..., prompts[i] its prompt; c its
    RolloutConfig) on the engine (sampling.engine=True): a task's G episodes share
    its prompt's prefill, and each keeps its slot and cache across turns and attempts: the
    observation (or retry feedback) after a turn is prefilled alone, never the history, and
    an episode's next turn starts as soon as its own tools (or verdict) come back, whatever
    the others do. Turns, calls, caps and retries are rollout.episodes._run_attempt's (ptrain/rollout/turns.py):
    greedily the episodes equal the per-turn path's token for token. Verdicts (with
    verify_now: `verify([episode])`) come per episode as its attempt ends, not per batch."""
    stop_ids, stop_strings = turns.turn_stops(fmt, tokenizer, c.stop_token_ids,
                                              tools=any(e.task.tools for e in episodes))
    text = turns.TurnText.of(tokenizer, fmt, c)
    lock = threading.Lock()  # on_turn runs in the engine's threads: one at a time encodes
    taken = [0] * len(episodes)  # model turns in the episode's current attempt

    def on_turn(traj):
        i = traj.request * c.num_samples + traj.sample
        e, new, hit_length = episodes[i], traj.turns[-1], traj.finish_reasons[-1] != "stop"
        logp = traj.logp_temp[len(traj.tokens) - len(new):]
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
        verify([e])
        if (e.verdicts[-1].passed or e.attempts >= c.max_attempts
                or e.finish not in ("answered", "truncated")):
            return None
        before = len(e.tokens)
        with lock:
            turns.append(e, tokenizer,
                         chat.feedback(fmt, e.verdicts[-1].feedback, closed=e.closed), c)
        taken[i] = 0
        return None if e.finish == "max_len" else e.tokens[before:]

    first = first_request(len(prompts), params)
    requests = [Request(prompt, key=jax.random.fold_in(key, first + i),
                        num_samples=c.num_samples, on_turn=on_turn,
                        max_len=len(prompt) + c.max_len)
                for i, prompt in enumerate(prompts)]
    longest = max(map(len, prompts), default=1)
    trajs = sampler.run(params, requests,
                        max_len=max(16, 1 << (longest - 1).bit_length()) + c.max_len,
                        max_new_tokens=c.max_new_tokens, temperature=c.temperature,
                        top_k=c.top_k, top_p=c.top_p, greedy=c.greedy,
                        stop_token_ids=stop_ids, stop_strings=stop_strings)
    for traj in trajs:  # MoE: each token's experts as the engine ran it (`routing.pack`)
        e = episodes[traj.request * c.num_samples + traj.sample]
        if traj.experts is not None:
            e.routing = [traj.experts]
        if isinstance(params, interrupt.Live):  # each model token's policy version
            e.versions = np.where(np.asarray(e.mask, bool), interrupt.token_versions(
                traj, 0, len(e.tokens)), interrupt.UNSAMPLED).tolist()


def first_request(n: int, params, shared: bool = False) -> int:
    """The global index of this process's first of `n` requests: the requests of the row
    blocks before its own (0 with one process, or when every process passes the same
    requests, `shared`). A collective with many processes."""
    if shared or jax.process_count() == 1:
        return 0
    mesh = decode_weights.mesh_of(params)
    counts = sharding.gather_blocks(int(n), mesh)
    return sum(counts[:sharding.row_block(mesh)[0]])


def _check(live):
    if live is not None and jax.process_count() > 1:
        raise ValueError("rl.interrupt swaps the engine's weights mid-generation, which each "
                         "process would do at its own time: it runs on one process only; set "
                         "rl.interrupt=False for a multi-process run")
