"""Reward graders: accuracy on hand-labeled math cases and throughput, math and code.

    python -m experiments.bench_rewards

Math: experiments/assets/rewards/math_equivalence_cases.jsonl (completions labeled right or wrong
by a careful human reading) graded three ways: `ours` (tlt_jax.rl.rewards.math_reward alone),
`math_verify` (HF math-verify alone: the reference as one boxed expression, the whole completion
parsed as the open recipes do), `combined` (tlt_jax.rl.equivalence.grade: our exact fast path,
then math-verify). Right = the grader agrees with the label. Each grader scores every case once in
this process's main thread (math-verify's own timeouts), after one warm-up call.
Code: the 3 code rows of experiments/assets/rewards/mixed_sample.jsonl (2-3 tests each), each
with a correct and a wrong solution, repeated to 48 samples, scored by RewardScorer with 2 thread
workers (every test of every sample is its own sandboxed process; "all" partial mode, so a wrong
solution stops at its first failed test). Samples/s is wall time from the first submit to all
results.
Prints one JSON object and writes experiments/results/rewards.json.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import platform
import time

from tlt_jax.data.sources import read_rows
from tlt_jax.rl import equivalence, sandbox
from tlt_jax.rl.rewards import math_reward
from tlt_jax.rl.scoring import RewardScorer, RewardSpec

ASSETS = os.path.join(os.path.dirname(__file__), "assets", "rewards")


def load_cases() -> list[dict]:
  with open(os.path.join(ASSETS, "math_equivalence_cases.jsonl"), encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


GRADERS = {
    "ours": lambda c, r: math_reward(c, r) == 1.0,
    "math_verify": lambda c, r: bool(equivalence.math_verify_equal(r, c)),
    "combined": lambda c, r: equivalence.grade(c, r)[0],
}


def bench_math(cases: list[dict]) -> dict:
  out = {}
  for name, grader in GRADERS.items():
    grader("\\boxed{1}", "1")  # imports
    t0 = time.perf_counter()
    verdicts = [grader(c["completion"], c["reference"]) for c in cases]
    seconds = time.perf_counter() - t0
    wrong = [c for c, v in zip(cases, verdicts) if v != c["correct"]]
    out[name] = {"right": len(cases) - len(wrong), "total": len(cases),
                 "samples_per_s": round(len(cases) / seconds, 1),
                 "wrong": [f"{c['category']}: {c['completion'][-60:]!r} vs {c['reference']!r}"
                           f" (truth {c['correct']})" for c in wrong]}
  # GSM8K-style throughput: integer answers, the fast path alone decides them.
  gsm = [(f"She has {i} + {i} = {2 * i} apples.\n#### {2 * i + i % 2}", str(2 * i))
         for i in range(2000)]
  t0 = time.perf_counter()
  verdicts = [equivalence.grade(c, r) for c, r in gsm]
  out["combined_gsm8k_style"] = {
      "samples": len(gsm), "samples_per_s": round(len(gsm) / (time.perf_counter() - t0), 1),
      "all_fast": all(p == "fast" for _, p in verdicts),
      "right": sum(ok == (i % 2 == 0) for i, (ok, _) in enumerate(verdicts))}
  paths = collections.Counter(equivalence.grade(c["completion"], c["reference"])[1] for c in cases)
  out["combined"]["decided_by"] = dict(paths)
  return out


CODE_SOLUTIONS = [  # (correct, wrong) for the code rows of mixed_sample.jsonl, in order
    ("a, b = map(int, input().split())\nprint(a + b)",
     "a, b = map(int, input().split())\nprint(a * b)"),
    ("def is_even(n):\n  return n % 2 == 0", "def is_even(n):\n  return n % 2"),
    ("input()\nprint(max(map(int, input().split())))",
     "input()\nprint(min(map(int, input().split())))"),
]


def bench_code(samples: int = 48, workers: int = 2) -> dict:
  rows = [r for r in read_rows(os.path.join(ASSETS, "mixed_sample.jsonl")).rows
          if r["reward"] == "code"]
  jobs = []
  for i in range(samples):
    row, (good, bad) = rows[i % len(rows)], CODE_SOLUTIONS[i % len(rows)]
    jobs.append((row, f"```python\n{good if (i // len(rows)) % 2 == 0 else bad}\n```",
                 (i // len(rows)) % 2 == 0))
  with RewardScorer(RewardSpec(), workers=workers, kind="thread") as scorer:
    t0 = time.perf_counter()
    for i, (row, completion, _) in enumerate(jobs):
      scorer.submit(i, completion, row)
    results, _ = scorer.results()
    seconds = time.perf_counter() - t0
  right = sum((results[i]["reward"] == 1.0) == ok for i, (_, _, ok) in enumerate(jobs))
  return {"samples": samples, "workers": workers, "isolation": sandbox.isolation(),
          "right": right, "seconds": round(seconds, 2),
          "samples_per_s": round(samples / seconds, 1)}


def main() -> None:
  logging.disable(logging.WARNING)  # math-verify logs every unparsable answer
  result = {"machine": f"{platform.machine()} {os.cpu_count()} cores",
            "math": bench_math(load_cases()), "code": bench_code()}
  os.makedirs("experiments/results", exist_ok=True)
  with open("experiments/results/rewards.json", "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
