"""A vision-language model answering chart tasks in one turn: launch.eval's `--agent=model` on
a chart task file.

    agent = model_agent(path, max_new_tokens=32, greedy=True)
    attempts = agent(items, attempt=0)          # items: [(Task, reference answer)]

`ptrain.code_eval.ModelAgent` with each prompt made by `charts.prompt` (the tokenizer's chat
template, the images converted and resized as the HF processor does, one placeholder per
merged patch) and sampled with its images (`Sampler.sample(images=...)`); the turn's text
is the answer judged.
"""

from __future__ import annotations

import json
import os


def load(path: str, *, chat_format: str = ""):
    """(model, VLConfig, tokenizer, image processing, chat format, stop ids) of a local
    Qwen2.5-VL directory; a text-only model is refused (chart tasks show images)."""
    from ptrain import chat, hf
    from ptrain.envs.terminal import agent as terminal_agent
    from ptrain.vision import hf as vhf
    with open(os.path.join(path, "config.json")) as f:
        if not vhf.is_vl(json.load(f)):
            raise ValueError(f"{path} is a text-only model: chart tasks show images and need "
                             "a vision-language model (a Qwen2.5-VL directory)")
    model, config = vhf.load(path)
    tokenizer = hf.load_tokenizer(path)
    chat.check_vocab(tokenizer, config.text.vocab_size)
    fmt = chat.get(chat_format) if chat_format else terminal_agent.detect_format(tokenizer)
    stop = chat.stop_ids(fmt, tokenizer, eos_sources=hf.eos_token_ids(path),
                         vocab_size=config.text.vocab_size)
    return model, config, tokenizer, vhf.load_image_processing(path), fmt, stop


def model_agent(path: str, *, chat_format: str = "", seed: int = 0, **how):
    """A `ptrain.code_eval.ModelAgent` of the Qwen2.5-VL directory `path` whose prompts are
    `charts.prompt`'s, sampled with their images; `how`: its sampling settings
    (max_new_tokens, temperature, greedy, batch_size)."""
    from flax import nnx
    from ptrain import code_eval
    from ptrain.envs import charts
    from ptrain.generate import sampler as sampler_lib
    model, vl_config, tokenizer, processing, fmt, stop = load(path, chat_format=chat_format)
    sampler = sampler_lib.Sampler(model, seed=seed,
                                  pad_id=getattr(tokenizer, "pad_token_id", None) or 0,
                                  decode=tokenizer.decode)
    return code_eval.ModelAgent(
        sampler, nnx.state(model), tokenizer, fmt, stop_ids=stop, seed=seed,
        prompt=lambda task: charts.prompt(task, tokenizer, vl_config, processing), **how)
