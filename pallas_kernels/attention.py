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

Per backend (each batch-invariant on its own):
- GPU (Triton): a program walks the whole KV axis from global memory; head_dim is padded with
  zeros to a power of 2 (Triton's arrays must be), which adds exact zeros to every q.k.
- TPU (Mosaic): VMEM cannot hold a row's whole cache (32768 keys), so the KV axis is the grid's
  last, sequential axis in blocks of `TPU_KV_BLOCK` (128-lane aligned), with the running
  (max, sum, out) in VMEM scratch: the same online softmax, one block per grid step, in order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import (compiler_params, default_interpret, dot_f32, kernel_layout,
                                   next_pow2, out_struct, pad_axis, round_up, tree_sum, vmem)

KV_SPLIT = 32  # keys per step of the online softmax; KV caches are padded to a multiple of this
BLOCK_Q = 16   # query rows (tokens x query heads of one KV head) per program
TPU_KV_BLOCK = 512  # keys per grid step on TPU (a multiple of the 128 lanes a mask slice needs)
TPU_LANES = 128     # the running max and sum are kept broadcast over one lane-dense row
KV_MULTIPLE = {"cpu": KV_SPLIT, "gpu": KV_SPLIT, "tpu": TPU_KV_BLOCK}


def kv_cache_multiple() -> int:
  """KV caches are sized to a multiple of this for the current target, so the kernel never
  pads (copies) a cache to its KV block."""
  return KV_MULTIPLE[kernel_layout(None, default_interpret())]


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


def _check_shapes(q_BxTxHxD, k_BxSxKxD, mask_BxTxS) -> None:
  B, T, H, _ = q_BxTxHxD.shape
  K = k_BxSxKxD.shape[2]
  if H % K:
    raise ValueError(f"attention: {H} query heads do not group over {K} KV heads")
  if mask_BxTxS.shape != (B, T, k_BxSxKxD.shape[1]):
    raise ValueError(f"attention: mask {mask_BxTxS.shape} != (B, T, S) = "
                     f"{(B, T, k_BxSxKxD.shape[1])}")


def _query_rows(q_BxTxHxD, K: int, mask_BxTxS):
  """Queries as [B, K, T*G, D] rows (t-major, then the G heads sharing a KV head), mask per row."""
  B, T, H, D = q_BxTxHxD.shape
  G = H // K
  q_BxKxRxD = q_BxTxHxD.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, D)
  return q_BxKxRxD, jnp.repeat(mask_BxTxS, G, axis=1)


def _to_rows(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, block_rows: int,
             kv_multiple: int = KV_SPLIT, head_dim_multiple: int = 1):
  """Kernel layout: rows padded to `block_rows`, KV as [B, K, S, D] padded to `kv_multiple`,
  head_dim zero-padded to `head_dim_multiple`."""
  _check_shapes(q_BxTxHxD, k_BxSxKxD, mask_BxTxS)
  q_BxKxRxD, mask_BxRxS = _query_rows(q_BxTxHxD, k_BxSxKxD.shape[2], mask_BxTxS)
  q_BxKxRxD = pad_axis(pad_axis(q_BxKxRxD, 2, block_rows), 3, head_dim_multiple)
  mask_BxRxS = pad_axis(pad_axis(mask_BxRxS, 1, block_rows, False), 2, kv_multiple, False)
  k_BxKxSxD = pad_axis(pad_axis(k_BxSxKxD.transpose(0, 2, 1, 3), 2, kv_multiple), 3,
                       head_dim_multiple)
  v_BxKxSxD = pad_axis(pad_axis(v_BxSxKxD.transpose(0, 2, 1, 3), 2, kv_multiple), 3,
                       head_dim_multiple)
  return q_BxKxRxD, k_BxKxSxD, v_BxKxSxD, mask_BxRxS


def _from_rows(out_BxKxRxD, B, T, H, D):
  K = out_BxKxRxD.shape[1]
  out = out_BxKxRxD[:, :, :T * (H // K), :D].reshape(B, K, T, H // K, D)
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


def _attention_kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, *, scale: float, num_splits: int,
                      causal_group: int):
  rows, D = q_ref.shape
  q_RxD = q_ref[...]
  if causal_group:  # rows are (position, head of the group): stop after the last row's split
    last_position = ((pl.program_id(2) + 1) * rows - 1) // causal_group
    num_splits = jnp.minimum(num_splits, last_position // KV_SPLIT + 1)

  def split_step(j, state):
    cols = pl.ds(pl.multiple_of(j * KV_SPLIT, KV_SPLIT), KV_SPLIT)
    k_CxD = k_ref[cols, :]
    v_CxD = v_ref[cols, :]
    s = dot_f32(q_RxD, k_CxD, ((1,), (1,))) * scale
    s = jnp.where(mask_ref[:, cols] != 0, s, -jnp.inf)
    pv = lambda p: dot_f32(p.astype(v_CxD.dtype), v_CxD)
    return _online_softmax_step(state, s, pv)

  init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, D), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, num_splits, split_step, init)  # noqa: E741 (l: the softmax denominator, as in the flash-attention papers)
  o_ref[...] = _finish(l, acc).astype(o_ref.dtype)


def _widen(x_RxL, width: int):
  """A per-row value kept broadcast over TPU_LANES lanes, as `width` lanes (same values)."""
  if width <= TPU_LANES:
    return x_RxL[:, :width]
  return jnp.tile(x_RxL, (1, width // TPU_LANES))


def _attention_kernel_tpu(q_ref, k_ref, v_ref, mask_ref, o_ref, m_ref, l_ref, acc_ref, *,
                          scale: float, causal_group: int):
  """One (batch row, KV head, query block, KV block) grid step of the online softmax."""
  j = pl.program_id(3)
  rows, D = q_ref.shape
  kv_block = k_ref.shape[0]

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def update():  # `_online_softmax_step`, with (max, sum) broadcast over lanes
    s = dot_f32(q_ref[...], k_ref[...], ((1,), (1,))) * scale
    s = jnp.where(mask_ref[...] != 0, s, -jnp.inf)
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen no key yet
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - _widen(m_safe, kv_block))
    l_ref[...] = l_ref[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
    acc_ref[...] = acc_ref[...] * _widen(alpha, D) + dot_f32(p.astype(v_ref.dtype), v_ref[...])
    m_ref[...] = m_new

  if causal_group:  # blocks past the last row's position hold no visible key: skip them
    last_position = ((pl.program_id(2) + 1) * rows - 1) // causal_group
    pl.when(j * kv_block <= last_position)(update)
  else:
    update()

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    l = l_ref[...]  # noqa: E741 (l: the softmax denominator, as in the flash-attention papers)
    o_ref[...] = (acc_ref[...] / _widen(jnp.where(l == 0.0, 1.0, l), D)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "causal", "interpret", "layout"))
def attention_pallas(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, scale: float,
                     causal: bool = False, *, interpret: bool | None = None,
                     layout: str | None = None) -> jax.Array:
  """GQA attention; `mask` is True where a query may attend a key slot. `causal`: the caller
  promises query t sees no key past index t, so each block stops after its last position's
  split (the splits it skips would leave the running state bitwise unchanged)."""
  if interpret is None:
    interpret = default_interpret()
  layout = kernel_layout(layout, interpret)
  B, T, H, D = q_BxTxHxD.shape
  causal_group = H // k_BxSxKxD.shape[2] if causal else 0
  if layout == "tpu":
    # A head_dim over 128 lanes must be whole lane rows (256 is; 192 would be padded to 256).
    head_dim_multiple = TPU_LANES if D > TPU_LANES else 1
    q, k, v, mask = _to_rows(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, BLOCK_Q,
                             TPU_KV_BLOCK, head_dim_multiple)
    K, Rp, Sp, Dp = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
    out = pl.pallas_call(
        functools.partial(_attention_kernel_tpu, scale=scale, causal_group=causal_group),
        grid=(B, K, Rp // BLOCK_Q, Sp // TPU_KV_BLOCK),
        in_specs=[pl.BlockSpec((None, None, BLOCK_Q, Dp), lambda b, h, i, j: (b, h, i, 0)),
                  pl.BlockSpec((None, None, TPU_KV_BLOCK, Dp), lambda b, h, i, j: (b, h, j, 0)),
                  pl.BlockSpec((None, None, TPU_KV_BLOCK, Dp), lambda b, h, i, j: (b, h, j, 0)),
                  pl.BlockSpec((None, BLOCK_Q, TPU_KV_BLOCK), lambda b, h, i, j: (b, i, j))],
        out_specs=pl.BlockSpec((None, None, BLOCK_Q, Dp), lambda b, h, i, j: (b, h, i, 0)),
        out_shape=out_struct(q.shape, q_BxTxHxD.dtype, q, k, v, mask),
        scratch_shapes=[vmem((BLOCK_Q, TPU_LANES), jnp.float32),
                        vmem((BLOCK_Q, TPU_LANES), jnp.float32),
                        vmem((BLOCK_Q, Dp), jnp.float32)],
        compiler_params=compiler_params(layout, "parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(q, k, v, mask.astype(jnp.int32))
    return _from_rows(out, B, T, H, D)
  # Triton: every array a power of 2, and a dot's dimensions at least 16.
  head_dim_multiple = max(next_pow2(D), 16) if layout == "gpu" else 1
  q, k, v, mask = _to_rows(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, BLOCK_Q, KV_SPLIT,
                           head_dim_multiple)
  K, Rp, Sp, Dp = q.shape[1], q.shape[2], k.shape[2], q.shape[3]
  out = pl.pallas_call(
      functools.partial(_attention_kernel, scale=scale, num_splits=Sp // KV_SPLIT,
                        causal_group=causal_group),
      grid=(B, K, Rp // BLOCK_Q),
      in_specs=[pl.BlockSpec((None, None, BLOCK_Q, Dp), lambda b, h, i: (b, h, i, 0)),
                pl.BlockSpec((None, None, Sp, Dp), lambda b, h, i: (b, h, 0, 0)),
                pl.BlockSpec((None, None, Sp, Dp), lambda b, h, i: (b, h, 0, 0)),
                pl.BlockSpec((None, BLOCK_Q, Sp), lambda b, h, i: (b, i, 0))],
      out_specs=pl.BlockSpec((None, None, BLOCK_Q, Dp), lambda b, h, i: (b, h, i, 0)),
      out_shape=out_struct(q.shape, q_BxTxHxD.dtype, q, k, v, mask),
      compiler_params=compiler_params(layout),
      interpret=interpret,
  )(q, k, v, mask.astype(jnp.int32))
  return _from_rows(out, B, T, H, D)


def attention_blocked_jax(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, scale: float,
                          causal: bool = False) -> jax.Array:
  """`_attention_splits` one query position at a time (a loop over T of the decode shape).

  Every row's result is already independent of the others; the loop is for speed on CPU, where
  the elementwise tree sums over [B, K, T*G, splits, C, D] run out of cache as T grows: looped,
  a 3-token verify is 5x and a 16 x 232 trainer chunk 4x faster (`experiments/bench_forward`).

  causal: the caller promises that query t sees no key past index t (a forward without a
  cache, or a prefill written from slot 0). The queries then go in blocks ending at KV_SPLIT
  x 1, 2, 4, 8, ... positions, each over only the keys up to its end: the splits it skips hold
  no visible key and would add exactly 0, so the bits are those of the full loop. On a 16 x 224
  trainer chunk that is 65% of the work and 9% off the gradient step (blocks of one split each
  would do 57% of it, 12% off, but compile a loop per split: 1.7x the compile time).
  """
  T = q_BxTxHxD.shape[1]
  if T == 1:
    return _attention_splits(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, scale)
  if not causal:
    return _looped_queries(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, scale)
  S = k_BxSxKxD.shape[1]
  outs, start, stop = [], 0, KV_SPLIT
  while start < T:
    stop = min(stop, T)
    keys = min(round_up(stop, KV_SPLIT), S)
    outs.append(_looped_queries(q_BxTxHxD[:, start:stop], k_BxSxKxD[:, :keys],
                                v_BxSxKxD[:, :keys], mask_BxTxS[:, start:stop, :keys], scale))
    start, stop = stop, 2 * stop
  return jnp.concatenate(outs, axis=1)


def _looped_queries(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, scale: float) -> jax.Array:
  _check_shapes(q_BxTxHxD, k_BxSxKxD, mask_BxTxS)
  kv = _split_kv(k_BxSxKxD, v_BxSxKxD)  # once, not once per query
  one = lambda qm: _attend_splits(qm[0][:, None], *kv, qm[1][:, None], scale)
  out_TxBx1xHxD = jax.lax.map(one, (jnp.moveaxis(q_BxTxHxD, 1, 0), jnp.moveaxis(mask_BxTxS, 1, 0)))
  return jnp.moveaxis(out_TxBx1xHxD[:, :, 0], 0, 1)


def _attention_splits(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, scale: float) -> jax.Array:
  """Split-KV attention with fixed splits in pure JAX (the fast path on CPU).

  XLA:CPU picks the loop order of a dot or a `reduce` from the shapes around it, so q.k over the
  same D numbers can round differently with 1 and with 64 query rows. Here every split of
  KV_SPLIT keys is reduced on its own, all splits at once: q.k (over D) and p.v (over the split's
  keys) are elementwise products summed by `tree_sum`, whose order is fixed by construction, and
  each split is normalised by its own max. The splits are then merged in slot order by a
  sequential sum after rescaling to the global max (max is exact in any order). A split with no
  visible key contributes exactly 0, so a longer cache gives the same bits.
  """
  _check_shapes(q_BxTxHxD, k_BxSxKxD, mask_BxTxS)
  return _attend_splits(q_BxTxHxD, *_split_kv(k_BxSxKxD, v_BxSxKxD), mask_BxTxS, scale)


def _split_kv(k_BxSxKxD, v_BxSxKxD):
  """Keys and values in split layouts, materialized, with the summed axis major: keys as
  [D, B, K, 1, n, C] (q.k sums over D), values as [C, B, K, 1, n, D] (p.v sums over a split's
  C keys). Each halving of a tree sum then adds two contiguous blocks."""
  B, _, K, D = k_BxSxKxD.shape
  k = pad_axis(k_BxSxKxD, 1, KV_SPLIT)
  v = pad_axis(v_BxSxKxD, 1, KV_SPLIT)
  n = k.shape[1] // KV_SPLIT
  # [B, n, C, K, D]: split j holds slots j*C .. j*C + C-1.
  k_DxBxKx1xNxC = k.reshape(B, n, KV_SPLIT, K, D).transpose(4, 0, 3, 1, 2)[:, :, :, None]
  v_CxBxKx1xNxD = v.reshape(B, n, KV_SPLIT, K, D).transpose(2, 0, 3, 1, 4)[:, :, :, None]
  return jax.lax.optimization_barrier((k_DxBxKx1xNxC, v_CxBxKx1xNxD))


def _attend_splits(q_BxTxHxD, k_DxBxKx1xNxC, v_CxBxKx1xNxD, mask_BxTxS, scale: float):
  B, T, H, D = q_BxTxHxD.shape
  K, n = k_DxBxKx1xNxC.shape[2], k_DxBxKx1xNxC.shape[4]
  q, mask = _query_rows(q_BxTxHxD, K, mask_BxTxS)
  R = q.shape[2]
  mask = pad_axis(mask, 2, KV_SPLIT, False)
  mask_Bx1xRxNxC = mask.reshape(B, R, n, KV_SPLIT)[:, None]
  q_DxBxKxRx1x1 = jnp.moveaxis(q.astype(jnp.float32), -1, 0)[..., None, None]
  s = tree_sum(q_DxBxKxRx1x1 * k_DxBxKx1xNxC.astype(jnp.float32), axis=0) * scale  # [B,K,R,n,C]
  s = jnp.where(mask_Bx1xRxNxC, s, -jnp.inf)
  m_split = jnp.max(s, axis=-1)                                             # [B, K, R, n]
  m_split_safe = jnp.where(m_split == -jnp.inf, 0.0, m_split)
  p = jnp.exp(s - m_split_safe[..., None])
  l_split = tree_sum(p, axis=-1)                                            # [B, K, R, n]
  p_CxBxKxRxN = jnp.moveaxis(p, -1, 0)
  pv_split = tree_sum(p_CxBxKxRxN[..., None] * v_CxBxKx1xNxD.astype(jnp.float32),
                      axis=0)                                               # [B, K, R, n, D]
  m_all = jnp.max(m_split, axis=-1, keepdims=True)
  weight = jnp.exp(m_split - jnp.where(m_all == -jnp.inf, 0.0, m_all))     # 0 for empty splits
  l_terms = jnp.moveaxis(l_split * weight, -1, 0)
  pv_terms = jnp.moveaxis(pv_split * weight[..., None], -2, 0)

  def merge(carry, terms):  # in slot order; elementwise only, so no shape can reorder it
    return (carry[0] + terms[0], carry[1] + terms[1]), None

  (l, acc), _ = jax.lax.scan(  # noqa: E741 (l: the softmax denominator, as above)
      merge, (jnp.zeros_like(l_terms[0]), jnp.zeros_like(pv_terms[0])), (l_terms, pv_terms))
  return _from_rows(_finish(l, acc).astype(q_BxTxHxD.dtype), B, T, H, D)
