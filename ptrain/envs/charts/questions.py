"""Generated chart questions: a page of seeded numbers and a question that needs reading it
and some arithmetic, with its answer computed from the same numbers.

    generate(4, seed=0, split="train") -> [{"page", "question", "answer", "kind"}, ...]

Templates (`TEMPLATES`): on a bar chart the largest segment, the ratio of two bars (the
larger to the smaller) and the total of all bars; on a line chart the growth of a series from
one year to the next (in %) and the year a series peaks; on a table a column total, a row's
growth between two years and the ratio of two rows in a year (the larger to the smaller).
Ratios and growth are asked rounded to one decimal place.

The held-out split is held out twice: its pages are drawn from their own random stream
(seed, "heldout"), and from template parameters the training split never uses: other region,
product and cost names, other metrics and the years 2013-2022 (training: 2001-2012).
"""

from __future__ import annotations

import random

PARAMS = {
    "train": dict(
        regions=("North", "South", "East", "West", "Central", "Coast", "Valley", "Harbor"),
        products=("Alpha", "Beta", "Gamma", "Delta", "Omega", "Sigma"),
        costs=("Rent", "Staff", "Travel", "Energy", "Software", "Legal"),
        metrics=(("Revenue", "$ thousands"), ("Units sold", "units"),
                 ("Orders", "orders")),
        years=range(2001, 2013)),
    "heldout": dict(
        regions=("Nordic", "Iberia", "Alps", "Baltic", "Delta Bay", "Highlands"),
        products=("Kappa", "Lambda", "Theta", "Zeta"),
        costs=("Marketing", "Insurance", "Freight", "Training"),
        metrics=(("Sales", "$ millions"), ("Visitors", "thousands"),
                 ("Shipments", "containers")),
        years=range(2013, 2023)),
}
SPLITS = tuple(PARAMS)
KINDS = ("label", "number", "percent", "ratio")  # what an answer is (judge.py's feedback)
ROUND = "Round to one decimal place."


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}"


def _growth(a: float, b: float) -> str:
    return f"{(b - a) / a * 100:.1f}"


def bar(rng: random.Random, p: dict) -> dict:
    metric, unit = rng.choice(p["metrics"])
    regions = rng.sample(p["regions"], rng.randint(3, 5))
    values = rng.sample(range(20, 200), len(regions))  # distinct: one largest
    year = rng.choice(p["years"])
    page = {"kind": "bar", "title": f"{metric} by region, {year}", "unit": unit,
            "labels": regions, "series": {metric: values}}
    which = rng.choice(("largest", "ratio", "total"))
    if which == "largest":
        q = f"Which region had the largest {metric.lower()} in {year}?"
        return dict(page=page, question=q, answer=regions[values.index(max(values))],
                    kind="label")
    if which == "ratio":
        i, j = sorted(rng.sample(range(len(regions)), 2), key=lambda k: -values[k])
        q = (f"What is the ratio of {regions[i]}'s {metric.lower()} to {regions[j]}'s in "
             f"{year}? {ROUND}")
        return dict(page=page, question=q, answer=_ratio(values[i], values[j]), kind="ratio")
    q = f"What is the total {metric.lower()} of all regions in {year}, in {unit}?"
    return dict(page=page, question=q, answer=str(sum(values)), kind="number")


def line(rng: random.Random, p: dict) -> dict:
    metric, unit = rng.choice(p["metrics"])
    n = rng.randint(4, 6)
    start = rng.choice([y for y in p["years"] if y + n - 1 in p["years"]])
    years = list(range(start, start + n))
    names = rng.sample(p["products"], rng.randint(1, 2))
    series = {}
    for k, name in enumerate(names):  # the second series well below the first
        base = rng.randint(120, 200) if k == 0 else rng.randint(30, 80)
        series[name] = [max(5, base + rng.randint(-25, 25)) for _ in years]
        series[name][rng.randrange(n)] = max(series[name]) + rng.randint(10, 30)  # one peak
    page = {"kind": "line", "title": f"{metric} by year", "unit": unit, "labels": years,
            "series": series}
    name = rng.choice(names)
    values = series[name]
    if rng.random() < 0.6:
        i = rng.randrange(n - 1)
        q = (f"By what percentage did {metric.lower()} of {name} change from {years[i]} to "
             f"{years[i + 1]}? {ROUND}")
        return dict(page=page, question=q, answer=_growth(values[i], values[i + 1]),
                    kind="percent")
    q = f"In which year were {metric.lower()} of {name} highest?"
    return dict(page=page, question=q, answer=str(years[values.index(max(values))]),
                kind="number")


def table(rng: random.Random, p: dict) -> dict:
    unit = rng.choice(("$ thousands", "$ millions"))
    costs = rng.sample(p["costs"], rng.randint(3, 4))
    start = rng.choice([y for y in p["years"] if y + 2 in p["years"]])
    years = [start, start + 1, start + 2]
    series = {c: [rng.randint(10, 2000) for _ in years] for c in costs}
    page = {"kind": "table", "title": f"Costs by year ({unit})", "unit": unit,
            "labels": years, "series": series}
    which = rng.choice(("total", "growth", "ratio"))
    if which == "total":
        y = rng.randrange(3)
        q = f"What is the total of all costs in {years[y]}, in {unit}?"
        return dict(page=page, question=q, answer=str(sum(v[y] for v in series.values())),
                    kind="number")
    if which == "growth":
        c, y = rng.choice(costs), rng.randrange(2)
        q = f"By what percentage did {c} change from {years[y]} to {years[y + 1]}? {ROUND}"
        return dict(page=page, question=q, answer=_growth(series[c][y], series[c][y + 1]),
                    kind="percent")
    y = rng.randrange(3)
    a, b = sorted(rng.sample(costs, 2), key=lambda c: -series[c][y])
    q = f"What is the ratio of {a} to {b} in {years[y]}? {ROUND}"
    return dict(page=page, question=q, answer=_ratio(series[a][y], series[b][y]), kind="ratio")


TEMPLATES = {"bar": bar, "line": line, "table": table}


def generate(n: int, seed: int, split: str, kinds=tuple(TEMPLATES)) -> list[dict]:
    """n distinct questions (by question and page) of the page kinds `kinds`, drawn from
    (seed, split)'s stream and the split's template parameters."""
    if split not in PARAMS:
        raise ValueError(f"split {split!r}: use one of {SPLITS}")
    unknown = sorted(set(kinds) - set(TEMPLATES))
    if unknown or not kinds:
        raise ValueError(f"page kinds {list(kinds)}: use some of {list(TEMPLATES)}")
    from ptrain.envs import base
    rng = random.Random(f"charts/{seed}/{split}")
    kinds = tuple(kinds)

    def draw(i):
        return TEMPLATES[kinds[i % len(kinds)]](rng, PARAMS[split])

    return base.distinct(draw, n, key=lambda q: (q["question"], repr(q["page"])),
                         what=f"chart questions ({split})")
