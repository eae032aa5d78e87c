"""The documents-and-charts environment: a report page (bar chart, line chart or table of known
numbers) shown as an image, a question that needs reading it and some arithmetic, the answer
judged numerically (docs/charts.md).

    dict(env="ptrain.envs.charts:make", args=dict(n_train=200, n_heldout=40))
    dict(env="ptrain.envs.charts:make", args=dict(train="train.jsonl", heldout="held.jsonl"))

Tasks: generated (`questions.py`: seeded numbers, pages drawn by `pages.py` into the run's
work dir, a held-out split by seed and by template parameters), or brought task files
(`task_file.py`: image paths, question, answer, tolerance). A task's prompt is chat messages
whose user content holds `{"type": "image", "image": PATH}` items and the question, the form
`ptrain.vision.chat.render_prompt` reads (`prompt` here). The verifier (`judge.py`) reads the
value after "Answer:" with one parser and compares it within a tolerance; the feedback says
what form was expected, never the value.

Demonstrations: with a vision-language policy (`Context.vision`), each training task answered
with its reference answer (`demonstration`: the image prompt's ids, the answer, the image
paths), the closed loop's SFT records.

A vision task needs a vision-language model: `prompt` without one raises, and the rollouts
refuse a task with images for a text-only policy before anything is generated
(`ptrain.rollout.images.check`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from ptrain import rewards
from ptrain.envs import base
from ptrain.envs.charts import judge, pages, questions, task_file
from ptrain.envs.verdict import Verdict
from ptrain.tasks import Task

NAME = "charts"
INSTRUCTION = "Read the page and end your reply with a line 'Answer: <value>'."


def answer_text(task: Task) -> str:
    """The reference answer in the form the verifier reads (the oracle's and the
    demonstrations')."""
    return f"Answer: {task.verifier.answer}"


def images(task: Task) -> list:
    """The task's images (paths or arrays), in prompt order."""
    from ptrain.vision import chat
    return chat.message_images(task.messages)


def _task(tid: str, image_paths, question: str, expected: judge.Expected, **metadata) -> Task:
    return Task(id=tid, domain=NAME, verifier=expected,
                messages=task_file.messages(image_paths, f"{question}\n{INSTRUCTION}"),
                metadata=dict(metadata))


def page_path(out_dir: str, page: dict, width_px: int, height_px: int) -> str:
    """Where a page is drawn: named by a hash of its data and size (drawn once)."""
    key = hashlib.sha256(json.dumps([page, width_px, height_px], sort_keys=True).encode())
    return os.path.join(out_dir, f"{key.hexdigest()[:16]}.png")


def generated(n: int, seed: int, split: str, out_dir: str, *, kinds=tuple(questions.TEMPLATES),
              width_px: int = 448, height_px: int = 336) -> list[Task]:
    """n generated tasks of `split`, their pages drawn under out_dir."""
    out = []
    for i, q in enumerate(questions.generate(n, seed, split, kinds)):
        path = page_path(out_dir, q["page"], width_px, height_px)
        if not os.path.exists(path):
            pages.render(q["page"], path, width_px=width_px, height_px=height_px)
        out.append(_task(f"{split}/{NAME}/{i}", [path], q["question"],
                         judge.Expected(q["answer"], q["kind"]), page=q["page"]))
    return out


def brought(path: str) -> list[Task]:
    """A task file's tasks (`task_file.py`)."""
    return [_task(t["id"], t["images"], t["question"], t["expected"])
            for t in task_file.read(path)]


def text_only_error(task) -> ValueError:
    return ValueError(
        f"task {task.id} shows {len(images(task))} image(s): a vision task needs a "
        "vision-language model (a Qwen2.5-VL checkpoint, ptrain.vision.hf.load) and its "
        "prompt made by ptrain.envs.charts.prompt; a text-only model cannot be given it")


def prompt(task: Task, tokenizer, vl_config, processing=None):
    """(prompt token ids, (patches, grids)) of a task for a vision-language model
    (`ptrain.vision.chat.render_prompt` with the tokenizer's chat template): the images
    converted to RGB and resized within the pixel budget as the HF processor does. Raises
    for a text-only model (`vl_config` None)."""
    if vl_config is None:
        raise text_only_error(task)
    from ptrain.vision import chat, image_processing
    return chat.render_prompt(tokenizer, task.messages, vl_config,
                              processing or image_processing.ImageProcessing())


def demonstration(task: Task, tokenizer, fmt, vl_config, processing=None) -> dict:
    """The SFT record of a task answered with its reference answer: the image prompt's ids
    (`prompt`), the answer's ids ending with the chat format's end-of-turn token (trained
    on), and the prompt's images (`images`: paths) for an SFT batch that carries them."""
    from ptrain import chat
    ids, _ = prompt(task, tokenizer, vl_config, processing)
    completion = chat.encode(tokenizer, answer_text(task)) + list(
        chat.end_of_turn_ids(fmt, tokenizer)[:1])
    return {"prompt_ids": ids, "completion_ids": completion,
            "completion_mask": [1] * len(completion), "domain": task.domain,
            "images": [str(p) for p in images(task)]}


def make(n_train: int = 200, n_heldout: int = 40, *, train: str = "", heldout: str = "",
         kinds: tuple = (), width_px: int = 448, height_px: int = 336,
         pages_dir: str = "", demonstrations: bool = True) -> base.Environment:
    """The charts environment. Tasks: generated (`kinds`: page kinds of
    `questions.TEMPLATES`, () all; pages of width_px x height_px drawn under `pages_dir`,
    default the environment's directory of the run's work dir, /pages), or the task files
    `train` and `heldout` (both). demonstrations: the training tasks' reference answers as
    SFT records, when the run's policy is a vision-language model (`Context.vision`)."""
    if bool(train) != bool(heldout):
        raise ValueError("give both task files, train and heldout, or neither (generated)")
    unknown = sorted(set(kinds) - set(questions.TEMPLATES))
    if unknown:
        raise ValueError(f"unknown page kinds {unknown}; known: {list(questions.TEMPLATES)}")
    if min(width_px, height_px) < 28:
        raise ValueError(f"pages of {width_px}x{height_px} pixels: give at least 28 a side")

    def tasks(ctx: base.Context) -> base.Splits:
        if train:
            splits = [brought(path) for path in (train, heldout)]
            key = [{json.dumps(t.messages) for t in s} for s in splits]
            if key[0] & key[1]:
                raise ValueError(f"{heldout}: {len(key[0] & key[1])} held-out tasks are also "
                                 f"in {train}")
        else:
            out_dir = pages_dir or os.path.join(ctx.workdir, "pages")
            splits = [generated(n, ctx.seed, split, out_dir, kinds=kinds or tuple(
                questions.TEMPLATES), width_px=width_px, height_px=height_px)
                      for n, split in ((n_train, "train"), (n_heldout, "heldout"))]
        splits = [[dataclasses.replace(t, domain=ctx.name) for t in s] for s in splits]
        demos = []
        if demonstrations and ctx.vision is not None:
            demos = [demonstration(t, ctx.tokenizer, ctx.fmt, ctx.vision.config,
                                   ctx.vision.processing) for t in splits[0]]
        return base.Splits(splits[0], splits[1], demos)

    def verify(tasks_, answers, *, sessions=None, pool=None,
               config: rewards.RewardConfig = rewards.RewardConfig()) -> list[Verdict]:
        del sessions, pool, config  # judged on the host from the answer's text
        return [judge.judge(t.verifier, a) for t, a in zip(tasks_, answers)]

    return base.Environment(name=NAME, tasks=tasks, verify=verify,
                            turns=base.TurnPolicy(retries=True))
