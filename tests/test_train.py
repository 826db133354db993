"""The RL job end to end on the smoke config: reward improves, sampler == trainer log-probs,
every output is written; resume is bitwise (N steps == k steps, stop, resume, N - k steps)."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy

from tests.conftest import on_devices
from tlt_jax import config as config_lib
from tlt_jax import job, metrics, train
from tlt_jax.rollout import drafter_text

CONFIG = os.path.join(job.REPO_ROOT, "experiments", "configs", "tiny_arith.py")
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
  # The summary's figures are the per-step records' (metrics.jsonl), not merely present.
  records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  steps = [r for r in records if "reward_mean" in r]
  evals = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
  assert summary["steps"] == len(steps) == 6
  assert (summary["eval_accuracy_before"], summary["eval_accuracy_after"]) == (evals[0], evals[-1])
  for key in ("rollout_s", "train_s"):
    assert summary[key] == pytest.approx(sum(r[key] for r in steps), rel=1e-9), key
  assert summary["kl_sample_train_max"] == max(abs(r["kl_sample_train"]) for r in steps)
  assert summary["wall_s"] > summary["rollout_s"] + summary["train_s"] > 0
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
  # arm_*: per-arm tuner figures (seconds; which arms ran is chosen by timing)
  return [{k: v for k, v in r.items() if k not in drop and not k.startswith(("drafter_", "arm_"))}
          for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def _adapter(workdir):
  return safetensors.numpy.load_file(
      os.path.join(workdir, "export", "adapter", "adapter_model.safetensors"))


def _assert_same_adapter(a, b):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])


def _short_config(workdir, steps: int, tlt: bool = False):
  """Two-bucket smoke runs of a few steps, checkpointed every step, with one train-step program
  to compile (one length bucket for the trainer's chunks)."""
  c = _config()
  c.workdir, c.rl.steps = str(workdir), steps
  c.eval.num_problems, c.checkpoint.every = 8, 1
  c.rollout.buckets, c.rl.length_bucket = (4, 16), 128
  c.metrics.plots = c.metrics.tensorboard = False
  if tlt:
    c.rollout.groups = 2
    c.tlt.enabled, c.tlt.arms, c.tlt.rows, c.tlt.row_len = True, "chain3", 4, 64
  return c


@pytest.fixture(scope="module", autouse=True)
def _on_two_devices():
  """The TLT run has two rollout groups, a device each; every run it is compared with runs on
  the same platform (the host's devices on a single-accelerator machine: `on_devices`)."""
  with on_devices(2) as devices:
    yield devices


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, _on_two_devices):
  """Two steps straight, SD off: the reference of the TLT and the resume tests."""
  workdir = tmp_path_factory.mktemp("plain")
  return workdir, train.run(_short_config(workdir, 2))


def test_tlt_changes_nothing_but_time(plain_run, tmp_path):
  """Speculative decoding (gumbel) across two rollout groups with the drafter trained on idle
  devices gives the run without any of it: same tokens (so rewards), losses and LoRA params."""
  off_dir, off = plain_run
  on = train.run(_short_config(tmp_path / "on", 2, tlt=True))
  assert on["tlt"] and on["spot_training"] and not off["tlt"]
  assert on["drafter_steps"] > 0  # the drafter really trained during the rollouts
  records = metrics.read_jsonl(str(tmp_path / "on" / "metrics.jsonl"))
  assert max(r.get("sd_chunk_fraction", 0.0) for r in records) > 0.0  # and SD really ran
  assert max(r.get("drafter_published", 0) for r in records) >= 1  # new weights went out
  drop = TIMING | TLT_ONLY
  assert _rows(off_dir, drop) == _rows(tmp_path / "on", drop)
  _assert_same_adapter(_adapter(off_dir), _adapter(tmp_path / "on"))


def _history_config(workdir, steps: int):
  c = _short_config(workdir, steps)
  c.rollout.groups = 2
  c.rollout.history_arms, c.rollout.history_global_tokens = "history_chain2,lookup_chain4", 256
  return c


@pytest.fixture(scope="module")
def history_run(tmp_path_factory, _on_two_devices):
  """Two steps straight with model-free arms across two rollout groups."""
  workdir = tmp_path_factory.mktemp("hist")
  return workdir, train.run(_history_config(workdir, 2))


def test_history_arms_change_nothing_but_time(plain_run, history_run):
  """Model-free chains (rollout.history_arms, no learned drafter, tlt off), drafted on the host
  from each group's siblings and a global trie (history_chain2) and looked up on device in the
  bucket's rows and the bank of recent responses (lookup_chain4), across two rollout groups: the
  run without them, bitwise."""
  off_dir, _ = plain_run
  hist_dir, on = history_run
  assert not on["tlt"]
  records = metrics.read_jsonl(str(hist_dir / "metrics.jsonl"))
  assert max(r.get("sd_chunk_fraction", 0.0) for r in records) > 0.0  # history rounds ran
  # Per arm, each step: the fractions of decode chunks cover them all, and the model-free ones
  # are what sd_chunk_fraction counts (computed from the chunks separately).
  steps = [r for r in records if "reward_mean" in r]
  for r in steps:
    fractions = {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("arm_chunk_fraction/")}
    assert set(fractions) <= {"off", "history_chain2", "lookup_chain4"}
    assert sum(fractions.values()) == pytest.approx(1.0)
    assert 1.0 - fractions.get("off", 0.0) == pytest.approx(r["sd_chunk_fraction"])
    assert all(r[f"arm_accept_len/{arm}"] > 0 and r[f"arm_seconds/{arm}"] > 0 for arm in fractions)
  drop = TIMING | TLT_ONLY
  assert _rows(off_dir, drop) == _rows(hist_dir, drop)
  _assert_same_adapter(_adapter(off_dir), _adapter(hist_dir))


def _earlier_responses(workdir, step: int) -> list[dict]:
  """Per rollout group, the earlier responses its history holds per prompt at `step`, read from
  the text beside the checkpoint: {prompt: sorted responses} (sorted: the order samples finish
  in depends on which arms the tuner timed fastest)."""
  out = []
  for group in (0, 1):
    with np.load(workdir / "drafter_text" / f"step_{step}" / f"group_{group}.npz") as f:
      tokens, offsets, records = f["tokens"], f["offsets"], f["records"]
      prompt_tokens, prompt_offsets = f["prompt_tokens"], f["prompt_offsets"]
    per_prompt = {}
    for kind, p, r in records.tolist():
      if kind == drafter_text.HISTORY_GROUP:
        prompt = tuple(prompt_tokens[prompt_offsets[p]:prompt_offsets[p + 1]].tolist())
        per_prompt.setdefault(prompt, []).append(tuple(tokens[offsets[r]:offsets[r + 1]]))
    out.append({p: sorted(rs) for p, rs in per_prompt.items()})
  return out


def test_history_arms_resume_with_the_responses_they_drafted_from(history_run, tmp_path,
                                                                  capsys):
  """Stopped after step 1 and resumed, a run with model-free arms gets its history tries and
  lookup banks back from the text written beside step 1's checkpoint: after step 2 each
  rollout group's history holds the same earlier responses per prompt as the run that did not
  stop. A copy of the stopped run without that text resumes too, saying so in one line, its
  drafters empty: after step 2 they hold step 2's responses alone."""
  straight_dir, _ = history_run
  train.run(_history_config(tmp_path / "resumed", 1))
  shutil.copytree(tmp_path / "resumed", tmp_path / "no_text")
  shutil.rmtree(tmp_path / "no_text" / "drafter_text")
  assert train.run(_history_config(tmp_path / "resumed", 2))["resumed_from"] == 1
  step_1, step_2 = (_earlier_responses(straight_dir, s) for s in (1, 2))
  held = lambda groups: sum(len(rs) for g in groups for rs in g.values())
  assert held(step_1) > 0 and held(step_2) > held(step_1)
  assert _earlier_responses(tmp_path / "resumed", 2) == step_2
  assert sorted(os.listdir(tmp_path / "resumed" / "drafter_text")) == ["step_1", "step_2"]

  capsys.readouterr()
  assert train.run(_history_config(tmp_path / "no_text", 2))["resumed_from"] == 1
  missing = [line for line in capsys.readouterr().err.splitlines() if "drafter_text" in line]
  assert len(missing) == 2 and all("group_" in line and "is missing" in line
                                    and "start empty" in line for line in missing), missing
  assert held(_earlier_responses(tmp_path / "no_text", 2)) == held(step_2) - held(step_1)


def test_resume_is_bitwise(plain_run, tmp_path, _on_two_devices):
  """2 steps straight == 1 step, stop, resume, 1 step: the same data order, rewards, losses,
  statistics, adapter, and final checkpoint leaf by leaf."""
  straight_dir, _ = plain_run
  train.run(_short_config(tmp_path / "resumed", 1))
  summary = train.run(_short_config(tmp_path / "resumed", 2))
  assert summary["resumed_from"] == 1

  def rows(workdir):
    return [r for r in _rows(workdir) if "reward_mean" in r]

  assert len(rows(straight_dir)) == 2 and rows(straight_dir) == rows(tmp_path / "resumed")
  _assert_same_adapter(_adapter(straight_dir), _adapter(tmp_path / "resumed"))
  import orbax.checkpoint as ocp

  def restore(path):
    """Onto one of the run's devices: without a target Orbax looks for the devices it was saved
    from among the default backend's (one GPU, on a single-GPU machine)."""
    ck = ocp.StandardCheckpointer()
    one = jax.sharding.SingleDeviceSharding(_on_two_devices[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
                          ck.metadata(path).item_metadata)
    return ck.restore(path, target)

  for item in ("params", "opt_state"):  # the final checkpoints, leaf by leaf
    a, b = (restore(str(workdir / "checkpoints" / "2" / item))
            for workdir in (straight_dir, tmp_path / "resumed"))
    assert len(jax.tree.leaves(a)) == len(jax.tree.leaves(b)) > 0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
