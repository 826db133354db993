"""The numerics switch: every reducing op of the model goes through this module.

Two modes, chosen once per process with `set_numerics` (from `config.numerics`):
- "xla": XLA's own kernels. Fast; results may depend on batch size and on the path (prefill vs
  decode), so sampler and trainer agree only approximately.
- "batch_invariant": fixed-reduction-order kernels (see `pallas_kernels/`). Not yet wired: the
  batch-invariant kernels plug in here, and nothing else in the model changes.

Keeping the switch in one place is what makes the contracts testable: LoRA, the drafter and the
trainer call the same functions as the sampler.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NUMERICS_MODES = ("xla", "batch_invariant")
_numerics = "xla"


def set_numerics(mode: str) -> None:
  if mode not in NUMERICS_MODES:
    raise ValueError(f"numerics must be one of {NUMERICS_MODES}, got {mode!r}")
  if mode == "batch_invariant":
    raise NotImplementedError(
        "numerics='batch_invariant' needs the kernels of pallas_kernels/ (not built yet); "
        "use numerics='xla'")
  global _numerics
  _numerics = mode


def numerics() -> str:
  return _numerics


def matmul(x_NxK: jax.Array, w_KxM: jax.Array) -> jax.Array:
  """x @ w over the last axis of x; leading axes of x are flattened into rows."""
  return jnp.matmul(x_NxK, w_KxM)


def rms_norm(x: jax.Array, weight_D: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, computed in f32 and cast back (as HF does)."""
  x32 = x.astype(jnp.float32)
  variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
  normed = x32 * jax.lax.rsqrt(variance + eps)
  return weight_D.astype(x.dtype) * normed.astype(x.dtype)


def attention(q_BxTxHxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array,
              mask_BxTxS: jax.Array, scale: float) -> jax.Array:
  """Grouped-query attention; `mask` is True where a query may attend a key.

  H query heads share K key/value heads (H % K == 0). Scores and softmax are computed in f32.
  Rows with no visible key (padding) produce zeros rather than NaN.
  """
  B, T, H, D = q_BxTxHxD.shape
  K = k_BxSxKxD.shape[2]
  q_BxTxKxGxD = q_BxTxHxD.reshape(B, T, K, H // K, D)
  scores_BxKxGxTxS = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD,
                                preferred_element_type=jnp.float32) * scale
  mask_Bx1x1xTxS = mask_BxTxS[:, None, None, :, :]
  scores_BxKxGxTxS = jnp.where(mask_Bx1x1xTxS, scores_BxKxGxTxS, -jnp.inf)
  row_max = jnp.max(scores_BxKxGxTxS, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  probs = jnp.exp(scores_BxKxGxTxS - row_max)
  probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)
  out_BxTxKxGxD = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v_BxSxKxD.dtype), v_BxSxKxD)
  return out_BxTxKxGxD.reshape(B, T, H, D)


def log_softmax(logits: jax.Array) -> jax.Array:
  return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def token_logprobs(logits_BxTxV: jax.Array, tokens_BxT: jax.Array,
                   temperature: float = 1.0) -> jax.Array:
  """log p(token) under softmax(logits / temperature); the one definition sampler and trainer share."""
  logp = log_softmax(logits_BxTxV.astype(jnp.float32) / temperature)
  return jnp.take_along_axis(logp, tokens_BxT[..., None], axis=-1)[..., 0]
