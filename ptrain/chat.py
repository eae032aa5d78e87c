"""Chat formats: the text around a model's turns, exactly as the tokenizer's template writes it.

An episode is a list of token ids that only grows: the prompt (rendered once, through the
tokenizer's own chat template where the format has one), each model turn exactly as sampled,
then what follows a turn (tool results, retry feedback) rendered here and encoded on its own.
Nothing is ever re-tokenised, so the sampler's log-probs are those of the tokens trained on.
For the episode to be the conversation the model knows, what is appended must be, token for
token, what the template writes for the same conversation: `check` verifies that on the
tokenizer at hand (tests/test_chat.py does it for the real Qwen2.5 and Llama 3.1 templates).

  QWEN    ChatML, <|im_start|>role ... <|im_end|>; Hermes tool calls, several per turn:
          <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>; the results of a
          turn come back in one user turn of <tool_response> blocks.
  LLAMA3  <|start_header_id|>role<|end_header_id|> ... <|eot_id|> (<|eom_id|> after a
          built-in tool call); a call is the whole turn, {"name": ..., "parameters": {...}},
          or <|python_tag|> + code; each result is an ipython turn, JSON-encoded as the
          Llama 3.1 template does with string contents.
  PLAIN   completion (a base model, the quickstart's word tokenizer): no template; Hermes
          calls, <tool_response> and <feedback> blocks; a turn ends at the tokenizer's eos.

Also here: the stop ids of a turn, the vocabulary check, and the two texts of a sampled turn
(`turn_text` for parsing calls, `verifier_text` for judging: no special tokens, so the stop
token never reaches a verifier).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from sandbox import tools as sandbox_tools

from ptrain import quiet


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


# A turn's calls, in order: a ToolCall, or an error message (str) for a malformed one.
Calls = list  # list[ToolCall | str]


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """The text around the model's turns. `{content}`, `{results}` and `{output}` are filled in
    (by replacement: braces in what is filled in are kept as they are)."""

    name: str
    end_of_turn: tuple[str, ...]  # tokens that end a model turn; the first closes an open one
    after_turn: str  # what the template writes after the end-of-turn token
    next_turn: str  # the header of the model's next turn
    user: str  # a user turn: "{content}"
    tool_results: str  # the results of one turn's calls: "{results}"
    tool_result: str  # one result: "{output}"
    parse_calls: Callable[[str], Calls]
    format_calls: Callable[[str, Sequence[ToolCall]], str]
    strip_user: bool = False  # the template trims user contents (Llama 3)
    json_results: bool = False  # the template JSON-encodes string results (Llama 3.1)
    retry: str = "{feedback}\nPlease fix it."  # the user content of retry feedback
    uses_template: bool = True  # prompts go through the tokenizer's chat template


# ----------------------------------------------------------------------------- tool calls

def _arguments(arguments) -> dict | str:
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            return f"Error: the arguments are not valid JSON ({e})."
    if not isinstance(arguments, dict):
        return "Error: the arguments of a tool call are a JSON object."
    return arguments


def _call_from_json(body: str, keys: tuple[str, ...], shape: str) -> ToolCall | str:
    try:
        call = json.loads(body)
    except ValueError as e:
        return f"Error: the tool call is not valid JSON ({e})."
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return f"Error: a tool call is {shape}."
    arguments = _arguments(next((call[k] for k in keys if k in call), {}))
    return arguments if isinstance(arguments, str) else ToolCall(call["name"], arguments)


def parse_hermes(text: str) -> Calls:
    """Every <tool_call>{"name": ..., "arguments": {...}}</tool_call> block of a turn."""
    calls, at = [], 0
    while (start := text.find("<tool_call>", at)) >= 0:
        end = text.find("</tool_call>", start)
        if end < 0:
            calls.append("Error: the tool call is not closed with </tool_call>.")
            break
        body = text[start + len("<tool_call>"):end].strip()
        calls.append(_call_from_json(body, ("arguments", "parameters"),
                                     '{"name": <tool>, "arguments": {...}}'))
        at = end + len("</tool_call>")
    return calls


def format_hermes(content: str, calls: Sequence[ToolCall]) -> str:
    blocks = [f'<tool_call>\n{{"name": "{c.name}", "arguments": '
              f'{json.dumps(c.arguments, ensure_ascii=False)}}}\n</tool_call>' for c in calls]
    return "\n".join(([content] if content else []) + blocks)


_BUILTIN = re.compile(r"(\w+)\.call\((.*)\)", re.DOTALL)


def parse_llama3(text: str) -> Calls:
    """A Llama 3 turn's call: the turn is {"name": ..., "parameters": {...}} (JSON, maybe after
    <|python_tag|>), or <|python_tag|> + `tool.call(k="v")` (a built-in tool) or + code (the
    code interpreter, our `python` tool). Any other turn is an answer."""
    text = text.strip()
    tagged = text.startswith("<|python_tag|>")
    body = text[len("<|python_tag|>"):].strip() if tagged else text
    shape = '{"name": <tool>, "parameters": {...}}'
    if body.startswith("{") and (tagged or re.match(r'\{\s*"name"\s*:', body)):
        return [_call_from_json(body, ("parameters", "arguments"), shape)]
    if not tagged:
        return []
    builtin = _BUILTIN.fullmatch(body)
    if builtin:
        try:
            call = quiet.parse(f"f({builtin.group(2)})", mode="eval").body
            arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        except (SyntaxError, ValueError) as e:
            return [f"Error: the arguments of {builtin.group(1)}.call(...) are not literals ({e})."]
        return [ToolCall(builtin.group(1), arguments)]
    return [ToolCall("python", {"code": body})]


def format_llama3(content: str, calls: Sequence[ToolCall]) -> str:
    if not calls:
        return content.strip()
    if len(calls) > 1 or content:
        raise ValueError("a Llama 3 turn is one tool call and nothing else (its template "
                         "drops the content of a turn with calls and allows only one)")
    c = calls[0]
    return (f'{{"name": "{c.name}", "parameters": '
            f'{json.dumps(c.arguments, ensure_ascii=False)}}}')


# ----------------------------------------------------------------------------- formats

QWEN = ChatFormat(
    name="qwen", end_of_turn=("<|im_end|>",), after_turn="\n",
    next_turn="<|im_start|>assistant\n", user="<|im_start|>user\n{content}<|im_end|>\n",
    tool_results="<|im_start|>user{results}<|im_end|>\n",
    tool_result="\n<tool_response>\n{output}\n</tool_response>",
    parse_calls=parse_hermes, format_calls=format_hermes)

LLAMA3 = ChatFormat(
    name="llama3", end_of_turn=("<|eot_id|>", "<|eom_id|>"), after_turn="",
    next_turn="<|start_header_id|>assistant<|end_header_id|>\n\n",
    user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>",
    tool_results="{results}",
    tool_result="<|start_header_id|>ipython<|end_header_id|>\n\n{output}<|eot_id|>",
    parse_calls=parse_llama3, format_calls=format_llama3, strip_user=True, json_results=True)

PLAIN = ChatFormat(
    name="plain", end_of_turn=(), after_turn="", next_turn="",
    user="\n<feedback>\n{content}\n</feedback>\n", tool_results="{results}\n",
    tool_result="\n<tool_response>\n{output}\n</tool_response>",
    parse_calls=parse_hermes, format_calls=format_hermes, retry="{feedback}",
    uses_template=False)

FORMATS = {f.name: f for f in (QWEN, LLAMA3, PLAIN)}


def get(name: str) -> ChatFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown chat format {name!r}; use one of {sorted(FORMATS)}")
    return FORMATS[name]


# ----------------------------------------------------------------------------- rendering

def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` with no special tokens added (a BOS in mid-episode is wrong)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # a tokenizer without the keyword adds none anyway
        return list(tokenizer.encode(text))


def tool_schemas(tools: Iterable) -> list[dict]:
    """The function-calling schemas of the tools, in the order given: `sandbox.tools.Tool`s
    (an environment's), or names of the sandbox's own tools."""
    by_name = {t.name: t for t in sandbox_tools.TOOLS}
    unknown = [t for t in tools if isinstance(t, str) and t not in by_name]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; known: {sorted(by_name)}")
    return sandbox_tools.schemas([by_name[t] if isinstance(t, str) else t for t in tools])


def render_prompt(fmt: ChatFormat, tokenizer, *, prompt: str = "",
                  messages: Sequence[Mapping] = (), tools: Sequence = ()) -> list[int]:
    """The prompt's token ids, ending where the model's first turn begins: the tokenizer's chat
    template with the generation prompt (and the tools' schemas), or plain text."""
    if not fmt.uses_template:
        if messages:
            raise ValueError(f"chat format {fmt.name!r} is plain completion and cannot render "
                             "chat messages; give the task a plain prompt or use a chat format")
        return encode(tokenizer, prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"chat format {fmt.name!r} renders prompts with the tokenizer's chat "
                         "template and this tokenizer has none: use a tokenizer directory with "
                         "a chat template, or the 'plain' format")
    messages = [dict(m) for m in messages] or [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tools=tool_schemas(tools) or None,
                                         add_generation_prompt=True, tokenize=False)
    return encode(tokenizer, text)


def close_turn(fmt: ChatFormat, closed: bool) -> str:
    """What ends a model turn in the history: its end-of-turn token unless the model sampled
    it (`closed`), then what the template writes after it."""
    return ("" if closed or not fmt.end_of_turn else fmt.end_of_turn[0]) + fmt.after_turn


def observation(fmt: ChatFormat, outputs: Sequence[str], *, closed: bool) -> str:
    """The text after a turn that made tool calls: the results, then the next turn's header."""
    results = "".join(fmt.tool_result.replace(
        "{output}", json.dumps(o, ensure_ascii=False) if fmt.json_results else o)
        for o in outputs)
    return (close_turn(fmt, closed) + fmt.tool_results.replace("{results}", results)
            + fmt.next_turn)


def user_turn(fmt: ChatFormat, content: str, *, closed: bool) -> str:
    """A user turn after a model turn, then the next turn's header."""
    content = content.strip() if fmt.strip_user else content
    return close_turn(fmt, closed) + fmt.user.replace("{content}", content) + fmt.next_turn


def feedback(fmt: ChatFormat, text: str, *, closed: bool) -> str:
    """Retry feedback after a failed answer (a user turn asking to fix it)."""
    return user_turn(fmt, fmt.retry.replace("{feedback}", text), closed=closed)


def format_turn(fmt: ChatFormat, content: str = "",
                calls: Sequence[ToolCall] = ()) -> str:
    """A model turn's text (before its end-of-turn token) as the template writes an assistant
    message with this content and these calls: for demonstrations and scripted policies."""
    return fmt.format_calls(content, list(calls))


def parse_tool_calls(fmt: ChatFormat, text: str) -> Calls:
    """The calls a turn makes ([] for a final answer), from its `turn_text`."""
    return fmt.parse_calls(text)


# ----------------------------------------------------------------------------- token ids

def vocab_len(tokenizer) -> int:
    """How many ids the tokenizer can produce: len(tokenizer), added tokens included."""
    try:
        return len(tokenizer)
    except TypeError:
        return int(tokenizer.vocab_size)


def token_id(tokenizer, token: str) -> int | None:
    """The id of `token` if the tokenizer has it as one token, else None."""
    ids = encode(tokenizer, token)
    return ids[0] if len(ids) == 1 else None


def end_of_turn_ids(fmt: ChatFormat, tokenizer) -> tuple[int, ...]:
    """Ids that end a model turn: the format's end-of-turn tokens (the first must be one token
    of this tokenizer), or for plain completion the tokenizer's eos."""
    if not fmt.end_of_turn:
        eos = getattr(tokenizer, "eos_token_id", None)
        return () if eos is None else (int(eos),)
    first = token_id(tokenizer, fmt.end_of_turn[0])
    if first is None:
        raise ValueError(
            f"chat format {fmt.name!r} ends a turn with {fmt.end_of_turn[0]}, which this "
            "tokenizer does not have as one token: the tokenizer is not of that family; set "
            f"the chat format to the model's ({', '.join(sorted(FORMATS))})")
    extra = (token_id(tokenizer, t) for t in fmt.end_of_turn[1:])
    return (first, *(i for i in extra if i is not None))


def stop_ids(fmt: ChatFormat, tokenizer, *, eos_sources: Mapping[str, Iterable[int]] = (),
             vocab_size: int | None = None) -> tuple[int, ...]:
    """Ids that end a turn: the union of the format's end-of-turn tokens, `eos_sources`
    (`hf.eos_token_ids(model_dir)`: config.json and generation_config.json) and the tokenizer's
    eos, in that order. Each is checked to exist in the vocabulary (the tokenizer's, and the
    model's `vocab_size` when given); an error names the source that is wrong."""
    sources = {f"chat format {fmt.name!r} end of turn": end_of_turn_ids(fmt, tokenizer)}
    sources.update(dict(eos_sources))
    eos = getattr(tokenizer, "eos_token_id", None)
    sources["the tokenizer's eos_token_id"] = () if eos is None else (int(eos),)
    limit = vocab_len(tokenizer)
    out: list[int] = []
    for where, ids in sources.items():
        for i in ids:
            if not 0 <= int(i) < limit:
                raise ValueError(f"{where} names token id {i}, which the tokenizer does not "
                                 f"have (it has {limit} ids): the model directory and the "
                                 "tokenizer do not belong together; fix that eos_token_id or "
                                 "use the model's own tokenizer")
            if vocab_size is not None and int(i) >= vocab_size:
                raise ValueError(f"{where} names token id {i}, past the model's vocab_size "
                                 f"{vocab_size}; fix that eos_token_id")
            if int(i) not in out:
                out.append(int(i))
    return tuple(out)


def check_vocab(tokenizer, vocab_size: int, *, what: str = "the model") -> None:
    """Every id the tokenizer produces must have an embedding: an id past the embedding table
    reads garbage (NaN logits), silently."""
    n = vocab_len(tokenizer)
    if n > vocab_size:
        raise ValueError(
            f"the tokenizer has {n} tokens (len(tokenizer), added tokens included) but "
            f"{what} has vocab_size={vocab_size}: ids {vocab_size}..{n - 1} have no embedding. "
            "Use the tokenizer saved with the model, or a model whose vocab_size (config.json "
            f"vocab_size / config.model.vocab_size) is at least {n}")


def check_ids(ids: Iterable[int], vocab_size: int, *, where: str) -> None:
    """Token ids given directly (records with prompt_ids) must fit the model's vocabulary."""
    bad = [i for i in ids if not 0 <= int(i) < vocab_size]
    if bad:
        raise ValueError(f"{where}: token ids {bad[:5]} are outside the model's vocabulary "
                         f"(vocab_size={vocab_size}); they were made with another tokenizer")


def _strip_stops(ids: Sequence[int], stop: Iterable[int]) -> list[int]:
    ids, stop = list(ids), set(stop)
    while ids and ids[-1] in stop:
        ids.pop()
    return ids


def _is_hf(tokenizer) -> bool:
    return hasattr(tokenizer, "all_special_ids")


def turn_text(tokenizer, ids: Sequence[int], stop_ids_: Iterable[int] = ()) -> str:
    """A turn's text for parsing its tool calls: special tokens kept (Llama's <|python_tag|>),
    the trailing stop tokens dropped."""
    ids = _strip_stops(ids, stop_ids_)
    if _is_hf(tokenizer):
        return tokenizer.decode(ids, skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
    return tokenizer.decode(ids)


def verifier_text(tokenizer, ids: Sequence[int], stop_ids_: Iterable[int] = ()) -> str:
    """The text a verifier judges: the turn without its trailing stop tokens and without any
    special token (an HF tokenizer's; the word tokenizer's decode drops <pad> and <eos>), and
    exactly as sampled otherwise: no clean-up of spaces (Llama 3's tokenizer_config asks for
    it, and it rewrites code: `"a ."` would become `"a."`)."""
    ids = _strip_stops(ids, stop_ids_)
    if _is_hf(tokenizer):
        return tokenizer.decode(ids, skip_special_tokens=True,
                                clean_up_tokenization_spaces=False)
    return tokenizer.decode(ids)


# ----------------------------------------------------------------------------- the check

def probe(fmt: ChatFormat, tokenizer, *, tools: Sequence = ("python",),
          closed: bool = True) -> tuple[list[int], list[int]]:
    """(ours, the template's): a conversation rendered append-only by `fmt` (prompt, a tool
    call, its result, an answer, retry feedback, a second answer) and the same conversation
    rendered whole by the tokenizer's chat template. `closed`: whether the model's turns end
    with their sampled end-of-turn token."""
    first_tool = getattr(tools[0], "name", tools[0]) if tools else ""
    call = ToolCall(first_tool, {"code": "print(1 + 2)"} if first_tool == "python" else {}) \
        if tools else None
    first = [{"role": "user", "content": "What is 1 + 2?"}]
    eot = list(end_of_turn_ids(fmt, tokenizer)[:1]) if closed else []
    ours = render_prompt(fmt, tokenizer, messages=first, tools=tools)
    whole = list(first)
    if call is not None:
        ours += encode(tokenizer, format_turn(fmt, calls=[call])) + eot
        ours += encode(tokenizer, observation(fmt, ["3\n"], closed=closed))
        whole += [{"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": call.name,
                                                        "arguments": call.arguments}}]},
                  {"role": "tool", "content": "3\n"}]
    ours += encode(tokenizer, format_turn(fmt, "The answer is 4.")) + eot
    ours += encode(tokenizer, feedback(fmt, "Wrong answer: '4'.", closed=closed))
    ours += encode(tokenizer, format_turn(fmt, "The answer is 3.")) + eot
    ours += encode(tokenizer, close_turn(fmt, closed))  # the template closes the last turn
    whole += [{"role": "assistant", "content": "The answer is 4."},
              {"role": "user", "content": fmt.retry.replace("{feedback}", "Wrong answer: '4'.")},
              {"role": "assistant", "content": "The answer is 3."}]
    text = tokenizer.apply_chat_template(whole, tools=tool_schemas(tools) or None,
                                         add_generation_prompt=False, tokenize=False)
    return ours, encode(tokenizer, text)


def check(fmt: ChatFormat, tokenizer, *, tools: Sequence = ("python",)) -> None:
    """Raises unless `fmt` appends exactly what the tokenizer's chat template writes (see
    `probe`). A plain format has no template to agree with."""
    if not fmt.uses_template:
        return
    end_of_turn_ids(fmt, tokenizer)  # a tokenizer of another family: say so, first
    try:
        ours, theirs = probe(fmt, tokenizer, tools=tools)
    except Exception as e:  # a template that cannot render tools or tool turns
        raise ValueError(f"chat format {fmt.name!r}: the tokenizer's chat template cannot "
                         f"render a conversation with tools "
                         f"{[getattr(t, 'name', t) for t in tools]} ({e})") from e
    if ours == theirs:
        return
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
              min(len(ours), len(theirs)))
    show = lambda ids: repr(tokenizer.decode(ids[max(0, at - 8):at + 8]))  # noqa: E731
    raise ValueError(
        f"chat format {fmt.name!r} does not match this tokenizer's chat template: from token "
        f"{at} the template writes {show(theirs)}, the format {show(ours)}. Use the format of "
        f"the model's family ({', '.join(sorted(FORMATS))}); 'plain' for completion")
