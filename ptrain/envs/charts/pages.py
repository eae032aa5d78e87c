"""Report pages drawn with matplotlib (Agg): a bar chart, a line chart or a table of known
numbers, every value written on the page so that a reader can read it exactly.

    page = {"kind": "bar", "title": "Revenue by region, 2019", "unit": "$ thousands",
            "labels": ["North", "South", "East"], "series": {"Revenue": [120, 95, 143]}}
    render(page, "page.png", width_px=448, height_px=336)

`kind` "bar": one bar per label with its value above it (the y axis from 0); "line": one
line per series over the labels (years), each point labelled with its value; "table": a
table whose rows are the series and whose columns are the labels. The page is the same
bytes for the same page and size: the matplotlib-bundled DejaVu Sans font file, a fixed DPI,
no timestamp or software name in the PNG.
"""

from __future__ import annotations

import os

DPI = 100
BAR_COLOR = "#1f77b4"  # every bar's face colour (tests find the bars by it)
LINE_COLORS = ("#1f77b4", "#d62728", "#2ca02c")
KINDS = ("bar", "line", "table")


def _font(size: float):
    import matplotlib
    from matplotlib.font_manager import FontProperties
    return FontProperties(fname=os.path.join(matplotlib.get_data_path(), "fonts", "ttf",
                                             "DejaVuSans.ttf"), size=size)


def check(page: dict) -> None:
    """A page's data: a known kind, labels, and series of numbers one per label."""
    if page.get("kind") not in KINDS:
        raise ValueError(f"page kind {page.get('kind')!r}: use one of {KINDS}")
    labels, series = page.get("labels") or [], page.get("series") or {}
    if not labels or not series:
        raise ValueError("a page needs labels and at least one series")
    for name, values in series.items():
        if len(values) != len(labels):
            raise ValueError(f"series {name!r} has {len(values)} values for {len(labels)} "
                             "labels")
    if page["kind"] == "bar" and len(series) != 1:
        raise ValueError("a bar page draws one series")
    if page["kind"] == "line" and len(series) > len(LINE_COLORS):
        raise ValueError(f"a line page draws at most {len(LINE_COLORS)} series")


def figure(page: dict, width_px: int, height_px: int):
    """The matplotlib Figure of a page (not yet saved): tests read its artists back."""
    from matplotlib.figure import Figure
    check(page)
    fig = Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI)
    small = max(5.0, height_px / 48)
    title = _font(small * 1.15)
    text = _font(small)
    labels = [str(x) for x in page["labels"]]
    series = page["series"]
    unit = page.get("unit", "")
    if page["kind"] == "table":
        ax = fig.add_axes((0.02, 0.02, 0.96, 0.8))
        ax.set_axis_off()
        cells = [[name] + [f"{v:,}" for v in values] for name, values in series.items()]
        table = ax.table(cellText=cells, colLabels=[unit] + labels, loc="upper center",
                         cellLoc="center")
        table.auto_set_font_size(False)
        for cell in table.get_celld().values():
            cell.get_text().set_fontproperties(text)
        table.scale(1.0, 1.4)
        fig.text(0.5, 0.93, page.get("title", ""), ha="center", va="center",
                 fontproperties=title)
        return fig
    ax = fig.add_axes((0.16, 0.16, 0.8, 0.68))
    ax.set_title(page.get("title", ""), fontproperties=title)
    ax.set_ylabel(unit, fontproperties=text)
    x = list(range(len(labels)))
    top = max(max(v) for v in series.values())
    if page["kind"] == "bar":
        values = next(iter(series.values()))
        ax.bar(x, values, width=0.6, color=BAR_COLOR, linewidth=0)
        for xi, v in zip(x, values):
            ax.text(xi, v + top * 0.02, f"{v:,}", ha="center", va="bottom",
                    fontproperties=text)
        ax.set_ylim(0, top * 1.18)
    else:
        span = top - min(min(v) for v in series.values()) + 1
        for i, ((name, values), color) in enumerate(zip(series.items(), LINE_COLORS)):
            ax.plot(x, values, marker="o", markersize=3, color=color, label=name)
            for xi, v in zip(x, values):  # the first series' labels above, the others' below
                ax.text(xi, v + (0.04 if i == 0 else -0.04) * span, f"{v:,}", ha="center",
                        va="bottom" if i == 0 else "top", color=color, fontproperties=text)
        bottom = min(min(v) for v in series.values())
        ax.set_ylim(max(0, bottom - (top - bottom) * 0.3 - 1), top + (top - bottom) * 0.3 + 1)
        if len(series) > 1:
            ax.legend(prop=text, loc="lower right", frameon=False)
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontproperties=text)
    for tick in ax.get_yticklabels():
        tick.set_fontproperties(text)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig


def render(page: dict, path: str, *, width_px: int = 448, height_px: int = 336) -> str:
    """Draws the page into a PNG at `path` (its directory made); returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    fig = figure(page, width_px, height_px)
    FigureCanvasAgg(fig)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    fig.savefig(tmp, format="png", dpi=DPI, metadata={"Software": None})
    os.replace(tmp, path)
    return path
