"""FLOPs and bytes of the programs an RL step runs, and their time on a hardware profile.

Analytic, from the model config alone (nothing is built or traced):
- FLOPs: 2 per weight per token for every matmul (attention projections, MLP, the lm_head over
  the tokens that need logits), plus attention: 4 x attended slots x heads x head_dim per query
  per layer (scores and the weighted sum).
- Bytes (HBM, per device): every weight read once per program call, the KV cache read over the
  attended slots and written for the new tokens, the embedding rows gathered, the f32 logits
  written. Activations between ops are not counted: a fused accelerator program keeps them on
  chip; that is where XLA:CPU's `bytes accessed` (which counts every fusion's operands, layout
  copies of the cache included) reads higher, see tests/test_cost_model.py.
- Tensor parallelism over `tp` devices splits weights, KV heads and the vocabulary; each layer
  then all-reduces its two outputs (ring: 2 (tp - 1) / tp of the activation bytes per device).
- `calls`: host program calls, each paying the profile's `step_overhead_s`.

Time on a profile (`seconds`): max(flops / peak, bytes / HBM bandwidth) / efficiency +
interconnect bytes / interconnect bandwidth + calls x step overhead. Where a measurement exists it
wins (`Predictor`). `xla_cost` takes XLA's own count from a compiled program
(`compiled.cost_analysis()`), for any backend the program was compiled for.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from tlt_jax.model.transformer import ModelConfig
from tlt_jax.perf.hardware import Hardware

F32 = 4


@dataclasses.dataclass(frozen=True)
class Cost:
  flops: float = 0.0
  bytes: float = 0.0  # HBM traffic per device
  comm_bytes: float = 0.0  # sent over the interconnect per device
  calls: float = 0.0  # host program calls

  def __add__(self, other: "Cost") -> "Cost":
    return Cost(self.flops + other.flops, self.bytes + other.bytes,
                self.comm_bytes + other.comm_bytes, self.calls + other.calls)

  def times(self, k: float) -> "Cost":
    return Cost(self.flops * k, self.bytes * k, self.comm_bytes * k, self.calls * k)


def itemsize(cfg: ModelConfig) -> int:
  return {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.dtype]


def layer_matmul_params(cfg: ModelConfig, qkv_in: int | None = None) -> int:
  """Weights one token multiplies by in one decoder layer (norm weights and biases are noise).
  `qkv_in`: the q/k/v input width (EAGLE-3 layers read [embedding; feature] = 2 x hidden)."""
  D, I, H, K, hd = (  # noqa: E741 (I: the MLP width, in the shape-letter names used here)
      cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                    cfg.head_dim)
  qkv_in = D if qkv_in is None else qkv_in
  return qkv_in * (H + 2 * K) * hd + H * hd * D + 3 * D * I


def kv_bytes_per_token(cfg: ModelConfig, layers: int | None = None) -> int:
  L = cfg.num_layers if layers is None else layers
  return 2 * L * cfg.num_kv_heads * cfg.head_dim * itemsize(cfg)


def _allreduce_bytes(nbytes: float, tp: int) -> float:
  return 2 * (tp - 1) / tp * nbytes if tp > 1 else 0.0


def forward(cfg: ModelConfig, rows: int, tokens: int, context: float, *, tp: int = 1,
            logits_tokens: int | None = None, layers: int | None = None,
            extra_params: int = 0, lm_head: bool = True, qkv_in: int | None = None,
            lm_head_vocab: int | None = None, calls: float = 1.0) -> Cost:
  """One forward of `rows` x `tokens` new tokens, each attending `context` slots on average.

  logits_tokens: tokens whose logits are computed (default all); layers: decoder layers (default
  cfg's); extra_params: matmul weights outside the layers and the head (a drafter's fc);
  lm_head_vocab: the head's width (a drafter's reduced vocabulary)."""
  L = cfg.num_layers if layers is None else layers
  n = rows * tokens
  logit_n = n if logits_tokens is None else logits_tokens
  V = (cfg.vocab_size if lm_head_vocab is None else lm_head_vocab) if lm_head else 0
  D, H, hd, isz = cfg.hidden_size, cfg.num_heads, cfg.head_dim, itemsize(cfg)
  layer_w = layer_matmul_params(cfg, qkv_in)
  flops = (2 * n * (L * layer_w + extra_params) + 2 * logit_n * D * V
           + 4 * n * context * H * hd * L)
  weights = (L * layer_w + extra_params + D * V) * isz
  kv = rows * context * kv_bytes_per_token(cfg, L) + n * kv_bytes_per_token(cfg, L)
  bytes_ = (weights + kv) / tp + n * D * isz + logit_n * V * F32 / tp
  comm = _allreduce_bytes(2 * L * n * D * isz, tp)
  return Cost(flops / tp, bytes_, comm, calls)


def drafter_forward(target: ModelConfig, rows: int, tokens: int, context: float, *,
                    tp: int = 1, eagle3: bool = False, draft_vocab: int | None = None,
                    calls: float = 1.0) -> Cost:
  """The EAGLE drafter: fc over [embedding; feature(s)] -> one decoder layer -> the lm_head
  (the target's, or EAGLE-3's reduced draft vocabulary). tlt-jax's and TLT's drafter is the
  EAGLE-2 one (fc: 2D -> D); EAGLE-3 fuses three target layers (fc: 3D -> D) and its q/k/v read
  2D (the fc output and the embedding)."""
  D = target.hidden_size
  return forward(target, rows, tokens, context, tp=tp, layers=1,
                 extra_params=(3 if eagle3 else 2) * D * D, qkv_in=2 * D if eagle3 else None,
                 lm_head_vocab=draft_vocab, calls=calls)


def train_step(cfg: ModelConfig, rows: int, seq_len: int, *, lora_rank: int = 0,
               devices: int = 1, extra_forwards: int = 1) -> Cost:
  """The policy update over rows x seq_len tokens, data-parallel over `devices`.

  Full fine-tuning: forward 2, backward 4 FLOPs per weight per token (dX and dW); LoRA: the
  frozen weights' backward needs dX only (2), the adapters are noise at rank <= 64
  ("LoRA without regret": 2N^2 + 6NR vs 3N^2). `extra_forwards`: forward-only passes before the
  update (1: the old-policy log-probs; 2 with a KL reference). Attention is causal: 2 T^2
  products per head per forward, 3x that with the backward. Bytes: weights read per pass (and
  under full fine-tuning the gradients and f32 AdamW moments); activations are noise next to
  the FLOPs at these sizes (compute-bound)."""
  n = rows * seq_len
  w = cfg.num_layers * layer_matmul_params(cfg) + cfg.hidden_size * cfg.vocab_size
  backward = 2 if lora_rank else 4
  attn = 2 * rows * seq_len * seq_len * cfg.num_heads * cfg.head_dim * cfg.num_layers
  flops = (2 + backward + 2 * extra_forwards) * n * w + (3 + extra_forwards) * attn
  isz = itemsize(cfg)
  bytes_ = w * isz * (3 + extra_forwards)
  if not lora_rank:
    bytes_ += w * (2 * isz + 3 * 2 * F32)  # grads, params + mu + nu read and written
  grads = (w if not lora_rank else 0) * isz  # data parallel: gradients all-reduced
  return Cost(flops / devices, bytes_, _allreduce_bytes(grads, devices), 2.0)


def drafter_train_step(target: ModelConfig, rows: int, row_len: int, *,
                       devices: int = 1) -> Cost:
  """One drafter step (tlt/spot.py): forward + backward of fc + one layer (all trainable, 6
  FLOPs per weight per token), the frozen lm_head forward on the prediction and on the target
  feature (soft labels) and its dX backward; AdamW on the drafter's weights."""
  D, V, n = target.hidden_size, target.vocab_size, rows * row_len
  w = layer_matmul_params(target) + 2 * D * D
  attn = 2 * rows * row_len * row_len * target.num_heads * target.head_dim
  flops = 6 * n * w + 3 * attn + (2 + 2 + 2) * n * D * V
  isz = itemsize(target)
  bytes_ = w * (3 * isz + 3 * 2 * F32) + 3 * D * V * isz + 3 * n * V * F32
  return Cost(flops / devices, bytes_, _allreduce_bytes(w * isz, devices), 1.0)


def weight_sync(nbytes: float, devices: int) -> Cost:
  """Publishing `nbytes` of weights to every device of a group: a broadcast over the
  interconnect (each device receives the bytes once)."""
  return Cost(0.0, nbytes, nbytes if devices > 1 else 0.0, 1.0)


def seconds(cost: Cost, hw: Hardware) -> float:
  roofline = max(cost.flops / hw.peak_flops, cost.bytes / hw.hbm_bytes_per_s)
  return (roofline / hw.efficiency + cost.comm_bytes / hw.interconnect_bytes_per_s
          + cost.calls * hw.step_overhead_s)


def bound(cost: Cost, hw: Hardware) -> str:
  return "compute" if cost.flops / hw.peak_flops >= cost.bytes / hw.hbm_bytes_per_s else "memory"


@dataclasses.dataclass
class Predictor:
  """Times programs on `hw`; a measured time for a program (same key) wins over the model."""
  hw: Hardware
  measurements: dict[str, float] = dataclasses.field(default_factory=dict)
  measurement_source: str = ""

  def time(self, key: str, cost: Cost) -> tuple[float, str]:
    if key in self.measurements:
      return self.measurements[key], "measured"
    return seconds(cost, self.hw), "model"


def xla_cost(compiled) -> Cost:
  """XLA's own FLOPs and bytes of a compiled program (`jax.jit(f).lower(...).compile()`), for
  whatever backend it was compiled for (this host's, or an abstract GPU/TPU target)."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older JAX: one dict per computation
    analysis = analysis[0]
  return Cost(float(analysis.get("flops", 0.0)), float(analysis.get("bytes accessed", 0.0)),
              0.0, 1.0)


def xla_cost_of(fn: Callable, *args) -> Cost:
  import jax  # noqa: PLC0415 (only this hook needs JAX)
  return xla_cost(jax.jit(fn).lower(*args).compile())
