import csv
import re
from pathlib import Path


def test_total_has_two_decimals():
    text = Path("/app/total.txt").read_text().strip()
    assert re.fullmatch(r"-?\d+\.\d\d", text), f"not a number with two decimals: {text!r}"


def test_total_is_the_sum():
    with open("/app/sales.csv", newline="") as f:
        want = sum(float(r["amount"]) for r in csv.DictReader(f))
    got = float(Path("/app/total.txt").read_text())
    assert abs(got - want) < 0.005, f"total {got}, want {want:.2f}"
