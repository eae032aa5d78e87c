"""OpenAI chat messages <-> token ids, in the chat format's convention (ptrain/chat.py).

A conversation's first prompt is rendered by the tokenizer's own chat template (with the
request's tool schemas); what a later request adds after the model's turn (tool results,
user turns) is rendered append-only by the chat format and encoded on its own, exactly as
the rollouts do: nothing the model sampled is ever re-tokenised. Messages are compared in a
canonical form (`canonical`): role, text content and, for the assistant, its calls as
(name, arguments object), so a client that echoes the assistant's message back with other
ids, a JSON string re-serialised or `content: null` for "" is still the same conversation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from ptrain import chat

ROLES = ("system", "user", "assistant", "tool")
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_HERMES_BLOCK = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


class BadMessages(ValueError):
    """The request's messages or tools are malformed (a 400, with what to fix)."""


# ----------------------------------------------------------------------------- canonical form

def _text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise BadMessages(f"{where}: only text content parts "
                                  '({"type": "text", "text": ...}) are served')
            parts.append(part["text"])
        return "".join(parts)
    raise BadMessages(f"{where}: content must be a string, null or a list of text parts")


def _arguments(value, where: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise BadMessages(f"{where}: arguments are not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise BadMessages(f"{where}: arguments must be a JSON object")
    return value


def canonical(messages) -> list[dict]:
    """The messages as {"role", "content"[, "tool_calls": [{"name", "arguments"}]]}."""
    if not isinstance(messages, list) or not messages:
        raise BadMessages("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise BadMessages(f"{where}: a message is an object with a role in {ROLES}")
        c = {"role": m["role"], "content": _text(m.get("content"), where)}
        calls = m.get("tool_calls") or []
        if calls and m["role"] != "assistant":
            raise BadMessages(f"{where}: only assistant messages have tool_calls")
        if m["role"] == "assistant":
            if not isinstance(calls, list):
                raise BadMessages(f"{where}: tool_calls must be a list")
            c["tool_calls"] = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise BadMessages(f"{where}.tool_calls[{j}]: a call is "
                                      '{"type": "function", "function": {"name", "arguments"}}')
                c["tool_calls"].append({"name": fn["name"], "arguments": _arguments(
                    fn.get("arguments", {}), f"{where}.tool_calls[{j}]")})
        out.append(c)
    return out


def canonical_tools(tools) -> list[dict]:
    """The request's tool schemas, checked: [{"type": "function", "function": {"name", ...}}]."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadMessages("tools must be a list of function schemas")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" \
                or not isinstance(fn, Mapping):
            raise BadMessages(f'tools[{i}]: a tool is {{"type": "function", "function": '
                              '{"name": ..., "description": ..., "parameters": {...}}}')
        if not isinstance(fn.get("name"), str) or not NAME.fullmatch(fn["name"]):
            raise BadMessages(f"tools[{i}]: the function's name must be 1-64 of "
                              "A-Z a-z 0-9 _ . : -")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            raise BadMessages(f"tools[{i}] ({fn['name']}): parameters must be a JSON schema "
                              'object ({"type": "object", "properties": {...}})')
        if "description" in fn and not isinstance(fn["description"], str):
            raise BadMessages(f"tools[{i}] ({fn['name']}): description must be a string")
        out.append({"type": "function", "function": json.loads(json.dumps(dict(fn)))})
    return out


# ----------------------------------------------------------------------------- rendering

def _for_template(m: dict) -> dict:
    out = {"role": m["role"], "content": m["content"]}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "function": dict(c)}
                             for c in m["tool_calls"]]
    return out


def render_prompt(fmt: chat.ChatFormat, tokenizer, messages: Sequence[dict],
                  tools: Sequence[dict]) -> list[int]:
    """The token ids of a whole conversation up to the model's next turn (the tokenizer's
    chat template, with the generation prompt)."""
    if not fmt.uses_template:
        raise BadMessages(f"this server's chat format {fmt.name!r} is plain completion: use "
                          "/v1/completions")
    text = tokenizer.apply_chat_template([_for_template(m) for m in messages],
                                         tools=list(tools) or None,
                                         add_generation_prompt=True, tokenize=False)
    return chat.encode(tokenizer, text)


def appendable(tail: Sequence[dict]) -> str | None:
    """Why the chat format cannot append `tail` after a model turn (None when it can):
    it appends tool results and user turns."""
    if not tail:
        return "no new message after the model's turn"
    for m in tail:
        if m["role"] not in ("tool", "user"):
            return f"a {m['role']} message after the model's turn"
    return None


def render_tail(fmt: chat.ChatFormat, tail: Sequence[dict], *, closed: bool) -> str:
    """The text after a model turn for `tail` (tool results, user turns), up to the model's
    next turn: each run of tool messages is one block of results, as the templates write."""
    text, results = chat.close_turn(fmt, closed), []

    def flush():
        nonlocal text, results
        if results:
            text += fmt.tool_results.replace("{results}", "".join(results))
            results = []

    for m in tail:
        if m["role"] == "tool":
            output = json.dumps(m["content"], ensure_ascii=False) if fmt.json_results \
                else m["content"]
            results.append(fmt.tool_result.replace("{output}", output))
        else:
            flush()
            content = m["content"].strip() if fmt.strip_user else m["content"]
            text += fmt.user.replace("{content}", content)
    flush()
    return text + fmt.next_turn


# ----------------------------------------------------------------------------- the model's turn

def assistant_message(fmt: chat.ChatFormat, text: str) -> tuple[dict, list[str]]:
    """(the canonical assistant message of a turn's text, the errors of malformed calls).
    Hermes: the content is the text without its <tool_call> blocks; Llama 3: a turn with a
    call is only the call. With a malformed call the content is the whole text (the client
    sees what the model wrote) and the well-formed calls are kept."""
    parsed = chat.parse_tool_calls(fmt, text)
    calls = [{"name": c.name, "arguments": c.arguments} for c in parsed
             if isinstance(c, chat.ToolCall)]
    errors = [c for c in parsed if isinstance(c, str)]
    if errors or not calls:
        content = text
    elif fmt.parse_calls is chat.parse_hermes:
        content = _HERMES_BLOCK.sub("", text).strip()
    else:
        content = ""
    return {"role": "assistant", "content": content, "tool_calls": calls}, errors


def openai_tool_calls(message: dict, prefix: str) -> list[dict]:
    return [{"id": f"{prefix}_{i}", "type": "function",
             "function": {"name": c["name"],
                          "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for i, c in enumerate(message["tool_calls"])]
