"""Reward graders: accuracy on hand-labeled math cases and throughput, math and code.

    python -m experiments.bench_rewards

Math: experiments/assets/rewards/math_equivalence_cases.jsonl (completions labeled right or wrong
by a careful human reading) graded three ways: `ours` (tlt_jax.rl.rewards.math_reward alone),
`math_verify` (HF math-verify alone: the reference as one boxed expression, the whole completion
parsed as the open recipes do), `combined` (tlt_jax.rl.equivalence.grade: our exact fast path,
then math-verify). Right = the grader agrees with the label. Each grader scores every case once in
this process's main thread (math-verify's own timeouts), after one warm-up call.
Code: the code rows of experiments/assets/rewards/mixed_sample.jsonl with a correct, a wrong and
a timing-out solution each, scored by RewardScorer with 2 process... thread workers (each sample is
its own sandboxed subprocess).
Prints one JSON object and writes experiments/results/rewards.json.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import platform
import time

from tlt_jax.rl import equivalence
from tlt_jax.rl.rewards import math_reward

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
  paths = collections.Counter(equivalence.grade(c["completion"], c["reference"])[1] for c in cases)
  out["combined"]["decided_by"] = dict(paths)
  return out


def main() -> None:
  logging.disable(logging.WARNING)  # math-verify logs every unparsable answer
  result = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "math": bench_math(load_cases())}
  os.makedirs("experiments/results", exist_ok=True)
  with open("experiments/results/rewards.json", "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
