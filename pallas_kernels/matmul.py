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

from pallas_kernels.common import default_interpret, map_row_blocks, out_struct, pad_axis

# (bm, bn, bk) per input dtype: one configuration, used for every shape.
PALLAS_BLOCKS = {
    jnp.dtype(jnp.float32): (32, 128, 128),
    jnp.dtype(jnp.bfloat16): (32, 128, 256),
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
    x_blk = x_ref[:, pl.ds(kb * bk, bk)]
    w_blk = w_ref[pl.ds(kb * bk, bk), :]
    return acc_bmxbn + jnp.dot(x_blk, w_blk, preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, num_k_blocks, k_step, jnp.zeros((bm, bn), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def matmul_pallas(x_MxK: jax.Array, w_KxN: jax.Array, *, interpret: bool | None = None) -> jax.Array:
  """[M, K] @ [K, N] with the fixed tile of `PALLAS_BLOCKS` for the input dtype."""
  if interpret is None:
    interpret = default_interpret()
  M, K = x_MxK.shape
  K2, N = w_KxN.shape
  if K != K2:
    raise ValueError(f"matmul: x is [{M}, {K}] but w is [{K2}, {N}]")
  out_dtype = jnp.result_type(x_MxK, w_KxN)
  bm, bn, bk = PALLAS_BLOCKS[jnp.dtype(out_dtype)]
  x = pad_axis(pad_axis(x_MxK.astype(out_dtype), 0, bm), 1, bk)
  w = pad_axis(pad_axis(w_KxN.astype(out_dtype), 0, bk), 1, bn)
  Mp, Kp = x.shape
  Np = w.shape[1]
  out = pl.pallas_call(
      functools.partial(_matmul_kernel, bk=bk, num_k_blocks=Kp // bk),
      grid=(Mp // bm, Np // bn),
      in_specs=[pl.BlockSpec((bm, Kp), lambda i, j: (i, 0)),
                pl.BlockSpec((Kp, bn), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      out_shape=out_struct((Mp, Np), out_dtype, x, w),
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
  dot = lambda u, v: jax.lax.optimization_barrier(  # noqa: E731
      jnp.dot(u, v, preferred_element_type=jnp.float32).astype(out_dtype))

  def block(x_bmxK):
    return jnp.concatenate([dot(x_bmxK, w), dot(dot(x_bmxK, a), b)], axis=-1)

  both = map_row_blocks(block, x_MxK.astype(out_dtype), BLOCKED_JAX_ROWS)
  N = w_KxN.shape[1]
  return both[:, :N], both[:, N:]
