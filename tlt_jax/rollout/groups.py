"""Rollout over device groups: data-parallel rollout groups on disjoint devices, each one
`RolloutEngine`, and the devices of groups that finish early lent to drafter training.

A rollout batch is cut into even shares, one per group, decoded under the batch's own sample
ids (so the tokens are exactly those of one engine decoding the whole batch); a prompt seen
before goes to the group that holds its earlier responses (`route`), where the model-free
drafters read them. The host steps each group's `RolloutEngine.rollout` generator as soon as
that group's chunk in flight is ready (not in turn: a group whose chunk finished would idle
behind a slower one); each step dispatches the group's next decode chunk and returns without
waiting, so the groups' chunks run concurrently on their devices.
When a group has no live sequence left, its devices are idle until the barrier (the slowest
group): they are lent to a `tlt.spot.SpotTrainer`, which dispatches one drafter training step
per round there while the other groups keep decoding. At the barrier training stops between
steps (at most the one step in flight is waited for).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Sequence

import jax
import numpy as np

from tlt_jax import compile_queue
from tlt_jax.mesh import group_sharding
from tlt_jax.model.drafter import Drafter
from tlt_jax.model.transformer import Transformer
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.engine import RolloutEngine, Sample
from tlt_jax.rollout.history import HistoryDrafter
from tlt_jax.rollout.tuner import OFF

if TYPE_CHECKING:  # an annotation only: `generate` steps the trainer it is handed
  from tlt_jax.tlt.spot import SpotTrainer


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
  # per arm the tuner ran: decode chunks, their seconds, tokens emitted, live rows x rounds
  by_arm: dict = dataclasses.field(default_factory=dict)
  trace: list = dataclasses.field(default_factory=list)  # the first group's decode chunks


def arm_totals(chunks) -> dict[str, dict]:
  """Per arm: decode chunks, their seconds, tokens emitted and live rows x rounds (what
  `accept_len` divides by), summable across rollouts."""
  out: dict[str, dict] = {}
  for t in chunks:
    a = out.setdefault(t.arm, dict(chunks=0, seconds=0.0, emitted=0, row_rounds=0))
    a["chunks"] += 1
    a["seconds"] += t.seconds
    a["emitted"] += t.emitted
    a["row_rounds"] += t.live * t.rounds
  return out


def route(prompts: list[list[int]], holds: Sequence[Callable[[list[int]], int]]
          ) -> list[list[int]]:
  """Prompt indices per group: as many per group as an even split gives, each prompt to the
  group holding most of its earlier responses (`holds[g](prompt)`: history trie, lookup bank)
  while that group has room, the others in batch order. A revisited prompt then drafts from its
  earlier responses (where a contiguous split would send it to any group), and nothing about
  its tokens changes: a sample's tokens depend on its id, not its group."""
  room = [len(s) for s in np.array_split(np.arange(len(prompts)), len(holds))]
  shares: list[list[int]] = [[] for _ in holds]
  others = []
  for i, prompt in enumerate(prompts):
    held = [h(prompt) for h in holds]
    home = int(np.argmax(held))
    if held[home] and len(shares[home]) < room[home]:
      shares[home].append(i)
    else:
      others.append(i)
  for i in others:
    g = next(g for g in range(len(shares)) if len(shares[g]) < room[g])
    shares[g].append(i)
  return [sorted(s) for s in shares]


class GroupedRollout:
  """One `RolloutEngine` per device group; `generate` decodes a batch across all of them."""

  def __init__(self, target: Transformer, cfg: EngineConfig,
               device_groups: Sequence[Sequence[jax.Device]], drafter: Drafter | None = None,
               detokenize: Callable | None = None, tensor_parallel: bool = False,
               history_global_tokens: int = 0):
    """tensor_parallel: each group's devices split the model (`programs.ProgramPool`) instead of
    each holding all of it. With history arms each engine keeps its own `HistoryDrafter` (the
    groups it decodes, their earlier responses and, with history_global_tokens, a global trie
    over its recent responses): host state where the group decodes, nothing shared per token."""
    flat = [d for g in device_groups for d in g]
    if len(set(flat)) != len(flat) or not device_groups or any(len(g) == 0 for g in device_groups):
      raise ValueError("device groups must be non-empty and disjoint")
    self.device_groups = [tuple(g) for g in device_groups]
    with_history = any(a.is_history for a in cfg.arms)
    self.engines = [RolloutEngine(target, cfg, drafter, detokenize=detokenize,
                                  placement=group_sharding(g), tensor_parallel=tensor_parallel,
                                  history=(HistoryDrafter(global_tokens=history_global_tokens)
                                           if with_history else None))
                    for g in self.device_groups]
    self.drafter_version = 0
    self.last_report: RolloutReport | None = None

  def warm_up(self, queue: compile_queue.CompileQueue | None = None) -> int:
    """Builds every group's programs, side by side (see `ProgramPool.warm_up`)."""
    with compile_queue.using(queue) as queue:
      return sum(e.pool.warm_up(queue) for e in self.engines)

  def compile_seconds(self) -> dict[str, float]:
    """Seconds each kind of program took to build, summed over the groups' pools."""
    total = collections.Counter()
    for e in self.engines:
      total.update(e.pool.compile_seconds)
    return dict(total)

  def update_policy(self, target: Transformer) -> None:
    for e in self.engines:
      e.update_policy(target)

  def update_drafter(self, drafter: Drafter, version: int) -> None:
    for e in self.engines:
      e.update_drafter(drafter)
    self.drafter_version = version

  def route(self, prompts: list[list[int]]) -> list[list[int]]:
    """The batch's prompt indices per group (`route`, by the responses each engine holds)."""
    return route(prompts, [e.holds_prompt for e in self.engines])

  def generate(self, prompts: list[list[int]], *, group_size: int = 1, seed: int | None = None,
               on_finish: Callable[[Sample], None] | None = None,
               spot: SpotTrainer | None = None, min_live_share: float = 0.0,
               **kw) -> list[Sample]:
    """Decodes the batch across the groups (see the module docstring); the report of the
    rollout is `self.last_report`. With `spot`, drafter steps run on the devices of finished
    groups, or also of groups whose live sequences fell under `min_live_share` of their share
    (single-group machines: the tail's spare compute)."""
    G = len(self.engines)
    shares = self.route(prompts)
    budgets = kw.pop("max_new_per_sample", None)  # per sample of the batch: cut per group
    runs = {}
    for g, idx in enumerate(shares):
      if len(idx):
        share_budgets = (None if budgets is None else
                         [b for i in idx for b in budgets[i * group_size:(i + 1) * group_size]])
        runs[g] = self.engines[g].rollout([prompts[i] for i in idx], group_size=group_size,
                                          seed=seed, on_finish=on_finish, prompt_ids=idx,
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
    ready: dict[int, concurrent.futures.Future] = {}  # when each group's chunk in flight is done

    def advance(g: int) -> None:
      try:
        _, live, ready[g] = next(runs[g])
        live_share[g] = live / share[g]
      except StopIteration as done:
        results.extend(done.value)
        finish_s[g] = time.perf_counter() - start
        del runs[g]

    for g in list(runs):
      advance(g)
    while runs:
      done_now, _ = concurrent.futures.wait([ready[g] for g in runs],
                                            return_when=concurrent.futures.FIRST_COMPLETED)
      for g in [g for g in runs if ready[g] in done_now]:
        advance(g)
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
    report.by_arm = arm_totals(chunks)
    report.trace = [t for t in self.engines[0].trace[trace_from[0]:]]
    self.last_report = report
    return sorted(results, key=lambda s: s.sample_id)
