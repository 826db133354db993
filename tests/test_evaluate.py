"""`python -m tlt_jax.evaluate`: avg@K / pass@K match a hand count of the samples; a run's final
eval is reproduced exactly from its workdir and from its PEFT adapter; bad checkpoints fail
clearly."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import TINY_ARITH_CONFIG

from tlt_jax import config as config_lib
from tlt_jax import evaluate, job


def _config(num_problems=6, samples=3):
  c = config_lib.load_config_file(TINY_ARITH_CONFIG, "smoke")
  c.eval.num_problems, c.eval.samples = num_problems, samples
  return c


def _final_number(text: str):
  """The hand count's own reading of an answer: the last integer the model wrote."""
  numbers = re.findall(r"-?\d+", text.replace(",", ""))
  return int(numbers[-1]) if numbers else None


def test_avg_and_pass_at_k_match_a_hand_count():
  report = evaluate.run_eval(_config(), samples=3, records=True)
  records = report["records"]
  assert len(records) == 6 * 3 and report["problems"] == 6
  right = {}
  for r in records:
    right.setdefault(r["problem"], []).append(_final_number(r["text"]) == int(r["answer"]))
  hand_avg = sum(sum(v) for v in right.values()) / 18
  hand_pass = sum(any(v) for v in right.values()) / 6
  assert report["avg@3"] == pytest.approx(hand_avg) and report["pass@3"] == pytest.approx(hand_pass)
  # The tiny model slips when it samples: both outcomes occur, so the count is not trivial.
  assert 0 < hand_avg < 1, records
  by_digits = report["by_digits"]
  assert sum(g["problems"] for g in by_digits.values()) == 6
  assert sum(g["avg@3"] * g["problems"] for g in by_digits.values()) / 6 == pytest.approx(hand_avg)


def test_run_final_eval_is_reproduced_from_workdir_and_adapter(smoke_run, tmp_path):
  workdir, summary = smoke_run
  c = config_lib.load_config_file(TINY_ARITH_CONFIG, "smoke")
  out = str(tmp_path / "report.json")
  from_run = evaluate.run_eval(c, checkpoint=workdir, out=out)
  assert from_run["accuracy"] == summary["eval_accuracy_after"]
  assert from_run["problems"] == summary["eval_problems"] == 64
  with open(out) as f:
    assert json.load(f)["avg@1"] == from_run["avg@1"]
  from_adapter = evaluate.run_eval(c, checkpoint=os.path.join(workdir, "export", "adapter"))
  assert from_adapter["accuracy"] == summary["eval_accuracy_after"]
  c.eval.num_problems = 8
  step3 = evaluate.run_eval(c, checkpoint=workdir, step=3)
  assert step3["checkpoint"].endswith("step 3") and step3["problems"] == 8
  c.lora.rank = 4
  with pytest.raises(ValueError, match=r"lora.rank: run 8, config 4"):
    evaluate.run_eval(c, checkpoint=workdir)


def test_cli_writes_a_json_report(tmp_path):
  out = tmp_path / "eval.json"
  proc = subprocess.run(
      [sys.executable, "-m", "tlt_jax.evaluate", f"--config={TINY_ARITH_CONFIG}:smoke",
       "--samples=2", "--config.eval.num_problems=4", f"--out={out}", "--records",
       "--config.metrics.progress=false"],
      cwd=job.REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["problems"] == 4 and report["samples"] == 2
  # avg@2 and pass@2 from the per-sample scores (a problem passes when any sample is right)
  correct = np.zeros((4, 2), bool)
  for r in report["records"]:
    correct[r["problem"], r["sample"]] = r["correct"]
  assert len(report["records"]) == 8
  assert report["avg@2"] == correct.mean() and report["pass@2"] == correct.any(axis=1).mean()
  missing = subprocess.run(
      [sys.executable, "-m", "tlt_jax.evaluate", f"--config={TINY_ARITH_CONFIG}:smoke",
       f"--checkpoint={tmp_path / 'nope'}"], cwd=job.REPO_ROOT, capture_output=True, text=True,
      timeout=300)
  assert missing.returncode != 0 and "no such directory" in missing.stderr
