"""Grain pipelines over prompt rows: per-process shard, seeded shuffle per epoch, batches of
prompts per RL step, and an iterator whose state goes into checkpoints."""

from __future__ import annotations

from typing import Callable

import grain


def prompt_dataset(rows: list[dict], *, batch_size: int, seed: int, process_index: int = 0,
                   process_count: int = 1, shuffle: bool = True, num_epochs: int | None = None,
                   transform: Callable[[dict], dict] | None = None) -> grain.IterDataset:
  """Batches (lists of rows) of `batch_size` prompts, endless unless num_epochs is given.

  Process p reads rows p, p + P, p + 2P, ... (disjoint shards); the shuffle is a function of
  (seed, epoch) only, so two runs with one seed see one order, and resume continues it.
  """
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} not in [0, {process_count})")
  shard = rows[process_index::process_count]
  if len(shard) < batch_size:
    raise ValueError(f"process {process_index} has {len(shard)} rows, fewer than one batch of "
                     f"{batch_size}")
  ds = grain.MapDataset.source(shard)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.repeat(num_epochs)
  if transform is not None:
    ds = ds.map(transform)
  # One RL step takes seconds and reads one batch, so one batch read ahead is plenty. Grain's
  # default (16 threads, 500 elements ahead) spent step 1's rollout computing shuffled indices
  # in 16 Python threads: that rollout ran 5x slower than the next ones (BENCHMARKS.md).
  return ds.batch(batch_size, drop_remainder=True, batch_fn=list).to_iter_dataset(
      grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))
