"""Images in episodes, for a vision-language policy (`ptrain.vision.vl.VLModel`): prompts with
image items, tool observations that carry images, and the learner batch's vision arrays.

An episode's images (`Episode.images`) are the processor's output per image, (patches
[n, patch_dim], grid [3]), in the order of their placeholder runs in `Episode.tokens`: the
prompt's first, then each observation's as it is appended. The G episodes of a task share
their prompt images' arrays (one preprocessing), and the first turn samples G times from one
prefill of the prompt, its images encoded once; later turns prefill each history with all
of its images (`Sampler.sample(images=...)`).

A prompt: a task's messages may hold `{"type": "image", "image": path | bytes | PIL image |
uint8 array}` items; they are rendered by the tokenizer's chat template (with the tools'
schemas) and each `<|image_pad|>` is repeated once per merged patch of its image, as
transformers' Qwen2.5-VL processor does (`ptrain.vision.chat.render_prompt`).

An observation: a tool returns `sandbox.tools.ToolOutput(text, images)`; its result is
rendered as the chat template renders a tool message whose content is the text item then the
image items (`<|vision_start|><|image_pad|>...<|vision_end|>` after the text, inside the
format's tool-response block), the placeholder runs expanded per merged patch and inserted
as ids. Every observation of a VL policy's episode is rendered here: a tool's text that
spells an image marker (`<|image_pad|>`, printed by a program) is written without its bars
(`<image_pad>`), so only real images have placeholders. An observation cut at the episode's
room keeps only the images whose whole run fits. A turn in which the policy itself sampled
an image marker ends its episode (finish "vision_token": no prefill could take a placeholder
without an image); the learner reads the policy's own tokens as text (`attach`), as the
sampler decoded them; an answer with one is judged, never retried (`sampled_marker`).

The learner (`attach`): each row's prompt images (its group's) padded to `prompt_patches`,
and, with `observation_patches` > 0, its continuation images padded to that budget with
their places in the continuation and the continuation's M-RoPE positions (computed on the
whole history, as the sampler computed them): shapes fixed per run.

A task with images, or with a tool that declares `images=True`, given a text-only policy is
refused before generation (`check`).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence

import numpy as np

from sandbox import tools as sandbox_tools

from ptrain import chat

# An episode image: (patches float32 [n, patch_dim], grid int64 [3])
Image = tuple


@dataclasses.dataclass(frozen=True)
class Vision:
    """How a run's episodes carry images: the policy's `VLConfig`, its image processing
    (`ptrain.vision.hf.load_image_processing` of the checkpoint), and the learner's patch
    budgets per row: for the prompt's images and for the continuation's (tool observations;
    0: no image observations)."""

    config: object  # ptrain.vision.vl.VLConfig
    processing: object = None  # ptrain.vision.image_processing.ImageProcessing (default one)
    prompt_patches: int = 1024
    observation_patches: int = 0

    def __post_init__(self):
        if self.processing is None:
            from ptrain.vision.image_processing import ImageProcessing
            object.__setattr__(self, "processing", ImageProcessing())
        unit = self.config.vision.merge_unit
        for name in ("prompt_patches", "observation_patches"):
            n = getattr(self, name)
            if n < 0 or n % unit:
                raise ValueError(f"Vision.{name}={n}: a multiple of the merge unit ({unit})")


def of(sampler, vision: Vision | None) -> Vision | None:
    """The run's `Vision`: as given, or the default one of a vision-language sampler's
    model, None for a text-only one."""
    vl_config = getattr(sampler, "vl_config", None)
    if vision is not None and vl_config is None:
        raise ValueError("rollout vision settings given for a text-only policy; sample with a "
                         "vision-language model (ptrain.vision.hf.load)")
    return vision or (Vision(vl_config) if vl_config is not None else None)


def task_images(task) -> list:
    """The images of a task's prompt messages, in order (none for a task without messages:
    an environment's own task, e.g. a terminal one)."""
    from ptrain.vision.chat import message_images
    return message_images(getattr(task, "messages", None) or ())


def check(tasks, envs, vision: Vision | None) -> None:
    """Refuses, before any generation, a task with prompt images or image-returning tools
    when the policy reads text only, and image-returning tools without an observation patch
    budget."""
    for task, env in zip(tasks, envs):
        tools = [n for n in task.tools if n in {t.name for t in env.tools} and
                 getattr(env.tool(n), "images", False)]
        if vision is not None:
            if tools and not vision.observation_patches:
                raise ValueError(f"task {task.id!r} offers tools that return images "
                                 f"({', '.join(tools)}) and Vision.observation_patches is 0: "
                                 "give the run an observation patch budget")
            continue
        if task_images(task) or tools:
            what = "images in its prompt" if task_images(task) else \
                f"tools that return images ({', '.join(tools)})"
            raise ValueError(
                f"task {task.id!r} (environment {env.name!r}) has {what}, and the policy is a "
                "text-only model: sample it with a vision-language model "
                "(ptrain.vision.hf.load), or leave the images out of the tasks (an "
                "environment's image option off)")


def split(patches, grids) -> list[Image]:
    """The processor's output for several images as one (patches, grid) per image."""
    out, at = [], 0
    for grid in np.asarray(grids, np.int64).reshape(-1, 3):
        n = int(np.prod(grid))
        out.append((patches[at:at + n], grid))
        at += n
    return out


def joined(images: Sequence[Image]):
    """Images as the sampler and `prompts.prepare` take a row's: (patches, grids) or None."""
    if not images:
        return None
    return (np.concatenate([p for p, _ in images]),
            np.stack([np.asarray(g, np.int64) for _, g in images]))


def render_prompt(task, tokenizer, fmt: chat.ChatFormat, env, vision: Vision):
    """(prompt ids, images) of a task whose messages hold images: the tokenizer's chat
    template with the tools' schemas, each placeholder expanded per merged patch."""
    from ptrain.vision import chat as vision_chat
    if not fmt.uses_template or env.prompt_ids is not None:
        raise ValueError(f"task {task.id!r}: images in the prompt need a chat format with a "
                         f"template (not {fmt.name!r}) and an environment without its own "
                         "prompt_ids")
    schemas = chat.tool_schemas([env.tool(name) for name in task.tools]) or None
    ids, item = vision_chat.render_prompt(tokenizer, task.messages, vision.config,
                                          vision.processing, tools=schemas)
    return ids, split(*item)


def check_budget(task, images, vision: Vision) -> None:
    """A task's prompt images must fit `vision.prompt_patches`."""
    n = sum(len(patches) for patches, _ in images)
    if n > vision.prompt_patches:
        raise ValueError(f"task {task.id!r}: its prompt images have {n} patches, over "
                         f"Vision.prompt_patches={vision.prompt_patches}; raise the "
                         "budget or lower the image processing's max_pixels")


def sample_kwargs(rows: Sequence[Sequence[Image]], vision: Vision | None) -> dict:
    """The sampler's `images=` for these rows (nothing for a text-only policy, or when no row
    has images)."""
    if vision is None or not any(rows):
        return {}
    return {"images": [joined(r) for r in rows]}


# ----------------------------------------------------------------------------- observations

def run(config, n: int) -> list[int]:
    """An image's ids in a chat: <|vision_start|>, n image tokens, <|vision_end|>."""
    return ([config.vision_start_token_id] + [config.image_token_id] * n
            + [config.vision_end_token_id])


def observation_ids(outputs, tokenizer, fmt: chat.ChatFormat, vision: Vision, *, closed: bool,
                    patch_room: int | None = None):
    """(ids, images) of a turn's tool outputs (text or `ToolOutput`s) as the chat format
    renders them, each output's images after its text, each placeholder run expanded. An
    image the processor cannot read, or past `patch_room` patches, is not shown; its
    output's text says why (a tool's result is data, never an exception)."""
    from ptrain.vision.image_processing import preprocess
    from ptrain.vision.layout import n_merged
    texts, shown = [], []  # per output: its text, its images (processed)
    for o in outputs:
        text, mine = (o.text, list(o.images)) if isinstance(o, sandbox_tools.ToolOutput) \
            else (o, [])
        for mark in vision_ids(vision.config):  # "<|image_pad|>" printed by a program: text
            name = tokenizer.decode([mark])
            text = text.replace(name, name.replace("|", ""))
        ok = []
        for k, picture in enumerate(mine):
            try:
                (image,) = split(*preprocess([picture], vision.processing))
            except (ValueError, TypeError) as e:
                text += f"\n[image {k + 1} is not shown: {e}]"
                continue
            if patch_room is not None:
                if len(image[0]) > patch_room:
                    text += (f"\n[image {k + 1} is not shown: the episode's images would "
                             "pass the run's observation patch budget]")
                    continue
                patch_room -= len(image[0])
            ok.append(image)
        texts.append(text)
        shown.append(ok)
    if any(shown) and fmt.json_results:
        raise ValueError(f"chat format {fmt.name!r} JSON-encodes tool results; it has no "
                         "image placeholders (use 'qwen' or 'plain')")
    marker = f"\ue000{uuid.uuid4().hex}\ue001"  # where each image goes; never in the texts
    pieces = chat.observation(fmt, [t + marker * len(ok) for t, ok in zip(texts, shown)],
                              closed=closed).split(marker)
    images = [image for ok in shown for image in ok]
    counts = n_merged(np.stack([g for _, g in images]) if images else np.zeros((0, 3)),
                      vision.config.vision)
    ids = chat.encode(tokenizer, pieces[0])
    for piece, n in zip(pieces[1:], counts):
        ids += run(vision.config, n) + chat.encode(tokenizer, piece)
    return ids, images


def vision_ids(config) -> tuple[int, ...]:
    """The ids that mark images in a chat (placeholders, their start and end)."""
    return (config.image_token_id, config.video_token_id, config.vision_start_token_id,
            config.vision_end_token_id)


def sampled_marker(e) -> bool:
    """Whether a vision-language policy sampled an image marker token in the episode (it
    then takes no further turn: no observation, no retry)."""
    if getattr(e, "vision", None) is None:
        return False
    marks = set(vision_ids(e.vision.config))
    return any(m and t in marks for t, m in zip(e.tokens[e.prompt_len:], e.mask[e.prompt_len:]))


def observe(e, outputs, tokenizer, fmt, c) -> bool:
    """`turns.observe` for a vision-language policy's episode (or outputs with images):
    appends the turn's outputs (mask 0) and their images to `e.images`, cut at the
    episode's room keeping only the images whose run fits; False when the episode ends
    here. It ends, with finish "vision_token", when the policy sampled one of the image
    marker tokens itself (an image placeholder no image stands behind, which no prefill
    can take): those tokens stay in the history as text (`attach` treats model tokens so)."""
    if e.vision is None:
        raise ValueError(f"task {e.task.id!r}: a tool returned images and the policy is a "
                         "text-only model; declare the tool with images=True so that such a "
                         "run is refused before generation")
    if sampled_marker(e):
        e.finish = "vision_token"
        e.answers.append("")
        return False
    vs = e.vision.config.vision_start_token_id
    prompt_images = e.tokens[:e.prompt_len].count(vs)
    used = sum(len(p) for p, _ in e.images[prompt_images:])
    ids, images = observation_ids(outputs, tokenizer, fmt, e.vision, closed=e.closed,
                                  patch_room=e.vision.observation_patches - used)
    room = c.max_len - (len(e.tokens) - e.prompt_len)
    if len(ids) + 1 > room:  # no room left for the model to respond
        e.finish = "max_len"
        ids = ids[:room]
        ends = np.flatnonzero(np.asarray(ids) == e.vision.config.vision_end_token_id)
        starts = np.flatnonzero(np.asarray(ids) == e.vision.config.vision_start_token_id)
        images = images[:len(ends)]
        if len(starts) > len(ends):  # a run cut in its middle: cut before it
            ids = ids[:int(starts[len(ends)])]
    e.tokens += ids
    e.mask += [0] * len(ids)
    e.logp += [0.0] * len(ids)
    e.images += images
    if e.finish == "max_len":
        e.answers.append("")
        return False
    return True


# ----------------------------------------------------------------------------- the learner

def attach(batch, episodes, vision: Vision):
    """`batch` (the episodes' `to_batch` rows) with its vision arrays: each row's prompt
    images (its group's), and with `observation_patches` its continuation's images and
    M-RoPE positions (`ptrain.vision.vl.OBSERVATION_KEYS`)."""
    from ptrain.vision import layout, positions, prompts as vision_prompts
    from ptrain.vision.vl import image_dest
    config = vision.config
    prompt_rows, later_rows = [], []
    for e in episodes:
        n_prompt = sum(1 for start, _ in _runs(e, config) if start < e.prompt_len)
        prompt_rows.append(joined(e.images[:n_prompt]))
        later_rows.append(e.images[n_prompt:])
    batch = vision_prompts.with_images(batch, prompt_rows, config,
                                       n_patches=vision.prompt_patches)
    if not vision.observation_patches:
        seen = [i for i, r in enumerate(later_rows) if r]
        if seen:
            raise ValueError(f"episode {seen[0]} has images in its continuation (tool "
                             "observations) and the run's observation patch budget is 0; set "
                             "Vision.observation_patches")
        return batch
    b, n = batch.tokens_bn.shape
    rope_b3n = np.zeros((b, 3, n), np.int32)
    for r, e in enumerate(episodes):
        grids = np.stack([g for _, g in e.images]) if e.images else np.zeros((0, 3))
        rope_3t, delta = positions.mrope_positions(_placeholders(e), config.image_token_id,
                                                   grids, config.vision)
        k = len(e.tokens) - e.prompt_len
        rope_b3n[r, :, :k] = rope_3t[:, e.prompt_len:]
        rope_b3n[r, :, k:] = (len(e.tokens) + delta + np.arange(n - k))[None]  # padding
    seen = layout.make_images([joined(r) for r in later_rows], config.vision,
                              vision.observation_patches)
    dest = image_dest(np.where(batch.loss_mask_bn > 0, -1, batch.tokens_bn),
                      config.image_token_id, vision.observation_patches // config.vision.merge_unit)
    return dataclasses.replace(
        batch, vision_obs_patches_bnf=seen.patches_bnf, vision_obs_rope_hw_bn2=seen.rope_hw_bn2,
        vision_obs_full_seg_bn=seen.full_seg_bn, vision_obs_window_seg_bn=seen.window_seg_bn,
        vision_obs_dest_bm=dest, vision_rope_b3n=rope_b3n)


def _placeholders(e) -> np.ndarray:
    """The history with the policy's own tokens as -1: an image token it sampled is text
    (the sampler decoded it as one), never a placeholder."""
    return np.where(np.asarray(e.mask) > 0, -1, np.asarray(e.tokens))


def _runs(e, config):
    from ptrain.vision import positions
    grids = np.stack([g for _, g in e.images]) if e.images else np.zeros((0, 3))
    return positions.image_runs(_placeholders(e), config.image_token_id, grids, config.vision)
