"""What the server records: episodes, token for token, and the training rows they become.

An episode is what one agent run sent to the server. Its `segments` are token sequences:
the first starts with the prompt as the chat template rendered it; each model turn is
appended exactly as sampled (mask 1, its log-probs under the behaviour policy and the policy
version that sampled each token); what the client sent after a turn (tool results, user
turns) is appended rendered by the chat format (mask 0). A request whose messages extend the
conversation the last segment holds goes on in that segment (and in its KV cache). One that
does not (the agent rewrote, truncated or summarised its history) is a `mismatch`, recorded;
by the server's `on_rewrite` it either starts a new segment from the rewritten conversation
(`reprefill`: its prompt is the template's rendering, mask 0, so nothing the model did not
sample is ever trained on) or drops the episode (`drop`: it has no training rows).

`training_episodes` turns a finished episode into the rollout batch builder's episodes
(`ptrain.rollout.Episode`, `rollout.to_batch`), one per segment with a sampled token.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from ptrain.generate.interrupt import UNSAMPLED


@dataclasses.dataclass
class Segment:
    tokens: list = dataclasses.field(default_factory=list)
    mask: list = dataclasses.field(default_factory=list)
    logp: list = dataclasses.field(default_factory=list)  # 0.0 where mask is 0
    versions: list = dataclasses.field(default_factory=list)  # UNSAMPLED where mask is 0
    prompt_len: int = 0
    turns: int = 0
    finish: str = ""  # the last turn's: stop, length, max_len

    def add_unsampled(self, ids) -> None:
        ids = [int(t) for t in ids]
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logp += [0.0] * len(ids)
        self.versions += [UNSAMPLED] * len(ids)

    def truncate(self, n: int) -> None:
        for name in ("tokens", "mask", "logp", "versions"):
            del getattr(self, name)[n:]

    def add_turn(self, turn) -> None:
        """A model turn (`runner.Turn`), which must end where the engine's sequence does."""
        self.tokens += turn.ids
        self.mask += [1] * len(turn.ids)
        self.logp += list(turn.logp)
        self.versions += list(turn.versions)
        self.turns += 1
        self.finish = turn.finish
        if turn.length != len(self.tokens):
            raise RuntimeError(f"the engine's sequence holds {turn.length} tokens and the "
                               f"record {len(self.tokens)}: the record is not the sequence")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Episode:
    id: str
    max_len: int  # the most tokens a segment may hold
    metadata: dict = dataclasses.field(default_factory=dict)
    on_rewrite: str = "reprefill"  # a request that rewrites the history: reprefill | drop
    kind: str = ""  # chat | completion: the first request's
    segments: list = dataclasses.field(default_factory=list)
    messages: list = dataclasses.field(default_factory=list)  # chat: what the segment holds
    tools: list = dataclasses.field(default_factory=list)  # chat: the schemas it was given
    text: str | None = ""  # completion: the text the segment holds (None: token ids)
    closed_turn: bool = True  # the last turn ended with its sampled end-of-turn token
    mismatches: list = dataclasses.field(default_factory=list)
    dropped: str = ""  # why the episode has no training rows ("" if it has)
    closed: bool = False
    requests: int = 0
    reprefills: int = 0  # segments re-prefilled whole (the slot had been freed)
    created: float = dataclasses.field(default_factory=time.time)
    sequence: object = None  # the runner.Sequence holding the last segment's cache
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def segment(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def end_sequence(self) -> None:
        if self.sequence is not None:
            self.sequence.end()
            self.sequence = None

    def to_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "max_len": self.max_len,
                "metadata": self.metadata,
                "on_rewrite": self.on_rewrite, "segments": [s.to_dict() for s in self.segments],
                "messages": self.messages, "tools": self.tools, "mismatches": self.mismatches,
                "dropped": self.dropped, "closed": self.closed, "requests": self.requests,
                "reprefills": self.reprefills, "created": self.created}


def mismatch_at(recorded: list, given: list) -> int:
    """The first index where `given` leaves `recorded` (len(recorded) if it extends it)."""
    for i, (a, b) in enumerate(zip(recorded, given)):
        if a != b:
            return i
    return min(len(recorded), len(given))


# ----------------------------------------------------------------------------- training rows

def training_segments(episode: Episode) -> list[Segment]:
    """The segments to train on: none of a dropped episode; of the others, each segment in
    which the model sampled a token."""
    if episode.dropped:
        return []
    return [s for s in episode.segments if any(s.mask)]


def training_episodes(episode: Episode, task, *, group_id: int = 0) -> list:
    """The episode as the rollout batch builder's episodes (`ptrain.rollout.Episode`, one per
    training segment, for `rollout.to_batch`): tokens, mask, log-probs (behaviour policy) and
    per-token versions as recorded; `task` is the environment's task the agent ran (its
    verdicts are the caller's to add: `rollout.verify_episodes` or the environment's
    verifier)."""
    from ptrain import rollout  # (the learner's side; the server itself does not need it)
    out = []
    for s in training_segments(episode):
        finish = {"stop": "answered", "length": "truncated"}.get(s.finish, "max_len")
        out.append(rollout.Episode(
            task=task, group_id=group_id, tokens=list(s.tokens), mask=list(s.mask),
            logp=list(s.logp), prompt_len=s.prompt_len, turns=s.turns, finish=finish,
            versions=list(s.versions)))
    return out
