"""The published points the hardware profiles are fitted to, one per profile, and the model
shapes they were measured on.

Each fitted profile takes its per-call overhead from ONE plain-decode measurement at batch 1
(the regime where the weight read and that overhead are all there is):
- h20: fastrl issue 7, Qwen2.5-7B-Instruct at TP 2 in SGLang, 3.9 ms per step;
- h100_sxm: vllm issue 20780, Llama-3.1-8B-Instruct on one H100 in vLLM, TPOT 7.07 ms.
Profiles with no point of their own (h200, gh200, gb200) borrow the h100 figure, said so in
their notes: the overhead belongs to the serving stack more than to the chip. TPUs and the CPU
keep theirs (0 / measured peaks). `experiments/reproduce_published.py` reports every
calibration point as a `calibration: true` row.
"""

from __future__ import annotations

import dataclasses
import functools

from tlt_jax.model.transformer import ModelConfig
from tlt_jax.perf import cost_model as cm
from tlt_jax.perf import hardware as hw_lib

# Shapes from the models' Hugging Face config.json files.
QWEN2_5_7B = ModelConfig("qwen2", 152064, 3584, 18944, 28, 28, 4, 128, dtype="bfloat16")
LLAMA3_1_8B = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, dtype="bfloat16")
QWEN3_8B = ModelConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, qk_norm=True,
                       dtype="bfloat16")


@dataclasses.dataclass(frozen=True)
class Point:
  source: str
  quantity: str
  seconds: float
  model: ModelConfig
  model_name: str
  tp: int
  context: float  # slots attended (the sources give none; KV is a few % of the bytes)


H20_POINT = Point("fastrl issue 7 (tlt.md s5)", "plain decode step, batch 1", 3.9e-3,
                  QWEN2_5_7B, "Qwen2.5-7B-Instruct", 2, 1024.0)
H100_POINT = Point("vllm issue 20780 (H100, Llama-3.1-8B-Instruct, batch 1)",
                   "vanilla TPOT, batch 1", 7.07e-3, LLAMA3_1_8B, "Llama-3.1-8B-Instruct", 1,
                   512.0)


def overhead_from(point: Point, hw: hw_lib.Hardware) -> float:
  """The per-call overhead that makes one plain decode step at batch 1 take the measured time."""
  bare = cm.seconds(cm.forward(point.model, 1, 1, point.context, tp=point.tp, calls=0.0), hw)
  return point.seconds - bare


def fit(hw: hw_lib.Hardware, point: Point) -> hw_lib.Hardware:
  return hw_lib.calibrated(hw, fits="step_overhead_s", value=overhead_from(point, hw),
                           source=point.source, quantity=point.quantity,
                           published=point.seconds)


@functools.cache
def profile(name: str) -> hw_lib.Hardware:
  """A hardware profile with its calibration applied (or borrowed, or none)."""
  if name == "h20":
    return fit(hw_lib.H20, H20_POINT)
  h100 = fit(hw_lib.H100_SXM, H100_POINT)
  if name == "h100_sxm":
    return h100
  base = hw_lib.profile(name)
  if name in ("h200", "gh200", "gb200"):
    return dataclasses.replace(
        base, step_overhead_s=h100.step_overhead_s,
        notes=f"per-call overhead {h100.step_overhead_s * 1e3:.2f} ms borrowed from the "
              f"h100_sxm calibration ({H100_POINT.source}); no point of its own")
  return base
