"""Held-out evaluation with K samples per problem: avg@K (mean accuracy over all samples, the
AIME-style protocol) and pass@K (a problem counts when any of its K samples is right), overall and
per group (`difficulty_key`, e.g. the number of digits, or the dataset name). The RL loop calls
`evaluate` for its before / periodic / after evals."""

from __future__ import annotations

import collections

import numpy as np

from tlt_jax.rl.rewards import math_reward


def evaluate(engine, formatter, tokenizer, rows: list[dict], *, samples: int = 1, seed: int = 0,
             difficulty_key: str | None = None, on_finish=None) -> dict:
  prompts = [formatter.encode(r["prompt"]) for r in rows]
  outputs = engine.generate(prompts, group_size=samples, seed=seed, on_finish=on_finish)
  correct = np.zeros((len(rows), samples), np.float32)
  lengths = np.zeros((len(rows), samples), np.int32)
  for s in outputs:
    i, k = divmod(s.sample_id, samples)
    text = tokenizer.decode(s.tokens.tolist(), skip_special_tokens=True)
    correct[i, k] = math_reward(text, rows[i]["answer"])
    lengths[i, k] = len(s.tokens)
  report = {"problems": len(rows), "samples": samples,
            f"avg@{samples}": float(correct.mean()), f"pass@{samples}": float(correct.max(1).mean()),
            "accuracy": float(correct.mean()), "response_len_mean": float(lengths.mean())}
  if difficulty_key:
    groups = collections.defaultdict(list)
    for i, r in enumerate(rows):
      groups[str(r.get(difficulty_key, "?"))].append(i)
    report["by_" + difficulty_key] = {
        g: {"problems": len(ix), "accuracy": float(correct[ix].mean())}
        for g, ix in sorted(groups.items(), key=lambda kv: _sort_key(kv[0]))}
  return report


def _sort_key(group: str):
  return (0, int(group)) if group.isdigit() else (1, group)
