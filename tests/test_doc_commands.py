"""The shell commands of README.md and docs/*.md stay true to the code.

Every fenced shell block (```bash / ```sh) is read: each `python -m launch.X` command may use
only the flags launch/X.py defines (and `--config.*` overrides where it takes a config), each
`python bench/X.py` command only the options bench/X.py parses, and each `--config=configs/...`
names a file that exists. Blocks marked runnable, with the line `<!-- runnable -->` right
before the fence, are run as written from the repository root and must exit 0: the documented
subset that is cheap enough for every test run (training commands are not: they are run by
tests/test_closed_loop.py, test_byo.py, test_export.py and test_eval.py)."""

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<marker><!-- runnable -->\n)?```(?:bash|sh|shell)[^\n]*\n(?P<body>.*?)^```",
                   re.MULTILINE | re.DOTALL)
ABSL_FLAGS = {"help", "helpshort", "helpfull"}


def blocks() -> list[tuple[str, bool, list[str]]]:
    """(doc, runnable, commands) of every fenced shell block; a command joins its
    backslash-continued lines and drops comments."""
    out = []
    for doc in DOCS:
        for m in FENCE.finditer(doc.read_text()):
            text = m.group("body").replace("\\\n", " ")
            commands = [re.sub(r"(^|\s+)#(\s.*)?$", "", line).strip() for line in text.splitlines()]
            out.append((doc.name, bool(m.group("marker")), [c for c in commands if c]))
    return out


def _launch_flags(module: str) -> tuple[set[str], bool]:
    """The flags launch/<module>.py defines, and whether it takes a config file."""
    source = (ROOT / "launch" / f"{module}.py").read_text()
    names = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", source))
    return names | ABSL_FLAGS, "DEFINE_config_file" in source


def _bench_options(script: str) -> set[str]:
    source = (ROOT / script).read_text()
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", source)) | {"--help"}


def problems(command: str) -> list[str]:
    """What in one documented command does not match the code."""
    try:
        words = [w.strip("[]") for w in shlex.split(command)]
    except ValueError as e:
        return [f"{command!r}: {e}"]
    found = []
    for i, word in enumerate(words):
        if not word.endswith("python") or i + 1 >= len(words):
            continue
        args = words[i + 1:]
        if args[0] == "-m" and len(args) > 1 and args[1].startswith("launch."):
            module = args[1].split(".", 1)[1]
            if not (ROOT / "launch" / f"{module}.py").exists():
                return [f"{command!r}: no launch/{module}.py"]
            flags, takes_config = _launch_flags(module)
            for arg in (a for a in args[2:] if a.startswith("--")):
                name = arg[2:].split("=", 1)[0]
                if takes_config and name.startswith("config."):
                    continue
                if name not in flags and not (name.startswith("no") and name[2:] in flags):
                    found.append(f"{command!r}: launch/{module}.py has no flag --{name}")
        elif args[0].startswith("bench/") and args[0].endswith(".py"):
            if not (ROOT / args[0]).exists():
                return [f"{command!r}: no {args[0]}"]
            options = _bench_options(args[0])
            found += [f"{command!r}: {args[0]} has no option {a.split('=')[0]}"
                      for a in args[1:] if a.startswith("--") and a.split("=")[0] not in options]
        for arg in args:
            if arg.startswith("--config=configs/"):
                path = arg.split("=", 1)[1].split(":", 1)[0]
                if not (ROOT / path).exists():
                    found.append(f"{command!r}: no {path}")
    return found


def test_the_reader_finds_commands_and_mismatches():
    assert problems("python -m launch.export --workdir=runs/x --out=y --step=1") == []
    assert problems("python -m launch.train --config=configs/quickstart.py:smoke "
                    "--config.steps=2 --workdir=w") == []
    assert problems("python -m launch.export --workdir=w --outdir=y") == [
        "'python -m launch.export --workdir=w --outdir=y': launch/export.py has no flag --outdir"]
    assert problems("python bench/rl_bench.py --rounds 2 --modez engine") == [
        "'python bench/rl_bench.py --rounds 2 --modez engine': bench/rl_bench.py has no "
        "option --modez"]
    assert problems("python -m launch.train --config=configs/nope.py") == [
        "'python -m launch.train --config=configs/nope.py': no configs/nope.py"]
    found = blocks()
    assert sum(len(c) for _, _, c in found) > 40 and any(r for _, r, _ in found)


def test_documented_commands_use_flags_and_files_that_exist():
    found = [p for doc, _, commands in blocks() for c in commands for p in problems(c)]
    assert not found, "fix these documented commands:\n" + "\n".join(found)


@pytest.mark.parametrize("doc, command", [(doc, c) for doc, runnable, commands in blocks()
                                          if runnable for c in commands])
def test_runnable_commands_run_as_written(doc, command):
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    p = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, f"{doc}: {command}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
