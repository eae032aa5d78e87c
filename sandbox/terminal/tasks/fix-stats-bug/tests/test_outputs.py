import importlib.util
import statistics

import pytest


def load():
    spec = importlib.util.spec_from_file_location("stats", "/app/stats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("xs", [[1, 2, 3], [4, 1, 3, 2], [5, 5, 1, 9, 2, 7], [2.5]])
def test_median_matches_statistics(xs):
    assert load().median(xs) == pytest.approx(statistics.median(xs))


def test_mean():
    assert load().mean([1, 2, 3, 4]) == pytest.approx(2.5)


def test_mean_of_empty_raises_value_error():
    with pytest.raises(ValueError):
        load().mean([])
