"""The RL job: rollouts with the engine, verifiable rewards, GRPO-family updates of LoRA weights.

    python -m tlt_jax.train                                   # experiments/configs/tiny_arith.py
    python -m tlt_jax.train --config experiments/configs/tiny_arith.py:smoke
    python -m tlt_jax.train --config experiments/configs/X.py --config.rl.lr=1e-3 --config.workdir=runs/a

One step: a batch of prompts from the grain pipeline -> `group_size` samples each (scored in a
worker pool as they finish) -> advantages -> `rl.trainer` update -> new weights to the engine.
The workdir gets metrics.jsonl, TensorBoard events (tb/), plots/*.png, checkpoints/ (resumed
from automatically), export/ (the PEFT adapter) and summary.json.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import numpy as np

from tlt_jax import config as config_lib
from tlt_jax import determinism

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "experiments", "configs", "tiny_arith.py")
# Named purposes for host-side seeds: one run seed, never call order.
PURPOSE_ROLLOUT, PURPOSE_EVAL, PURPOSE_WARMUP, PURPOSE_WARMUP_PROMPTS = 1, 2, 3, 4


def derived_seed(seed: int, purpose: int, step: int, *more: int) -> np.int32:
  return np.int32(np.random.SeedSequence([seed, purpose, step, *more]).generate_state(1)[0]
                  & 0x7FFFFFFF)


def parse_mix(spec: str) -> dict[int, float]:
  try:
    return {int(d): float(w) for d, w in (part.split(":") for part in spec.split(","))}
  except ValueError as e:
    raise ValueError(f"data.synthetic_mix={spec!r} must look like '1:0.5,2:0.5' ({e})") from None


def load_rows(c) -> tuple[list[dict], list[dict], dict]:
  """(train rows, held-out eval rows, a report). Eval problems never appear in the train rows."""
  from tlt_jax.data import sources, synthetic  # noqa: PLC0415

  d = c.data
  if d.source == "synthetic":
    mix, ops = parse_mix(d.synthetic_mix), tuple(d.synthetic_ops)
    train = synthetic.make_dataset(d.synthetic_train, c.seed, mix, ops)
    candidates = synthetic.make_dataset(20 * c.eval.num_problems, c.seed + 7919 * (1 + c.eval.seed),
                                        mix, ops)
    report = {"skipped_rows": 0}
  else:
    def read(path):
      return sources.read_rows(path, prompt_field=d.prompt_field, answer_field=d.answer_field,
                               on_error=d.on_error)

    train_report = read(d.train_path) if d.train_path else sources.ReadReport([], [])
    train, skipped = train_report.rows, list(train_report.skipped)
    # Several eval files (comma-separated) are reported per dataset: rows carry its name.
    candidates_by_dataset = {}
    for path in eval_paths(d.eval_path):
      eval_report = read(path)
      skipped += eval_report.skipped
      candidates_by_dataset[dataset_name(path)] = [
          dict(r, dataset=dataset_name(path)) for r in eval_report.rows]
    report = {"skipped_rows": len(skipped), "skipped_examples": skipped[:5]}
  seen = {r["prompt"] for r in train}
  held_out = []
  groups = (candidates_by_dataset.values() if d.source == "files" else [candidates])
  for rows in groups:  # num_problems per eval dataset
    picked, prompts = [], set()
    for r in rows:
      if r["prompt"] not in seen and r["prompt"] not in prompts:
        picked.append(r)
        prompts.add(r["prompt"])
      if len(picked) == c.eval.num_problems:
        break
    if len(picked) < c.eval.num_problems:
      print(f"[train] only {len(picked)} held-out eval problems in {picked[0].get('dataset', '')}"
            f" (asked for {c.eval.num_problems}): the rest also appear in the training rows"
            if picked else "[train] no held-out eval problems", file=sys.stderr)
    held_out += picked
  report["eval_problems"] = len(held_out)
  return train, held_out, report


def eval_paths(spec: str) -> list[str]:
  return [p.strip() for p in spec.split(",") if p.strip()]


def dataset_name(path: str) -> str:
  """gsm8k_test.jsonl -> gsm8k_test: the name a dataset's eval results are reported under."""
  return os.path.splitext(os.path.basename(path))[0]


def eval_group_key(c) -> str:
  """Eval results are split by difficulty (synthetic) or by dataset (files)."""
  return "digits" if c.data.source == "synthetic" else "dataset"


def load_policy(c):
  """(model, tokenizer, prompt formatter, eos ids) from the config's HF checkpoint."""
  from tlt_jax.data.chat import PromptFormatter  # noqa: PLC0415
  from tlt_jax.model import hf  # noqa: PLC0415

  if not c.model.hf_dir:
    raise ValueError("the RL job needs model.hf_dir: an HF checkpoint with a tokenizer.json")
  model = hf.load_model(c.model.hf_dir, dtype=c.model.dtype)
  tokenizer = hf.load_tokenizer(c.model.hf_dir)
  formatter = PromptFormatter.from_hf_dir(c.model.hf_dir, tokenizer,
                                          system_prompt=c.data.system_prompt,
                                          use_chat_template=c.data.use_chat_template)
  eos = model.cfg.eos_token_id
  eos_ids = tuple(eos) if isinstance(eos, (tuple, list)) else ((eos,) if eos is not None else ())
  return model, tokenizer, formatter, eos_ids


def engine_config(c, eos_ids, arms):
  from tlt_jax.rollout.engine import EngineConfig  # noqa: PLC0415
  from tlt_jax.rollout.sampling import SamplingParams  # noqa: PLC0415

  r = c.rollout
  return EngineConfig(
      buckets=tuple(r.buckets), max_prompt_len=r.max_prompt_len, max_new_tokens=r.max_new_tokens,
      chunk_steps=r.chunk_steps, eos_ids=eos_ids, verification=r.verification,
      sampling=SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p),
      compaction=r.compaction, seed=c.seed, arms=arms, drafter_numerics=c.tlt.drafter_numerics)


def spot_config(c, *, online: bool = True):
  """The drafter trainer's settings: online during RL, or for the offline warm-up."""
  from tlt_jax.tlt.drafter_trainer import DrafterLossConfig  # noqa: PLC0415
  from tlt_jax.tlt.scheduler import SpotConfig  # noqa: PLC0415

  t = c.tlt
  return SpotConfig(lr=t.online_lr if online else t.drafter_lr, rows=t.rows,
                    row_len=t.row_len, max_steps_per_rollout=t.max_steps_per_rollout,
                    loss=DrafterLossConfig(unroll=t.drafter_unroll), seed=c.seed)


def train_mesh(c):
  """The trainer's mesh: `config.mesh` over all devices of the run. In a multi-process run that
  is every process's devices: the trainer's state is sharded across hosts (fsdp can span them)
  and each device computes its own rows of the gathered batch, so no host repeats another's
  work. Raises ValueError naming `config.mesh` when the devices do not fit it."""
  import jax  # noqa: PLC0415

  from tlt_jax import mesh as mesh_lib  # noqa: PLC0415

  devices = mesh_lib.run_devices()
  try:
    return mesh_lib.mesh_from_config(c.mesh, devices)
  except ValueError as e:
    kind = devices[0].platform
    where = (f"{len(devices)} {kind} devices over {jax.process_count()} processes"
             if jax.process_count() > 1 else f"{len(devices)} {kind} devices")
    raise ValueError(f"config.mesh ({where}): {e}") from None


def build_rollout(c, model, eos_ids, drafter=None):
  """The rollout engines of the config: `rollout.groups` data-parallel groups over the local
  devices, with the tuner's SD arms when TLT is on (plain decode otherwise)."""
  from tlt_jax import mesh as mesh_lib  # noqa: PLC0415
  from tlt_jax.rollout.tuner import OFF, Arm, parse_arms  # noqa: PLC0415
  from tlt_jax.tlt.scheduler import GroupedRollout  # noqa: PLC0415

  devices = mesh_lib.run_devices(local=True)
  if not 1 <= c.rollout.groups <= len(devices):
    raise ValueError(
        f"rollout.groups={c.rollout.groups} must be 1..{len(devices)}: each group needs a "
        f"device and this process has {len(devices)} {devices[0].platform} device(s) (host "
        "devices instead: start with JAX_PLATFORMS=cpu; the CLI asks XLA for enough of them)")
  arms = parse_arms(c.tlt.arms) if drafter is not None else (Arm(OFF),)
  if drafter is not None and c.tlt.fixed_arm and c.tlt.fixed_arm not in {a.name for a in arms}:
    raise ValueError(f"tlt.fixed_arm={c.tlt.fixed_arm!r} is not one of tlt.arms={c.tlt.arms!r}")
  groups = [list(g) for g in np.array_split(np.array(devices, dtype=object), c.rollout.groups)]
  return GroupedRollout(model, engine_config(c, eos_ids, arms), groups, drafter,
                        tensor_parallel=c.rollout.tensor_parallel)


def run(c, name: str = "run") -> dict:
  """Runs (or resumes) the job described by config `c`; returns the summary."""
  config_lib.validate(c)
  if c.data.source == "files" and not c.data.train_path:
    raise ValueError("data.source='files' needs data.train_path for the RL job")
  # before JAX creates its backends
  determinism.configure(c.numerics, c.xla_determinism, c.numerics_f32_matmul)
  from tlt_jax import distributed, ops  # noqa: PLC0415

  distributed.initialize_from_config(c)  # multi-host: before the first JAX computation

  with ops.numerics_mode(c.numerics, c.numerics_backend):
    return _run(c, name)


def _run(c, name: str) -> dict:  # noqa: PLR0915 (one loop, read top to bottom)
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from tlt_jax import checkpoint as ckpt_lib  # noqa: PLC0415
  from tlt_jax import metrics as metrics_lib  # noqa: PLC0415
  from tlt_jax import multihost  # noqa: PLC0415
  from tlt_jax.data.pipeline import prompt_dataset  # noqa: PLC0415
  from tlt_jax.evaluate import evaluate  # noqa: PLC0415
  from tlt_jax.model import lora  # noqa: PLC0415
  from tlt_jax.rl import algorithms  # noqa: PLC0415
  from tlt_jax.rl.scoring import RewardScorer, RewardSpec  # noqa: PLC0415
  from tlt_jax.rl.trainer import TrainConfig, Trainer, make_batch  # noqa: PLC0415
  from tlt_jax.model.drafter import Drafter  # noqa: PLC0415
  from tlt_jax.rollout.sampling import SamplingParams  # noqa: PLC0415
  from tlt_jax.tlt.buffer import DrafterBuffer  # noqa: PLC0415
  from tlt_jax.tlt.drafter_trainer import load_drafter  # noqa: PLC0415
  from tlt_jax.tlt.scheduler import SpotTrainer  # noqa: PLC0415

  t_start = time.perf_counter()
  # Several processes (config.distributed): each decodes its share of the prompts on its own
  # devices, the rollouts are gathered (tlt_jax/multihost.py) and one trainer sharded over all
  # processes' devices trains on them. Process 0 writes the metrics, plots, exports and summary;
  # checkpoints are written by all together.
  multi, pid = jax.process_count() > 1, jax.process_index()
  primary = pid == 0
  workdir = c.workdir or os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
  if multi and not c.workdir:
    raise ValueError("a multi-process run needs config.workdir (the same path on every process)")
  os.makedirs(workdir, exist_ok=True)
  if primary:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(c.to_json_best_effort(indent=2))
  progress = (lambda *a, **k: metrics_lib.progress(*a, **k)) if c.metrics.progress else (
      lambda *a, **k: metrics_lib.progress(*a, disable=True, **k))

  # --- model, tokenizer, prompts
  model, tokenizer, formatter, eos_ids = load_policy(c)
  if c.lora.rank > 0:
    lora.apply_lora(model, rank=c.lora.rank, alpha=c.lora.alpha, targets=tuple(c.lora.targets),
                    seed=c.seed)
  train_rows, eval_rows, data_report = load_rows(c)

  r = c.rollout
  # rollout.prompts_per_step is the whole step's; each process decodes an equal share of it.
  if r.prompts_per_step % jax.process_count():
    raise ValueError(f"rollout.prompts_per_step={r.prompts_per_step} must be a multiple of the "
                     f"{jax.process_count()} processes (each decodes an equal share)")
  local_prompts = r.prompts_per_step // jax.process_count()
  G, N = r.group_size, local_prompts * r.group_size  # N: this process's samples
  sampling = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)
  t = c.tlt
  drafter = None
  if t.enabled:
    drafter = (load_drafter(t.drafter_init, model.cfg) if t.drafter_init
               else Drafter(model.cfg, nnx.Rngs(c.seed + 1)))
  engine = build_rollout(c, model, eos_ids, drafter)
  # tlt.fixed_arm: the tuner is off, every chunk decodes with that arm.
  forced_arm = {"arm": t.fixed_arm} if t.enabled and t.fixed_arm else {}
  buffer = DrafterBuffer(t.window_steps) if t.enabled else None
  spot = None
  if t.enabled and t.spot_training:
    spot = SpotTrainer(drafter, model, buffer, spot_config(c))
  buffer_dir = os.path.join(workdir, "drafter_buffer", *([f"process_{pid}"] if multi else []))
  rl = c.rl
  # The trainer reshards its model onto its mesh in place. Across processes that mesh spans
  # hosts, so it gets its own copy of the module: the engine and the spot trainer keep process-
  # local weights (and are handed trainer.local_policy() after each update).
  trainer = Trainer(nnx.clone(model) if multi else model, TrainConfig(
      algorithm=rl.algorithm, loss=rl.loss, lr=rl.lr, warmup_steps=rl.warmup_steps,
      weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm, minibatches=rl.minibatches,
      epochs=rl.epochs, eps_low=rl.eps_low if rl.eps_low >= 0 else None,
      eps_high=rl.eps_high if rl.eps_high >= 0 else None, kl_coef=rl.kl_coef,
      kl_estimator=rl.kl_estimator, tis_cap=rl.tis_cap, max_response_len=r.max_new_tokens,
      chunk_rows=rl.chunk_rows, exact_tensor_parallel=rl.exact_tensor_parallel,
      tp_regather=rl.tp_regather,
      sampling=sampling), mesh=train_mesh(c))
  train_len = r.max_prompt_len + r.max_new_tokens
  data = iter(prompt_dataset(train_rows, batch_size=local_prompts, seed=c.seed,
                             process_index=jax.process_index(),
                             process_count=jax.process_count(), shuffle=c.data.shuffle))
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=c.checkpoint.keep,
                               async_save=c.checkpoint.async_save)

  t0 = time.perf_counter()
  engine.warm_up()
  trainer.warm_up(train_len)
  if spot is not None:
    spot.warm_up(engine.device_groups)  # the drafter step too: no compile inside a rollout
  compile_s = time.perf_counter() - t0

  def run_eval(step: int) -> dict:
    return evaluate(engine, formatter, tokenizer, eval_rows, samples=c.eval.samples,
                    seed=derived_seed(c.seed, PURPOSE_EVAL, 0), difficulty_key=eval_group_key(c),
                    progress=c.metrics.progress, desc=f"eval @ step {step}")

  # --- resume or start
  start_step, totals, eval_before = 0, {"rollout_s": 0.0, "train_s": 0.0, "reward_wait_s": 0.0,
                                        "eval_s": 0.0, "kl_sample_train_max": 0.0,
                                        "logp_abs_diff_max": 0.0}, None

  def run_state() -> dict:
    state = trainer.state()
    if spot is not None:
      state.update(drafter=spot.params, drafter_opt=spot.opt_state)
    return state

  latest = ckpt.latest_step() if c.checkpoint.resume else None
  if latest is not None:
    state, meta = ckpt.restore(run_state(), latest)
    trainer.load_state(state)
    engine.update_policy(trainer.local_policy())
    data.set_state(meta["data_iterator"][pid] if multi else meta["data_iterator"])
    for e, tuner_state in zip(engine.engines, meta["tuners"][pid] if multi else meta["tuners"]):
      e.tuner.load_state_dict(tuner_state)
    if spot is not None:
      spot.load_state({"params": state["drafter"], "opt_state": state["drafter_opt"]},
                      steps_done=meta["drafter_steps_done"], version=meta["drafter_version"])
      engine.update_drafter(*spot.publish(new_version=False))
    if buffer is not None and os.path.exists(buffer_dir):
      buffer = DrafterBuffer.load(buffer_dir)
      if spot is not None:
        spot.buffer = buffer
    start_step, totals, eval_before = meta["step"], meta["totals"], meta["eval_before"]
    print(f"[train] resumed from {workdir}/checkpoints step {start_step}", file=sys.stderr)
  else:
    t0 = time.perf_counter()
    eval_before = run_eval(0)
    totals["eval_s"] += time.perf_counter() - t0

  # Other processes log their (identical, gathered) step metrics under process_<i>/.
  writer = (metrics_lib.MetricsWriter(workdir, tensorboard=c.metrics.tensorboard) if primary
            else metrics_lib.MetricsWriter(os.path.join(workdir, f"process_{pid}"),
                                           tensorboard=False))
  scorer = RewardScorer(RewardSpec(rl.correct_weight, rl.format_weight),
                        workers=rl.reward_workers, kind=rl.reward_worker_kind)
  if latest is None:
    writer.write(0, {"eval_accuracy": eval_before["accuracy"]})

  def save_meta(step: int) -> dict:
    tuners = [e.tuner.state_dict() for e in engine.engines]
    meta = {"step": step, "data_iterator": data.get_state(), "totals": totals,
            "eval_before": eval_before, "tuners": tuners, "seed": c.seed}
    if multi:  # each process resumes its own data shard and tuners
      meta.update(data_iterator=multihost.gather_json(data.get_state()),
                  tuners=multihost.gather_json(tuners))
    if spot is not None:
      meta.update(drafter_steps_done=spot.steps_done, drafter_version=spot.version)
    if buffer is not None and t.spill_buffer:
      buffer.spill(buffer_dir)
    return meta

  last_trace: list = []
  bar = progress(total=rl.steps, initial=start_step, desc=f"RL {name}", unit="step")
  for step in range(start_step, rl.steps):
    t_step = time.perf_counter()
    rows = next(data)
    prompts = [formatter.encode(row["prompt"]) for row in rows]
    inner = progress(total=N, desc=f"rollout {step + 1}", unit="sample", leave=False)

    def score_when_done(sample, rows=rows, inner=inner):
      text = tokenizer.decode(sample.tokens.tolist(), skip_special_tokens=True)
      scorer.submit(sample.sample_id, text, rows[sample.sample_id // G]["answer"])
      inner.update(1)

    if spot is not None:
      spot.refresh_data(trainer.local_policy())  # the window so far, features of the current policy
    t0 = time.perf_counter()
    rollout_seed = derived_seed(c.seed, PURPOSE_ROLLOUT, step, *([pid] if multi else []))
    samples = engine.generate(prompts, group_size=G, seed=rollout_seed,
                              on_finish=score_when_done, spot=spot,
                              min_live_share=t.min_live_share, **forced_arm)
    rollout_s = time.perf_counter() - t0
    inner.close()
    scores, reward_wait_s = scorer.results()
    report = engine.last_report
    tlt_record = {}
    if buffer is not None:
      buffer.add(step, samples)
      # drafter_version: the weights this rollout drafted with (drafter_published: after it).
      tlt_record = {"drafter_version": engine.drafter_version, "buffer_tokens": buffer.num_tokens}
    if spot is not None:
      published_steps = report.drafter_steps
      if multi:  # one drafter for all processes: their step-weighted average
        spot.params, spot.opt_state, published_steps = multihost.sync_drafter(
            spot.params, spot.opt_state, report.drafter_steps)
      if published_steps:
        engine.update_drafter(*spot.publish())  # served from the next rollout on
      tlt_record.update(drafter_published=spot.version, drafter_steps=report.drafter_steps,
                        idle_device_s=report.idle_device_s,
                        drafter_steps_total=spot.steps_done,
                        **{f"drafter_{k}": v for k, v in report.drafter_metrics.items()})

    rewards = np.array([scores[i]["reward"] for i in range(N)], np.float32)
    correct = np.array([scores[i]["correct"] for i in range(N)], np.float32)
    batch_prompts = [s.prompt for s in samples]
    batch_tokens, batch_logps = [s.tokens for s in samples], [s.logprobs for s in samples]
    finish = [s.finish_reason for s in samples]
    if multi:  # the whole batch, every process's samples in process order
      g = multihost.gather_rollouts(batch_prompts, batch_tokens, batch_logps, rewards, correct,
                                    finish, max_prompt_len=r.max_prompt_len,
                                    max_new_tokens=r.max_new_tokens)
      batch_prompts, batch_tokens, batch_logps = g["prompts"], g["tokens"], g["logprobs"]
      rewards, correct, finish = g["rewards"], g["correct"], g["finish"]
    lengths = np.array([len(t) for t in batch_tokens], np.int32)
    if rl.overlong_buffer:
      rewards = rewards + np.asarray(algorithms.overlong_penalty(lengths, r.max_new_tokens,
                                                                 rl.overlong_buffer))
    advantages = np.asarray(algorithms.ADVANTAGES[rl.algorithm](rewards, G))
    mixed = np.asarray(algorithms.mixed_groups(rewards, G))
    keep = algorithms.dynamic_sampling_weights(rl.algorithm, correct, G)  # on accuracy (DAPO)
    batch = make_batch(batch_prompts, batch_tokens, batch_logps, advantages, train_len,
                       weights_N=keep)
    t0 = time.perf_counter()
    try:
      stats = trainer.step(batch)
    except FloatingPointError as e:
      # The update was not applied: save the state as it was, so nothing is lost; resuming
      # continues with the next batch.
      ckpt.save(step, run_state(), save_meta(step))
      ckpt.wait()
      raise FloatingPointError(f"RL step {step + 1}: {e}. The state before this step is saved in "
                               f"{workdir}/checkpoints/{step}; rerunning with this workdir "
                               "resumes there and skips this batch.") from e
    engine.update_policy(trainer.local_policy())
    train_s = time.perf_counter() - t0

    totals["rollout_s"] += rollout_s
    totals["idle_device_s"] = totals.get("idle_device_s", 0.0) + report.idle_device_s
    totals["drafter_steps"] = totals.get("drafter_steps", 0) + report.drafter_steps
    totals["train_s"] += train_s
    totals["reward_wait_s"] += reward_wait_s
    totals["kl_sample_train_max"] = max(totals["kl_sample_train_max"],
                                        abs(stats["kl_sample_train"]))
    totals["logp_abs_diff_max"] = max(totals["logp_abs_diff_max"], stats["logp_abs_diff_max"])
    record = {
        "reward_mean": float(rewards.mean()), "correct_mean": float(correct.mean()),
        "reward_std": float(rewards.std()), "mixed_group_fraction": float(mixed.mean()),
        "response_len_mean": float(lengths.mean()), "response_len_max": int(lengths.max()),
        "truncated_fraction": float(np.mean([f == "length" for f in finish])),
        "rollout_s": rollout_s, "reward_wait_s": reward_wait_s, "train_s": train_s,
        "rollout_tokens_per_s": float(sum(len(s.tokens) for s in samples) / rollout_s),
        "accept_len": report.accept_len, "sd_chunk_fraction": report.sd_chunk_fraction,
        **tlt_record, **stats}
    last_trace = report.trace
    if c.eval.every and (step + 1) % c.eval.every == 0 and step + 1 < rl.steps:
      t0 = time.perf_counter()
      record["eval_accuracy"] = run_eval(step + 1)["accuracy"]
      totals["eval_s"] += time.perf_counter() - t0
    record["step_s"] = time.perf_counter() - t_step
    writer.write(step + 1, record)
    bar.update(1)
    bar.set_postfix(reward=f"{record['reward_mean']:.3f}", len=f"{record['response_len_mean']:.0f}")
    last = step + 1 == rl.steps
    if (c.checkpoint.every and (step + 1) % c.checkpoint.every == 0) or last:
      ckpt.save(step + 1, run_state(), save_meta(step + 1))
  bar.close()
  scorer.close()

  t0 = time.perf_counter()
  eval_after = run_eval(rl.steps)
  totals["eval_s"] += time.perf_counter() - t0
  writer.write(rl.steps, {"eval_accuracy": eval_after["accuracy"]})
  writer.close()
  ckpt.wait()
  ckpt.close()
  # Every process's copy of the trained weights (a gather across hosts: all processes take
  # part); replicas on different processes must agree bitwise.
  final_policy = trainer.local_policy()
  fingerprint = multihost.fingerprint(trainer.local_trainable()) if multi else None
  mesh_info = {**{k: int(v) for k, v in trainer.mesh.shape.items()},
               "processes": len({d.process_index for d in trainer.mesh.devices.flat})}
  drafter_fingerprint = multihost.fingerprint(spot.params) if multi and spot else None
  if not primary:
    return {"workdir": workdir, "process_index": pid, "eval_after": eval_after,
            "eval_accuracy_after": eval_after["accuracy"], "trainable_sha256": fingerprint,
            "drafter_sha256": drafter_fingerprint, "train_mesh": mesh_info,
            "resumed_from": start_step or None}
  if c.checkpoint.export_adapter and c.lora.rank > 0:
    ckpt_lib.export_adapter(final_policy, os.path.join(workdir, "export", "adapter"),
                            base_model_name_or_path=os.path.abspath(c.model.hf_dir))
  if c.checkpoint.export_merged:
    merged = os.path.join(workdir, "export", "merged")
    ckpt_lib.export_merged_hf(final_policy, merged)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
      if os.path.exists(os.path.join(c.model.hf_dir, name)):  # a complete HF checkpoint
        shutil.copy(os.path.join(c.model.hf_dir, name), merged)
  records = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  plots = []
  if c.metrics.plots:
    plots = metrics_lib.plot_run(workdir, records, [t.__dict__ for t in last_trace] or None)
  steps_run = [x for x in records if "reward_mean" in x]
  summary = {
      "config": name, "workdir": workdir, "numerics": c.numerics, "algorithm": rl.algorithm,
      "lora_rank": c.lora.rank, "steps": rl.steps, "resumed_from": start_step or None,
      "tlt": bool(t.enabled), "spot_training": spot is not None,
      "accept_len_mean": (float(np.mean([x["accept_len"] for x in steps_run]))
                          if steps_run else None),
      "eval_problems": len(eval_rows), "eval_samples": c.eval.samples,
      "eval_accuracy_before": eval_before["accuracy"], "eval_accuracy_after": eval_after["accuracy"],
      "eval_before": eval_before, "eval_after": eval_after,
      "reward_first": steps_run[0]["reward_mean"] if steps_run else None,
      "reward_last": steps_run[-1]["reward_mean"] if steps_run else None,
      "wall_s": time.perf_counter() - t_start, "compile_s": compile_s, **totals,
      "data": data_report, "plots": [os.path.relpath(p, workdir) for p in plots],
      "train_mesh": mesh_info,
      **({"processes": jax.process_count(), "trainable_sha256": fingerprint,
          "drafter_sha256": drafter_fingerprint} if multi else {}),
  }
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary


def main(argv) -> None:
  del argv
  from absl import flags  # noqa: PLC0415

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
  summary = run(flags.FLAGS.config, name=f"{base}-{variant}" if variant else base)
  print(json.dumps({k: v for k, v in summary.items() if k not in ("eval_before", "eval_after")},
                   indent=2))


if __name__ == "__main__":
  from absl import app  # noqa: PLC0415
  from ml_collections import config_flags  # noqa: PLC0415

  config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "experiment config file[:variant]",
                                  lock_config=True)
  app.run(main)
