"""Final answers: extraction, and MATH equivalence checked on cases we did not write."""

import pytest

from ptrain import answers, rewards, tasks

# The MATH authors' own tests of their checker (hendrycks/math, test_math_equivalence.py):
# (answer, reference, equivalent).
HENDRYCKS = [
    ("\\tfrac{1}{2} + \\frac1{72}", "\\\\frac{1}{2} + 2/3", False),
    ("10, 4, -2", "4, 10, -2", False),
    ("10, 4, 2", "4, 12, 2", False),
    ("\\tfrac{1}{2} +\\! \\frac1{72}", "\\\\dfrac{1}{2} +\\frac{1}{72}", True),
    ("10\\text{ units}", "10 ", True),
    ("10\\text{ units}", "100 ", False),
    ("10", "\\$10", True),
    ("\\left(x-2\\right)\\left(x+2\\right)", "(x-2)(x+2)", True),
    ("0.1, 4, 2", "4, .1, 2", False),
    ("0.1", ".1", True),
    ("10\\%", "10", True),
    ("10\\sqrt{3} + \\sqrt4", "10\\sqrt3 + \\sqrt{4}", True),
    ("\\frac34i", "\\frac{3}{4}i", True),
    ("\\tfrac83", "\\frac{8}{3}", True),
    ("5x - 7y + 11z + 4 = 0", "x + y - z + 2 = 0", False),
    ("1/2", "\\frac{1}{2}", True),
]

# Forms that MATH's reference answers use (degrees, thousands separators with \! or {,},
# \text{(C)} choices, \left( \right) tuples, dollars) against what a model writes.
CONVENTIONS = [
    ("90^\\circ", "90", True), ("30^{\\circ}", "30", True),
    ("1,\\!000", "1000", True), ("1{,}000", "1,000", True), ("10,\\!080", "10080", True),
    ("\\text{(C)}", "(C)", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True),
    ("\\$18.90", "18.9", True), ("x = 5", "5", True), ("k=-3", "-3", True),
    ("0.5", "\\dfrac{1}{2}", True), ("5.0", "5", True), ("-\\frac{1}{3}", "-1/3", True),
    ("\\frac{2}{4}", "\\frac{1}{2}", True), ("0.333", "\\frac13", False),
    ("(3, 4]", "(3, 4)", False), ("\\dfrac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", True),
    ("2\\sqrt{2}", "\\sqrt{8}", False),  # not symbolic
    ("58 square units", "58", True), ("12\\text{ cm}^2", "12", True),
]


@pytest.mark.parametrize("got, want, same", HENDRYCKS + CONVENTIONS)
def test_math_equivalence(got, want, same):
    assert answers.same_math(got, want) is same
    assert answers.same_math(want, got) is same


def test_extraction_order():
    assert answers.extract("... so \\boxed{\\frac{1}{2}} and later \\boxed{3}") == "3"
    assert answers.extract("\\fbox{7}") == "7" and answers.extract("$\\boxed 5$.") == "5"
    assert answers.extract("She has 5 + 2 = 7 apples.\n#### 7") == "7"
    assert answers.extract("The final answer is: 12.") == "12."
    assert answers.extract("3 then 4 so 7") == "7"
    assert answers.extract("nothing") == ""
    assert tasks.boxed("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"


def test_math_and_gsm8k_verdicts():
    math_task = tasks.Task("m", "math", tasks.Answer("\\frac{3}{4}", latex=True), prompt="?")
    assert rewards.verify(math_task, "so it is $\\boxed{\\dfrac34}$").passed
    assert rewards.verify(math_task, "The answer is 0.75.").passed
    assert not rewards.verify(math_task, "\\boxed{\\frac{4}{3}}").passed
    gsm = tasks.Task("g", "math", tasks.Answer("1007", numeric=True), prompt="?")
    assert rewards.verify(gsm, "1000 + 7 = 1007\n#### 1,007").passed
    assert not rewards.verify(gsm, "1000 + 7 = 1007\n#### 1006").passed
