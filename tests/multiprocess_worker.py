"""One process of tests/test_multiprocess.py: `python tests/multiprocess_worker.py PID PORT WORKDIR
OUT.json` runs RL step 1 of tiny_arith:smoke with TLT on, then a second job that resumes from its
checkpoint and runs step 2, as process PID of 2 (gloo on CPU, 2 host devices each), and writes
both summaries to OUT.json. Step 2 trains the drafter on step 1's rollouts (the buffer is empty
before that). The second job reuses the first's compiled programs (same process). The
trainer's mesh is fsdp over all 4 devices, so its parameters and optimizer state are sharded
across the two processes."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
# The path under test is CPU processes with gloo collectives: on a machine with an accelerator
# too (both processes would share it), the host devices are what each process uses.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["TLT_NO_PROGRESS"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tlt_jax import config as config_lib
from tlt_jax import train


def job(pid: int, port: int, workdir: str, steps: int) -> dict:
  c = config_lib.load_config_file(os.path.join(ROOT, "experiments", "configs", "tiny_arith.py"),
                                  "smoke")
  c.distributed.coordinator_address = f"127.0.0.1:{port}"
  c.distributed.num_processes, c.distributed.process_id = 2, pid
  c.workdir = workdir
  c.rl.steps = steps
  c.mesh.data, c.mesh.fsdp = 1, 4
  c.rollout.prompts_per_step, c.rollout.group_size = 4, 2  # 2 prompts per process
  c.rollout.max_new_tokens, c.rollout.buckets = 40, (2,)
  c.rl.length_bucket = 128  # one train-step program to compile, not three
  c.rollout.groups = 2  # one group per local device: the drafter trains on a finished group's
  c.tlt.enabled, c.tlt.arms, c.tlt.row_len = True, "chain2", 64
  # At this size both groups finish in the same chunk, leaving no idle time: a share above 1
  # lends a group to the drafter while it still decodes, so step 2 trains on both processes.
  c.tlt.min_live_share = 1.01
  c.eval.num_problems = 2
  c.checkpoint.export_merged = False
  c.metrics.plots = c.metrics.tensorboard = False
  summary = train.run(c, "multiprocess")
  return {k: summary.get(k) for k in ("trainable_sha256", "drafter_sha256", "eval_accuracy_after",
                                      "processes", "steps", "train_mesh", "resumed_from")}


def main(pid: int, port: int, workdir: str, out: str) -> None:
  summaries = [job(pid, port, workdir, steps) for steps in (1, 2)]
  with open(out, "w") as f:
    json.dump(summaries, f)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
