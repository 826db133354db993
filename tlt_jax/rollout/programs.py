"""The rollout's compiled programs: `ProgramPool` builds each device program of `rollout.steps`
once per (phase, bucket, strategy) ahead of time, on the engine's devices (replicated, or split
by tensor parallelism), and keeps a process-wide least-recently-used set of executables that
every engine with the same model structure, config, placement and numerics shares. So nothing
compiles inside a timed rollout after `warm_up`, and a second engine compiles nothing.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax import ops
from tlt_jax import tensor_parallel as tp
from tlt_jax import compile_queue
from tlt_jax.model.drafter import Drafter
from tlt_jax.model.transformer import KVCache, Transformer
from tlt_jax.rollout import steps
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.steps import Slots

_TP_AXIS = "model"  # a tensor-parallel engine's devices, the axis its layers are split over
_TP_WHERE = "devices per rollout group"  # how errors name that axis's size

# Executables are shared by every pool of the process with the same model structure, config,
# placement and numerics: a second engine (a resumed run, a notebook cell run again, another
# test) takes them instead of tracing and compiling again. Least recently used entries beyond
# the limit are dropped: the limit is small because a loaded CPU executable holds ~100 memory
# mappings (measured: 12 engine programs, +1300) and Linux stops a process at 65530, which
# XLA meets as a segfault while loading the next executable. Like jax.jit's own cache, this
# does not notice a step function (`rollout.steps`) being replaced after a program was built:
# call `clear_shared_programs()` then.
_SHARED_PROGRAMS: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
SHARED_PROGRAMS_LIMIT = 96


def clear_shared_programs() -> None:
  """Forget the executables shared between engines (e.g. after patching `rollout.steps`)."""
  _SHARED_PROGRAMS.clear()


def _signature(tree) -> tuple:
  """What a compiled program assumes of its array arguments: shapes, dtypes, shardings."""
  return tuple((x.shape, str(x.dtype), getattr(x, "sharding", None))
               for x in jax.tree.leaves(tree))


class ProgramPool:
  """Compiled executables per (phase, bucket, strategy), built once by `warm_up`.

  Each SD arm's program is built only for the buckets the tuner may choose it in; a history
  arm's decode program is one verify round that takes its drafts as an input; a lookup arm's
  takes the bank of recent responses it drafts from.

  placement: where every program runs and every array lives, a data-parallel rollout group's
  devices (None = JAX's default device). Without tensor parallelism everything is replicated
  over them. With `tensor_parallel`, the group's devices split the model (`tlt_jax.
  tensor_parallel`: every linear layer over its outputs, whole inputs gathered, the target's
  and the drafter's KV caches over their KV heads), so a model too large for one device decodes
  on several, and with the Pallas kernels every token and log-prob is bitwise the unsplit
  engine's.
  """

  def __init__(self, target: Transformer, drafter: Drafter | None, cfg: EngineConfig,
               allowed_arms: dict[int, list[str]],
               placement: jax.sharding.NamedSharding | None = None,
               tensor_parallel: bool = False):
    self.cfg = cfg
    self.placement = placement
    self.tp_mesh: Mesh | None = None
    if tensor_parallel:
      if placement is None:
        raise ValueError("a tensor-parallel engine needs a placement (its devices)")
      devices = np.array(list(placement.mesh.devices.flat))
      tp.check_model(target.cfg, len(devices), _TP_WHERE)
      self.tp_mesh = Mesh(devices, (_TP_AXIS,))
    self.graphdef, params = nnx.split(target)
    self.params = self.place(params)
    if drafter is not None:
      self.draft_graphdef, draft_params = nnx.split(drafter)
      self.draft_params = self.place(draft_params)
    else:
      self.draft_graphdef, self.draft_params = None, None
    self.allowed_arms = allowed_arms
    self.programs: dict[tuple, Any] = {}
    self._shapes: dict[int, Slots] = {}
    self.compiles = 0  # programs this pool built or took from the process's shared ones
    # Seconds spent building (tracing + compiling, or loading from the persistent cache) per
    # program kind: "prefill", "decode:<arm>", "insert", ... (shared programs cost nothing).
    self.compile_seconds: collections.Counter[str] = collections.Counter()
    self._share_key = (self.graphdef, self.draft_graphdef, cfg, placement, tensor_parallel,
                       _signature(self.params), _signature(self.draft_params))

  # -- where things live ---------------------------------------------------------------------

  def _param_specs(self, state):
    if state is None or self.tp_mesh is None:
      return None if state is None else jax.tree.map(lambda _: P(), state)
    return tp.param_specs(state, _TP_AXIS, self.tp_mesh.size, _TP_WHERE)

  def _slots_specs(self, slots: Slots):
    """KV caches split over their KV heads ([B, S, K, hd]) under tensor parallelism; the rest
    (tokens, flags, outputs: the same on every device) replicated."""
    whole = jax.tree.map(lambda _: P(), slots)
    if self.tp_mesh is None:
      return whole
    heads = lambda c: None if c is None else jax.tree.map(lambda _: P(None, None, _TP_AXIS), c)
    return whole._replace(cache=heads(slots.cache), draft_cache=heads(slots.draft_cache))

  def _shardings(self, specs):
    """NamedShardings for a tree of PartitionSpecs (None: JAX's default placement)."""
    if self.placement is None:
      return None
    mesh = self.tp_mesh if self.tp_mesh is not None else self.placement.mesh
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, P))

  def place(self, state):
    """Parameters (the target's or the drafter's) where the programs read them."""
    if self.placement is None:
      return state
    if self.tp_mesh is None:
      return jax.device_put(state, self.placement)
    return jax.device_put(state, self._shardings(self._param_specs(state)))

  def _jit(self, fn, in_specs, out_specs, *, split_model: bool = False, **kw):
    """fn compiled on the placement, its arguments and results laid out by the specs. A program
    that runs the models (`split_model`) runs, under tensor parallelism, once per device of the
    group (a shard_map manual over the model axis) with the layers traced split."""
    if self.tp_mesh is not None and split_model:
      body = fn

      def fn(*args):
        with tp.over(_TP_AXIS):
          return body(*args)
      # check_vma=False: Pallas' interpret mode mis-types its loop carries in a checked
      # shard_map (as in the trainer); the replicated outputs are computed alike on every device.
      fn = jax.shard_map(fn, mesh=self.tp_mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
    if self.placement is not None:
      kw.update(in_shardings=self._shardings(in_specs), out_shardings=self._shardings(out_specs))
    return jax.jit(fn, **kw)

  def _models(self, params, draft_params):
    target = nnx.merge(self.graphdef, params)
    drafter = nnx.merge(self.draft_graphdef, draft_params) if self.draft_graphdef else None
    if drafter is not None and self.cfg.drafter_numerics == "xla":
      drafter = _TracedUnderXla(drafter)
    return target, drafter

  def _lower(self, key) -> jax.stages.Lowered:
    """The program of `key`, traced and lowered for the pool's placement (not compiled)."""
    phase, bucket, extra = key
    cfg = self.cfg
    models = (self._param_specs(self.params), self._param_specs(self.draft_params))
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    if phase == "prefill":
      def fn(params, draft_params, prompts, lengths, sample_ids, max_new, seed):
        target, drafter = self._models(params, draft_params)
        return steps.prefill(target, drafter, cfg, prompts, lengths, sample_ids, max_new, seed)
      rows = jax.ShapeDtypeStruct((bucket,), jnp.int32)
      args = (jax.ShapeDtypeStruct((bucket, cfg.max_prompt_len), jnp.int32), rows, rows, rows, i32)
      program = self._jit(fn, (*models, *[P()] * len(args)),
                          self._slots_specs(self.slots_shape(bucket)), split_model=True)
      return program.lower(self.params, self.draft_params, *args)
    slots = self.slots_shape(bucket)
    slots_specs = self._slots_specs(slots)
    if phase == "decode":  # extra = arm name
      arm = next(a for a in cfg.arms if a.name == extra)
      if arm.is_history:  # one round, its drafts from the host: [bucket, depth] per chain
        if arm.is_tree:  # a tree's chains [bucket, chains, depth] and which are valid
          def fn(params, draft_params, s, seed, drafts, valid):
            target, drafter = self._models(params, draft_params)
            return steps.history_round(target, drafter, cfg, s, seed, drafts, valid)
          drafts = (jax.ShapeDtypeStruct((bucket, arm.topk, arm.depth), jnp.int32),
                    jax.ShapeDtypeStruct((bucket, arm.topk), jnp.bool_))
        else:
          def fn(params, draft_params, s, seed, drafts):
            target, drafter = self._models(params, draft_params)
            return steps.history_round(target, drafter, cfg, s, seed, drafts)
          drafts = (jax.ShapeDtypeStruct((bucket, arm.depth), jnp.int32),)
        program = self._jit(fn, (*models, slots_specs, P(), *[P()] * len(drafts)),
                            (slots_specs, P(), P(), P()), split_model=True, donate_argnums=(2,))
        return program.lower(self.params, self.draft_params, slots, i32, *drafts)

      if arm.reads_bank:  # a chunk of rounds drafted on device, from the rows and the bank
        def fn(params, draft_params, s, seed, bank, bank_len):
          target, drafter = self._models(params, draft_params)
          return steps.decode_chunk(target, drafter, cfg, arm, s, seed, bank, bank_len)
        bank = self.bank_shape()
        program = self._jit(fn, (*models, slots_specs, P(), P(), P()),
                            (slots_specs, P(), P(), P()), split_model=True, donate_argnums=(2,))
        return program.lower(self.params, self.draft_params, slots, i32, *bank)

      def fn(params, draft_params, s, seed):
        target, drafter = self._models(params, draft_params)
        return steps.decode_chunk(target, drafter, cfg, arm, s, seed)
      program = self._jit(fn, (*models, slots_specs, P()), (slots_specs, P(), P(), P()),
                          split_model=True, donate_argnums=(2,))
      return program.lower(self.params, self.draft_params, slots, i32)
    if phase == "insert":  # bucket = destination, extra = prefill bucket
      new = self.slots_shape(extra)
      program = self._jit(steps.insert, (slots_specs, self._slots_specs(new), P()), slots_specs,
                          donate_argnums=(0,))
      return program.lower(slots, new, jax.ShapeDtypeStruct((extra,), jnp.int32))
    if phase == "compact":  # bucket = source, extra = destination
      program = self._jit(steps.compact, (slots_specs, P(), P()),
                          self._slots_specs(self.slots_shape(extra)))
      return program.lower(slots, jax.ShapeDtypeStruct((extra,), jnp.int32),
                           jax.ShapeDtypeStruct((extra,), bool))
    if phase == "finish":  # mark rows done (a stop string was found on the host)
      program = self._jit(lambda s, m: s._replace(done=s.done | m), (slots_specs, P()),
                          slots_specs, donate_argnums=(0,))
      return program.lower(slots, jax.ShapeDtypeStruct((bucket,), bool))
    if phase == "empty":
      return self._jit(lambda: steps.empty(slots), (), slots_specs).lower()
    if phase == "hidden_row":
      return self._jit(lambda h, r: h[r], (P(), P()), P()).lower(slots.out_hidden, i32)
    raise KeyError(key)

  def bank_shape(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The lookup arms' bank of recent responses: tokens [H, N] and lengths [H]."""
    H, N = self.cfg.lookup_bank, self.cfg.max_new_tokens
    return (jax.ShapeDtypeStruct((H, N), jnp.int32), jax.ShapeDtypeStruct((H,), jnp.int32))

  def slots_shape(self, bucket: int):
    if bucket not in self._shapes:
      self._shapes[bucket] = self._slots_shape(bucket)
    return self._shapes[bucket]

  def _slots_shape(self, bucket: int):
    cfg = self.cfg

    def init(params, draft_params):
      target, drafter = self._models(params, draft_params)
      zeros = jnp.zeros((bucket, cfg.max_prompt_len), jnp.int32)
      ones = jnp.ones((bucket,), jnp.int32)
      return steps.prefill(target, drafter, cfg, zeros, ones, ones, ones, jnp.int32(0))

    return jax.eval_shape(init, self.params, self.draft_params)

  def get(self, phase: str, bucket: int, extra: int | str = 0):
    key = (phase, bucket, extra)
    if key not in self.programs:  # not warmed up: built here, in this thread
      queue = compile_queue.CompileQueue(workers=1)
      self._enqueue(key, queue)
      queue.wait()
    return self.programs[key]

  def program_keys(self) -> list[tuple]:
    """Every (phase, bucket, extra) a rollout can call."""
    keys = []
    buckets = self.cfg.buckets
    for b in buckets:
      keys += [("prefill", b, 0), ("empty", b, 0)]
      if self.cfg.stop_strings:
        keys.append(("finish", b, 0))
      keys.append(("hidden_row", b, 0))
      keys += [("decode", b, arm) for arm in self.allowed_arms[b]]
      for k in buckets:
        if k <= b:
          keys.append(("insert", b, k))
          if k < b:
            keys.append(("compact", b, k))
    return keys

  def warm_up(self, queue: compile_queue.CompileQueue | None = None) -> int:
    """Builds every program a rollout can call; returns how many were missing. With `queue`
    the compiles are only queued there (the caller's `queue.wait()` finishes them), so several
    pools and the trainer compile side by side; without, this waits for its own queue."""
    missing = [key for key in self.program_keys() if key not in self.programs]
    with compile_queue.using(queue) as queue:
      for key in missing:
        self._enqueue(key, queue)
    return len(missing)

  def _enqueue(self, key: tuple, queue: compile_queue.CompileQueue) -> None:
    # The numerics mode is read while tracing: part of what a program is.
    shared = (self._share_key, ops.numerics(), ops.backend(), key)
    program = _SHARED_PROGRAMS.pop(shared, None)
    if program is not None:
      self._install(key, shared, program, 0.0)
      return
    phase, _, extra = key
    kind = f"{phase}:{extra}" if phase == "decode" else phase
    queue.add(kind, lambda: self._lower(key),
              lambda compiled, seconds: self._install(key, shared, compiled, seconds, kind))

  def _install(self, key: tuple, shared: tuple, program, seconds: float, kind: str = "") -> None:
    if kind:
      self.compile_seconds[kind] += seconds
    _SHARED_PROGRAMS[shared] = program
    while len(_SHARED_PROGRAMS) > SHARED_PROGRAMS_LIMIT:
      _SHARED_PROGRAMS.popitem(last=False)
    self.programs[key] = program
    self.compiles += 1


class _TracedUnderXla:
  """The drafter with every call traced under XLA numerics (see EngineConfig.drafter_numerics)."""

  def __init__(self, drafter: Drafter):
    self.drafter = drafter

  def __call__(self, *args, **kw):
    with ops.numerics_mode("xla"):
      return self.drafter(*args, **kw)

  def init_cache(self, batch: int, num_slots: int) -> KVCache:
    return self.drafter.init_cache(batch, num_slots)
