"""EAGLE-style drafter: one decoder layer over fc([embed(token); feature]).

At position t the drafter reads the token x_t and the target's last-layer hidden state h_{t-1}
(after the final norm: what lm_head consumes) and predicts the feature h_t; the target's own
lm_head turns it into draft logits. The embedding and lm_head are the target's, shared and frozen
(passed in, not owned), so the drafter's parameters are just fc + one layer + a norm. Drafting k
tokens ahead feeds the drafter's own features back in place of h.

The drafter keeps its own KV cache, written at the same slots as the target's. After each plain
decode chunk one drafter forward over the chunk's tokens (and the target features the chunk
stored with them) brings that cache up to date, so speculative decoding can start at any chunk
without re-prefilling anything (`engine._drafter_catch_up`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from tlt_jax.model.transformer import (DecoderLayer, KVCache, Linear, ModelConfig, RMSNorm,
                                       Transformer, causal_mask, init_cache)


def drafter_config(target: ModelConfig) -> ModelConfig:
  """The drafter's layer has the target's widths (its features live in the target's space)."""
  return dataclasses.replace(target, num_layers=1, tie_embeddings=True)


class Drafter(nnx.Module):

  def __init__(self, target_cfg: ModelConfig, rngs: nnx.Rngs):
    cfg = drafter_config(target_cfg)
    D = cfg.hidden_size
    self.cfg = cfg
    self.fc = Linear(2 * D, D, use_bias=True, dtype=cfg.jnp_dtype, rngs=rngs)
    self.layer = DecoderLayer(cfg, rngs)
    self.norm = RMSNorm(D, cfg.rms_eps, cfg.jnp_dtype)

  def __call__(self, target: Transformer, tokens_BxT: jax.Array, features_BxTxD: jax.Array,
               cache: KVCache, write_slot_B: jax.Array,
               positions_BxT: jax.Array | None = None, mask_BxTxS: jax.Array | None = None,
               kv_index_BxTxS: jax.Array | None = None) -> tuple[jax.Array, jax.Array, KVCache]:
    """Returns (draft logits [B,T,V] f32, features [B,T,D], updated cache).

    Tokens are written at slots write_slot..+T-1; mask / kv_index as in `Transformer.__call__`
    (drafting a tree gives each node its path's layout)."""
    B, T = tokens_BxT.shape
    slots_BxT = write_slot_B[:, None] + jnp.arange(T)[None, :]
    if positions_BxT is None:
      positions_BxT = slots_BxT
    emb = target.embed_tokens(tokens_BxT)
    x = self.fc(jnp.concatenate([emb, features_BxTxD.astype(emb.dtype)], axis=-1))
    mask = causal_mask(slots_BxT, cache.num_slots) if mask_BxTxS is None else mask_BxTxS
    x, ck, cv = self.layer(x, positions_BxT, mask, cache.k[0], cache.v[0], write_slot_B,
                           kv_index_BxTxS)
    feature = self.norm(x)
    return target.logits(feature), feature, KVCache((ck,), (cv,))

  def init_cache(self, batch: int, num_slots: int) -> KVCache:
    return init_cache(self.cfg, batch, num_slots)


def check_fits(drafter: Drafter, target_cfg: ModelConfig) -> None:
  """A drafter built for another target fails here, before anything compiles."""
  d = drafter.cfg
  problems = [f"{name}: drafter {getattr(d, name)} != target {getattr(target_cfg, name)}"
              for name in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim")
              if getattr(d, name) != getattr(target_cfg, name)]
  fc_in = drafter.fc.kernel.get_value().shape[0]
  if fc_in != 2 * target_cfg.hidden_size:
    problems.append(f"fc input {fc_in} != 2 x target hidden {2 * target_cfg.hidden_size}")
  if problems:
    raise ValueError("drafter does not fit the target: " + "; ".join(problems))
