"""A run's rows from its config: the training rows and the held-out eval problems.

Eval problems never appear in the training rows: synthetic problems are drawn from their own
seed and filtered against the training prompts; with files, each eval file contributes up to
`eval.num_problems` prompts that are not training prompts, reported under the file's name.
"""

from __future__ import annotations

import os
import sys

from tlt_jax.data import sources, synthetic


def parse_mix(spec: str) -> dict[int, float]:
  """'1:0.5,2:0.5' -> {1: 0.5, 2: 0.5}: the synthetic problems' digit-count mixture."""
  try:
    return {int(d): float(w) for d, w in (part.split(":") for part in spec.split(","))}
  except ValueError as e:
    raise ValueError(f"data.synthetic_mix={spec!r} must look like '1:0.5,2:0.5' ({e})") from None


def eval_paths(spec: str) -> list[str]:
  return [p.strip() for p in spec.split(",") if p.strip()]


def dataset_name(path: str) -> str:
  """gsm8k_test.jsonl -> gsm8k_test: the name a dataset's eval results are reported under."""
  return os.path.splitext(os.path.basename(path))[0]


def eval_group_key(c) -> str:
  """Eval results are split by difficulty (synthetic) or by dataset (files)."""
  return "digits" if c.data.source == "synthetic" else "dataset"


def load_rows(c) -> tuple[list[dict], list[dict], dict]:
  """(train rows, held-out eval rows, a report of skipped rows and eval problems)."""
  d = c.data
  if d.source == "synthetic":
    mix, ops = parse_mix(d.synthetic_mix), tuple(d.synthetic_ops)
    train = synthetic.make_dataset(d.synthetic_train, c.seed, mix, ops)
    candidates = synthetic.make_dataset(20 * c.eval.num_problems, c.seed + 7919 * (1 + c.eval.seed),
                                        mix, ops)
    candidate_groups = [candidates]
    report = {"skipped_rows": 0}
  else:
    def read(path):
      return sources.read_rows(path, prompt_field=d.prompt_field, answer_field=d.answer_field,
                               on_error=d.on_error, reward_field=d.reward_field,
                               tests_field=d.tests_field, layout=d.layout)

    train_report = read(d.train_path) if d.train_path else sources.ReadReport([], [])
    train, skipped = train_report.rows, list(train_report.skipped)
    # Several eval files (comma-separated) are reported per dataset: rows carry its name.
    candidate_groups = []
    for path in eval_paths(d.eval_path):
      eval_report = read(path)
      skipped += eval_report.skipped
      candidate_groups.append([dict(r, dataset=dataset_name(path)) for r in eval_report.rows])
    report = {"skipped_rows": len(skipped), "skipped_examples": skipped[:5]}
  held_out = []
  seen = {r["prompt"] for r in train}
  for rows in candidate_groups:  # num_problems per eval dataset
    held_out += _held_out(rows, seen, c.eval.num_problems)
  report["eval_problems"] = len(held_out)
  return train, held_out, report


def _held_out(rows: list[dict], train_prompts: set[str], num_problems: int) -> list[dict]:
  picked, prompts = [], set()
  for r in rows:
    if r["prompt"] not in train_prompts and r["prompt"] not in prompts:
      picked.append(r)
      prompts.add(r["prompt"])
    if len(picked) == num_problems:
      break
  if len(picked) < num_problems:
    print(f"[data] only {len(picked)} held-out eval problems in {picked[0].get('dataset', '')}"
          f" (asked for {num_problems}): the rest also appear in the training rows"
          if picked else "[data] no held-out eval problems", file=sys.stderr)
  return picked
