"""Batch-invariant matmul: one fixed tile configuration per dtype, the whole K loop in one program.

Why: XLA (and cuBLAS) pick the algorithm by shape. At batch 1 a product runs as a matrix-vector
kernel, at small M a GPU library may switch to split-K; either way row i of `x @ w` changes with
the number of rows around it. Here every output tile [bm, bn] is computed by one program that
walks K in blocks of bk, in order, into an f32 accumulator. The row count only changes how many
programs run, never what any of them computes, so a row's result does not depend on M or on its
position. No split-K: M and N are padded to the tile, K to the K block (zeros add exactly 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import (compiler_params, default_interpret, dot_f32, kernel_layout,
                                   map_row_blocks, out_struct, pad_axis, vmem)

# (bm, bn, bk) per input dtype and layout: one configuration per backend, used for every shape.
# GPU (Triton): each program holds a [bm, K] strip of x and a [K, bn] strip of w in global memory
# and walks K in power-of-2 blocks. TPU (Mosaic): K is the grid's last, sequential axis with an
# f32 accumulator in VMEM, so a K of 18944 (Qwen2.5-7B's down_proj) needs no K-long strip in
# VMEM; tiles are 128-lane aligned and big enough to feed the MXU.
PALLAS_BLOCKS = {
    "cpu": {jnp.dtype(jnp.float32): (32, 128, 128), jnp.dtype(jnp.bfloat16): (32, 128, 256)},
    "gpu": {jnp.dtype(jnp.float32): (32, 128, 128), jnp.dtype(jnp.bfloat16): (32, 128, 256)},
    "tpu": {jnp.dtype(jnp.float32): (128, 256, 512), jnp.dtype(jnp.bfloat16): (128, 256, 512)},
}
# Rows per block of the pure-JAX path: one [bm, K] x [K, N] dot per block (whole K in one dot).
BLOCKED_JAX_ROWS = 8


def matmul_reference(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  out = jnp.matmul(x_MxK, w_KxN, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST)
  return out.astype(jnp.result_type(x_MxK, w_KxN))


def _matmul_kernel(x_ref, w_ref, o_ref, *, bk: int, num_k_blocks: int):
  bm, bn = o_ref.shape

  def k_step(kb, acc_bmxbn):
    start = pl.multiple_of(kb * bk, bk)
    x_blk = x_ref[:, pl.ds(start, bk)]
    w_blk = w_ref[pl.ds(start, bk), :]
    return acc_bmxbn + dot_f32(x_blk, w_blk)

  acc = jax.lax.fori_loop(0, num_k_blocks, k_step, jnp.zeros((bm, bn), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _matmul_kernel_tpu(x_ref, w_ref, o_ref, acc_ref):
  """One (i, j, k) grid step: acc += x[i, k] @ w[k, j]; k runs in order (an "arbitrary" axis)."""
  k = pl.program_id(2)

  @pl.when(k == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  acc_ref[...] = acc_ref[...] + dot_f32(x_ref[...], w_ref[...])

  @pl.when(k == pl.num_programs(2) - 1)
  def _():
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "layout"))
def matmul_pallas(x_MxK: jax.Array, w_KxN: jax.Array, *, interpret: bool | None = None,
                  layout: str | None = None) -> jax.Array:
  """[M, K] @ [K, N] with the fixed tile of `PALLAS_BLOCKS` for the layout and input dtype."""
  if interpret is None:
    interpret = default_interpret()
  layout = kernel_layout(layout, interpret)
  M, K = x_MxK.shape
  K2, N = w_KxN.shape
  if K != K2:
    raise ValueError(f"matmul: x is [{M}, {K}] but w is [{K2}, {N}]")
  out_dtype = jnp.result_type(x_MxK, w_KxN)
  bm, bn, bk = PALLAS_BLOCKS[layout][jnp.dtype(out_dtype)]
  x = pad_axis(pad_axis(x_MxK.astype(out_dtype), 0, bm), 1, bk)
  w = pad_axis(pad_axis(w_KxN.astype(out_dtype), 0, bk), 1, bn)
  Mp, Kp = x.shape
  Np = w.shape[1]
  if layout == "tpu":
    out = pl.pallas_call(
        _matmul_kernel_tpu,
        grid=(Mp // bm, Np // bn, Kp // bk),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, k: (i, k)),
                  pl.BlockSpec((bk, bn), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, k: (i, j)),
        out_shape=out_struct((Mp, Np), out_dtype, x, w),
        scratch_shapes=[vmem((bm, bn), jnp.float32)],
        compiler_params=compiler_params(layout, "parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(x, w)
    return out[:M, :N]
  out = pl.pallas_call(
      functools.partial(_matmul_kernel, bk=bk, num_k_blocks=Kp // bk),
      grid=(Mp // bm, Np // bn),
      in_specs=[pl.BlockSpec((bm, Kp), lambda i, j: (i, 0)),
                pl.BlockSpec((Kp, bn), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      out_shape=out_struct((Mp, Np), out_dtype, x, w),
      compiler_params=compiler_params(layout),
      interpret=interpret,
  )(x, w)
  return out[:M, :N]


def matmul_blocked_jax(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """Pure-JAX batch-invariant matmul for CPU: fixed [8, K] row blocks, one dot each, in a loop.

  Every block is the same [bm, K] x [K, N] dot in one compiled loop body, so XLA cannot switch
  algorithm with M. About as fast as XLA's own matmul on CPU (see the calibration notes), where
  the interpreted Pallas kernel is 10-20x slower.
  """
  out_dtype = jnp.result_type(x_MxK, w_KxN)
  w = w_KxN.astype(out_dtype)

  def block(x_bmxK):
    return jnp.dot(x_bmxK, w, preferred_element_type=jnp.float32).astype(out_dtype)

  return map_row_blocks(block, x_MxK.astype(out_dtype), BLOCKED_JAX_ROWS)


def lora_matmul_blocked_jax(x_MxK: jax.Array, w_KxN: jax.Array, a_KxR: jax.Array,
                            b_RxN: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(x @ w, (x @ a) @ b) for a LoRA linear: the three dots of each row block in one loop body.

  Each dot has the shape it has in `matmul_blocked_jax` ([bm, K] x [K, N], [bm, K] x [K, R],
  [bm, R] x [R, N]), so a row's results still do not depend on M; one loop instead of three
  cuts the per-iteration overhead that dominates small decode steps on CPU. Each product is
  fenced so XLA cannot fuse one dot into the next.
  """
  out_dtype = jnp.result_type(x_MxK, w_KxN)
  w, a, b = (t.astype(out_dtype) for t in (w_KxN, a_KxR, b_RxN))
  dot = lambda u, v: jax.lax.optimization_barrier(
      jnp.dot(u, v, preferred_element_type=jnp.float32).astype(out_dtype))

  def block(x_bmxK):
    return jnp.concatenate([dot(x_bmxK, w), dot(dot(x_bmxK, a), b)], axis=-1)

  both = map_row_blocks(block, x_MxK.astype(out_dtype), BLOCKED_JAX_ROWS)
  N = w_KxN.shape[1]
  return both[:, :N], both[:, N:]
