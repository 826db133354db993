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

from pallas_kernels.common import default_interpret, out_struct, pad_axis, tree_sum

BLOCK_ROWS = 8
CHUNK = 256  # columns per step of the in-order sum of squares


def rms_norm_reference(x: jax.Array, weight_D: jax.Array, eps: float) -> jax.Array:
  x32 = x.astype(jnp.float32)
  variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
  normed = x32 * jax.lax.rsqrt(variance + eps)
  return weight_D.astype(x.dtype) * normed.astype(x.dtype)


def _rms_norm_kernel(x_ref, w_ref, o_ref, *, dim: int, chunk: int, eps: float):
  rows, padded_dim = x_ref.shape

  def chunk_step(c, sum_sq_R):
    x_chunk = x_ref[:, pl.ds(c * chunk, chunk)].astype(jnp.float32)
    return sum_sq_R + jnp.sum(x_chunk * x_chunk, axis=1)

  sum_sq = jax.lax.fori_loop(0, padded_dim // chunk, chunk_step, jnp.zeros((rows,), jnp.float32))
  inv_rms = jax.lax.rsqrt(sum_sq / dim + eps)
  x32 = x_ref[...].astype(jnp.float32)
  normed = (x32 * inv_rms[:, None]).astype(o_ref.dtype)
  o_ref[...] = w_ref[...].astype(o_ref.dtype) * normed


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def rms_norm_pallas(x: jax.Array, weight_D: jax.Array, eps: float, *,
                    interpret: bool | None = None) -> jax.Array:
  """RMSNorm over the last axis; leading axes are flattened into rows."""
  if interpret is None:
    interpret = default_interpret()
  *lead, D = x.shape
  if weight_D.shape != (D,):
    raise ValueError(f"rms_norm: weight shape {weight_D.shape} != ({D},)")
  chunk = min(CHUNK, D)
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
      interpret=interpret,
  )(xp, wp)
  return out[:R, :D].reshape(*lead, D)


def rms_norm_blocked_jax(x: jax.Array, weight_D: jax.Array, eps: float) -> jax.Array:
  """Pure-JAX path: the sum of squares is a `tree_sum`, whose order no shape can change."""
  x32 = x.astype(jnp.float32)
  variance = tree_sum(x32 * x32, axis=-1)[..., None] / x.shape[-1]
  normed = x32 * jax.lax.rsqrt(variance + eps)
  return weight_D.astype(x.dtype) * normed.astype(x.dtype)
