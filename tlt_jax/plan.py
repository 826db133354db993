"""Will a config fit? Per-device memory of every component of the RL job on the config's mesh,
computed abstractly (nothing of a 7B/32B model is allocated), and its programs lowered there.

    python -m tlt_jax.plan --config experiments/configs/qwen2_5_7b_8gpu.py
    python -m tlt_jax.plan --config FILE[:variant] --config.lora.rank=0 --json plan.json [--compile]

The CLI asks XLA for `plan.device_count` CPU devices (or the mesh's product) before JAX starts,
so a 32-device plan runs on a laptop; in a process whose JAX already has another device count
(tests) the same numbers come from a `jax.sharding.AbstractMesh`. `plan(c)` raises
`PlanDoesNotFit`, naming the largest components, when the per-device total exceeds
`plan.device_memory_gib x plan.headroom`; the CLI prints the table and exits 1.

What is counted, per device, from each array's shard shape on the mesh (`tlt_jax/mesh.py` rules):
  always   params (frozen base), trainable (LoRA, or all params at lora.rank=0), AdamW state
           (optax, as `rl/trainer.py` builds it), the drafter (an engine copy, the spot
           trainer's copy and its AdamW state; replicated, as `tlt/spot.py` places it),
           the drafter's data window (every sample's [max_new_tokens, D] hidden states, kept on
           device for tlt.window_steps steps);
  rollout  the engine's slots at its largest bucket (KV cache of every layer + the drafter's
           layer, slots = max_prompt_len + max_new_tokens + the widest SD window, padded to the
           KV split; per-token output buffers) and the step transients: the prefill of a whole
           bucket (a second cache, f32 logits over every prompt position) or a decode round;
  train    gradients (accumulated + one chunk's) and one chunk's activations: the residuals
           JAX's autodiff keeps for the real loss (`StepFunctions._loss_fn` traced abstractly over
           rl.chunk_rows x (max_prompt_len + max_new_tokens) tokens; no remat: the trainer has
           none) plus the largest backward transient (one layer's f32 attention scores, which
           the reference VJP of the batch-invariant attention recomputes, or the f32 logits'
           gradient).
total = always + max(rollout, train): the caches are gone when the trainer runs.

Cheap by construction: layers are identical, so sizes come from 1- and 2-layer abstract models
scaled to the real depth (tracing 64 layers costs minutes, 2 cost a second), and the lowered
programs (train grad, optimizer update, prefill, decode chunk) have `plan.lower_layers` layers
(0 = all). `--compile` also compiles them (needs the mesh's devices: the CLI has them) and adds
XLA's `memory_analysis()` for this host's backend. On CPU that is a rough check only: the
batch-invariant kernels run as their blocked pure-JAX twin there (far larger temporaries than the
Pallas kernels), and XLA:CPU keeps extra copies of the decode loop's output buffers. On the
accelerator itself (`JAX_PLATFORMS=cuda` or `tpu`, with the mesh's device count) the same flag
reports that backend's numbers.

Activation shards are a rule, not XLA's propagation: a leading batch axis over data x fsdp, the
MLP / vocabulary / head axes over model, hidden-size axes replicated over model (conservative).

The counting itself (shard shapes, residuals, the lowered programs) is `tlt_jax/plan_memory.py`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from tlt_jax import config as config_lib
from tlt_jax import determinism, ops
from tlt_jax import mesh as mesh_lib
from tlt_jax.model.drafter import Drafter
from tlt_jax.plan_memory import (GIB, _abstract_model, _bucket_rows, _count, _engine_config,
                                 _lower_programs, _mesh, _residuals, _Shards, _slots_bytes,
                                 _slots_shape, _slots_shardings, _split, _summary, mesh_sizes)
from tlt_jax.rl.trainer import TrainConfig, make_optimizer
from tlt_jax.rollout.tuner import Tuner

PHASES = ("always", "rollout", "train")


class PlanDoesNotFit(ValueError):
  """The per-device total exceeds the usable memory; `.plan` is the full result."""

  def __init__(self, message: str, plan: dict):
    super().__init__(message)
    self.plan = plan


@dataclasses.dataclass
class Row:
  name: str
  phase: str  # "always" | "rollout" | "train"
  global_bytes: float
  device_bytes: float
  sharding: str
  note: str = ""


# ---------------------------------------------------------------------------------------------
# Devices


def requested_devices(c: ml_collections.ConfigDict) -> int | None:
  """Devices to ask XLA for before JAX starts: plan.device_count, else a fully given mesh."""
  if c.plan.device_count:
    return int(c.plan.device_count)
  sizes = (c.mesh.data, c.mesh.fsdp, c.mesh.model)
  return None if -1 in sizes else math.prod(sizes)


# ---------------------------------------------------------------------------------------------
# The rows


def _g(nbytes: float) -> str:
  return _gib(nbytes / GIB)


def _gib(x: float) -> str:
  return f"{x:.2f}" if x >= 0.01 or x == 0 else f"{x:.1e}"


def _drafter_rows(c, mcfg, shards: _Shards, drafter) -> list[Row]:
  """Its own parameters (embedding and lm_head are the target's), replicated as the engine and
  the spot trainer place them, and the window of hidden states it trains on."""
  r, t = c.rollout, c.tlt
  leaves = jax.tree.leaves(nnx.state(drafter, nnx.Param))
  n = sum(math.prod(x.shape) for x in leaves)
  nbytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
  copies = 4 if t.spot_training else 1
  samples = r.prompts_per_step * r.group_size
  window = t.window_steps * samples * r.max_new_tokens * mcfg.hidden_size * \
      jnp.dtype(mcfg.dtype).itemsize
  return [
      Row("drafter", "always", nbytes * copies, nbytes * copies, "replicated",
          f"{n / 1e6:.0f}M params x {copies} (engine, trainer, mu, nu)" if copies > 1
          else f"{n / 1e6:.0f}M params (engine)"),
      Row("drafter data", "always", window, shards.rows(samples) / samples * window,
          shards.rule(samples), f"{t.window_steps} steps x {samples} samples x "
          f"{r.max_new_tokens} x {mcfg.hidden_size} hidden")]


def _rollout_rows(c, mcfg, mesh, shards: _Shards, n: int, target, drafter) -> list[Row]:
  """The engine's slots at its largest bucket and the larger of its step transients: a whole
  bucket's prefill (its new slots, f32 logits at every prompt position, one layer's
  intermediates) or a decode round at any bucket (logits of every verified token, a tree's
  per-query copy of one layer's cache)."""
  t = c.tlt
  ecfg = _engine_config(c, mcfg, t.enabled)
  D, V, I, H, K, hd = (  # noqa: E741 (I: the MLP width, in the shape-letter names used here)
      mcfg.hidden_size, mcfg.vocab_size, mcfg.intermediate_size, mcfg.num_heads,
                       mcfg.num_kv_heads, mcfg.head_dim)
  itemsize, L = jnp.dtype(mcfg.dtype).itemsize, mcfg.num_layers
  bucket, groups = _bucket_rows(c, ecfg)
  rows = bucket * groups
  slots = _slots_shape(target, drafter, ecfg, rows)
  g, slots_dev = _slots_bytes(slots, _slots_shardings(slots, mesh, shards, K), L)
  kv_rule = ("kv heads over model" if K % shards.model == 0 else
             f"kv heads replicated ({K} % model={shards.model})") if shards.model > 1 else ""
  out = [Row("kv cache", "rollout", g, slots_dev, shards.rule(rows, kv_rule),
             f"{rows} slots x {ecfg.num_slots} tokens x {L}{' + 1 drafter' if t.enabled else ''}"
             " layers; + output buffers")]

  P_, S, xla, rd = ecfg.max_prompt_len, ecfg.num_slots, c.numerics == "xla", shards.rows(rows)
  prefill = (slots_dev + rd * P_ * shards.over_model(V) * 4
             + rd * P_ * (5 * D + 3 * shards.over_model(I)) * itemsize
             + (4 * rd * shards.over_model(H) * P_ * S * 4 if xla else 0))  # as XLA:CPU holds
  tuner, decode = Tuner(ecfg.arms, ecfg.buckets), 0.0
  for b in (b for b in ecfg.buckets if b <= rows):
    for a in (a for a in ecfg.arms if a.name in tuner.allowed[b]):
      T, bd = a.verify_tokens, shards.rows(b)
      x = 3 * bd * T * shards.over_model(V) * 4
      x += 2 * bd * T * S * shards.over_model(K) * hd * itemsize if a.is_tree else 0
      x += 2 * bd * shards.over_model(H) * T * S * 4 if xla else 0
      decode = max(decode, x)
  peak = max(prefill, decode)
  out.append(Row("decode activations", "rollout", peak * shards.batch, peak,
                 shards.rule(rows, "vocab over model" if shards.model > 1 else ""),
                 f"peak: {'prefill' if prefill >= decode else 'decode round'} (prefill of "
                 f"{rows} rows: {_g(prefill)} GiB incl. its new slots; decode round: "
                 f"{_g(decode)} GiB)"))
  if t.enabled and t.spot_training:  # on the devices of a rollout group that has finished
    group_devices = n // groups
    step = -(-t.rows // group_devices) * t.row_len * (4 * V * 4 + (6 * D + 3 * I) * itemsize)
    out.append(Row("drafter step", "rollout", step * min(group_devices, t.rows), step,
                   "rows over a group's devices",
                   f"{t.rows} x {t.row_len} tokens: f32 logits x 4 + one layer"))
  return out


def _train_rows(c, mcfg, shards: _Shards, fsdp: int, layer_bytes: float) -> tuple[Row, str]:
  """One chunk's residuals (1- and 2-layer traces; linear in depth) plus the largest backward
  transient: one layer's f32 attention scores (the batch-invariant attention's reference VJP
  recomputes them; XLA's attention keeps them too) or the f32 logits' gradient."""
  L = mcfg.num_layers
  R, T = c.rl.chunk_rows, c.rollout.max_prompt_len + c.rollout.max_new_tokens
  exact_tp = (c.numerics == "batch_invariant" and shards.model > 1
              and c.rl.exact_tensor_parallel)
  g1, d1 = _residuals(c, mcfg, 1, shards)
  g2, d2 = (g1, d1) if L == 1 else _residuals(c, mcfg, 2, shards)
  g_res, d_res = g1 + (L - 1) * (g2 - g1), d1 + (L - 1) * (d2 - d1)
  rdev = shards.rows(R)
  if exact_tp and not c.rl.tp_regather:
    # tensor_parallel.py: the traces above split as XLA would. On top of that, without
    # rl.tp_regather each layer keeps the whole gathered inputs of o_proj [H*hd] and down_proj
    # [I] for the backward, and the model the whole gathered logits [V] (f32), where XLA's split
    # keeps 1/model. With it, the backward gathers and recomputes them instead (and the traces'
    # 1/model of the logits is an overcount).
    whole = 1 - 1 / shards.model
    per_layer = rdev * T * (mcfg.num_heads * mcfg.head_dim + mcfg.intermediate_size) * \
        jnp.dtype(mcfg.dtype).itemsize
    extra = whole * (L * per_layer + rdev * T * mcfg.vocab_size * 4)
    d_res += extra
    g_res += extra * shards.batch * shards.model
  scores = 3 * rdev * shards.over_model(mcfg.num_heads) * T * T * 4
  if exact_tp and c.rl.tp_regather:  # whole vocabulary, one head chunk of tokens at a time
    dlogits = 2 * rdev * min(T, TrainConfig.from_config(c).head_chunk_tokens) * mcfg.vocab_size * 4
  else:
    vocab = mcfg.vocab_size if exact_tp else shards.over_model(mcfg.vocab_size)
    dlogits = 2 * rdev * T * vocab * 4
  # FSDP gathers one layer's weights (split only over model) going forward and again backward.
  gather = 2 * layer_bytes / shards.model if fsdp > 1 else 0.0
  transient = max(scores, dlogits) + gather
  split = "mlp/vocab/heads over model" if shards.model > 1 else ""
  if exact_tp:
    split += (", exact tensor parallelism (the backward gathers o_proj/down_proj inputs "
              "again and recomputes the logits, whole, in head chunks)" if c.rl.tp_regather else
              ", o_proj/down_proj inputs and logits whole (exact tensor parallelism)")
  row = Row("train activations", "train", g_res + transient * shards.batch, d_res + transient,
            shards.rule(R, split) + f" ({rdev:g} rows/device)",
            f"{R} x {T} tokens: residuals {_g(d_res)} + backward transient {_g(transient)} GiB "
            f"({'attention scores' if scores >= dlogits else 'dlogits'}"
            f"{', fsdp gathers' if gather else ''})")
  itemsize = jnp.dtype(mcfg.dtype).itemsize
  remat = L * rdev * T * mcfg.hidden_size * itemsize + d1 + transient
  note = (f"with per-layer remat (rl/trainer.py has none) train activations would be "
          f"~{_g(remat)} GiB per device instead of {_g(d_res + transient)}")
  return row, note


# ---------------------------------------------------------------------------------------------
# The plan


def plan(c: ml_collections.ConfigDict, *, name: str = "config", lower: bool = True,
         compile: bool = False) -> dict:
  """Per-device memory of the job `c` describes, on its mesh; raises PlanDoesNotFit (the result
  attached) when it exceeds plan.device_memory_gib x plan.headroom."""
  config_lib.validate(c)
  n = c.plan.device_count or len(mesh_lib.run_devices())
  sizes = mesh_sizes(c, n, "plan.device_count" if c.plan.device_count else "local devices")
  mesh, mesh_kind = _mesh(sizes)
  data, fsdp, model_ax = sizes
  mcfg = config_lib.model_config(c)
  D, L = mcfg.hidden_size, mcfg.num_layers
  shards = _Shards(data * fsdp, model_ax, frozenset(
      {mcfg.intermediate_size, mcfg.vocab_size, mcfg.num_heads * mcfg.head_dim,
       mcfg.num_kv_heads * mcfg.head_dim, mcfg.num_heads, mcfg.num_kv_heads} - {D}))
  full_ft = c.lora.rank == 0

  # Parameters, trainable, optimizer: a 1-layer abstract model, scaled to L layers.
  m1 = _abstract_model(mcfg, c, 1)
  _, trainable, frozen = _split(m1, full_ft)
  base, train_n = _count(frozen, mesh, L), _count(trainable, mesh, L)
  opt = _count(jax.eval_shape(make_optimizer(TrainConfig.from_config(c)).init, trainable), mesh, L)
  ref = 2 if c.rl.kl_coef else 1  # KL reference: a copy (full FT) or zeroed adapters (LoRA)
  rows = [
      Row("params", "always", base.global_bytes, base.device_bytes, _summary(base.by_axes),
          "none frozen: full fine-tuning" if full_ft else "frozen base"),
      Row("trainable", "always", train_n.global_bytes * ref, train_n.device_bytes * ref,
          _summary(train_n.by_axes),
          ("all params (lora.rank=0)" if full_ft else f"LoRA rank {c.lora.rank}")
          + (" + KL reference copy" if ref == 2 else "")),
      Row("optimizer", "always", opt.global_bytes, opt.device_bytes, _summary(opt.by_axes),
          "AdamW mu + nu" + (" (full fine-tuning: lora.rank=0)" if full_ft else "")),
      Row("gradients", "train", 2 * train_n.global_bytes, 2 * train_n.device_bytes,
          _summary(train_n.by_axes), "accumulated + one chunk's")]
  drafter = nnx.eval_shape(lambda: Drafter(mcfg, nnx.Rngs(c.seed + 1))) if c.tlt.enabled else None
  if drafter is not None:
    rows += _drafter_rows(c, mcfg, shards, drafter)
  rows += _rollout_rows(c, mcfg, mesh, shards, n, m1, drafter)
  train_row, remat_note = _train_rows(c, mcfg, shards, fsdp,
                                      base.layer_bytes + train_n.layer_bytes)
  rows.append(train_row)

  phase = {p: sum(x.device_bytes for x in rows if x.phase == p) for p in PHASES}
  total = phase["always"] + max(phase["rollout"], phase["train"])
  rows.append(Row("total", "rollout" if phase["rollout"] >= phase["train"] else "train",
                  sum(x.global_bytes for x in rows), total, "",
                  f"always {_g(phase['always'])} + max(rollout {_g(phase['rollout'])}, "
                  f"train {_g(phase['train'])})"))
  gathered = (base.global_bytes + train_n.global_bytes) / (data * model_ax)
  with ops.numerics_mode(c.numerics, c.numerics_backend):
    kernels = ops.backend()
  notes = [remat_note] + ([f"rl.chunk_rows={c.rl.chunk_rows} is not a multiple of data x "
                           f"fsdp={shards.batch}: the trainer refuses it (each device takes "
                           "whole rows)"]
                          if c.rl.chunk_rows % shards.batch else []) + [
      "assumed: engine and trainer both lay out on c.mesh. The engine does so with "
      "rollout.tensor_parallel=True and mesh.model devices per rollout group (local devices / "
      "rollout.groups): each group splits the model over its devices, the groups split the "
      "rows. Otherwise train.py replicates the engine over each group's devices. The trainer "
      "runs on c.mesh over all devices of the run (several processes: one mesh across the "
      "hosts)"] + ([
      "the batch-invariant trainer runs its forward in shard_map over data x fsdp: parameters "
      f"are gathered over fsdp at its entry, up to {_g(gathered)} GiB per device at once if XLA "
      "does not schedule the gathers per layer (counted above as per-layer)"]
      if c.numerics == "batch_invariant" and fsdp > 1 else []) + [
      f"traced and lowered with numerics={c.numerics!r} ({kernels} kernels on this host; the "
      "batch-invariant kernels save the same residuals on every backend)"]
  usable = c.plan.device_memory_gib * c.plan.headroom
  result = {
      "name": name, "devices": n, "mesh": dict(zip(mesh_lib.MESH_AXES, sizes)),
      "mesh_kind": mesh_kind,
      "model": {"arch": mcfg.arch, "layers": L, "hidden": D, "vocab": mcfg.vocab_size,
                "params": (train_n if full_ft else base).elements,
                "trainable": train_n.elements, "dtype": mcfg.dtype},
      "rows": [dict(dataclasses.asdict(x), global_gib=x.global_bytes / GIB,
                    device_gib=x.device_bytes / GIB) for x in rows],
      "total_device_gib": total / GIB, "device_memory_gib": c.plan.device_memory_gib,
      "headroom": c.plan.headroom, "usable_gib": usable or None,
      "fits": (total / GIB <= usable) if usable else None, "notes": notes,
  }
  if lower:
    if compile and mesh_kind != "devices":
      raise ValueError(f"--compile needs the mesh's {n} devices, this process has "
                       f"{len(mesh_lib.run_devices())} (the CLI asks XLA for them)")
    result["lowered_layers"] = min(L, c.plan.lower_layers or L)
    result["lowered"] = _lower_programs(c, mcfg, mesh, shards, result["lowered_layers"], compile)
  if result["fits"] is False:
    raise PlanDoesNotFit(_no_fit_message(result, rows, c), result)
  return result


HINTS = {
    "params": "a larger mesh.fsdp or mesh.model (params are sharded over both)",
    "trainable": "lora.rank>0 (LoRA trains a fraction of the params), a larger mesh.fsdp",
    "optimizer": "lora.rank>0, a larger mesh.fsdp (AdamW state follows the params' shards)",
    "gradients": "lora.rank>0, a larger mesh.fsdp",
    "drafter": "tlt.spot_training=False or tlt.enabled=False (the drafter is replicated)",
    "drafter data": "a smaller tlt.window_steps or rollout.max_new_tokens",
    "kv cache": "a smaller largest rollout.buckets entry (fewer slots at once), a smaller "
                "rollout.max_new_tokens, mesh.model dividing model.num_kv_heads",
    "decode activations": "a smaller largest rollout.buckets entry (the prefill of a whole bucket "
                          "holds f32 logits over every prompt position), a smaller max_prompt_len",
    "drafter step": "smaller tlt.rows or tlt.row_len",
    "train activations": "a smaller rl.chunk_rows (down to data x fsdp), a larger mesh.model, a "
                         "smaller rollout.max_new_tokens, per-layer remat in the trainer",
}


def _no_fit_message(result: dict, rows: list[Row], c) -> str:
  peak = rows[-1].phase
  parts = sorted((x for x in rows[:-1] if x.phase in ("always", peak)),
                 key=lambda x: -x.device_bytes)[:2]
  largest = "; ".join(f"{x.name} {x.device_bytes / GIB:.1f} GiB"
                      + (f" ({x.note})" if x.note else "") for x in parts)
  hints = "; ".join(dict.fromkeys(HINTS[x.name] for x in parts if x.name in HINTS))
  mesh = " x ".join(f"{k}={v}" for k, v in result["mesh"].items())
  return (f"{result['name']}: per-device total {result['total_device_gib']:.1f} GiB > "
          f"{result['usable_gib']:.1f} GiB usable ({c.plan.device_memory_gib:g} GiB x "
          f"{c.plan.headroom:g}) on mesh {mesh}; largest: {largest} - try {hints}")


# ---------------------------------------------------------------------------------------------
# Output and CLI


def format_table(result: dict) -> str:
  m = result["model"]
  lines = [f"{result['name']}: {result['devices']} devices, mesh "
           + " x ".join(f"{k}={v}" for k, v in result["mesh"].items())
           + f" ({result['mesh_kind']}); {m['arch']} {m['layers']} layers, "
           f"{m['params'] / 1e9:.2f}B params {m['dtype']}, {m['trainable'] / 1e6:.1f}M trainable",
           f"{'component':<19} {'phase':<8} {'global GiB':>11} {'per-device GiB':>15}  "
           "sharding / what"]
  for x in result["rows"]:
    if x["name"] == "total":
      lines.append("-" * 72)
    what = "; ".join(s for s in (x["sharding"], x["note"]) if s)
    lines.append(f"{x['name']:<19} {x['phase']:<8} {_gib(x['global_gib']):>11} "
                 f"{_gib(x['device_gib']):>15}  {what}")
  if result["usable_gib"]:
    spare = result["usable_gib"] - result["total_device_gib"]
    lines.append(f"usable: {result['device_memory_gib']:g} GiB x {result['headroom']:g} = "
                 f"{result['usable_gib']:.1f} GiB per device -> "
                 + (f"fits ({spare:.1f} GiB spare)" if result["fits"] else
                    f"DOES NOT FIT ({-spare:.1f} GiB over)"))
  else:
    lines.append("no fit check (plan.device_memory_gib=0)")
  if result.get("lowered"):
    lines.append(f"lowered on the mesh ({result['lowered_layers']} of {m['layers']} layers; "
                 "layers are identical):")
    for p in result["lowered"]:
      extra = (f", compiled {p['compile_s']}s: XLA temp {p['temp']:.2f} GiB, arguments "
               f"{p['argument']:.2f} GiB per device (this host's backend)" if "temp" in p else "")
      lines.append(f"  {p['program']:<17} {p['lower_s']:>6.2f}s  {p['what']}{extra}")
  return "\n".join(lines + [f"note: {x}" for x in result["notes"]])


def format_prediction(c: ml_collections.ConfigDict, name: str, hardware: str = "") -> str:
  """The cost model's step breakdown and predicted speedups for `c` on its hardware
  (`tlt_jax/perf/predict.py`; the profile from --hardware, the config's name, or
  plan.device_memory_gib). A model, not a measurement: its assumptions are listed with it."""
  from tlt_jax.perf import calibration, predict  # noqa: PLC0415 (the memory plan needs neither)

  hw_name = hardware or predict.hardware_for(c, name)
  if not hw_name:
    return ("predicted step time: no hardware profile for this config (pass --hardware, one "
            "of h100_sxm, h200, h20, gh200, gb200, tpu_v5e, tpu_v5p, cpu_2core)")
  try:
    r = predict.predict_config(c, name, calibration.profile(hw_name), trials=2)
  except ValueError as e:
    return f"predicted step time: not available ({e})"
  lines = [f"predicted step time on {r['devices']} x {hw_name} ({r['groups']} rollout groups, "
           f"TP {r['tp']}), from the cost model (tlt_jax/perf/predict.py):",
           f"  {'program':<26} {'ms per call':>12}  source    bound    what"]
  for x in r["breakdown"]:
    lines.append(f"  {x['program']:<26} {x['seconds'] * 1e3:>12.3f}  {x['source']:<9} "
                 f"{x['bound']:<8} {x['note']}")
  m = r["measurements"]
  lines.append(f"  measured programs used: {m['programs_measured']} ({m['files']}); the rest "
               "from the roofline model")
  v = r["variants"]
  lines.append("  per RL step (simulated long tail): " + "; ".join(
      f"{k} rollout {v[k]['rollout_s']:.1f} s, step {v[k]['step_s']:.1f} s"
      + (f" ({v[k]['arm']}, accept {v[k]['accept_len']:.2f})" if v[k].get("arm") else "")
      for k in ("sd_off", "static_sd", "adaptive_sd", "tlt")))
  needed = ", ".join(f"{k}: {'out of reach' if a is None else f'accept {a}'}"
                     for k, a in r["accept_needed"].items())
  lines.append(f"  predicted speedup: TLT {r['predicted_speedup_tlt']:.2f}x, static SD "
               f"{r['predicted_speedup_static_sd']:.2f}x, adaptive SD "
               f"{r['predicted_speedup_adaptive_sd']:.2f}x over SD off; idle device-s for the "
               f"drafter {r['idle_device_s_for_drafter']:.1f}; TLT needs "
               f"({r['accept_needed_arm']}) "
               + needed)
  lines += [f"  assumed {k}: {a}" for k, a in r["assumptions"].items()]
  return "\n".join(lines)


def main(argv) -> None:
  from absl import flags  # noqa: PLC0415 (the CLI's flag modules, only when run as a script)

  if len(argv) > 1:
    raise SystemExit(f"unexpected arguments {argv[1:]}")
  FLAGS = flags.FLAGS
  path = FLAGS["config"].config_filename
  name = os.path.splitext(os.path.basename(path.split(":")[0]))[0] + (
      f":{path.split(':', 1)[1]}" if ":" in path else "")
  message = ""
  try:
    result = plan(FLAGS.config, name=name, lower=not FLAGS.no_lower, compile=FLAGS.compile)
  except PlanDoesNotFit as e:
    result, message = e.plan, str(e)
  except ValueError as e:  # a config or mesh that cannot be planned at all
    print(f"plan: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  print(format_table(result))
  print(format_prediction(FLAGS.config, name, FLAGS.hardware))
  if FLAGS.json:
    with open(FLAGS.json, "w") as f:
      json.dump(result, f, indent=2, default=float)
  if message:
    print(f"plan: {message}", file=sys.stderr)
    raise SystemExit(1)


def _start() -> None:
  """Parses the config, asks XLA for its device count, then lets JAX start."""
  from absl import app, flags  # noqa: PLC0415 (the CLI's flag modules, only when run as a script)
  from jax._src import xla_bridge  # noqa: PLC0415 (the CLI's flag modules, only when run as a script)
  from ml_collections import config_flags  # noqa: PLC0415 (the CLI's flag modules, only when run as a script)


  default = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "experiments", "configs", "tiny_arith.py")
  config_flags.DEFINE_config_file("config", default, "experiment config file[:variant]",
                                  lock_config=True)
  flags.DEFINE_string("json", "", "also write the plan as JSON here")
  flags.DEFINE_bool("compile", False, "also compile the lowered programs (slow) and report "
                    "XLA's memory_analysis()")
  flags.DEFINE_bool("no_lower", False, "the memory table only")
  flags.DEFINE_string("hardware", "", "hardware profile for the predicted step time "
                      "(tlt_jax/perf/hardware.py; default: by config name or device memory)")

  def run(argv):
    c = flags.FLAGS.config
    if not xla_bridge.backends_are_initialized():
      if not os.environ.get("JAX_PLATFORMS"):
        # CPU only: planning needs no accelerator and must not take one's memory (JAX would
        # preallocate it); the env var is read at `import jax`, too late here, the config is not.
        jax.config.update("jax_platforms", "cpu")
      n = requested_devices(c)
      if n:
        determinism.force_host_devices(n)  # read when JAX creates its CPU backend
    determinism.configure(c.numerics, c.xla_determinism, c.numerics_f32_matmul)
    main(argv)
  app.run(run)


if __name__ == "__main__":
  _start()
