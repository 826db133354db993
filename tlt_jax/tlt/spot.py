"""Spot training of the drafter on the devices of rollout groups that have finished
(`rollout.groups.GroupedRollout` lends them while the other groups keep decoding).

`SpotTrainer` moves the drafter's parameters and optimizer state onto the lent devices and
dispatches one training step per round. At the rollout's barrier training stops between steps;
the state stays with the trainer (and in the run's checkpoints) and the new weights are
published to the engines under a version number for the next rollout.

The drafter trains on one group's devices at a time, replicated over them with the batch split
across them: a fixed data-parallel degree, so its numerics do not depend on which group, or how
many, happened to finish first, and an interrupted run of steps equals an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tlt_jax import ops
from tlt_jax import compile_queue
from tlt_jax.mesh import group_sharding
from tlt_jax.model.drafter import Drafter
from tlt_jax.model.transformer import Transformer
from tlt_jax.tlt.buffer import DrafterBuffer, PackedBatch
from tlt_jax.tlt.drafter_trainer import DrafterLossConfig
from tlt_jax.tlt.packed_loss import eagle_loss_packed


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

  def warm_up(self, device_groups: Sequence[Sequence[jax.Device]],
              queue: compile_queue.CompileQueue | None = None) -> int:
    """Compiles the step for every group it may be lent, before the first rollout: a compile
    inside the tail would hold the barrier for seconds. Returns how many programs were built.
    With `queue` the compiles are only queued there (the caller waits for them)."""
    spec = lambda tree, sharding: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
    built = 0
    with compile_queue.using(queue) as queue:
      for devices in map(tuple, device_groups):
        if devices in self._compiled:
          continue
        replicated = group_sharding(devices)
        batch = group_sharding(devices, batch=self.cfg.rows % len(devices) == 0)

        def lower():  # called at once, in this iteration
          with ops.numerics_mode("xla"):
            return self._step.lower(
                spec(self.params, replicated), spec(self.opt_state, replicated),
                spec(self.target_params, replicated), spec(self.batch_shape, batch))
        done = lambda compiled, _, devices=devices: self._compiled.__setitem__(devices, compiled)
        queue.add("drafter_step", lower, done)
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
