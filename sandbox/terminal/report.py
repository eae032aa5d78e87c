"""The HTML report of an evaluation directory: one self-contained file, every value escaped.

    path = write_html("runs/eval")      # reads results.jsonl, summary.json, transcripts/
                                        # writes runs/eval/report.html

The report shows pass@1 / pass@k and the mean reward, a table per category and per task, and
each attempt's transcript (instruction, every command or model turn with its output, the
verdict, the verdict's PNG artefacts inline: a CAD render) in a collapsible section, linked
from its task's row. No script, no external style sheet, font or image file: the file opens
as it is, offline. Everything that came from a task, a model or a container (names, commands,
outputs, feedback) is HTML-escaped, so output that contains markup is shown as text, never run.

The directory is what `evaluate` (terminal tasks) and `ptrain.code_eval.evaluate` (code tasks)
write: rows with task, attempt, reward, passed, time_s, turns, tool_calls, feedback, and a
transcript per attempt whose steps are commands (`command`, `output`, `exit_code`, ...) or
model turns (`role`, `text`).
"""

import base64
import html
import json
import os

from sandbox.terminal.evaluate import read_rows, transcript_path

_CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f3f3f3}.pass{color:#070}.fail{color:#b00}
pre{background:#f7f7f7;border:1px solid #ddd;padding:6px;white-space:pre-wrap;
word-break:break-all;max-height:30em;overflow:auto;margin:.2em 0}
details{margin:.3em 0 .3em 1em}summary{cursor:pointer}.step{margin:.4em 0 .8em}
.meta{color:#666;font-size:12px}"""


# Control characters (a terminal's colour codes, NULs) are shown as \xNN, not sent.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0, 9), 11, 12, *range(14, 32), 127)}


def _e(value) -> str:
    return html.escape(str(value).translate(_CONTROL), quote=True)


def _num(x, digits=3) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else _e(x)


def _anchor(task: str, attempt) -> str:
    return "a-" + "".join(c if c.isalnum() else f"_{ord(c):x}" for c in f"{task}/{attempt}")


def _transcript(out_dir: str, task: str, attempt) -> dict | None:
    path = transcript_path(out_dir, task, attempt)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _step_html(i: int, step: dict) -> str:
    if "command" in step:  # a shell command of a terminal episode
        status = ("timed out" if step.get("timed_out") else f"exit {step.get('exit_code')}")
        extra = " (shell restarted)" if step.get("restarted") else ""
        return (f'<div class="step"><b>$</b> <code>{_e(step["command"])}</code>'
                f' <span class="meta">#{i + 1}, {_e(status)}, '
                f'{_num(step.get("duration_s", 0.0), 2)} s{extra}</span>'
                f'<pre>{_e(step.get("output", ""))}</pre></div>')
    role = step.get("role", "step")
    return (f'<div class="step"><b>{_e(role)}</b> <span class="meta">#{i + 1}</span>'
            f'<pre>{_e(step.get("text", json.dumps(step)))}</pre></div>')


def _attempt_html(out_dir: str, row: dict) -> str:
    t = _transcript(out_dir, row["task"], row["attempt"]) or {}
    cls = "pass" if row.get("passed") else "fail"
    parts = [f'<details id="{_anchor(row["task"], row["attempt"])}"><summary>'
             f'<span class="{cls}">attempt {_e(row["attempt"])}: reward '
             f'{_num(row.get("reward", 0.0))}</span> <span class="meta">'
             f'{_num(row.get("time_s", 0.0), 1)} s, {_e(row.get("turns", 0))} turns, '
             f'{_e(row.get("tool_calls", 0))} tool calls'
             f'{", agent timed out" if row.get("agent_timed_out") else ""}</span></summary>']
    if t.get("instruction"):
        parts.append(f'<details><summary>instruction</summary><pre>{_e(t["instruction"])}'
                     f'</pre></details>')
    for i, step in enumerate(t.get("steps", [])):
        parts.append(_step_html(i, step))
    if row.get("error"):
        parts.append(f'<p class="fail">error: {_e(row["error"])}</p>')
    parts.append(f'<p><b>verdict</b></p><pre>{_e(row.get("feedback", ""))}</pre>')
    verdict = t.get("verdict")
    artefacts = verdict.get("artefacts") if isinstance(verdict, dict) else None
    parts += [_image_html(p) for p in (artefacts or {}).values()
              if isinstance(p, str) and p.lower().endswith(".png")]
    if t.get("error"):
        parts.append(f'<details><summary>harness traceback</summary><pre>{_e(t["error"])}'
                     f'</pre></details>')
    parts.append("</details>")
    return "".join(parts)


def _image_html(path: str) -> str:
    """A verdict's image (a CAD render) inline, as a data: URI (up to 2 MiB)."""
    try:
        if os.path.getsize(path) > 2 << 20:
            return f'<p class="meta">{_e(path)}: too large to inline</p>'
        with open(path, "rb") as f:
            data = base64.b64encode(f.read()).decode()
    except OSError as e:
        return f'<p class="meta">{_e(path)}: {_e(e.strerror or e)}</p>'
    return (f'<p><img src="data:image/png;base64,{data}" alt="render" '
            f'style="max-width:420px;border:1px solid #ccc"></p>')


def render(out_dir: str, title: str = "") -> str:
    """The report of `out_dir` as an HTML string."""
    rows = read_rows(os.path.join(out_dir, "results.jsonl"))
    summary_path = os.path.join(out_dir, "summary.json")
    summary = {}
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
    ks = sorted((k for k in summary if k.startswith("pass@")), key=lambda k: int(k[5:]))
    title = title or f"Evaluation: {out_dir}"
    agents = sorted({str(r.get("agent", "")) for r in rows} - {""})
    total_time = sum(r.get("time_s", 0.0) for r in rows)
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
           f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>",
           f"<p>agent: {_e(', '.join(agents) or '?')}; {len(rows)} attempts of "
           f"{_e(summary.get('tasks_evaluated', len({r['task'] for r in rows})))} tasks; "
           f"{_num(total_time, 1)} s of episodes</p>",
           "<table><tr>" + "".join(f"<th>{_e(k)}</th>" for k in ks) +
           "<th>mean reward</th></tr><tr>" +
           "".join(f"<td>{_num(summary[k])}</td>" for k in ks) +
           f"<td>{_num(summary.get('mean_reward', 0.0))}</td></tr></table>"]
    categories = summary.get("categories", {})
    if categories:
        out.append("<h2>By category</h2><table><tr><th>category</th><th>tasks</th>"
                   "<th>pass@1</th></tr>")
        out += [f"<tr><td>{_e(c)}</td><td>{_e(v.get('tasks'))}</td>"
                f"<td>{_num(v.get('pass@1', 0.0))}</td></tr>" for c, v in categories.items()]
        out.append("</table>")
    by_task: dict[str, list[dict]] = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(r)
    task_stats = summary.get("tasks", {})
    out.append("<h2>By task</h2><table><tr><th>task</th><th>category</th><th>passed</th>"
               + "".join(f"<th>{_e(k)}</th>" for k in ks) +
               "<th>mean reward</th><th>mean time (s)</th><th>attempts</th></tr>")
    for name, rs in sorted(by_task.items()):
        rs.sort(key=lambda r: r["attempt"])
        st = task_stats.get(name, {})
        links = " ".join(
            f'<a class="{"pass" if r.get("passed") else "fail"}" '
            f'href="#{_anchor(name, r["attempt"])}">{_e(r["attempt"])}</a>' for r in rs)
        out.append(
            f'<tr><td><a href="#t-{_anchor(name, "")}">{_e(name)}</a></td>'
            f'<td>{_e(rs[0].get("category", ""))}</td>'
            f'<td>{sum(bool(r.get("passed")) for r in rs)}/{len(rs)}</td>'
            + "".join(f"<td>{_num(st[k]) if k in st else '-'}</td>" for k in ks) +
            f'<td>{_num(sum(r.get("reward", 0.0) for r in rs) / len(rs))}</td>'
            f'<td>{_num(sum(r.get("time_s", 0.0) for r in rs) / len(rs), 1)}</td>'
            f"<td>{links}</td></tr>")
    out.append("</table><h2>Transcripts</h2>")
    for name, rs in sorted(by_task.items()):
        out.append(f'<h3 id="t-{_anchor(name, "")}">{_e(name)}</h3>')
        out += [_attempt_html(out_dir, r) for r in rs]
    out.append("</body></html>\n")
    return "".join(out)


def write_html(out_dir: str, title: str = "") -> str:
    """Writes OUT/report.html (atomically); returns its path."""
    path = os.path.join(out_dir, "report.html")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(render(out_dir, title))
    os.replace(tmp, path)
    return path
