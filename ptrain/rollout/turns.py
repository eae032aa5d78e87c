"""A model turn of an episode (`ptrain.rollout.Episode`) and what follows it, shared by the
per-turn path (rollout.generate) and the engine's (engine_sampler.run_episodes).

  turn_stops   the stop ids and strings of a model turn in a chat format
  take_turn    appends the turn's tokens (mask 1, their log-probs) and returns its tool
               calls, or ends the attempt (an answer, or out of room)
  call_tool    runs one call in the episode's sandbox session (a malformed or disallowed
               call becomes an error observation, never an exception)
  observe      appends the turn's tool outputs as one observation (mask 0)
  append       appends rendered observation or feedback text, cut at the episode's room
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sandbox import tools as sandbox_tools

from ptrain import chat

PLAIN_CALL_END = "</tool_call>"  # where a plain-format turn that calls a tool ends


def turn_stops(fmt: chat.ChatFormat, tokenizer, stop_token_ids=(), *, tools=False):
    """(stop ids, stop strings) of a model turn: the configured ids and the format's end-of-turn
    tokens; in the plain format, with tools, also the end of a tool call (an id when it is one
    token, else a stop string)."""
    ids = tuple(dict.fromkeys((*map(int, stop_token_ids), *(
        chat.end_of_turn_ids(fmt, tokenizer) if fmt.end_of_turn else ()))))
    if not tools or fmt.end_of_turn:
        return ids, ()
    end = chat.encode(tokenizer, PLAIN_CALL_END)
    return (tuple(dict.fromkeys(ids + tuple(end))), ()) if len(end) == 1 else (ids,
                                                                              (PLAIN_CALL_END,))


@dataclasses.dataclass(frozen=True)
class TurnText:
    """How a turn's ids become text: for its calls, for a verifier, and whether it closed."""

    tokenizer: Any
    fmt: chat.ChatFormat
    strip: tuple  # the stop ids a verifier never sees (not a plain call's end tag)
    end_of_turn: frozenset

    @classmethod
    def of(cls, tokenizer, fmt, c) -> TurnText:
        return cls(tokenizer, fmt, turn_stops(fmt, tokenizer, c.stop_token_ids)[0], frozenset(
            chat.end_of_turn_ids(fmt, tokenizer) if fmt.end_of_turn else ()))


def take_turn(e, new, logp, text: TurnText, *, cut: bool, hit_length: bool):
    """Appends a model turn (cut: it ran out of room) to the episode; returns its tool calls,
    or [] when the attempt ended (an answer, or out of room)."""
    e.tokens += new
    e.mask += [1] * len(new)
    e.logp += list(logp)
    e.turns += 1
    e.closed = bool(new) and new[-1] in text.end_of_turn
    if cut:
        e.finish = "max_len"
        e.answers.append(chat.verifier_text(text.tokenizer, new, text.strip))
        return []
    found = (chat.parse_tool_calls(text.fmt, chat.turn_text(text.tokenizer, new, text.strip))
             if e.task.tools else [])
    if not found:
        e.finish = "truncated" if hit_length else "answered"
        e.answers.append(chat.verifier_text(text.tokenizer, new, text.strip))
    return found


def observe(e, outputs, tokenizer, fmt, c) -> bool:
    """Appends a turn's tool outputs (texts, or `ToolOutput`s with images: `rollout.images`)
    as one observation; False when the episode ran out of room (it ends without an answer)."""
    if getattr(e, "vision", None) is not None or any(
            isinstance(o, sandbox_tools.ToolOutput) for o in outputs):
        from ptrain.rollout import images
        return images.observe(e, outputs, tokenizer, fmt, c)
    append(e, tokenizer, chat.observation(fmt, outputs, closed=e.closed), c)
    if e.finish == "max_len":
        e.answers.append("")
        return False
    return True


def call_tool(e, call, c):
    e.tool_calls += 1
    if isinstance(call, str):
        e.tool_errors += 1
        return call
    if call.name not in e.task.tools:
        e.tool_errors += 1
        allowed = ", ".join(e.task.tools)
        return f"Error: tool {call.name!r} is not available here; use one of: {allowed}."
    output = sandbox_tools.call_tool(e.session, call.name, call.arguments,
                                     tools=e.env.tools if e.env else sandbox_tools.TOOLS,
                                     timeout_s=c.tool_timeout_s,
                                     max_output_chars=c.max_tool_output_chars)
    text = output.text if isinstance(output, sandbox_tools.ToolOutput) else output
    if text.startswith("Error:"):
        e.tool_errors += 1
    return output


def append(e, tokenizer, text: str, c) -> None:
    """Appends rendered observation / feedback tokens (not trained on)."""
    ids = chat.encode(tokenizer, text)
    room = c.max_len - (len(e.tokens) - e.prompt_len)
    if len(ids) + 1 > room:  # no room left for the model to respond
        e.finish = "max_len"
        ids = ids[:room]
    e.tokens += ids
    e.mask += [0] * len(ids)
    e.logp += [0.0] * len(ids)
