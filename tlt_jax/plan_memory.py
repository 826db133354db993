"""The abstract counting behind `tlt_jax.plan`, which is its only user: the mesh a plan runs on,
the RL job's pieces built abstractly as the job builds them (model and LoRA split, AdamW, engine
slots, the trainer's chunk), per-device bytes from each array's shard shape (`_Count`, `_Shards`,
the engine's slots, the residuals autodiff keeps) and the job's programs lowered on the mesh.
Named for what it measures, per-device memory; which rows a plan has, whether they fit and the CLI
stay in `plan.py`.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.extend import core as jcore
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax import mesh as mesh_lib
from tlt_jax import ops
from tlt_jax.model import lora
from tlt_jax.model.drafter import Drafter
from tlt_jax.model.transformer import ModelConfig, Transformer
from tlt_jax.rl.trainer import StepFunctions, TrainConfig
from tlt_jax.rollout import steps as rollout_steps
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.tuner import OFF, Arm, Tuner, parse_arms

GIB = 2 ** 30


# ---------------------------------------------------------------------------------------------
# Mesh


def mesh_sizes(c: ml_collections.ConfigDict, n: int, source: str) -> tuple[int, int, int]:
  """(data, fsdp, model) over n devices; a mismatch names the keys."""
  sizes = [c.mesh.data, c.mesh.fsdp, c.mesh.model]
  text = f"mesh.data={sizes[0]} x mesh.fsdp={sizes[1]} x mesh.model={sizes[2]}"
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"{text}: every mesh axis must be a positive size or -1 (the rest)")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if n % known:
      raise ValueError(f"{text}: the fixed axes ({known} devices) do not divide {source}={n}")
    sizes[sizes.index(-1)] = n // known
  elif known != n:
    raise ValueError(f"{text} needs {known} devices, but {source}={n}: set the mesh axes so their "
                     f"product is {n}, or plan.device_count={known}")
  return tuple(sizes)


def _mesh(sizes: tuple[int, int, int]):
  """The real devices when there are exactly that many, else an AbstractMesh (same shardings)."""
  devices = mesh_lib.run_devices()
  if len(devices) == math.prod(sizes):
    return mesh_lib.make_mesh(*sizes, devices=devices), "devices"
  return AbstractMesh(sizes, mesh_lib.MESH_AXES,
                      axis_types=mesh_lib.auto_axes(mesh_lib.MESH_AXES)), "abstract"


# ---------------------------------------------------------------------------------------------
# The job's pieces, abstractly and as the RL job builds them


def _abstract_model(mcfg: ModelConfig, c, layers: int) -> Transformer:
  cfg = dataclasses.replace(mcfg, num_layers=layers)

  def build():
    model = Transformer(cfg, nnx.Rngs(c.seed))
    if c.lora.rank > 0:
      lora.apply_lora(model, rank=c.lora.rank, alpha=c.lora.alpha, targets=tuple(c.lora.targets),
                      seed=c.seed)
    return model
  return nnx.eval_shape(build)


def _split(model: Transformer, full_ft: bool):
  """(graphdef, trainable, frozen), as Trainer splits the model."""
  return nnx.split(model, nnx.Param if full_ft else nnx.LoRAParam, ...)


def _engine_config(c, mcfg: ModelConfig, with_drafter: bool) -> EngineConfig:
  """The job's engine config (`EngineConfig.from_config`), with the policy's end tokens."""
  arms = parse_arms(c.tlt.arms) if with_drafter else (Arm(OFF),)
  return EngineConfig.from_config(c, mcfg.eos_ids, arms)


def _train_inputs(c):
  """One chunk of the longest rows (and the prepare pass's outputs when there is one)."""
  R, L, f32 = c.rl.chunk_rows, c.rollout.max_prompt_len + c.rollout.max_new_tokens, jnp.float32
  chunk = (jax.ShapeDtypeStruct((R, L), jnp.int32), jax.ShapeDtypeStruct((R, L - 1), bool),
           jax.ShapeDtypeStruct((R, L - 1), f32), jax.ShapeDtypeStruct((R,), f32))
  extra = (None, None, None)
  if not (c.rl.minibatches == 1 and c.rl.epochs == 1):
    logp = jax.ShapeDtypeStruct((R, L - 1), f32)
    extra = (logp, logp if c.rl.tis_cap else None, logp if c.rl.kl_coef else None)
  return chunk, extra


def _slots_shape(target, drafter, ecfg, rows: int):
  """The engine's state for `rows` slots (`rollout.steps.prefill` evaluated abstractly)."""
  gd, params = nnx.split(target)
  dgd, dparams = nnx.split(drafter) if drafter is not None else (None, None)

  def init(params, dparams):
    d = nnx.merge(dgd, dparams) if dgd is not None else None
    zeros, ones = jnp.zeros((rows, ecfg.max_prompt_len), jnp.int32), jnp.ones((rows,), jnp.int32)
    return rollout_steps.prefill(nnx.merge(gd, params), d, ecfg, zeros, ones, ones, ones,
                                 jnp.int32(0))
  with ops.numerics_mode("xla"):  # shapes only
    return jax.eval_shape(init, params, dparams)


def _bucket_rows(c, ecfg) -> tuple[int, int]:
  """(rows of one group's largest bucket, groups of the whole run): every process runs
  `rollout.groups` engines on its share of the step's prompts; an engine starts in the smallest
  bucket that holds its share of the batch, or the largest bucket."""
  r = c.rollout
  groups = max(r.groups, 1) * max(c.distributed.num_processes, 1)
  share = -(-r.prompts_per_step * r.group_size // groups)
  return next((b for b in ecfg.buckets if b >= share), ecfg.buckets[-1]), groups


# ---------------------------------------------------------------------------------------------
# Bytes per device


def _spec(path: str, shape: tuple[int, ...], mesh) -> P:
  try:
    return mesh_lib.param_spec(path, shape, mesh)
  except KeyError:  # optimizer counters and other scalars: replicated
    return P()


def _shardings(tree, mesh):
  """The mesh.py rules for params, and for optimizer state through its param-shaped paths."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, _spec(mesh_lib._path_str(path), x.shape, mesh)), tree)


def _axes(spec: P) -> tuple[str, ...]:
  used = set()
  for entry in spec:
    used |= {entry} if isinstance(entry, str) else set(entry or ())
  return tuple(a for a in mesh_lib.MESH_AXES if a in used)


def _summary(by_axes: dict[tuple[str, ...], float]) -> str:
  total = sum(by_axes.values()) or 1.0
  items = sorted(by_axes.items(), key=lambda kv: -kv[1])
  return ", ".join(f"{'+'.join(k) if k else 'replicated'} {100 * v / total:.0f}%"
                   for k, v in items[:3] if v / total >= 0.005) or "-"


@dataclasses.dataclass
class _Count:
  elements: float = 0.0
  global_bytes: float = 0.0
  device_bytes: float = 0.0
  layer_bytes: float = 0.0  # one decoder layer's share of global_bytes
  by_axes: dict = dataclasses.field(default_factory=dict)


def _count(tree, mesh, layers: int) -> _Count:
  """Sizes of an abstract pytree of a 1-layer model as the `layers`-layer model's (its leaves
  under layers/0/ stand for every layer's)."""
  n = _Count()
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    p = mesh_lib._path_str(path)
    in_layer = re.search(r"(^|/)layers/\d+/", p) is not None
    mult = layers if in_layer else 1
    spec = _spec(p, leaf.shape, mesh)
    size = math.prod(leaf.shape) * leaf.dtype.itemsize
    n.elements += math.prod(leaf.shape) * mult
    n.global_bytes += size * mult
    n.device_bytes += (math.prod(NamedSharding(mesh, spec).shard_shape(leaf.shape))
                       * leaf.dtype.itemsize * mult)
    n.layer_bytes += size if in_layer else 0
    n.by_axes[_axes(spec)] = n.by_axes.get(_axes(spec), 0.0) + size * mult
  return n


@dataclasses.dataclass(frozen=True)
class _Shards:
  """How activations split: rows over data x fsdp, one MLP / vocab / head axis over model."""
  batch: int
  model: int
  model_dims: frozenset  # axis sizes the rules shard over `model` (never the hidden size)

  def rows(self, n: int) -> float:
    return n / self.batch if n % self.batch == 0 else n

  def over_model(self, dim: int) -> float:
    return dim / self.model if dim % self.model == 0 else dim

  def activation(self, shape, itemsize: int) -> float:
    n = math.prod(shape) * itemsize
    if shape and shape[0] % self.batch == 0:
      n /= self.batch
    for d in shape[1:]:
      if d in self.model_dims and d % self.model == 0:
        return n / self.model
    return n

  def rule(self, rows: int, extra: str = "") -> str:
    first = ("rows over data+fsdp" if rows % self.batch == 0 else "rows replicated"
             ) if self.batch > 1 else ""
    return ", ".join(x for x in (first, extra) if x) or "replicated"


def _slots_shardings(slots, mesh, shards: _Shards, kv_heads: int):
  """Rows over data x fsdp; the caches' KV heads ([B, S, K, D]) over model when they divide."""
  def one(path, leaf):
    spec = [None] * len(leaf.shape)
    if leaf.shape and leaf.shape[0] % shards.batch == 0 and shards.batch > 1:
      spec[0] = mesh_lib.LOGICAL_TO_MESH["batch"]
    if (re.match(r"(draft_)?cache/", mesh_lib._path_str(path)) and shards.model > 1
        and kv_heads % shards.model == 0):
      spec[2] = "model"
    return NamedSharding(mesh, P(*spec))
  return jax.tree_util.tree_map_with_path(one, slots)


def _slots_bytes(slots, shardings, layers: int) -> tuple[float, float]:
  """(global, per-device) bytes of a 1-layer target's slots, its cache scaled to `layers`."""
  g = d = 0.0
  for (path, leaf), sh in zip(jax.tree_util.tree_leaves_with_path(slots),
                              jax.tree.leaves(shardings)):
    nbytes = leaf.dtype.itemsize * (layers if mesh_lib._path_str(path).startswith("cache/") else 1)
    g += math.prod(leaf.shape) * nbytes
    d += math.prod(sh.shard_shape(leaf.shape)) * nbytes
  return g, d


_ALIASING = ("reshape", "squeeze", "expand_dims")  # bitcasts in XLA: no buffer of their own


def _residual_buffers(jaxpr) -> list:
  """Avals of the distinct buffers among a jaxpr's outputs: inputs (the parameters) and
  reshaped views of another output are not counted again."""
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  inputs, roots = set(jaxpr.invars), {}
  for v in jaxpr.outvars:
    if isinstance(v, jcore.Literal):
      continue
    while v in producer and producer[v].primitive.name in _ALIASING:
      v = producer[v].invars[0]
    if v not in inputs and not isinstance(v, jcore.Literal):
      roots[v] = v.aval
  return list(roots.values())


def _residuals(c, mcfg, layers: int, shards: _Shards) -> tuple[float, float]:
  """(global, per-device) bytes autodiff keeps from the forward of one chunk for its backward:
  what `StepFunctions._loss_fn`'s pullback closes over, traced (not run) with `layers` layers."""
  graphdef, trainable, frozen = _split(_abstract_model(mcfg, c, layers), c.lora.rank == 0)
  tcfg = TrainConfig.from_config(c)
  chunk, extra = _train_inputs(c)
  reference = trainable if c.rl.kl_coef else None

  def pullback_leaves(trainable, frozen, reference, chunk, extra):
    shim = StepFunctions(tcfg, graphdef)
    loss = lambda t: shim._loss_fn(t, frozen, reference, jnp.float32(1.0),
                                   *chunk, *extra)
    return jax.tree.leaves(jax.vjp(loss, trainable, has_aux=True)[1])

  with ops.numerics_mode(c.numerics, c.numerics_backend):
    closed = jax.make_jaxpr(pullback_leaves)(trainable, frozen, reference, chunk, extra)
  res = _residual_buffers(closed.jaxpr)
  return (sum(math.prod(x.shape) * x.dtype.itemsize for x in res),
          sum(shards.activation(x.shape, x.dtype.itemsize) for x in res))


# ---------------------------------------------------------------------------------------------
# Lowering


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def _lower(fn, args, platform: str | None, donate=(), compile_: bool = False) -> dict:
  """Lowers (and compiles) for the mesh's devices, or for `platform` on an AbstractMesh."""
  t0 = time.perf_counter()
  traced = jax.jit(fn, donate_argnums=donate).trace(*args)
  lowered = traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()
  out = {"lower_s": round(time.perf_counter() - t0, 2)}
  if compile_:
    t0 = time.perf_counter()
    mem = lowered.compile().memory_analysis()
    out["compile_s"] = round(time.perf_counter() - t0, 2)
    if mem is not None:
      out.update({k: getattr(mem, f"{k}_size_in_bytes") / GIB
                  for k in ("temp", "argument", "output", "alias")})
  return out


def _lower_programs(c, mcfg, mesh, shards: _Shards, layers: int, compile_: bool) -> list[dict]:
  """The train step (gradient of one chunk, optimizer update) and the rollout programs (prefill
  of the largest bucket, one decode chunk with its widest SD arm), with `layers` layers, their
  inputs carrying the shardings the memory rows assume."""
  model = _abstract_model(mcfg, c, layers)
  graphdef, trainable, frozen = _split(model, c.lora.rank == 0)
  tr = _abstract(trainable, _shardings(trainable, mesh))
  fr = _abstract(frozen, _shardings(frozen, mesh))
  replicated = NamedSharding(mesh, P())
  batch = lambda x: None if x is None else jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=mesh_lib.batch_sharding(mesh, len(x.shape))
      if x.shape and x.shape[0] % shards.batch == 0 else replicated)
  chunk, extra = (tuple(map(batch, x)) for x in _train_inputs(c))
  # The trainer's own step functions, lowered under GSPMD on the plan's mesh (mesh=None: no
  # shard_map). The batch-invariant trainer runs its forward in shard_map over data x fsdp
  # (parameters gathered over fsdp); `plan` notes that gather.
  fns = StepFunctions(TrainConfig.from_config(c), graphdef)
  backend = mesh_lib.default_platform() or jax.default_backend()
  platform = None if isinstance(mesh, jax.sharding.Mesh) else {"gpu": "cuda"}.get(backend, backend)
  drafter = nnx.eval_shape(lambda: Drafter(mcfg, nnx.Rngs(c.seed + 1))) if c.tlt.enabled else None
  ecfg = _engine_config(c, mcfg, drafter is not None)
  bucket, groups = _bucket_rows(c, ecfg)
  rows = bucket * groups
  arm = max((a for a in ecfg.arms if a.name in Tuner(ecfg.arms, ecfg.buckets).allowed[bucket]),
            key=lambda a: a.verify_tokens)
  # The engine serves the policy itself (LoRA unmerged, as the trainer runs it).
  tgd, tparams = nnx.split(model)
  tparams = _abstract(tparams, _shardings(tparams, mesh))
  dgd, dparams = nnx.split(drafter) if drafter is not None else (None, None)
  dparams = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                         dparams)
  models = lambda p, d: (nnx.merge(tgd, p), nnx.merge(dgd, d) if dgd else None)
  slots = _slots_shape(model, drafter, ecfg, rows)
  slots = _abstract(slots, _slots_shardings(slots, mesh, shards, mcfg.num_kv_heads))
  i32 = lambda *s: batch(jax.ShapeDtypeStruct(s, jnp.int32))

  def grad(trainable, frozen, reference, chunk, extra):
    return fns._grad_fn(trainable, frozen, reference, jnp.float32(1.0), *chunk, *extra)

  def prefill(p, d, *args):
    return rollout_steps.prefill(*models(p, d), ecfg, *args)

  def decode(p, d, s, seed):
    return rollout_steps.decode_chunk(*models(p, d), ecfg, arm, s, seed)

  opt = jax.eval_shape(fns.tx.init, trainable)
  R, L = chunk[0].shape
  programs = [
      ("train grad",
       f"StepFunctions._grad_fn: forward + backward of the policy loss, {R} x {L} tokens",
       grad, (tr, fr, tr if c.rl.kl_coef else None, chunk, extra), ()),
      ("optimizer update", "StepFunctions._apply_fn: clip + AdamW",
       fns._apply_fn,
       (tr, _abstract(opt, _shardings(opt, mesh)), tr), (0, 1)),
      ("prefill", f"steps.prefill of {rows} rows x {ecfg.max_prompt_len} tokens", prefill,
       (tparams, dparams, i32(rows, ecfg.max_prompt_len), i32(rows), i32(rows), i32(rows), i32()),
       ()),
      ("decode chunk", f"steps.decode_chunk ({arm.name}, {ecfg.chunk_steps} rounds) over "
       f"{rows} slots of {ecfg.num_slots}", decode, (tparams, dparams, slots, i32()), (2,)),
  ]
  with ops.numerics_mode(c.numerics, c.numerics_backend):
    return [dict(program=name, what=what, **_lower(fn, args, platform, donate, compile_))
            for name, what, fn, args, donate in programs]
