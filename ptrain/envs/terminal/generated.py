"""Generated terminal tasks in the Harbor layout, their demonstrations and a word tokenizer:
configs/terminal_toy.py's embedded default (no download, nothing to pull).

Each task asks for words written to a file, maybe in a folder that does not exist yet
("terminal: write red fox to lake/cat.txt"). It is a real Harbor task directory
(instruction.md, task.toml, environment/Dockerfile on ptrain-term-base, tests/test.sh writing
/logs/verifier/reward.txt, solution/solve.sh), run and verified in docker like any other.
The demonstrations of the warm start are partly wrong in a systematic way, as the
quickstart's: when the path has a folder, the demonstration usually forgets `mkdir -p`. The
model that copies them fails those tasks greedily and sometimes samples the right command:
what RL on the verifier's reward fixes, measured on a held-out split.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re

from ptrain import chat
from ptrain.envs import synthetic

WORDS = synthetic.WORDS
TEMPLATE_TEXT = ("terminal: write", "to", "done", "name", "bash", "arguments", "command",
                 "mkdir -p", "echo", "txt", "exit status", "No such file or directory",
                 "line", "timed out after", "no exit status", "the shell was restarted")
TASK_TOML = """version = "1.0"

[metadata]
category = "file-operations"
generated_by = "ptrain.envs.terminal.generated"

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 60.0

[environment]
build_timeout_sec = 120.0
cpus = 1
memory_mb = 256
storage_mb = 256
allow_internet = false
"""
DOCKERFILE = "FROM ptrain-term-base:latest\nWORKDIR /app\n"
TEST_SH = """#!/bin/bash
if [ "$(cat /app/{path} 2>/dev/null)" = "{words}" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


@dataclasses.dataclass(frozen=True)
class Generated:
    task_dir: str
    instruction: str
    good: str  # the right command
    bad: str  # the demonstrations' systematic mistake (== good when not triggered)
    triggered: bool
    domain: str = "terminal"  # its environment's name
    tools = ("bash",)  # what its episodes may call

    @property
    def id(self) -> str:
        """split/NNNN: the same wherever the run's work dir is (rows, task filters)."""
        return "/".join(os.path.normpath(self.task_dir).split(os.sep)[-2:])

    def to_record(self) -> dict:
        """What the task file holds of it (the producer takes it, or this record)."""
        return {"task_dir": self.task_dir, "domain": self.domain}


def tokenizer() -> synthetic.WordTokenizer:
    """Every piece the tasks, the calls and the shell's usual answers are made of, plus each
    printable ASCII character (anything else is spelled or becomes '?')."""
    text = " ".join(WORDS + TEMPLATE_TEXT)
    singles = [chr(i) for i in range(33, 127)]
    return synthetic.WordTokenizer(re.findall(r"[A-Za-z]+", text) + singles +
                                         [" " * n for n in range(1, 9)] + ["\n"])


def _task(rng: random.Random):
    words = f"{rng.choice(WORDS)} {rng.choice(WORDS)}"
    file = f"{rng.choice(WORDS)}.txt"
    folder = rng.choice(WORDS) if rng.random() < 0.5 else ""
    path = f"{folder}/{file}" if folder else file
    write = f"echo {words} > {path}"
    good = f"mkdir -p {folder} && {write}" if folder else write
    return f"terminal: write {words} to {path}\n", path, words, good, write, bool(folder)


def write_task(task_dir: str, instruction: str, path: str, words: str, solution: str) -> None:
    files = {"instruction.md": instruction, "task.toml": TASK_TOML,
             "environment/Dockerfile": DOCKERFILE,
             "tests/test.sh": TEST_SH.format(path=path, words=words),
             "solution/solve.sh": f"#!/bin/bash\ncd /app\n{solution}\n"}
    for rel, text in files.items():  # atomically: every process of a run writes the same
        file = os.path.join(task_dir, rel)
        os.makedirs(os.path.dirname(file), exist_ok=True)
        with open(f"{file}.{os.getpid()}.tmp", "w") as f:
            f.write(text)
        os.replace(f"{file}.{os.getpid()}.tmp", file)


def generate(root: str, n: int, *, seed: int, split: str, exclude=frozenset()) -> list[Generated]:
    """n distinct tasks under root/<split>/<index>/ whose instructions are not in `exclude`
    (another split's)."""
    from ptrain.envs import base
    rng = random.Random(f"{seed}/terminal/{split}")
    out = []
    for i, (instruction, path, words, good, bad, triggered) in enumerate(base.distinct(
            lambda i: _task(rng), n, key=lambda t: t[0], exclude=exclude,
            what="terminal tasks")):
        task_dir = os.path.join(root, split, f"{i:04d}")
        write_task(task_dir, instruction, path, words, good)
        out.append(Generated(task_dir, instruction, good, bad if triggered else good, triggered))
    return out


def call_text(command: str) -> str:
    """A model turn that runs `command` (Hermes form, as the plain format parses it)."""
    body = json.dumps({"name": "bash", "arguments": {"command": command}},
                      separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def demonstration(g: Generated, rng: random.Random, bug_rate: float) -> tuple[str, str]:
    """(command, what the shell answers): the mistake with probability `bug_rate` when the
    task is triggered."""
    if g.triggered and rng.random() < bug_rate:
        path = g.bad.split("> ", 1)[1]
        return g.bad, f"bash: line 1: {path}: No such file or directory\n[exit status 1]"
    return g.good, "[exit status 0]"


def demo_record(g: Generated, tok, command: str, output: str, *, system: str = "",
                domain: str = "terminal") -> dict:
    """An SFT record of the plain format: the prompt, then the call (a plain turn that calls
    a tool ends at its </tool_call>; trained on), the shell's answer (not), and "done" + EOS
    (trained on)."""
    from ptrain.envs.terminal import agent as terminal_agent
    turn = chat.encode(tok, call_text(command))
    obs = chat.encode(tok, chat.observation(chat.PLAIN, [output], closed=True))
    done = chat.encode(tok, "done") + [tok.eos_token_id]
    return {"prompt_ids": terminal_agent.render_prompt(chat.PLAIN, tok, g.instruction, system),
            "completion_ids": turn + obs + done,
            "completion_mask": [1] * len(turn) + [0] * len(obs) + [1] * len(done),
            "domain": domain}
