"""Synthetic tasks in three domains, their demonstrations, and a word-level tokenizer: the
environments `code`, `arith` and `files` (`ptrain.envs.synthetic:code`, ...).

The quickstart's embedded default: everything is generated locally from a seed, so the main
job runs with no download. Code and scripts the model writes really run, in the sandbox:

  code    write `name(x)` returning `x <op> k`, judged by hidden unit tests (sandbox judge)
  arith   compute `a <op> b` by calling the python tool (in the sandbox), then answer
          (multi-turn; `Answer`: the final number is compared on the host, not in the sandbox)
  files   write a bash script that saves words to a file, judged by the files it leaves

The demonstrations used for the supervised warm start are partly wrong, and wrong in a
systematic way: a visible feature of the task triggers the bug most of the time (in `code`
"minus" and "times" are often written with the wrong operator, in `arith` the tool is asked
to add instead of subtract, in `files` a folder is forgotten). Trained to convergence on them, the model
copies the majority behaviour greedily while still sampling the right one now and then:
exactly what RL on executable feedback can fix, and what a held-out split can measure.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re

from ptrain import chat
from ptrain import rewards
from ptrain.envs import base
from ptrain.tasks import Answer, Files, Task, UnitTests

DOMAINS = ("code", "arith", "files")
WORDS = ("red", "blue", "green", "gold", "gray", "pink", "fox", "owl", "cat", "dog", "bee",
         "elk", "ant", "yak", "emu", "cod", "sun", "moon", "star", "rain", "snow", "wind",
         "tree", "leaf", "rock", "sand", "lake", "hill", "road", "door", "lamp", "book",
         "cup", "key", "ring", "coin", "bell", "drum", "kite", "boat")
OPS = {"plus": "+", "minus": "-", "times": "*"}
SPECIAL = ("<pad>", "<eos>", "<tool_call>", "</tool_call>", "<tool_response>",
           "</tool_response>", "<feedback>", "</feedback>")
PAD, EOS = 0, 1

# Pieces: special tags, runs of spaces, words, single digits, any other single character.
_PIECES = re.compile("|".join(re.escape(s) for s in SPECIAL) + r"|\n| +|[A-Za-z]+|\d|.",
                     re.DOTALL)


class WordTokenizer:
    """Text <-> ids over a closed vocabulary of pieces (words, digits, symbols, space runs).

    Decoding concatenates pieces, so text made of known pieces (all the model can write)
    round-trips exactly. Text from outside (a traceback in a tool observation) may hold
    unknown words, which are spelled letter by letter, and unknown characters, which become
    "?". `<pad>` and `<eos>` are dropped when decoding.
    """

    def __init__(self, pieces):
        self.pieces = list(SPECIAL) + sorted(set(pieces) - set(SPECIAL))
        self.ids = {p: i for i, p in enumerate(self.pieces)}
        self.pad_token_id, self.eos_token_id = PAD, EOS
        self.chat_template = None

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        del add_special_tokens  # there is no BOS
        ids = []
        for piece in _PIECES.findall(text):
            if piece in self.ids:
                ids.append(self.ids[piece])
            elif piece.isascii() and piece.isalpha():
                ids += [self.ids[ch] for ch in piece]
            elif piece.startswith(" "):
                ids += [self.ids[" " * 8]] * (len(piece) // 8) + \
                    ([self.ids[" " * (len(piece) % 8)]] if len(piece) % 8 else [])
            else:
                ids.append(self.ids["?"])
        return ids

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids if i not in (PAD, EOS))

    @classmethod
    def for_tasks(cls) -> WordTokenizer:
        """The vocabulary of every text the generator can produce, plus every printable
        ASCII character and letter, so tool output can always be spelled."""
        words = " ".join(WORDS + tuple(OPS) + _TEMPLATE_TEXT)
        singles = [chr(i) for i in range(33, 127)]
        return cls(_PIECES.findall(words) + singles + [" " * n for n in range(1, 9)] + ["\n"])


_TEMPLATE_TEXT = (
    "code: write a function", "that takes x and returns x", "def", "return",
    "arith: what is", "use python", "answer", "name", "arguments", "print",
    "files: save the words", "to file", "in folder", "mkdir", "echo", "Error", "Traceback",
    "most recent call last", "File", "line", "module", "NameError", "SyntaxError",
    "ZeroDivisionError", "TypeError", "is not defined", "invalid syntax", "No such file or "
    "directory", "tests passed", "First failure", "failed", "assert", "Wrong answer",
    "exit code", "stderr", "Wrote bytes to", "test", "bash", "sh",
)


# ----------------------------------------------------------------------------- tasks

@dataclasses.dataclass(frozen=True)
class Generated:
    """A task with a correct and a buggy demonstration: texts alternating between the model's
    turns (even indices) and tool outputs (odd). `triggered`: the task shows the bug's
    trigger."""

    task: Task
    good: tuple[str, ...]
    bad: tuple[str, ...]
    triggered: bool


def _name(rng) -> str:
    return f"{rng.choice(WORDS)}_{rng.choice(WORDS)}"


def code_task(rng: random.Random, index: int, split: str) -> Generated:
    op = rng.choice(tuple(OPS))
    k = rng.randint(2, 9)
    name = _name(rng)
    prompt = f"code: {name}(x) = x {op} {k}\n"
    body = "def {name}(x):\n    return x {sym} {k}\n"
    good = body.format(name=name, sym=OPS[op], k=k)
    wrong = {"plus": "+", "minus": "+", "times": "**"}[op]  # the systematic bug
    bad = body.format(name=name, sym=wrong, k=k)
    tests = "".join(f"assert {name}({x}) == {eval(f'{x} {OPS[op]} {k}')}\n"
                    for x in (0, 1, 3, -2, 7))
    task = Task(id=f"{split}/code/{index}", domain="code", prompt=prompt,
                verifier=UnitTests(tests=tests), metadata={"op": op})
    return Generated(task, (good,), (bad,), op != "plus")


def arith_task(rng: random.Random, index: int, split: str) -> Generated:
    op = rng.choice(tuple(OPS))
    a, b = rng.randint(10, 99), rng.randint(2, 9 if op == "times" else 99)  # <= 3 digits
    prompt = f"arith: {a} {op} {b} = ? (python)\n"

    def episode(sym):
        value = eval(f"{a} {sym} {b}")
        call = json.dumps({"name": "python", "arguments": {"code": f"print({a}{sym}{b})"}},
                          separators=(",", ":"))
        return (f"<tool_call>{call}</tool_call>", f"{value}\n", f"answer: {value}\n"), value

    good, right = episode(OPS[op])
    bad, _ = episode("+" if op == "minus" else OPS[op])  # the bug: subtraction adds
    task = Task(id=f"{split}/arith/{index}", domain="arith", prompt=prompt,
                verifier=Answer(answer=str(right), numeric=True), tools=("python",),
                metadata={"op": op})
    return Generated(task, good, bad, op == "minus")


def files_task(rng: random.Random, index: int, split: str) -> Generated:
    words = f"{rng.choice(WORDS)} {rng.choice(WORDS)}"
    file = f"{rng.choice(WORDS)}.txt"
    folder = rng.choice(WORDS) if rng.random() < 0.5 else ""
    path = f"{folder}/{file}" if folder else file
    prompt = f"files: write {words} to {path}\n"
    write = f"echo {words} > {path}\n"
    good = (f"mkdir -p {folder}\n" if folder else "") + write
    bad = write  # the systematic bug: the folder is never created
    task = Task(id=f"{split}/files/{index}", domain="files", prompt=prompt,
                verifier=Files(expected={path: f"{words}\n"}, run="bash"),
                metadata={"folder": bool(folder)})
    return Generated(task, (good,), (bad,), bool(folder))


GENERATORS = {"code": code_task, "arith": arith_task, "files": files_task}


def generate(domain: str, n: int, *, seed: int, split: str, exclude=frozenset()):
    """n distinct tasks of a domain whose prompts are not in `exclude` (another split's)."""
    rng = random.Random(f"{seed}/{domain}/{split}")
    return base.distinct(lambda i: GENERATORS[domain](rng, i, split), n,
                         key=lambda g: g.task.prompt, exclude=exclude, what=f"{domain} tasks")


def demonstration(g: Generated, rng: random.Random, bug_rate: float) -> tuple[str, ...]:
    """The buggy demonstration with probability `bug_rate` when the task is triggered."""
    return g.bad if g.triggered and rng.random() < bug_rate else g.good


# ----------------------------------------------------------------------------- environments

def environment(domain: str, *, n_train: int = 3000, n_heldout: int = 100,
                bug_rate: float = 0.7) -> base.Environment:
    """The generated tasks of `domain` (DOMAINS) as an environment: n_train training and
    n_heldout held-out instances (no prompt in both), and the partly wrong demonstrations of
    the training tasks (a triggered one carries its bug with probability `bug_rate`)."""
    if domain not in GENERATORS:
        raise ValueError(f"synthetic domain {domain!r}; use one of {DOMAINS}")

    def tasks(ctx: base.Context) -> base.Splits:
        held = generate(domain, n_heldout, seed=ctx.seed, split="heldout")
        gen = generate(domain, n_train, seed=ctx.seed, split="train",
                       exclude={g.task.prompt for g in held})
        rng = random.Random(f"{ctx.seed}/demos/{domain}")
        demos = [demo_record(g.task, demonstration(g, rng, bug_rate), ctx.tokenizer, ctx.fmt)
                 for g in gen]
        rename = (lambda t: t) if ctx.name == domain else (
            lambda t: dataclasses.replace(t, domain=ctx.name))
        return base.Splits([rename(g.task) for g in gen], [rename(g.task) for g in held],
                           demos)

    return base.Environment(
        name=domain, tasks=tasks, verify=rewards.verify_all,
        tools=base.sandbox_tools_named("python") if domain == "arith" else (),
        opens_session=rewards.needs_session, tokenizer=WordTokenizer.for_tasks)


def code(**kwargs) -> base.Environment:
    """Write name(x) returning x <op> k, judged by hidden unit tests in the sandbox."""
    return environment("code", **kwargs)


def arith(**kwargs) -> base.Environment:
    """Compute a <op> b by calling the python tool, then answer."""
    return environment("arith", **kwargs)


def files(**kwargs) -> base.Environment:
    """A bash script that writes words to a file, judged by the files it leaves."""
    return environment("files", **kwargs)


def demo_record(task, demo, tokenizer, fmt) -> dict:
    """A demonstration as an SFT record: the prompt's ids, then the model's turns (trained
    on, each ending with the format's end-of-turn token; in the plain format only the last,
    with EOS, as a call turn ends at its closing tag) and the tool outputs rendered as
    observations (not trained on), exactly as a rollout appends them."""
    ids, mask = [], []
    end = list(chat.end_of_turn_ids(fmt, tokenizer)[:1])
    for i, text in enumerate(demo):
        if i % 2:  # a tool's output
            part = chat.encode(tokenizer, chat.observation(fmt, [text], closed=True))
        else:
            part = chat.encode(tokenizer, text)
            if fmt.end_of_turn or i == len(demo) - 1:
                part += end
        ids += part
        mask += [1 - i % 2] * len(part)
    prompt = chat.render_prompt(fmt, tokenizer, prompt=task.prompt, messages=task.messages,
                                tools=base.sandbox_tools_named(*task.tools))
    return {"prompt_ids": prompt, "completion_ids": ids, "completion_mask": mask,
            "domain": task.domain}
