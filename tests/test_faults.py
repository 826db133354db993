"""Faults a long run meets: a resume under another config, a workdir reused by mistake, an
unreadable newest checkpoint, preemption (SIGTERM), SIGKILL anywhere in a run. Each is made to
happen for real: real workdirs and Orbax checkpoints, a real training subprocess sent a real
signal."""

import glob
import json
import os
import re
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
# Per-arm figures: seconds always, and which arms ran whenever the tuner chose by timing.
ARM_TIMED = ("arm_seconds/", "arm_chunk_fraction/", "arm_accept_len/")


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


def test_a_workdir_from_before_a_key_existed_resumes_with_it_at_its_default(tmp_path):
  """An upgrade that adds a config key must not strand older runs: their config.json lacks the
  key, and the key's default is the behaviour they ran with. Set otherwise, it is a change."""
  c = _smoke()
  workdir = _workdir_with_checkpoint(tmp_path, c)
  with open(os.path.join(workdir, "config.json")) as f:
    saved = json.load(f)
  del saved["rollout"]["lookup_bank"]  # as a run written before the key was added
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(saved, f)
  assert run_state.check_config(c, workdir) == {}
  c.rollout.lookup_bank = 4
  with pytest.raises(ValueError, match=r"^rollout\.lookup_bank=4: .* was run with "
                                       r"rollout\.lookup_bank=None"):
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


def _written(workdir, rows, **kw):
  with metrics.MetricsWriter(str(workdir), tensorboard=False, **kw) as w:
    for step, row in rows:
      w.write(step, row)
  return [(r.pop("step"), r) for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def test_a_run_killed_in_its_export_resumes_without_a_second_final_eval_row(tmp_path):
  """The last step's row, then its checkpoint, then the final eval row under the same step
  number; killed in the export, the run resumes from that checkpoint and evaluates again."""
  run = [(0, {"eval_accuracy": 0.5}), (1, {"reward_mean": 0.1}), (2, {"reward_mean": 0.2}),
         (2, {"eval_accuracy": 0.75})]
  _written(tmp_path, run)
  assert _written(tmp_path, [(2, {"eval_accuracy": 0.75})], resume_step=2) == run
  # Resumed from step 1: its row stays, the rest is written again.
  assert _written(tmp_path, run[2:], resume_step=1) == run


def test_a_run_killed_before_its_first_checkpoint_starts_its_metrics_over(tmp_path):
  _written(tmp_path, [(0, {"eval_accuracy": 0.5}), (1, {"reward_mean": 0.1})])
  assert _written(tmp_path, [(0, {"eval_accuracy": 0.5})], start_over=True) == [
      (0, {"eval_accuracy": 0.5})]


def _cli(workdir, steps):
  """A short smoke run, every step checkpointed, as a user starts it. One length bucket for
  the trainer's chunks (one train-step program, not three): each of the chain's restarts traces
  and lowers every program again, the persistent cache saves only XLA's compile."""
  return [sys.executable, "-m", "tlt_jax.train", f"--config={TINY_ARITH_CONFIG}:smoke",
          f"--config.workdir={workdir}", f"--config.rl.steps={steps}",
          "--config.eval.num_problems=8", "--config.checkpoint.every=1",
          "--config.rollout.buckets=(4,16)", "--config.rl.length_bucket=128",
          "--config.metrics.plots=False",
          "--config.metrics.tensorboard=False", "--config.metrics.progress=False"]


def _rows(workdir):
  return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("arm_seconds/")}
          for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


def _adapter(workdir):
  return safetensors.numpy.load_file(
      os.path.join(workdir, "export", "adapter", "adapter_model.safetensors"))


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one host device, as a user's CLI run has
  return env


STEPS = 3  # the length of the runs below, which all compare with one uninterrupted run


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The uninterrupted run: STEPS steps, every step checkpointed."""
  workdir = tmp_path_factory.mktemp("straight")
  subprocess.run(_cli(workdir, STEPS), cwd=job.REPO_ROOT, env=_env(), check=True,
                 capture_output=True, timeout=900)
  return workdir


def _assert_same_run(straight, other):
  """Bitwise the same run: metrics rows (timings aside) and the final LoRA adapter."""
  assert _rows(straight) == _rows(other)
  a, b = _adapter(straight), _adapter(other)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])


def test_sigterm_checkpoints_exits_zero_and_the_same_command_resumes_bitwise(straight, tmp_path):
  """Preemption: SIGTERM during step 2 of 3 -> the step finishes, its checkpoint is committed,
  exit 0; the same command then resumes and the run is bitwise the uninterrupted one."""
  preempted = tmp_path / "preempted"
  proc = subprocess.Popen(_cli(preempted, STEPS), cwd=job.REPO_ROOT, env=_env(),
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
  assert summary["preempted"] and 1 <= summary["step"] < STEPS
  assert not (preempted / "summary.json").exists()
  resumed = subprocess.run(_cli(preempted, STEPS), cwd=job.REPO_ROOT, env=_env(),
                           capture_output=True, text=True, timeout=900)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert f"resumed from {preempted}/checkpoints step {summary['step']}" in resumed.stderr
  _assert_same_run(straight, preempted)


def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before(straight, tmp_path):
  """A newest step whose metadata was cut short (a dying disk, a copy interrupted): the
  resume says so, restores the step before it, and the run ends bitwise the uninterrupted
  one."""
  damaged = tmp_path / "damaged"
  shutil.copytree(straight, damaged)
  for name in ("export", "summary.json"):
    shutil.rmtree(damaged / name) if name == "export" else os.remove(damaged / name)
  with open(damaged / "config.json") as f:
    config = json.load(f)
  config["workdir"] = str(damaged)  # the copy's own workdir: a key a resume may change anyway
  meta = damaged / "checkpoints" / str(STEPS) / "meta" / "metadata"
  assert meta.exists(), sorted(os.listdir(meta.parent))
  meta.write_bytes(meta.read_bytes()[:7])
  resumed = subprocess.run(_cli(damaged, STEPS), cwd=job.REPO_ROOT, env=_env(),
                           capture_output=True, text=True, timeout=900)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert (f"checkpoint step {STEPS} in" in resumed.stderr
          and f"falling back to step {STEPS - 1}" in resumed.stderr)
  assert f"resumed from {damaged}/checkpoints step {STEPS - 1}" in resumed.stderr
  _assert_same_run(straight, damaged)


# -- SIGKILL anywhere: a chain of kills on one workdir, each resumed by the same command

KILL_SEED = int(os.environ.get("TLT_KILL_SEED", "26"))

# Where each kill of the chain aims, in order. The test watches the workdir (and the run's own
# "[train] resumed from" / "starting at step 0" line) for the event a point follows, then kills
# after a seeded delay: a fraction of the phase's duration in the uninterrupted run.
#   rollout       the first step this run takes, during its rollout (after the start line)
#   update        the same step, during its train update
#   checkpoint    a step's async checkpoint write, right after its tmp directory appears
#   next_rollout  once a step's checkpoint is committed, the next step's rollout (begun while
#                 the write went on) or, after the last step's, the final eval
#   spill         a step's drafter buffer spill, right after it starts (TLT)
#   export        the final export
# With 3 steps: step 1 killed three times before its checkpoint commits (rollout, update, its
# write), step 2 in its rollout and in its write, step 3 in its rollout, then the final eval,
# and the last run dies in its export. Every kill is a restart (tracing, loading the compiled
# programs), so no kind of point comes more than twice.
PLAIN_CHAIN = ("rollout", "update", "checkpoint", "next_rollout", "checkpoint", "next_rollout",
               "next_rollout", "export")
_EVENT = {"rollout": "start", "update": "start", "checkpoint": "checkpoint",
          "next_rollout": "commit", "spill": "spill", "export": "export"}
# event: (glob under the workdir, the paths of it that count)
_WATCHED = {"checkpoint": ("checkpoints/*", r"checkpoints/\d+\.orbax-checkpoint-tmp$"),
            "commit": ("checkpoints/*", r"checkpoints/\d+$"),
            "spill": ("drafter_buffer/step_*", r"step_\d+$"), "export": ("export/**", r"")}
_START = re.compile(r"\[train\] (?:resumed from \S+ step (\d+)|starting at step 0)")


def _mtimes(workdir, watched) -> dict:
  pattern, counts = watched
  out = {}
  for path in glob.glob(os.path.join(workdir, pattern), recursive=True):
    if not re.search(counts, path):
      continue
    try:
      out[path] = os.stat(path).st_mtime_ns
    except FileNotFoundError:  # removed between the listing and the stat
      pass
  return out


def _wait(proc, what, found, every=0.002, timeout=600.0):
  """Polls `found()` until it returns something; fails if the run ends first."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    value = found()
    if value is not None:
      return value
    if proc.poll() is not None:
      raise AssertionError(f"the run exited ({proc.returncode}) before {what}")
    time.sleep(every)
  raise AssertionError(f"no {what} within {timeout:.0f} s")


def _left_behind(workdir) -> str:
  """What a kill left on disk: committed steps, checkpoints in flight, spills without their
  index, an export."""
  ckpt = os.path.join(workdir, "checkpoints")
  names = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
  committed = [n for n in names if n.isdigit()]
  in_flight = [n.split(".")[0] for n in names if ".orbax-checkpoint-tmp" in n]
  partial_spills = [os.path.basename(d)[5:] for d in glob.glob(f"{workdir}/drafter_buffer/step_*")
                    if not os.path.exists(os.path.join(d, "index.json"))]
  return (f"committed {committed}, in flight {in_flight}"
          + (f", partial spills {partial_spills}" if partial_spills else "")
          + (", export started" if os.path.isdir(os.path.join(workdir, "export")) else ""))


class _StartLine:
  """Reads a run's stderr log as it grows (only the new bytes: the log is long) for the line
  the loop prints as it begins; returns the step it resumed from (0: a new run)."""

  def __init__(self, path):
    self.path, self.offset, self.tail = path, 0, ""

  def __call__(self) -> int | None:
    with open(self.path, errors="replace") as f:
      f.seek(self.offset)
      new = f.read()
      self.offset = f.tell()
    text, self.tail = self.tail + new, (self.tail + new)[-400:]  # a line split across reads
    m = _START.search(text)
    return None if m is None else int(m.group(1) or 0)


def _phase_times(straight) -> dict:
  """The uninterrupted run's step count and, per phase, its quickest step's seconds (rollout,
  update) and one eval's. The quickest, not each step's own: a step slowed by the other test
  worker's load (an update of 2.5 s beside 0.6 s ones) would aim a kill past the phase, past
  the step's checkpoint, and shift the rest of the chain; a kill aimed by the quickest step
  lands early in the phase at worst."""
  rows = [r for r in metrics.read_jsonl(os.path.join(straight, "metrics.jsonl"))
          if "reward_mean" in r]
  with open(os.path.join(straight, "summary.json")) as f:
    eval_s = json.load(f)["eval_s"] / 2
  return {"steps": max(r["step"] for r in rows), "eval": eval_s,
          "rollout": min(r["rollout_s"] for r in rows),
          "update": min(r["train_s"] for r in rows)}


def _kill_chain(workdir, cli, chain, times, rng, log) -> list[str]:
  """Starts `cli` on `workdir` once per point of `chain`, SIGKILLs it there; returns one line
  per kill: where it aimed, when it struck, what it left behind."""
  steps = times["steps"]
  kills = []
  for i, point in enumerate(chain):
    u = float(rng.uniform(0.1, 0.9))
    with open(log / f"kill{i}.err", "w") as err:
      proc = subprocess.Popen(cli, cwd=job.REPO_ROOT, env=_env(), stdout=subprocess.DEVNULL,
                              stderr=err)
      try:
        resumed = _wait(proc, "its start line", _StartLine(log / f"kill{i}.err"), every=0.01)
        first = resumed + 1  # the first step this run takes
        event = _EVENT[point]
        if event == "start":
          seen = f"the start (from step {resumed})"
        else:
          before = _mtimes(workdir, _WATCHED[event])

          def changed(watched=_WATCHED[event], before=before):
            # a path this run wrote, not one a killed run left behind
            now = _mtimes(workdir, watched)
            new = sorted(p for p, t in now.items() if before.get(p) != t)
            return new[0] if new else None
          path = _wait(proc, f"a change under {_WATCHED[event][0]}", changed)
          seen = os.path.relpath(path, workdir)
        if point in ("rollout", "update") and first > steps:  # resumed after the last step
          aim, delay = "final eval", u * times["eval"]
        elif point == "rollout":
          aim, delay = f"step {first} rollout", u * times["rollout"]
        elif point == "update":
          aim = f"step {first} update"
          delay = times["rollout"] + u * times["update"]
        elif point == "next_rollout":
          step = int(os.path.basename(seen))
          aim, delay = ((f"step {step + 1} rollout", u * times["rollout"])
                        if step < steps else ("final eval", u * times["eval"]))
        else:  # checkpoint, spill, export: at once, the write has only begun
          aim, delay = f"{point} write", u * 0.01
        time.sleep(delay)
        assert proc.poll() is None, (f"kill {i} ({aim}): the run ended ({proc.returncode}) "
                                     "before the kill")
      finally:
        proc.kill()
        proc.wait()
    kills.append(f"kill {i}: aim {aim}, {delay:.3f} s after {seen}; left {_left_behind(workdir)}")
    print(kills[-1], flush=True)
  return kills


def _killed_and_finished(straight, workdir, cli, chain, record_property) -> list[str]:
  """The chain of kills on `workdir`, then the same command once more to the end."""
  log = workdir.parent / f"{workdir.name}_logs"
  os.makedirs(log)
  t0 = time.monotonic()
  print(f"\nkill points, TLT_KILL_SEED={KILL_SEED}:")
  kills = _kill_chain(workdir, cli, chain, _phase_times(straight),
                      np.random.default_rng(KILL_SEED), log)
  where = f"TLT_KILL_SEED={KILL_SEED}:\n" + "\n".join(kills)
  record_property("kill_points", where)
  finished = subprocess.run(cli, cwd=job.REPO_ROOT, env=_env(), capture_output=True, text=True,
                            timeout=900, check=False)
  print(f"{len(kills)} kills and the finishing run: {time.monotonic() - t0:.1f} s")
  assert finished.returncode == 0, where + "\n" + finished.stderr[-2000:]
  assert any("in flight ['" in k for k in kills), where  # a kill struck during a write
  assert "export started" in kills[-1], where
  return kills


def test_killed_anywhere_resumes_bitwise(straight, tmp_path, record_property):
  """SIGKILL at 8 seeded points spread over a run (before its first checkpoint, in rollouts
  and updates, during async checkpoint writes, during the final export), each time resumed
  by the same command on the same workdir, which finally finishes: the run is bitwise the
  uninterrupted one."""
  workdir = tmp_path / "killed"
  _killed_and_finished(straight, workdir, _cli(workdir, STEPS), PLAIN_CHAIN, record_property)
  _assert_same_run(straight, workdir)


# Two rollout groups with speculative decoding and the drafter spot-trained on idle devices,
# its buffer spilled beside every checkpoint (tests/test_train.py's small TLT setup).
TLT_FLAGS = ["--config.rollout.groups=2", "--config.tlt.enabled=True", "--config.tlt.arms=chain3",
             "--config.tlt.rows=4", "--config.tlt.row_len=64", "--config.tlt.spill_buffer=True"]
# How many drafter steps fit in the devices' idle time is the clock's to say, so the drafter
# (its params, its drafter_* metrics) and what it changes (accept lengths, the tuner's arms)
# differ between two uninterrupted runs too; the tokens, rewards, LoRA update and the buffer
# the drafter trains on do not.
TLT_TIMED = TIMING | {"idle_device_s", "accept_len", "sd_chunk_fraction"}
TLT_CHAIN = ("spill", "checkpoint", "next_rollout", "spill", "update", "checkpoint",
             "next_rollout", "spill", "checkpoint", "export")


def _tlt_rows(workdir):
  return [{k: v for k, v in r.items()
           if k not in TLT_TIMED and not k.startswith(("drafter_", *ARM_TIMED))}
          for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))]


@pytest.mark.skipif(os.environ.get("TLT_KILL_TLT", "") in ("", "0"),
                    reason="the TLT kill chain (twice the plain one) runs with TLT_KILL_TLT=1")
def test_killed_anywhere_with_drafter_spills_resumes_bitwise(tmp_path, record_property):
  """The kill chain on a TLT run, three of its kills as a step's drafter buffer spill starts:
  the run ends bitwise the uninterrupted one (rows, adapter) and so does the buffer spilled
  with its last checkpoint."""
  from tlt_jax.tlt.buffer import DrafterBuffer

  straight, workdir = tmp_path / "straight", tmp_path / "killed"
  subprocess.run(_cli(straight, STEPS) + TLT_FLAGS, cwd=job.REPO_ROOT, env=_env(), check=True,
                 capture_output=True, timeout=900)
  kills = _killed_and_finished(straight, workdir, _cli(workdir, STEPS) + TLT_FLAGS, TLT_CHAIN,
                               record_property)
  assert any("spill" in k.split(";")[0] for k in kills)
  assert _tlt_rows(straight) == _tlt_rows(workdir)
  a, b = _adapter(straight), _adapter(workdir)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  buffers = [sorted(DrafterBuffer.load(str(w / "drafter_buffer" / f"step_{STEPS}")).examples(),
                    key=lambda e: (e.step, e.sample_id)) for w in (straight, workdir)]
  assert len(buffers[0]) == len(buffers[1]) > 0
  for x, y in zip(*buffers):
    assert (x.step, x.sample_id) == (y.step, y.sample_id)
    for field in ("tokens", "response_mask", "hidden"):
      np.testing.assert_array_equal(getattr(x, field), getattr(y, field))
