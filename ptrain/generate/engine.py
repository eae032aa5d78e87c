"""The rollout engine: continuous batching over decode slots, multi-turn without re-prefill.

engine = Engine(model, slots=16, max_len=1024, max_new_tokens=256, temperature=1.0,
                stop_token_ids=(eos,))
engine.warm_up()                      # compiles every program a run can use, once
trajs = engine.generate(params, [Request(prompt_ids, key, num_samples=8), ...])

A request is a prompt and a PRNG key; its `num_samples` sequences share one prefill (the
prompt runs once, its cache rows are copied into G slots). Each sequence holds a slot
(ptrain/generate/kv_slots.py) from its prefill until it ends; the slots decode together on the
device, and when one finishes the host takes its tokens and gives the slot to the next
waiting request at once, without waiting for the others. Decoding runs on a bucket of the
live rows only (powers of two up to `slots`), so a long tail decodes one row, not N.

Multi-turn: `on_turn(traj)` is called after each model turn (also one that filled the
sequence), in a thread (a tool call can take as long as it likes); it returns the
observation's token ids, or None to end the sequence. The observation is appended to the
sequence's own cache (a prefill of just those tokens, never of the history) and the
sequence decodes its next turn. While one sequence waits on its tool, the others decode;
the time the device had nothing to do but wait on tools is reported.

A server's generation never ends by itself: `generate(params, [], feed=feed)` admits the
requests put into the feed while it runs (ptrain/generate/feed.py) until the feed is closed.

Stop strings are checked on the host every `stop_check_every` tokens, on the text of the
tokens since the last check (and a few before), never the whole completion; a sequence that
went past one is truncated on the device.

Weights: `generate` takes the learner's parameters as they are; with `decode_dtype=
"bfloat16"` (and a mesh) the engine keeps its own copy, cast and resharded for decoding
(heads over `tensor`, no FSDP gathers per token), refreshed by `sync_weights(params)` after
each update; the sync's time is in `metrics()`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ptrain import lora
from ptrain import model as model_lib
from ptrain.generate import interrupt
from ptrain.generate import kv_slots
from ptrain.generate.buckets import bucket, buckets, prefill_chunks
from ptrain.generate.decode_weights import decode_copy, mesh_of
from ptrain.generate.feed import Feed

FINISH = {kv_slots.STOP: "stop", kv_slots.LENGTH: "length"}  # and "max_len": the cache is full


@dataclasses.dataclass
class Request:
    """A prompt to continue `num_samples` times. `key`: a typed PRNG key (or an int seed);
    sample g uses fold_in(key, g), so its tokens depend on nothing else."""

    prompt: Sequence[int]
    key: object = 0
    num_samples: int = 1
    max_new_tokens: int | None = None  # per turn; None: the engine's
    on_turn: Callable | None = None  # (Trajectory) -> observation ids | None (end)
    max_len: int | None = None  # the most tokens the sequence may hold; None: the engine's


@dataclasses.dataclass
class Trajectory:
    """One sequence: the prompt, each model turn (mask 1) and each observation (mask 0).
    Log-probs of each token (0 on prompt and observation tokens): `logp` under the
    distribution sampled from (top-k / top-p applied; 0 when greedy), `logp_temp` under
    logits / temperature (what a learner's forward computes: the behaviour policy), `logp_t1`
    the plain model's."""

    request: int
    sample: int
    prompt_len: int
    tokens: list = dataclasses.field(default_factory=list)
    mask: list = dataclasses.field(default_factory=list)
    logp: list = dataclasses.field(default_factory=list)
    logp_temp: list = dataclasses.field(default_factory=list)
    logp_t1: list = dataclasses.field(default_factory=list)
    turns: list = dataclasses.field(default_factory=list)  # each turn's token ids
    finish_reasons: list = dataclasses.field(default_factory=list)  # per turn
    tool_wait_s: float = 0.0
    # MoE (record_routing): the experts [tokens run, MoE layers, k] of each token the model
    # ran, as it ran them (a final observation that was not run has none)
    experts: np.ndarray | None = None
    # (position, version): tokens from that position on were sampled by that policy version
    # (one pair unless the generation was interrupted, ptrain/generate/interrupt.py)
    versions: list = dataclasses.field(default_factory=list)

    def add_unsampled(self, ids) -> None:
        """Appends tokens the model did not sample (the prompt, an observation): mask and
        log-probs 0."""
        ids = list(ids)
        self.tokens += ids
        for name in ("mask", "logp", "logp_temp", "logp_t1"):
            getattr(self, name).extend([0] * len(ids) if name == "mask" else [0.0] * len(ids))

    def completion(self, turn: int = -1) -> list[int]:
        return self.turns[turn]


class Engine:
    """Continuous-batching sampler for one model (see the module docstring).

    slots: decode slots (rows of the KV cache). max_len: cache positions per slot, the most
      tokens a sequence can hold (prompt, turns and observations). max_new_tokens: per turn.
    prefill_rows: the most prompts (or observations) prefilled in one call.
    token_buckets: the lengths prompts and observations are padded to (default: powers of
      two from 16 up to max_len).
    refill_rows: a decode call runs many steps on the device and comes back to the host
      (to give free slots to waiting requests, or to start tools) once this many rows have
      finished a turn (default slots // 8, at least 1); it also comes back when half its
      bucket of rows would hold the live ones, so the tail decodes in a smaller bucket.
    sync_every: while tools run, a decode call comes back after at most this many steps, so
      that the observations returned meanwhile join the next call instead of waiting out
      the turn (8: on the 3-turn workload of bench/rollout_bench.py 224-256 decode steps
      for 64 episodes on 32 slots, against 320-352 with 32; 192 is the least).
    tool_threads: threads running on_turn callbacks (default: one per slot, at least 16).
    """

    def __init__(self, model: model_lib.Transformer, *, slots: int, max_len: int,
                 max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, greedy: bool = False, stop_token_ids: Sequence[int] = (),
                 stop_strings: Sequence[str] = (), decode: Callable | None = None,
                 stop_check_every: int = 16, pad_id: int = 0, prefill_rows: int = 8,
                 token_buckets: Sequence[int] | None = None, decode_dtype: str | None = None,
                 mesh=None, tool_threads: int | None = None, sync_every: int = 8,
                 refill_rows: int | None = None, record_routing: bool = False):
        c = model.config
        checks = [
            (slots >= 1 and max_new_tokens >= 1, "slots and max_new_tokens must be >= 1"),
            (max_len > max_new_tokens, f"max_len ({max_len}) must exceed max_new_tokens "
                                       f"({max_new_tokens}): it holds the prompt as well"),
            (greedy or temperature > 0, f"temperature must be > 0 (or greedy), got {temperature}"),
            (not stop_strings or decode is not None,
             "stop_strings need decode= (a tokenizer's decode)"),
            (all(0 <= t < c.vocab_size for t in stop_token_ids),
             f"stop_token_ids must be in [0, {c.vocab_size})"),
            (decode_dtype in (None, "float32", "bfloat16"),
             f"decode_dtype must be None, float32 or bfloat16, got {decode_dtype!r}"),
            (not record_routing or c.n_experts > 0,
             "record_routing needs a model with experts (n_experts > 0)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"Engine: {message}")
        self.config, self.slots, self.max_len = c, int(slots), int(max_len)
        self.max_new_tokens, self.prefill_rows = int(max_new_tokens), int(prefill_rows)
        self.settings = kv_slots.Settings(float(temperature), int(top_k), float(top_p),
                                          bool(greedy), tuple(int(t) for t in stop_token_ids),
                                          int(pad_id))
        self.stop_strings, self.decode_text = tuple(stop_strings), decode
        self.stop_check_every, self.sync_every = int(stop_check_every), int(sync_every)
        self.refill_rows = int(refill_rows or max(1, self.slots // 8))
        self.token_buckets = tuple(token_buckets or buckets(self.max_len, 16))
        self.row_buckets = buckets(self.slots)
        self.prefill_buckets = buckets(min(self.prefill_rows, self.slots))
        self.decode_dtype, self.mesh = decode_dtype, mesh
        dc = c if decode_dtype is None else c.replace(dtype=decode_dtype, param_dtype=decode_dtype)
        if decode_dtype is not None and c.lora_rank:  # the decode copy has them merged in
            dc = lora.base_config(dc)
        self.lora_scale = lora.scale(c) if c.lora_rank else None
        # Activation constraints off: rows come in buckets that need not divide the mesh.
        self.graphdef = nnx.graphdef(nnx.eval_shape(
            lambda: model_lib.Transformer(dc, rngs=nnx.Rngs(0), mesh=None)))
        self.params = None  # the decode copy (decode_dtype set) after sync_weights
        self.state = kv_slots.init_state(c if decode_dtype is None else dc, self.slots,
                                         self.max_len, self.max_new_tokens,
                                         record_routing=record_routing)
        # Every slot may be on a tool at once: one thread each (threads mostly wait).
        self.threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=tool_threads or max(16, self.slots))
        self.tallies = collections.Counter()  # what the engine did; interrupt.swap adds its own
        self._queue_max = collections.Counter()
        self._queue_peak = collections.Counter()  # since the last counters()
        self._last_queues = {}

    # ------------------------------------------------------------------ weights

    def sync_weights(self, params) -> float:
        """Refreshes the decode copy from the learner's parameters; returns its seconds."""
        start = time.perf_counter()
        self.params = decode_copy(params, self.decode_dtype or "float32",
                                  self.mesh or mesh_of(params),  # default: the params' own
                                  self.lora_scale)
        seconds = time.perf_counter() - start
        self.tallies["weight_sync_s"] += seconds
        self.tallies["weight_syncs"] += 1
        return seconds

    def decode_params(self, params):
        """The parameters a generation decodes: the engine's own copy with decode_dtype, else
        `params` (a module's state)."""
        if self.decode_dtype is not None:
            if params is not None:
                raise ValueError("Engine: with decode_dtype the engine decodes its own copy; "
                                 "call sync_weights(params) after each update, not generate(params)")
            if self.params is None:
                raise ValueError("Engine: call sync_weights(params) before generate")
            return self.params
        if params is None:
            raise ValueError("Engine: generate needs the parameters")
        return nnx.state(params) if isinstance(params, nnx.Module) else params

    # ------------------------------------------------------------------ compilation

    def warm_up(self, params=None) -> int:
        """Runs every program at every shape a run can use, on rows that do not exist (so the
        state is unchanged); returns the number of compilations it caused."""
        params = self.decode_params(params)
        before = sum(kv_slots.TRACES.values())
        n = self.slots
        for r in self.prefill_buckets:
            for t in self.token_buckets:
                self._extend(params, np.full(r, n), np.zeros((r, t), np.int32), np.ones(r),
                             np.zeros(r, bool), np.zeros(r), np.zeros((r, 2), np.uint32))
        for b in self.row_buckets:
            self._fork(np.full(b, n), np.full(b, n), np.zeros((b, 2), np.uint32))
            self._decode(params, np.full(b, n), 1, 1, 0)
        self._truncate({})
        jax.block_until_ready(self.state)
        return sum(kv_slots.TRACES.values()) - before

    def _extend(self, params, rows, tokens, lengths, reset, limit, keys):
        self.state = kv_slots.extend(
            params, self.state, jnp.asarray(rows, jnp.int32), jnp.asarray(tokens, jnp.int32),
            jnp.asarray(lengths, jnp.int32), jnp.asarray(reset, bool),
            jnp.asarray(limit, jnp.int32), jnp.asarray(keys, jnp.uint32), graphdef=self.graphdef)

    def _fork(self, src, dst, keys):
        self.state = kv_slots.fork(self.state, jnp.asarray(src, jnp.int32),
                                   jnp.asarray(dst, jnp.int32), jnp.asarray(keys, jnp.uint32))

    def _decode(self, params, rows, max_steps, refill_at, min_live):
        self.state, steps, busy = kv_slots.decode(
            params, self.state, jnp.asarray(rows, jnp.int32), jnp.int32(max_steps),
            jnp.int32(refill_at), jnp.int32(min_live), graphdef=self.graphdef,
            settings=self.settings)
        return steps, busy

    def _truncate(self, cuts):
        """cuts: row -> (length, gen, count)."""
        n = self.slots
        arr = np.full((4, n), 0, np.int32)
        arr[0] = n
        for i, (row, values) in enumerate(cuts.items()):
            arr[:, i] = (row,) + tuple(values)
        self.state = kv_slots.truncate(self.state, *(jnp.asarray(a) for a in arr))

    # ------------------------------------------------------------------ generation

    def generate(self, params, requests: Sequence[Request], *,
                 live: interrupt.Live | None = None,
                 feed: Feed | None = None) -> list[Trajectory]:
        """Runs every request to the end; trajectories come back request-major (request i's
        samples at i*G ... in order). live: the version of `params` and a switch that may
        bring newer ones mid-generation (ptrain/generate/interrupt.py). feed: requests that
        join while it runs (ptrain/generate/feed.py; their trajectories reach their on_turn
        only); it returns once the feed is closed and every sequence has ended."""
        params = self.decode_params(params)
        run = _Run(self, params, requests, live, feed)
        return run.loop()

    def metrics(self) -> dict:
        """Totals since the engine was made, and rates from them."""
        m = dict(self.tallies)
        if m.get("decode_s"):
            m["tokens_per_s"] = m["tokens"] / m["decode_s"]
        if m.get("decode_steps"):
            m["slot_occupancy"] = m["busy_row_steps"] / (m["decode_steps"] * self.slots)
            m["bucket_occupancy"] = m["busy_row_steps"] / m["bucket_row_steps"]
        for name in self._last_queues:
            if m.get("rounds"):
                m[f"queue_{name}_mean"] = m.pop(f"queue_{name}_sum", 0) / m["rounds"]
            m[f"queue_{name}_max"] = self._queue_max[name]
        return m

    def reset_metrics(self) -> None:
        self.tallies.clear()
        self._queue_max.clear()

    def counters(self) -> tuple[dict, dict]:
        """(totals, peaks): the raw counts `metrics()` derives its rates from (since the
        engine was made or reset), `slot_steps` (decode steps x slots) among them, and the
        largest queue lengths since the last call (which resets them). Safe to call while
        another thread generates (the copy is one C-level dict copy)."""
        totals = dict(self.tallies)
        totals["slot_steps"] = totals.get("decode_steps", 0) * self.slots
        peaks, self._queue_peak = self._queue_peak, collections.Counter()
        return totals, dict(peaks)

    def queues(self) -> dict:
        """Queue lengths at the last scheduling round: sequences waiting for a slot, live
        (decoding) and on tools."""
        return dict(self._last_queues)


def _key_data(key) -> np.ndarray:
    if isinstance(key, (int, np.integer)):
        key = jax.random.key(int(key))
    return np.asarray(jax.random.key_data(key), np.uint32)


class _Run:
    """One `generate` call: the host-side scheduler."""

    def __init__(self, engine: Engine, params, requests, live=None, feed=None):
        self.e, self.params = engine, params
        self.version = live.version if live is not None else 0
        self.live_params = live  # (a swap advances it: the producer's next call starts there)
        self.switch, self.decodes = live and live.switch, 0  # decode rounds so far
        self.trajs, self.waiting = [], collections.deque()
        self.feed, self.requests = feed, 0  # feed: requests arriving while it runs
        for req in requests:
            self._add(req)
        self.free = list(range(engine.slots))[::-1]
        self.row_of = {}  # id(traj) -> row
        self.live = {}  # row -> (traj, request, turn start: (gen, count 0), checked)
        self.tools = {}  # future -> (row, traj, request, submitted at)
        self.ready = []  # (row, traj, request, observation ids)

    def _add(self, req, keep: bool = True):
        """keep: the trajectories are returned (a fed request's are not: its on_turn has them,
        and a server's generation would hold every one it ever ran)."""
        engine, i = self.e, self.requests
        self.requests += 1
        prompt = [int(t) for t in req.prompt]
        if not prompt:
            raise ValueError(f"Engine: request {i} has an empty prompt")
        if min(prompt) < 0 or max(prompt) >= engine.config.vocab_size:
            raise ValueError(f"Engine: request {i} has token ids outside [0, vocab_size)")
        cap = req.max_len or engine.max_len
        if cap > engine.max_len:
            raise ValueError(f"Engine: request {i}'s max_len={cap} exceeds the engine's "
                             f"max_len={engine.max_len}")
        if len(prompt) >= cap or len(prompt) > engine.token_buckets[-1]:
            raise ValueError(f"Engine: request {i}'s prompt ({len(prompt)} tokens) leaves no "
                             f"room in max_len={cap}")
        if not 1 <= req.num_samples <= engine.slots:
            raise ValueError(f"Engine: num_samples must be in [1, slots={engine.slots}]")
        key = _key_data(req.key)
        group = []
        for g in range(req.num_samples):
            t = Trajectory(request=i, sample=g, prompt_len=len(prompt),
                           versions=[(len(prompt), self.version)])
            t.add_unsampled(prompt)
            group.append((t, np.asarray(jax.random.key_data(jax.random.fold_in(
                jax.random.wrap_key_data(key), g)), np.uint32)))
            if keep:
                self.trajs.append(t)
        self.waiting.append((req, group))

    def loop(self):
        e = self.e
        while self.waiting or self.live or self.tools or self.ready or (
                self.feed is not None and not self.feed.done):
            for req in self.feed.take() if self.feed is not None else ():
                self._add(req, keep=False)
            new = self.switch and self.switch.poll(self.version, self.decodes)
            if new:  # a round boundary: the sequences go on with the new weights
                interrupt.swap(self, *new)
            self._admit()
            self._collect_tools(block=not self.live and not self.ready)
            self._append_observations()
            e._last_queues = dict(waiting=sum(len(g) for _, g in self.waiting),
                                  live=len(self.live), on_tools=len(self.tools))
            e.tallies["rounds"] += 1
            for name, value in e._last_queues.items():
                e.tallies[f"queue_{name}_sum"] += value
                e._queue_max[name] = max(e._queue_max[name], value)
                e._queue_peak[name] = max(e._queue_peak[name], value)
            if self.live:
                self._decode_round()
        e._last_queues = dict(waiting=0, live=0, on_tools=0)
        return self.trajs

    # -- admission: a waiting request's prefill goes into free slots as soon as there are G
    def _admit(self):
        e = self.e
        batch = []  # (req, group, rows)
        while self.waiting and len(self.waiting[0][1]) <= len(self.free):
            req, group = self.waiting.popleft()
            rows = [self.free.pop() for _ in group]
            batch.append((req, group, rows))
        forks = []
        for t, r, chunk in prefill_chunks(batch, lambda item: len(item[0].prompt),
                                           e.token_buckets, e.prefill_buckets):
            rows, tokens = np.full(r, e.slots), np.zeros((r, t), np.int32)
            lengths, limits = np.ones(r), np.zeros(r)
            keys = np.zeros((r, 2), np.uint32)
            for i, (req, group, slot_rows) in enumerate(chunk):
                rows[i], lengths[i] = slot_rows[0], len(req.prompt)
                tokens[i, :len(req.prompt)] = req.prompt
                limits[i] = self._limit(req, len(req.prompt))
                keys[i] = group[0][1]
                for (traj, key), row in zip(group[1:], slot_rows[1:]):
                    forks.append((slot_rows[0], row, key))
            e._extend(self.params, rows, tokens, lengths, np.ones(r, bool), limits, keys)
            e.tallies["prefill_tokens"] += int(sum(len(c[0].prompt) for c in chunk))
            e.tallies["prefill_calls"] += 1
        for start in range(0, len(forks), e.slots):
            chunk = forks[start:start + e.slots]
            c = bucket(len(chunk), e.row_buckets)
            src, dst = np.full(c, e.slots), np.full(c, e.slots)
            keys = np.zeros((c, 2), np.uint32)
            for i, (s, d, k) in enumerate(chunk):
                src[i], dst[i], keys[i] = s, d, k
            e._fork(src, dst, keys)
        for req, group, rows in batch:
            for (traj, _), row in zip(group, rows):
                self.row_of[id(traj)] = row
                self.live[row] = [traj, req, 0]  # checked: tokens of this turn stop-checked

    def _limit(self, req, length):
        turn = req.max_new_tokens or self.e.max_new_tokens
        return max(0, min(turn, self.e.max_new_tokens, self._max_len(req) - length))

    def _max_len(self, req):
        return req.max_len or self.e.max_len

    # -- decoding: the live rows, in the smallest bucket that holds them
    def _decode_round(self):
        e = self.e
        rows = sorted(self.live)
        b = bucket(len(rows), e.row_buckets)
        rows_b = np.full(b, e.slots)
        rows_b[:len(rows)] = rows
        if e.stop_strings:
            max_steps = e.stop_check_every
        elif self.tools:
            max_steps = e.sync_every  # come back soon for the observations
        else:
            max_steps = e.max_new_tokens
        if self.switch is not None:  # back soon enough for a new policy version
            max_steps = min(max_steps, self.switch.every)
        self.decodes += 1
        start = time.perf_counter()
        # Back to the host when enough slots are free for waiting requests (or a turn
        # ended and its tool can start), or when half the bucket would hold the live rows.
        turns = any(self.live[row][1].on_turn is not None for row in rows)
        if self.waiting:
            refill_at = max(len(self.waiting[0][1]) - len(self.free), e.refill_rows)
        else:
            refill_at = e.refill_rows if turns else b + 1
        min_live = b // 2 + 1 if b > 1 else 0
        steps, busy = e._decode(self.params, rows_b, max_steps, refill_at, min_live)
        s = e.state
        (live, count, reason, index, gen, tokens, logp, logp_temp, logp_t1, steps,
         busy) = jax.device_get((s["live_n"], s["count_n"], s["reason_n"], s["index_n"],
                                 s["gen_n"], s["tokens_nm"], s["logp_nm"], s["logp_temp_nm"],
                                 s["logp_t1_nm"], steps, busy))
        e.tallies["decode_s"] += time.perf_counter() - start
        e.tallies["decode_calls"] += 1
        e.tallies["decode_steps"] += int(steps)
        e.tallies["busy_row_steps"] += int(busy)
        e.tallies["bucket_row_steps"] += int(steps) * b
        e.tallies["tokens"] += int(busy)
        cuts, ended = {}, []
        for row in rows:
            traj, req, checked = self.live[row]
            n = int(count[row])
            if e.stop_strings and n > checked:
                end = _stop_string_end(e.decode_text, tokens[row, :n].tolist(), checked,
                                       e.stop_strings)
                self.live[row][2] = n
                if end is not None:
                    if live[row] or end < n:
                        cuts[row] = (int(index[row]) - (n - end), int(gen[row]) - (n - end), end)
                    ended.append((row, end, "stop"))
                    continue
            if not live[row]:
                ended.append((row, n, FINISH[int(reason[row])]))
        if cuts:
            e._truncate(cuts)
        for row, n, why in ended:
            traj, req, _ = self.live.pop(row)
            traj.tokens += tokens[row, :n].tolist()
            traj.mask += [1] * n
            traj.logp += logp[row, :n].tolist()
            traj.logp_temp += logp_temp[row, :n].tolist()
            traj.logp_t1 += logp_t1[row, :n].tolist()
            traj.turns.append(tokens[row, :n].tolist())
            if why == "length" and len(traj.tokens) >= self._max_len(req):
                why = "max_len"
            traj.finish_reasons.append(why)
            if req.on_turn is None:
                self._release(traj)
            else:
                future = e.threads.submit(req.on_turn, traj)
                self.tools[future] = (row, traj, req, time.perf_counter())

    def _release(self, traj):
        row = self.row_of.pop(id(traj))
        s = self.e.state
        if "experts_nslk" in s:  # the slot's routing, before another sequence takes it
            experts, index = jax.device_get((s["experts_nslk"][row], s["index_n"][row]))
            traj.experts = np.asarray(experts[:int(index)])
        self.free.append(row)

    # -- tools: observations come back in any order; each is appended to its own slot
    def _collect_tools(self, block: bool):
        # with a feed, nothing to decode: wait for a tool or a new request, whichever is first
        wake = (self.feed.wakeup() if block and not self.waiting and self.feed is not None
                and not self.feed.closed else None)
        if not self.tools and wake is None:
            return
        start = time.perf_counter()
        if block:
            concurrent.futures.wait([*self.tools, *([wake] if wake else [])],
                                    return_when=concurrent.futures.FIRST_COMPLETED)
            self.e.tallies["tool_wait_s"] += time.perf_counter() - start
        done = [f for f in self.tools if f.done()]
        for future in done:
            row, traj, req, submitted = self.tools.pop(future)
            traj.tool_wait_s += time.perf_counter() - submitted
            ids = future.result()
            if ids is None:
                self._release(traj)
                continue
            ids = [int(t) for t in ids]
            if not ids:
                raise ValueError("Engine: on_turn returned no tokens; return None to end")
            room = self._max_len(req) - len(traj.tokens)
            if len(ids) + 1 > room or len(ids) > self.e.token_buckets[-1]:
                # no room for the model to answer after it: recorded (as far as it fits),
                # not run
                ids = ids[:max(0, room)]
                traj.add_unsampled(ids)
                if traj.finish_reasons[-1] != "max_len":
                    traj.finish_reasons.append("max_len")
                self._release(traj)
                continue
            self.ready.append((row, traj, req, ids))

    def _append_observations(self):
        e = self.e
        ready, self.ready = self.ready, []
        for t, r, chunk in prefill_chunks(ready, lambda item: len(item[3]),
                                           e.token_buckets, e.prefill_buckets):
            rows, tokens = np.full(r, e.slots), np.zeros((r, t), np.int32)
            lengths, limits = np.ones(r), np.zeros(r)
            for i, (row, traj, req, ids) in enumerate(chunk):
                rows[i], lengths[i] = row, len(ids)
                tokens[i, :len(ids)] = ids
                traj.add_unsampled(ids)
                limits[i] = self._limit(req, len(traj.tokens))
            e._extend(self.params, rows, tokens, lengths, np.zeros(r, bool), limits,
                      np.zeros((r, 2), np.uint32))
            e.tallies["prefill_tokens"] += int(sum(len(c[3]) for c in chunk))
            e.tallies["prefill_calls"] += 1
            for row, traj, req, ids in chunk:
                self.live[row] = [traj, req, 0]


def _stop_string_end(decode, ids, checked, stop_strings, lookback: int = 8):
    """The smallest n > checked with a stop string in the text of ids[lo:n], or None, where
    lo starts a window of the longest stop string's length plus `lookback` tokens before
    `checked` (ids[:checked] is known to hold none): the text decoded is only that window."""
    back = max(len(s) for s in stop_strings) + lookback
    lo = max(0, checked - back)
    if not any(s in decode(ids[lo:]) for s in stop_strings):
        return None
    for n in range(max(checked, lo) + 1, len(ids) + 1):
        if any(s in decode(ids[lo:n]) for s in stop_strings):
            return n
    return len(ids)
