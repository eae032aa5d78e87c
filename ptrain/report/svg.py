"""Line charts as inline SVG, drawn with the standard library (no script, no external file).

    svg = line_chart({"code": [(1, 0.2), (2, 0.5)], "arith": [...]}, title="reward",
                     y_range=(0, 1))
"""

from __future__ import annotations

import html
import math

# Distinguishable on white and for the common colour-vision deficiencies (Okabe-Ito).
COLOURS = ("#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#000000",
           "#f0e442")
WIDTH, HEIGHT = 520, 250
LEFT, RIGHT, TOP, BOTTOM = 48, 120, 28, 36  # margins: the legend sits on the right


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if raw <= m * step)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() and abs(x) >= 1 else f"{x:.3g}"


def line_chart(series: dict[str, list[tuple[float, float]]], *, title: str,
               x_label: str = "step", y_range: tuple[float, float] | None = None,
               colours: dict[str, str] | None = None) -> str:
    """One SVG element: a line per series (name -> (x, y) points, non-finite ys skipped),
    axes with ticks, the title, a legend. y_range fixes the y axis (else the data's);
    colours: a series' colour by name (the same environment alike in every chart), else
    COLOURS in turn."""
    series = {name: [(float(x), float(y)) for x, y in points if math.isfinite(float(y))]
              for name, points in series.items()}
    series = {name: points for name, points in series.items() if points}
    e = lambda s: html.escape(str(s), quote=True)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{WIDTH}" '
             f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
             f'aria-label="{e(title)}">',
             f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#fff"/>',
             f'<text x="{LEFT}" y="18" font-size="14" font-weight="bold">{e(title)}</text>']
    if not series:
        parts.append(f'<text x="{LEFT}" y="{HEIGHT // 2}" font-size="13" fill="#666">'
                     'no data</text></svg>')
        return "".join(parts)
    xs = [x for points in series.values() for x, _ in points]
    ys = [y for points in series.values() for _, y in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = y_range if y_range else (min(ys), max(ys))
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    px = lambda x: LEFT + (x - x0) / (x1 - x0) * w  # noqa: E731
    py = lambda y: TOP + (1 - (y - y0) / (y1 - y0)) * h  # noqa: E731
    for t in _ticks(y0, y1):
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + w}" y1="{py(t):.1f}" y2="{py(t):.1f}" '
                     f'stroke="#e4e4e4"/><text x="{LEFT - 6}" y="{py(t) + 4:.1f}" '
                     f'font-size="11" text-anchor="end">{_label(t)}</text>')
    for t in _ticks(x0, x1):
        parts.append(f'<text x="{px(t):.1f}" y="{TOP + h + 16}" font-size="11" '
                     f'text-anchor="middle">{_label(t)}</text>')
    parts.append(f'<rect x="{LEFT}" y="{TOP}" width="{w}" height="{h}" fill="none" '
                 f'stroke="#444"/><text x="{LEFT + w / 2:.1f}" y="{HEIGHT - 4}" font-size="11" '
                 f'text-anchor="middle">{e(x_label)}</text>')
    for i, (name, points) in enumerate(series.items()):
        colour = (colours or {}).get(name) or COLOURS[i % len(COLOURS)]
        path = " ".join(f"{px(x):.1f},{py(min(max(y, y0), y1)):.1f}" for x, y in sorted(points))
        parts.append(f'<polyline class="series" points="{path}" fill="none" '
                     f'stroke="{colour}" stroke-width="2"><title>{e(name)}</title></polyline>')
        if len(points) == 1:
            parts.append(f'<circle cx="{px(points[0][0]):.1f}" cy="{py(points[0][1]):.1f}" '
                         f'r="3" fill="{colour}"/>')
        ly = TOP + 14 + 16 * i
        parts.append(f'<line x1="{LEFT + w + 10}" x2="{LEFT + w + 28}" y1="{ly - 4}" '
                     f'y2="{ly - 4}" stroke="{colour}" stroke-width="3"/>'
                     f'<text x="{LEFT + w + 32}" y="{ly}" font-size="11">{e(name[:18])}</text>')
    parts.append("</svg>")
    return "".join(parts)
