"""The RL job end to end on the smoke config: reward improves, sampler == trainer log-probs,
every output is written; resume is bitwise (N steps == k steps, stop, resume, N - k steps)."""

import importlib.util
import json
import os

import numpy as np
import pytest
import safetensors.numpy

from tlt_jax import metrics, train

CONFIG = os.path.join(train.REPO_ROOT, "experiments", "configs", "tiny_arith.py")
TIMING = {"rollout_s", "reward_wait_s", "train_s", "step_s", "rollout_tokens_per_s"}


def _config(variant="smoke"):
  spec = importlib.util.spec_from_file_location("tiny_arith", CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  c = _config()
  c.workdir = str(tmp_path_factory.mktemp("smoke"))
  return c.workdir, train.run(c, "tiny_arith-smoke")


def test_smoke_run_improves_and_is_on_policy(smoke):
  workdir, summary = smoke
  assert summary["steps"] == 6 and summary["eval_problems"] == 64
  records = [r for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
             if "reward_mean" in r]
  first, last = records[0]["reward_mean"], np.mean([r["reward_mean"] for r in records[-3:]])
  assert last > first, (first, last)
  # The same 64 held-out problems under the same sampling noise, before and after.
  assert summary["eval_accuracy_after"] >= summary["eval_accuracy_before"] + 0.1, summary
  assert summary["kl_sample_train_max"] == 0.0 and summary["logp_abs_diff_max"] == 0.0


def test_smoke_run_writes_its_outputs(smoke):
  workdir, summary = smoke
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
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3", "6"]


def test_resume_is_bitwise(tmp_path):
  def config(workdir, steps):
    c = _config()
    c.workdir, c.rl.steps = str(workdir), steps
    c.eval.num_problems, c.checkpoint.every = 8, 2
    c.metrics.plots = c.metrics.tensorboard = False
    return c

  train.run(config(tmp_path / "straight", 4))
  train.run(config(tmp_path / "resumed", 2))
  summary = train.run(config(tmp_path / "resumed", 4))
  assert summary["resumed_from"] == 2

  def rows(name):
    return [{k: v for k, v in r.items() if k not in TIMING}
            for r in metrics.read_jsonl(str(tmp_path / name / "metrics.jsonl"))
            if "reward_mean" in r]

  assert rows("straight") == rows("resumed")  # same data order, rewards, losses, statistics
  def adapter(name):
    return safetensors.numpy.load_file(
        str(tmp_path / name / "export" / "adapter" / "adapter_model.safetensors"))
  straight, resumed = adapter("straight"), adapter("resumed")
  assert straight.keys() == resumed.keys()
  for k in straight:
    np.testing.assert_array_equal(straight[k], resumed[k])
