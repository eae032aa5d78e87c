"""README, docs, comments and docstrings speak of the software, never of how it was made: no
references to the development process (a numbered work stop, the current session or wave, an
issue number as history, the people and their instructions) that a reader cannot resolve.
Scanned: README.md, docs/*.md, and the comments and docstrings of every Python file (C and
shell files whole: they are mostly comments). Benchmark measurements may be grouped in
numbered series ("series 37"): that word is allowed."""

import ast
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CODE_DIRS = ("ptrain", "sandbox", "long_context", "launch", "bench", "configs", "tests",
             "examples", "colabs")

# Each pattern names one kind of process reference; ordinary words stay legal ("stop" as a
# stop token, "a test helper", "a sandbox session", "two waves of rows").
PATTERNS = {
    "a numbered work stop": r"\bstops? \d+\b",
    "this stop / session / wave / brief": r"\bthis (?:stop|session|wave|brief)\b",
    "a wave of work": r"\b(?:(?:the|this|that) )?(?:last|next|previous|earlier) wave\b",
    "an issue number as history": r"\bissues? #?\d+\b",
    "the people who made it": r"\b(?:the lead|other helpers?|another helper)\b",
    "the task's brief": r"\bthe brief'?s?\b",
}
FLAGS = re.compile("|".join(f"(?P<p{i}>{p})" for i, p in enumerate(PATTERNS.values())),
                   re.IGNORECASE)


def _python_prose(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    source = path.read_text()
    out = [(tok.start[0], tok.string) for tok in
           tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.append((body[0].lineno, body[0].value.value))
    return out


def _texts() -> list[tuple[str, int, str]]:
    """(file, line, text) of every piece of prose the rule covers."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        out.append((str(path.relative_to(ROOT)), 1, path.read_text()))
    for d in CODE_DIRS:
        for path in sorted((ROOT / d).rglob("*")):
            rel = str(path.relative_to(ROOT))
            if not path.is_file() or "/." in "/" + rel:
                continue
            if path.suffix == ".py":
                out += [(rel, line, text) for line, text in _python_prose(path)]
            elif path.suffix in (".c", ".sh"):
                out.append((rel, 1, path.read_text()))
    return out


def find(text: str) -> list[tuple[int, str, str]]:
    """(line offset, the words, their kind) of each process reference in `text`."""
    kinds = list(PATTERNS)
    return [(text.count("\n", 0, m.start()), m.group(0), kinds[int(m.lastgroup[1:])])
            for m in FLAGS.finditer(text)]


@pytest.mark.parametrize("text, words", [
    ("the xdist worker segfaults of stops 21-24", "stops 21"),
    ("measured in this session", "this session"),
    ("Issue 15's attack classes", "Issue 15"),
    ("the lead's call", "the lead"),
    ("under the brief's 20 min", "the brief's"),
    ("done in the last wave", "the last wave"),
])
def test_the_rule_catches_process_words(text, words):
    assert [w for _, w, _ in find(text)] == [words]


@pytest.mark.parametrize("text", [
    "stop at the stop token; stop_ids=(2,); stop 'strings'", "a sandbox Session's work dir",
    "series 37, on the Intel VM", "helper functions of the test", "two waves of 32 rows",
    "a tissue 3 cm", "stops when the model's turn ends"])
def test_the_rule_leaves_ordinary_words_alone(text):
    assert find(text) == []


def test_readme_docs_comments_and_docstrings_speak_only_of_the_software():
    texts = _texts()
    assert any(f == "README.md" for f, _, _ in texts) and len(texts) > 1000  # all were read
    found = [f"{f}:{line + offset}: {words!r} ({kind})" for f, line, text in texts
             for offset, words, kind in find(text)]
    assert not found, ("describe the software, not how it was made; rewrite:\n"
                       + "\n".join(found))
