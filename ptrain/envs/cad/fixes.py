"""Demonstrations that use the `cad` tool to find and fix a mistake: build a script with one
dimension wrong, read the measurement against the target, answer with the right script.

A demonstration that only answers never shows the model what the tool is for (a policy SFT'd
on one-turn answers never calls it). These show the loop an episode offers, with the tool's
real output: the wrong script is built and measured in the sandbox when the tasks are made,
exactly as the tool does in an episode (`observation`).
"""

from __future__ import annotations

import dataclasses
import re

from ptrain import chat
from ptrain.envs import synthetic

# A number in a script's code (not in its import line): a dimension the mistake changes.
_NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?![\w.])")


def observation(report) -> str:
    """What the `cad` tool returns for a build (`sandbox.cad.Report`)."""
    printed = report.stdout.strip()
    return report.text + (f"\nThe script printed:\n{printed[-500:]}" if printed else "")


def mistake(code: str) -> str:
    """`code` with its largest dimension (the first largest number after the import line)
    scaled by 1.5: a script that still runs but builds a part the measurement tells apart
    (a small feature scaled can stay within a pass's IoU)."""
    head, _, body = code.partition("\n")
    spots = list(_NUMBER.finditer(body))
    if not spots:
        raise ValueError(f"no dimension to change in the script:\n{code}")
    m = max(spots, key=lambda m: float(m.group(1)))
    wrong = f"{float(m.group(1)) * 1.5:g}"
    return f"{head}\n{body[:m.start()]}{wrong}{body[m.end():]}"


def demonstration(task, tokenizer, fmt: chat.ChatFormat, tool, wrong: str,
                  seen: str, answer: str) -> dict:
    """The SFT record: a `cad` call with the `wrong` script, the tool's output `seen` (not
    trained on), then `answer` (the reference script); the prompt with the tool's schema."""
    call = chat.format_turn(fmt, calls=[chat.ToolCall("cad", {"script": wrong})])
    record = synthetic.demo_record(dataclasses.replace(task, tools=()), (call, seen, answer),
                                   tokenizer, fmt)
    record["prompt_ids"] = chat.render_prompt(fmt, tokenizer, prompt=task.prompt,
                                              messages=task.messages, tools=(tool,))
    return record
