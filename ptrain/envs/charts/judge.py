"""Judging a chart answer: the value in the model's text, read by one parser, against the
expected answer.

Where: the last \\boxed{...}, else the last "Answer: ..." (or "answer is ..."), else the last
number in the text (`ptrain.answers.extract`).

Numbers (`parse_number`): an optional sign; an optional currency sign or code before or after
($, €, £, ¥, USD, EUR, GBP); digits with thousands commas in groups of three or none
("1,234.5", "1234.5", ".5"); an optional "%", "percent" or "per cent"; then unit words,
ignored ("12 units", "$1,234 thousand": no scaling). "12.5", "12.5%", "$1,234", "-3.2 %",
"USD 1,234" are read; "1,23", "12.5.1", "about 12", "12-13" are not (feedback says how to
write it). A percentage is compared in percent: "12.5%" and "12.5" are the same answer, 0.125
is not.

Tolerance: an absolute one, by default half a unit of the expected answer's last decimal place
("12.5" -> 0.05, "1234" -> 0.5), so any correctly rounded or more precise value passes; a task
may give its own. Labels (the largest segment's name) are compared as text, case, spacing,
quotes and a final full stop aside.

Feedback says what went wrong in form (no answer found, not a number, outside the tolerance)
and the form expected (`FORMATS`), never the expected value.
"""

from __future__ import annotations

import dataclasses
import math
import re

from ptrain import answers as answers_lib
from ptrain.envs.verdict import Verdict

FORMATS = {
    "label": "the name exactly as the page writes it",
    "number": "a number (e.g. 2,048 or $2,048)",
    "percent": "a percentage rounded to one decimal place (e.g. 4.2 or 4.2%)",
    "ratio": "a number rounded to one decimal place (e.g. 0.8)",
}
_NUMBER = re.compile(
    r"(?P<sign>[-+\u2212]?)\s*(?:[$€£¥]|usd|eur|gbp)?\s*(?P<sign2>[-+\u2212]?)\s*"
    r"(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)\s*(?:[$€£¥]|usd|eur|gbp)?"
    r"\s*(?P<percent>%|percent|per cent)?(?P<unit>(?:\s+[a-z]+)*)\.?")


@dataclasses.dataclass(frozen=True)
class Expected:
    """A chart task's verifier: the answer as text, its kind (`FORMATS`), and the absolute
    tolerance of a numeric answer (None: half a unit of its last decimal place)."""

    answer: str
    kind: str = "number"
    tolerance: float | None = None

    def __post_init__(self):
        if self.kind not in FORMATS:
            raise ValueError(f"answer kind {self.kind!r}: use one of {list(FORMATS)}")
        if self.kind != "label" and parse_number(self.answer) is None:
            raise ValueError(f"answer {self.answer!r} is not a number ({FORMATS['number']})")
        if self.tolerance is not None and not (isinstance(self.tolerance, (int, float))
                                               and math.isfinite(self.tolerance)
                                               and self.tolerance >= 0):
            raise ValueError(f"tolerance {self.tolerance!r} must be a number >= 0")


def parse_number(text: str) -> float | None:
    """The number a short answer writes (see the module docstring), or None."""
    m = _NUMBER.fullmatch(text.strip().lower())
    if m is None or (m.group("sign") and m.group("sign2")):
        return None
    value = float(m.group("digits").replace(",", ""))
    return -value if (m.group("sign") or m.group("sign2")) in ("-", "\u2212") else value


def default_tolerance(answer: str) -> float:
    """Half a unit of the answer's last decimal place."""
    m = re.search(r"\.(\d+)", answer)
    return 0.5 * 10.0 ** -(len(m.group(1)) if m else 0)


def kind_of(answer: str) -> str:
    """A brought answer's kind: "percent" if it ends with %, "number" if it parses, else
    "label"."""
    if parse_number(answer) is None:
        return "label"
    return "percent" if answer.strip().endswith("%") else "number"


def _label(text: str) -> str:
    text = text.strip().strip("\"'`*").rstrip(".").strip("\"'`*")
    return re.sub(r"\s+", " ", text).lower()


def judge(expected: Expected, text: str) -> Verdict:
    """The verdict on a model's whole answer text."""
    how = (f"End with a line 'Answer: <value>' where <value> is "
           f"{FORMATS[expected.kind]}.")
    found = answers_lib.extract(text or "")
    if not found.strip():
        return Verdict(0.0, False, 0.0, f"No answer found. {how}", "no_answer")
    if expected.kind == "label":
        if _label(found) == _label(expected.answer):
            return Verdict(1.0, True, 1.0, "Correct.")
        return Verdict(0.0, False, 0.0, f"{found[:60]!r} is not the right name. {how}",
                       "wrong_answer")
    got = parse_number(found)
    if got is None:
        return Verdict(0.0, False, 0.0, f"Could not read {found[:60]!r} as one number. {how}",
                       "not_a_number")
    want = parse_number(expected.answer)
    tol = (default_tolerance(expected.answer) if expected.tolerance is None
           else expected.tolerance)
    if abs(got - want) <= tol + 1e-9 * max(1.0, abs(want)):
        return Verdict(1.0, True, 1.0, "Correct.")
    return Verdict(0.0, False, 0.0, f"{found[:60]!r} is not the right value (judged within "
                   f"{tol:g}). {how}", "wrong_answer")
