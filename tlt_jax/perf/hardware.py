"""Hardware profiles for the cost model: what one device can do, and where each number comes from.

A profile holds datasheet figures (dense bf16 peak FLOP/s, HBM bandwidth, interconnect bandwidth
per device and direction) and two figures the datasheets do not give:
- `step_overhead_s`: the fixed cost of one program call (host dispatch, launches, the serving
  stack's scheduler). It is a property of the software stack as much as of the chip.
- `efficiency`: the fraction of the roofline a program reaches.
At most ONE of the two is fitted, from a measurement or from ONE published calibration point
named in `calibration` (and marked `calibration: true` wherever it is reported); the other keeps
its neutral value (efficiency 1.0, overhead 0) or a value copied from another profile's
calibration, said so in `notes`. `calibrated(...)` is the only way a profile gets a fitted
figure, so every fitted number carries its source.
"""

from __future__ import annotations

import dataclasses

TERA = 1e12
GIGA = 1e9


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  peak_flops: float  # dense bf16 FLOP/s per device (f32 for the CPU)
  hbm_bytes_per_s: float  # per device
  interconnect_bytes_per_s: float  # per device, one direction (NVLink / ICI)
  memory_bytes: float
  step_overhead_s: float = 0.0  # per program call
  efficiency: float = 1.0  # one figure for the whole roofline
  sources: str = ""  # where the datasheet numbers come from
  calibration: dict | None = None  # {"fits", "source", "quantity", "published"} if fitted
  notes: str = ""

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def calibrated(hw: Hardware, *, fits: str, value: float, source: str, quantity: str,
               published: float) -> Hardware:
  """`hw` with its one fitted figure (`fits` = "step_overhead_s" or "efficiency") set to `value`,
  recording the published point it came from."""
  if fits not in ("step_overhead_s", "efficiency"):
    raise ValueError(f"a profile fits step_overhead_s or efficiency, not {fits!r}")
  if hw.calibration is not None:
    raise ValueError(f"{hw.name} is already calibrated from {hw.calibration['source']}")
  return dataclasses.replace(hw, **{fits: value}, calibration=dict(
      fits=fits, value=value, source=source, quantity=quantity, published=published))


# Datasheet figures. bf16 peaks are dense (no 2:4 sparsity); bandwidths as the vendors state them.
H100_SXM = Hardware(
    "h100_sxm", 989.4 * TERA, 3.35 * TERA, 450 * GIGA, 80e9,
    sources="NVIDIA H100 datasheet (SXM5: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 900 GB/s "
            "both directions); memory_bandwidth 3.352e12 in XLA's h100_sxm.txtpb")
H200 = Hardware(
    "h200", 989.4 * TERA, 4.8 * TERA, 450 * GIGA, 141e9,
    sources="NVIDIA H200 datasheet (989 TFLOP/s dense bf16, 4.8 TB/s HBM3e, 141 GB, "
            "NVLink 900 GB/s)")
H20 = Hardware(
    "h20", 148 * TERA, 4.0 * TERA, 450 * GIGA, 96e9,
    sources="fastrl issue 7 / issue 23 text (148 TFLOP/s bf16, 4.0 TB/s); NVLink 900 GB/s, 96 GB "
            "(NVIDIA H20 spec sheet)")
GH200 = Hardware(
    "gh200", 989.4 * TERA, 4.0 * TERA, 450 * GIGA, 96e9,
    sources="NVIDIA GH200 datasheet (H100 compute, 96 GB HBM3 at 4.0 TB/s)")
GB200 = Hardware(
    "gb200", 2.5e15, 8.0 * TERA, 900 * GIGA, 186e9,
    sources="NVIDIA GB200 NVL72 datasheet: 180 PFLOP/s dense bf16 over 72 GPUs = 2.5 PFLOP/s, "
            "8 TB/s HBM3e, NVLink 5 1.8 TB/s both directions")
TPU_V5E = Hardware(
    "tpu_v5e", 197 * TERA, 819 * GIGA, 200 * GIGA, 16e9,
    sources="Google Cloud TPU v5e docs (197 TFLOP/s bf16, 819 GB/s HBM2, ICI 1600 Gbps)",
    notes="not calibrated: no published decode measurement at hand; predictions are the ideal "
          "roofline (efficiency 1.0, overhead 0)")
TPU_V5P = Hardware(
    "tpu_v5p", 459 * TERA, 2765 * GIGA, 600 * GIGA, 95e9,
    sources="Google Cloud TPU v5p docs (459 TFLOP/s bf16, 2765 GB/s HBM2e, ICI 4800 Gbps)",
    notes="not calibrated: no published decode measurement at hand; predictions are the ideal "
          "roofline (efficiency 1.0, overhead 0)")
# This machine (2-core AMD EPYC, f32). Both figures measured, not datasheet:
# ../shared/reference/cpu-calibration.md: a 512 x 1024 x 1024 f32 matmul in 8.37 ms
# (128 GFLOP/s, XLA) and numpy copy bandwidth ~20 GB/s. With measured peaks the efficiency
# stays 1.0: the measurement already is what the programs reach.
CPU_2CORE = Hardware(
    "cpu_2core", 2 * 512 * 1024 * 1024 / 8.37e-3, 20 * GIGA, 20 * GIGA, 24e9,
    sources="measured on this machine (cpu-calibration.md): XLA f32 matmul 128 GFLOP/s, copy "
            "bandwidth 20 GB/s; interconnect = memory copy (devices are host threads)",
    notes="L3 is 32 MiB: the bandwidth roofline means nothing for weights that sit in cache")

PROFILES: dict[str, Hardware] = {h.name: h for h in (
    H100_SXM, H200, H20, GH200, GB200, TPU_V5E, TPU_V5P, CPU_2CORE)}


def profile(name: str) -> Hardware:
  try:
    return PROFILES[name]
  except KeyError:
    raise ValueError(f"unknown hardware {name!r} (known: {sorted(PROFILES)})") from None
