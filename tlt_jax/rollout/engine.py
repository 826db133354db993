"""Rollout engine: slots padded to batch buckets, on-device decode chunks, continuous batching,
compaction into smaller buckets, and chain / tree speculative decoding with an EAGLE-style
drafter, with chains drafted on the host from the group's own text (`rollout.history`), or
with chains looked up on device in the bucket's rows and a bank of recent responses.

One rollout, as the host sees it:
  pending samples -> prefill into free slots -> decode chunk (N steps on device, plain or SD)
  -> read the done flags -> collect finished samples, refill free slots from pending
  -> when nothing is pending and the live rows fit a smaller bucket, compact into it -> repeat.

This module is that host loop: which sample sits in which row, when to refill and compact, which
strategy the tuner picks per chunk. A history arm's chunk is one verify round: the host reads
each live row's tokens, asks the history drafter for its chain, and passes the drafts in. One
round per round trip, because the next round's drafts continue the tokens this round accepts,
which only the device knows (the learned drafter avoids the trip by drafting on device); drafts
fixed for several rounds would only be right while every draft is accepted, i.e. they would be
one longer chain. A lookup arm's chunk avoids the trip the learned drafter's way: its drafts
are looked up on device, round by round (`steps._lookup_drafts`, or several distinct chains
verified as one tree for `lookup_treeD_W`, or beside the learned drafter's chain in one tree
for `combined_treeD_W`); the host only picks the bank of `lookup_bank` finished responses
they also read, earlier responses to the prompts the chunk decodes first (`rollout.bank`).
The device programs it calls are `rollout.steps` (where the exactness argument lives: slot,
bucket, chunk size, refill order and compaction change no token), built ahead of time per
(phase, bucket, strategy) by `rollout.programs.ProgramPool` and called as compiled
executables, so nothing compiles inside a timed rollout after `warm_up`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Callable

import jax
import numpy as np
from flax import nnx

from tlt_jax.model.drafter import Drafter, check_fits
from tlt_jax.model.transformer import Transformer
from tlt_jax.rollout.bank import ResponseBank
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.history import HistoryDrafter
from tlt_jax.rollout.programs import ProgramPool
from tlt_jax.rollout.tuner import OFF, Arm, Tuner


@dataclasses.dataclass
class Sample:
  sample_id: int
  prompt: list[int]
  tokens: np.ndarray
  logprobs: np.ndarray
  finish_reason: str          # "eos" | "stop" | "length"
  hidden: jax.Array           # [max_new_tokens, D] on device; rows [:len(tokens)] are valid


@dataclasses.dataclass
class ChunkTrace:
  start_s: float
  seconds: float
  bucket: int
  live: int
  arm: str
  emitted: int
  rounds: int
  host_s: float = 0.0  # of `seconds`, the host's history drafting (token reads included)
  row_rounds: int = 0  # rounds summed over the rows active in each (a row emits >= 1 per round)

  @property
  def accept_len(self) -> float:
    """Tokens emitted per live row per decode round (1.0 for plain decode)."""
    return self.emitted / max(self.live * self.rounds, 1)


def _ready_time(x: jax.Array) -> float:
  x.block_until_ready()
  return time.perf_counter()


class RolloutEngine:

  def __init__(self, target: Transformer, cfg: EngineConfig, drafter: Drafter | None = None,
               tuner: Tuner | None = None, detokenize=None,
               placement: jax.sharding.NamedSharding | None = None,
               tensor_parallel: bool = False, history: HistoryDrafter | None = None):
    """placement / tensor_parallel: the devices the engine runs on, and whether they split the
    model or each hold all of it (see `ProgramPool`). history: the history arms' drafter (a
    default one when the arms have history chains and none is given); it keeps the responses of
    every rollout, so earlier responses to a prompt draft for its later rollouts."""
    if cfg.stop_strings and detokenize is None:
      raise ValueError("stop_strings need a detokenize(token_ids) -> str function")
    self.detokenize = detokenize
    if drafter is not None:
      check_fits(drafter, target.cfg)
    if drafter is None and any(a.needs_drafter for a in cfg.arms):
      cfg = dataclasses.replace(cfg, arms=tuple(a for a in cfg.arms if not a.needs_drafter))
    self.cfg = cfg
    if history is None and any(a.is_history for a in cfg.arms):
      history = HistoryDrafter()
    self.history = history
    self.target, self.drafter = target, drafter
    self.tuner = tuner or Tuner(cfg.arms, cfg.buckets,
                                max_verify_tokens_per_bucket=cfg.max_verify_tokens_per_bucket,
                                seed=cfg.seed)
    self.pool = ProgramPool(target, drafter, cfg, self.tuner.allowed, placement, tensor_parallel)
    self.trace: list[ChunkTrace] = []
    self.target_tokens_processed = 0  # prefill + decode + verify tokens through the target
    self.prefill_rows = 0  # prompts prefilled (a mid-rollout SD switch must not add any)
    # The lookup arms' bank: earlier responses to the prompts a chunk decodes, then the newest
    # of any prompt (`rollout.bank`); it keeps earlier responses only where an arm reads it.
    reads_bank = any(a.reads_bank for a in cfg.arms)
    self.bank = ResponseBank(cfg.lookup_bank, cfg.max_new_tokens,
                             cfg.lookup_history_tokens if reads_bank else 0)
    # A chunk's time is its own: dispatch to results ready, stamped by a thread that waits on
    # them. The host loop may be busy elsewhere when they become ready (interleaving other
    # rollout groups: `rollout.groups`), and charging that wait to the chunk made every arm look
    # as slow as the slowest chunk any group ran meanwhile: with two groups, a plain chunk timed
    # across the other group's 9-token verify rounds lost to it, and the tuner chose SD for
    # 100% of chunks while the rollout ran 0.71x.
    self._ready_clock = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="tlt-chunk-clock")

  def update_policy(self, target: Transformer) -> None:
    """Serve new target weights (e.g. after an RL update; same shapes: no recompile)."""
    params = nnx.split(target)[1]
    if jax.tree.structure(params) != jax.tree.structure(self.pool.params):
      raise ValueError("update_policy needs a model with the engine's parameter structure")
    self.pool.params = self.pool.place(params)
    self.target = target

  def update_drafter(self, drafter: Drafter) -> None:
    """Serve new drafter weights (same shapes: no recompile)."""
    check_fits(drafter, self.target.cfg)
    self.pool.draft_params = self.pool.place(nnx.split(drafter)[1])
    self.drafter = drafter

  def _bucket_for(self, n: int) -> int:
    return next((b for b in self.cfg.buckets if b >= n), self.cfg.buckets[-1])

  def _check_prompts(self, prompts: list[list[int]]) -> None:
    if not prompts:
      raise ValueError("rollout needs at least one prompt")
    V = self.target.cfg.vocab_size
    for i, p in enumerate(prompts):
      if len(p) == 0:
        raise ValueError(f"prompt {i} is empty")
      if len(p) > self.cfg.max_prompt_len:
        raise ValueError(f"prompt {i} has {len(p)} tokens; the engine's max_prompt_len is "
                         f"{self.cfg.max_prompt_len} (cache of {self.cfg.num_slots} slots)")
      if min(p) < 0 or max(p) >= V:
        raise ValueError(f"prompt {i} has token ids outside [0, {V})")

  def generate(self, prompts: list[list[int]], **kw) -> list[Sample]:
    """Samples `group_size` completions per prompt; returns them in sample-id order (keyword
    arguments: see `rollout`)."""
    run = self.rollout(prompts, **kw)
    while True:
      try:
        next(run)
      except StopIteration as finished:
        return finished.value

  def rollout(self, prompts: list[list[int]], *, group_size: int = 1, arm: str | None = None,
              max_new_tokens: int | None = None, sd_after_rounds: int = 0,
              order: list[int] | None = None,
              max_new_per_sample: list[int] | None = None,
              seed: int | None = None,
              on_finish: Callable[[Sample], None] | None = None,
              first_sample_id: int = 0, prompt_ids: list[int] | None = None):
    """`generate` as a generator: it yields (bucket, live rows, a Future of the time the chunk's
    results are ready) right after dispatching each decode chunk (before waiting for it), so a
    host loop can interleave the rollouts of several engines on disjoint devices, or other
    device work, resuming each when its chunk is ready; the samples are its return value.

    arm: force a strategy ("off", "chain4", ...) instead of the tuner's choice;
    sd_after_rounds: plain decode for that many chunks before the tuner may pick SD (tests the
    mid-rollout switch); order: the order in which samples are admitted (default: by id);
    on_finish: called with each sample as soon as it finishes (e.g. to score it while the long
    tail is still decoding); first_sample_id: sample ids start there (a data-parallel group
    decodes its share of a batch under the batch's ids, so its tokens are the same);
    prompt_ids: instead, each prompt's index in the batch (its samples are ids
    prompt_id * group_size + 0 .. group_size - 1), for a share that is not contiguous.
    """
    self._check_prompts(prompts)
    cfg = self.cfg
    max_new = min(max_new_tokens or cfg.max_new_tokens, cfg.max_new_tokens)
    num_samples = len(prompts) * group_size
    budgets = (list(max_new_per_sample) if max_new_per_sample is not None
               else [max_new] * num_samples)
    if len(budgets) != num_samples or min(budgets) < 1 or max(budgets) > cfg.max_new_tokens:
      raise ValueError(f"max_new_per_sample needs {num_samples} budgets in "
                       f"[1, {cfg.max_new_tokens}]")
    if prompt_ids is not None and len(prompt_ids) != len(prompts):
      raise ValueError(f"prompt_ids has {len(prompt_ids)} ids for {len(prompts)} prompts")
    sample_ids = (range(first_sample_id, first_sample_id + num_samples) if prompt_ids is None
                  else [p * group_size + j for p in prompt_ids for j in range(group_size)])
    requests = [(sid, prompts[i // group_size], budgets[i])
                for i, sid in enumerate(sample_ids)]
    if order is not None:
      requests = [requests[i] for i in order]
    pending = collections.deque(requests)
    bucket = self._bucket_for(len(pending))
    slots = None
    row_sample: list[int | None] = [None] * bucket
    row_prompt: dict[int, list[int]] = {}
    results: dict[int, Sample] = {}
    stopped: dict[int, int] = {}  # sample id -> tokens kept (up to and including a stop string)
    chunks = 0
    seed = np.int32(cfg.seed if seed is None else seed)  # host scalar: no conversion compile
    t_start = time.perf_counter()
    while pending or any(r is not None for r in row_sample):
      slots, prefilled = self._refill(slots, bucket, row_sample, row_prompt, pending, seed)
      chosen = self._choose_arm(bucket, arm, chunks, sd_after_rounds)
      t0 = time.perf_counter()
      live = sum(r is not None for r in row_sample)
      program = self.pool.get("decode", bucket, chosen.name)
      host_s = 0.0
      if chosen.is_history:
        drafts = self._history_drafts(slots, row_sample, chosen)
        host_s = time.perf_counter() - t0
        slots, emitted, rounds, row_rounds = program(self.pool.params, self.pool.draft_params,
                                                     slots, seed, *drafts)
      elif chosen.reads_bank:
        bank = self._bank_arrays(row_sample, row_prompt)
        slots, emitted, rounds, row_rounds = program(self.pool.params, self.pool.draft_params,
                                                     slots, seed, *bank)
      else:
        slots, emitted, rounds, row_rounds = program(self.pool.params, self.pool.draft_params,
                                                     slots, seed)
      ready_at = self._ready_clock.submit(_ready_time, slots.done)
      yield bucket, live, ready_at  # dispatched, not waited for
      done = np.asarray(slots.done)
      dt = ready_at.result() - t0
      emitted, rounds, row_rounds = int(emitted), int(rounds), int(row_rounds)
      self.target_tokens_processed += bucket * rounds * chosen.verify_tokens
      # Mean rows active per round: a row that finished in round 2 of 8 is not charged 8. A
      # refill's prefill ran on the device just before this chunk and is in its time (the
      # chunk donates `slots`, and waiting for the prefill on the host would hold up the other
      # groups' chunks), so that sample only stands in for the arm until a clean one comes.
      self.tuner.update(bucket, chosen, emitted, dt, row_rounds / max(rounds, 1),
                        provisional=prefilled is not None)
      self.trace.append(ChunkTrace(t0 - t_start, dt, bucket, live, chosen.name, emitted, rounds,
                                   host_s, row_rounds))
      chunks += 1
      if cfg.stop_strings:
        slots, done = self._apply_stop_strings(slots, done, row_sample, stopped, bucket)
      self._collect(slots, done, row_sample, row_prompt, results, bucket, stopped, on_finish)
      if cfg.compaction and not pending:
        slots, bucket, row_sample = self._maybe_compact(slots, bucket, row_sample)
    return [results[sid] for sid in sorted(results)]

  def _choose_arm(self, bucket, arm, chunks, sd_after_rounds) -> Arm:
    if arm is not None:
      if arm not in self.tuner.allowed[bucket]:
        return self.tuner.arms[OFF]
      return self.tuner.arms[arm]
    if chunks < sd_after_rounds:
      return self.tuner.arms[OFF]
    return self.tuner.choose(bucket)

  def _history_drafts(self, slots, row_sample, arm: Arm) -> tuple[np.ndarray, ...]:
    """The history round's inputs: each live row's tokens so far recorded in its group, then
    its chain, (drafts [bucket, depth],) padded with any token (verification rejects what the
    target would not emit), or for a tree its chains (drafts [bucket, chains, depth], -1 past
    a chain's end; valid [bucket, chains]). Free rows draft nothing."""
    tokens, gen = np.asarray(slots.out_tokens), np.asarray(slots.gen)
    live = [(r, sid) for r, sid in enumerate(row_sample) if sid is not None]
    for r, sid in live:  # every sibling's newest tokens first, then the drafts that read them
      self.history.extend(sid, tokens[r, :int(gen[r])])
    if not arm.is_tree:
      drafts = np.zeros((len(row_sample), arm.depth), np.int32)
      for r, sid in live:
        chain = self.history.propose(sid, arm.depth)
        drafts[r, :len(chain)] = chain
      return (drafts,)
    drafts = np.full((len(row_sample), arm.topk, arm.depth), -1, np.int32)
    valid = np.zeros((len(row_sample), arm.topk), bool)
    for r, sid in live:
      for w, chain in enumerate(self.history.propose_chains(sid, arm.depth, arm.topk)):
        drafts[r, w, :len(chain)] = chain
        valid[r, w] = True
    return drafts, valid

  def _bank_arrays(self, row_sample, row_prompt):
    live_prompts = (tuple(row_prompt[sid]) for sid in row_sample if sid is not None)
    return self.bank.arrays(live_prompts, self.pool.placement)

  def holds_prompt(self, prompt) -> int:
    """How many earlier responses to `prompt` this engine's model-free drafters hold."""
    return self.bank.holds(prompt) + (self.history.holds(prompt) if self.history else 0)

  def clear_bank(self) -> None:
    """Forget the responses the lookup arms draft from (e.g. before timing a batch whose own
    tokens an earlier run put there: drafts that cannot miss)."""
    self.bank.clear()

  def _refill(self, slots, bucket, row_sample, row_prompt, pending, seed):
    """Prefills pending samples into free rows; returns the slots and the prefill's outputs
    (None when nothing was prefilled)."""
    free = [r for r, s in enumerate(row_sample) if s is None]
    if slots is not None and (not free or not pending):
      return slots, None
    take = min(len(free), len(pending))
    k = self._bucket_for(take)
    prompts = np.zeros((k, self.cfg.max_prompt_len), np.int32)
    lengths = np.ones(k, np.int32)
    sample_ids = np.zeros(k, np.int32)
    max_new = np.ones(k, np.int32)
    rows = np.full(k, bucket, np.int32)  # padding rows land out of range: dropped
    for i in range(take):
      sid, prompt, budget = pending.popleft()
      prompts[i, :len(prompt)] = prompt
      lengths[i], sample_ids[i], rows[i], max_new[i] = len(prompt), sid, free[i], budget
      row_sample[free[i]] = sid
      row_prompt[sid] = list(prompt)
      if self.history is not None:
        self.history.begin(sid, prompt)
    new = self.pool.get("prefill", k)(self.pool.params, self.pool.draft_params, prompts, lengths,
                                      sample_ids, max_new, seed)
    self.target_tokens_processed += k * self.cfg.max_prompt_len
    self.prefill_rows += take
    if slots is None:
      slots = self.pool.get("empty", bucket)()
    return self.pool.get("insert", bucket, k)(slots, new, rows), new

  def _apply_stop_strings(self, slots, done, row_sample, stopped, bucket):
    tokens, gen = np.asarray(slots.out_tokens), np.asarray(slots.gen)
    newly = np.zeros(bucket, bool)
    for r, sid in enumerate(row_sample):
      if sid is None or sid in stopped:
        continue
      toks = tokens[r, :int(gen[r])].tolist()
      if not any(stop in self.detokenize(toks) for stop in self.cfg.stop_strings):
        continue
      keep = next(m for m in range(1, len(toks) + 1)
                  if any(stop in self.detokenize(toks[:m]) for stop in self.cfg.stop_strings))
      stopped[sid] = keep
      newly[r] = True
    if newly.any():
      slots = self.pool.get("finish", bucket)(slots, newly)
      done = done | newly
    return slots, done

  def _collect(self, slots, done, row_sample, row_prompt, results, bucket, stopped, on_finish):
    finished = [r for r, sid in enumerate(row_sample) if sid is not None and done[r]]
    if not finished:
      return
    tokens = np.asarray(slots.out_tokens)
    logprobs = np.asarray(slots.out_logprobs)
    gen = np.asarray(slots.gen)
    eos = set(self.cfg.eos_ids)
    for r in finished:
      sid = row_sample[r]
      n = stopped.get(sid, int(gen[r]))
      toks = tokens[r, :n].copy()
      reason = ("stop" if sid in stopped else "eos" if int(toks[-1]) in eos else "length")
      results[sid] = Sample(
          sample_id=sid, prompt=row_prompt.pop(sid), tokens=toks, logprobs=logprobs[r, :n].copy(),
          finish_reason=reason,
          hidden=self.pool.get("hidden_row", bucket)(slots.out_hidden, np.int32(r)))
      row_sample[r] = None
      if self.history is not None:
        self.history.finish(sid, toks)
      self.bank.add(results[sid].prompt, toks)
      if on_finish is not None:
        on_finish(results[sid])

  def _maybe_compact(self, slots, bucket, row_sample):
    live_rows = [r for r, s in enumerate(row_sample) if s is not None]
    if not live_rows:
      return slots, bucket, row_sample
    smaller = self._bucket_for(len(live_rows))
    if smaller >= bucket:
      return slots, bucket, row_sample
    # Padding rows copy a live row and are marked free: they never emit or get collected.
    rows = live_rows + [live_rows[0]] * (smaller - len(live_rows))
    live = np.arange(smaller) < len(live_rows)
    slots = self.pool.get("compact", bucket, smaller)(slots, np.asarray(rows, np.int32), live)
    new_rows = [row_sample[r] for r in live_rows] + [None] * (smaller - len(live_rows))
    return slots, smaller, new_rows
