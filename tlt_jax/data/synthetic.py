"""Synthetic verifiable task: multi-digit arithmetic with a worked scratchpad.

Difficulty is the number of digits; a mix weighted toward easy problems with a tail of hard
ones gives the heavy-tailed response lengths of reasoning RL (the scratchpad grows with the
digits: one line per column of an addition, one partial product per digit of a multiplication).

`slip` makes flawed worked solutions for pretraining corpora: each carry is dropped with that
probability and the final answer follows the flawed scratchpad, like the sloppy solutions of web
data. A model trained on them makes the same slips at that rate when it samples; RL against the
verifiable answer is what teaches it to stop.
"""

from __future__ import annotations

import numpy as np

DEFAULT_MIX = {1: 0.35, 2: 0.3, 3: 0.15, 4: 0.1, 8: 0.06, 16: 0.04}  # digits -> share
OPS = ("+", "*")


def scratchpad_add(a: int, b: int, rng: np.random.Generator | None = None,
                   slip: float = 0.0) -> tuple[str, int]:
  """Column addition, right to left, with carries: 'x+y+c=s' lines; returns (work, answer).

  The answer is read off the lines (so a slipped carry gives a consistent wrong answer)."""
  xs, ys = str(a)[::-1], str(b)[::-1]
  carry, lines, digits = 0, [], []
  for i in range(max(len(xs), len(ys))):
    x = int(xs[i]) if i < len(xs) else 0
    y = int(ys[i]) if i < len(ys) else 0
    total = x + y + carry
    lines.append(f"{x}+{y}+{carry}={total}")
    digits.append(total % 10)
    carry = total // 10
    if carry and slip and rng is not None and rng.random() < slip:
      carry = 0
  if carry:
    lines.append(f"carry {carry}")
    digits.append(carry)
  answer = int("".join(str(d) for d in reversed(digits)))
  return "; ".join(lines), answer


def scratchpad_mul(a: int, b: int) -> tuple[str, int]:
  parts = [f"{a}*{d}e{i}={a * int(d) * 10 ** i}" for i, d in enumerate(str(b)[::-1])]
  return "; ".join(parts) + f"; sum={a * b}", a * b


def make_problem(rng: np.random.Generator, digits: int, ops: tuple[str, ...] = OPS,
                 slip: float = 0.0) -> dict:
  """One problem; `answer` is always the true result, `solution` may carry slips."""
  unknown = set(ops) - set(OPS)
  if unknown or not ops:
    raise ValueError(f"ops must be a non-empty subset of {OPS}, got {ops}")
  lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits
  a, b = int(rng.integers(lo, hi)), int(rng.integers(lo, hi))
  multiply = "*" in ops and digits <= 3 and ("+" not in ops or rng.random() >= 0.5)
  if multiply:
    op, answer = "*", a * b
    work, written = scratchpad_mul(a, b)
  else:
    op, answer = "+", a + b
    work, written = scratchpad_add(a, b, rng, slip)
  return {"prompt": f"{a}{op}{b}=", "answer": str(answer),
          "solution": f"{work} \\boxed{{{written}}}", "digits": digits}


def make_dataset(n: int, seed: int, mix: dict[int, float] | None = None,
                 ops: tuple[str, ...] = OPS, slip: float = 0.0) -> list[dict]:
  mix = mix or DEFAULT_MIX
  digits = np.array([int(d) for d in mix])
  probs = np.array(list(mix.values()), np.float64)
  rng = np.random.default_rng(seed)
  picks = rng.choice(digits, size=n, p=probs / probs.sum())
  return [make_problem(rng, int(d), tuple(ops), slip) for d in picks]
