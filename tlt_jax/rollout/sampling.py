"""Counter-based sampling: token t of sample s is argmax(logits / T + Gumbel(key(seed, s, t))).

The noise depends only on (seed, sample id, position), never on the slot, batch or loop step, so
any schedule of the same samples produces the same tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gumbel_noise(seed: jax.Array, sample_id: jax.Array, position: jax.Array, vocab: int):
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), sample_id), position)
  return jax.random.gumbel(key, (vocab,), jnp.float32)


def sample_tokens(logits_BxV: jax.Array, seed, sample_ids_B: jax.Array, positions_B: jax.Array,
                  temperature: float) -> jax.Array:
  """temperature == 0 is greedy."""
  if temperature == 0.0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  V = logits_BxV.shape[-1]
  noise_BxV = jax.vmap(lambda s, p: gumbel_noise(seed, s, p, V))(sample_ids_B, positions_B)
  return jnp.argmax(logits_BxV.astype(jnp.float32) / temperature + noise_BxV, -1).astype(jnp.int32)
