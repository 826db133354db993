"""Two processes on 127.0.0.1 (gloo collectives on CPU, 2 host devices each) run two RL steps of
the smoke config with TLT on, the second in a job resumed from the first's checkpoint: each
decodes its own prompts (with spot drafter training on its own devices), the rollouts are
gathered, and one trainer, fsdp-sharded over both processes' devices, trains on the whole
batch. They must agree: bitwise-equal LoRA weights, one drafter (the barrier averages the
processes' drafters), equal step metrics, sampler log-probs equal to the cross-host trainer's
bitwise, and each checkpoint written once."""

import json
import os
import socket
import subprocess
import sys

from tlt_jax import metrics

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_worker.py")
# Per-process figures: time, and the TLT side of each process's own rollout.
LOCAL = {"rollout_s", "reward_wait_s", "train_s", "step_s", "rollout_tokens_per_s", "accept_len",
         "sd_chunk_fraction", "buffer_tokens", "idle_device_s"}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_run_rl_steps_with_tlt_resume_and_agree(tmp_path):
  port, workdir = _free_port(), tmp_path / "run"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [subprocess.Popen([sys.executable, WORKER, str(pid), str(port), str(workdir),
                             str(tmp_path / f"out{pid}.json")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=600)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for pid, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, f"process {pid}:\n{log[-4000:]}"
  # Per process: [the step-1 job, the job that resumed from its checkpoint for step 2].
  (first_0, out_0), (first_1, out_1) = (
      json.loads((tmp_path / f"out{pid}.json").read_text()) for pid in (0, 1))
  first, out = [first_0, first_1], [out_0, out_1]
  assert first[0]["trainable_sha256"] == first[1]["trainable_sha256"]
  assert [o["resumed_from"] for o in first + out] == [None, None, 1, 1]
  assert out[0]["processes"] == 2 and len(out[0]["trainable_sha256"]) == 64
  assert out[0]["trainable_sha256"] == out[1]["trainable_sha256"]
  # Step 2 moved the weights (its AdamW moments came back from step 1's checkpoint).
  assert out[0]["trainable_sha256"] != first[0]["trainable_sha256"]
  # One trainer over both processes' devices, not a replica per process.
  for o in first + out:
    assert o["train_mesh"] == {"data": 1, "fsdp": 4, "model": 1, "processes": 2}
  # Each process trained its drafter on its own rollouts; the barrier averaged them into one.
  assert out[0]["drafter_sha256"] == out[1]["drafter_sha256"]
  assert out[0]["eval_accuracy_after"] == out[1]["eval_accuracy_after"]

  rows = [[r for r in metrics.read_jsonl(os.path.join(d, "metrics.jsonl")) if "reward_mean" in r]
          for d in (workdir, workdir / "process_1")]
  assert len(rows[0]) == len(rows[1]) == 2
  for step in (0, 1):
    shared = {k: v for k, v in rows[0][step].items()
              if k not in LOCAL and not k.startswith(("drafter_", "arm_"))}
    assert shared == {k: rows[1][step][k] for k in shared}
    # Batch-invariant numerics with the trainer's rows split across hosts: still on-policy.
    assert rows[0][step]["logp_abs_diff_max"] == 0.0 and rows[0][step]["kl_sample_train"] == 0.0
  # A group with mixed rewards (step 1 at these seeds) sent a nonzero gradient across the hosts.
  assert max(r["grad_norm"] for r in rows[0]) > 0
  # Step 2 trained the drafter on step 1's rollouts (the spilled buffer, reloaded on resume);
  # both processes publish the same version.
  assert rows[0][1]["drafter_steps"] + rows[1][1]["drafter_steps"] > 0
  assert rows[0][1]["drafter_published"] == rows[1][1]["drafter_published"] == 1
  # Both processes decoded with the drafter (some of their chunks ran the chain2 program; an
  # accept_len > 0 held for plain decode too, at 1.0), each on its own prompts (its own buffer).
  assert rows[0][0]["sd_chunk_fraction"] > 0 and rows[1][0]["sd_chunk_fraction"] > 0
  # Each checkpointed step's spill, per process (run_state: a spill belongs to its step).
  assert sorted(os.listdir(workdir / "drafter_buffer")) == ["step_1", "step_2"]
  for step in ("step_1", "step_2"):
    assert sorted(os.listdir(workdir / "drafter_buffer" / step)) == ["process_0", "process_1"]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "2"]
  assert ((workdir / "summary.json").exists()
          and not (workdir / "process_1" / "summary.json").exists())
