"""Verifiable math rewards: final-answer extraction and answer equivalence.

Extraction, in order of trust: the last `\\boxed{...}` (nested braces), then "#### x" (GSM8K),
then "answer: x" / "the answer is x", then the last number in the text. Equivalence normalises
both sides (LaTeX wrappers, thousands separators, units of `\\text{}`, `\\frac`, trailing zeros)
and compares them as exact rationals when both parse as numbers, else as strings, else through
sympy (`1/2` vs `0.5`, `2\\sqrt{2}` vs `\\sqrt{8}`), which runs under a size limit.
"""

from __future__ import annotations

import fractions
import re

NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_ANSWER_PATTERNS = (
    re.compile(r"####\s*([^\n]+)"),
    re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*\\?\$?([^\n$]+)", re.IGNORECASE),
)
_FINAL_ANSWER = re.compile(r"final answer\s*(?:is|:)\s*\\?\$?([^\n$]+)", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
  """Content of the last \\boxed{...} or \\fbox{...}, braces matched."""
  starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
  if not starts:
    return None
  i = start = starts[-1]
  depth = 1
  while i < len(text) and depth:
    depth += {"{": 1, "}": -1}.get(text[i], 0)
    i += 1
  return text[start:i - 1] if depth == 0 else None


def reference_answer(reference: str) -> str:
  """The final answer inside a reference as datasets ship it: GSM8K's worked solution ending in
  "#### 72" -> "72", a MATH solution -> its last \\boxed{}, a plain answer field -> itself.
  Applied once at load time (tlt_jax/data/sources.py keeps the raw text beside it)."""
  gsm8k = re.findall(r"####\s*([^\n]+)", reference)
  if gsm8k:
    return gsm8k[-1].strip()
  boxed = last_boxed(reference)
  if boxed is not None:
    return boxed.strip()
  return reference.strip()


def extract_answer(text: str) -> str | None:
  boxed = last_boxed(text)
  if boxed is not None:
    # "I get \\boxed{12} at first, but ... The final answer is 10.": a stated final answer after
    # the last box retracts it (it must look like an answer: a digit or LaTeX, not "correct").
    box_at = text.rfind("\\boxed")
    later = [m.group(1) for m in _FINAL_ANSWER.finditer(text, max(box_at, 0))
             if re.search(r"[\d\\]", m.group(1)) and "\\boxed" not in m.group(1)]
    return later[-1].strip().rstrip(".") if later else boxed.strip()
  for pattern in _ANSWER_PATTERNS:
    matches = pattern.findall(text)
    if matches:
      return matches[-1].strip().rstrip(".")
  numbers = re.findall(NUMBER, text)
  return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
  s = answer.strip()
  s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
  s = re.sub(r"\\(?:mathrm|mathbf|textbf)\{([^{}]*)\}", r"\1", s)
  s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\$", "")
  s = s.replace("$", "")
  s = s.replace("\\%", "").replace("%", "").replace("^\\circ", "").replace("^{\\circ}", "")
  s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)  # \frac12
  s = re.sub(r"^(?:x|y|n|k)\s*=\s*", "", s)  # "x = 5"
  s = re.sub(r"\s*(?:units?|dollars?|cm|meters?|inches|degrees|cents)$", "", s)
  s = s.strip().rstrip(".").strip()
  s = re.sub(r"^(-?[\d,]*\.?\d+)\s+[a-zA-Z][a-zA-Z ]*$", r"\1", s)  # "42 apples"
  if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
    s = s.replace(",", "")
  return s.replace(" ", "")


def as_fraction(s: str) -> fractions.Fraction | None:
  """Exact value of an integer, decimal, a/b or \\frac{a}{b} (with sign), else None."""
  m = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", s)
  if m:
    sign = -1 if m.group(1) else 1
    return sign * fractions.Fraction(m.group(2)) / fractions.Fraction(m.group(3))
  m = re.fullmatch(r"(-?\d+(?:\.\d+)?)/(-?\d+(?:\.\d+)?)", s)
  if m:
    den = fractions.Fraction(m.group(2))
    return fractions.Fraction(m.group(1)) / den if den else None
  m = re.fullmatch(r"(-?)(\d*)\.(\d*)\\overline\{(\d+)\}", s)  # 0.1\overline{6} = 1/6
  if m:
    sign, whole, fixed, repeat = m.groups()
    value = (int(whole or 0) + fractions.Fraction(int(fixed or 0), 10 ** len(fixed))
             + fractions.Fraction(int(repeat), 10 ** len(fixed) * (10 ** len(repeat) - 1)))
    return -value if sign else value
  if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
    return fractions.Fraction(s)
  return None


def _sympy_equal(a: str, b: str) -> bool:
  if len(a) > 200 or len(b) > 200:
    return False
  try:
    import sympy  # noqa: PLC0415 (sympy only for answers that are not plain numbers)
  except ImportError:
    return False
  try:
    ea, eb = _to_sympy(a), _to_sympy(b)
    if ea is None or eb is None:
      return False
    return bool(sympy.simplify(ea - eb) == 0)
  except Exception:  # noqa: BLE001 (malformed model output is a wrong answer, not a crash)
    return False


def _to_sympy(s: str):
  import sympy  # noqa: PLC0415 (sympy only for answers that are not plain numbers)
  t, previous = s, None
  while t != previous:  # innermost first: \frac{\sqrt{3}}{3}
    previous = t
    t = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", t)
    t = re.sub(r"\\sqrt(\d+)", r"sqrt(\1)", t)
    t = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", t)
  t = t.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*").replace("^", "**")
  t = t.replace("{", "(").replace("}", ")")
  t = re.sub(r"(\d)\s*(sqrt|pi|\()", r"\1*\2", t)
  if "\\" in t:
    return None
  return sympy.sympify(t, rational=True)


def fast_path(predicted: str | None, reference: str) -> bool | None:
  """True/False when exact comparison decides, None when it cannot (not both plain numbers)."""
  if predicted is None:
    return False
  p, r = normalize(predicted), normalize(reference)
  if p == r:
    return True
  fp, fr = as_fraction(p), as_fraction(r)
  if fp is not None and fr is not None:
    return fp == fr
  return None


def is_equivalent(predicted: str | None, reference: str) -> bool:
  decided = fast_path(predicted, reference)
  if decided is not None:
    return decided
  return _sympy_equal(normalize(predicted), normalize(reference))


def math_reward(completion: str, reference: str) -> float:
  """1.0 when the final answer is equivalent to the reference, else 0.0."""
  return float(is_equivalent(extract_answer(completion), reference))


def format_reward(completion: str) -> float:
  """1.0 when the completion states a final answer in a recognised form (boxed or 'answer:')."""
  if last_boxed(completion) is not None:
    return 1.0
  return float(any(p.search(completion) for p in _ANSWER_PATTERNS))
