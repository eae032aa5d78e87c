"""The endpoint's logic, without HTTP: OpenAI chat and text completions over the rollout
engine, each request in an episode that is recorded token for token (ptrain/serve/episodes.py).

service = Service(engine, params, tokenizer, ServeConfig(chat_format="qwen"))
episode = service.open_episode()                       # {"id": ...}
reply = service.chat(episode["id"], {"messages": [...], "tools": [...]})
service.close_episode(episode["id"]); rows = service.take_closed()

A request that extends its episode's conversation (its messages begin with every message
the episode holds, the model's own turns as the server returned them) is appended to the
episode's sequence: only the new messages are prefilled, into the cache the sequence holds.
Sampling is the engine's (temperature, top-k, top-p, stop ids are the server's: the
policy's samples come from the distribution the learner corrects for); a request that asks
for other sampling is refused unless `ServeConfig.sampling_params="ignore"`.
Errors are `ApiError`s: an HTTP status, a message that says what to fix, an OpenAI type.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import threading
import time
from collections.abc import Mapping

from ptrain import chat
from ptrain.serve import messages as msg
from ptrain.serve.episodes import Episode, Segment, mismatch_at
from ptrain.serve.runner import EngineFailed, Evicted, Runner

ON_REWRITE = ("reprefill", "drop")
SAMPLING_PARAMS = ("error", "ignore")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"  # loopback unless asked
    port: int = 0  # 0: a free one
    token: str | None = None  # the bearer token; None: $PTRAIN_SERVE_TOKEN or a new one
    allowed_hosts: tuple[str, ...] = ()  # more Host headers to accept ("name:port")
    model_name: str = "ptrain"
    chat_format: str = "qwen"  # ptrain.chat.FORMATS
    max_request_bytes: int = 4 << 20
    max_messages: int = 1024
    max_open_episodes: int = 4096
    episode_max_len: int | None = None  # tokens per segment; None: the engine's max_len
    on_rewrite: str = "reprefill"  # ON_REWRITE
    auto_episodes: bool = False  # an unknown episode id opens an episode (else a 404)
    idle_timeout_s: float = 120.0  # a sequence waiting longer on its client frees its slot
    request_timeout_s: float = 600.0
    sampling_params: str = "error"  # SAMPLING_PARAMS: a request's other sampling
    seed: int = 0  # sequences of requests without `seed` draw from (seed, counter)
    load_weights: bool = False  # serve POST /update_weights_from_disk (a learner's exports)

    def __post_init__(self):
        checks = [
            (self.on_rewrite in ON_REWRITE, f"on_rewrite must be one of {ON_REWRITE}"),
            (self.sampling_params in SAMPLING_PARAMS,
             f"sampling_params must be one of {SAMPLING_PARAMS}"),
            (self.chat_format in chat.FORMATS,
             f"chat_format must be one of {sorted(chat.FORMATS)}"),
            (min(self.max_request_bytes, self.max_messages, self.max_open_episodes) >= 1,
             "max_request_bytes, max_messages and max_open_episodes must be >= 1"),
            (self.idle_timeout_s > 0 and self.request_timeout_s > 0, "timeouts must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"ServeConfig: {message}")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


# Fields a request may carry: those the server acts on, and those it accepts as they are.
_CHAT_FIELDS = {"model", "messages", "tools", "tool_choice", "parallel_tool_calls",
                "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
                "seed", "stream", "stream_options", "logprobs", "top_logprobs", "stop",
                "episode_id", "user", "metadata", "store", "presence_penalty",
                "frequency_penalty", "response_format"}
_COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n",
                      "seed", "stream", "stream_options", "logprobs", "stop", "episode_id",
                      "user", "echo", "best_of", "presence_penalty", "frequency_penalty",
                      "suffix"}


class Service:
    """See the module docstring. `params`: the policy's parameters (None when the engine
    decodes its own copy: `Engine.sync_weights`); `version` their policy version."""

    def __init__(self, engine, params, tokenizer, config: ServeConfig = ServeConfig(), *,
                 version: int = 0):
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.fmt = chat.get(config.chat_format)
        if self.fmt.uses_template:
            chat.check(self.fmt, tokenizer)  # append-only rendering equals the template
        self.max_len = int(config.episode_max_len or engine.max_len)
        if not 1 < self.max_len <= engine.max_len:
            raise ValueError(f"ServeConfig.episode_max_len={self.max_len} must be in "
                             f"(1, the engine's max_len={engine.max_len}]")
        self.runner = Runner(engine, params, version=version,
                             idle_timeout_s=config.idle_timeout_s)
        self.episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()
        self._sequences = 0

    def close(self) -> None:
        self.runner.close()

    # ------------------------------------------------------------------ episodes

    def open_episode(self, body: Mapping | None = None) -> dict:
        body = dict(body or {})
        unknown = set(body) - {"id", "max_len", "metadata", "on_rewrite"}
        if unknown:
            raise ApiError(400, f"unknown field(s) {sorted(unknown)}; an episode takes id, "
                                "max_len, metadata, on_rewrite")
        on_rewrite = body.get("on_rewrite", self.config.on_rewrite)
        if on_rewrite not in ON_REWRITE:
            raise ApiError(400, f"on_rewrite must be one of {ON_REWRITE}")
        max_len = body.get("max_len", self.max_len)
        if not isinstance(max_len, int) or not 1 < max_len <= self.max_len:
            raise ApiError(400, f"max_len must be an integer in (1, {self.max_len}]")
        if not isinstance(body.get("metadata", {}), dict):
            raise ApiError(400, "metadata must be an object")
        eid = body.get("id") or secrets.token_hex(8)
        if not isinstance(eid, str) or not msg.NAME.fullmatch(eid):
            raise ApiError(400, "an episode id is 1-64 of A-Z a-z 0-9 _ . : -")
        with self._lock:
            if eid in self.episodes:
                raise ApiError(409, f"episode {eid!r} exists")
            if sum(not e.closed for e in self.episodes.values()) >= self.config.max_open_episodes:
                raise ApiError(429, f"{self.config.max_open_episodes} episodes are open: close "
                                    "some (POST /v1/episodes/<id>/close)", "rate_limit_error")
            episode = Episode(eid, max_len, metadata=body.get("metadata", {}),
                              on_rewrite=on_rewrite)
            self.episodes[eid] = episode
        return {"id": eid, "max_len": max_len, "on_rewrite": on_rewrite,
                "base_path": f"/episodes/{eid}/v1"}

    def episode(self, eid: str) -> Episode:
        with self._lock:
            episode = self.episodes.get(eid)
        if episode is None:
            if not self.config.auto_episodes:
                raise ApiError(404, f"unknown episode {eid!r}: open it first (POST "
                                    "/v1/episodes) and send its id", "not_found_error")
            try:
                self.open_episode({"id": eid})
            except ApiError as e:
                if e.status != 409:  # (another request opened it meanwhile)
                    raise
            return self.episode(eid)
        return episode

    def close_episode(self, eid: str) -> dict:
        episode = self.episode(eid)
        with episode.lock:
            episode.end_sequence()
            episode.closed = True
        return episode.to_dict()

    def take_closed(self, ids=None) -> list[Episode]:
        """The closed episodes (of `ids` only, if given), removed from the server (a
        learner's rollouts)."""
        with self._lock:
            done = [e for e in self.episodes.values()
                    if e.closed and (ids is None or e.id in ids)]
            for e in done:
                del self.episodes[e.id]
        return done

    def load_weights(self, body: Mapping) -> dict:
        """New weights from a Hugging Face directory (a learner's export, `hf.save`), swapped
        in at the engine's next decode round as the next policy version (SGLang's
        /update_weights_from_disk shape: {"model_path": dir})."""
        if not self.config.load_weights:
            raise ApiError(403, "this server does not load weights (start it with "
                                "load_weights=True)", "permission_error")
        path = body.get("model_path")
        if set(body) - {"model_path", "load_format"} or not isinstance(path, str) \
                or not os.path.isfile(os.path.join(path, "config.json")):
            raise ApiError(400, "give {\"model_path\": a Hugging Face directory the server "
                                "can read}")
        from flax import nnx

        from ptrain import hf
        model, _ = hf.load(path)
        version = self.runner.version + 1
        self.runner.publish(version, nnx.split(model)[1], timeout_s=self.config.request_timeout_s)
        return {"success": True, "message": f"loaded {path}", "policy_version": version}

    # ------------------------------------------------------------------ requests

    def chat(self, eid: str, body: Mapping) -> dict:
        """An OpenAI chat completion (its stream chunks: `http.chunks`)."""
        _check_fields(body, _CHAT_FIELDS, "/v1/chat/completions")
        if not self.fmt.uses_template:
            raise ApiError(400, f"the chat format {self.fmt.name!r} has no chat template: "
                                "use /v1/completions")
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > self.config.max_messages:
            raise ApiError(413, f"{len(messages)} messages; the limit is "
                                f"{self.config.max_messages}")
        try:
            messages = msg.canonical(messages)
            tools = msg.canonical_tools(body.get("tools"))
        except msg.BadMessages as e:
            raise ApiError(400, str(e)) from None
        if body.get("tool_choice") not in (None, "auto"):
            self._other_sampling("tool_choice", body["tool_choice"])
        if body.get("top_logprobs"):
            raise ApiError(400, "top_logprobs are not served (the engine keeps each sampled "
                                "token's log-prob only)")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        episode = self.episode(eid)
        with self._exclusive(episode, "chat"):
            self._sampling(body)
            n = len(episode.messages)
            consistent = (episode.segment is not None and tools == episode.tools
                          and messages[:n] == episode.messages)
            why = msg.appendable(messages[n:]) if consistent else None
            if consistent and why is None:
                delta = chat.encode(self.tokenizer, msg.render_tail(
                    self.fmt, messages[n:], closed=episode.closed_turn))
                turn = self._extend(episode, delta, max_tokens)
            else:
                if episode.segment is not None:
                    self._rewrite(episode, messages, tools, why)
                import jinja2  # (the templates' engine, with the tokenizer's transformers)
                try:
                    prompt = msg.render_prompt(self.fmt, self.tokenizer, messages, tools)
                except (jinja2.TemplateError, TypeError, ValueError) as e:
                    raise ApiError(400, f"the model's chat template cannot render these "
                                        f"messages: {e}") from None
                turn = self._start(episode, prompt, max_tokens, body.get("seed"))
                delta = prompt
            text = chat.turn_text(self.tokenizer, turn.ids, self.engine.settings.stop_token_ids)
            reply, errors = msg.assistant_message(self.fmt, text)
            episode.messages = messages + [reply]
            episode.tools = tools
            episode.closed_turn = bool(turn.ids) and \
                turn.ids[-1] in self.engine.settings.stop_token_ids
            call_prefix = f"call_{episode.id}_{episode.requests}"
        finish = ("length" if turn.finish != "stop" else
                  "tool_calls" if reply["tool_calls"] else "stop")
        message = {"role": "assistant", "content": reply["content"]}
        if reply["tool_calls"]:
            message["tool_calls"] = msg.openai_tool_calls(reply, call_prefix)
        choice = {"index": 0, "message": message, "finish_reason": finish,
                  "logprobs": ({"content": self._logprobs(turn)} if body.get("logprobs")
                               else None),
                  "token_ids": list(turn.ids)}
        return self._response("chat.completion", episode, choice, delta, turn,
                              tool_call_errors=errors)

    def completion(self, eid: str, body: Mapping) -> dict:
        """An OpenAI text completion: `prompt` is a string or a list of token ids."""
        _check_fields(body, _COMPLETION_FIELDS, "/v1/completions")
        for name, ok in (("echo", not body.get("echo")), ("suffix", body.get("suffix") is None),
                         ("best_of", body.get("best_of") in (None, 1))):
            if not ok:
                raise ApiError(400, f"{name} is not served")
        prompt = body.get("prompt")
        ids_given = isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) or ids_given) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string or list of token ids "
                                "(one prompt per request)")
        max_tokens = body.get("max_tokens", 16)
        given = [int(t) for t in prompt] if ids_given else prompt
        episode = self.episode(eid)
        with self._exclusive(episode, "completion"):
            self._sampling(body)
            seg = episode.segment
            # what the segment holds, as this request's prompt would give it
            recorded = None if seg is None else seg.tokens if ids_given else episode.text
            if recorded is not None and len(given) > len(recorded) \
                    and given[:len(recorded)] == recorded:
                rest = given[len(recorded):]
                delta = rest if ids_given else chat.encode(self.tokenizer, rest)
                turn = self._extend(episode, delta, max_tokens)
            else:
                if seg is not None:
                    self._rewrite(episode, given, None, None, recorded=recorded or [])
                delta = given if ids_given else chat.encode(self.tokenizer, given)
                turn = self._start(episode, delta, max_tokens, body.get("seed"))
            text = chat.verifier_text(self.tokenizer, turn.ids, self.engine.settings.stop_token_ids)
            # a text prompt goes on from the text the client saw; token ids from the ids
            episode.text = None if ids_given else given + text
        choice = {"index": 0, "text": text,
                  "finish_reason": "stop" if turn.finish == "stop" else "length",
                  "logprobs": (self._completion_logprobs(turn)
                               if body.get("logprobs") is not None else None),
                  "token_ids": list(turn.ids)}
        return self._response("text_completion", episode, choice, delta, turn)

    # ------------------------------------------------------------------ the engine's side

    def _start(self, episode: Episode, prompt: list[int], max_tokens, seed):
        """A new segment from `prompt` (a new sequence; the old one, if any, is ended)."""
        episode.end_sequence()
        max_tokens = self._max_tokens(max_tokens, episode.max_len - len(prompt))
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ApiError(400, "seed must be an integer")
        try:
            episode.sequence = self.runner.start_sequence(
                prompt, key=self._key(seed), max_new_tokens=max_tokens,
                max_len=episode.max_len)
        except ValueError as e:
            raise ApiError(400, f"the prompt does not fit the episode: {e}") from None
        seg = Segment(prompt_len=len(prompt))
        seg.add_unsampled(prompt)
        episode.segments.append(seg)
        return self._record(episode, lambda: episode.sequence.next_turn(
            self.config.request_timeout_s))

    def _extend(self, episode: Episode, delta: list[int], max_tokens):
        """The episode's segment goes on: `delta` into its cache, then the model's turn."""
        seg = episode.segment
        room = episode.max_len - len(seg.tokens) - len(delta)
        if room < 1:
            raise ApiError(400, f"the new messages ({len(delta)} tokens) leave no room in the "
                                f"episode's budget ({episode.max_len} tokens, "
                                f"{len(seg.tokens)} used)")
        max_tokens = self._max_tokens(max_tokens, room)
        if len(delta) > self.engine.token_buckets[-1]:
            raise ApiError(413, f"the new messages are {len(delta)} tokens; the engine "
                                f"appends at most {self.engine.token_buckets[-1]} at once")
        seq, held = episode.sequence, len(seg.tokens)
        seg.add_unsampled(delta)
        try:
            if seq is None:
                raise Evicted("no sequence")
            return self._record(episode, lambda: seq.extend(
                delta, max_new_tokens=max_tokens, timeout_s=self.config.request_timeout_s))
        except Evicted:  # its slot was freed: the whole segment is prefilled again
            try:
                episode.sequence = self.runner.start_sequence(
                    seg.tokens, key=self._key(None), max_new_tokens=max_tokens,
                    max_len=episode.max_len)
            except ValueError as e:
                seg.truncate(held)  # (the request did not happen)
                raise ApiError(400, f"the episode does not fit the engine again: {e}") from None
            episode.reprefills += 1
            return self._record(episode, lambda: episode.sequence.next_turn(
                self.config.request_timeout_s))

    def _key(self, seed) -> int:
        """A new sequence's PRNG seed: the request's `seed`, else (config seed, a counter)."""
        with self._lock:
            self._sequences += 1
            key = seed if seed is not None else self.config.seed * 1_000_003 + self._sequences
        return int(key) % (1 << 31)

    def _record(self, episode: Episode, wait):
        try:
            turn = wait()
        except TimeoutError as e:
            episode.end_sequence()
            episode.dropped = episode.dropped or f"a turn timed out ({e})"
            raise ApiError(504, f"the model's turn did not come: {e}", "server_error") from None
        except EngineFailed as e:
            raise ApiError(500, str(e), "server_error") from None
        episode.segment.add_turn(turn)
        if turn.finish == "max_len":
            episode.sequence = None  # (the engine ended it: the episode's budget is spent)
        return turn

    def _max_tokens(self, max_tokens, room: int) -> int:
        cap = min(self.engine.max_new_tokens, room)
        if max_tokens is None:
            if cap < 1:
                raise ApiError(400, "the episode's token budget is spent")
            return cap
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ApiError(400, "max_tokens must be a positive integer")
        if max_tokens > self.engine.max_new_tokens:
            raise ApiError(400, f"max_tokens={max_tokens} exceeds the server's "
                                f"{self.engine.max_new_tokens} tokens per turn")
        if max_tokens > room:
            raise ApiError(400, f"max_tokens={max_tokens} asks for more tokens than the "
                                f"episode's budget has left ({room})")
        return max_tokens

    def _rewrite(self, episode: Episode, given, tools, why, *, recorded=None):
        """The request does not extend the episode: recorded, then per `on_rewrite`."""
        recorded = episode.messages if recorded is None else recorded
        at = mismatch_at(recorded, given)
        reason = why or ("the tools changed" if tools is not None and tools != episode.tools
                         else f"the history differs from the recorded one at {at}")
        episode.mismatches.append({"request": episode.requests, "at": at, "reason": reason,
                                   "segment": len(episode.segments) - 1,
                                   "policy": episode.on_rewrite})
        episode.end_sequence()
        if episode.on_rewrite == "drop":
            episode.dropped = f"request {episode.requests}: {reason}"
            raise ApiError(409, f"episode {episode.id!r}: {reason}; this server drops "
                                "episodes whose history is rewritten (on_rewrite=drop)",
                           "conflict_error")

    # ------------------------------------------------------------------ helpers

    @contextlib.contextmanager
    def _exclusive(self, episode: Episode, kind: str):
        """The episode, for one request at a time."""
        if not episode.lock.acquire(blocking=False):
            raise ApiError(409, f"episode {episode.id!r} has a request in flight; send one "
                                "request at a time per episode", "conflict_error")
        try:
            checks = [
                (not episode.closed, 409, f"episode {episode.id!r} is closed"),
                (not episode.dropped, 409, f"episode {episode.id!r} was dropped: "
                                           f"{episode.dropped}"),
                (episode.kind in ("", kind), 400, f"episode {episode.id!r} is a "
                                                  f"{episode.kind} episode; open another for "
                                                  f"{kind} requests"),
                (self.runner.error is None, 500, f"the engine stopped: {self.runner.error!r}"),
            ]
            for ok, status, message in checks:
                if not ok:
                    raise ApiError(status, message)
            episode.kind = kind
            episode.requests += 1
            yield episode
        finally:
            episode.lock.release()

    def _sampling(self, body: Mapping) -> None:
        s = self.engine.settings
        wanted = {"temperature": (s.temperature if not s.greedy else 0.0),
                  "top_p": s.top_p, "top_k": s.top_k, "n": 1,
                  "presence_penalty": 0, "frequency_penalty": 0}
        for name, value in wanted.items():
            given = body.get(name)
            if given is not None and given != value:
                self._other_sampling(name, given, value)
        if body.get("stop"):
            self._other_sampling("stop", body["stop"], "the server's stop tokens")
        fmt = body.get("response_format")
        if fmt not in (None, {"type": "text"}):
            self._other_sampling("response_format", fmt, {"type": "text"})

    def _other_sampling(self, name, given, value=None):
        if name == "n" or self.config.sampling_params == "error":
            raise ApiError(400, f"{name}={given!r}: this server samples the policy as it is "
                                f"trained ({name}={value!r}); leave it out"
                                + ("" if name == "n" else
                                   ", or start the server with sampling_params=ignore"))

    def _logprobs(self, turn) -> list[dict]:
        out = []
        for t, lp in zip(turn.ids, turn.logp):
            token = self.tokenizer.decode([t])
            out.append({"token": token, "logprob": float(lp),
                        "bytes": list(token.encode("utf-8")), "top_logprobs": []})
        return out

    def _completion_logprobs(self, turn) -> dict:
        tokens = [self.tokenizer.decode([t]) for t in turn.ids]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": [float(x) for x in turn.logp],
                "top_logprobs": None, "text_offset": offsets}

    def _response(self, obj: str, episode: Episode, choice: dict, delta, turn, **extra):
        seg = episode.segment
        return {"id": f"{'chatcmpl' if obj == 'chat.completion' else 'cmpl'}-"
                      f"{episode.id}-{episode.requests}",
                "object": obj, "created": int(time.time()), "model": self.config.model_name,
                "choices": [choice],
                "usage": {"prompt_tokens": len(seg.tokens) - len(turn.ids),
                          "completion_tokens": len(turn.ids),
                          "total_tokens": len(seg.tokens)},
                "prompt_token_ids": list(delta),  # what this request appended before the turn
                "episode_id": episode.id, "segment": len(episode.segments) - 1,
                "policy_version": turn.versions[-1] if turn.versions else self.runner.version,
                **extra}


def _check_fields(body: Mapping, allowed: set, path: str) -> None:
    if not isinstance(body, Mapping):
        raise ApiError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"unknown field(s) {unknown} for {path}; this server takes "
                            f"{', '.join(sorted(allowed))}")


def from_model_dir(path: str, config: ServeConfig = ServeConfig(), *, slots: int = 16,
                   max_len: int = 4096, max_new_tokens: int = 1024, temperature: float = 1.0,
                   top_k: int = 0, top_p: float = 1.0, decode_dtype: str | None = None
                   ) -> Service:
    """A Service over a Hugging Face model directory (weights, tokenizer, chat template):
    its turns stop at the chat format's end of turn and the directory's eos ids."""
    from ptrain import hf
    from ptrain.generate.engine import Engine
    from flax import nnx
    model, model_config = hf.load(path)
    tokenizer = hf.load_tokenizer(path)
    fmt = chat.get(config.chat_format)
    chat.check_vocab(tokenizer, model_config.vocab_size)
    stop = chat.stop_ids(fmt, tokenizer, eos_sources=hf.eos_token_ids(path),
                         vocab_size=model_config.vocab_size)
    engine = Engine(model, slots=slots, max_len=max_len, max_new_tokens=max_new_tokens,
                    temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=stop,
                    decode_dtype=decode_dtype)
    params = nnx.state(model)
    if decode_dtype:
        engine.sync_weights(params)
        params = None
    return Service(engine, params, tokenizer, config)
