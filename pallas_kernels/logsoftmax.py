"""Row-wise log-softmax and token log-probs with a fixed chunk order over the vocabulary.

Three passes over each row in the same chunk order (as Thinking Machines' kernel does): the max,
then sum(exp(x - max)), then x - max - log(sum). One program owns whole rows, so a row's value
does not depend on how many rows share the call. `token_logprobs` reads the logit of the given id
and subtracts the same log-sum-exp: the sampler (one token per row, at decode) and the trainer
(all tokens of a sequence) call this one function, which is what makes their log-probs equal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import default_interpret, out_struct, pad_axis, tree_sum

BLOCK_ROWS = 8
CHUNK = 512


def log_softmax_reference(logits: jax.Array) -> jax.Array:
  return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def token_logprobs_reference(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  logp = log_softmax_reference(logits)
  return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def _row_stats(x_ref, rows: int, padded_vocab: int, chunk: int):
  """(max, log-sum-exp) per row; padded columns hold -inf and contribute exactly nothing."""
  num_chunks = padded_vocab // chunk

  def max_step(c, m_R):
    return jnp.maximum(m_R, jnp.max(x_ref[:, pl.ds(c * chunk, chunk)], axis=1))

  row_max = jax.lax.fori_loop(0, num_chunks, max_step, jnp.full((rows,), -jnp.inf, jnp.float32))

  def sum_step(c, s_R):
    return s_R + jnp.sum(jnp.exp(x_ref[:, pl.ds(c * chunk, chunk)] - row_max[:, None]), axis=1)

  sum_exp = jax.lax.fori_loop(0, num_chunks, sum_step, jnp.zeros((rows,), jnp.float32))
  return row_max, jnp.log(sum_exp)


def _log_softmax_kernel(x_ref, o_ref, *, chunk: int):
  rows, padded_vocab = x_ref.shape
  row_max, log_sum = _row_stats(x_ref, rows, padded_vocab, chunk)

  def out_step(c, carry):
    cols = pl.ds(c * chunk, chunk)
    o_ref[:, cols] = x_ref[:, cols] - row_max[:, None] - log_sum[:, None]
    return carry

  jax.lax.fori_loop(0, padded_vocab // chunk, out_step, 0)


def _token_logprob_kernel(x_ref, tok_ref, o_ref, *, chunk: int):
  rows, padded_vocab = x_ref.shape
  row_max, log_sum = _row_stats(x_ref, rows, padded_vocab, chunk)
  tokens_R = tok_ref[:, 0]

  def pick_step(c, picked_R):
    cols = c * chunk + jax.lax.broadcasted_iota(jnp.int32, (rows, chunk), 1)
    hit = cols == tokens_R[:, None]
    return picked_R + jnp.sum(jnp.where(hit, x_ref[:, pl.ds(c * chunk, chunk)], 0.0), axis=1)

  picked = jax.lax.fori_loop(0, padded_vocab // chunk, pick_step, jnp.zeros((rows,), jnp.float32))
  o_ref[:, 0] = picked - row_max - log_sum


def _rows(logits: jax.Array):
  V = logits.shape[-1]
  chunk = min(CHUNK, V)
  rows = logits.reshape(-1, V).astype(jnp.float32)
  padded = pad_axis(pad_axis(rows, 1, chunk, value=-jnp.inf), 0, BLOCK_ROWS)
  return padded, rows.shape[0], chunk


@functools.partial(jax.jit, static_argnames=("interpret",))
def log_softmax_pallas(logits: jax.Array, *, interpret: bool | None = None) -> jax.Array:
  """log_softmax over the last axis, in f32."""
  if interpret is None:
    interpret = default_interpret()
  x, R, chunk = _rows(logits)
  Rp, Vp = x.shape
  out = pl.pallas_call(
      functools.partial(_log_softmax_kernel, chunk=chunk),
      grid=(Rp // BLOCK_ROWS,),
      in_specs=[pl.BlockSpec((BLOCK_ROWS, Vp), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((BLOCK_ROWS, Vp), lambda i: (i, 0)),
      out_shape=out_struct((Rp, Vp), jnp.float32, x),
      interpret=interpret,
  )(x)
  return out[:R, :logits.shape[-1]].reshape(logits.shape)


@functools.partial(jax.jit, static_argnames=("interpret",))
def token_logprobs_pallas(logits: jax.Array, tokens: jax.Array, *,
                          interpret: bool | None = None) -> jax.Array:
  """log softmax(logits)[token] for each row; `tokens` has the shape of `logits` without V."""
  if interpret is None:
    interpret = default_interpret()
  if tokens.shape != logits.shape[:-1]:
    raise ValueError(f"token_logprobs: tokens {tokens.shape} vs logits {logits.shape}")
  x, R, chunk = _rows(logits)
  Rp, Vp = x.shape
  tok = pad_axis(tokens.reshape(-1, 1).astype(jnp.int32), 0, BLOCK_ROWS)
  out = pl.pallas_call(
      functools.partial(_token_logprob_kernel, chunk=chunk),
      grid=(Rp // BLOCK_ROWS,),
      in_specs=[pl.BlockSpec((BLOCK_ROWS, Vp), lambda i: (i, 0)),
                pl.BlockSpec((BLOCK_ROWS, 1), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((BLOCK_ROWS, 1), lambda i: (i, 0)),
      out_shape=out_struct((Rp, 1), jnp.float32, x, tok),
      interpret=interpret,
  )(x, tok)
  return out[:R, 0].reshape(tokens.shape)


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
