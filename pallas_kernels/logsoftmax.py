"""Row-wise log-softmax and token log-probs with a fixed chunk order over the vocabulary.

Passes over each row in the same chunk order (as Thinking Machines' kernel does): the max, then
sum(exp(x - max)); then, elementwise, x - max - log(sum). One program owns whole rows, so a
row's value does not depend on how many rows share the call. `token_logprobs` reads the logit
of the given id and subtracts the same log-sum-exp: the sampler (one token per row, at decode)
and the trainer (all tokens of a sequence) call this one function, which is what makes their
log-probs equal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import (compiler_params, default_interpret, kernel_layout, next_pow2,
                                   out_struct, pad_axis, tree_sum)

BLOCK_ROWS = 8
CHUNK = 512
STAT_LANES = 128  # a row's statistic is stored broadcast over one lane-dense row


def log_softmax_reference(logits: jax.Array) -> jax.Array:
  return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def token_logprobs_reference(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  logp = log_softmax_reference(logits)
  return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def _row_stats_kernel(x_ref, max_ref, log_sum_ref, *, chunk: int):
  """(max, log sum exp(x - max)) of each row; padded columns hold -inf and contribute nothing.

  The statistics are written broadcast over a 128-lane row: a lane-dense block that Mosaic
  stores as is and Triton as a power-of-2 array (a [rows, 1] column is neither's natural tile).
  """
  rows, padded_vocab = x_ref.shape
  num_chunks = padded_vocab // chunk

  def chunk_of(c):
    return x_ref[:, pl.ds(pl.multiple_of(c * chunk, chunk), chunk)]

  def max_step(c, m_R):
    return jnp.maximum(m_R, jnp.max(chunk_of(c), axis=1))

  row_max = jax.lax.fori_loop(0, num_chunks, max_step, jnp.full((rows,), -jnp.inf, jnp.float32))

  def sum_step(c, s_R):
    return s_R + jnp.sum(jnp.exp(chunk_of(c) - row_max[:, None]), axis=1)

  sum_exp = jax.lax.fori_loop(0, num_chunks, sum_step, jnp.zeros((rows,), jnp.float32))
  max_ref[...] = jnp.broadcast_to(row_max[:, None], max_ref.shape)
  log_sum_ref[...] = jnp.broadcast_to(jnp.log(sum_exp)[:, None], log_sum_ref.shape)


def _rows(logits: jax.Array):
  V = logits.shape[-1]
  chunk = min(CHUNK, next_pow2(V))
  rows = logits.reshape(-1, V).astype(jnp.float32)
  padded = pad_axis(pad_axis(rows, 1, chunk, value=-jnp.inf), 0, BLOCK_ROWS)
  return rows, padded, chunk


def _row_stats(padded_RxV: jax.Array, chunk: int, interpret: bool):
  """[R, 1] max and [R, 1] log-sum-exp of each row, from one kernel pass over the vocabulary.

  The elementwise rest (x - max - log_sum, or its value at one token) is left to XLA: an
  elementwise op has no reduction order to fix, and gathering one logit per row needs no pass
  over the vocabulary.
  """
  Rp, Vp = padded_RxV.shape
  stats = jax.ShapeDtypeStruct((Rp, STAT_LANES), jnp.float32)
  row_max, log_sum = pl.pallas_call(
      functools.partial(_row_stats_kernel, chunk=chunk),
      grid=(Rp // BLOCK_ROWS,),
      in_specs=[pl.BlockSpec((BLOCK_ROWS, Vp), lambda i: (i, 0))],
      out_specs=[pl.BlockSpec((BLOCK_ROWS, STAT_LANES), lambda i: (i, 0))] * 2,
      out_shape=[out_struct(stats.shape, stats.dtype, padded_RxV)] * 2,
      compiler_params=compiler_params(kernel_layout(None, interpret)),
      interpret=interpret,
  )(padded_RxV)
  return row_max[:, :1], log_sum[:, :1]


@functools.partial(jax.jit, static_argnames=("interpret",))
def log_softmax_pallas(logits: jax.Array, *, interpret: bool | None = None) -> jax.Array:
  """log_softmax over the last axis, in f32."""
  if interpret is None:
    interpret = default_interpret()
  rows, padded, chunk = _rows(logits)
  row_max, log_sum = _row_stats(padded, chunk, interpret)
  R = rows.shape[0]
  return (rows - row_max[:R] - log_sum[:R]).reshape(logits.shape)


@functools.partial(jax.jit, static_argnames=("interpret",))
def token_logprobs_pallas(logits: jax.Array, tokens: jax.Array, *,
                          interpret: bool | None = None) -> jax.Array:
  """log softmax(logits)[token] for each row; `tokens` has the shape of `logits` without V."""
  if interpret is None:
    interpret = default_interpret()
  if tokens.shape != logits.shape[:-1]:
    raise ValueError(f"token_logprobs: tokens {tokens.shape} vs logits {logits.shape}")
  rows, padded, chunk = _rows(logits)
  row_max, log_sum = _row_stats(padded, chunk, interpret)
  R = rows.shape[0]
  picked = jnp.take_along_axis(rows, tokens.reshape(-1, 1).astype(jnp.int32), axis=1)
  return (picked - row_max[:R] - log_sum[:R])[:, 0].reshape(tokens.shape)


def _log_sum_exp_blocked(x: jax.Array):
  row_max = jnp.max(x, axis=-1, keepdims=True)  # max is exact in any order
  return row_max, jnp.log(tree_sum(jnp.exp(x - row_max), axis=-1))[..., None]


def log_softmax_blocked_jax(logits: jax.Array) -> jax.Array:
  """Pure-JAX path: sum(exp) is a `tree_sum`, so a row's value never depends on other rows."""
  x = logits.astype(jnp.float32)
  row_max, log_sum = _log_sum_exp_blocked(x)
  return x - row_max - log_sum


def token_logprobs_blocked_jax(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  x = logits.astype(jnp.float32)
  row_max, log_sum = _log_sum_exp_blocked(x)
  picked = jnp.take_along_axis(x, tokens[..., None], axis=-1)
  return (picked - row_max - log_sum)[..., 0]
