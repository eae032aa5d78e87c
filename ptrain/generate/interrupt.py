"""Interruption of in-flight episodes at a weight update (rl.interrupt, AReaL's interruptible
generation), on the rollout engine (sampling.engine=True) with rl.staleness = k >= 1, for
the producers that record per-token versions (rollout.SingleTurn, rollout.Tasks (every
environment's episodes), and the mixed producer of them: `Live.advance`).

Without it a batch is generated from one policy version to its end (ptrain/lookahead.py:
batch t + k from version t - 1, while update t runs). With it, when update t ends the learner
publishes version t (`Switch.publish`, a copy of its parameters, which the next generation
reuses), and the generation in flight switches to it at its next decode-round boundary
(`Switch.poll`, called by the engine's scheduler before each round; rounds are at most
`Switch.every` decode steps while a switch is attached): every sequence that holds a slot
gets its cache recomputed under the new weights from its whole sequence so far (`swap`:
`kv_slots.recompute`, one prefill per row, AReaL's choice: the KV of the old weights is not
mixed with the new ones), keeps its turn state and sampling key, and goes on; requests not
yet admitted start with the new weights. So an interrupted sequence's tokens before the
swap are the old policy's and those after are the new policy's continuation of the same
prefix (greedily, token for token; sampled, with the same per-token randomness).

With rl.router_replay (a MoE; `Switch(replay=True)`) the recomputation routes every position to
the experts it recorded when it was run, and those stay recorded: the cache is then the forward
the learner replays over that prefix, so the new version's tokens come from exactly the forward
they are trained with (without replay the prefix is re-routed by the new weights and recorded
so). With rl.interrupt_cache="keep" (`Switch(keep_cache=True)`) nothing is recomputed: the new
weights attend to the old weights' keys and values of the prefix (no prefill at the swap), and
a decoding row's next token, drawn from the logits the old weights computed, is the old
version's; the tokens' behaviour log-probs are those of that mixed forward, which the
importance correction takes as it takes any behaviour policy.

Each token keeps the log-probs it was sampled with, and its version: `Trajectory.versions`
holds (position, version) pairs (tokens from that position on came from that version), and
the batch a per-token array (`Batch.versions_bn`, -1 where the model did not sample). The
loss's importance correction (rl.tis_cap; with rl.ppo_epochs > 1 AReaL's decoupled
objective) is per token against those behaviour log-probs, so each token is corrected for
its own version. Metrics: `rollout/interrupted` (rows whose tokens come from more than one
version), `rollout/token_staleness` and its histogram over 0..k (`metrics`).

Where the swap falls depends on the threads' timing (how far the generation got when the
update ended). Exact resume holds anyway: a checkpoint holds the batches pending at it
finished (the save waits for the generation in flight; `encode_batch`: their arrays
are saved as arrays, the rest in the metadata), with their per-token versions, and a resumed run trains on those instead of generating them again.
A run that resumes is exact; a run generated again from scratch is not number for number
(the swap rounds differ), unless the swap round is fixed (`Switch.at_round`, the tests').
"""

from __future__ import annotations

import dataclasses
import json
import threading

import jax
import numpy as np

from ptrain.generate import kv_slots
from ptrain.generate.buckets import prefill_chunks

UNSAMPLED = -1  # versions_bn where the model did not sample the token (padding, observations)


class Switch:
    """The policy versions published for one generation in flight.

    every: decode steps per round while the switch is attached (how soon a swap can fall).
    at_round (a test hook): the swap falls once, exactly after this many decode rounds of
    the first sampler call of the generation that gets that far, to the first version
    published to it (waiting for it if it has not come yet; a later publication that
    raced the wait is not taken; no swap at all if the generation ends first), and
    never again in that generation (a producer that makes several calls, the mixed one's
    parts or the terminal one's turns, goes on with the version it took), so it no longer
    depends on the threads' timing. The class attributes are the defaults (a test program
    may set them)."""

    every: int = 16
    at_round: int | None = None
    timeout_s: float = 600.0

    def __init__(self, *, every: int | None = None, at_round: int | None = None,
                 replay: bool = False, keep_cache: bool = False):
        self.every = int(every or type(self).every)
        self.replay = bool(replay)  # rl.router_replay: recompute with the recorded experts
        self.keep_cache = bool(keep_cache)  # rl.interrupt_cache="keep": no recomputation
        self.at_round = type(self).at_round if at_round is None else at_round
        self._lock, self._published = threading.Lock(), threading.Event()
        self._latest = None  # (version, params)
        self._first = None  # at_round: the first publication, the one its swap takes
        self._fired = False  # at_round: the one swap was decided

    def publish(self, version: int, params) -> None:
        with self._lock:
            if self._latest is None or version > self._latest[0]:
                self._latest = (int(version), params)
            if self._first is None:
                self._first = self._latest
        self._published.set()

    def poll(self, version: int, rounds: int):
        """(version, params) newer than `version` to switch to now, after `rounds` decode
        rounds, or None."""
        if self.at_round is not None:
            if rounds != self.at_round or self._fired:
                return None
            if not self._published.wait(self.timeout_s):
                raise RuntimeError(f"interrupt: no policy version published within "
                                   f"{self.timeout_s} s of round {rounds}")
            self._fired = True
        with self._lock:
            latest = self._first if self.at_round is not None else self._latest
        return latest if latest is not None and latest[0] > version else None


@dataclasses.dataclass
class Live:
    """Parameters handed to a producer's generate under rl.interrupt: the weights it starts
    from, their version, and the switch that may bring newer ones (None: not interruptible).
    The engine sampler unwraps it (`unwrap`); another sampler cannot take it. A swap
    advances it to the new (params, version), so a producer that makes several sampler calls
    with it (the mixed producer's parts) never goes back to
    an older version: each call starts from the newest one its generation has taken."""

    params: object
    version: int
    switch: Switch | None = None

    def advance(self, version: int, params) -> None:
        """A sampler call of this generation switched to `params` of `version`."""
        self.params, self.version = params, int(version)


def unwrap(params):
    """(parameters, Live or None)."""
    return (params.params, params) if isinstance(params, Live) else (params, None)


# ------------------------------------------------------------------ the engine's side

def mark(traj, position: int, version: int) -> None:
    """Tokens of `traj` from `position` on come from `version`."""
    if traj.versions and traj.versions[-1][0] >= position:
        traj.versions[-1] = (position, version)
    else:
        traj.versions.append((position, version))


def token_versions(traj, start: int, end: int) -> np.ndarray:
    """The version of each of traj's tokens start..end-1 (from `traj.versions`)."""
    out = np.full(end - start, traj.versions[0][1] if traj.versions else 0, np.int32)
    for position, version in traj.versions:
        out[max(0, position - start):] = version
    return out


def swap(run, version: int, params) -> None:
    """Switches an engine generation (`engine._Run`) to `params` of `version` at a round
    boundary: every sequence holding a slot (decoding, on a tool, or with an observation
    to append) gets its cache recomputed from its whole sequence under the new weights;
    waiting requests will be prefilled with them."""
    e = run.e
    if e.decode_dtype is not None:
        e.sync_weights(params)
        run.params = e.params
    else:
        run.params = e.decode_params(params)
    s = e.state
    count, index, tokens_nm = jax.device_get((s["count_n"], s["index_n"], s["tokens_nm"]))
    held = [(row, traj.tokens + tokens_nm[row, :int(count[row])].tolist(), traj)
            for row, (traj, _, _) in run.live.items()]
    held += [(row, list(traj.tokens), traj) for row, traj, _, _ in run.tools.values()]
    held += [(row, list(traj.tokens), traj) for row, traj, _, _ in run.ready]
    keep = run.switch.keep_cache
    for row, seq, traj in held:
        if int(index[row]) != len(seq):
            raise RuntimeError(f"interrupt: slot {row} holds {int(index[row])} positions but "
                               f"its sequence has {len(seq)} tokens")
        # Keeping the cache, a decoding row's next token comes from the logits the old
        # weights left (then the new weights run it): it is still the old version's.
        mark(traj, len(seq) + (keep and row in run.live), version)
    for _, group in run.waiting:
        for traj, _ in group:
            mark(traj, len(traj.tokens), version)
    lengths = tuple(sorted({*e.token_buckets, e.max_len}))
    # (keeping the cache: the old weights' keys and values stay, nothing is prefilled)
    recompute = [] if keep else held
    for t, r, chunk in prefill_chunks(recompute, lambda item: len(item[1]), lengths,
                                       e.prefill_buckets):
        rows, tokens, lens = np.full(r, e.slots), np.zeros((r, t), np.int32), np.ones(r)
        for i, (row, seq, _) in enumerate(chunk):
            rows[i], lens[i], tokens[i, :len(seq)] = row, len(seq), seq
        e.state = kv_slots.recompute(run.params, e.state, np.asarray(rows, np.int32),
                                     tokens, np.asarray(lens, np.int32), graphdef=e.graphdef,
                                     replay=run.switch.replay)
        e.tallies["recompute_tokens"] += int(sum(len(c[1]) for c in chunk))
    run.version = version
    if run.live_params is not None:  # a producer's later calls (turns, parts) go on from here
        run.live_params.advance(version, params)
    e.tallies["interruptions"] += 1
    e.tallies["interrupted_rows"] += len(held)


# ------------------------------------------------------------------ the learner's side

def metrics(batch, step: int, k: int) -> dict:
    """Per-token staleness of a batch with `versions_bn`: the mean and histogram over 0..k
    of the lags of its sampled tokens behind the learner (version step - 1), and the share
    of rows whose tokens come from more than one version (`rollout/interrupted`)."""
    v_bn = np.asarray(batch.versions_bn)
    sampled = v_bn != UNSAMPLED
    lags = (step - 1 - v_bn)[sampled]
    if lags.size and not (0 <= lags.min() and lags.max() <= k):
        raise RuntimeError(f"step {step}: a token's staleness is outside [0, {k}]: "
                           f"{sorted(set(lags.tolist()))}")
    hi = np.where(sampled, v_bn, np.iinfo(np.int32).min).max(-1)
    lo = np.where(sampled, v_bn, np.iinfo(np.int32).max).min(-1)
    return {"rollout/token_staleness": float(lags.mean()) if lags.size else 0.0,
            "rollout/token_staleness_hist": np.bincount(lags, minlength=k + 1).tolist(),
            "rollout/interrupted": float(np.mean(sampled.any(-1) & (hi > lo)))}


def encode_batch(batch) -> tuple[dict, dict]:
    """A finished Batch for a checkpoint: (its arrays, by field name, which the checkpoint
    saves as arrays: exact; everything else, as JSON, for its metadata). Its meta must be
    JSON (numpy scalars become numbers)."""
    arrays, rest = {}, {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, np.ndarray):
            arrays[f.name] = value
        else:
            rest[f.name] = value
    try:
        rest = json.loads(json.dumps(rest, default=_number))
    except TypeError as err:
        raise ValueError(f"rl.interrupt saves the pending batches in the checkpoint: their "
                         f"meta must be JSON ({err})") from None
    return arrays, rest


def decode_batch(arrays: dict, rest: dict):
    """The Batch of `encode_batch`'s two parts."""
    from ptrain.batch import Batch
    return Batch(**{name: np.asarray(value) for name, value in arrays.items()}, **rest)


def _number(x):
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON")
