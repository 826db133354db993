"""What a checkpoint of an RL run holds, and the one way to save and restore it.

A checkpoint at step s is everything that makes the run from s on bitwise the uninterrupted
run's: arrays (Orbax items) and host state (its JSON meta), one entry per stateful part:

    trainer       arrays: the trainable params and optimizer state       (rl.trainer.Trainer)
    drafter       arrays: spot-trained drafter params + optimizer state; meta: steps, version
    data          meta: the grain iterator's position (per process)
    tuners        meta: each rollout group's bandit statistics (per process)
    progress      meta: the step, running totals, the eval before training
    buffer        the drafter's window of hidden states, spilled per step beside the
                  checkpoints (drafter_buffer/step_<s>/) before step s's checkpoint starts, so
                  a committed step always has its own spill and a killed spill has no step
    drafter text  the model-free drafters' responses (history tries, lookup bank), one file per
                  rollout group beside the checkpoints (drafter_text/step_<s>/), written the
                  same way; a step without them resumes with those drafters empty (only speed
                  depends on them: `rollout.drafter_text`)

Every part is saved by `save` and restored by `restore`, in the same order. `restore` falls
back past an unreadable newest step (a run killed while writing it, a damaged disk) to the
newest readable one and says so; `check_config` refuses a resume whose config changes what the
checkpoint means.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

import jax

from tlt_jax import config as config_lib
from tlt_jax import cli, multihost
from tlt_jax.job import Job
from tlt_jax.rollout import drafter_text
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


def buffer_dir(job: Job, step: int) -> str:
  """Where step `step`'s drafter buffer spill lives (this process's, in a multi-process run)."""
  return os.path.join(job.buffer_dir, f"step_{step}",
                      *([f"process_{jax.process_index()}"] if job.multi_process else []))


def text_path(job: Job, step: int, group: int) -> str:
  """Where rollout group `group`'s drafter text at step `step` lives (this process's)."""
  return os.path.join(job.workdir, "drafter_text", f"step_{step}",
                      *([f"process_{jax.process_index()}"] if job.multi_process else []),
                      f"group_{group}.npz")


def save(job: Job, progress: Progress) -> None:
  """Starts the checkpoint of step `progress.step` (async unless checkpoint.async_save=False).
  A step already committed (the regular save of the step a NaN update then stopped at) is
  replaced: the new one skips the batch that failed."""
  step = progress.step
  meta = {"step": step, "totals": progress.totals, "eval_before": progress.eval_before,
          "seed": job.config.seed,
          "data_iterator": _per_process(job, job.data.get_state()),
          "tuners": _per_process(job, [e.tuner.state_dict() for e in job.engine.engines])}
  if job.spot is not None:
    meta.update(drafter_steps_done=job.spot.steps_done, drafter_version=job.spot.version)
  # The previous step's save committed first: its spill is then among the committed steps'
  # spills kept below (while in flight it is not listed, and its spill would be pruned).
  job.checkpointer.wait()
  if step in job.checkpointer.all_steps():
    job.checkpointer.delete(step)
  keep = {step, *job.checkpointer.all_steps()}
  if _spills(job):
    job.buffer.spill(buffer_dir(job, step))
    _prune_steps(job.buffer_dir, keep)
  texts = [(g, e) for g, e in enumerate(job.engine.engines) if drafter_text.keeps_text(e)]
  for group, engine in texts:
    drafter_text.spill(engine.history, engine.bank, text_path(job, step, group))
  if texts:
    _prune_steps(os.path.join(job.workdir, "drafter_text"), keep)
  job.checkpointer.save(step, _arrays(job), meta)


def _spills(job: Job) -> bool:
  return job.buffer is not None and job.config.tlt.spill_buffer


def _prune_steps(directory: str, keep: set[int]) -> None:
  """Removes the step_<s> folders of `directory` whose step is not kept."""
  if not os.path.isdir(directory):
    return
  for name in os.listdir(directory):
    if name.startswith("step_") and name[5:].isdigit() and int(name[5:]) not in keep:
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def restore(job: Job) -> Progress | None:
  """Restores the newest readable checkpoint into the job's parts (None: there is none, or
  checkpoint.resume is off) and returns the loop's progress at it."""
  if not job.config.checkpoint.resume:
    return None
  steps = job.checkpointer.all_steps()
  newest_problem = ""
  for step in reversed(steps):
    try:
      state, meta = job.checkpointer.restore(_arrays(job), step)
      if _spills(job) and not DrafterBuffer.is_spill(buffer_dir(job, step)):
        # Without its buffer the drafter would train on another window than the run's.
        raise FileNotFoundError(f"its drafter buffer spill {buffer_dir(job, step)} is missing "
                                "or incomplete")
    except Exception as e:  # noqa: BLE001 (any unreadable step: the next older one is tried)
      older = [s for s in steps if s < step]
      newest_problem = newest_problem or f"step {step}: {type(e).__name__}: {_first_line(e)}"
      print(f"[train] checkpoint step {step} in {job.checkpointer.directory} is unreadable "
            f"({type(e).__name__}: {_first_line(e)}); "
            + (f"falling back to step {older[-1]}" if older else "no older step to fall back to"),
            file=sys.stderr)
      continue
    _load(job, state, meta)
    print(f"[train] resumed from {job.workdir}/checkpoints step {meta['step']}", file=sys.stderr)
    return Progress(step=meta["step"], totals=meta["totals"], eval_before=meta["eval_before"],
                    resumed_from=meta["step"])
  if steps:
    raise ValueError(f"{job.checkpointer.directory}: no readable checkpoint among steps {steps} "
                     f"({newest_problem}); move the directory away to start over")
  return None


def _first_line(e: Exception) -> str:
  return cli.one_line(str(e).splitlines()[0]) if str(e) else ""


def _load(job: Job, state: dict, meta: dict) -> None:
  job.trainer.load_state(state)
  job.engine.update_policy(job.trainer.local_policy())
  job.data.set_state(_mine(job, meta["data_iterator"]))
  for engine, tuner_state in zip(job.engine.engines, _mine(job, meta["tuners"])):
    engine.tuner.load_state_dict(tuner_state)
  for group, engine in enumerate(job.engine.engines):
    path = text_path(job, meta["step"], group)
    if not drafter_text.keeps_text(engine):
      continue
    try:
      drafter_text.restore(engine.history, engine.bank, path)
    except (OSError, ValueError, KeyError) as e:  # from before the text was kept, or damaged
      problem = ("is missing" if isinstance(e, FileNotFoundError)
                 else f"is unreadable ({type(e).__name__}: {_first_line(e)})")
      print(f"[train] {path} {problem}: rollout group {group}'s history and lookup drafters "
            "start empty (the run's output is the same; only its speed depends on them)",
            file=sys.stderr)
  if job.spot is not None:
    job.spot.load_state({"params": state["drafter"], "opt_state": state["drafter_opt"]},
                        steps_done=meta["drafter_steps_done"], version=meta["drafter_version"])
    job.engine.update_drafter(*job.spot.publish(new_version=False))
  if _spills(job):
    job.buffer = DrafterBuffer.load(buffer_dir(job, meta["step"]))
    if job.spot is not None:
      job.spot.buffer = job.buffer


# -- the config a checkpoint was written under

# Keys a resume may change: how long to run, what to evaluate and log, how to checkpoint and
# where to run. Any other key changes what the checkpoint's state means.
RESUMABLE_KEYS = ("rl.steps", "eval.", "metrics.", "checkpoint.", "workdir", "distributed.",
                  "rl.reward_workers", "rl.reward_worker_kind", "compile.", "log_level")


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[prefix + k] = v
  return out


def check_workdir(c) -> None:
  """Before anything is built: a workdir with checkpoints is resumed only under the config it
  was run with (`check_config`), and never silently overwritten (checkpoint.resume=False)."""
  ckpt_dir = os.path.join(c.workdir, "checkpoints") if c.workdir else ""
  steps = sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit()) if (
      ckpt_dir and os.path.isdir(ckpt_dir)) else []
  if not steps:
    return
  if not c.checkpoint.resume:
    raise ValueError(f"checkpoint.resume=False but {ckpt_dir} holds steps {steps}: a new run "
                     "there would mix its checkpoints and metrics with them; use a new "
                     "config.workdir (or move that one away)")
  check_config(c, c.workdir)


def check_config(c, workdir: str) -> dict:
  """Before a resume: the keys that differ from the config the workdir's checkpoints were
  written under, {key: [then, now]}. Raises ValueError naming the first key a resume may not
  change; the allowed changes are appended to <workdir>/config_changes.jsonl. A key added to the
  defaults since that run, now at its default, is no change: a key is added with the default
  that keeps the old behaviour, so the run was made under it."""
  path = os.path.join(workdir, "config.json")
  if not c.checkpoint.resume or not os.path.exists(path):
    return {}
  with open(path) as f:
    then = _flat(json.load(f))
  now = _flat(json.loads(c.to_json_best_effort()))
  defaults = _flat(json.loads(config_lib.default_config().to_json_best_effort()))
  added_at_default = {k for k in now if k not in then and k in defaults and now[k] == defaults[k]}
  changed = {k: [then.get(k), now.get(k)] for k in sorted(set(then) | set(now))
             if then.get(k) != now.get(k) and k not in added_at_default}
  for key, (old, new) in changed.items():
    if not key.startswith(RESUMABLE_KEYS):
      raise ValueError(f"{key}={new!r}: {workdir} was run with {key}={old!r} and its checkpoints "
                       "continue that run; resume with the same value or use a new workdir")
  if changed:
    with open(os.path.join(workdir, "config_changes.jsonl"), "a") as f:
      f.write(json.dumps({"changed": changed}) + "\n")
  return changed
