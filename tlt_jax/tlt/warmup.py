"""Offline drafter warm-up before RL: train the EAGLE drafter on the policy's own rollouts.

    python -m tlt_jax.tlt.warmup --config experiments/configs/tiny_arith.py \\
        [--rollouts 24] [--steps 1500] [--buffer DIR] [--out DIR]

Decodes `--rollouts` batches of training prompts with the config's policy (plain decoding; its
hidden states are kept), or loads a spilled buffer (`--buffer`, e.g. a run's drafter_buffer/),
trains the drafter for `--steps` packed steps and writes `<out>/drafter.safetensors` (+ the
buffer it trained on and warmup.json). Start RL from it with `--config.tlt.drafter_init=<out>`.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from flax import nnx

from tlt_jax import determinism, metrics, ops
from tlt_jax import job as job_lib
from tlt_jax import mesh as mesh_lib
from tlt_jax.data import splits
from tlt_jax.data.pipeline import prompt_dataset
from tlt_jax.model.drafter import Drafter
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.groups import GroupedRollout
from tlt_jax.rollout.tuner import OFF, Arm
from tlt_jax.tlt.buffer import DrafterBuffer
from tlt_jax.tlt.drafter_trainer import save_drafter
from tlt_jax.tlt.spot import SpotTrainer


def warmup(c, *, rollouts: int, steps: int, out: str, buffer_dir: str = "") -> dict:
  determinism.configure(c.numerics, c.xla_determinism, c.numerics_f32_matmul)
  with ops.numerics_mode(c.numerics, c.numerics_backend):
    return _warmup(c, rollouts, steps, out, buffer_dir)


def _warmup(c, rollouts: int, steps: int, out: str, buffer_dir: str) -> dict:
  start = time.perf_counter()
  model, _, formatter, eos_ids = job_lib.load_policy(c)
  device = mesh_lib.run_devices(local=True)[:1]
  if buffer_dir:
    buffer = DrafterBuffer.load(buffer_dir)
  else:
    buffer = DrafterBuffer(window_steps=rollouts)
    train_rows, _, _ = splits.load_rows(c)
    # Its own shuffle of the training prompts: with the run's seed the warm-up would decode
    # exactly the first batches the RL steps then decode, and a drafter that has seen those
    # prompts looks better on them than it is.
    data = iter(prompt_dataset(train_rows, batch_size=c.rollout.prompts_per_step,
                               seed=int(job_lib.derived_seed(
                                   c.seed, job_lib.PURPOSE_WARMUP_PROMPTS, 0))))
    engine = GroupedRollout(model, EngineConfig.from_config(c, eos_ids, (Arm(OFF),)), [device])
    bar = metrics.progress(total=rollouts, desc="warm-up rollouts", unit="batch")
    for i in range(rollouts):
      prompts = [formatter.encode(row["prompt"]) for row in next(data)]
      buffer.add(i, engine.generate(prompts, group_size=c.rollout.group_size,
                                    seed=job_lib.derived_seed(c.seed, job_lib.PURPOSE_WARMUP,
                                                                i)))
      bar.update(1)
    bar.close()
    buffer.spill(os.path.join(out, "buffer"))
  spot = SpotTrainer(Drafter(model.cfg, nnx.Rngs(c.seed + 1)), model, buffer,
                     job_lib.spot_config(c, online=False))
  batches = spot.refresh_data()
  spot.lend(device)
  curve, marks = [], []  # marks: (steps done, time) at each curve point
  bar = metrics.progress(total=steps, desc="drafter warm-up", unit="step")
  for i in range(steps):
    spot.step()
    bar.update(1)
    if i % 50 == 0 or i == steps - 1:
      curve.append({"step": i + 1, **spot.wait()})
      marks.append((i + 1, time.perf_counter()))
  bar.close()
  # Seconds per step between curve points; the first point (step 1) comes after the compile.
  step_s = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(marks, marks[1:])]
  drafter, _ = spot.publish()
  path = save_drafter(drafter, out)
  report = {"drafter": path, "rollouts": rollouts if not buffer_dir else None,
            "buffer": buffer_dir or os.path.join(out, "buffer"), "examples": len(buffer),
            "tokens": buffer.num_tokens, "packed_batches": batches, "steps": steps,
            "final": curve[-1] if curve else {}, "curve": curve,
            "step_s_median": float(np.median(step_s)) if step_s else None,
            "seconds": time.perf_counter() - start}
  with open(os.path.join(out, "warmup.json"), "w") as f:
    json.dump(report, f, indent=2)
  return report


def main(argv) -> None:
  del argv
  from absl import flags  # noqa: PLC0415 (absl's flags exist once the CLI has defined them)

  f = flags.FLAGS
  out = f.out or os.path.join("runs", "drafter-warmup")
  report = warmup(f.config, rollouts=f.rollouts, steps=f.steps, out=out, buffer_dir=f.buffer)
  print(json.dumps({k: v for k, v in report.items() if k != "curve"}, indent=2,
                   default=lambda x: float(np.asarray(x))))


if __name__ == "__main__":
  from absl import app, flags
  from ml_collections import config_flags

  config_flags.DEFINE_config_file("config", job_lib.DEFAULT_CONFIG,
                                  "experiment config file[:variant]", lock_config=True)
  # On tiny_arith, 6 batches (192 samples) were memorized: top-1 agreement 0.98 on them, 0.76
  # on fresh rollouts. 24 batches and 1500 steps (about 4 epochs) generalize much better.
  flags.DEFINE_integer("rollouts", 24, "rollout batches of training prompts to learn from")
  flags.DEFINE_integer("steps", 1500, "drafter steps")
  flags.DEFINE_string("buffer", "", "train on a spilled buffer instead of new rollouts")
  flags.DEFINE_string("out", "", "output directory (default runs/drafter-warmup)")
  app.run(main)
