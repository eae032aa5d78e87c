from pathlib import Path

EXPECTED = {
    "sorted/text/notes.txt": "meeting at noon\n",
    "sorted/text/todo.txt": "buy milk\n",
    "sorted/data/numbers.csv": "a,b\n1,2\n",
    "sorted/data/people.csv": "name,age\nann,31\n",
    "sorted/logs/service.log": "started\nstopped\n",
}


def test_sorted_files_moved_with_contents():
    for rel, content in EXPECTED.items():
        path = Path("/app") / rel
        assert path.is_file(), f"{path} is missing"
        assert path.read_text() == content, f"{path} has changed"


def test_inbox_keeps_only_other_files():
    left = sorted(p.name for p in Path("/app/inbox").iterdir())
    assert left == ["README.md", "run.sh"], f"/app/inbox holds {left}"
