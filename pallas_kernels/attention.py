"""Batch- and path-invariant grouped-query attention: online softmax over KV splits of ONE size.

Why: decode kernels split the KV axis to keep the device busy, and a split count (or a split size)
chosen from the batch or the KV length makes the sum over keys depend on them. FlashDecoding with
a fixed *number* of splits is not invariant; a fixed split *size* is (KV length 1000 with size 256
is 256+256+256+232, whatever else runs). Here:
- one program owns a block of `BLOCK_Q` query rows of one (batch row, KV head) and walks the KV
  axis in splits of `KV_SPLIT`, in order, keeping the running max, sum and output in f32;
- the caller writes new keys/values into the KV cache before calling (prefill, decode and verify
  all read keys from the same slots), and the mask says which slots each query sees. Masked and
  padded slots contribute exactly 0, and a split with no visible slot leaves the running state
  bitwise unchanged (alpha = exp(0) = 1), so a longer cache (more splits) gives the same result.
The same kernel serves prefill, one-token decode, multi-token verify and tree masks: they differ
only in the number of query rows and in the mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import default_interpret, pad_axis, tree_sum

KV_SPLIT = 32  # keys per step of the online softmax; KV caches are padded to a multiple of this
BLOCK_Q = 16   # query rows (tokens x query heads of one KV head) per program


def attention_reference(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, scale: float) -> jax.Array:
  """Plain softmax attention in f32 (the independent reference for the kernels)."""
  B, T, H, D = q_BxTxHxD.shape
  K = k_BxSxKxD.shape[2]
  q = q_BxTxHxD.reshape(B, T, K, H // K, D).astype(jnp.float32)
  s = jnp.einsum("btkgd,bskd->bkgts", q, k_BxSxKxD.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST) * scale
  s = jnp.where(mask_BxTxS[:, None, None], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
  out = jnp.einsum("bkgts,bskd->btkgd", p, v_BxSxKxD.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  return out.reshape(B, T, H, D).astype(q_BxTxHxD.dtype)


def _to_rows(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, block_rows: int):
  """Lays queries out as [B, K, T*G, D] rows (t-major, then the G heads sharing a KV head)."""
  B, T, H, D = q_BxTxHxD.shape
  K = k_BxSxKxD.shape[2]
  if H % K:
    raise ValueError(f"attention: {H} query heads do not group over {K} KV heads")
  G = H // K
  if mask_BxTxS.shape != (B, T, k_BxSxKxD.shape[1]):
    raise ValueError(f"attention: mask {mask_BxTxS.shape} != (B, T, S) = "
                     f"{(B, T, k_BxSxKxD.shape[1])}")
  q_BxKxRxD = q_BxTxHxD.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, D)
  mask_BxRxS = jnp.repeat(mask_BxTxS, G, axis=1)
  q_BxKxRxD = pad_axis(q_BxKxRxD, 2, block_rows)
  mask_BxRxS = pad_axis(pad_axis(mask_BxRxS, 1, block_rows, False), 2, KV_SPLIT, False)
  k_BxKxSxD = pad_axis(k_BxSxKxD.transpose(0, 2, 1, 3), 2, KV_SPLIT)
  v_BxKxSxD = pad_axis(v_BxSxKxD.transpose(0, 2, 1, 3), 2, KV_SPLIT)
  return q_BxKxRxD, k_BxKxSxD, v_BxKxSxD, mask_BxRxS, G


def _from_rows(out_BxKxRxD, B, T, H, D):
  K = out_BxKxRxD.shape[1]
  out = out_BxKxRxD[:, :, :T * (H // K)].reshape(B, K, T, H // K, D)
  return out.transpose(0, 2, 1, 3, 4).reshape(B, T, H, D)


def _online_softmax_step(state, s_RxC, v_CxD_dot, row_sum=lambda x: jnp.sum(x, axis=-1)):
  """One KV split: rescale the running (max, sum, out) and add this split's share."""
  m_R, l_R, acc_RxD = state
  m_new = jnp.maximum(m_R, jnp.max(s_RxC, axis=-1))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen no key yet
  alpha = jnp.exp(m_R - m_safe)
  p_RxC = jnp.exp(s_RxC - m_safe[..., None])
  l_new = l_R * alpha + row_sum(p_RxC)
  acc_new = acc_RxD * alpha[..., None] + v_CxD_dot(p_RxC)
  return m_new, l_new, acc_new


def _finish(l_R, acc_RxD):
  return acc_RxD / jnp.where(l_R == 0.0, 1.0, l_R)[..., None]  # rows with no key -> zeros


def _attention_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, *, scale: float, num_splits: int):
  rows, D = q_ref.shape
  q_RxD = q_ref[...]

  def split_step(j, state):
    cols = pl.ds(j * KV_SPLIT, KV_SPLIT)
    k_CxD = k_ref[cols, :]
    v_CxD = v_ref[cols, :]
    s = jax.lax.dot_general(q_RxD, k_CxD, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask_ref[:, cols] != 0, s, -jnp.inf)
    pv = lambda p: jnp.dot(p.astype(v_CxD.dtype), v_CxD, preferred_element_type=jnp.float32)
    return _online_softmax_step(state, s, pv)

  init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, D), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, num_splits, split_step, init)
  o_ref[...] = _finish(l, acc).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def attention_pallas(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, scale: float, *,
                     interpret: bool | None = None) -> jax.Array:
  """GQA attention; `mask` is True where a query may attend a key slot."""
  if interpret is None:
    interpret = default_interpret()
  B, T, H, D = q_BxTxHxD.shape
  q, k, v, mask, _ = _to_rows(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, BLOCK_Q)
  K, Rp, Sp = q.shape[1], q.shape[2], k.shape[2]
  out = pl.pallas_call(
      functools.partial(_attention_kernel, scale=scale, num_splits=Sp // KV_SPLIT),
      grid=(B, K, Rp // BLOCK_Q),
      in_specs=[pl.BlockSpec((None, None, BLOCK_Q, D), lambda b, h, i: (b, h, i, 0)),
                pl.BlockSpec((None, None, Sp, D), lambda b, h, i: (b, h, 0, 0)),
                pl.BlockSpec((None, None, Sp, D), lambda b, h, i: (b, h, 0, 0)),
                pl.BlockSpec((None, BLOCK_Q, Sp), lambda b, h, i: (b, i, 0))],
      out_specs=pl.BlockSpec((None, None, BLOCK_Q, D), lambda b, h, i: (b, h, i, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q_BxTxHxD.dtype),
      interpret=interpret,
  )(q, k, v, mask.astype(jnp.int32))
  return _from_rows(out, B, T, H, D)


def attention_blocked_jax(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, scale: float) -> jax.Array:
  """The same online softmax over fixed KV splits in pure JAX (the fast path on CPU).

  XLA:CPU picks the loop order of a dot or a `reduce` from the shapes around it, so q.k over the
  same D numbers can round differently with 1 and with 64 query rows. Here the splits run in
  order inside one `lax.scan`, and within a split q.k (over D) and p.v (over the KV_SPLIT keys)
  are elementwise products summed by `tree_sum`, whose order is fixed by construction.
  """
  B, T, H, D = q_BxTxHxD.shape
  q, k, v, mask, _ = _to_rows(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, 1)
  K, R, Sp = q.shape[1], q.shape[2], k.shape[2]
  n = Sp // KV_SPLIT
  q32 = q.astype(jnp.float32)
  k_splits = k.reshape(B, K, n, KV_SPLIT, D).transpose(2, 0, 1, 3, 4)
  v_splits = v.reshape(B, K, n, KV_SPLIT, D).transpose(2, 0, 1, 3, 4)
  m_splits = mask.reshape(B, R, n, KV_SPLIT).transpose(2, 0, 1, 3)

  def split_step(state, split):
    # Barriers keep this body one fusion context whether the scan runs once (and is inlined)
    # or loops: XLA:CPU contracts a*b+c into an FMA only inside a fusion.
    state, (k_BxKxCxD, v_BxKxCxD, mask_BxRxC) = jax.lax.optimization_barrier((state, split))
    k32, v32 = k_BxKxCxD.astype(jnp.float32), v_BxKxCxD.astype(jnp.float32)
    s = tree_sum(q32[:, :, :, None, :] * k32[:, :, None, :, :], axis=-1) * scale
    s = jnp.where(mask_BxRxC[:, None], s, -jnp.inf)
    pv = lambda p: tree_sum(p[..., None] * v32[:, :, None, :, :], axis=3)
    return jax.lax.optimization_barrier(_online_softmax_step(state, s, pv, tree_sum)), None

  init = (jnp.full((B, K, R), -jnp.inf, jnp.float32), jnp.zeros((B, K, R), jnp.float32),
          jnp.zeros((B, K, R, D), jnp.float32))
  (_, l, acc), _ = jax.lax.scan(split_step, init, (k_splits, v_splits, m_splits))
  return _from_rows(_finish(l, acc).astype(q_BxTxHxD.dtype), B, T, H, D)
