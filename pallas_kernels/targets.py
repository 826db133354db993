"""Ahead-of-time compiles for accelerators this machine does not have (TPU v4 / v5e / v5p / v6e,
H100), on a CPU: does every kernel and program compile there, and what does XLA say it costs?

    python -m pallas_kernels.targets                      # which targets this environment builds
    python -m pallas_kernels.targets --kernels            # kernel x target table: ok / FAIL
    python -m pallas_kernels.targets --kernels --targets tpu_v5e,h100 --match attention --errors

How: `jax.experimental.topologies.get_topology_desc` gives compile-only ("abstract") devices of a
TPU topology (libtpu) or of an H100 described by a GPU target config (the CUDA PJRT plugin, with
ptxas from nvidia-cuda-nvcc); the extra wheels are pinned in `requirements-accel.txt`. Inputs
are `jax.ShapeDtypeStruct`s with a `SingleDeviceSharding` on that device, lowered inside
`jax.default_device(device)`: Pallas TPU asks the default device which chip it compiles for, and
`pallas_kernels.common.target_platform()` (so `kernel_layout`, `default_interpret` and
`tlt_jax.ops.backend()`) picks that target's kernels and layouts. On the H100 the Pallas calls
lower through Triton: the kernels pass Triton's compiler parameters (JAX 0.10's Pallas GPU
default is Mosaic GPU).

Environment: run with `JAX_PLATFORMS=cpu` (CI's compile-check step does). Then JAX neither starts
a TPU backend from libtpu nor checks for a CUDA driver at start-up, and this module loads what
it needs when a target is first asked for: libtpu with `ALLOW_MULTIPLE_LIBTPU_LOAD=1` (libtpu
takes /tmp/libtpu_lockfile; a second process loading it, e.g. another pytest worker, fails
without it), the CUDA plugin's topology with `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`. Without
JAX_PLATFORMS=cpu it still works in one process: JAX prints the CUDA plugin's failed start-up
check and drops the plugin; `_ensure_cuda_plugin` registers it again.

Costs: `compile_for(...).cost_analysis()` is a dict on TPU, where a Pallas call counts only
what its `pl.CostEstimate` says (the kernels give none yet: no flops, ~0 s); on the H100's
compile-only client it is None. `memory_analysis()` works on both.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import os
import re
import shutil
import time
from typing import Callable

import jax
import jax.numpy as jnp
from jax._src import xla_bridge

from pallas_kernels import attention, logsoftmax, matmul, rmsnorm

TARGET_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "target_configs")


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  platform: str          # what get_topology_desc takes: "tpu" or "cuda"
  topology: str          # TPU topology name, or the GPU topology's name
  description: str
  target_config: str = ""  # GPU only: a GpuTargetConfigProto in text format, in target_configs/


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("tpu_v4", "tpu", "v4:2x2x1", "TPU v4"),
    Target("tpu_v5e", "tpu", "v5e:2x2", "TPU v5 lite"),
    Target("tpu_v5p", "tpu", "v5p:2x2x1", "TPU v5p"),
    Target("tpu_v6e", "tpu", "v6e:2x2", "TPU v6 lite (Trillium)"),
    Target("h100", "cuda", "h100", "NVIDIA H100 SXM 80GB (sm_90), Triton", "h100_sxm.txtpb"),
)}
TPU_TARGETS = tuple(n for n, t in TARGETS.items() if t.platform == "tpu")
GPU_TARGETS = tuple(n for n, t in TARGETS.items() if t.platform == "cuda")

# How a Pallas call shows in the lowered StableHLO of each platform (Mosaic TPU, Triton,
# Mosaic GPU).
PALLAS_CUSTOM_CALLS = {"tpu": ("tpu_custom_call",), "cuda": ("__gpu$xla.gpu.triton",)}


class TargetUnavailable(RuntimeError):
  """This environment cannot build the target (a wheel of requirements-accel.txt is missing)."""


class TargetCompileError(RuntimeError):
  """A kernel or program did not lower or compile for a target; the message names all three."""


def _target(name: str) -> Target:
  if name not in TARGETS:
    raise KeyError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
  return TARGETS[name]


# ---------------------------------------------------------------------------------------------
# What this environment can build


def _ptxas() -> str | None:
  """ptxas where XLA looks for it: the nvidia-cuda-nvcc-cu12 wheel's (what XLA runs when the
  wheel is importable; checked with strace), else one on PATH or in /usr/local/cuda."""
  try:
    spec = importlib.util.find_spec("nvidia.cuda_nvcc")
  except (ImportError, ValueError):
    spec = None
  for root in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(root, "bin", "ptxas")
    if os.path.isfile(path):
      return path
  system = "/usr/local/cuda/bin/ptxas"
  return shutil.which("ptxas") or (system if os.path.isfile(system) else None)


def _missing(name: str) -> str | None:
  """Why the target cannot be built here, from what is installed (None: nothing missing)."""
  t = _target(name)
  if t.platform == "tpu":
    from jax._src import cloud_tpu_init  # noqa: PLC0415 (TPU-only module)

    if cloud_tpu_init.get_tpu_library_path() is None:
      return "libtpu missing (pip install -r requirements-accel.txt)"
    return None
  try:
    plugin = importlib.util.find_spec("jax_plugins.xla_cuda12")
  except (ImportError, ValueError):
    plugin = None
  if plugin is None:
    return "CUDA plugin missing: jax-cuda12-plugin (pip install -r requirements-accel.txt)"
  if importlib.util.find_spec("jax_cuda12_pjrt") is None and not any(
      os.path.isfile(os.path.join(p, "xla_cuda_plugin.so"))
      for p in plugin.submodule_search_locations or []):
    return "CUDA PJRT missing: jax-cuda12-pjrt (pip install -r requirements-accel.txt)"
  if _ptxas() is None:
    return "ptxas missing: nvidia-cuda-nvcc-cu12 (pip install -r requirements-accel.txt)"
  if not os.path.isfile(os.path.join(TARGET_CONFIG_DIR, t.target_config)):
    return f"target config {t.target_config} missing from {TARGET_CONFIG_DIR}"
  return None


def available_targets(probe: bool = True) -> dict[str, str | None]:
  """{target: None if this environment builds it, else why not}. `probe` also makes each
  target's abstract device (a fraction of a second each) and reports its error."""
  out = {}
  for name in TARGETS:
    reason = _missing(name)
    if reason is None and probe:
      try:
        abstract_device(name)
      except Exception as e:  # noqa: BLE001 (the reason is the answer)
        reason = f"{type(e).__name__}: {first_line(e)}"
    out[name] = reason
  return out


# ---------------------------------------------------------------------------------------------
# Abstract devices


@contextlib.contextmanager
def _env(name: str, value: str):
  previous = os.environ.get(name)
  os.environ[name] = value
  try:
    yield
  finally:
    if previous is None:
      del os.environ[name]
    else:
      os.environ[name] = previous


def _ensure_cuda_plugin() -> None:
  """The CUDA plugin's topology factory, without a CUDA driver: its start-up check (CUDA runtime
  versions) is skipped. If JAX already dropped the plugin (it started without JAX_PLATFORMS=cpu
  and the check failed before the plugin registered anything), it is initialized again."""
  with _env("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1"):
    xla_bridge._discover_and_register_pjrt_plugins()  # noqa: SLF001
    if "cuda" not in xla_bridge._topology_factories:  # noqa: SLF001
      import jax_plugins.xla_cuda12 as cuda_plugin  # noqa: PLC0415 (optional accelerator wheels: absent without requirements-accel.txt)

      cuda_plugin.initialize()
  if "cuda" not in xla_bridge._topology_factories:  # noqa: SLF001
    raise TargetUnavailable("the CUDA plugin did not register its topology")


@functools.cache
def abstract_device(name: str) -> jax.Device:
  """A compile-only device of the target (the first of its topology); built once."""
  t = _target(name)
  reason = _missing(name)
  if reason is not None:
    raise TargetUnavailable(f"target {name}: {reason}")
  from jax.experimental import topologies  # noqa: PLC0415 (optional accelerator wheels: absent without requirements-accel.txt)

  if t.platform == "tpu":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # read when libtpu loads
    return topologies.get_topology_desc(t.topology, "tpu").devices[0]
  _ensure_cuda_plugin()
  with open(os.path.join(TARGET_CONFIG_DIR, t.target_config)) as f:
    config = f.read()
  return topologies.get_topology_desc(t.topology, t.platform, target_config=config,
                                      topology="1x1x1").devices[0]


# ---------------------------------------------------------------------------------------------
# Lowering and compiling


def first_line(e: BaseException) -> str:
  for line in str(e).splitlines():
    if line.strip():
      return line.strip()[:400]
  return type(e).__name__


def _short(dtype) -> str:
  d = jax.numpy.dtype(dtype)
  return {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "i32",
          "bool": "bool"}.get(d.name, d.name)


def describe(*arg_specs) -> str:
  """'bf16[8,3584] bf16[3584,512]': the array arguments of a call, for names and errors."""
  leaves = [x for x in jax.tree.leaves(arg_specs) if hasattr(x, "shape")]
  if len(leaves) > 6:
    return f"{len(leaves)} arrays"
  return " ".join(f"{_short(x.dtype)}[{','.join(map(str, x.shape))}]" for x in leaves)


def on_device(tree, device: jax.Device):
  """Every array-like leaf (array, ShapeDtypeStruct) as a ShapeDtypeStruct on `device`."""
  sharding = jax.sharding.SingleDeviceSharding(device)

  def spec(x):
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x
  return jax.tree.map(spec, tree)


def target_context(name: str):
  """Everything a trace for the target needs: its device as the default device. (On GPU the
  kernels name Triton's compiler themselves, so nothing here forces a Pallas lowering: the
  H100 cases compile what a run would.)"""
  return jax.default_device(abstract_device(name))


def lower_for(name: str, fn: Callable, *arg_specs, label: str | None = None, **static):
  """`jax.jit(fn).lower(...)` for the target: array leaves of `arg_specs` become
  ShapeDtypeStructs on its abstract device, `static` are bound as keyword arguments.
  `fn` may already be a jitted function (its own static arguments in `static`)."""
  label = label or getattr(fn, "__name__", repr(fn))
  try:
    device = abstract_device(name)
    specs = on_device(arg_specs, device)
    with target_context(name):
      return jax.jit(functools.partial(fn, **static) if static else fn).lower(*specs)
  except TargetUnavailable:
    raise
  except Exception as e:
    raise TargetCompileError(
        f"{label} [{describe(*arg_specs)}] on {name}: lowering failed: {first_line(e)}") from e


def pallas_calls(name: str, lowered) -> int:
  """How many Pallas kernels (the target's custom calls) a lowered program contains."""
  text = lowered.as_text(debug_info=False)
  return sum(len(re.findall(re.escape(c), text))
             for c in PALLAS_CUSTOM_CALLS[_target(name).platform])


def compile_lowered(name: str, lowered, where: str, min_pallas_calls: int = 0):
  """`lowered.compile()` for the target; errors start with `where` (what, shapes, target).
  `min_pallas_calls`: fail unless the lowered program holds at least that many Pallas kernels
  (a kernel that fell back to interpret mode, or to the XLA path, lowers to plain HLO)."""
  if min_pallas_calls:
    found = pallas_calls(name, lowered)
    if found < min_pallas_calls:
      raise TargetCompileError(f"{where}: {found} Pallas calls in the lowered program, expected "
                               f">= {min_pallas_calls} (interpret mode or the XLA path?)")
  try:
    with target_context(name):
      return lowered.compile()
  except Exception as e:
    raise TargetCompileError(f"{where}: compile failed: {first_line(e)}") from e


def compile_for(name: str, fn: Callable, *arg_specs, label: str | None = None,
                min_pallas_calls: int = 0, **static):
  """The compiled executable of `fn` for the target (read `cost_analysis()` /
  `memory_analysis()` from it; on the H100's compile-only client `cost_analysis()` is None).
  Errors name `label` (default: fn's name), the argument shapes and the target."""
  label = label or getattr(fn, "__name__", repr(fn))
  lowered = lower_for(name, fn, *arg_specs, label=label, **static)
  return compile_lowered(name, lowered, f"{label} [{describe(*arg_specs)}] on {name}",
                         min_pallas_calls)


# ---------------------------------------------------------------------------------------------
# The kernels at realistic shapes (tests/test_accelerator_compile.py compiles each for every
# target; `python -m pallas_kernels.targets --kernels` prints the table)


@dataclasses.dataclass(frozen=True)
class KernelCase:
  id: str          # kernel-role-dtype-shape: what a test id and an error name
  fn: Callable
  specs: tuple     # ShapeDtypeStructs (no sharding: compile_for puts them on the target)
  static: dict

  def __repr__(self):
    return self.id

  def compile(self, target: str):
    return compile_for(target, self.fn, *self.specs, label=self.id, min_pallas_calls=1,
                       **self.static)


def kernel_cases() -> list[KernelCase]:
  """Every Pallas kernel at the shapes the configs run (Qwen2.5-0.5B / 7B / 32B, Llama-2's and
  Qwen's vocabularies), one case per shape. Every head_dim (64, 80, 96, 128, 256), both GQA
  ratios (7:1, 2:1) and every attention path (decode, verify, prefill causal and into a cache)
  is covered; dtypes (bf16, f32) and rows (1, 8, 64) are spread over the cases, not crossed."""


  S = jax.ShapeDtypeStruct
  BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)

  def mm(role, M, K, N, dt=BF16):
    return KernelCase(f"matmul-{role}-{_short(dt)}-{M}x{K}x{N}", matmul.matmul_pallas,
                      (S((M, K), dt), S((K, N), dt)), {"interpret": False})

  def rms(role, rows, D, dt=BF16):
    return KernelCase(f"rms_norm-{role}-{_short(dt)}-{rows}x{D}", rmsnorm.rms_norm_pallas,
                      (S((rows, D), dt), S((D,), dt)), {"eps": 1e-6, "interpret": False})

  def attn(path, B, T, H, K, D, Sk, dt=BF16, causal=False):
    return KernelCase(
        f"attention-{path}-{_short(dt)}-B{B}-T{T}-H{H}-K{K}-D{D}-S{Sk}", attention.attention_pallas,
        (S((B, T, H, D), dt), S((B, Sk, K, D), dt), S((B, Sk, K, D), dt),
         S((B, T, Sk), jnp.bool_)),
        {"scale": 1.0 / D ** 0.5, "causal": causal, "interpret": False})

  def log_softmax(rows, V):
    return KernelCase(f"log_softmax-f32-{rows}x{V}", logsoftmax.log_softmax_pallas,
                      (S((rows, V), F32),), {"interpret": False})

  def token_logprobs(rows, V):
    return KernelCase(f"token_logprobs-f32-{rows}x{V}", logsoftmax.token_logprobs_pallas,
                      (S((rows, V), F32), S((rows,), jnp.int32)), {"interpret": False})

  return [
      # Qwen2.5-7B linears (hidden 3584, 28 q / 4 kv heads of 128, MLP 18944), rows 1 / 8 / 64.
      mm("q_o", 8, 3584, 3584),
      mm("k_v", 1, 3584, 512),
      mm("gate_up", 64, 3584, 18944),
      mm("down", 1, 18944, 3584),
      mm("down", 64, 18944, 3584),
      mm("down", 64, 18944, 3584, F32),
      mm("lm_head", 8, 3584, 152064),
      # ... split 4 ways (exact tensor parallelism, mesh.model = 4): one device's share.
      mm("tp4_q", 8, 3584, 896),
      mm("tp4_down", 8, 18944, 896),
      # LoRA rank 32: x @ A, then (x @ A) @ B.
      mm("lora_a", 8, 3584, 32),
      mm("lora_b", 8, 32, 3584, F32),
      # Qwen2.5-0.5B (hidden 896, 14 / 2 heads of 64, MLP 4864) and -32B (5120, 40 / 8, 27648).
      mm("q_o", 64, 896, 896, F32),
      mm("k_v", 8, 896, 128),
      mm("down", 8, 4864, 896),
      mm("k_v", 64, 5120, 1024),
      mm("gate_up", 8, 5120, 27648),
      mm("down", 1, 27648, 5120),
      # RMSNorm over the hidden size and over one head (Qwen3's q/k norm), rows 1 / 8 / 64.
      rms("hidden", 8, 3584),
      rms("hidden", 1, 3584, F32),
      rms("hidden", 64, 896),
      rms("hidden", 8, 5120, F32),
      rms("head", 64, 128),
      rms("head", 8, 80, F32),
      rms("head", 8, 24, F32),  # the small Qwen3 of the tests (head_dim 24)
      # Attention. Decode (T = 1) at every head_dim, 7:1 GQA (Qwen2.5-7B: 28 / 4) and 2:1.
      attn("decode", 8, 1, 28, 4, 128, 32768),
      attn("decode", 1, 1, 28, 4, 128, 9216, F32),
      attn("decode", 64, 1, 28, 4, 128, 4096),
      attn("decode", 8, 1, 14, 2, 64, 8192),
      attn("decode", 8, 1, 16, 8, 80, 4096),
      attn("decode", 8, 1, 16, 8, 96, 4096, F32),
      attn("decode", 8, 1, 8, 4, 256, 4096),
      attn("decode", 4, 1, 4, 2, 24, 96, F32),  # the small Qwen3 of the tests
      # Chain / tree verify: T = 4..8 tokens against the cache, an explicit (tree) mask.
      attn("verify", 8, 4, 28, 4, 128, 9216),
      attn("verify", 16, 8, 28, 4, 128, 32768),
      attn("verify", 8, 5, 16, 8, 96, 4096),
      attn("verify", 8, 8, 14, 2, 64, 4096, F32),
      # Prefill: causal over the tokens themselves (the trainer's forward), and into a cache.
      attn("prefill_causal", 1, 512, 28, 4, 128, 512, causal=True),
      attn("prefill_causal", 4, 128, 16, 8, 80, 128, causal=True),
      attn("prefill_causal", 2, 256, 8, 4, 256, 256, F32, causal=True),
      attn("prefill_cache", 1, 512, 28, 4, 128, 9216),
      # Log-softmax and token log-probs: Llama-2's (32000) and Qwen2.5's (151936) vocabularies.
      log_softmax(1, 32000),
      log_softmax(8, 151936),
      log_softmax(64, 151936),
      token_logprobs(8, 32000),
      token_logprobs(64, 151936),
      token_logprobs(2048, 151936),  # the trainer's head: 2 rows x 1024-token chunks
  ]


def _main(argv=None) -> int:

  try:  # what a run sets before JAX starts (tlt_jax.determinism: XLA flags, f32 matmul precision)
    from tlt_jax import determinism  # noqa: PLC0415 (the CLI sets XLA flags before tlt_jax loads)

    determinism.configure("batch_invariant")
  except ImportError:
    pass

  parser = argparse.ArgumentParser(prog="python -m pallas_kernels.targets",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--kernels", action="store_true", help="compile each kernel per target")
  parser.add_argument("--targets", default="", help="comma-separated (default: all buildable)")
  parser.add_argument("--match", default="", help="only kernel cases whose id has this text")
  parser.add_argument("--errors", action="store_true", help="print each failure's error line")
  args = parser.parse_args(argv)

  available = available_targets()
  names = [n for n in (args.targets.split(",") if args.targets else TARGETS) if n]
  for n in names:
    print(f"{n:9s} {TARGETS[n].description:40s} {'ok' if available[n] is None else available[n]}")
  names = [n for n in names if available[n] is None]
  if not args.kernels or not names:
    return 0 if names else 1
  cases = [c for c in kernel_cases() if args.match in c.id]
  width = max(len(c.id) for c in cases)
  print(f"\n{'kernel':{width}s}  " + "  ".join(f"{n:>8s}" for n in names))
  failures = []
  start = time.time()
  for case in cases:
    cells = []
    for n in names:
      try:
        case.compile(n)
        cells.append("ok")
      except TargetCompileError as e:
        cells.append("FAIL")
        failures.append(str(e))
    print(f"{case.id:{width}s}  " + "  ".join(f"{c:>8s}" for c in cells), flush=True)
  print(f"\n{len(failures)} of {len(cases) * len(names)} failed ({time.time() - start:.0f} s)")
  if args.errors:
    for f in failures:
      print(" ", f)
  return 1 if failures else 0


if __name__ == "__main__":
  import sys

  sys.exit(_main())
