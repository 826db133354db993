"""XLA flags that numerics depend on, set from the config before JAX creates its backends.

What each flag buys, and what it does not:
- `--xla_cpu_max_isa=AVX` (CPU, batch_invariant): XLA:CPU contracts `a * b + c` into one fused
  multiply-add whenever both ops land in one fusion, and which products get contracted depends
  on how a program was fused (a loop of one trip is inlined, a slice becomes a bitcast, ...). The
  same expression then rounds differently in a decode program and in a prefill program. Capping
  codegen at AVX (no FMA instructions) makes every elementwise op round as written. Float vector
  width stays 256 bit; the measured cost is small at batch >= 16 (see BENCHMARKS.md).
- `--xla_gpu_deterministic_ops=true` (GPU): run-to-run determinism (no atomics-based scatter or
  reductions, no autotuning, which could pick a different kernel on a rerun). It does NOT give
  batch invariance: another batch size is another HLO, tiled and possibly split-K'd differently.
  That is what the batch-invariant kernels are for.
None of this changes TPU behaviour; TPU programs are run-to-run deterministic already, and batch
invariance comes from the kernels.

Not a flag but set here too: the precision of XLA's f32 matmuls (`config.numerics_f32_matmul`).
XLA runs an f32 dot as TF32 on NVIDIA GPUs (and as one bf16 pass on TPU) unless asked otherwise;
that broke HF logits parity (1e-4) and PEFT export/import parity on an H200. So f32 means f32
by default ("highest"); "tf32" is the named opt-in to the faster mode.
(The Pallas kernels ask for their own precision explicitly; this is for XLA's dots.)
"""

from __future__ import annotations

import os
import platform
import re

from jax._src import xla_bridge

CPU_NO_FMA = "--xla_cpu_max_isa=AVX"
GPU_DETERMINISTIC = "--xla_gpu_deterministic_ops=true"


def required_flags(numerics: str, xla_determinism: bool = True) -> list[str]:
  flags = []
  if numerics == "batch_invariant" and platform.machine() in ("x86_64", "AMD64"):
    flags.append(CPU_NO_FMA)
  if xla_determinism:
    flags.append(GPU_DETERMINISTIC)
  return flags


def missing_flags(flags: list[str]) -> list[str]:
  present = os.environ.get("XLA_FLAGS", "").split()
  return [f for f in flags if f not in present]


# config.numerics_f32_matmul -> jax_default_matmul_precision
F32_MATMUL = {"highest": "highest", "tf32": "tensorfloat32"}


def set_f32_matmul(f32_matmul: str = "highest") -> None:
  """XLA's precision for f32 matmuls, process-wide (`jax_default_matmul_precision`)."""
  import jax  # noqa: PLC0415 (setting a config option creates no backend)

  if f32_matmul not in F32_MATMUL:
    raise ValueError(f"numerics_f32_matmul={f32_matmul!r} must be one of {sorted(F32_MATMUL)}")
  jax.config.update("jax_default_matmul_precision", F32_MATMUL[f32_matmul])


def configure(numerics: str, xla_determinism: bool = True,
              f32_matmul: str = "highest") -> list[str]:
  """Adds the flags `numerics` needs to XLA_FLAGS and sets the f32 matmul precision (full f32
  unless `f32_matmul="tf32"`); returns the flags in force.

  Must run before the first JAX computation (XLA reads XLA_FLAGS when it creates a backend).
  Raises if a backend already exists without them: the run would silently break the contracts.
  """
  set_f32_matmul(f32_matmul)
  flags = required_flags(numerics, xla_determinism)
  missing = missing_flags(flags)
  if missing and xla_bridge.backends_are_initialized():
    raise RuntimeError(
        f"numerics={numerics!r} needs XLA_FLAGS {' '.join(missing)}, but JAX has already created "
        "its backends. Call tlt_jax.determinism.configure(...) before the first JAX computation, "
        f"or start the process with XLA_FLAGS='{' '.join(flags)}'.")
  if missing:
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *missing]).strip()
  return flags


def check_cpu_flags() -> None:
  """Batch-invariant numerics on x86 CPU are only exact without FMA contraction: say so early."""
  import jax  # noqa: PLC0415 (creating the backend here is fine: it is being used anyway)

  from tlt_jax import mesh  # noqa: PLC0415 (mesh imports jax; determinism must stay importable before XLA_FLAGS are set)

  missing = missing_flags(required_flags("batch_invariant", xla_determinism=False))
  # The default device's platform when one is set: host devices on a GPU machine need it too.
  if missing and (mesh.default_platform() or jax.default_backend()) == "cpu":
    raise RuntimeError(
        f"numerics='batch_invariant' on CPU needs XLA_FLAGS {' '.join(missing)} (no FMA "
        "contraction) set before JAX starts: call tlt_jax.determinism.configure('batch_invariant') "
        "first, or export XLA_FLAGS.")


HOST_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def force_host_devices(n: int) -> None:
  """Asks XLA for n CPU devices (read when JAX creates its CPU backend; GPUs/TPUs unaffected)."""
  flags = re.sub(HOST_DEVICE_COUNT + r"=\S+", "", os.environ.get("XLA_FLAGS", ""))
  os.environ["XLA_FLAGS"] = f"{flags} {HOST_DEVICE_COUNT}={n}".strip()


def host_devices_requested() -> bool:
  return HOST_DEVICE_COUNT in os.environ.get("XLA_FLAGS", "")
