"""Needle-in-a-haystack: prompt construction, scoring grid, table and heat map."""

import json
import re

import matplotlib.image
import numpy as np
import pytest

from long_context import niah


def _needle_word_fraction(prompt):
    """Where the needle sits among the filler words (0 = first, 1 = last)."""
    words = prompt.split()
    start = len(niah.INTRO.split())
    end = len(words) - len(niah.QUESTION.split())
    at = next(i for i, w in enumerate(words) if w == "pass" and words[i + 1] == "key")
    filler = end - start - len(niah.NEEDLE.split())
    return (at - 1 - start) / filler


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_prompt_fills_length_and_puts_needle_at_depth(depth):
    trial = niah.make_trial(1000, depth, "71432")
    words = len(trial.prompt.split())
    assert trial.tokens == words
    assert 990 <= words <= 1000  # one filler sentence is at most 4 words
    assert trial.prompt.count("71432") == 2
    assert trial.prompt.endswith(niah.QUESTION)
    assert abs(_needle_word_fraction(trial.prompt) - depth) < 0.01


def test_length_is_measured_by_the_given_tokenizer():
    trial = niah.make_trial(3000, 0.5, "123", count_tokens=len)  # characters
    assert 2970 <= len(trial.prompt) <= 3000 and trial.tokens == len(trial.prompt)


def _window_model(window):
    """A 'model' that only sees the last `window` words: it finds the key if it sees it."""

    def generate(prompt):
        seen = " ".join(prompt.split()[-window:])
        match = re.search(r"The pass key is (\d+)\.", seen)
        return match.group(1) if match else "I do not know."

    return generate


def test_grid_reflects_what_the_model_can_see(tmp_path):
    lengths, depths = [100, 250, 1000, 2000], [0.0, 0.5, 1.0]
    rows = niah.run_niah(niah.exact_match(_window_model(300)), lengths, depths, trials=2,
                         seed=0, out_dir=str(tmp_path))
    assert len(rows) == len(lengths) * len(depths) * 2
    assert len({r["passkey"] for r in rows}) > 1
    _, _, grid = niah.score_grid(rows)
    expected = np.array([[1, 1, 0, 0],    # depth 0: lost beyond the 300-word window
                         [1, 1, 0, 0],    # depth 0.5: 500+ words back at length 1000
                         [1, 1, 1, 1]])   # depth 1: always just before the question
    np.testing.assert_array_equal(grid, expected)

    lines = (tmp_path / "niah.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == rows
    table = (tmp_path / "niah.md").read_text().splitlines()
    assert table[0] == "| depth \\ length | 100 | 250 | 1000 | 2000 |"
    assert table[2] == "| 0.00 | 1.00 | 1.00 | 0.00 | 0.00 |"
    assert table[4] == "| 1.00 | 1.00 | 1.00 | 1.00 | 1.00 |"
    png = tmp_path / "niah.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(str(png))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 200


def test_repeated_runs_with_a_seed_agree():
    score = niah.exact_match(_window_model(50))
    assert niah.run_niah(score, [200], [0.5], trials=3, seed=7) == niah.run_niah(
        score, [200], [0.5], trials=3, seed=7)


@pytest.mark.parametrize("kwargs,message", [
    (dict(depths=[1.5]), "depth must be in"),
    (dict(lengths=[20]), "too short"),
    (dict(score_fn=lambda prompt, answer: 2.0), "score in"),
])
def test_bad_input_says_what_to_fix(kwargs, message):
    args = dict(score_fn=lambda prompt, answer: 1.0, lengths=[200], depths=[0.5]) | kwargs
    with pytest.raises(ValueError, match=message):
        niah.run_niah(args.pop("score_fn"), **args)
