"""Final answers: found in a model's text, compared with the reference.

`extract` takes the last \\boxed{...} (MATH's convention), else GSM8K's `#### x`, else what
follows the last "answer:" / "answer is", else the last number. Three comparisons:
`same_text` (normalised case and spacing), `same_number` (within a tolerance) and
`same_math`, for MATH answers: both sides are normalised the way the MATH authors' checker
does (Hendrycks et al. 2021, `is_equiv`: \\dfrac and \\tfrac are \\frac, \\frac12 is
\\frac{1}{2}, \\left / \\right, spacing commands, degrees, percent and dollar signs, trailing
\\text{ units}, "x = 5", leading-dot decimals), then equal as text, as exact numbers (integers,
decimals, fractions, a/b: 0.5 == \\frac{1}{2}, 5 == 5.0, 1,000 == 1000), or element by element
for tuples and intervals (in order: "4, 10" is not "10, 4"). Nothing symbolic: x^2-4 and
(x-2)(x+2) differ.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction


def boxed(text: str) -> str:
    """The content of the last \\boxed{...} or \\fbox{...} (braces balanced; also
    `\\boxed 5`), or ''."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return ""
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    if text.startswith(" ", i):  # \boxed 5
        return re.match(r" *([^\s$]*)", text[i:]).group(1)
    if not text.startswith("{", i):
        return ""
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return ""


_ANSWER = re.compile(r"(?:final answer|answer)\s*(?:is)?\s*[:=]?[ \t]*(.*)", re.IGNORECASE)
_GSM8K = re.compile(r"####\s*(.+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def extract(text: str) -> str:
    """The final answer in a model's text, or '' (see the module docstring for the order)."""
    found = boxed(text)
    if found:
        return found
    marked = _GSM8K.findall(text)
    if marked and marked[-1].strip():
        return marked[-1].strip()
    lines = [m.group(1).strip() for m in _ANSWER.finditer(text)]
    if lines and lines[-1]:
        return lines[-1].splitlines()[0].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else ""


def _plain(answer: str) -> str:
    answer = answer.strip().strip("$").strip().rstrip(".").strip()
    return re.sub(r"\s+", " ", answer).lower()


def same_text(got: str, want: str) -> bool:
    return _plain(got) == _plain(want)


def as_number(text: str) -> float | None:
    text = _plain(text).replace(",", "")
    try:
        return float(text)
    except ValueError:
        match = _NUMBER.fullmatch(text)
        return float(match.group(0)) if match else None


def same_number(got: str, want: str, tol: float = 1e-6) -> bool:
    a, b = as_number(got), as_number(want)
    return a is not None and b is not None and math.isclose(a, b, rel_tol=tol, abs_tol=tol)


# ----------------------------------------------------------------------------- MATH

def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def _fix_fracs(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{72} -> \\frac{1}{72}, \\frac{3}4 -> \\frac{3}{4}."""
    out, rest = "", s
    while (i := rest.find("\\frac")) >= 0:
        out, rest = out + rest[:i + 5], rest[i + 5:]
        args = []
        for _ in range(2):
            if rest.startswith("{"):
                depth = 0
                for j, ch in enumerate(rest):
                    depth += {"{": 1, "}": -1}.get(ch, 0)
                    if depth == 0:
                        break
                args.append(rest[:j + 1])
                rest = rest[j + 1:]
            elif rest:
                args.append("{" + rest[0] + "}")
                rest = rest[1:]
        out += "".join(args)
    return out + rest


_SPACING = ("\\!", "\\,", "\\;", "\\:", "\\ ", "~")
_UNITS = re.compile(r"^(.+?)\s*\\(?:text|mbox|mathrm)\{\s*[^{}]*\}$")
_WORD_UNITS = re.compile(r"^([-+]?[\d.,/]+)\s+[a-z][a-z ]*$", re.IGNORECASE)
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")


def normalise_math(answer: str) -> str:
    """A MATH answer in canonical text (see the module docstring)."""
    s = answer.strip().replace("\n", "")
    s = s.replace("{,}", ",")
    for space in _SPACING:
        s = s.replace(space, " " if space == "\\ " else "")
    s = s.replace("\\\\", "\\")
    s = s.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    s = re.sub(r"\\left\b|\\right\b", "", s)
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°", "", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = s.strip().rstrip(".").strip()
    whole = re.fullmatch(r"\\(?:text|textbf|mbox|mathrm)\{(.*)\}", s)
    if whole:
        s = whole.group(1).strip()
    if "\\text{ " in s and s.split("\\text{ ")[0].strip():  # "12\text{ cm}^2": units
        s = s.split("\\text{ ")[0].strip()
    units = _UNITS.match(s) or _WORD_UNITS.match(s)
    if units:
        s = units.group(1).strip()
    if s.count("=") == 1 and len(s.split("=")[0].strip()) <= 2:
        s = s.split("=")[1].strip()  # "x = 5", "k=5"
    s = re.sub(r"(^|[\s{(\[,])\.(\d)", r"\g<1>0.\2", s)
    s = _fix_fracs(_fix_sqrt(s)).replace(" ", "")
    if re.fullmatch(r"-?\d+/\d+", s):
        num, den = s.lstrip("-").split("/")
        s = ("-" if s.startswith("-") else "") + f"\\frac{{{num}}}{{{den}}}"
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return s


def _exact(s: str) -> Fraction | None:
    """The exact value of an integer, decimal or fraction (\\frac{a}{b}), else None."""
    sign = -1 if s.startswith("-") else 1
    s = s[1:] if s[:1] in "-+" else s
    frac = re.fullmatch(r"\\frac\{(\d+(?:\.\d+)?)\}\{(\d+(?:\.\d+)?)\}", s)
    try:
        if frac:
            value = Fraction(frac.group(1)) / Fraction(frac.group(2))
        elif re.fullmatch(r"\d+(?:\.\d+)?|\d*\.\d+", s):
            value = Fraction(s)
        else:
            return None
    except ZeroDivisionError:
        return None
    return sign * value


def _split_top(s: str) -> list[str]:
    """Split at commas outside braces and brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "{([":
            depth += 1
        elif ch in "})]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    return parts + [s[start:]]


def _same_normalised(a: str, b: str) -> bool:
    if a == b:
        return True
    x, y = _exact(a), _exact(b)
    if x is not None and y is not None:
        return x == y
    brackets = re.compile(r"^([(\[])(.*)([)\]])$")
    ma, mb = brackets.match(a), brackets.match(b)
    if ma and mb and (ma.group(1), ma.group(3)) == (mb.group(1), mb.group(3)):
        a, b = ma.group(2), mb.group(2)
    pa, pb = _split_top(a), _split_top(b)
    if len(pa) > 1 and len(pa) == len(pb):
        return all(_same_normalised(p, q) for p, q in zip(pa, pb))
    return False


def same_math(got: str, want: str) -> bool:
    """Whether two MATH answers are the same (see the module docstring)."""
    return _same_normalised(normalise_math(got), normalise_math(want))
