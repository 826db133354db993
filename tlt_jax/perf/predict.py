"""Step costs from the cost model, for the long-tail simulator and the planner.

`long_tail` takes a decode step cost fixed + per_row x b, an SD round's overhead over a plain
step and an accept length. `tail_params` derives the first two from `cost_model` on a hardware
profile (in seconds of that hardware, not CPU units), for a serving stack that calls programs
its own way (`Stack`); accept lengths stay inputs, named with their sources by the caller.
`predict_config` does it for a tlt-jax config: the per-program breakdown (prefill, decode per
bucket, verify per arm and bucket, drafter forward and train step, policy train step, weight
sync) and the long-tail simulation of SD off, static SD and TLT driven by those costs.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from tlt_jax.model.transformer import ModelConfig
from tlt_jax.perf import cost_model as cm
from tlt_jax.perf import long_tail
from tlt_jax.perf.hardware import Hardware
from tlt_jax.rollout.tuner import Arm


@dataclasses.dataclass(frozen=True)
class Stack:
  """How a serving stack turns decode work into program calls (each pays the profile's
  step_overhead_s): `plain_calls` per plain step; an SD round makes `round_calls_fixed` calls
  plus `round_calls_per_draft` per draft forward."""
  name: str
  plain_calls: float
  round_calls_fixed: float
  round_calls_per_draft: float
  extend_is_first_draft: bool = False  # the extend's output is the first draft level
  eagle3: bool = False
  draft_vocab: int | None = None
  source: str = ""

  def round_calls(self, depth: int) -> float:
    return self.round_calls_fixed + self.round_calls_per_draft * depth


# SGLang's EAGLE worker: the whole multi-step draft is one CUDA graph, then verify, then the
# draft extend: 3 calls per round whatever the depth (sglang eagle_worker.py / eagle draft
# cuda graph runner, as vendored in fastrl, tlt.md s2.3).
# The draft loop runs depth - 1 drafter forwards: its first level is the top-k of the previous
# round's extend.
SGLANG_EAGLE = Stack("sglang_eagle", 1.0, 3.0, 0.0, extend_is_first_draft=True,
                     source="SGLang EAGLE worker: draft graph (depth - 1 drafter forwards) + "
                            "verify + draft extend per round")
# vLLM V1's EAGLE proposer: one drafter call per draft token (the first over the accepted
# tokens), then the target's verify step.
VLLM_EAGLE3 = Stack("vllm_eagle3", 1.0, 1.0, 1.0, extend_is_first_draft=True, eagle3=True,
                    draft_vocab=32000,
                    source="vLLM V1 EagleProposer: K drafter forwards (the first over the "
                           "accepted tokens) + 1 target step; EAGLE-3 drafters with a 32K draft "
                           "vocabulary")


class Strategy(NamedTuple):
  """An SD strategy as the cost model needs it (a tlt-jax `Arm` has the same attributes; SGLang's
  trees, e.g. TLT's 8_4_48, may verify more tokens than an Arm allows)."""
  name: str
  depth: int
  topk: int  # 0 = chain
  verify_tokens: int


def tlt_jax_stack(chunk_steps: int) -> Stack:
  """tlt-jax: `rollout/steps.decode_chunk` runs chunk_steps rounds (plain or SD, drafter
  catch-up included) in ONE compiled program, so a round pays 1/chunk_steps of a call."""
  k = 1.0 / chunk_steps
  return Stack(f"tlt_jax(chunk_steps={chunk_steps})", k, k, 0.0,
               source="rollout/steps.py: one decode_chunk program per chunk_steps rounds")


def plain_cost(cfg: ModelConfig, rows: int, context: float, tp: int, stack: Stack) -> cm.Cost:
  return cm.forward(cfg, rows, 1, context, tp=tp, calls=stack.plain_calls)


def round_cost(cfg: ModelConfig, arm: Arm | Strategy, rows: int, context: float, tp: int,
               stack: Stack, extend_tokens: int | None = None) -> cm.Cost:
  """One SD round: the drafter's forwards per draft level (top-k tokens per row for a tree, one
  for a chain; depth - 1 of them where the extend's output is the first level), the target's
  verify of arm.verify_tokens per row, and the drafter's extend over the accepted tokens
  (default depth + 1, the most a round accepts on a path)."""
  d, width = arm.depth, max(arm.topk, 1)
  kw = dict(tp=tp, eagle3=stack.eagle3, draft_vocab=stack.draft_vocab, calls=0.0)
  levels = d - 1 if stack.extend_is_first_draft else d
  drafts = cm.drafter_forward(cfg, rows, width, context, **kw).times(levels)
  extend = cm.drafter_forward(cfg, rows, d + 1 if extend_tokens is None else extend_tokens,
                              context, **kw)
  verify = cm.forward(cfg, rows, arm.verify_tokens, context, tp=tp, calls=0.0)
  return verify + drafts + extend + cm.Cost(calls=stack.round_calls(d))


def tail_params(cfg: ModelConfig, hw: Hardware, *, tp: int, context: float, arm: Arm | Strategy,
                stack: Stack, max_live: int, sd_threshold: int) -> dict:
  """cost(b) = fixed + per_row x b: least squares over b = 1, 2, 4, ... max_live of the
  modelled plain step; sd_overhead: the mean over the tail's buckets (b <= sd_threshold) of
  round / plain - 1, as `long_tail.fit_sd` takes it from measurements."""
  bs = [b for b in (2 ** i for i in range(16)) if b <= max_live]
  plain = np.array([cm.seconds(plain_cost(cfg, b, context, tp, stack), hw) for b in bs])
  per_row, fixed = np.polyfit(np.array(bs, np.float64), plain, 1) if len(bs) > 1 else (0.0, plain[0])
  tail = [b for b in bs if b <= sd_threshold]
  rounds = np.array([cm.seconds(round_cost(cfg, arm, b, context, tp, stack), hw) for b in tail])
  ratio = rounds / plain[:len(tail)]
  return dict(fixed_s=float(fixed), per_row_s=float(max(per_row, 0.0)),
              sd_overhead=float(ratio.mean() - 1.0), batches=bs, plain_step_s=plain.tolist(),
              tail_batches=tail, round_s=rounds.tolist())
