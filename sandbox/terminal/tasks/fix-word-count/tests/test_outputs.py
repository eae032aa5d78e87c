import os
import subprocess


def run(path):
    return subprocess.run(["/app/wordcount.sh", path], capture_output=True, text=True,
                          timeout=10)


def test_executable():
    assert os.access("/app/wordcount.sh", os.X_OK), "/app/wordcount.sh is not executable"


def test_counts_words(tmp_path):
    sample = tmp_path / "sample.txt"
    sample.write_text("the quick brown fox\njumps over\n\nthe lazy dog\n")
    r = run(str(sample))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "9"


def test_file_name_with_spaces(tmp_path):
    sample = tmp_path / "two words.txt"
    sample.write_text("a b c\n")
    assert run(str(sample)).stdout.strip() == "3"
