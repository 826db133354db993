"""The numerics switch: every reducing op of the model goes through this module.

Two modes (`config.numerics`):
- "xla": XLA's own kernels. Fast; results may depend on batch size and on the path (prefill vs
  decode), so sampler and trainer agree only approximately.
- "batch_invariant": the fixed-reduction-order kernels of `pallas_kernels/`. A row's result
  does not depend on its batch, its position in the batch, or the path (prefill, decode, verify,
  trainer forward) that computed it.

Two implementations serve "batch_invariant" (`backend`):
- "pallas": the Pallas kernels (compiled on GPU/TPU, `interpret=True` elsewhere);
- "blocked_jax": the same fixed-shape blocking replayed in pure JAX with `lax.map`, which is
  what runs fast on CPU (interpreted Pallas is 10-20x slower there).
"auto" picks pallas on GPU/TPU and blocked_jax on CPU. Both pass the same contract tests; they are
not bitwise equal to each other, so one run uses one.

The mode is a JAX config state included in the jit cache key: a function traced under one mode
is never reused under the other. LoRA, the drafter and the trainer call the same functions as the
sampler, which is what makes the contracts testable.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax._src import config as jax_config

from pallas_kernels import attention as attention_kernels
from pallas_kernels import common as common_kernels
from pallas_kernels import logsoftmax as logsoftmax_kernels
from pallas_kernels import matmul as matmul_kernels
from pallas_kernels import rmsnorm as rmsnorm_kernels
from tlt_jax import determinism

NUMERICS_MODES = ("xla", "batch_invariant")
BACKENDS = ("auto", "pallas", "blocked_jax")
KV_SPLIT = attention_kernels.KV_SPLIT  # the attention's key split on CPU and GPU
# KV caches are padded to a multiple of this (the attention's KV block on the current target).
kv_cache_multiple = attention_kernels.kv_cache_multiple

_numerics_state = jax_config.enum_state(
    "tlt_numerics", list(NUMERICS_MODES), "xla",
    help="tlt-jax numerics: XLA kernels or batch-invariant kernels.",
    include_in_jit_key=True, include_in_trace_context=True)
_backend_state = jax_config.enum_state(
    "tlt_numerics_backend", list(BACKENDS), "auto",
    help="Implementation of the batch-invariant kernels.",
    include_in_jit_key=True, include_in_trace_context=True)


def _check(mode: str, backend: str) -> None:
  if mode not in NUMERICS_MODES:
    raise ValueError(f"numerics must be one of {NUMERICS_MODES}, got {mode!r}")
  if backend not in BACKENDS:
    raise ValueError(f"numerics backend must be one of {BACKENDS}, got {backend!r}")


def set_numerics(mode: str, backend: str = "auto") -> None:
  """Sets the process-wide mode (from `config.numerics`); see `determinism.configure` for flags."""
  _check(mode, backend)
  if mode == "batch_invariant":
    determinism.check_cpu_flags()
  _numerics_state._set(mode)
  _backend_state._set(backend)


@contextlib.contextmanager
def numerics_mode(mode: str, backend: str = "auto"):
  """Runs a block under another mode (tests and benchmarks compare both in one process)."""
  _check(mode, backend)
  if mode == "batch_invariant":
    determinism.check_cpu_flags()
  with _numerics_state(mode), _backend_state(backend):
    yield


def numerics() -> str:
  return _numerics_state.value


def backend() -> str:
  """The implementation in use: "xla", "pallas" or "blocked_jax"."""
  if _numerics_state.value == "xla":
    return "xla"
  chosen = _backend_state.value
  if chosen == "auto":
    return "pallas" if common_kernels.target_platform() in ("gpu", "tpu") else "blocked_jax"
  return chosen


def _reference_grad(invariant_fn, reference_fn):
  """`invariant_fn` forward, the VJP of the XLA `reference_fn` (recomputed) backward.

  The contracts are about forward values (sampled tokens, log-probs); gradients need no fixed
  reduction order. Differentiating the blocked forward itself would run its sequential block
  loop backward (3-4x slower on CPU), and Pallas calls have no autodiff rule at all."""
  f = jax.custom_vjp(invariant_fn)
  f.defvjp(lambda *args: (invariant_fn(*args), args),
           lambda args, g: jax.vjp(reference_fn, *args)[1](g))
  return f


def _matmul_rows(impl: str):
  kernel = matmul_kernels.matmul_pallas if impl == "pallas" else matmul_kernels.matmul_blocked_jax
  return _reference_grad(kernel, jnp.matmul)


def matmul(x_NxK: jax.Array, w_KxM: jax.Array) -> jax.Array:
  """x @ w over the last axis of x; leading axes of x are flattened into rows."""
  impl = backend()
  if impl == "xla":
    return jnp.matmul(x_NxK, w_KxM)
  *lead, K = x_NxK.shape
  out = _matmul_rows(impl)(x_NxK.reshape(-1, K), w_KxM)
  return out.reshape(*lead, w_KxM.shape[1])


def _lora_reference(x_NxK, w_KxN, a_KxR, b_RxN):
  return jnp.matmul(x_NxK, w_KxN), jnp.matmul(jnp.matmul(x_NxK, a_KxR), b_RxN)


def lora_matmul(x_NxK: jax.Array, w_KxM: jax.Array, a_KxR: jax.Array,
                b_RxM: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(x @ w, (x @ a) @ b): a LoRA linear's base output and its unscaled update.

  What three `matmul` calls compute; on CPU the blocked path runs the three dots of a row block
  in one loop (a third of the loop overhead, which is most of a small decode step). Its bits may
  differ from three separate loops; sampler and trainer both call this, so they agree."""
  impl = backend()
  if impl != "blocked_jax":
    return matmul(x_NxK, w_KxM), matmul(matmul(x_NxK, a_KxR), b_RxM)
  *lead, K = x_NxK.shape
  kernel = _reference_grad(matmul_kernels.lora_matmul_blocked_jax, _lora_reference)
  base, delta = kernel(x_NxK.reshape(-1, K), w_KxM, a_KxR, b_RxM)
  M = w_KxM.shape[1]
  return base.reshape(*lead, M), delta.reshape(*lead, M)


def rms_norm(x: jax.Array, weight_D: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, computed in f32 and cast back (as HF does)."""
  impl = backend()
  reference = functools.partial(rmsnorm_kernels.rms_norm_reference, eps=eps)
  if impl == "xla":
    return reference(x, weight_D)
  kernel = (rmsnorm_kernels.rms_norm_pallas if impl == "pallas"
            else rmsnorm_kernels.rms_norm_blocked_jax)
  return _reference_grad(functools.partial(kernel, eps=eps), reference)(x, weight_D)


def attention(q_BxTxHxD: jax.Array, k_BxSxKxD: jax.Array, v_BxSxKxD: jax.Array,
              mask_BxTxS: jax.Array, scale: float, causal: bool = False) -> jax.Array:
  """Grouped-query attention; `mask` is True where a query may attend a key.

  H query heads share K key/value heads (H % K == 0). Scores and softmax are computed in f32.
  Rows with no visible key (padding) produce zeros rather than NaN. `causal=True` is a promise
  that query t sees no key past index t (the mask still decides): the batch-invariant kernels
  then skip the key splits no query of a block can see, with the same bits.
  """
  impl = backend()
  reference = functools.partial(_attention_xla, scale=scale)
  if impl == "xla":
    return reference(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS)
  kernel = (attention_kernels.attention_pallas if impl == "pallas"
            else attention_kernels.attention_blocked_jax)
  return _reference_grad(functools.partial(kernel, scale=scale, causal=causal), reference)(
      q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS)


def _attention_xla(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, scale: float):
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
  """log_softmax over the last axis, in f32."""
  impl = backend()
  reference = logsoftmax_kernels.log_softmax_reference
  if impl == "xla":
    return reference(logits)
  kernel = (logsoftmax_kernels.log_softmax_pallas if impl == "pallas"
            else logsoftmax_kernels.log_softmax_blocked_jax)
  return _reference_grad(kernel, reference)(logits)


def token_logprobs(logits_BxTxV: jax.Array, tokens_BxT: jax.Array,
                   temperature: float = 1.0) -> jax.Array:
  """log p(token) under softmax(logits / temperature); the one definition sampler and trainer
  share."""
  scaled = logits_BxTxV.astype(jnp.float32) / temperature
  impl = backend()
  reference = logsoftmax_kernels.token_logprobs_reference
  if impl == "xla":
    return reference(scaled, tokens_BxT)
  kernel = (logsoftmax_kernels.token_logprobs_pallas if impl == "pallas"
            else logsoftmax_kernels.token_logprobs_blocked_jax)
  return _reference_grad(kernel, reference)(scaled, tokens_BxT)
