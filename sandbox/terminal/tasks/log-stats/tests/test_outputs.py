from collections import Counter
from pathlib import Path


def expected_lines():
    counts = Counter(line.split()[8] for line in Path("/app/access.log").read_text().splitlines())
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], int(kv[0])))
    return [f"{code} {n}" for code, n in ordered]


def test_report_exists():
    assert Path("/app/report.txt").is_file(), "/app/report.txt is missing"


def test_report_counts_and_order():
    got = Path("/app/report.txt").read_text().split("\n")
    got = [line.strip() for line in got if line.strip()]
    assert got == expected_lines()


def test_log_untouched():
    assert len(Path("/app/access.log").read_text().splitlines()) == 82
