"""The RL job end to end on the smoke config: reward improves, sampler == trainer log-probs,
every output is written; resume is bitwise (N steps == k steps, stop, resume, N - k steps)."""

import json
import os

import jax
import numpy as np
import pytest
import safetensors.numpy

from tlt_jax import config as config_lib
from tlt_jax import metrics, train

CONFIG = os.path.join(train.REPO_ROOT, "experiments", "configs", "tiny_arith.py")
TIMING = {"rollout_s", "reward_wait_s", "train_s", "step_s", "rollout_tokens_per_s"}
TLT_ONLY = {"accept_len", "sd_chunk_fraction", "buffer_tokens", "idle_device_s"}  # + drafter_*


def _config(variant="smoke"):
  return config_lib.load_config_file(CONFIG, variant)


def test_smoke_run_improves_and_is_on_policy(smoke_run):
  workdir, summary = smoke_run
  assert summary["steps"] == 6 and summary["eval_problems"] == 64
  records = [r for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
             if "reward_mean" in r]
  first, last = records[0]["reward_mean"], np.mean([r["reward_mean"] for r in records[-3:]])
  assert last > first, (first, last)
  # The same 64 held-out problems under the same sampling noise, before and after.
  assert summary["eval_accuracy_after"] >= summary["eval_accuracy_before"] + 0.1, summary
  assert summary["kl_sample_train_max"] == 0.0 and summary["logp_abs_diff_max"] == 0.0


def test_smoke_run_writes_its_outputs(smoke_run):
  workdir, summary = smoke_run
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f)["eval_accuracy_after"] == summary["eval_accuracy_after"]
  for key in ("eval_accuracy_before", "eval_accuracy_after", "steps", "wall_s", "rollout_s",
              "train_s", "kl_sample_train_max"):
    assert summary[key] is not None
  assert set(summary["plots"]) == {"plots/reward_accuracy.png", "plots/response_length.png",
                                   "plots/time_split.png", "plots/live_slots.png"}
  scalars = metrics.read_tensorboard_scalars(os.path.join(workdir, "tb"))
  assert [s for s, _ in scalars["reward_mean"]] == list(range(1, 7))
  adapter = os.path.join(workdir, "export", "adapter")
  assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
  from tlt_jax.model import hf
  merged = hf.load_model(os.path.join(workdir, "export", "merged"))  # a whole HF checkpoint
  assert hf.load_tokenizer(os.path.join(workdir, "export", "merged")).encode("12+3=").ids
  assert merged.cfg.num_layers == 4
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3", "6"]


def _rows(workdir, drop=TIMING):
  return [{k: v for k, v in r.items() if k not in drop and not k.startswith("drafter_")}
          for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def _adapter(workdir):
  return safetensors.numpy.load_file(
      os.path.join(workdir, "export", "adapter", "adapter_model.safetensors"))


def _assert_same_adapter(a, b):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])


def test_tlt_changes_nothing_but_time(tmp_path):
  """Speculative decoding (gumbel) across two rollout groups with the drafter trained on idle
  devices gives the run without any of it: same tokens (so rewards), losses and LoRA params."""
  def config(workdir, tlt):
    c = _config()
    c.workdir, c.rl.steps = str(workdir), 2
    c.eval.num_problems = 8
    c.rollout.buckets = (4, 16)
    c.metrics.plots = c.metrics.tensorboard = False
    if tlt:
      c.rollout.groups = 2
      c.tlt.enabled, c.tlt.arms, c.tlt.rows, c.tlt.row_len = True, "chain3", 4, 64
    return c

  off = train.run(config(tmp_path / "off", False))
  on = train.run(config(tmp_path / "on", True))
  assert on["tlt"] and on["spot_training"] and not off["tlt"]
  assert on["drafter_steps"] > 0  # the drafter really trained during the rollouts
  records = metrics.read_jsonl(str(tmp_path / "on" / "metrics.jsonl"))
  assert max(r.get("sd_chunk_fraction", 0.0) for r in records) > 0.0  # and SD really ran
  assert max(r.get("drafter_published", 0) for r in records) >= 1  # new weights went out
  drop = TIMING | TLT_ONLY
  assert _rows(tmp_path / "off", drop) == _rows(tmp_path / "on", drop)
  _assert_same_adapter(_adapter(tmp_path / "off"), _adapter(tmp_path / "on"))


def test_resume_is_bitwise(tmp_path):
  def config(workdir, steps):
    c = _config()
    c.workdir, c.rl.steps = str(workdir), steps
    c.eval.num_problems, c.checkpoint.every = 8, 1
    c.rollout.buckets = (4, 16)
    c.metrics.plots = c.metrics.tensorboard = False
    return c

  train.run(config(tmp_path / "straight", 3))
  train.run(config(tmp_path / "resumed", 1))
  summary = train.run(config(tmp_path / "resumed", 3))
  assert summary["resumed_from"] == 1

  def rows(name):  # same data order, rewards, losses, statistics
    return [r for r in _rows(tmp_path / name) if "reward_mean" in r]

  assert rows("straight") == rows("resumed")
  _assert_same_adapter(_adapter(tmp_path / "straight"), _adapter(tmp_path / "resumed"))
  import orbax.checkpoint as ocp

  for item in ("params", "opt_state"):  # the final checkpoints, leaf by leaf
    a, b = (ocp.StandardCheckpointer().restore(str(tmp_path / name / "checkpoints" / "3" / item))
            for name in ("straight", "resumed"))
    assert len(jax.tree.leaves(a)) == len(jax.tree.leaves(b)) > 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
