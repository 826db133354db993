"""Ahead-of-time compilation of many programs at once: each is traced and lowered in the calling
thread (tracing reads thread-local JAX state: the numerics mode, the default device) and compiled
by a pool of threads while the caller goes on lowering the next (XLA's compile releases the GIL).

What it buys depends on how much of one compile XLA already spreads over cores. Measured on this
2-core CPU (BENCHMARKS.md, `experiments/bench_compile.py`): the default job's 96 rollout programs
build in 35.4 s with two threads against 41.9 s with one (1.18x), mostly from lowering overlapping
compiles, since XLA:CPU already uses both cores for one compile. Cross-compiled for an H100,
those 96 programs were slower with two threads (0.92x), while nine larger ones were 1.24x
faster. No GPU host (16 cores) has measured it: `compile.workers=1` is the one-at-a-time path.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

# One compile holds its whole LLVM module in memory: more than this many at once buys little
# and costs memory.
MAX_AUTO_WORKERS = 8


def auto_workers() -> int:
  return max(1, min(MAX_AUTO_WORKERS, os.cpu_count() or 1))


class CompileQueue:
  """`add` lowers a program now and starts compiling it in the background; `wait` hands each
  compiled program and its seconds to its `done` callback (in the calling thread, in the order
  added) and returns the seconds per kind of program, lowering plus compiling. With programs
  compiled side by side those seconds overlap: their sum may exceed the wall time of the whole.

  `workers=1` compiles each program in `add`, in the calling thread (nothing concurrent)."""

  def __init__(self, workers: int = 0):
    self.workers = workers if workers > 0 else auto_workers()
    self._executor: concurrent.futures.ThreadPoolExecutor | None = None
    self._pending: list[tuple[str, float, Any, Callable[[Any, float], None]]] = []
    self.seconds: collections.Counter[str] = collections.Counter()

  def add(self, kind: str, lower: Callable[[], Any], done: Callable[[Any, float], None]) -> Any:
    """Lowers (`lower()` returns a `jax.stages.Lowered`) and queues its compile; returns the
    Lowered. `done(compiled, seconds)` runs in `wait`, with the program's lowering plus
    compiling seconds."""
    t0 = time.perf_counter()
    lowered = lower()
    lower_s = time.perf_counter() - t0
    if self.workers == 1:
      result = concurrent.futures.Future()
      result.set_result(_timed_compile(lowered))
    else:
      if self._executor is None:
        self._executor = concurrent.futures.ThreadPoolExecutor(self.workers, "tlt-compile")
      result = self._executor.submit(_timed_compile, lowered)
    self._pending.append((kind, lower_s, result, done))
    return lowered

  def wait(self) -> dict[str, float]:
    """Waits for every queued compile and returns the seconds per kind so far. The first
    failed compile raises here, once the others have finished."""
    try:
      for kind, lower_s, result, done in self._pending:
        compiled, compile_s = result.result()
        self.seconds[kind] += lower_s + compile_s
        done(compiled, lower_s + compile_s)
    finally:
      self._pending.clear()
      if self._executor is not None:
        self._executor.shutdown(wait=True)
        self._executor = None
    return dict(self.seconds)


@contextlib.contextmanager
def using(queue: CompileQueue | None) -> Iterator[CompileQueue]:
  """`queue` (its caller waits), or a queue of the block's own, waited for when the block ends."""
  if queue is not None:
    yield queue
    return
  own = CompileQueue()
  yield own
  own.wait()


def _timed_compile(lowered) -> tuple[Any, float]:
  t0 = time.perf_counter()
  compiled = lowered.compile()
  return compiled, time.perf_counter() - t0
