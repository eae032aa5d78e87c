"""A vision-language model answering chart tasks in one turn: launch.eval's `--agent=model` on
a chart task file.

    agent = ModelAgent(*load(path), max_new_tokens=32, greedy=True)
    attempts = agent(items, attempt=0)          # items: [(Task, reference answer)]

Each prompt is made by `charts.prompt` (the tokenizer's chat template, the images converted
and resized as the HF processor does, one placeholder per merged patch), sampled with its
images (`Sampler.sample(images=...)`), and the turn's text is the answer judged.
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


class ModelAgent:
    """A VL model's single-turn answers to chart tasks, a batch of prompts at a time."""

    __name__ = "model"

    def __init__(self, model, vl_config, tokenizer, processing, fmt, stop_ids, *,
                 max_new_tokens=64, temperature=1.0, greedy=False, seed=0, batch_size=8):
        from flax import nnx
        from ptrain.generate import sampler as sampler_lib
        self.params, self.vl_config, self.tokenizer = nnx.state(model), vl_config, tokenizer
        self.processing, self.fmt, self.stop_ids = processing, fmt, tuple(stop_ids)
        self.max_new_tokens, self.temperature, self.greedy = max_new_tokens, temperature, greedy
        self.seed, self.batch_size = seed, batch_size
        self.sampler = sampler_lib.Sampler(
            model, seed=seed, pad_id=getattr(tokenizer, "pad_token_id", None) or 0,
            decode=tokenizer.decode)

    def __call__(self, items, attempt: int) -> list:
        import jax
        from ptrain import chat
        from ptrain.code_eval import Attempt
        from ptrain.envs import charts
        made = [charts.prompt(t, self.tokenizer, self.vl_config, self.processing)
                for t, _ in items]  # every bad image or prompt raises before sampling
        out = []
        for start in range(0, len(made), self.batch_size):
            part = made[start:start + self.batch_size]
            key = jax.random.fold_in(jax.random.key(self.seed * 100003 + attempt), start)
            s = self.sampler.sample(self.params, [ids for ids, _ in part],
                                    images=[im for _, im in part],
                                    max_new_tokens=self.max_new_tokens,
                                    temperature=self.temperature, greedy=self.greedy,
                                    stop_token_ids=self.stop_ids, key=key)
            for ids in s.completions():
                text = chat.verifier_text(self.tokenizer, ids, self.stop_ids)
                out.append(Attempt(text, steps=[{"role": "model", "text": text}]))
        return out
