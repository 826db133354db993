"""The RL job: rollouts with the engine, verifiable rewards, GRPO-family updates of LoRA weights.

    python -m tlt_jax.train                                   # experiments/configs/tiny_arith.py
    python -m tlt_jax.train --config experiments/configs/tiny_arith.py:smoke
    python -m tlt_jax.train --config experiments/configs/X.py --config.rl.lr=1e-3 \\
        --config.workdir=runs/a

`run(c)` builds the job (tlt_jax/job.py), compiles its programs, resumes from the newest
checkpoint or evaluates the starting policy, then runs `rl.steps` RL steps (tlt_jax/rl/step.py)
and calls the loop's hooks after each: eval, metrics, checkpoint (tlt_jax/run_state.py). The
workdir gets metrics.jsonl, TensorBoard events (tb/), plots/*.png, checkpoints/, export/ (the
PEFT adapter) and summary.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
import threading
import time
from typing import Callable

import jax
import numpy as np

from tlt_jax import checkpoint as ckpt_lib
from tlt_jax import (cli, compile_cache, determinism, distributed, logs, multihost, ops,
                     run_state)
from tlt_jax import config as config_lib
from tlt_jax import job as job_lib
from tlt_jax import metrics as metrics_lib
from tlt_jax.data import splits
from tlt_jax.evaluate import evaluate
from tlt_jax.rl import step as rl_step


@dataclasses.dataclass
class StepDone:
  """What a hook sees after each RL step."""
  step: int            # steps done, 1-based
  record: dict         # the step's metrics; hooks before the metrics hook may add to it
  started: float       # perf_counter() when the step began
  last: bool


Hook = Callable[[StepDone], None]


def run(c, name: str = "run", config_path: str = "") -> dict:
  """Runs (or resumes) the job described by config `c`; returns the summary."""
  t_start = time.perf_counter()
  config_lib.validate(c)
  logs.configure(c.log_level)
  print(f"[train] compile cache: {compile_cache.configure(c.compile.cache_dir) or 'off'}",
        file=sys.stderr)
  determinism.configure(c.numerics, c.xla_determinism, c.numerics_f32_matmul)
  distributed.initialize_from_config(c)  # multi-host: before the first JAX computation
  run_state.check_workdir(c)
  with ops.numerics_mode(c.numerics, c.numerics_backend):
    job = job_lib.build(c, name)
    with _Preemption() as preemption:
      return train(job, t_start=t_start, config_path=config_path, preemption=preemption)


def train(job: job_lib.Job, *, t_start: float | None = None, config_path: str = "",
          preemption: _Preemption | None = None) -> dict:
  """The loop over a built job: compile, resume or evaluate, steps with hooks, final eval.
  With `preemption` (SIGTERM seen), it stops after the current step with a checkpoint."""
  c, workdir, steps = job.config, job.workdir, job.config.rl.steps
  stages = _Stages(time.perf_counter() if t_start is None else t_start, show=job.primary)
  stages.done("load")
  if job.primary:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(c.to_json_best_effort(indent=2))
  compile_by_program = job.warm_up()
  stages.done("compile")

  def run_eval(step: int) -> dict:
    return evaluate(job.engine, job.policy.formatter, job.policy.tokenizer, job.eval_rows,
                    samples=c.eval.samples,
                    seed=job_lib.derived_seed(c.seed, job_lib.PURPOSE_EVAL, 0),
                    difficulty_key=splits.eval_group_key(c), progress=c.metrics.progress,
                    desc=f"eval @ step {step}")

  progress = run_state.restore(job)
  if progress is None:
    progress = run_state.Progress()
    progress.eval_before = _timed(run_eval, 0, progress.totals)
    print(f"[train] starting at step 0 in {workdir} (no checkpoint to resume from)",
          file=sys.stderr)
  # Other processes log their (identical, gathered) step metrics under process_<i>/. Rows a
  # killed run wrote after the checkpoint restored (all of them, when none was) are dropped.
  resumed = {"resume_step": progress.resumed_from, "start_over": progress.resumed_from is None}
  writer = (metrics_lib.MetricsWriter(workdir, tensorboard=c.metrics.tensorboard, **resumed)
            if job.primary else metrics_lib.MetricsWriter(
                os.path.join(workdir, f"process_{jax.process_index()}"), tensorboard=False,
                **resumed))
  if progress.resumed_from is None:
    writer.write(0, {"eval_accuracy": progress.eval_before["accuracy"]})
  stages.done("eval_before" if progress.resumed_from is None else "resume")

  bar = _progress(c, total=steps, initial=progress.step, desc=f"RL {job.name}", unit="step")
  hooks = [_eval_hook(c, run_eval, progress), _metrics_hook(writer, bar),
           _checkpoint_hook(job, progress)]
  last_trace: list = []
  for step in range(progress.step, steps):
    started = time.perf_counter()
    rows = next(job.data)
    inner = _progress(c, total=len(rows) * job.group_size, desc=f"rollout {step + 1}",
                      unit="sample", leave=False)
    try:
      # DAPO may read more batches from job.data within the step (its over-sampling): before
      # the checkpoint below, which saves the iterator's position after them.
      record, ro = rl_step.run(job, step, rows, on_sample=lambda _: inner.update(1))
    except FloatingPointError as e:
      # The update was not applied: save the state as it was, so nothing is lost; resuming
      # continues with the next batch.
      progress.step = step
      run_state.save(job, progress)
      job.checkpointer.wait()
      raise FloatingPointError(f"RL step {step + 1}: {e}. The state before this step is saved in "
                               f"{workdir}/checkpoints/{step}; rerunning with this workdir "
                               "resumes there and skips this batch.") from e
    inner.close()
    _add_to_totals(progress.totals, record, ro.report)
    last_trace = ro.report.trace
    progress.step = step + 1
    for hook in hooks:
      hook(StepDone(step + 1, record, started, last=step + 1 == steps))
    if preemption is not None and step + 1 < steps and preemption.agreed(job):
      bar.close()
      writer.close()
      return _preempted(job, progress)
  bar.close()
  stages.done("steps")

  eval_after = _timed(run_eval, steps, progress.totals)
  writer.write(steps, {"eval_accuracy": eval_after["accuracy"]})
  writer.close()
  job.close()
  stages.done("eval_after")
  return _finish(job, progress, eval_after, last_trace, stages, compile_by_program, config_path)


class _Stages:
  """Consecutive stages of a run (load, compile, eval, steps, ...): one console line each with
  its seconds, and seconds that add up to the wall time."""

  def __init__(self, start: float, show: bool):
    self.seconds: dict[str, float] = {}
    self._last, self._start, self._show = start, start, show

  def done(self, name: str) -> None:
    now = time.perf_counter()
    self.seconds[name] = now - self._last
    self._last = now
    if self._show:
      print(f"[train] {name}: {self.seconds[name]:.1f} s", file=sys.stderr)

  @property
  def wall(self) -> float:
    return self._last - self._start


class _Preemption:
  """SIGTERM (TPU pods and spot GPUs send it before they take the machine) asks the loop to
  stop after the current step; every process stops at the same step."""

  def __init__(self):
    self.requested, self._previous = False, None

  def __enter__(self) -> _Preemption:
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
    return self

  def __exit__(self, *exc) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)

  def _on_sigterm(self, signum, frame) -> None:
    del signum, frame
    self.requested = True
    print("[train] SIGTERM: stopping after this step with a checkpoint", file=sys.stderr)

  def agreed(self, job: job_lib.Job) -> bool:
    if job.multi_process:  # one process's signal stops all of them at the same step
      return any(multihost.gather_json(self.requested))
    return self.requested


def _preempted(job: job_lib.Job, progress: run_state.Progress) -> dict:
  job.checkpointer.wait()
  if progress.step not in job.checkpointer.all_steps():
    run_state.save(job, progress)
  job.close()
  print(f"[train] preempted: step {progress.step} is checkpointed in {job.workdir}/checkpoints; "
        "the same command resumes there", file=sys.stderr)
  return {"preempted": True, "workdir": job.workdir, "step": progress.step,
          "process_index": jax.process_index()}


def _progress(c, **kw):
  return metrics_lib.progress(**kw, **({} if c.metrics.progress else {"disable": True}))


def _timed(run_eval, step: int, totals: dict) -> dict:
  t0 = time.perf_counter()
  report = run_eval(step)
  totals["eval_s"] += time.perf_counter() - t0
  return report


def _add_to_totals(totals: dict, record: dict, report) -> None:
  for key in ("rollout_s", "train_s", "reward_wait_s"):
    totals[key] += record[key]
  totals["idle_device_s"] = totals.get("idle_device_s", 0.0) + report.idle_device_s
  totals["drafter_steps"] = totals.get("drafter_steps", 0) + report.drafter_steps
  totals["kl_sample_train_max"] = max(totals["kl_sample_train_max"],
                                      abs(record["kl_sample_train"]))
  totals["logp_abs_diff_max"] = max(totals["logp_abs_diff_max"], record["logp_abs_diff_max"])


# -- hooks: each runs after every step, in the order listed in `train`


def _eval_hook(c, run_eval, progress: run_state.Progress) -> Hook:
  def hook(done: StepDone) -> None:
    if c.eval.every and done.step % c.eval.every == 0 and not done.last:
      done.record["eval_accuracy"] = _timed(run_eval, done.step, progress.totals)["accuracy"]
  return hook


def _metrics_hook(writer: metrics_lib.MetricsWriter, bar) -> Hook:
  def hook(done: StepDone) -> None:
    done.record["step_s"] = time.perf_counter() - done.started
    writer.write(done.step, done.record)
    bar.update(1)
    bar.set_postfix(reward=f"{done.record['reward_mean']:.3f}",
                    len=f"{done.record['response_len_mean']:.0f}")
  return hook


def _checkpoint_hook(job: job_lib.Job, progress: run_state.Progress) -> Hook:
  every = job.config.checkpoint.every

  def hook(done: StepDone) -> None:
    if (every and done.step % every == 0) or done.last:
      run_state.save(job, progress)
  return hook


# -- the end of a run: exports, plots, summary


def _finish(job: job_lib.Job, progress: run_state.Progress, eval_after: dict, last_trace: list,
            stages: _Stages, compile_by_program: dict, config_path: str) -> dict:
  c, workdir, trainer, spot = job.config, job.workdir, job.trainer, job.spot
  # Every process's copy of the trained weights (a gather across hosts: all processes take
  # part); replicas on different processes must agree bitwise.
  final_policy = trainer.local_policy()
  fingerprint = multihost.fingerprint(trainer.local_trainable()) if job.multi_process else None
  drafter_fingerprint = (multihost.fingerprint(spot.params) if job.multi_process and spot
                         else None)
  mesh_info = {**{k: int(v) for k, v in trainer.mesh.shape.items()},
               "processes": len({d.process_index for d in trainer.mesh.devices.flat})}
  resumed_from = progress.resumed_from or None
  if not job.primary:
    return {"workdir": workdir, "process_index": jax.process_index(), "eval_after": eval_after,
            "eval_accuracy_after": eval_after["accuracy"], "trainable_sha256": fingerprint,
            "drafter_sha256": drafter_fingerprint, "train_mesh": mesh_info,
            "resumed_from": resumed_from}
  _export(c, workdir, final_policy)
  records = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  plots = []
  if c.metrics.plots:
    plots = metrics_lib.plot_run(workdir, records, [t.__dict__ for t in last_trace] or None)
  steps_run = [x for x in records if "reward_mean" in x]
  stages.done("export")
  speculative = any(x.get("sd_chunk_fraction", 0) > 0 for x in steps_run)
  eval_before = progress.eval_before
  summary = {
      "config": config_path.split(":")[0] or job.name,
      "variant": config_path.split(":", 1)[1] if ":" in config_path else "",
      "workdir": workdir, "numerics": c.numerics,
      "algorithm": c.rl.algorithm, "lora_rank": c.lora.rank, "steps": c.rl.steps,
      "resumed_from": resumed_from, "tlt": bool(c.tlt.enabled), "spot_training": spot is not None,
      # None when no chunk was decoded speculatively (SD off): no acceptance to report.
      "accept_len_mean": (float(np.mean([x["accept_len"] for x in steps_run]))
                          if speculative else None),
      "eval_problems": len(job.eval_rows), "eval_samples": c.eval.samples,
      "eval_accuracy_before": eval_before["accuracy"],
      "eval_accuracy_after": eval_after["accuracy"],
      "eval_before": eval_before, "eval_after": eval_after,
      "reward_first": steps_run[0]["reward_mean"] if steps_run else None,
      "reward_last": steps_run[-1]["reward_mean"] if steps_run else None,
      "wall_s": stages.wall, "compile_s": stages.seconds["compile"],
      "stage_s": stages.seconds,  # consecutive: they add up to wall_s
      "compile_by_program": dict(sorted(compile_by_program.items())), **progress.totals,
      "data": job.data_report, "plots": [os.path.relpath(p, workdir) for p in plots],
      "train_mesh": mesh_info,
      **({"processes": jax.process_count(), "trainable_sha256": fingerprint,
          "drafter_sha256": drafter_fingerprint} if job.multi_process else {}),
  }
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary


def _export(c, workdir: str, policy) -> None:
  if c.checkpoint.export_adapter and c.lora.rank > 0:
    ckpt_lib.export_adapter(policy, os.path.join(workdir, "export", "adapter"),
                            base_model_name_or_path=os.path.abspath(c.model.hf_dir))
  if c.checkpoint.export_merged:
    merged = os.path.join(workdir, "export", "merged")
    ckpt_lib.export_merged_hf(policy, merged)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
      if os.path.exists(os.path.join(c.model.hf_dir, file)):  # a complete HF checkpoint
        shutil.copy(os.path.join(c.model.hf_dir, file), merged)


# -- the CLI


def main(argv) -> None:
  del argv
  from absl import flags  # noqa: PLC0415 (absl's flags exist once the CLI has defined them)

  path = flags.FLAGS["config"].config_filename
  base = os.path.splitext(os.path.basename(path.split(":")[0]))[0]
  variant = path.split(":", 1)[1] if ":" in path else ""
  c = flags.FLAGS.config
  devices = c.rollout.groups * (c.mesh.model if c.rollout.tensor_parallel else 1)
  if devices > 1 and not determinism.host_devices_requested():
    # On a CPU-only machine JAX sees one device; give each rollout group one, or mesh.model
    # when the groups split the model (before JAX starts). On a machine with accelerators the
    # run uses those (too few: build_rollout says so, naming rollout.groups); the host devices
    # asked for here serve it only under JAX_PLATFORMS=cpu.
    determinism.force_host_devices(devices)
  summary = run(c, name=f"{base}-{variant}" if variant else base, config_path=path)
  # One line per key (summary.json in the workdir has it all, indented).
  shown = {k: v for k, v in summary.items() if k not in ("eval_before", "eval_after")}
  print("{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in shown.items())
        + "\n}")


if __name__ == "__main__":
  from absl import app

  cli.define_config(job_lib.DEFAULT_CONFIG)
  app.run(cli.guarded(main), flags_parser=cli.parse_flags)
