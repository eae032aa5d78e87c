from pathlib import Path


def test_answer():
    assert Path("/app/answer.txt").read_text().strip() == "7f3a-kiwi-42"


def test_extracted():
    files = list(Path("/app/extracted").rglob("*.txt"))
    assert len(files) == 300, f"{len(files)} files extracted"
