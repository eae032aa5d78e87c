"""ptrain/envs/adaptive.py: the mixture's adaptive sampler and task filter (host only, no JAX)."""

import json

import ml_collections
import numpy as np
import pytest

from ptrain import config as config_lib
from ptrain.envs.adaptive import Adaptive, TaskFilter

NAMES = ("flat", "learning", "solved", "hopeless")


def _train(mix, steps, learning_rate=0.1):
    """`learning`'s pass rate climbs each step; the others stay where they are."""
    for t in range(steps):
        mix.observe("flat", [0.5, 0.5])
        mix.observe("learning", [min(1.0, learning_rate * t)] * 2)
        mix.observe("solved", [1.0, 1.0])
        mix.observe("hopeless", [0.0, 0.0])


def test_off_is_the_normalised_weights():
    mix = Adaptive(NAMES, (1, 2, 3, 4), mode="off")
    _train(mix, 5)
    np.testing.assert_allclose(mix.probabilities(), np.array([1, 2, 3, 4]) / 10)


def test_progress_moves_to_the_environment_that_learns_with_a_floor_for_the_rest():
    mix = Adaptive(NAMES, (1, 1, 1, 1), mode="progress", fast=0.5, slow=0.05, floor=0.2)
    np.testing.assert_allclose(mix.probabilities(), 0.25)  # nothing seen: the weights
    _train(mix, 6)
    p = mix.probabilities()
    # The EMAs by their definition: flat ones never separate, the climbing one's do.
    fast = slow = 0.0
    for t in range(1, 6):
        fast += 0.5 * (0.1 * t - fast)
        slow += 0.05 * (0.1 * t - slow)
    assert mix.scores()[1] == pytest.approx(abs(fast - slow)) and mix.scores()[1] > 0
    np.testing.assert_allclose(mix.scores()[[0, 2, 3]], 0.0)
    # All of the non-floor mass to it; each other keeps floor * w_i / sum(w) exactly.
    np.testing.assert_allclose(p, [0.05, 0.05 + 0.8, 0.05, 0.05])
    assert p.sum() == pytest.approx(1.0)
    drawn = mix.draw(4000)
    assert drawn.count("learning") / 4000 == pytest.approx(0.85, abs=0.03)
    assert all(drawn.count(n) > 0 for n in NAMES)


def test_progress_explores_environments_not_yet_seen_twice():
    mix = Adaptive(NAMES, (1, 1, 1, 1), mode="progress", floor=0.2)
    for rate in (0.0, 0.5, 1.0):
        mix.observe("flat", [rate])  # separates its EMAs
    mix.observe("solved", [1.0])  # seen once: no progress measurable yet
    s = mix.scores()
    assert s[0] > 0 and s[2] == s[0] and s[1] == s[3] == s[0]  # the others' largest score
    np.testing.assert_allclose(mix.probabilities(), 0.25)


def test_band_prefers_intermediate_pass_rates():
    mix = Adaptive(NAMES, (1, 1, 1, 1), mode="band", band=(0.2, 0.8), floor=0.1)
    _train(mix, 1)  # learning at 0.0 -> out of band
    np.testing.assert_array_equal(mix.scores(), [1, 0, 0, 0])
    np.testing.assert_allclose(mix.probabilities(), [0.025 + 0.9, 0.025, 0.025, 0.025])
    assert mix.probabilities().min() > 0


def test_state_round_trip_gives_identical_draws_and_probabilities():
    a = Adaptive(NAMES, (1, 2, 1, 1), mode="progress", seed=3)
    _train(a, 5)
    a.draw(17)
    saved = json.loads(json.dumps(a.state()))  # through JSON, as a checkpoint keeps it
    b = Adaptive(NAMES, (1, 2, 1, 1), mode="progress", seed=99)
    b.load(saved)
    for _ in range(3):
        np.testing.assert_array_equal(a.probabilities(), b.probabilities())
        assert a.draw(50) == b.draw(50)
        a.observe("flat", [0.75])
        b.observe("flat", [0.75])


def test_bad_options_and_input_are_clear_errors():
    with pytest.raises(ValueError, match="mode='lp'; use one of"):
        Adaptive(NAMES, (1,) * 4, mode="lp")
    with pytest.raises(ValueError, match="3 weights for 4 environments"):
        Adaptive(NAMES, (1, 1, 1))
    with pytest.raises(ValueError, match="names repeat: \\['a'\\]"):
        Adaptive(("a", "a"), (1, 1))
    with pytest.raises(ValueError, match="weights must be finite and > 0"):
        Adaptive(("a", "b"), (1, 0))
    with pytest.raises(ValueError, match="0 < slow < fast <= 1"):
        Adaptive(("a",), (1,), fast=0.1, slow=0.2)
    with pytest.raises(ValueError, match="band must be"):
        Adaptive(("a",), (1,), band=(0.9, 0.1))
    with pytest.raises(ValueError, match="floor must be in \\(0, 1\\]"):
        Adaptive(("a",), (1,), floor=0)
    mix = Adaptive(("a",), (1,))
    with pytest.raises(ValueError, match="unknown environment 'b'"):
        mix.observe("b", [1.0])
    with pytest.raises(ValueError, match="numbers in \\[0, 1\\]"):
        mix.observe("a", [1.5])
    with pytest.raises(ValueError, match="resume with the same mixture"):
        Adaptive(("a", "b"), (1, 1)).load(mix.state())
    with pytest.raises(ValueError, match="patience must be an integer >= 1"):
        TaskFilter(0)


def test_task_filter_skips_all_pass_or_all_fail_after_patience_and_resumes():
    f = TaskFilter(patience=2)
    for key, rates in {"easy": [1, 1], "hard": [0, 0], "mixed": [1, 0.5, 1],
                       "flip": [1, 0], "once": [1]}.items():
        for r in rates:
            f.observe(key, r)
    assert [k for k in ("easy", "hard", "mixed", "flip", "once") if f.keep(k)] == [
        "mixed", "flip", "once"]
    assert f.skipped() == {"easy": "solved", "hard": "unsolved"}
    g = TaskFilter(patience=2)
    g.load(json.loads(json.dumps(f.state())))
    g.observe("once", 1)
    assert not g.keep("once") and g.skipped() == {**f.skipped(), "once": "solved"}


def test_config_section_defaults_and_checker():
    c = config_lib.defaults(closed_loop=True)
    config_lib.check(c)  # the defaults pass
    assert c.tasks.adaptive.mode == "off"
    for change, message in [({"mode": "lp"}, "tasks.adaptive: adaptive: mode='lp'"),
                            ({"floor": 1.5}, "floor must be in"),
                            ({"filter_patience": -1}, "tasks.adaptive.filter_patience=-1")]:
        bad = config_lib.defaults(closed_loop=True)
        bad.tasks.adaptive.update(change)
        with pytest.raises(ValueError, match=message.replace("(", "\\(")):
            config_lib.check(bad)
    assert isinstance(c.tasks.adaptive, ml_collections.ConfigDict)
