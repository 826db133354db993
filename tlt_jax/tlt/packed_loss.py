"""The EAGLE loss over packed batches (`tlt.buffer.PackedBatch`), with an optional unrolled
"training-time test" for draft depths beyond the first.

Depth 1 (teacher forcing, EAGLE-1): at position t the drafter reads (x_t, h_{t-1}), the target's
own feature, and predicts h_t. Attention stays inside each packed document; RoPE sees true
positions.

Depths 2..k (`DrafterLossConfig.unroll = k`, as EAGLE-3's training-time test): when it drafts,
the drafter reads the target's feature only at the first step of a round; step j reads the
feature it predicted itself at step j-1. Teacher forcing alone never shows it its own errors:
on the arithmetic policy a first draft was accepted 62% of the time, a second one (after an
accepted first) 39%.
Pass j computes depth j at every position at once. Position t reads pass j-1's feature
predicted at t-1, and attends to exactly what the drafter's cache holds when it drafts t at depth
j: pass-1 entries (written with target features) up to t-j+1, then the entries passes 2..j
wrote at t-j+2..t. The passes share one cache, which grows by T slots per pass: pass j writes
block j and attends blocks 1..j, where its mask admits keys (a k x T cache for every pass made
the attention cost grow as k^2: 4.9x one pass's step time at k = 3,
`experiments/bench_drafter_unroll.py`). Pass j's loss is on positions whose chain t-j+1..t lies
in one document's loss positions; the passes are weighted by `unroll_decay ** (j - 1)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from tlt_jax.model.drafter import Drafter
from tlt_jax.model.transformer import KVCache, Transformer
from tlt_jax.tlt.buffer import PackedBatch
from tlt_jax.tlt.drafter_trainer import DrafterLossConfig


def same_document_BxTxT(segment_ids_BxT: jax.Array) -> jax.Array:
  """Whether query t and key s are in one (non-padding) packed document."""
  seg = jnp.asarray(segment_ids_BxT)
  return (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)


def attention_mask_BxTxT(segment_ids_BxT: jax.Array) -> jax.Array:
  """Query t sees key s iff both are in one (non-padding) segment and s <= t."""
  T = jnp.shape(segment_ids_BxT)[1]
  return same_document_BxTxT(segment_ids_BxT) & (jnp.arange(T)[None, :] <=
                                                 jnp.arange(T)[:, None])[None]


def _depth_mask(same_BxTxT: jax.Array, depth: int, passes: int) -> jax.Array:
  """[B, T, passes * T]: what a depth-`depth` draft at t attends in a cache of `passes` blocks
  (module docstring)."""
  T = same_BxTxT.shape[1]
  rel_TxT = jnp.arange(T)[None, :] - jnp.arange(T)[:, None]  # key s - query t
  blocks = [same_BxTxT & (rel_TxT <= 1 - depth)[None]]
  for i in range(2, passes + 1):
    on_chain = (rel_TxT == i - depth)[None] if i <= depth else jnp.zeros((1, T, T), bool)
    blocks.append(same_BxTxT & on_chain)
  return jnp.concatenate(blocks, axis=-1)


def eagle_terms_packed(drafter: Drafter, target: Transformer, batch: PackedBatch, *,
                       features_in_BxTxD: jax.Array | None = None,
                       cache: KVCache | None = None, write_slot: int = 0,
                       mask_BxTxS: jax.Array | None = None) -> dict[str, jax.Array]:
  """Per-token terms of `drafter_trainer.eagle_loss` over a packed batch ([B, T] each), plus the
  drafter's logits, features and cache. Defaults: depth 1 (the batch's own input features, a
  fresh T-slot cache, in-document causal attention); the unrolled passes override them."""
  B, T = batch.tokens_BxT.shape
  hidden = jax.lax.stop_gradient(jnp.asarray(batch.target_hidden_BxTxD).astype(jnp.float32))
  if features_in_BxTxD is None:
    features_in_BxTxD = jnp.asarray(batch.features_in_BxTxD).astype(jnp.float32)
  features_in = jax.lax.stop_gradient(features_in_BxTxD)
  logits, feature, cache = drafter(
      target, jnp.asarray(batch.tokens_BxT), features_in,
      drafter.init_cache(B, T) if cache is None else cache,
      jnp.full((B,), write_slot, jnp.int32), positions_BxT=jnp.asarray(batch.positions_BxT),
      mask_BxTxS=attention_mask_BxTxT(batch.segment_ids_BxT) if mask_BxTxS is None else mask_BxTxS)
  target_logp = jax.lax.stop_gradient(jax.nn.log_softmax(target.logits(hidden), axis=-1))
  draft_logp = jax.nn.log_softmax(logits, axis=-1)
  return {"feature_loss": optax.huber_loss(feature.astype(jnp.float32), hidden).mean(-1),
          "ce_loss": -jnp.sum(jnp.exp(target_logp) * draft_logp, axis=-1),
          "top1_agreement": jnp.argmax(logits, -1) == jnp.argmax(target_logp, -1),
          "logits": logits, "feature": feature, "cache": cache}


def _masked_means(terms: dict, mask_BxT: jax.Array, cfg: DrafterLossConfig) -> dict:
  m = mask_BxT.astype(jnp.float32)
  denom = jnp.maximum(m.sum(), 1.0)
  feat = jnp.sum(terms["feature_loss"] * m) / denom
  ce = jnp.sum(terms["ce_loss"] * m) / denom
  agree = jnp.sum(terms["top1_agreement"] * m) / denom
  loss = cfg.feature_weight * feat + cfg.ce_weight * ce
  return {"loss": loss, "feature_loss": feat, "ce_loss": ce, "top1_agreement": agree}


def unrolled_terms_packed(drafter: Drafter, target: Transformer, batch: PackedBatch,
                          unroll: int) -> list[tuple[dict[str, jax.Array], jax.Array]]:
  """Per draft depth 1..unroll: (`eagle_terms_packed` of that pass, its loss mask [B, T])."""
  if unroll < 1:
    raise ValueError(f"the drafter's loss needs unroll >= 1 draft depths, got {unroll}")
  B, T = batch.tokens_BxT.shape
  loss_mask = jnp.asarray(batch.loss_mask_BxT)
  if unroll == 1:
    return [(eagle_terms_packed(drafter, target, batch), loss_mask)]
  same = same_document_BxTxT(batch.segment_ids_BxT)
  seg = jnp.asarray(batch.segment_ids_BxT)
  follows_in_doc_BxT = jnp.concatenate(  # t-1 is in t's document
      [jnp.zeros((B, 1), bool), (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)], axis=1)
  shift = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
  features_in = jnp.asarray(batch.features_in_BxTxD).astype(jnp.float32)
  cache, valid, passes = drafter.init_cache(B, T), loss_mask, []
  for depth in range(1, unroll + 1):
    if depth > 1:  # a fresh block of T slots for this pass to write
      block = drafter.init_cache(B, T)
      cache = jax.tree.map(lambda c, z: jnp.concatenate([c, z], axis=1), cache, block)
    terms = eagle_terms_packed(drafter, target, batch, features_in_BxTxD=features_in,
                               cache=cache, write_slot=(depth - 1) * T,
                               mask_BxTxS=_depth_mask(same, depth, depth))
    passes.append((terms, valid))
    cache = terms["cache"]
    # The next depth reads this pass's feature from t-1 where that was a trained prediction.
    valid = loss_mask & shift(valid) & follows_in_doc_BxT
    features_in = jnp.where(valid[..., None], shift(terms["feature"].astype(jnp.float32)),
                            features_in)
  return passes


def eagle_loss_packed(drafter: Drafter, target: Transformer, batch: PackedBatch,
                      cfg: DrafterLossConfig = DrafterLossConfig()) -> tuple[jax.Array, dict]:
  """`drafter_trainer.eagle_loss`, term for term, on a packed batch (mean over loss tokens);
  with cfg.unroll > 1, the decay-weighted mean over draft depths 1..unroll. The metrics are
  depth 1's, plus `top1_agreement_depth{j}` for the deeper passes."""
  passes = unrolled_terms_packed(drafter, target, batch, cfg.unroll)
  metrics = _masked_means(*passes[0], cfg)
  if len(passes) == 1:
    return metrics["loss"], metrics
  total, weights = 0.0, 0.0
  for depth, (terms, valid) in enumerate(passes, start=1):
    means = _masked_means(terms, valid, cfg) if depth > 1 else metrics
    w = cfg.unroll_decay ** (depth - 1)
    total, weights = total + w * means["loss"], weights + w
    if depth > 1:
      metrics[f"top1_agreement_depth{depth}"] = means["top1_agreement"]
  metrics["loss"] = total / weights
  return metrics["loss"], metrics
