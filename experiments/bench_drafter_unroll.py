"""What `tlt.drafter_unroll` buys: drafter step time against accept length, for k = 1, 2, 3.

    python -m experiments.bench_drafter_unroll [--steps 600] [--rollouts 12] [--unrolls 1,2,3]

k = 1 trains the drafter by teacher forcing (EAGLE-1: every position reads the target's
feature); k > 1 also feeds its own features back for depths 2..k (EAGLE-3's training-time test),
which is what it reads when it drafts more than one token. Setup: the tiny_arith policy; one
buffer of its own rollouts (`--rollouts` batches, decoded once and spilled), then for each k a
drafter warmed up from the same initialization on the same buffer for `--steps` steps
(`tlt.warmup`, batch-invariant target, XLA drafter). Each is then measured on the same fresh
prompts (not in the buffer): chain4 and chain2 rollouts with gumbel verification, accept length
= tokens emitted per live row per round. The tokens are the policy's own in every case (the
verification keeps them), so only the accept length and the time change.

Reports per k: seconds per drafter step (the warm-up's median, after compile), final training
loss and top-1 agreement, and accept length per arm. Prints one JSON object and writes
experiments/results/drafter_unroll.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

from tlt_jax import compile_cache, determinism, logs, ops
from tlt_jax import config as config_lib
from tlt_jax import job as job_lib
from tlt_jax.data import splits
from tlt_jax.data.pipeline import prompt_dataset
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.tuner import OFF, Arm
from tlt_jax.tlt.drafter_trainer import load_drafter
from tlt_jax.tlt.warmup import warmup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "experiments", "results")
CONFIG = os.path.join(ROOT, "experiments", "configs", "tiny_arith.py")
EVAL_BATCHES = 2  # fresh prompt batches for the accept-length measurement
ARMS = ("chain2", "chain4")


def accept_lengths(c, drafter_dir: str) -> dict[str, float]:
  """Accept length per arm on fresh prompts (another seed than the warm-up's rollouts)."""

  model, _, formatter, eos_ids = job_lib.load_policy(c)
  drafter = load_drafter(drafter_dir, model.cfg)
  arms = (Arm(OFF), Arm("chain2", 2), Arm("chain4", 4))
  engine = RolloutEngine(model, EngineConfig.from_config(c, eos_ids, arms), drafter)
  train_rows, _, _ = splits.load_rows(c)
  data = iter(prompt_dataset(train_rows, batch_size=c.rollout.prompts_per_step, seed=12345))
  batches = [[formatter.encode(row["prompt"]) for row in next(data)] for _ in range(EVAL_BATCHES)]
  out = {}
  for arm in ARMS:
    start = len(engine.trace)
    for i, prompts in enumerate(batches):
      engine.generate(prompts, group_size=c.rollout.group_size, arm=arm, seed=1000 + i)
    chunks = [t for t in engine.trace[start:] if t.arm == arm]
    out[arm] = sum(t.emitted for t in chunks) / max(sum(t.live * t.rounds for t in chunks), 1)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--rollouts", type=int, default=12)
  parser.add_argument("--unrolls", default="1,2,3")
  args = parser.parse_args()
  unrolls = [int(k) for k in args.unrolls.split(",")]

  c = config_lib.load_config_file(CONFIG)
  logs.configure(c.log_level)
  cache_dir = compile_cache.configure(c.compile.cache_dir)
  print(f"[bench_drafter_unroll] compile cache: {cache_dir or 'off'}", file=sys.stderr)
  determinism.configure(c.numerics, c.xla_determinism, c.numerics_f32_matmul)

  results, buffer_dir = {}, ""
  with tempfile.TemporaryDirectory() as tmp:
    for k in unrolls:
      c.tlt.drafter_unroll = k
      out = os.path.join(tmp, f"unroll{k}")
      start = time.perf_counter()
      # The first k decodes and spills the buffer; the others train on that same buffer.
      report = warmup(c, rollouts=args.rollouts, steps=args.steps, out=out, buffer_dir=buffer_dir)
      buffer_dir = buffer_dir or report["buffer"]
      with ops.numerics_mode(c.numerics, c.numerics_backend):
        accept = accept_lengths(c, out)
      final = report["final"]
      results[f"unroll{k}"] = {
          "drafter_step_s": report["step_s_median"],
          "final_loss": float(final.get("loss", np.nan)),
          "final_top1_agreement": float(final.get("top1_agreement", np.nan)),
          "accept_len": accept, "seconds": time.perf_counter() - start}
      print(f"unroll {k}: {results[f'unroll{k}']}", flush=True)
  base = results[f"unroll{unrolls[0]}"]
  summary = {
      "steps": args.steps, "rollouts": args.rollouts, "buffer_tokens": report["tokens"],
      "results": results,
      "step_time_vs_unroll1": {k: v["drafter_step_s"] / base["drafter_step_s"]
                               for k, v in results.items()},
      "platform": f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
  }
  print(json.dumps(summary, indent=2))
  os.makedirs(RESULTS_DIR, exist_ok=True)
  with open(os.path.join(RESULTS_DIR, "drafter_unroll.json"), "w") as f:
    json.dump(summary, f, indent=2)


if __name__ == "__main__":
  main()
