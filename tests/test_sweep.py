"""`python -m experiments.sweep`: grid parsing, and a 2-point sweep on the smoke config (one point
trains, one fails) that writes the CSV, the Markdown table and the comparison plot."""

import csv
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import TINY_ARITH_CONFIG

from experiments import sweep
from tlt_jax import metrics


def test_grid_points_multiply_axes_and_add_explicit_points():
  points = sweep.grid_points(["lora.rank=1,8", "rl.lr=1e-3,2e-3"],
                             ["lora.rank=0,rl.lr=2e-4"], ["rl.steps=4"])
  assert points[0] == {"rl.steps": "4", "lora.rank": "1", "rl.lr": "1e-3"}
  assert [(p["lora.rank"], p["rl.lr"]) for p in points] == [
      ("1", "1e-3"), ("1", "2e-3"), ("8", "1e-3"), ("8", "2e-3"), ("0", "2e-4")]
  assert sweep.point_label(points[-1], {"rl.steps": "4"}) == "lora.rank=0_rl.lr=2e-4"
  # Brackets keep their commas: a tuple-valued key is one value.
  assert sweep.split_values("(4,16),(4,16,32)") == ["(4,16)", "(4,16,32)"]
  assert sweep.grid_points(["rollout.buckets=(4,16),(8,)"], [], [])[1] == {
      "rollout.buckets": "(8,)"}
  with pytest.raises(ValueError, match="duplicate points"):
    sweep.grid_points(["lora.rank=1,1"], [], [])
  with pytest.raises(ValueError, match="key=value"):
    sweep.grid_points(["lora.rank"], [], [])


def test_sweep_writes_table_and_plot_and_reports_a_failed_point(tmp_path):
  out = tmp_path / "sweep"
  cmd = [sys.executable, "-m", "experiments.sweep", f"--config={TINY_ARITH_CONFIG}:smoke",
         "--grid", "rl.algorithm=grpo,bogus", "--set", "rl.steps=2",
         "--set", "rl.length_bucket=128",  # one train-step program per point
         "--set", "eval.num_problems=8", "--set", "checkpoint.export_adapter=false",
         "--set", "checkpoint.export_merged=false", "--set", "metrics.tensorboard=false",
         "--set", "metrics.plots=false", f"--out={out}"]
  proc = subprocess.run(cmd, cwd=sweep.REPO_ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1, proc.stderr[-3000:]  # a failed point: non-zero, after the rest
  result = json.loads(proc.stdout)
  assert result["points"] == 2 and result["ok"] == 1
  assert result["failed"] == ["rl.algorithm=bogus"]
  with open(out / "results.csv") as f:
    rows = list(csv.DictReader(f))
  assert [(r["set:rl.algorithm"], r["status"]) for r in rows] == [("grpo", "ok"),
                                                                  ("bogus", "failed")]
  ok, failed = rows
  assert "bogus" in failed["error"]
  assert ok["workdir"] == "points/rl.algorithm=grpo"
  with open(out / ok["workdir"] / "summary.json") as f:
    point = json.load(f)
  assert point["steps"] == 2
  # The table's figures are the point's own (its summary, its per-step metrics).
  assert float(ok["eval_accuracy_after"]) == point["eval_accuracy_after"]
  steps = [r for r in metrics.read_jsonl(out / ok["workdir"] / "metrics.jsonl")
           if "reward_mean" in r]
  assert float(ok["step_s_mean"]) == pytest.approx(np.mean([r["step_s"] for r in steps]))
  table = (out / "results.md").read_text()
  assert "| rl.algorithm | status |" in table and "| grpo | ok |" in table
  assert "Failed points:" in table and "`rl.algorithm=bogus`" in table
  assert (out / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
