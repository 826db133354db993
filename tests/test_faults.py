"""Faults a long run meets: a resume under another config, a workdir reused by mistake, an
unreadable newest checkpoint, preemption (SIGTERM). Each is made to happen for real: real
workdirs and Orbax checkpoints, a real training subprocess sent a real signal."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import safetensors.numpy
from conftest import TINY_ARITH_CONFIG

from tlt_jax import config as config_lib
from tlt_jax import job, metrics, run_state

TIMING = {"rollout_s", "reward_wait_s", "train_s", "step_s", "rollout_tokens_per_s"}


def _workdir_with_checkpoint(tmp_path, c):
  """A workdir as a run of `c` leaves it: its config.json and a committed step directory."""
  workdir = tmp_path / "run"
  os.makedirs(workdir / "checkpoints" / "1")
  c.workdir = str(workdir)
  with open(workdir / "config.json", "w") as f:
    f.write(c.to_json_best_effort(indent=2))
  return str(workdir)


def _smoke():
  return config_lib.load_config_file(TINY_ARITH_CONFIG, "smoke")


def test_resume_with_a_changed_key_names_it(tmp_path):
  c = _smoke()
  _workdir_with_checkpoint(tmp_path, c)
  c.rl.lr = c.rl.lr * 2
  with pytest.raises(ValueError, match=r"^rl\.lr=.*was run with rl\.lr=.*use a new workdir$"):
    run_state.check_workdir(c)
  c = _smoke()
  _workdir_with_checkpoint(tmp_path / "b", c)
  c.rl.algorithm = "dapo"
  with pytest.raises(ValueError, match=r"^rl\.algorithm='dapo': "):
    run_state.check_workdir(c)


def test_resume_may_change_steps_and_eval_and_it_is_recorded(tmp_path):
  c = _smoke()
  _workdir_with_checkpoint(tmp_path, c)
  steps, every = c.rl.steps, c.eval.every
  c.rl.steps, c.eval.every = steps + 4, every + 1
  run_state.check_workdir(c)  # no error
  with open(os.path.join(c.workdir, "config_changes.jsonl")) as f:
    change = json.loads(f.read())
  assert change == {"changed": {"eval.every": [every, every + 1],
                                "rl.steps": [steps, steps + 4]}}


def test_resume_false_on_a_workdir_with_checkpoints_fails_before_anything_runs(tmp_path):
  c = _smoke()
  _workdir_with_checkpoint(tmp_path, c)
  c.checkpoint.resume = False
  with pytest.raises(ValueError, match=r"^checkpoint\.resume=False but .*checkpoints holds "
                                       r"steps \[1\]"):
    run_state.check_workdir(c)


def _cli(workdir, steps):
  """A short smoke run, every step checkpointed, as a user starts it."""
  return [sys.executable, "-m", "tlt_jax.train", f"--config={TINY_ARITH_CONFIG}:smoke",
          f"--config.workdir={workdir}", f"--config.rl.steps={steps}",
          "--config.eval.num_problems=8", "--config.checkpoint.every=1",
          "--config.rollout.buckets=(4,16)", "--config.metrics.plots=False",
          "--config.metrics.tensorboard=False", "--config.metrics.progress=False"]


def _rows(workdir):
  return [{k: v for k, v in r.items() if k not in TIMING}
          for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def _adapter(workdir):
  return safetensors.numpy.load_file(
      os.path.join(workdir, "export", "adapter", "adapter_model.safetensors"))


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one host device, as a user's CLI run has
  return env


def test_sigterm_checkpoints_exits_zero_and_the_same_command_resumes_bitwise(tmp_path):
  """Preemption: SIGTERM during step 2 of 3 -> the step finishes, its checkpoint is committed,
  exit 0; the same command then resumes and the run is bitwise the uninterrupted one."""
  straight, preempted = tmp_path / "straight", tmp_path / "preempted"
  subprocess.run(_cli(straight, 3), cwd=job.REPO_ROOT, env=_env(), check=True,
                 capture_output=True, timeout=900)
  proc = subprocess.Popen(_cli(preempted, 3), cwd=job.REPO_ROOT, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 900
  while time.monotonic() < deadline and proc.poll() is None:
    rows = (metrics.read_jsonl(str(preempted / "metrics.jsonl"))
            if (preempted / "metrics.jsonl").exists() else [])
    if any(r.get("step") == 1 and "reward_mean" in r for r in rows):
      break
    time.sleep(0.2)
  assert proc.poll() is None, proc.communicate()[1][-2000:]
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-2000:]
  assert "[train] preempted: step" in err, err[-2000:]
  summary = json.loads(out[out.index("{"):])
  assert summary["preempted"] and 1 <= summary["step"] < 3
  assert not (preempted / "summary.json").exists()
  resumed = subprocess.run(_cli(preempted, 3), cwd=job.REPO_ROOT, env=_env(),
                           capture_output=True, text=True, timeout=900)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f"resumed from {preempted}/checkpoints step {summary['step']}" in resumed.stderr
  assert _rows(straight) == _rows(preempted)
  a, b = _adapter(straight), _adapter(preempted)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])


def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before(tmp_path):
  """A newest step whose metadata was cut short (a dying disk, a copy interrupted): the
  resume says so, restores the step before it, and the run ends bitwise the uninterrupted
  one."""
  straight, damaged = tmp_path / "straight", tmp_path / "damaged"
  subprocess.run(_cli(straight, 2), cwd=job.REPO_ROOT, env=_env(), check=True,
                 capture_output=True, timeout=900)
  shutil.copytree(straight, damaged)
  for name in ("export", "summary.json"):
    shutil.rmtree(damaged / name) if name == "export" else os.remove(damaged / name)
  with open(damaged / "config.json") as f:
    config = json.load(f)
  config["workdir"] = str(damaged)  # the copy's own workdir: a key a resume may change anyway
  meta = damaged / "checkpoints" / "2" / "meta" / "metadata"
  assert meta.exists(), sorted(os.listdir(meta.parent))
  meta.write_bytes(meta.read_bytes()[:7])
  resumed = subprocess.run(_cli(damaged, 2), cwd=job.REPO_ROOT, env=_env(),
                           capture_output=True, text=True, timeout=900)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert "checkpoint step 2 in" in resumed.stderr and "falling back to step 1" in resumed.stderr
  assert f"resumed from {damaged}/checkpoints step 1" in resumed.stderr
  assert _rows(straight) == _rows(damaged)
  a, b = _adapter(straight), _adapter(damaged)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
