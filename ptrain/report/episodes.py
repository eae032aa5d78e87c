"""The report's sample of episodes from rollouts.jsonl (`MetricsWriter.write_rollouts`): the
prompt, the model's turns with each tool call and the sandbox's answer, the verdict and its
feedback, and the images an episode record points to (a CAD render), inline.

    sample(records, per_domain=6)   # the first and the last logged step's, passed and failed
    html = episode_html(record, i)
"""

from __future__ import annotations

import base64
import os
import re

from ptrain.report.text import esc

# The chat formats' (`ptrain.chat`) tool calls, tool results and feedback within a completion.
_BLOCKS = re.compile(
    r"(?P<call><tool_call>.*?(?:</tool_call>|$))"
    r"|(?P<result><tool_response>.*?(?:</tool_response>|$)"
    r"|<\|start_header_id\|>ipython<\|end_header_id\|>.*?(?:<\|eot_id\|>|$))"
    r"|(?P<pycall><\|python_tag\|>.*?(?:<\|eom_id\|>|<\|eot_id\|>|$))"
    r"|(?P<feedback><feedback>.*?(?:</feedback>|$))", re.S)
_LABELS = {"call": ("tool call", "call"), "pycall": ("tool call", "call"),
           "result": ("sandbox", "result"), "feedback": ("feedback", "result")}
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg",
               ".svg": "image/svg+xml", ".gif": "image/gif", ".webp": "image/webp"}
MAX_IMAGE_BYTES = 2 << 20


def sample(records: list[dict], per_domain: int = 6) -> list[dict]:
    """Up to `per_domain` records of each domain from the first and the last logged step
    (half each), failures and passes alternating where both exist, in step order."""
    steps = sorted({r.get("step", 0) for r in records})
    chosen = []
    for step in dict.fromkeys((steps[0], steps[-1]) if steps else ()):
        at = [r for r in records if r.get("step", 0) == step]
        for domain in dict.fromkeys(r.get("domain") for r in at):
            mine = [r for r in at if r.get("domain") == domain]
            good = [r for r in mine if _passed(r)]
            bad = [r for r in mine if not _passed(r)]
            mixed = [r for pair in zip(bad, good) for r in pair]
            mixed += bad[len(good):] + good[len(bad):]
            chosen += mixed[:max(1, per_domain // (1 if len(steps) == 1 else 2))]
    return chosen


def _passed(record: dict) -> bool:
    return bool(record.get("passed", record.get("reward", 0) > 0))


def segments(completion: str) -> list[tuple[str, str]]:
    """(kind, text) pieces of a completion: "model" text, "call" a tool call, "result" what
    the sandbox answered (or the environment's feedback), in order."""
    out, at = [], 0
    for m in _BLOCKS.finditer(completion):
        if m.start() > at:
            out.append(("model", completion[at:m.start()]))
        out.append((m.lastgroup, m.group(0)))
        at = m.end()
    if at < len(completion):
        out.append(("model", completion[at:]))
    return [(kind, text) for kind, text in out if text.strip()]


def image_paths(record: dict) -> list[str]:
    """The image files an episode record names: artefacts {"render": path, ...}, images
    [path, ...], or image: path."""
    found = []
    artefacts = record.get("artefacts")
    if isinstance(artefacts, dict):
        found += [v for v in artefacts.values() if isinstance(v, str)]
    images = record.get("images")
    if isinstance(images, list):
        found += [v for v in images if isinstance(v, str)]
    if isinstance(record.get("image"), str):
        found.append(record["image"])
    return [p for p in found if os.path.splitext(p)[1].lower() in IMAGE_TYPES]


def image_html(path: str, root: str) -> str:
    """An <img> with the file inline as a data: URI (a relative path is under root), or a
    note why it is not shown."""
    full = path if os.path.isabs(path) else os.path.join(root, path)
    try:
        size = os.path.getsize(full)
        if size > MAX_IMAGE_BYTES:
            return f'<p class="meta">{esc(path)}: {size} bytes, not inlined</p>'
        with open(full, "rb") as f:
            data = base64.b64encode(f.read()).decode()
    except OSError as e:
        return f'<p class="meta">{esc(path)}: {esc(e.strerror or e)}</p>'
    kind = IMAGE_TYPES[os.path.splitext(full)[1].lower()]
    return (f'<figure><img src="data:{kind};base64,{data}" alt="{esc(os.path.basename(path))}">'
            f'<figcaption class="meta">{esc(path)}</figcaption></figure>')


def episode_html(record: dict, index: int, root: str, *, open_: bool = False) -> str:
    """One episode as a collapsible section (open_: shown open): its header line (step,
    domain, task, verdict), the prompt, the turns, the feedback, its images (a relative
    path is under root)."""
    passed = _passed(record)
    verdict = "passed" if passed else "failed"
    facts = [f"step {record.get('step', '?')}", str(record.get("domain") or "-"),
             str(record.get("task_id", "")), f"reward {_num(record.get('reward'))}"]
    facts += [f"{k.replace('_', ' ')} {record[k]}" for k in ("turns", "tool_calls", "finish")
              if k in record]
    parts = [f'<details class="episode" id="ep-{index}"{" open" if open_ else ""}><summary>'
             f'<span class="{"pass" if passed else "fail"}">{verdict}</span> '
             f'{esc(" · ".join(f for f in facts if f))}</summary>',
             f'<div class="role">prompt</div><pre>{esc(record.get("prompt", ""))}</pre>']
    for kind, text in segments(str(record.get("completion", ""))):
        label, css = _LABELS.get(kind, ("model", "model"))
        parts.append(f'<div class="role">{label}</div><pre class="{css}">{esc(text)}</pre>')
    feedback = record.get("feedback")
    if feedback:
        parts.append(f'<div class="role">verdict: {verdict}'
                     f'{esc(" (" + record["error_type"] + ")") if record.get("error_type") else ""}'
                     f'</div><pre class="feedback">{esc(feedback)}</pre>')
    parts += [image_html(p, root) for p in image_paths(record)]
    parts.append("</details>")
    return "".join(parts)


def _num(x) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else esc(x)
