"""What a checkpoint of an RL run holds, and the one way to save and restore it.

A checkpoint at step s is everything that makes the run from s on bitwise the uninterrupted
run's: arrays (Orbax items) and host state (its JSON meta), one entry per stateful part:

    trainer       arrays: the trainable params and optimizer state       (rl.trainer.Trainer)
    drafter       arrays: spot-trained drafter params + optimizer state; meta: steps, version
    data          meta: the grain iterator's position (per process)
    tuners        meta: each rollout group's bandit statistics (per process)
    progress      meta: the step, running totals, the eval before training
    buffer        the drafter's window of hidden states, spilled beside the checkpoints

Every part is saved by `save` and restored by `restore`, in the same order.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax

from tlt_jax import multihost
from tlt_jax.job import Job
from tlt_jax.tlt.buffer import DrafterBuffer


def _new_totals() -> dict:
  return {"rollout_s": 0.0, "train_s": 0.0, "reward_wait_s": 0.0, "eval_s": 0.0,
          "kl_sample_train_max": 0.0, "logp_abs_diff_max": 0.0}


@dataclasses.dataclass
class Progress:
  """The loop's own state: where it is and what it has summed so far."""
  step: int = 0
  totals: dict = dataclasses.field(default_factory=_new_totals)
  eval_before: dict | None = None
  resumed_from: int | None = None


def _arrays(job: Job) -> dict:
  state = job.trainer.state()
  if job.spot is not None:
    state.update(drafter=job.spot.params, drafter_opt=job.spot.opt_state)
  return state


def _per_process(job: Job, value):
  """Host state each process keeps for itself: gathered so every process's is in the meta."""
  return multihost.gather_json(value) if job.multi_process else value


def _mine(job: Job, value):
  return value[jax.process_index()] if job.multi_process else value


def save(job: Job, progress: Progress) -> None:
  """Starts the checkpoint of step `progress.step` (async unless checkpoint.async_save=False)."""
  meta = {"step": progress.step, "totals": progress.totals, "eval_before": progress.eval_before,
          "seed": job.config.seed,
          "data_iterator": _per_process(job, job.data.get_state()),
          "tuners": _per_process(job, [e.tuner.state_dict() for e in job.engine.engines])}
  if job.spot is not None:
    meta.update(drafter_steps_done=job.spot.steps_done, drafter_version=job.spot.version)
  if job.buffer is not None and job.config.tlt.spill_buffer:
    job.buffer.spill(job.buffer_dir)
  job.checkpointer.save(progress.step, _arrays(job), meta)


def restore(job: Job) -> Progress | None:
  """Restores the newest checkpoint into the job's parts (None: there is none, or
  checkpoint.resume is off) and returns the loop's progress at it."""
  latest = job.checkpointer.latest_step() if job.config.checkpoint.resume else None
  if latest is None:
    return None
  state, meta = job.checkpointer.restore(_arrays(job), latest)
  job.trainer.load_state(state)
  job.engine.update_policy(job.trainer.local_policy())
  job.data.set_state(_mine(job, meta["data_iterator"]))
  for engine, tuner_state in zip(job.engine.engines, _mine(job, meta["tuners"])):
    engine.tuner.load_state_dict(tuner_state)
  if job.spot is not None:
    job.spot.load_state({"params": state["drafter"], "opt_state": state["drafter_opt"]},
                        steps_done=meta["drafter_steps_done"], version=meta["drafter_version"])
    job.engine.update_drafter(*job.spot.publish(new_version=False))
  if job.buffer is not None and os.path.exists(job.buffer_dir):
    job.buffer = DrafterBuffer.load(job.buffer_dir)
    if job.spot is not None:
      job.spot.buffer = job.buffer
  print(f"[train] resumed from {job.workdir}/checkpoints step {meta['step']}", file=sys.stderr)
  return Progress(step=meta["step"], totals=meta["totals"], eval_before=meta["eval_before"],
                  resumed_from=meta["step"])
