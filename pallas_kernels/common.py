"""Helpers the kernels share: where interpret mode is needed, padding to block multiples, the
output types of a Pallas call inside `jax.shard_map`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import config as jax_config
from jax._src import core as jax_core


def target_platform() -> str:
  """Where the computation being traced will run: "gpu", "tpu" or "cpu".

  The default device, when one is set, wins over the default backend: a test that places its
  mesh on host devices of a GPU machine (`jax.default_device(jax.devices("cpu")[0])`) gets the
  CPU kernels, and an ahead-of-time compile for an abstract TPU or H100 device (see
  `pallas_kernels.targets`) gets that target's kernels, though no such chip is attached.
  """
  device = jax.config.jax_default_device
  if device is None:
    platform = jax.default_backend()
  else:
    platform = device if isinstance(device, str) else device.platform
  return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)


def default_interpret() -> bool:
  """Pallas compiles only for GPU/TPU; everywhere else the kernel runs in interpret mode."""
  return target_platform() not in ("gpu", "tpu")


def out_struct(shape, dtype, *inputs: jax.Array) -> jax.ShapeDtypeStruct:
  """A Pallas call's output type. Inside a `jax.shard_map` that checks how values vary over its
  manual mesh axes, pallas_call must be told: the output varies over every axis an input does
  (each device runs the kernel on its own blocks)."""
  if not jax_config._check_vma.value:
    return jax.ShapeDtypeStruct(shape, dtype)
  varying = frozenset().union(*(jax.typeof(x).mat.varying for x in inputs))
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=jax_core.ManualAxisType(varying=varying))


LAYOUTS = ("cpu", "gpu", "tpu")


def kernel_layout(layout: str | None, interpret: bool) -> str:
  """Which backend's block shapes a kernel uses: given, else the target's.

  Each backend compiles its own blocking (Triton needs power-of-2 arrays, Mosaic 128-lane
  aligned slices and bounded VMEM), and each is batch-invariant on its own. Interpret mode on a
  host keeps the "cpu" layout unless a test asks for another, so the CPU bits do not move and
  the GPU and TPU layouts can still be run, and checked, on a CPU.
  """
  if layout is not None:
    if layout not in LAYOUTS:
      raise ValueError(f"kernel layout must be one of {LAYOUTS}, got {layout!r}")
    return layout
  platform = target_platform()
  return platform if (platform in ("gpu", "tpu") and not interpret) else "cpu"


def next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def compiler_params(layout: str, *tpu_semantics: str):
  """The compiler a layout is written for, named explicitly.

  GPU: Triton. Pallas on GPU picks Mosaic GPU when no parameters are given (the default in JAX
  0.10), which these kernels exceed (shared memory, 256-element async copies). TPU: Mosaic,
  with the grid axes' semantics ("parallel" / "arbitrary"). Interpret mode needs none.
  """
  if layout == "gpu":
    from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415 (GPU-only module)

    return pltriton.CompilerParams()
  if layout == "tpu":
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415 (TPU-only module)

    return pltpu.CompilerParams(dimension_semantics=tpu_semantics or None)
  return None


def vmem(shape, dtype):
  from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415 (TPU-only module)

  return pltpu.VMEM(shape, dtype)


def dot_f32(a: jax.Array, b: jax.Array, contract=((1,), (0,))) -> jax.Array:
  """A 2-D dot inside a kernel, accumulated in f32, at full precision for f32 inputs.

  Triton's default for an f32 dot is TF32 (10 mantissa bits): 3e-4 off in a 300-long sum. f32
  here means f32, so f32 inputs ask for HIGHEST (Triton: IEEE; Mosaic: full-precision passes).
  """
  # Never None: that would take `jax_default_matmul_precision` ("highest" for XLA's f32 dots,
  # `tlt_jax.determinism`), which Mosaic refuses for bf16 inputs ("Bad lhs type").
  precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
  return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def pad_axis(x: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
  """Pads `axis` up to a multiple of `multiple` (no-op when it already is one)."""
  size = x.shape[axis]
  target = round_up(size, multiple)
  if target == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, target - size)
  return jnp.pad(x, widths, constant_values=value)


def fenced(fn):
  """Wraps a block body in optimization barriers on its inputs and outputs.

  A loop of one trip is inlined by XLA, and the inlined body may then fuse with its neighbours;
  a reduction inside a different fusion can be emitted with a different loop order. The
  barriers keep the block body the same computation whether it runs once or in a loop.
  """

  def wrapped(args):
    return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(args)))

  return wrapped


def map_row_blocks(fn, x_RxC: jax.Array, block_rows: int, *extra_row_args: jax.Array) -> jax.Array:
  """Applies `fn` to fixed-shape row blocks [block_rows, ...] one after another.

  The rows are padded up to a multiple of `block_rows` and the blocks run inside one `lax.map`
  (a loop), so XLA compiles a single program for the block shape whatever the number of rows.
  That is the pure-JAX way to get a batch-invariant result from ops whose algorithm XLA picks by
  shape (dots); a vmap would be folded back into one big dot of the padded shape.
  """
  rows = x_RxC.shape[0]
  padded = [pad_axis(a, 0, block_rows) for a in (x_RxC, *extra_row_args)]
  num_blocks = padded[0].shape[0] // block_rows
  blocked = [a.reshape(num_blocks, block_rows, *a.shape[1:]) for a in padded]
  out = jax.lax.map(fenced(lambda *args: fn(*args)), tuple(blocked))
  return out.reshape(num_blocks * block_rows, *out.shape[2:])[:rows]


def tree_sum(x: jax.Array, axis: int = -1) -> jax.Array:
  """Sum over `axis` as a pairwise tree of elementwise adds: one fixed order for every shape.

  XLA:CPU emits `reduce` (and fuses it) with a loop order chosen from the shapes around it, so
  the same row can sum differently in a [1, D] and a [64, D] array. Elementwise adds are never
  reassociated, so halving the axis with `a[:h] + a[h:]` (a zero pad where the length is odd)
  fixes the order completely, at the cost of log2(n) fused adds.
  """
  axis = axis % x.ndim
  while x.shape[axis] > 1:
    if x.shape[axis] % 2:
      x = pad_axis(x, axis, 2)
    half = x.shape[axis] // 2
    x = (jax.lax.slice_in_dim(x, 0, half, axis=axis)
         + jax.lax.slice_in_dim(x, half, 2 * half, axis=axis))
  return jax.lax.squeeze(x, (axis,))
