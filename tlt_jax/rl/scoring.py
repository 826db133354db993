"""Reward scoring in a worker pool, fed while the rollout's long tail is still decoding.

The engine calls `submit` for each sample as it finishes; `results` waits only for what is still
being scored when the rollout ends (`wait_s`, usually ~0). Workers:
  "thread"  (default) regex extraction and exact-rational equivalence release no GIL worth having,
            but they run while the host waits on the device, which is the point;
  "process" for heavy verifiers (sympy on MATH-style answers): a spawned pool (forking a process
            that runs JAX is unsafe), with a per-sample timeout that scores 0 instead of hanging;
            math-verify uses its own signal timeouts there (each worker's main thread), while a
            thread worker hands it to a killable helper process (tlt_jax/rl/equivalence.py);
  "inline"  scores in the caller (debugging, exact tracebacks).
A row's `reward` field picks math (tlt_jax/rl/equivalence.py) or code (tlt_jax/rl/code_reward.py:
each test a sandboxed subprocess, so code scoring overlaps decoding in any worker kind).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing
import time

import numpy as np

from tlt_jax.rl.code_reward import CodeSpec, code_reward
from tlt_jax.rl.equivalence import PATHS, grade
from tlt_jax.rl.rewards import format_reward
from tlt_jax.rl.sandbox import Limits

WORKER_KINDS = ("thread", "process", "inline")
REWARD_KINDS = ("math", "code")


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  correct_weight: float = 1.0
  format_weight: float = 0.0
  code: CodeSpec = CodeSpec()

  @classmethod
  def from_config(cls, rl) -> "RewardSpec":
    """From the config's `rl` section."""
    return cls(rl.correct_weight, rl.format_weight,
               CodeSpec(partial=rl.code_partial, max_tests=rl.code_max_tests,
                        limits=Limits(wall_s=rl.code_timeout_s,
                                      cpu_s=max(1, int(rl.code_timeout_s)))))


def score(completion: str, reference, spec: RewardSpec) -> dict:
  """Reward parts and their weighted total for one completion (module level: picklable).
  `reference`: the reference answer (math), or the dataset row (tlt_jax/data/sources.py), whose
  `reward` field picks math (its `answer`) or code (its `tests`)."""
  row = reference if isinstance(reference, dict) else {"reward": "math", "answer": reference}
  kind = row.get("reward", "math")
  if kind == "code":
    correct, path = code_reward(completion, row["tests"], spec.code), "code"
    fmt = 0.0
  elif kind == "math":
    ok, path = grade(completion, row["answer"])
    correct = float(ok)
    fmt = format_reward(completion) if spec.format_weight else 0.0
  else:
    raise ValueError(f"row reward kind {kind!r} is not one of {REWARD_KINDS}")
  return {"reward": spec.correct_weight * correct + spec.format_weight * fmt,
          "correct": correct, "format": fmt, "kind": kind, "path": path}


def reward_metrics(scores: dict[int, dict]) -> dict[str, float]:
  """Per-kind reward and correct means and how many math samples each grader path decided, for
  the step record (`record.update(reward_metrics(scores))`)."""
  out = {}
  for kind in REWARD_KINDS:
    parts = [s for s in scores.values() if s.get("kind", "math") == kind]
    if parts:
      out[f"reward_mean_{kind}"] = float(np.mean([s["reward"] for s in parts]))
      out[f"correct_mean_{kind}"] = float(np.mean([s["correct"] for s in parts]))
      out[f"samples_{kind}"] = len(parts)
  for path in PATHS:
    out[f"math_decided_{path}"] = sum(s.get("path") == path for s in scores.values())
  return out


class RewardScorer:

  def __init__(self, spec: RewardSpec = RewardSpec(), *, workers: int = 2, kind: str = "thread",
               timeout_s: float = 10.0):
    if kind not in WORKER_KINDS:
      raise ValueError(f"reward worker kind must be one of {WORKER_KINDS}, got {kind!r}")
    self.spec, self.kind, self.timeout_s = spec, kind, timeout_s
    if kind == "thread":
      self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="reward")
    elif kind == "process":
      self._pool = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    else:
      self._pool = None
    self._pending: dict[int, cf.Future | dict] = {}
    self._kinds: dict[int, str] = {}
    self.timeouts = 0

  def submit(self, sample_id: int, completion: str, reference) -> None:
    """`reference`: the reference answer (math) or the dataset row (math or code, its choice)."""
    if sample_id in self._pending:
      raise ValueError(f"sample {sample_id} was submitted twice")
    self._kinds[sample_id] = (reference.get("reward", "math") if isinstance(reference, dict)
                              else "math")
    if self._pool is None:
      self._pending[sample_id] = score(completion, reference, self.spec)
    else:
      self._pending[sample_id] = self._pool.submit(score, completion, reference, self.spec)

  def results(self) -> tuple[dict[int, dict[str, float]], float]:
    """All submitted scores (sample id -> parts) and the seconds spent waiting for them."""
    start = time.perf_counter()
    out = {}
    for sid, fut in self._pending.items():
      if isinstance(fut, dict):
        out[sid] = fut
        continue
      try:
        out[sid] = fut.result(timeout=self.timeout_s)
      except cf.TimeoutError:
        self.timeouts += 1
        fut.cancel()
        out[sid] = {"reward": 0.0, "correct": 0.0, "format": 0.0, "kind": self._kinds[sid],
                    "path": "timeout"}
    self._pending, self._kinds = {}, {}
    return out, time.perf_counter() - start

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
