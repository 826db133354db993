"""Synthetic verifiable task: multi-digit arithmetic with a worked scratchpad.

Difficulty is the number of digits; a mix weighted toward easy problems with a tail of hard
ones gives the heavy-tailed response lengths of reasoning RL (the scratchpad grows with the
digits: one line per column of an addition, one partial product per digit of a multiplication).
"""

from __future__ import annotations

import numpy as np

DEFAULT_MIX = {1: 0.35, 2: 0.3, 3: 0.15, 4: 0.1, 8: 0.06, 16: 0.04}  # digits -> share


def scratchpad_add(a: int, b: int) -> str:
  """Column addition, right to left, with carries: 'd: x+y+c=s' lines."""
  xs, ys = str(a)[::-1], str(b)[::-1]
  carry, lines = 0, []
  for i in range(max(len(xs), len(ys))):
    x = int(xs[i]) if i < len(xs) else 0
    y = int(ys[i]) if i < len(ys) else 0
    total = x + y + carry
    lines.append(f"{x}+{y}+{carry}={total}")
    carry = total // 10
  if carry:
    lines.append(f"carry {carry}")
  return "; ".join(lines)


def scratchpad_mul(a: int, b: int) -> str:
  parts = [f"{a}*{d}e{i}={a * int(d) * 10 ** i}" for i, d in enumerate(str(b)[::-1])]
  return "; ".join(parts) + f"; sum={a * b}"


def make_problem(rng: np.random.Generator, digits: int) -> dict:
  lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits
  a, b = int(rng.integers(lo, hi)), int(rng.integers(lo, hi))
  if rng.random() < 0.5 or digits > 3:
    op, answer, work = "+", a + b, scratchpad_add(a, b)
  else:
    op, answer, work = "*", a * b, scratchpad_mul(a, b)
  return {"prompt": f"{a}{op}{b}=", "answer": str(answer), "solution": f"{work} \\boxed{{{answer}}}",
          "digits": digits}


def make_dataset(n: int, seed: int, mix: dict[int, float] | None = None) -> list[dict]:
  mix = mix or DEFAULT_MIX
  digits = np.array(list(mix))
  probs = np.array(list(mix.values()), np.float64)
  rng = np.random.default_rng(seed)
  picks = rng.choice(digits, size=n, p=probs / probs.sum())
  return [make_problem(rng, int(d)) for d in picks]
