"""Chat formats against the real Qwen2.5 / Llama 3.1 templates, token for token; stop ids,
the vocabulary check and the texts a verifier and a tool-call parser see."""

import dataclasses
import json

import pytest

transformers = pytest.importorskip("transformers", reason="pip install '.[test]'")

import hf_fixtures  # noqa: E402
from ptrain import chat, hf, rewards, tasks  # noqa: E402
from ptrain.envs import synthetic  # noqa: E402

FAMILIES = {"qwen2.5-instruct": chat.QWEN, "qwen2.5-base": chat.QWEN,
            "llama3.1-instruct": chat.LLAMA3}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, hf_dir):
    path = hf_dir(request.param)
    return request.param, FAMILIES[request.param], hf.load_tokenizer(path), path


def _whole_call(call):
    return {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _render_both(fmt, tok, system, user, turns, *, tools, closed):
    """(append-only ids, the template's ids of the whole conversation) for `turns`: ("model",
    content, calls) | ("tools", outputs) | ("feedback", text)."""
    first = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": user}]
    ours = chat.render_prompt(fmt, tok, messages=first, tools=tools)
    eot = list(chat.end_of_turn_ids(fmt, tok)[:1]) if closed else []
    whole = list(first)
    for kind, *rest in turns:
        if kind == "model":
            content, calls = rest
            ours += chat.encode(tok, chat.format_turn(fmt, content, calls)) + eot
            whole.append({"role": "assistant", "content": content,
                          **({"tool_calls": [_whole_call(c) for c in calls]} if calls else {})})
        elif kind == "tools":
            ours += chat.encode(tok, chat.observation(fmt, rest[0], closed=closed))
            whole += [{"role": "tool", "content": o} for o in rest[0]]
        else:
            ours += chat.encode(tok, chat.feedback(fmt, rest[0], closed=closed))
            whole.append({"role": "user", "content": fmt.retry.replace("{feedback}", rest[0])})
    ours += chat.encode(tok, chat.close_turn(fmt, closed))  # the template closes the last turn
    text = tok.apply_chat_template(whole, tools=chat.tool_schemas(tools) or None,
                                   tokenize=False)
    return ours, chat.encode(tok, text)


PY = chat.ToolCall("python", {"code": 'print("héllo", {"k": [1, 2]})\nprint(6 * 7)'})
WRITE = chat.ToolCall("write_file", {"path": "a/b.txt", "content": "line 1\nline \"2\"\n"})
READ = chat.ToolCall("read_file", {"path": "a/b.txt"})


@pytest.mark.parametrize("closed", [True, False], ids=["turns_end_with_eot", "stopped_early"])
def test_multi_turn_tool_episode_rendered_append_only_equals_the_template(family, closed):
    name, fmt, tok, _ = family
    several = fmt is chat.QWEN  # Hermes allows several calls per turn; Llama 3.1 one
    turns = [("model", "Let me run it." if several else "", [PY, WRITE] if several else [PY]),
             ("tools", ['héllo {"k": [1, 2]}\n42\n', "Wrote 17 bytes to a/b.txt"][:1 + several]),
             ("model", "", [READ]),
             ("tools", ['line 1\nline "2"\n']),
             ("model", "The answer is 41.", []),
             ("feedback", "Wrong answer: '41'.\nTraceback: {not json}"),
             ("model", "The answer is 42.", [])]
    ours, theirs = _render_both(fmt, tok, "You are a careful assistant.", "Compute 6 * 7.",
                                turns, tools=("python", "write_file", "read_file"),
                                closed=closed)
    assert ours == theirs, (tok.decode(ours), tok.decode(theirs))


@pytest.mark.parametrize("tools", [("python",), ()], ids=["tools", "no_tools"])
def test_probe_conversation_matches_and_check_passes(family, tools):
    _, fmt, tok, _ = family
    for closed in (True, False):
        ours, theirs = chat.probe(fmt, tok, tools=tools, closed=closed)
        assert ours == theirs
    chat.check(fmt, tok, tools=tools)


def test_prompt_is_the_templates_generation_prompt(family):
    name, fmt, tok, _ = family
    messages = [{"role": "user", "content": "Write add(a, b)."}]
    ids = chat.render_prompt(fmt, tok, messages=messages, tools=("python",))
    reference = tok.apply_chat_template(messages, tools=chat.tool_schemas(["python"]),
                                        add_generation_prompt=True, tokenize=True)
    reference = reference["input_ids"] if hasattr(reference, "keys") else reference
    assert ids == list(reference)
    assert tok.decode(ids).endswith(fmt.next_turn)
    assert "python" in tok.decode(ids)  # the tool's schema is in the prompt
    if name.startswith("llama"):  # one BOS: the template writes it, encoding adds none
        assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    # a plain prompt is wrapped in one user turn
    assert chat.render_prompt(fmt, tok, prompt="Write add(a, b).") == chat.render_prompt(
        fmt, tok, messages=messages)


def test_a_format_of_another_family_or_template_is_refused(hf_dir):
    qwen = hf.load_tokenizer(hf_dir("qwen2.5-instruct"))
    llama = hf.load_tokenizer(hf_dir("llama3.1-instruct"))
    with pytest.raises(ValueError, match=r"'llama3' ends a turn with <\|eot_id\|>.*not of "
                                         "that family"):
        chat.check(chat.LLAMA3, qwen)
    with pytest.raises(ValueError, match=r"'qwen' ends a turn with <\|im_end\|>"):
        chat.check(chat.QWEN, llama)
    # Llama 3.1's template JSON-encodes string tool results: a format that does not is wrong
    raw_results = dataclasses.replace(chat.LLAMA3, json_results=False)
    with pytest.raises(ValueError, match="does not match this tokenizer's chat template"):
        chat.check(raw_results, llama)
    # a Qwen-like template that returns results in a "tool" turn is not Qwen2.5's
    qwen.chat_template = hf_fixtures.QWEN25_TEMPLATE.replace(
        "{{- '<|im_start|>user' }}", "{{- '<|im_start|>tool' }}")
    with pytest.raises(ValueError, match=r"from token \d+ the template writes"):
        chat.check(chat.QWEN, qwen)
    qwen.chat_template = None
    with pytest.raises(ValueError, match="this tokenizer has none.*'plain' format"):
        chat.render_prompt(chat.QWEN, qwen, prompt="hi")


def test_plain_format_is_text_completion(hf_dir):
    tok = hf.load_tokenizer(hf_dir("qwen2.5-base"))
    prompt = "def add(a, b):\n    \"\"\"Add.\"\"\"\n"
    assert chat.render_prompt(chat.PLAIN, tok, prompt=prompt) == tok.encode(
        prompt, add_special_tokens=False)  # no template, no special tokens
    with pytest.raises(ValueError, match="plain completion and cannot render chat messages"):
        chat.render_prompt(chat.PLAIN, tok, messages=[{"role": "user", "content": "x"}])
    # the text the quickstart's episodes have always had
    assert chat.observation(chat.PLAIN, ["7"], closed=False) == \
        "\n<tool_response>\n7\n</tool_response>\n"
    assert chat.feedback(chat.PLAIN, "1/3 tests passed", closed=True) == \
        "\n<feedback>\n1/3 tests passed\n</feedback>\n"
    chat.check(chat.PLAIN, tok)  # nothing to agree with
    words = synthetic.WordTokenizer.for_tasks()
    assert chat.end_of_turn_ids(chat.PLAIN, words) == (synthetic.EOS,)
    assert chat.render_prompt(chat.PLAIN, words, prompt="code: x") == words.encode("code: x")


# ----------------------------------------------------------------------------- tool calls

def test_hermes_calls_parse_every_block_and_name_what_is_wrong():
    text = chat.format_turn(chat.QWEN, "First this.", [PY, READ])
    assert chat.parse_tool_calls(chat.QWEN, text) == [PY, READ]
    assert chat.parse_tool_calls(chat.QWEN, "answer: 42") == []
    assert chat.parse_tool_calls(chat.QWEN, '<tool_call>{"name": "python", "arguments": '
                                 '"{\\"code\\": \\"1\\"}"}</tool_call>') == [
        chat.ToolCall("python", {"code": "1"})]  # arguments sent as a JSON string
    [bad_json] = chat.parse_tool_calls(chat.QWEN, "<tool_call>{name: python}</tool_call>")
    assert bad_json.startswith("Error: the tool call is not valid JSON")
    [no_name] = chat.parse_tool_calls(chat.QWEN, '<tool_call>{"code": 1}</tool_call>')
    assert no_name == 'Error: a tool call is {"name": <tool>, "arguments": {...}}.'
    good, unclosed = chat.parse_tool_calls(chat.QWEN, text.rsplit("</tool_call>", 1)[0][:-1]
                                           + "\n<tool_call>{")
    assert good == PY and "not closed with </tool_call>" in unclosed


def test_llama3_calls_json_python_tag_and_builtin():
    text = chat.format_turn(chat.LLAMA3, calls=[WRITE])
    assert text.startswith('{"name": "write_file", "parameters": ')
    assert chat.parse_tool_calls(chat.LLAMA3, text) == [WRITE]
    assert chat.parse_tool_calls(chat.LLAMA3, "<|python_tag|>" + text) == [WRITE]
    assert chat.parse_tool_calls(chat.LLAMA3, '{"name": "python", "arguments": {"code": "1"}}'
                                 ) == [chat.ToolCall("python", {"code": "1"})]
    assert chat.parse_tool_calls(chat.LLAMA3, "<|python_tag|>print(6 * 7)") == [
        chat.ToolCall("python", {"code": "print(6 * 7)"})]  # the code interpreter
    assert chat.parse_tool_calls(chat.LLAMA3, '<|python_tag|>brave_search.call(query="x y")'
                                 ) == [chat.ToolCall("brave_search", {"query": "x y"})]
    assert chat.parse_tool_calls(chat.LLAMA3, "The answer is {1, 2}.") == []
    assert chat.parse_tool_calls(chat.LLAMA3, '{"a": 1}') == []  # JSON, but not a call
    [broken] = chat.parse_tool_calls(chat.LLAMA3, '{"name": "python", "parameters": {')
    assert broken.startswith("Error: the tool call is not valid JSON")
    with pytest.raises(ValueError, match="one tool call and nothing else"):
        chat.format_turn(chat.LLAMA3, "text", [PY])


# ----------------------------------------------------------------------------- stop ids

def test_stop_ids_are_the_union_of_end_of_turn_and_every_eos(hf_dir):
    base = hf_dir("qwen2.5-base")
    tok = hf.load_tokenizer(base)
    im_end, endoftext = (tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    # a base tokenizer's eos is <|endoftext|>; a chat turn still ends at <|im_end|>
    assert tok.eos_token_id == endoftext
    assert set(hf.eos_token_ids(base)["config.json eos_token_id"]) == {endoftext}
    assert chat.stop_ids(chat.QWEN, tok, eos_sources=hf.eos_token_ids(base)) == (
        im_end, endoftext)
    assert chat.stop_ids(chat.PLAIN, tok, eos_sources=hf.eos_token_ids(base)) == (endoftext,)

    llama_dir = hf_dir("llama3.1-instruct")
    llama = hf.load_tokenizer(llama_dir)
    eot, eom, end = (llama.convert_tokens_to_ids(t)
                     for t in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"))
    assert chat.stop_ids(chat.LLAMA3, llama, eos_sources=hf.eos_token_ids(llama_dir)) == (
        eot, eom, end)

    with pytest.raises(ValueError, match="generation_config.json eos_token_id names token id "
                                         "9999, which the tokenizer does not have"):
        chat.stop_ids(chat.QWEN, tok, eos_sources={"generation_config.json eos_token_id":
                                                   (9999,)})
    with pytest.raises(ValueError, match="past the model's vocab_size 100"):
        chat.stop_ids(chat.QWEN, tok, vocab_size=100)


def test_vocabulary_check_counts_added_tokens(hf_dir):
    path = hf_dir("qwen2.5-instruct")
    tok = hf.load_tokenizer(path)
    vocab_size = hf.read_config(path)["vocab_size"]
    chat.check_vocab(tok, vocab_size)  # Qwen pads its embedding past len(tokenizer)
    assert len(tok) > tok.vocab_size  # the added tokens are what a base count misses
    with pytest.raises(ValueError, match=rf"has {len(tok)} tokens \(len\(tokenizer\), added "
                                         rf"tokens included\).*vocab_size={len(tok) - 1}"):
        chat.check_vocab(tok, len(tok) - 1)
    chat.check_ids([0, vocab_size - 1], vocab_size, where="t.jsonl:3")
    with pytest.raises(ValueError, match=r"t.jsonl:3: token ids \[704\]"):
        chat.check_ids([1, 704], vocab_size, where="t.jsonl:3")


# ----------------------------------------------------------------------------- texts

def test_the_stop_token_never_reaches_a_verifier(family):
    name, fmt, tok, path = family
    stops = chat.stop_ids(fmt, tok, eos_sources=hf.eos_token_ids(path))
    task = tasks.Task("m", "math", tasks.Answer("42", numeric=True), prompt="6 * 7?")
    code = tasks.Task("c", "code", tasks.UnitTests("assert f(2) == 4\n"), prompt="f(x)")
    for text, t in (("answer: 42", task), ("def f(x):\n    return x * 2", code)):
        ids = chat.encode(tok, text) + [stops[0]]
        assert chat.verifier_text(tok, ids, stops) == text
        assert chat.verifier_text(tok, ids) == text  # special tokens go even without stops
        with_stop = tok.decode(ids)  # what was judged before: the stop token kept
        assert with_stop != text
        if t is task:
            assert rewards.verify(t, chat.verifier_text(tok, ids, stops)).passed
            assert not rewards.verify(t, with_stop).passed
    # parsing sees special tokens (Llama's <|python_tag|>) but not the stop token
    call = chat.format_turn(fmt, calls=[PY])
    ids = chat.encode(tok, ("<|python_tag|>" if fmt is chat.LLAMA3 else "") + call) + [stops[0]]
    assert chat.parse_tool_calls(fmt, chat.turn_text(tok, ids, stops)) == [PY]


def test_verifier_text_is_exactly_what_was_sampled(hf_dir):
    tok = hf.load_tokenizer(hf_dir("llama3.1-instruct"))
    tok.clean_up_tokenization_spaces = True  # as Llama 3's own tokenizer_config.json sets it
    # (transformers >= 5.x skips the clean-up for BPE unless forced; earlier versions did not)
    tok.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    code = "print('a .', \"it 's\" , 1 !=2)"
    ids = chat.encode(tok, code)
    assert tok.decode(ids) != code  # the clean-up rewrites the program
    assert chat.verifier_text(tok, ids) == chat.turn_text(tok, ids) == code


def test_texts_with_the_word_tokenizer():
    words = synthetic.WordTokenizer.for_tasks()
    stops = chat.stop_ids(chat.PLAIN, words)
    ids = words.encode("answer: 42") + [synthetic.EOS]
    assert chat.verifier_text(words, ids, stops) == "answer: 42"
    call = '<tool_call>{"name":"python","arguments":{"code":"print(1)"}}</tool_call>'
    assert chat.parse_tool_calls(chat.PLAIN, chat.turn_text(words, words.encode(call))) == [
        chat.ToolCall("python", {"code": "print(1)"})]
    assert chat.vocab_len(words) == words.vocab_size
    json.dumps(chat.tool_schemas(["python", "bash"]))  # plain data for a template
    with pytest.raises(ValueError, match=r"unknown tools \['browser'\]"):
        chat.tool_schemas(["browser"])
