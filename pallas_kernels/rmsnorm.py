"""Row-wise RMSNorm with a fixed chunk order over the hidden dimension.

Why: a reduction kernel that picks its block size (or splits a row over several programs) from
the number of rows makes a token's norm depend on how many tokens share the call (vLLM had to pin
theirs). Here one program owns `block_rows` whole rows and sums x^2 over D in chunks of
`CHUNK` in order, in f32. The statistics and the scaling follow HF: f32 inside, cast back to the
input dtype before the weight multiply.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import (compiler_params, default_interpret, kernel_layout, next_pow2,
                                   out_struct, pad_axis, tree_sum)

BLOCK_ROWS = 8
CHUNK = 256  # columns per step of the in-order sum of squares


def rms_norm_reference(x: jax.Array, weight_D: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
  normed = x32 * jax.lax.rsqrt(variance + eps)
  return weight_D.astype(x.dtype) * normed.astype(x.dtype)


def _rms_norm_kernel(x_ref, w_ref, o_ref, *, dim: int, chunk: int, eps: float):
  rows, padded_dim = x_ref.shape
  num_chunks = padded_dim // chunk

  def chunk_step(c, sum_sq_R):
    x_chunk = x_ref[:, pl.ds(pl.multiple_of(c * chunk, chunk), chunk)].astype(jnp.float32)
    return sum_sq_R + jnp.sum(x_chunk * x_chunk, axis=1)

  sum_sq = jax.lax.fori_loop(0, num_chunks, chunk_step, jnp.zeros((rows,), jnp.float32))
  inv_rms = jax.lax.rsqrt(sum_sq / dim + eps)

  # The scaling goes chunk by chunk too: Triton loads only power-of-2 arrays, and a whole row
  # of 3584 or 5120 is not one. Each element is computed as it would be from the whole row.
  def scale_step(c, carry):
    cols = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
    normed = (x_ref[:, cols].astype(jnp.float32) * inv_rms[:, None]).astype(o_ref.dtype)
    o_ref[:, cols] = w_ref[:, cols].astype(o_ref.dtype) * normed
    return carry

  jax.lax.fori_loop(0, num_chunks, scale_step, 0)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "layout"))
def rms_norm_pallas(x: jax.Array, weight_D: jax.Array, eps: float, *,
                    interpret: bool | None = None, layout: str | None = None) -> jax.Array:
  """RMSNorm over the last axis; leading axes are flattened into rows."""
  if interpret is None:
    interpret = default_interpret()
  layout = kernel_layout(layout, interpret)
  *lead, D = x.shape
  if weight_D.shape != (D,):
    raise ValueError(f"rms_norm: weight shape {weight_D.shape} != ({D},)")
  # Triton: the chunk must be a power of 2 (a head_dim-24 q/k norm gets a 32 chunk, zero pad).
  chunk = min(CHUNK, next_pow2(D) if layout == "gpu" else D)
  rows = x.reshape(-1, D)
  R = rows.shape[0]
  xp = pad_axis(pad_axis(rows, 0, BLOCK_ROWS), 1, chunk)  # zero columns add 0 to the sum
  Rp, Dp = xp.shape
  wp = pad_axis(weight_D, 0, chunk)[None, :]
  out = pl.pallas_call(
      functools.partial(_rms_norm_kernel, dim=D, chunk=chunk, eps=eps),
      grid=(Rp // BLOCK_ROWS,),
      in_specs=[pl.BlockSpec((BLOCK_ROWS, Dp), lambda i: (i, 0)),
                pl.BlockSpec((1, Dp), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((BLOCK_ROWS, Dp), lambda i: (i, 0)),
      out_shape=out_struct((Rp, Dp), x.dtype, xp, wp),
      compiler_params=compiler_params(layout),
      interpret=interpret,
  )(xp, wp)
  return out[:R, :D].reshape(*lead, D)


def rms_norm_blocked_jax(x: jax.Array, weight_D: jax.Array, eps: float) -> jax.Array:
  """Pure-JAX path: the sum of squares is a `tree_sum`, whose order no shape can change."""
  x32 = x.astype(jnp.float32)
  variance = tree_sum(x32 * x32, axis=-1)[..., None] / x.shape[-1]
  normed = x32 * jax.lax.rsqrt(variance + eps)
  return weight_D.astype(x.dtype) * normed.astype(x.dtype)
