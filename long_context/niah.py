"""Needle-in-a-haystack (passkey retrieval) over context length x needle depth.

A prompt is repeated filler text with one needle sentence ("The pass key is 71432 ...") put
at a relative depth (0 = start, 1 = just before the question), then the question. Any model
plugs in through a scoring callable `score_fn(prompt, answer) -> float in [0, 1]`;
`exact_match(generate)` makes one from a `generate(prompt) -> text` sampler. Lengths are
counted by `count_tokens(text) -> int` (pass the model tokenizer's; the default counts
whitespace-separated words). Results: one row per trial, a markdown table, a heat map.
"""

import dataclasses
import json
import os

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it. ")
FILLER = ("The grass is green. ", "The sky is blue. ", "The sun is yellow. ", "Here we go. ",
          "There and back again. ")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is"


def count_words(text):
    """Default length measure: whitespace-separated words."""
    return len(text.split())


def exact_match(generate):
    """score_fn that is 1.0 when the generated text contains the answer, else 0.0."""
    return lambda prompt, answer: float(answer in generate(prompt))


@dataclasses.dataclass(frozen=True)
class Trial:
    length: int  # the asked-for length
    depth: float
    passkey: str
    prompt: str
    tokens: int  # the prompt's actual length (<= length)


def make_trial(length, depth, passkey, count_tokens=count_words):
    """The longest prompt within `length` tokens with the passkey needle at `depth`."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1]; got {depth}")
    needle = NEEDLE.format(key=passkey)

    def build(n):
        filler = [FILLER[i % len(FILLER)] for i in range(n)]
        at = round(depth * n)
        return INTRO + "".join(filler[:at]) + needle + "".join(filler[at:]) + QUESTION

    if count_tokens(build(0)) > length:
        raise ValueError(f"length {length} is too short for the intro, needle and question "
                         f"({count_tokens(build(0))} tokens)")
    lo, hi = 0, 1  # invariant: build(lo) fits; find the largest n that fits
    while count_tokens(build(hi)) <= length:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count_tokens(build(mid)) <= length else (lo, mid)
    prompt = build(lo)
    return Trial(length, depth, passkey, prompt, count_tokens(prompt))


def run_niah(score_fn, lengths, depths, *, trials=1, seed=0, count_tokens=count_words,
             out_dir=None):
    """Scores every (length, depth, trial); writes niah.jsonl/.md/.png to out_dir if given.

    Returns the rows: dicts with length, depth, trial, passkey, tokens, score.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for length in lengths:
        for depth in depths:
            for trial in range(trials):
                passkey = str(rng.integers(10_000, 100_000))
                t = make_trial(length, depth, passkey, count_tokens)
                score = float(score_fn(t.prompt, t.passkey))
                if not 0.0 <= score <= 1.0:
                    raise ValueError(f"score_fn must return a score in [0, 1]; got {score} "
                                     f"at length {length}, depth {depth}")
                rows.append(dict(length=length, depth=depth, trial=trial, passkey=passkey,
                                 tokens=t.tokens, score=score))
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "niah.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        with open(os.path.join(out_dir, "niah.md"), "w") as f:
            f.write(markdown_table(rows))
        plot_heatmap(rows, os.path.join(out_dir, "niah.png"))
    return rows


def score_grid(rows):
    """(lengths, depths, mean score [depth, length]) from the rows."""
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    total = np.zeros((len(depths), len(lengths)))
    count = np.zeros_like(total)
    for r in rows:
        i, j = depths.index(r["depth"]), lengths.index(r["length"])
        total[i, j] += r["score"]
        count[i, j] += 1
    return lengths, depths, total / np.maximum(count, 1)


def markdown_table(rows):
    """Mean score per depth (rows) and length (columns)."""
    lengths, depths, grid = score_grid(rows)
    lines = ["| depth \\ length | " + " | ".join(str(n) for n in lengths) + " |",
             "|---" * (len(lengths) + 1) + "|"]
    for depth, scores in zip(depths, grid):
        lines.append(f"| {depth:.2f} | " + " | ".join(f"{s:.2f}" for s in scores) + " |")
    return "\n".join(lines) + "\n"


def plot_heatmap(rows, path):
    """Heat map of mean score, depth down, length across; saved as PNG."""
    lengths, depths, grid = score_grid(rows)
    fig = Figure(figsize=(1.2 + 0.9 * len(lengths), 1.0 + 0.5 * len(depths)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for (i, j), score in np.ndenumerate(grid):
        ax.text(j, i, f"{score:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="score")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
