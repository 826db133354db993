"""Counter-based sampling: token t of sample s is
argmax(masked logits / T + Gumbel(key(seed, s, t))).

The noise depends only on (seed, sample id, position), never on the slot, batch or loop step, so
any schedule of the same samples produces the same tokens. Top-k / top-p masks are computed per
row in fixed-shape blocks (row-invariant like the model's kernels); the log-prob of a sampled
token is taken under the same masked, tempered distribution (one definition for sampler and
trainer)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.common import map_row_blocks
from tlt_jax import ops

# Named purposes folded into the key after (seed, sample, position): adding a use of randomness
# never shifts the noise of another.
PURPOSE_TOKEN, PURPOSE_DRAFT, PURPOSE_ACCEPT, PURPOSE_RESAMPLE = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 1.0  # 0 = greedy
  top_k: int = 0            # 0 = off
  top_p: float = 1.0        # 1 = off

  def __post_init__(self):
    if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
      raise ValueError(f"bad sampling params {self}: need temperature >= 0, top_k >= 0, "
                       "0 < top_p <= 1")


def noise_key(seed, sample_id, position, purpose: int = PURPOSE_TOKEN):
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), sample_id), position)
  return key if purpose == PURPOSE_TOKEN else jax.random.fold_in(key, purpose)


def gumbel_noise(seed, sample_id, position, vocab: int, purpose: int = PURPOSE_TOKEN):
  return jax.random.gumbel(noise_key(seed, sample_id, position, purpose), (vocab,), jnp.float32)


def uniform_noise(seed, sample_id, position, purpose: int):
  return jax.random.uniform(noise_key(seed, sample_id, position, purpose), (), jnp.float32)


def _top_p_mask(scaled_RxV: jax.Array, top_p: float) -> jax.Array:
  order = jnp.argsort(-scaled_RxV, axis=-1)
  sorted_logits = jnp.take_along_axis(scaled_RxV, order, axis=-1)
  probs = jnp.exp(sorted_logits - sorted_logits[:, :1])
  probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
  keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p  # the smallest set reaching top_p
  return jnp.zeros_like(keep_sorted).at[jnp.arange(order.shape[0])[:, None], order].set(
      keep_sorted)


def masked_logits(logits_BxV: jax.Array, params: SamplingParams) -> jax.Array:
  """logits / T with -inf outside top-k / top-p (f32). Greedy returns the logits unscaled."""
  x = logits_BxV.astype(jnp.float32)
  if params.temperature == 0.0:
    return x
  x = x / params.temperature
  if params.top_k:
    kth = jax.lax.top_k(x, params.top_k)[0][..., -1:]
    x = jnp.where(x >= kth, x, -jnp.inf)
  if params.top_p < 1.0:
    # Sort, softmax and cumsum pick their loop order by shape: run them on fixed 8-row blocks.
    keep = map_row_blocks(lambda b: _top_p_mask(b, params.top_p), x.reshape(-1, x.shape[-1]), 8)
    x = jnp.where(keep.reshape(x.shape), x, -jnp.inf)
  return x


def sample_from_masked(masked_BxV: jax.Array, seed, sample_ids_B, positions_B, greedy: bool,
                       purpose: int = PURPOSE_TOKEN) -> jax.Array:
  if greedy:
    return jnp.argmax(masked_BxV, axis=-1).astype(jnp.int32)
  V = masked_BxV.shape[-1]
  noise = jax.vmap(lambda s, p: gumbel_noise(seed, s, p, V, purpose))(sample_ids_B, positions_B)
  return jnp.argmax(masked_BxV + noise, axis=-1).astype(jnp.int32)


def sample_and_logprob(logits_BxV: jax.Array, seed, sample_ids_B: jax.Array,
                       positions_B: jax.Array, params: SamplingParams):
  """(token, its log-prob under the masked tempered distribution) for each row."""
  masked = masked_logits(logits_BxV, params)
  tokens = sample_from_masked(masked, seed, sample_ids_B, positions_B, params.temperature == 0.0)
  logp = ops.token_logprobs(masked[:, None], tokens[:, None])[:, 0]
  return tokens, logp


def sample_tokens(logits_BxV: jax.Array, seed, sample_ids_B: jax.Array, positions_B: jax.Array,
                  temperature: float) -> jax.Array:
  """temperature == 0 is greedy (no top-k / top-p)."""
  return sample_and_logprob(logits_BxV, seed, sample_ids_B, positions_B,
                            SamplingParams(temperature=temperature))[0]
