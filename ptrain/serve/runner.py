"""The engine behind a server: one generation that never ends, fed requests as they arrive.

runner = Runner(engine, params)            # starts the engine loop in a thread
seq = runner.start_sequence(prompt_ids, key=7, max_new_tokens=32, max_len=512)
turn = seq.next_turn()                     # the model's turn: ids, log-probs, versions
turn = seq.extend(observation_ids, max_new_tokens=32)   # appended to its own cache
seq.end()                                  # frees its slot

A sequence is one engine request with an `on_turn` callback (ptrain/generate/engine.py):
after each model turn the engine calls it in a tool thread; it hands the turn to whoever
waits for it (`next_turn`) and waits for the next observation (`extend`). While it waits the
sequence holds its slot and its KV cache, so an observation is a prefill of its own tokens
only, never of the history. A sequence left waiting longer than `idle_timeout_s` is evicted
(ended, its slot freed), and so are the longest-idle waiting sequences when new ones need
their slots; extending an evicted sequence raises `Evicted`, and the caller starts a new
sequence from the whole history (a re-prefill).

Weights: `publish(version, params)` swaps the policy at the next decode round
(ptrain/generate/interrupt.py: the held caches are recomputed); every sampled token carries
the version that sampled it (`Turn.versions`).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

from ptrain.generate import interrupt
from ptrain.generate.engine import Engine, Request, Trajectory
from ptrain.generate.feed import Feed


@dataclasses.dataclass(frozen=True)
class Turn:
    """One model turn of a sequence: its token ids, their log-probs under the behaviour
    policy (logits / temperature: what a learner's forward computes), their policy versions,
    why it ended (stop, length, max_len) and the sequence's length after it."""

    ids: tuple[int, ...]
    logp: tuple[float, ...]
    versions: tuple[int, ...]
    finish: str
    length: int


class Evicted(Exception):
    """The sequence no longer holds a slot (idle too long, or ended): start a new one."""


class EngineFailed(RuntimeError):
    pass


class Sequence:
    """One engine sequence (see the module docstring). Methods are called by one client
    thread at a time."""

    def __init__(self, runner: Runner, max_new_tokens: int):
        self.runner = runner
        self.request: Request | None = None
        self.max_new_tokens = int(max_new_tokens)
        self._turns = queue.Queue()  # Turn | EngineFailed, from the engine's tool thread
        self._actions = queue.Queue()  # observation ids | None (end)
        self._lock = threading.Lock()
        self.state = "decoding"  # decoding | waiting (on its client) | ended
        self.waiting_since = 0.0

    def next_turn(self, timeout_s: float | None = None) -> Turn:
        try:
            turn = self._turns.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no model turn within {timeout_s} s") from None
        if isinstance(turn, Exception):
            raise turn
        return turn

    def extend(self, ids, *, max_new_tokens: int, timeout_s: float | None = None) -> Turn:
        """Appends `ids` (an observation) to the sequence's cache and returns the model's
        next turn. Raises Evicted when the sequence no longer holds its slot."""
        with self._lock:
            if self.state != "waiting":
                raise Evicted(f"the sequence is {self.state}")
            self.state = "decoding"
            # The engine reads the request's max_new_tokens when the next turn starts.
            self.request.max_new_tokens = int(max_new_tokens)
            self._actions.put([int(t) for t in ids])
        return self.next_turn(timeout_s)

    def end(self) -> None:
        with self._lock:
            if self.state == "waiting":
                self._actions.put(None)
            self.state = "ended"
        self.runner._forget(self)

    def _evict(self) -> bool:
        """Frees the slot of a sequence waiting on its client (the next `extend` raises
        Evicted); False if it is not waiting."""
        with self._lock:
            if self.state != "waiting":
                return False
            self._actions.put(None)
            self.state = "ended"
        self.runner._forget(self)
        self.runner.evictions += 1
        return True

    # -- the engine's side (a tool thread)
    def _on_turn(self, traj: Trajectory):
        n = len(traj.turns[-1])
        end = len(traj.tokens)
        turn = Turn(ids=tuple(traj.turns[-1]), logp=tuple(traj.logp_temp[end - n:]),
                    versions=tuple(int(v) for v in interrupt.token_versions(traj, end - n, end)),
                    finish=traj.finish_reasons[-1], length=end)
        with self._lock:  # (the state first: the client may extend as soon as it has the turn)
            over = self.state == "ended" or turn.finish == "max_len"
            self.state = "ended" if over else "waiting"
            self.waiting_since = time.monotonic()
            self._turns.put(turn)
        if over:
            self.runner._forget(self)
            return None
        try:
            return self._actions.get(timeout=self.runner.idle_timeout_s)
        except queue.Empty:  # evicted (None), unless an observation came meanwhile
            self._evict()
            return self._actions.get_nowait()


@dataclasses.dataclass
class _Live(interrupt.Live):
    """The generation's weights; `swapped` is notified when a swap advances them."""

    swapped: threading.Condition = dataclasses.field(default_factory=threading.Condition)

    def advance(self, version: int, params) -> None:
        with self.swapped:
            super().advance(version, params)
            self.swapped.notify_all()


class Runner:
    """The engine loop in a thread (see the module docstring). `params`: what the engine
    decodes (None with the engine's own decode copy, `Engine.sync_weights`)."""

    def __init__(self, engine: Engine, params, *, version: int = 0,
                 idle_timeout_s: float = 120.0, swap_every: int | None = None):
        self.engine, self.idle_timeout_s = engine, float(idle_timeout_s)
        self.feed = Feed()
        # (decode calls no shorter than a turn: a swap waits for the one in flight)
        self.switch = interrupt.Switch(every=swap_every or engine.max_new_tokens)
        self.live = _Live(params, int(version), self.switch)
        self.evictions = 0
        self.error: BaseException | None = None
        self._sequences = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="ptrain-serve-engine",
                                        daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self.live.version

    def publish(self, version: int, params, *, wait: bool = True,
                timeout_s: float | None = None) -> None:
        """Newer weights: the generation switches to them at its next decode round (the
        caches it holds recomputed); `wait`: returns once it has."""
        self.switch.publish(version, params)
        self.feed.wake()
        if wait:
            with self.live.swapped:
                if not self.live.swapped.wait_for(
                        lambda: self.live.version >= version or self.error is not None,
                        timeout_s):
                    raise TimeoutError(f"version {version} was not taken within {timeout_s} s")

    def check(self, prompt, max_len: int) -> None:
        """What the engine would refuse, refused here (ValueError) before it joins."""
        e = self.engine
        if not prompt:
            raise ValueError("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= e.config.vocab_size:
            raise ValueError(f"token ids outside [0, {e.config.vocab_size})")
        if max_len > e.max_len:
            raise ValueError(f"max_len={max_len} exceeds the engine's max_len={e.max_len}")
        if len(prompt) >= max_len or len(prompt) > e.token_buckets[-1]:
            raise ValueError(f"the prompt ({len(prompt)} tokens) leaves no room in the "
                             f"sequence's {max_len} tokens (the engine prefills at most "
                             f"{e.token_buckets[-1]} at once)")

    def start_sequence(self, prompt, *, key, max_new_tokens: int, max_len: int) -> Sequence:
        """A new sequence from `prompt` (its first turn: `next_turn`)."""
        prompt = [int(t) for t in prompt]
        self.check(prompt, max_len)
        if self.error is not None:
            raise EngineFailed(f"the engine stopped: {self.error!r}")
        seq = Sequence(self, max_new_tokens)
        seq.request = Request(prompt, key=key, max_new_tokens=int(max_new_tokens),
                              on_turn=seq._on_turn, max_len=int(max_len))
        with self._lock:
            self._sequences.add(seq)
            sequences = list(self._sequences)
        # Sequences waiting on their clients give their slots to new ones, longest idle first.
        idle = sorted((s for s in sequences if s.state == "waiting"),
                      key=lambda s: s.waiting_since)
        for old in idle[:max(0, len(sequences) - self.engine.slots)]:
            old._evict()
        self.feed.put(seq.request)
        return seq

    def _forget(self, seq: Sequence) -> None:
        with self._lock:
            self._sequences.discard(seq)

    def close(self, timeout_s: float | None = None) -> None:
        """Ends every sequence and the engine loop."""
        self.feed.close()
        with self._lock:
            sequences = list(self._sequences)
        for seq in sequences:
            seq.end()
        self._thread.join(timeout_s)

    def _loop(self):
        e = self.engine
        try:
            e.generate(None if e.decode_dtype else self.live.params, [], live=self.live,
                       feed=self.feed)
        except BaseException as err:  # noqa: BLE001 - every waiting client is told
            self.error = err
            with self.live.swapped:
                self.live.swapped.notify_all()
            with self._lock:
                sequences = list(self._sequences)
            for seq in sequences:
                seq._turns.put(EngineFailed(f"the engine stopped: {err!r}"))
            raise

