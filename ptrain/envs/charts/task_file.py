"""Brought chart and document questions: a JSONL file, one task a line.

    {"id": "q3-revenue",                        # optional (default: FILE:LINE)
     "images": ["pages/q3.png"],                # one or more, relative to the file
     "question": "By what percentage did revenue grow from 2022 to 2023?",
     "answer": "12.5%",                         # a number (12.5, "12.5%", "$1,234") or a name
     "tolerance": 0.05}                         # optional, absolute (judge.py's default:
                                                # half a unit of the answer's last decimal)

The question may mark where each image goes with "<image>" (as many as there are images);
without any, the images come first. A record that is wrong fails the load with FILE:LINE and
what to fix: an unknown key, no images, an image file that is missing, not an image or
truncated, an image of extreme aspect ratio (over 200:1, which the processor refuses), no
question, "<image>" marks that do not match the images, an answer that is not a string or a
number, a tolerance that is not a number >= 0, a repeated id. Images of any PIL mode load
(grayscale, palette, RGBA, CMYK ...): they are converted to RGB when the prompt is made, as
transformers' Qwen2-VL processor converts them (`ptrain.vision.image_processing.to_rgb`, RGBA
over white), and an image over the processor's pixel budget is resized within it.
"""

from __future__ import annotations

import os

from ptrain import jsonl
from ptrain.envs import task_files
from ptrain.envs.charts import judge

KEYS = ("id", "images", "question", "answer", "tolerance")
IMAGE_MARK = "<image>"


def is_charts_file(path: str) -> bool:
    """Whether a JSONL file's first record is a chart task (it has "images" and
    "question")."""
    for _, record in jsonl.records(path):
        return "images" in record and "question" in record
    return False


def read(path: str) -> list[dict]:
    """The file's tasks as dicts: id, images (absolute paths), question, expected
    (`judge.Expected`)."""
    return task_files.parsed(path, parse, KEYS, "a chart task")


def parse(record: dict, where: str, base_dir: str) -> dict:
    images = record.get("images")
    if not isinstance(images, list) or not images or not all(
            isinstance(p, str) and p for p in images):
        raise ValueError(f"{where}: give \"images\": a list of image paths relative to the "
                         f"file, got {images!r:.120}")
    images = [check_image(os.path.join(base_dir, p), where) for p in images]
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: give the task's question (a non-empty string)")
    marks = question.count(IMAGE_MARK)
    if marks and marks != len(images):
        raise ValueError(f"{where}: the question has {marks} {IMAGE_MARK} mark(s) for "
                         f"{len(images)} image(s); mark each image once, or none (images "
                         "first)")
    answer = record.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(
            answer).strip():
        raise ValueError(f"{where}: give the answer: a number (12.5, \"12.5%\", "
                         f"\"$1,234\") or a name, got {answer!r:.60}")
    answer = str(answer).strip()
    tolerance = record.get("tolerance")
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(
            tolerance, (int, float)) or not tolerance >= 0):
        raise ValueError(f"{where}: tolerance={tolerance!r} must be a number >= 0")
    kind = judge.kind_of(answer)
    if tolerance is not None and kind == "label":
        raise ValueError(f"{where}: a tolerance is for numeric answers; {answer!r} is not a "
                         "number")
    expected = judge.Expected(answer, kind,
                              None if tolerance is None else float(tolerance))
    return {"id": str(record.get("id") or where), "images": images, "question": question,
            "expected": expected}


def check_image(path: str, where: str) -> str:
    """The path of a readable image (opened and decoded whole: a truncated file fails) whose
    aspect ratio the processor takes."""
    from ptrain.vision import image_processing
    if not os.path.isfile(path):
        raise ValueError(f"{where}: image {path} does not exist")
    try:
        rgb = image_processing.to_rgb(path)
        image_processing.smart_resize(rgb.height, rgb.width)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return path


def messages(images, question: str) -> tuple[dict, ...]:
    """The chat prompt: one user message of image items and text, each image at its
    "<image>" mark (or all before the question)."""
    parts = question.split(IMAGE_MARK)
    if len(parts) == 1:
        content = [{"type": "image", "image": im} for im in images]
        content.append({"type": "text", "text": question})
    else:
        content = [{"type": "text", "text": parts[0]}] if parts[0] else []
        for im, text in zip(images, parts[1:]):
            content.append({"type": "image", "image": im})
            if text:
                content.append({"type": "text", "text": text})
    return ({"role": "user", "content": content},)
