"""A small generation helper (prefill + KV-cache decode, greedy or sampled) for parity tests and the
demo. The rollout engine (slots, buckets, chunks, speculative decoding) is `tlt_jax.rollout`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax.model.transformer import Transformer, init_cache
from tlt_jax.rollout.sampling import sample_tokens


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature"))
def _generate(graphdef, state, cache, prompt_BxT, lengths_B, sample_ids_B, seed, *,
              max_new_tokens: int, temperature: float):
  model = nnx.merge(graphdef, state)
  B, T = prompt_BxT.shape
  zeros_B = jnp.zeros((B,), jnp.int32)
  out = model(prompt_BxT, cache=cache, write_slot_B=zeros_B)
  last_logits_BxV = jnp.take_along_axis(out.logits_BxTxV, (lengths_B - 1)[:, None, None], 1)[:, 0]
  first = sample_tokens(last_logits_BxV, seed, sample_ids_B, lengths_B, temperature)

  def step(i, carry):
    cache, tok_B, tokens_BxN = carry
    tokens_BxN = tokens_BxN.at[:, i].set(tok_B)
    slot_B = lengths_B + i
    o = model(tok_B[:, None], cache=cache, write_slot_B=slot_B)
    nxt = sample_tokens(o.logits_BxTxV[:, 0], seed, sample_ids_B, slot_B + 1, temperature)
    return o.cache, nxt, tokens_BxN

  tokens = jnp.zeros((B, max_new_tokens), jnp.int32)
  _, _, tokens = jax.lax.fori_loop(0, max_new_tokens, step, (out.cache, first, tokens))
  return tokens


def generate(model: Transformer, prompts: list[list[int]], max_new_tokens: int, *,
             temperature: float = 0.0, seed: int = 0, num_slots: int | None = None) -> np.ndarray:
  """Continues each prompt by `max_new_tokens` tokens (no early stop); returns [B, max_new_tokens].

  Token t of prompt b is sampled with noise keyed by (seed, b, position) only.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("generate needs at least one prompt and no empty prompt")
  lengths = np.array([len(p) for p in prompts], np.int32)
  T = int(lengths.max())
  needed = T + max_new_tokens
  num_slots = num_slots or needed
  if needed > num_slots:
    raise ValueError(f"prompt of {T} tokens + {max_new_tokens} new tokens needs {needed} cache "
                     f"slots, the cache has {num_slots}")
  padded = np.zeros((len(prompts), T), np.int32)
  for i, p in enumerate(prompts):
    padded[i, :len(p)] = p
  graphdef, state = nnx.split(model)
  cache = init_cache(model.cfg, len(prompts), num_slots)
  tokens = _generate(graphdef, state, cache, jnp.asarray(padded), jnp.asarray(lengths),
                     jnp.arange(len(prompts), dtype=jnp.int32), jnp.int32(seed),
                     max_new_tokens=max_new_tokens, temperature=float(temperature))
  return np.asarray(tokens)
