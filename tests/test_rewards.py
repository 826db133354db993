"""Answer extraction and equivalence on tricky cases (each one a way real completions go wrong)."""

import pytest

from tlt_jax.rl.rewards import extract_answer, format_reward, is_equivalent, math_reward

EXTRACT = [
    ("so the result is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("first \\boxed{3} then \\boxed{5}", "5"),
    ("\\boxed{x^{2}+1}", "x^{2}+1"),
    ("\\boxed{\\left( 1, 2 \\right)}", "\\left( 1, 2 \\right)"),
    ("\\fbox{7}", "7"),
    ("She pays 3 + 4 = 7 dollars.\n#### 7", "7"),
    ("#### 1,250", "1,250"),
    ("The answer is 12.", "12"),
    ("Final answer: -3", "-3"),
    ("answer: $\\frac{3}{4}$", "\\frac{3}{4}"),
    ("I computed 5 apples and then 8 pears", "8"),
    ("no digits at all", None),
    ("\\boxed{unbalanced", None),  # a box cut off by the length limit is no answer
    ("total is -0.5 now", "-0.5"),
]

EQUIVALENT = [
    ("42", "42"), ("1,000", "1000"), ("1000.0", "1000"), ("0.5", "\\frac{1}{2}"),
    ("\\dfrac{1}{2}", "1/2"), ("-\\frac{3}{4}", "-0.75"), ("\\frac12", "0.5"),
    ("3/6", "1/2"), ("$5$", "5"), ("5 dollars", "5"), ("\\text{5 cm}", "5"),
    ("50\\%", "50"), ("90^\\circ", "90"), ("x = 5", "5"), (" 7 ", "7"), ("7.", "7"),
    ("2\\sqrt{2}", "\\sqrt{8}"), ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"),
    ("\\pi/2", "\\frac{\\pi}{2}"), ("2^{10}", "1024"), ("12,345,678", "12345678"),
    ("-.5", "-0.5"), ("\\left(3\\right)", "3"), ("10.50", "10.5"),
]

NOT_EQUIVALENT = [
    ("41", "42"), ("1,001", "1000"), ("0.33", "\\frac{1}{3}"), ("-5", "5"), ("2\\sqrt{3}", "\\sqrt{8}"),
    ("1/0", "0"), ("", "0"), ("\\frac{1}{2", "0.5"), ("x^2", "x^3"), ("12", "1,2"),
]


@pytest.mark.parametrize("text,expected", EXTRACT)
def test_extract_answer(text, expected):
  assert extract_answer(text) == expected


@pytest.mark.parametrize("a,b", EQUIVALENT)
def test_equivalent(a, b):
  assert is_equivalent(a, b) and is_equivalent(b, a)


@pytest.mark.parametrize("a,b", NOT_EQUIVALENT)
def test_not_equivalent(a, b):
  assert not is_equivalent(a, b)


def test_rewards_end_to_end():
  assert math_reward("... so \\boxed{\\frac{6}{8}}", "0.75") == 1.0
  assert math_reward("#### 1,200", "1200") == 1.0
  assert math_reward("I think 7", "8") == 0.0
  assert math_reward("nothing", "8") == 0.0
  assert is_equivalent(None, "1") is False
  assert format_reward("\\boxed{1}") == 1.0 and format_reward("The answer is 3") == 1.0
  assert format_reward("3") == 0.0
