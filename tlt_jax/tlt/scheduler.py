"""Long-tail scheduler: data-parallel rollout groups on disjoint devices, and spot training of the
drafter on the devices of groups that have finished.

A rollout batch is cut into contiguous shares, one per group, decoded under the batch's own
sample ids (so the tokens are exactly those of one engine decoding the whole batch). The host
steps every group's `RolloutEngine.rollout` generator in turn; each call dispatches one decode
chunk and returns without waiting, so the groups' chunks run concurrently on their devices.
When a group has no live sequence left, its devices are idle until the barrier (the slowest
group): they are lent to `SpotTrainer`, which moves the drafter's parameters and optimizer state
there and dispatches one training step per round while the other groups keep decoding. At the
barrier training stops between steps (at most the one step in flight is waited for); the state
stays with the trainer (and in the run's checkpoints) and the new weights are published to the
engines under a version number for the next rollout.

The drafter trains on one group's devices at a time, replicated over them with the batch split
across them: a fixed data-parallel degree, so its numerics do not depend on which group, or how
many, happened to finish first, and an interrupted run of steps equals an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tlt_jax import ops
from tlt_jax.model.drafter import Drafter
from tlt_jax.model.transformer import Transformer
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine, Sample
from tlt_jax.rollout.tuner import OFF
from tlt_jax.tlt.buffer import DrafterBuffer, PackedBatch
from tlt_jax.tlt.drafter_trainer import DrafterLossConfig
from tlt_jax.tlt.packed_loss import eagle_loss_packed


def group_sharding(devices: Sequence[jax.Device], batch: bool = False) -> NamedSharding:
  """Everything replicated over a group's devices (or the leading axis split over them)."""
  mesh = Mesh(np.array(list(devices)), ("data",))
  return NamedSharding(mesh, P("data") if batch else P())


# ---------------------------------------------------------------------------------------------
# Spot training


@dataclasses.dataclass(frozen=True)
class SpotConfig:
  lr: float = 3e-3
  weight_decay: float = 0.0
  rows: int = 8           # packed rows per drafter step
  row_len: int = 256
  max_steps_per_rollout: int = 0  # 0 = as many as the idle time allows
  loss: DrafterLossConfig = DrafterLossConfig()
  seed: int = 0


class SpotTrainer:
  """The drafter's parameters and AdamW state, stepped on whatever devices are lent to it."""

  def __init__(self, drafter: Drafter, target: Transformer, buffer: DrafterBuffer,
               cfg: SpotConfig = SpotConfig()):
    self.cfg, self.buffer = cfg, buffer
    self.graphdef, params = nnx.split(drafter)
    # Steps donate (update in place) the trainer's own copies, never the caller's arrays.
    self.params = jax.tree.map(jnp.copy, params)
    self.target_graphdef, self.target_params = nnx.split(target)
    self.batch_shape = self._batch_shape(target)
    self.tx = optax.adamw(cfg.lr, weight_decay=cfg.weight_decay)
    self.opt_state = self.tx.init(self.params)
    self.version = 0          # bumped by every publish
    self.steps_done = 0       # drafter steps ever taken (the data schedule is keyed by it)
    self.devices: tuple[jax.Device, ...] | None = None
    self.step_devices: list[frozenset] = []  # per step: the devices that ran it (tests)
    self.last_metrics: dict | None = None
    self._batches: list[PackedBatch] = []
    self._step = jax.jit(self._step_fn, donate_argnums=(0, 1))
    self._compiled: dict[tuple[jax.Device, ...], Any] = {}  # the step, built per device group

  def _step_fn(self, params, opt_state, target_params, batch: PackedBatch):
    target = nnx.merge(self.target_graphdef, target_params)

    def loss(p):
      return eagle_loss_packed(nnx.merge(self.graphdef, p), target, batch, self.cfg.loss)
    (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics

  def refresh_data(self, target: Transformer | None = None) -> int:
    """Packs the buffer's window (once per rollout) and takes the current policy as the target
    whose features the drafter learns; returns the number of packed batches."""
    if target is not None:
      self.target_graphdef, self.target_params = nnx.split(target)
      self.devices = None  # the next lend moves the new target's weights too
    self._batches = self.buffer.batches(self.cfg.rows, self.cfg.row_len,
                                        seed=self.cfg.seed) if len(self.buffer) else []
    return len(self._batches)

  @property
  def has_data(self) -> bool:
    return bool(self._batches)

  def _batch_shape(self, target: Transformer) -> PackedBatch:
    """A packed batch's shapes and dtypes (known from the config before any data is; the
    rollout's hidden states, the batch's features, come in the target's dtype)."""
    B, T = self.cfg.rows, self.cfg.row_len
    i32 = jax.ShapeDtypeStruct((B, T), jnp.int32)
    feature = jax.ShapeDtypeStruct((B, T, target.cfg.hidden_size), target.cfg.jnp_dtype)
    return PackedBatch(i32, feature, feature, jax.ShapeDtypeStruct((B, T), jnp.bool_), i32, i32)

  def warm_up(self, device_groups: Sequence[Sequence[jax.Device]]) -> int:
    """Compiles the step for every group it may be lent, before the first rollout: a compile
    inside the tail would hold the barrier for seconds. Returns how many programs were built."""
    spec = lambda tree, sharding: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
    built = 0
    for devices in map(tuple, device_groups):
      if devices in self._compiled:
        continue
      replicated = group_sharding(devices)
      batch = group_sharding(devices, batch=self.cfg.rows % len(devices) == 0)
      with ops.numerics_mode("xla"):
        self._compiled[devices] = self._step.lower(
            spec(self.params, replicated), spec(self.opt_state, replicated),
            spec(self.target_params, replicated), spec(self.batch_shape, batch)).compile()
      built += 1
    return built

  def lend(self, devices: Sequence[jax.Device]) -> None:
    """Moves parameters, optimizer state and the target's weights onto `devices`."""
    devices = tuple(devices)
    if devices == self.devices:
      return
    sharding = group_sharding(devices)
    self.params, self.opt_state, self.target_params = jax.device_put(
        (self.params, self.opt_state, self.target_params), sharding)
    self.devices = devices

  def step(self) -> None:
    """Dispatches one step on the lent devices (returns before it has run)."""
    if self.devices is None:
      raise RuntimeError("SpotTrainer.step before lend(devices)")
    if not self._batches:
      raise RuntimeError("SpotTrainer has no data: add rollouts to its buffer, then refresh_data")
    host = self._batches[self.steps_done % len(self._batches)]
    split = self.cfg.rows % len(self.devices) == 0
    batch = jax.device_put(host, group_sharding(self.devices, batch=split))
    # The drafter's training numerics never reach the policy's tokens (gumbel verification
    # emits the target's own samples), so it trains on XLA's fast kernels whatever the run's
    # numerics, as the engines draft with it by default (`tlt.drafter_numerics`).
    shapes_match = all(a.shape == b.shape and a.dtype == b.dtype
                       for a, b in zip(host, self.batch_shape))
    step = self._compiled.get(self.devices, self._step) if shapes_match else self._step
    with ops.numerics_mode("xla"):
      self.params, self.opt_state, self.last_metrics = step(
          self.params, self.opt_state, self.target_params, batch)
    self.step_devices.append(frozenset(jax.tree.leaves(self.params)[0].sharding.device_set))
    self.steps_done += 1

  def in_flight(self) -> bool:
    """Whether the last dispatched step is still running. The loop dispatches a new step only
    when it is not, so steps never queue up behind each other: at the barrier at most one step
    is left to wait for."""
    return any(not leaf.is_ready() for leaf in jax.tree.leaves(self.params))

  def wait(self) -> dict[str, float]:
    """Blocks until the step in flight is done (all of its outputs: parameters and optimizer
    state too, not just the metrics, which may be ready first); its metrics."""
    if self.last_metrics is None:
      return {}
    jax.block_until_ready((self.params, self.opt_state, self.last_metrics))
    return {k: float(v) for k, v in jax.device_get(self.last_metrics).items()}

  def publish(self, *, new_version: bool = True) -> tuple[Drafter, int]:
    """The current weights as a Drafter (a copy: later steps update the trainer's own arrays in
    place) and their version number, a new one unless re-serving after a resume."""
    self.version += int(new_version)
    return nnx.merge(self.graphdef, jax.tree.map(jnp.copy, self.params)), self.version

  def state(self) -> dict:
    return {"params": self.params, "opt_state": self.opt_state}

  def load_state(self, state: dict, *, steps_done: int, version: int) -> None:
    self.params, self.opt_state = state["params"], state["opt_state"]
    self.steps_done, self.version, self.devices = steps_done, version, None


# ---------------------------------------------------------------------------------------------
# Grouped rollout


@dataclasses.dataclass
class RolloutReport:
  seconds: float
  group_finish_s: list[float]     # when each group ran out of sequences
  idle_device_s: float            # device-seconds between a group's finish and the barrier
  drafter_steps: int              # drafter steps dispatched during this rollout
  drafter_busy_devices: list[frozenset] = dataclasses.field(default_factory=list)
  live_devices_at_step: list[frozenset] = dataclasses.field(default_factory=list)
  drafter_metrics: dict = dataclasses.field(default_factory=dict)
  accept_len: float = 1.0
  sd_chunk_fraction: float = 0.0  # decode chunks the tuner ran speculatively
  trace: list = dataclasses.field(default_factory=list)  # the first group's decode chunks


class GroupedRollout:
  """One `RolloutEngine` per device group; `generate` decodes a batch across all of them."""

  def __init__(self, target: Transformer, cfg: EngineConfig,
               device_groups: Sequence[Sequence[jax.Device]], drafter: Drafter | None = None,
               detokenize: Callable | None = None, tensor_parallel: bool = False):
    """tensor_parallel: each group's devices split the model (`engine.ProgramPool`) instead of
    each holding all of it."""
    flat = [d for g in device_groups for d in g]
    if len(set(flat)) != len(flat) or not device_groups or any(len(g) == 0 for g in device_groups):
      raise ValueError("device groups must be non-empty and disjoint")
    self.device_groups = [tuple(g) for g in device_groups]
    self.engines = [RolloutEngine(target, cfg, drafter, detokenize=detokenize,
                                  placement=group_sharding(g), tensor_parallel=tensor_parallel)
                    for g in self.device_groups]
    self.drafter_version = 0
    self.last_report: RolloutReport | None = None

  def warm_up(self) -> int:
    return sum(e.pool.warm_up() for e in self.engines)

  def update_policy(self, target: Transformer) -> None:
    for e in self.engines:
      e.update_policy(target)

  def update_drafter(self, drafter: Drafter, version: int) -> None:
    for e in self.engines:
      e.update_drafter(drafter)
    self.drafter_version = version

  def generate(self, prompts: list[list[int]], *, group_size: int = 1, seed: int | None = None,
               on_finish: Callable[[Sample], None] | None = None,
               spot: SpotTrainer | None = None, min_live_share: float = 0.0,
               **kw) -> list[Sample]:
    """Decodes the batch across the groups (see the module docstring); the report of the
    rollout is `self.last_report`. With `spot`, drafter steps run on the devices of finished
    groups, or also of groups whose live sequences fell under `min_live_share` of their share
    (single-group machines: the tail's spare compute)."""
    G = len(self.engines)
    shares = np.array_split(np.arange(len(prompts)), G)
    budgets = kw.pop("max_new_per_sample", None)  # per sample of the batch: cut per group
    runs = {}
    for g, idx in enumerate(shares):
      if len(idx):
        first = int(idx[0]) * group_size
        share_budgets = (None if budgets is None else
                         list(budgets[first:first + len(idx) * group_size]))
        runs[g] = self.engines[g].rollout([prompts[i] for i in idx], group_size=group_size,
                                          seed=seed, on_finish=on_finish, first_sample_id=first,
                                          max_new_per_sample=share_budgets, **kw)
    trace_from = [len(e.trace) for e in self.engines]
    results: list[Sample] = []
    finish_s = [0.0] * G
    report = RolloutReport(0.0, finish_s, 0.0, 0)
    lent = None
    start = time.perf_counter()
    max_steps = spot.cfg.max_steps_per_rollout if spot is not None else 0
    share = {g: len(idx) * group_size for g, idx in enumerate(shares)}
    live_share = {g: 1.0 for g in runs}
    while runs:
      for g in list(runs):
        try:
          _, live = next(runs[g])
          live_share[g] = live / share[g]
        except StopIteration as done:
          results += done.value
          finish_s[g] = time.perf_counter() - start
          del runs[g]
      if spot is not None and spot.has_data and runs and (not max_steps or
                                                           report.drafter_steps < max_steps):
        idle = [g for g in range(G) if g not in runs or live_share[g] < min_live_share]
        if idle and not spot.in_flight():
          if lent is None:  # the first group to finish hosts the drafter until the barrier
            lent = idle[0]
            spot.lend(self.device_groups[lent])
          spot.step()
          report.drafter_steps += 1
          report.drafter_busy_devices.append(spot.step_devices[-1])
          report.live_devices_at_step.append(
              frozenset(d for g in runs for d in self.device_groups[g]))
    report.seconds = time.perf_counter() - start
    if spot is not None and report.drafter_steps:
      report.drafter_metrics = spot.wait()  # the barrier: at most the step in flight
    report.idle_device_s = sum((report.seconds - finish_s[g]) * len(self.device_groups[g])
                               for g in range(G))
    chunks = [t for e, i in zip(self.engines, trace_from) for t in e.trace[i:]]
    report.accept_len = (sum(t.emitted for t in chunks) /
                         max(sum(t.live * t.rounds for t in chunks), 1))
    report.sd_chunk_fraction = sum(t.arm != OFF for t in chunks) / max(len(chunks), 1)
    report.trace = [t for t in self.engines[0].trace[trace_from[0]:]]
    self.last_report = report
    return sorted(results, key=lambda s: s.sample_id)
