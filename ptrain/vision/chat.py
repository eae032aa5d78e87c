"""Chat prompts with images, token for token as transformers' Qwen2.5-VL processor makes them.

The chat template writes one `<|vision_start|><|image_pad|><|vision_end|>` per image item of
a message's content (`{"type": "image", "image": ...}`); the processor then repeats the
`<|image_pad|>` of image i once per merged patch of that image (t * h * w / 4 of its grid).
`render_prompt` does the same on token ids and returns the images' patches with them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ptrain.vision.image_processing import ImageProcessing, preprocess
from ptrain.vision.layout import n_merged
from ptrain.vision.vl import VLConfig


def _is_image(item) -> bool:  # the template's own test
    return isinstance(item, dict) and (item.get("type") == "image" or "image" in item
                                       or "image_url" in item)


def message_images(messages: Sequence[dict]) -> list:
    """The images of the messages' content items, in order."""
    images = []
    for m in messages:
        content = m.get("content")
        for item in content if isinstance(content, list) else ():
            if not _is_image(item):
                continue
            if "image" not in item:
                raise ValueError("an image item needs its image under 'image' (a path, a PIL "
                                 "image or a uint8 array); URLs are not fetched")
            images.append(item["image"])
    return images


def expand_placeholders(ids: Sequence[int], grids, config: VLConfig) -> list[int]:
    """`ids` with the k-th single image token repeated once per merged patch of image k."""
    ids = list(ids)
    slots = [i for i, t in enumerate(ids) if t == config.image_token_id]
    counts = n_merged(np.zeros((0, 3)) if grids is None else grids, config.vision)
    if len(slots) != len(counts):
        raise ValueError(f"the chat template wrote {len(slots)} image placeholder(s) for "
                         f"{len(counts)} image(s)")
    out, prev = [], 0
    for slot, n in zip(slots, counts):
        out += ids[prev:slot] + [config.image_token_id] * n
        prev = slot + 1
    return out + ids[prev:]


def render_prompt(tokenizer, messages: Sequence[dict], config: VLConfig,
                  processing: ImageProcessing = ImageProcessing(), *,
                  add_generation_prompt: bool = True, **template_kw):
    """(prompt token ids, (patches, grids) or None) for chat messages whose content may hold
    image items, rendered by the tokenizer's chat template (`template_kw`: its variables,
    e.g. tools)."""
    images = message_images(messages)
    text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **template_kw)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not images:
        return expand_placeholders(ids, None, config), None
    patches, grids = preprocess(images, processing)
    return expand_placeholders(ids, grids, config), (patches, grids)
