"""The run report: one self-contained HTML file a person opens to see a run at a glance.

    path = write_report("runs/quickstart")   # writes runs/quickstart/report.html

For a training run's work dir (`ptrain.closed_loop.run` writes it when the run ends, and any
finished work dir can be reported again: `python -m launch.report WORKDIR`):
  held-out results  per environment, each stage's evaluation side by side (the brought model,
                    after SFT, after RL) and the change, from eval.jsonl (`ptrain.eval_rows`)
  curves            training reward and pass@1 per environment, and the SFT loss, from
                    metrics.jsonl (and sft/metrics.jsonl), drawn as inline SVG (`svg`)
  episodes          a sample of rollouts.jsonl: the prompt, the model's turns with each tool
                    call and the sandbox's answer, the verdict and its feedback, the images a
                    record names (a CAD render) inline (`episodes`)
For an evaluation's output directory (results.jsonl: `launch.eval`) the report is
`sandbox.terminal.report`'s: pass@k, a table per task, each attempt's transcript.

No script, no external style sheet, font or image: the file opens as it is, offline. Every
piece of text that came from a task, a model or the sandbox is HTML-escaped (`text.esc`), so
output that contains markup is shown as text, never run. Written with the standard library.
"""

from __future__ import annotations

import datetime
import logging
import os

from ptrain import jsonl
from ptrain.report import episodes as episodes_lib
from ptrain.report import svg
from ptrain.report.text import esc

log = logging.getLogger("ptrain.report")

NAME = "report.html"
STAGES = ("base", "sft", "rl")  # eval.jsonl's stages, in the order a run reaches them
STAGE_NAMES = {"base": "brought model", "sft": "after SFT", "rl": "after RL"}

_CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222;
padding:0 1em}h1{font-size:22px}h2{font-size:18px;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0 1.2em}td,th{border:1px solid #bbb;padding:4px 10px;
text-align:right}th{background:#e8e8e8}td:first-child,th:first-child{text-align:left}
.up{color:#070}.down{color:#b00}.pass{color:#070;font-weight:bold}.fail{color:#b00;
font-weight:bold}.meta{color:#666;font-size:12px}.charts{display:flex;flex-wrap:wrap;gap:12px}
.chart{border:1px solid #ddd}pre{background:#f6f6f6;border:1px solid #ddd;padding:6px;
white-space:pre-wrap;word-break:break-word;max-height:28em;overflow:auto;margin:.15em 0 .5em}
pre.call{background:#eef4fb;border-color:#9bbbe0}pre.result{background:#f3f8ee;
border-color:#a9c98f}pre.feedback{background:#fdf3e7;border-color:#e0b77a}
.role{font-size:12px;color:#555;margin-top:.4em}details.episode{border:1px solid #ddd;
margin:.4em 0;padding:.3em .6em}summary{cursor:pointer}img{max-width:420px;border:1px solid #ccc}
figure{margin:.4em 0}"""


def write_report(workdir: str, *, title: str = "") -> str:
    """Writes <workdir>/report.html (see the module docstring); returns its path."""
    workdir = os.fspath(workdir)
    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"{workdir}: no such directory (a run's work dir or an "
                                "evaluation's --out)")
    has = lambda name: os.path.exists(os.path.join(workdir, name))  # noqa: E731
    if has("results.jsonl") and not (has("metrics.jsonl") or has("eval.jsonl")):
        from sandbox.terminal import report as eval_report
        return eval_report.write_html(workdir, title=title)
    if not (has("metrics.jsonl") or has("eval.jsonl") or has("rollouts.jsonl")):
        raise FileNotFoundError(f"{workdir}: neither a training run's work dir (metrics.jsonl, "
                                "eval.jsonl, rollouts.jsonl) nor an evaluation's output "
                                "(results.jsonl)")
    path = os.path.join(workdir, NAME)
    page = render(workdir, title or os.path.basename(os.path.abspath(workdir)))
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, path)
    return path


def write_report_quietly(workdir: str, **kwargs) -> str | None:
    """`write_report` for the end of a run: a failure is logged, never raised (the run's
    results stay what they are); returns the path, or None."""
    try:
        path = write_report(workdir, **kwargs)
    except Exception:  # noqa: BLE001 - a report must never fail the run it reports
        log.exception("the run report of %s was not written", workdir)
        return None
    log.info("run report: %s", path)
    return path


def render(workdir: str, title: str) -> str:
    """The page of a training run's work dir."""
    evals = jsonl.read(os.path.join(workdir, "eval.jsonl"))
    rows = jsonl.read(os.path.join(workdir, "metrics.jsonl"))
    sft_rows = jsonl.read(os.path.join(workdir, "sft", "metrics.jsonl"))
    rollouts = jsonl.read(os.path.join(workdir, "rollouts.jsonl"))
    command = _last_command(os.path.join(workdir, "command.txt"))
    chosen = episodes_lib.sample(rollouts)
    body = [f"<h1>{esc(title)}</h1>",
            f'<p class="meta">{esc(os.path.abspath(workdir))} · written '
            f'{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC'
            + (f" · <code>{esc(command)}</code>" if command else "") + "</p>",
            '<h2 id="heldout">Held-out results per environment</h2>', heldout_tables(evals),
            '<h2 id="curves">Training curves</h2>', charts(rows, sft_rows),
            f'<h2 id="episodes">Episodes ({len(chosen)} of {len(rollouts)} logged)</h2>',
            '<p class="meta">From rollouts.jsonl: the first and the last logged step, per '
            "environment, failures and passes. Click an episode to open it.</p>"]
    body += [episodes_lib.episode_html(r, i, workdir, open_=i == 0)
             for i, r in enumerate(chosen)]
    if not chosen:
        body.append("<p>No episodes logged (rollouts.jsonl is empty or absent).</p>")
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>{esc(title)}: ptrain run report</title><style>{_CSS}</style></head>"
            f"<body>{''.join(body)}</body></html>\n")


def heldout_tables(evals: list[dict]) -> str:
    """A table per decoding (greedy, sample): a row per environment, a column per evaluation
    (stage and step, in run order) with pass@1 (and the largest pass@k), and the change from
    the first evaluation to the last."""
    if not evals:
        return "<p>No held-out evaluation yet (eval.jsonl is empty or absent).</p>"
    out = []
    for decoding in dict.fromkeys(r.get("decoding", "greedy") for r in evals):
        mine = [r for r in evals if r.get("decoding", "greedy") == decoding]
        columns = sorted({(r["stage"], r["step"]) for r in mine}, key=_run_order)
        domains = list(dict.fromkeys(r["domain"] for r in mine))
        cell = {(r["domain"], r["stage"], r["step"]): r for r in mine}
        head = "".join(f"<th>{esc(STAGE_NAMES.get(s, s))}<br><span class=meta>step "
                       f"{esc(step)}</span></th>" for s, step in columns)
        lines = [f"<h3>{esc(decoding)} decoding</h3><table class=heldout><tr><th>environment"
                 f"</th>{head}{'<th>change</th>' if len(columns) > 1 else ''}</tr>"]
        for d in domains:
            values = [cell.get((d, s, step)) for s, step in columns]
            tds = "".join(f"<td>{_pass_cell(r)}</td>" for r in values)
            rates = [_pass_rate(r) for r in values if r is not None]
            if len(columns) > 1:
                delta = rates[-1] - rates[0] if len(rates) > 1 else None
                tds += ("<td>–</td>" if delta is None else
                        f'<td class="{"up" if delta > 0 else "down" if delta < 0 else ""}">'
                        f"{delta:+.3f}</td>")
            lines.append(f"<tr><td>{esc(d)}</td>{tds}</tr>")
        out.append("".join(lines) + "</table>")
    return "".join(out) + ('<p class="meta">pass@1 on the held-out split (n tasks); with '
                           "sampling also the largest pass@k measured.</p>")


def _pass_cell(row: dict | None) -> str:
    if row is None:
        return "–"
    ks = sorted((int(k[5:]), v) for k, v in row.items() if k.startswith("pass@") and k[5:]
                .isdigit() and k != "pass@1")
    extra = f" · pass@{ks[-1][0]} {ks[-1][1]:.3f}" if ks else ""
    n = esc(row.get("n", "?"))
    return f"{_pass_rate(row):.3f}{esc(extra)} <span class=meta>(n={n})</span>"


def _pass_rate(row: dict) -> float:
    return float(row.get("pass_rate", row.get("pass@1", 0.0)))


def _run_order(column: tuple) -> tuple:
    """(stage, step) columns in the order a run reaches them: base, sft, rl, then others."""
    stage, step = column
    return (STAGES.index(stage) if stage in STAGES else len(STAGES), stage, step)


def charts(rows: list[dict], sft_rows: list[dict]) -> str:
    """The reward and pass@1 curves of RL per environment, and the SFT loss."""
    from ptrain import metrics
    domains = list(dict.fromkeys(
        split[0] for r in rows for k in r if (split := metrics.split_domain_key(k))))
    series = lambda key: [(r["step"], r[key]) for r in rows  # noqa: E731
                          if isinstance(r.get(key), (int, float))]
    reward = {"all": series("reward/mean"), **{d: series(f"reward/{d}/mean") for d in domains}}
    passed = {d: series(f"episode/{d}/passed") for d in domains}
    colours = {name: svg.COLOURS[i % len(svg.COLOURS)] for i, name in enumerate(reward)}
    out = [svg.line_chart(reward, title="RL reward (mean per step)", x_label="RL step",
                          colours=colours),
           svg.line_chart(passed, title="RL pass@1 per environment", x_label="RL step",
                          y_range=(0.0, 1.0), colours=colours)]
    loss = [(r["step"], r["sft/loss"]) for r in sft_rows if isinstance(r.get("sft/loss"),
                                                                         (int, float))]
    if loss:
        out.append(svg.line_chart({"loss": loss}, title="SFT loss", x_label="SFT step"))
    return f'<div class="charts">{"".join(out)}</div>'


def _last_command(path: str) -> str:
    """The last command line in command.txt (`ptrain.run_record`: a comment line, then the
    command, per start of the run)."""
    try:
        with open(path) as f:
            lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    except OSError:
        return ""
    return lines[-1] if lines else ""
