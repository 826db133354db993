"""Rollout engine: slots padded to batch buckets, on-device decode chunks, continuous batching,
compaction into smaller buckets, and chain / tree speculative decoding with an EAGLE-style
drafter.

One rollout, as the host sees it:
  pending samples -> prefill into free slots -> decode chunk (N steps on device, plain or SD)
  -> read the done flags -> collect finished samples, refill free slots from pending
  -> when nothing is pending and the live rows fit a smaller bucket, compact into it -> repeat.

Every device program is built ahead of time per (phase, bucket, strategy) by `ProgramPool` and
called as a compiled executable, so nothing compiles inside a timed rollout after `warm_up`.

Exactness (with `numerics="batch_invariant"`): the slot a sample occupies, the bucket, the
chunk size, the refill order and compaction change none of its tokens or log-probs, and `gumbel`
verification emits exactly the tokens plain decode would: a drafted token is accepted iff it
equals the target's own Gumbel-argmax at that position, and the target's token is emitted at
the first mismatch. In a tree, each node attends its own path laid out at the slots plain
decoding would use (`kv_index`), and the accepted path's KV is moved to consecutive slots.
`rejection` verification (chains) is classic speculative sampling (exact in distribution only).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels.common import round_up
from tlt_jax import ops
from tlt_jax import tensor_parallel as tp
from tlt_jax.model.drafter import Drafter, check_fits
from tlt_jax.model.transformer import KVCache, Transformer, init_cache
from tlt_jax.rollout import sampling
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.tuner import OFF, Arm, Tuner, default_arms

VERIFICATION_MODES = ("gumbel", "rejection")
DRAFTER_NUMERICS = ("xla", "policy")
_TP_AXIS = "model"  # a tensor-parallel engine's devices, the axis its layers are split over
_TP_WHERE = "devices per rollout group"  # how errors name that axis's size


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
  max_prompt_len: int = 32
  max_new_tokens: int = 64
  chunk_steps: int = 8            # decode steps (or SD rounds) per host round trip
  sampling: SamplingParams = SamplingParams()
  eos_ids: tuple[int, ...] = ()
  verification: str = "gumbel"
  arms: tuple[Arm, ...] = default_arms()
  compaction: bool = True
  max_verify_tokens_per_bucket: int = 1024
  stop_strings: tuple[str, ...] = ()  # checked on the host after each chunk (needs detokenize)
  # JAX's persistent compilation cache: a restarted run loads its program pool instead of
  # compiling it ("" = off).
  compilation_cache_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "tlt-jax", "xla")
  seed: int = 0
  # The drafter only proposes: gumbel verification emits the target's own samples, and
  # rejection sampling is exact in distribution for any proposal. So it may run on XLA's fast
  # kernels whatever the target's numerics ("policy" = the target's own mode).
  drafter_numerics: str = "xla"

  def __post_init__(self):
    if self.verification not in VERIFICATION_MODES:
      raise ValueError(f"verification must be one of {VERIFICATION_MODES}")
    if self.drafter_numerics not in DRAFTER_NUMERICS:
      raise ValueError(f"drafter_numerics must be one of {DRAFTER_NUMERICS}, "
                       f"got {self.drafter_numerics!r}")
    if list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
      raise ValueError(f"buckets must be increasing positive sizes, got {self.buckets}")
    if self.max_prompt_len < 1 or self.max_new_tokens < 1 or self.chunk_steps < 1:
      raise ValueError("max_prompt_len, max_new_tokens and chunk_steps must be >= 1")
    if self.verification == "rejection" and any(a.is_tree for a in self.arms):
      raise ValueError("tree arms support verification='gumbel' only")

  @property
  def max_depth(self) -> int:
    return max(a.depth for a in self.arms)

  @property
  def num_slots(self) -> int:
    """Prompt + response + one draft/verify window (or, with SD arms, the drafter's catch-up
    window of `chunk_steps` tokens if wider), padded to the attention's KV split size."""
    window = max(a.draft_slots for a in self.arms)
    if self.max_depth:
      window = max(window, self.chunk_steps)
    return round_up(self.max_prompt_len + self.max_new_tokens + window,
                    ops.kv_cache_multiple())


class Slots(NamedTuple):
  """Device state of one bucket: row r is one sample (or free when live[r] is False)."""
  cache: KVCache
  draft_cache: KVCache | None
  token: jax.Array        # [B] last emitted token, not yet fed to the target
  pos: jax.Array          # [B] cache slot (= position) where `token` goes
  prev_hidden: jax.Array  # [B, D] target hidden state at pos - 1 (the drafter's input feature)
  sample_id: jax.Array    # [B]
  gen: jax.Array          # [B] tokens emitted so far
  max_new: jax.Array      # [B]
  done: jax.Array         # [B] bool
  live: jax.Array         # [B] bool
  out_tokens: jax.Array   # [B, N]
  out_logprobs: jax.Array  # [B, N]
  out_hidden: jax.Array   # [B, N, D] hidden state whose logits produced each emitted token


@dataclasses.dataclass
class Sample:
  sample_id: int
  prompt: list[int]
  tokens: np.ndarray
  logprobs: np.ndarray
  finish_reason: str          # "eos" | "stop" | "length"
  hidden: jax.Array           # [max_new_tokens, D] on device; rows [:len(tokens)] are valid


@dataclasses.dataclass
class ChunkTrace:
  start_s: float
  seconds: float
  bucket: int
  live: int
  arm: str
  emitted: int
  rounds: int

  @property
  def accept_len(self) -> float:
    """Tokens emitted per live row per decode round (1.0 for plain decode)."""
    return self.emitted / max(self.live * self.rounds, 1)


# ---------------------------------------------------------------------------------------------
# Device programs (pure functions of (params, state); jitted and compiled by ProgramPool)


def _write_rows(buf, rows_B, cols_B, values, valid_B):
  """buf[b, cols[b]] = values[b] where valid[b] (columns out of range are dropped)."""
  cols = jnp.where(valid_B, cols_B, buf.shape[1])
  return buf.at[rows_B, cols].set(values.astype(buf.dtype), mode="drop")


def _draft_features_for_prompt(hidden_BxTxD):
  """Zeros: the drafter's prompt entries see the prompt's tokens but not its features, as in
  training (`tlt.buffer` keeps only the response's hidden states). Feeding the real features
  here instead shifts every key the drafter attends over the prompt away from what it learned:
  on the arithmetic policy, chain4's accept length was 2.84 with them and 3.24 without."""
  return jnp.zeros_like(hidden_BxTxD)


def _prefill(target, drafter, cfg: EngineConfig, prompts_BxP, lengths_B, sample_ids_B, max_new_B,
             seed) -> Slots:
  B, _ = prompts_BxP.shape
  zeros_B = jnp.zeros((B,), jnp.int32)
  out = target(prompts_BxP, cache=init_cache(target.cfg, B, cfg.num_slots), write_slot_B=zeros_B)
  last = lengths_B - 1
  rows = jnp.arange(B)
  logits_BxV = out.logits_BxTxV[rows, last]
  hidden_BxD = out.hidden_BxTxD[rows, last]
  token, logp = sampling.sample_and_logprob(logits_BxV, seed, sample_ids_B, lengths_B, cfg.sampling)
  draft_cache = None
  if drafter is not None:
    _, _, draft_cache = drafter(target, prompts_BxP, _draft_features_for_prompt(out.hidden_BxTxD),
                                drafter.init_cache(B, cfg.num_slots), zeros_B)
  N, D = cfg.max_new_tokens, target.cfg.hidden_size
  done = _is_eos(token, cfg) | (max_new_B <= 1)
  return Slots(
      cache=out.cache, draft_cache=draft_cache, token=token, pos=lengths_B, prev_hidden=hidden_BxD,
      sample_id=sample_ids_B, gen=jnp.ones((B,), jnp.int32), max_new=max_new_B, done=done,
      live=jnp.ones((B,), bool),
      out_tokens=jnp.zeros((B, N), jnp.int32).at[:, 0].set(token),
      out_logprobs=jnp.zeros((B, N), jnp.float32).at[:, 0].set(logp),
      out_hidden=jnp.zeros((B, N, D), hidden_BxD.dtype).at[:, 0].set(hidden_BxD))


def _is_eos(token_B, cfg: EngineConfig):
  if not cfg.eos_ids:
    return jnp.zeros(token_B.shape, bool)
  return jnp.isin(token_B, jnp.asarray(cfg.eos_ids, jnp.int32))


def _plain_step(target, cfg: EngineConfig, s: Slots, seed) -> tuple[Slots, jax.Array]:
  active = s.live & ~s.done
  out = target(s.token[:, None], cache=s.cache, write_slot_B=s.pos)
  hidden = out.hidden_BxTxD[:, 0]
  token, logp = sampling.sample_and_logprob(out.logits_BxTxV[:, 0], seed, s.sample_id, s.pos + 1,
                                            cfg.sampling)
  rows = jnp.arange(token.shape[0])
  gen = s.gen + active
  done = s.done | (active & (_is_eos(token, cfg) | (gen >= s.max_new)))
  s = s._replace(
      cache=out.cache, token=jnp.where(active, token, s.token), pos=s.pos + active,
      prev_hidden=jnp.where(active[:, None], hidden, s.prev_hidden), gen=gen, done=done,
      out_tokens=_write_rows(s.out_tokens, rows, s.gen, token, active),
      out_logprobs=_write_rows(s.out_logprobs, rows, s.gen, logp, active),
      out_hidden=_write_rows(s.out_hidden, rows, s.gen, hidden, active))
  return s, jnp.sum(active)


def _probs(masked_BxV):
  return jax.nn.softmax(masked_BxV, axis=-1)


def _sd_step(target, drafter, cfg: EngineConfig, depth: int, s: Slots, seed):
  """One chain round: draft `depth` tokens, verify them in one target forward, commit."""
  B = s.token.shape[0]
  greedy = cfg.sampling.temperature == 0.0
  purpose = sampling.PURPOSE_TOKEN if cfg.verification == "gumbel" else sampling.PURPOSE_DRAFT
  # Draft: the first step reads the target's feature, later ones the drafter's own.
  tok, feat, draft_cache = s.token, s.prev_hidden, s.draft_cache
  drafts, draft_masked = [], []
  for j in range(depth):
    dlogits, dfeat, draft_cache = drafter(target, tok[:, None], feat[:, None], draft_cache, s.pos + j)
    masked = sampling.masked_logits(dlogits[:, 0], cfg.sampling)
    tok = sampling.sample_from_masked(masked, seed, s.sample_id, s.pos + j + 1, greedy, purpose)
    feat = dfeat[:, 0]
    drafts.append(tok)
    draft_masked.append(masked)
  drafts_BxK = jnp.stack(drafts, axis=1)
  # Verify: the target sees [token, d_1..d_k] at slots pos..pos+k (the cache is written first).
  out = target(jnp.concatenate([s.token[:, None], drafts_BxK], axis=1), cache=s.cache,
               write_slot_B=s.pos)
  K1 = depth + 1
  positions_BxK1 = s.pos[:, None] + 1 + jnp.arange(K1)[None, :]
  target_masked = sampling.masked_logits(out.logits_BxTxV.reshape(B * K1, -1), cfg.sampling)
  target_tok = sampling.sample_from_masked(
      target_masked, seed, jnp.repeat(s.sample_id, K1), positions_BxK1.reshape(-1), greedy
  ).reshape(B, K1)
  # At T = 0 the target and the draft distributions are one-hot at their argmax, and speculative
  # sampling is exactly this rule (accept iff the draft is the target's greedy token).
  if cfg.verification == "gumbel" or greedy:
    accept_BxK = drafts_BxK == target_tok[:, :depth]
    emitted = target_tok  # at and before the first mismatch these are the tokens emitted
  else:
    emitted, accept_BxK = _rejection_emit(s, seed, depth, drafts_BxK, draft_masked,
                                          target_masked.reshape(B, K1, -1), target_tok)
  accepted = jnp.sum(jnp.cumprod(accept_BxK.astype(jnp.int32), axis=1), axis=1)  # [B] 0..depth
  logits_BxK1xV = target_masked.reshape(B, K1, -1)
  return _commit(target, drafter, cfg, s, out.cache, draft_cache, emitted, accepted,
                 logits_BxK1xV, out.hidden_BxTxD)


def _commit(target, drafter, cfg, s: Slots, cache, draft_cache, emitted_BxK1, accepted_B,
            masked_logits_BxK1xV, hidden_BxK1xD):
  """Emits tokens 0..accepted of `emitted` (cut at EOS and max_new) and advances the slots.

  emitted[:, i] is the i-th token after the current one; its logits and hidden state are row i
  of masked_logits / hidden (the target's output at the i-th node of the accepted path).
  """
  B, K1 = emitted_BxK1.shape
  depth = K1 - 1
  rows = jnp.arange(B)
  active = s.live & ~s.done
  n_emit = accepted_B + 1
  eos_BxK1 = _is_eos(emitted_BxK1.reshape(-1), cfg).reshape(B, K1)
  first_eos = jnp.where(eos_BxK1.any(axis=1), jnp.argmax(eos_BxK1, axis=1) + 1, K1 + 1)
  n_emit = jnp.minimum(jnp.minimum(n_emit, first_eos), s.max_new - s.gen)
  n_emit = jnp.where(active, n_emit, 0)
  logp = ops.token_logprobs(masked_logits_BxK1xV, emitted_BxK1)
  out_tokens, out_logprobs, out_hidden = s.out_tokens, s.out_logprobs, s.out_hidden
  for i in range(K1):
    valid = i < n_emit
    out_tokens = _write_rows(out_tokens, rows, s.gen + i, emitted_BxK1[:, i], valid)
    out_logprobs = _write_rows(out_logprobs, rows, s.gen + i, logp[:, i], valid)
    out_hidden = _write_rows(out_hidden, rows, s.gen + i, hidden_BxK1xD[:, i], valid)
  last = jnp.maximum(n_emit - 1, 0)
  gen = s.gen + n_emit
  done = s.done | (active & ((first_eos <= n_emit) | (gen >= s.max_new)))
  # Re-run the drafter on the committed tokens with the target's features (EAGLE's "extend"):
  # slots pos+1.. get the entries plain decode would have written.
  _, _, draft_cache = drafter(target, emitted_BxK1[:, :depth], hidden_BxK1xD[:, :depth],
                              draft_cache, s.pos + 1)
  moved = n_emit > 0
  s = s._replace(
      cache=cache, draft_cache=draft_cache,
      token=jnp.where(moved, emitted_BxK1[rows, last], s.token), pos=s.pos + n_emit,
      prev_hidden=jnp.where(moved[:, None], hidden_BxK1xD[rows, last], s.prev_hidden),
      gen=gen, done=done, out_tokens=out_tokens, out_logprobs=out_logprobs, out_hidden=out_hidden)
  return s, jnp.sum(n_emit)


def _path_layout(pos_B, ancestors_BxTxA, depth_BxT, num_slots):
  """Per-query cache layout for tree nodes: virtual slot pos+j holds the node's ancestor at
  depth j (physical slot pos + ancestor index); slots before pos are the shared prefix."""
  v = jnp.arange(num_slots)[None, None, :]
  rel = v - pos_B[:, None, None]                                  # [B, 1, S]
  A = ancestors_BxTxA.shape[-1]
  anc = jnp.take_along_axis(ancestors_BxTxA, jnp.clip(rel, 0, A - 1), axis=-1)  # [B, T, S]
  on_path = (rel >= 0) & (rel <= depth_BxT[..., None])
  kv_index = jnp.where(on_path, pos_B[:, None, None] + anc, v)
  mask = (rel < 0) | on_path
  return kv_index, mask


def _tree_step(target, drafter, cfg: EngineConfig, arm: Arm, s: Slots, seed):
  """One tree round (gumbel verification): draft a tree level by level (beam of top-k nodes,
  each node's top-k children under the depth's Gumbel noise), verify the `verify` best nodes
  in one target forward where every node sees exactly its path (bitwise plain decoding),
  walk the accepted path, move its KV to consecutive slots, emit it plus the bonus token."""
  B = s.token.shape[0]
  rows = jnp.arange(B)
  d, k, n = arm.depth, arm.topk, arm.verify
  M = 1 + d * k
  S = s.cache.num_slots
  greedy = cfg.sampling.temperature == 0.0
  node_tok = jnp.zeros((B, M), jnp.int32).at[:, 0].set(s.token)
  node_parent = jnp.full((B, M), -1, jnp.int32)
  node_depth = jnp.zeros((B, M), jnp.int32)
  node_score = jnp.zeros((B, M), jnp.float32)
  node_anc = jnp.zeros((B, M, d + 1), jnp.int32)
  dlogits, dfeat, draft_cache = drafter(target, s.token[:, None], s.prev_hidden[:, None],
                                        s.draft_cache, s.pos)
  beam_idx = jnp.zeros((B, 1), jnp.int32)
  beam_score = jnp.zeros((B, 1), jnp.float32)
  for level in range(1, d + 1):
    W = beam_idx.shape[1]
    V = dlogits.shape[-1]
    masked = sampling.masked_logits(dlogits.reshape(B * W, V), cfg.sampling).reshape(B, W, V)
    logq = jax.nn.log_softmax(masked, axis=-1)
    if greedy:
      perturbed = masked
    else:
      noise = jax.vmap(lambda sid, p: sampling.gumbel_noise(seed, sid, p, V))(
          s.sample_id, s.pos + level)
      perturbed = masked + noise[:, None, :]
    _, cand_tok = jax.lax.top_k(perturbed, k)                            # [B, W, k]
    cand_score = beam_score[..., None] + jnp.take_along_axis(logq, cand_tok, axis=-1)
    new_score, pick = jax.lax.top_k(cand_score.reshape(B, W * k), k)     # [B, k]
    parent_local = pick // k
    new_tok = jnp.take_along_axis(cand_tok.reshape(B, W * k), pick, axis=1)
    parent = jnp.take_along_axis(beam_idx, parent_local, axis=1)
    new_idx = 1 + (level - 1) * k + jnp.arange(k)
    node_tok = node_tok.at[:, new_idx].set(new_tok)
    node_parent = node_parent.at[:, new_idx].set(parent)
    node_depth = node_depth.at[:, new_idx].set(level)
    node_score = node_score.at[:, new_idx].set(new_score)
    anc = jnp.take_along_axis(node_anc, parent[..., None], axis=1).at[..., level].set(new_idx)
    node_anc = node_anc.at[:, new_idx].set(anc)
    if level < d:  # feed this level to the drafter, each node seeing its own path
      depth_BxK = jnp.full((B, k), level, jnp.int32)
      kv_index, mask = _path_layout(s.pos, anc, depth_BxK, S)
      feats = jnp.take_along_axis(dfeat, parent_local[..., None], axis=1)
      dlogits, dfeat, draft_cache = drafter(
          target, new_tok, feats, draft_cache, s.pos + 1 + (level - 1) * k,
          positions_BxT=s.pos[:, None] + level, mask_BxTxS=mask, kv_index_BxTxS=kv_index)
      beam_idx = jnp.broadcast_to(new_idx, (B, k))
      beam_score = new_score
  # The root and the n-1 best nodes by draft score (a child never outscores its parent, and
  # top_k puts the lower index first on ties, so the set contains every chosen node's parents).
  _, best = jax.lax.top_k(node_score[:, 1:], n - 1)
  chosen = jnp.sort(jnp.concatenate([jnp.zeros((B, 1), jnp.int32), best + 1], axis=1), axis=1)
  rank = jnp.full((B, M), -1, jnp.int32).at[rows[:, None], chosen].set(jnp.arange(n))
  ver_tok = jnp.take_along_axis(node_tok, chosen, axis=1)
  ver_depth = jnp.take_along_axis(node_depth, chosen, axis=1)
  parent_of = jnp.take_along_axis(node_parent, chosen, axis=1)
  ver_parent = jnp.where(parent_of >= 0, jnp.take_along_axis(rank, jnp.maximum(parent_of, 0), 1), -1)
  ver_anc = jnp.take_along_axis(rank[:, None, :], jnp.take_along_axis(node_anc, chosen[..., None], 1),
                                axis=2)
  kv_index, mask = _path_layout(s.pos, ver_anc, ver_depth, S)
  out = target(ver_tok, s.pos[:, None] + ver_depth, cache=s.cache, write_slot_B=s.pos,
               mask_BxTxS=mask, kv_index_BxTxS=kv_index)
  V = out.logits_BxTxV.shape[-1]
  target_masked = sampling.masked_logits(out.logits_BxTxV.reshape(B * n, V), cfg.sampling)
  z = sampling.sample_from_masked(
      target_masked, seed, jnp.repeat(s.sample_id, n), (s.pos[:, None] + ver_depth + 1).reshape(-1),
      greedy).reshape(B, n)
  cur = jnp.zeros((B,), jnp.int32)
  accepted = jnp.zeros((B,), jnp.int32)
  walking = jnp.ones((B,), bool)
  path = [cur]
  for _ in range(d):
    match = (ver_parent == cur[:, None]) & (ver_tok == z[rows, cur][:, None])
    found = match.any(axis=1) & walking
    cur = jnp.where(found, jnp.argmax(match, axis=1).astype(jnp.int32), cur)
    accepted += found
    walking &= found
    path.append(cur)
  path_BxK1 = jnp.stack(path, axis=1)
  emitted = jnp.take_along_axis(z, path_BxK1, axis=1)
  logits_path = target_masked.reshape(B, n, V)[rows[:, None], path_BxK1]
  hidden_path = out.hidden_BxTxD[rows[:, None], path_BxK1]
  # Move the accepted path's KV to consecutive slots pos+1.. (gather all, then scatter).
  keep = jnp.arange(d + 1)[None, :] <= accepted[:, None]
  src = s.pos[:, None] + path_BxK1
  dst = jnp.where(keep, s.pos[:, None] + jnp.arange(d + 1)[None, :], S)
  move = lambda c: c.at[rows[:, None], dst].set(c[rows[:, None], src], mode="drop")
  cache = KVCache(tuple(move(c) for c in out.cache.k), tuple(move(c) for c in out.cache.v))
  return _commit(target, drafter, cfg, s, cache, draft_cache, emitted, accepted,
                 logits_path, hidden_path)


def _rejection_emit(s: Slots, seed, depth, drafts_BxK, draft_masked, target_masked_BxK1xV,
                    target_tok_BxK1):
  """Speculative sampling: accept d_j with prob min(1, p(d_j) / q(d_j)); at the first rejection
  emit a sample of norm(max(p - q, 0)); if all are accepted the bonus token is a sample of p."""
  B = drafts_BxK.shape[0]
  p = _probs(target_masked_BxK1xV)                        # [B, K+1, V]
  q = jnp.stack([_probs(m) for m in draft_masked], axis=1)  # [B, K, V]
  take = lambda probs, tok: jnp.take_along_axis(probs, tok[..., None], axis=-1)[..., 0]
  ratio = take(p[:, :depth], drafts_BxK) / jnp.maximum(take(q, drafts_BxK), 1e-30)
  positions = s.pos[:, None] + 1 + jnp.arange(depth)[None, :]
  coin = jax.vmap(jax.vmap(lambda sid, pos: sampling.uniform_noise(
      seed, sid, pos, sampling.PURPOSE_ACCEPT), in_axes=(None, 0)))(s.sample_id, positions)
  accept = coin < ratio
  residual = jnp.maximum(p[:, :depth] - q, 0.0)
  residual_logits = jnp.where(residual > 0, jnp.log(jnp.maximum(residual, 1e-38)), -jnp.inf)
  V = residual.shape[-1]
  noise = jax.vmap(jax.vmap(lambda sid, pos: sampling.gumbel_noise(
      seed, sid, pos, V, sampling.PURPOSE_RESAMPLE), in_axes=(None, 0)))(s.sample_id, positions)
  resampled = jnp.argmax(residual_logits + noise, axis=-1).astype(jnp.int32)  # [B, K]
  # Emitted token i: the draft while accepted, then the resample at the first rejection, or the
  # target's own sample (the bonus) after all depth drafts were accepted.
  first_reject = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
  i = jnp.arange(depth + 1)[None, :]
  padded_drafts = jnp.concatenate([drafts_BxK, jnp.zeros((B, 1), jnp.int32)], axis=1)
  padded_resampled = jnp.concatenate([resampled, target_tok_BxK1[:, -1:]], axis=1)
  emitted = jnp.where(i < first_reject[:, None], padded_drafts, padded_resampled)
  return emitted, accept


def _decode_chunk(target, drafter, cfg: EngineConfig, arm: Arm, s: Slots, seed):
  """Up to `chunk_steps` rounds on device; stops early when no row is active."""

  def cond(carry):
    step, s, _ = carry
    return (step < cfg.chunk_steps) & jnp.any(s.live & ~s.done)

  def body(carry):
    step, s, emitted = carry
    if arm.is_tree:
      s, n = _tree_step(target, drafter, cfg, arm, s, seed)
    elif arm.depth:
      s, n = _sd_step(target, drafter, cfg, arm.depth, s, seed)
    else:
      s, n = _plain_step(target, cfg, s, seed)
    return step + 1, s, emitted + n

  rounds, out, emitted = jax.lax.while_loop(cond, body, (jnp.int32(0), s, jnp.int32(0)))
  if drafter is not None and not arm.depth:
    out = _drafter_catch_up(target, drafter, cfg, s.pos, s.gen, out)
  return out, emitted, rounds


def _drafter_catch_up(target, drafter, cfg: EngineConfig, pos0_B, gen0_B, s: Slots) -> Slots:
  """Writes the drafter's cache entries for the slots a plain chunk decoded (pos0 .. s.pos-1)
  in one drafter forward over the chunk's tokens and the target features stored with them,
  instead of a drafter step inside every plain step: SD may start at the next chunk, and its
  first draft reads these entries.

  Slot pos0 + i holds token out_tokens[gen0 - 1 + i] with feature out_hidden[gen0 - 1 + i]
  (the hidden state whose logits produced it), exactly what a per-step update would have fed.
  Entries past a row's new pos are scratch: a round writes its slots before reading them, as
  after a verify that accepted fewer tokens than it wrote. `num_slots` leaves room for the
  `chunk_steps`-wide write, so the write is never shifted onto earlier slots."""
  N = cfg.chunk_steps
  g_BxN = jnp.clip(gen0_B[:, None] - 1 + jnp.arange(N)[None, :], 0, cfg.max_new_tokens - 1)
  tokens_BxN = jnp.take_along_axis(s.out_tokens, g_BxN, axis=1)
  features_BxNxD = jnp.take_along_axis(s.out_hidden, g_BxN[..., None], axis=1)
  _, _, draft_cache = drafter(target, tokens_BxN, features_BxNxD, s.draft_cache, pos0_B)
  return s._replace(draft_cache=draft_cache)


def _insert(s: Slots, new: Slots, rows_K) -> Slots:
  """Rows rows_K of `s` become the rows of `new` (indices >= bucket are padding, dropped)."""
  put = lambda old, upd: old.at[rows_K].set(upd, mode="drop")
  return jax.tree.map(put, s, new)


def _compact(s: Slots, rows_K, live_K) -> Slots:
  """A smaller bucket holding rows rows_K of `s` (in that order); rows not live_K are free."""
  s = jax.tree.map(lambda x: jnp.take(x, rows_K, axis=0), s)
  return s._replace(live=live_K, done=s.done | ~live_K)


def _empty(shape: Slots) -> Slots:
  s = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shape)
  return s._replace(done=jnp.ones(s.done.shape, bool))


class _TracedUnderXla:
  """The drafter with every call traced under XLA numerics (see EngineConfig.drafter_numerics)."""

  def __init__(self, drafter: Drafter):
    self.drafter = drafter

  def __call__(self, *args, **kw):
    with ops.numerics_mode("xla"):
      return self.drafter(*args, **kw)

  def init_cache(self, batch: int, num_slots: int) -> KVCache:
    return self.drafter.init_cache(batch, num_slots)


# ---------------------------------------------------------------------------------------------
# Program pool


# Executables are shared by every pool of the process with the same model structure, config,
# placement and numerics: a second engine (a resumed run, a notebook cell run again, another
# test) takes them instead of tracing and compiling again. Least recently used entries beyond
# the limit are dropped: the limit is small because a loaded CPU executable holds ~100 memory
# mappings (measured: 12 engine programs, +1300) and Linux stops a process at 65530, which
# XLA meets as a segfault while loading the next executable. Like jax.jit's own cache, this
# does not notice a function of this module being replaced after a program was built: call
# `clear_shared_programs()` then.
_SHARED_PROGRAMS: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
SHARED_PROGRAMS_LIMIT = 96


def clear_shared_programs() -> None:
  """Forget the executables shared between engines (e.g. after patching this module)."""
  _SHARED_PROGRAMS.clear()


def _signature(tree) -> tuple:
  """What a compiled program assumes of its array arguments: shapes, dtypes, shardings."""
  return tuple((x.shape, str(x.dtype), getattr(x, "sharding", None))
               for x in jax.tree.leaves(tree))


class ProgramPool:
  """Compiled executables per (phase, bucket, strategy), built once by `warm_up`.

  Verify programs are per depth (the token count), shared by every arm with that depth; each SD
  arm is built only for the buckets the tuner may choose it in.

  placement: where every program runs and every array lives, a data-parallel rollout group's
  devices (None = JAX's default device). Without tensor parallelism everything is replicated
  over them. With `tensor_parallel`, the group's devices split the model (`tlt_jax.
  tensor_parallel`: every linear layer over its outputs, whole inputs gathered, the target's
  and the drafter's KV caches over their KV heads), so a model too large for one device decodes
  on several, and with the Pallas kernels every token and log-prob is bitwise the unsplit
  engine's.
  """

  def __init__(self, target: Transformer, drafter: Drafter | None, cfg: EngineConfig,
               allowed_arms: dict[int, list[str]],
               placement: jax.sharding.NamedSharding | None = None,
               tensor_parallel: bool = False):
    self.cfg = cfg
    self.placement = placement
    self.tp_mesh: Mesh | None = None
    if tensor_parallel:
      if placement is None:
        raise ValueError("a tensor-parallel engine needs a placement (its devices)")
      devices = np.array(list(placement.mesh.devices.flat))
      tp.check_model(target.cfg, len(devices), _TP_WHERE)
      self.tp_mesh = Mesh(devices, (_TP_AXIS,))
    self.graphdef, params = nnx.split(target)
    self.params = self.place(params)
    if drafter is not None:
      self.draft_graphdef, draft_params = nnx.split(drafter)
      self.draft_params = self.place(draft_params)
    else:
      self.draft_graphdef, self.draft_params = None, None
    self.allowed_arms = allowed_arms
    self.programs: dict[tuple, Any] = {}
    self._shapes: dict[int, Slots] = {}
    self.compiles = 0  # programs this pool built or took from the process's shared ones
    self._share_key = (self.graphdef, self.draft_graphdef, cfg, placement, tensor_parallel,
                       _signature(self.params), _signature(self.draft_params))

  # -- where things live ---------------------------------------------------------------------

  def _param_specs(self, state):
    if state is None or self.tp_mesh is None:
      return None if state is None else jax.tree.map(lambda _: P(), state)
    return tp.param_specs(state, _TP_AXIS, self.tp_mesh.size, _TP_WHERE)

  def _slots_specs(self, slots: Slots):
    """KV caches split over their KV heads ([B, S, K, hd]) under tensor parallelism; the rest
    (tokens, flags, outputs: the same on every device) replicated."""
    whole = jax.tree.map(lambda _: P(), slots)
    if self.tp_mesh is None:
      return whole
    heads = lambda c: None if c is None else jax.tree.map(lambda _: P(None, None, _TP_AXIS), c)
    return whole._replace(cache=heads(slots.cache), draft_cache=heads(slots.draft_cache))

  def _shardings(self, specs):
    """NamedShardings for a tree of PartitionSpecs (None: JAX's default placement)."""
    if self.placement is None:
      return None
    mesh = self.tp_mesh if self.tp_mesh is not None else self.placement.mesh
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, P))

  def place(self, state):
    """Parameters (the target's or the drafter's) where the programs read them."""
    if self.placement is None:
      return state
    if self.tp_mesh is None:
      return jax.device_put(state, self.placement)
    return jax.device_put(state, self._shardings(self._param_specs(state)))

  def _jit(self, fn, in_specs, out_specs, *, split_model: bool = False, **kw):
    """fn compiled on the placement, its arguments and results laid out by the specs. A program
    that runs the models (`split_model`) runs, under tensor parallelism, once per device of the
    group (a shard_map manual over the model axis) with the layers traced split."""
    if self.tp_mesh is not None and split_model:
      body = fn

      def fn(*args):
        with tp.over(_TP_AXIS):
          return body(*args)
      # check_vma=False: Pallas' interpret mode mis-types its loop carries in a checked
      # shard_map (as in the trainer); the replicated outputs are computed alike on every device.
      fn = jax.shard_map(fn, mesh=self.tp_mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
    if self.placement is not None:
      kw.update(in_shardings=self._shardings(in_specs), out_shardings=self._shardings(out_specs))
    return jax.jit(fn, **kw)

  def _models(self, params, draft_params):
    target = nnx.merge(self.graphdef, params)
    drafter = nnx.merge(self.draft_graphdef, draft_params) if self.draft_graphdef else None
    if drafter is not None and self.cfg.drafter_numerics == "xla":
      drafter = _TracedUnderXla(drafter)
    return target, drafter

  def _build(self, key):
    phase, bucket, extra = key
    cfg = self.cfg
    models = (self._param_specs(self.params), self._param_specs(self.draft_params))
    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    if phase == "prefill":
      def fn(params, draft_params, prompts, lengths, sample_ids, max_new, seed):
        target, drafter = self._models(params, draft_params)
        return _prefill(target, drafter, cfg, prompts, lengths, sample_ids, max_new, seed)
      rows = jax.ShapeDtypeStruct((bucket,), jnp.int32)
      args = (jax.ShapeDtypeStruct((bucket, cfg.max_prompt_len), jnp.int32), rows, rows, rows, i32)
      program = self._jit(fn, (*models, *[P()] * len(args)),
                          self._slots_specs(self.slots_shape(bucket)), split_model=True)
      return program.lower(self.params, self.draft_params, *args).compile()
    slots = self.slots_shape(bucket)
    slots_specs = self._slots_specs(slots)
    if phase == "decode":  # extra = arm name
      arm = next(a for a in cfg.arms if a.name == extra)

      def fn(params, draft_params, s, seed):
        target, drafter = self._models(params, draft_params)
        return _decode_chunk(target, drafter, cfg, arm, s, seed)
      program = self._jit(fn, (*models, slots_specs, P()), (slots_specs, P(), P()),
                          split_model=True, donate_argnums=(2,))
      return program.lower(self.params, self.draft_params, slots, i32).compile()
    if phase == "insert":  # bucket = destination, extra = prefill bucket
      new = self.slots_shape(extra)
      program = self._jit(_insert, (slots_specs, self._slots_specs(new), P()), slots_specs,
                          donate_argnums=(0,))
      return program.lower(slots, new, jax.ShapeDtypeStruct((extra,), jnp.int32)).compile()
    if phase == "compact":  # bucket = source, extra = destination
      program = self._jit(_compact, (slots_specs, P(), P()),
                          self._slots_specs(self.slots_shape(extra)))
      return program.lower(slots, jax.ShapeDtypeStruct((extra,), jnp.int32),
                           jax.ShapeDtypeStruct((extra,), bool)).compile()
    if phase == "finish":  # mark rows done (a stop string was found on the host)
      program = self._jit(lambda s, m: s._replace(done=s.done | m), (slots_specs, P()),
                          slots_specs, donate_argnums=(0,))
      return program.lower(slots, jax.ShapeDtypeStruct((bucket,), bool)).compile()
    if phase == "empty":
      return self._jit(lambda: _empty(slots), (), slots_specs).lower().compile()
    if phase == "hidden_row":
      return self._jit(lambda h, r: h[r], (P(), P()), P()).lower(slots.out_hidden, i32).compile()
    raise KeyError(key)

  def slots_shape(self, bucket: int):
    if bucket not in self._shapes:
      self._shapes[bucket] = self._slots_shape(bucket)
    return self._shapes[bucket]

  def _slots_shape(self, bucket: int):
    cfg = self.cfg

    def init(params, draft_params):
      target, drafter = self._models(params, draft_params)
      zeros = jnp.zeros((bucket, cfg.max_prompt_len), jnp.int32)
      ones = jnp.ones((bucket,), jnp.int32)
      return _prefill(target, drafter, cfg, zeros, ones, ones, ones, jnp.int32(0))

    return jax.eval_shape(init, self.params, self.draft_params)

  def get(self, phase: str, bucket: int, extra: int | str = 0):
    key = (phase, bucket, extra)
    if key not in self.programs:
      # The numerics mode is read while tracing: part of what a program is.
      shared = (self._share_key, ops.numerics(), ops.backend(), key)
      program = _SHARED_PROGRAMS.pop(shared, None) or self._build(key)
      _SHARED_PROGRAMS[shared] = program
      while len(_SHARED_PROGRAMS) > SHARED_PROGRAMS_LIMIT:
        _SHARED_PROGRAMS.popitem(last=False)
      self.programs[key] = program
      self.compiles += 1
    return self.programs[key]

  def warm_up(self) -> int:
    """Builds every program a rollout can call; returns how many were compiled."""
    before = self.compiles
    buckets = self.cfg.buckets
    for b in buckets:
      self.get("prefill", b)
      self.get("empty", b)
      if self.cfg.stop_strings:
        self.get("finish", b)
      self.get("hidden_row", b)
      for arm in self.allowed_arms[b]:
        self.get("decode", b, arm)
      for k in buckets:
        if k <= b:
          self.get("insert", b, k)
          if k < b:
            self.get("compact", b, k)
    return self.compiles - before



# ---------------------------------------------------------------------------------------------
# The engine


class RolloutEngine:

  def __init__(self, target: Transformer, cfg: EngineConfig, drafter: Drafter | None = None,
               tuner: Tuner | None = None, detokenize=None,
               placement: jax.sharding.NamedSharding | None = None,
               tensor_parallel: bool = False):
    """placement / tensor_parallel: the devices the engine runs on, and whether they split the
    model or each hold all of it (see `ProgramPool`)."""
    if cfg.stop_strings and detokenize is None:
      raise ValueError("stop_strings need a detokenize(token_ids) -> str function")
    self.detokenize = detokenize
    if cfg.compilation_cache_dir:
      jax.config.update("jax_compilation_cache_dir", cfg.compilation_cache_dir)
    if drafter is not None:
      check_fits(drafter, target.cfg)
    if drafter is None and cfg.max_depth:
      cfg = dataclasses.replace(cfg, arms=tuple(a for a in cfg.arms if a.depth == 0))
    self.cfg = cfg
    self.target, self.drafter = target, drafter
    self.tuner = tuner or Tuner(cfg.arms, cfg.buckets,
                                max_verify_tokens_per_bucket=cfg.max_verify_tokens_per_bucket,
                                seed=cfg.seed)
    self.pool = ProgramPool(target, drafter, cfg, self.tuner.allowed, placement, tensor_parallel)
    self.trace: list[ChunkTrace] = []
    self.target_tokens_processed = 0  # prefill + decode + verify tokens through the target
    self.prefill_rows = 0  # prompts prefilled (a mid-rollout SD switch must not add any)

  def update_policy(self, target: Transformer) -> None:
    """Serve new target weights (e.g. after an RL update; same shapes: no recompile)."""
    params = nnx.split(target)[1]
    if jax.tree.structure(params) != jax.tree.structure(self.pool.params):
      raise ValueError("update_policy needs a model with the engine's parameter structure")
    self.pool.params = self.pool.place(params)
    self.target = target

  def update_drafter(self, drafter: Drafter) -> None:
    """Serve new drafter weights (same shapes: no recompile)."""
    check_fits(drafter, self.target.cfg)
    self.pool.draft_params = self.pool.place(nnx.split(drafter)[1])
    self.drafter = drafter

  def _bucket_for(self, n: int) -> int:
    return next((b for b in self.cfg.buckets if b >= n), self.cfg.buckets[-1])

  def _check_prompts(self, prompts: list[list[int]]) -> None:
    if not prompts:
      raise ValueError("rollout needs at least one prompt")
    V = self.target.cfg.vocab_size
    for i, p in enumerate(prompts):
      if len(p) == 0:
        raise ValueError(f"prompt {i} is empty")
      if len(p) > self.cfg.max_prompt_len:
        raise ValueError(f"prompt {i} has {len(p)} tokens; the engine's max_prompt_len is "
                         f"{self.cfg.max_prompt_len} (cache of {self.cfg.num_slots} slots)")
      if min(p) < 0 or max(p) >= V:
        raise ValueError(f"prompt {i} has token ids outside [0, {V})")

  def generate(self, prompts: list[list[int]], **kw) -> list[Sample]:
    """Samples `group_size` completions per prompt; returns them in sample-id order (keyword
    arguments: see `rollout`)."""
    run = self.rollout(prompts, **kw)
    while True:
      try:
        next(run)
      except StopIteration as finished:
        return finished.value

  def rollout(self, prompts: list[list[int]], *, group_size: int = 1, arm: str | None = None,
              max_new_tokens: int | None = None, sd_after_rounds: int = 0,
              order: list[int] | None = None,
              max_new_per_sample: list[int] | None = None,
              seed: int | None = None,
              on_finish: Callable[[Sample], None] | None = None,
              first_sample_id: int = 0):
    """`generate` as a generator: it yields right after dispatching each decode chunk (before
    waiting for it), so a host loop can interleave the rollouts of several engines on disjoint
    devices, or other device work; the samples are its return value.

    arm: force a strategy ("off", "chain4", ...) instead of the tuner's choice;
    sd_after_rounds: plain decode for that many chunks before the tuner may pick SD (tests the
    mid-rollout switch); order: the order in which samples are admitted (default: by id);
    on_finish: called with each sample as soon as it finishes (e.g. to score it while the long
    tail is still decoding); first_sample_id: sample ids start there (a data-parallel group
    decodes its share of a batch under the batch's ids, so its tokens are the same).
    """
    self._check_prompts(prompts)
    cfg = self.cfg
    max_new = min(max_new_tokens or cfg.max_new_tokens, cfg.max_new_tokens)
    num_samples = len(prompts) * group_size
    budgets = list(max_new_per_sample) if max_new_per_sample is not None else [max_new] * num_samples
    if len(budgets) != num_samples or min(budgets) < 1 or max(budgets) > cfg.max_new_tokens:
      raise ValueError(f"max_new_per_sample needs {num_samples} budgets in "
                       f"[1, {cfg.max_new_tokens}]")
    requests = [(first_sample_id + i, prompts[i // group_size], budgets[i])
                for i in range(num_samples)]
    if order is not None:
      requests = [requests[i] for i in order]
    pending = collections.deque(requests)
    bucket = self._bucket_for(len(pending))
    slots = None
    row_sample: list[int | None] = [None] * bucket
    row_prompt: dict[int, list[int]] = {}
    results: dict[int, Sample] = {}
    stopped: dict[int, int] = {}  # sample id -> tokens kept (up to and including a stop string)
    chunks = 0
    seed = np.int32(cfg.seed if seed is None else seed)  # host scalar: no conversion compile
    t_start = time.perf_counter()
    while pending or any(r is not None for r in row_sample):
      slots = self._refill(slots, bucket, row_sample, row_prompt, pending, seed)
      chosen = self._choose_arm(bucket, arm, chunks, sd_after_rounds)
      t0 = time.perf_counter()
      live = sum(r is not None for r in row_sample)
      slots, emitted, rounds = self.pool.get("decode", bucket, chosen.name)(
          self.pool.params, self.pool.draft_params, slots, seed)
      yield bucket, live  # dispatched, not waited for
      done = np.asarray(slots.done)
      dt = time.perf_counter() - t0
      emitted, rounds = int(emitted), int(rounds)
      self.target_tokens_processed += bucket * rounds * chosen.verify_tokens
      self.tuner.update(bucket, chosen, emitted, dt, live)
      self.trace.append(ChunkTrace(t0 - t_start, dt, bucket, live, chosen.name, emitted, rounds))
      chunks += 1
      if cfg.stop_strings:
        slots, done = self._apply_stop_strings(slots, done, row_sample, stopped, bucket)
      self._collect(slots, done, row_sample, row_prompt, results, bucket, stopped, on_finish)
      if cfg.compaction and not pending:
        slots, bucket, row_sample = self._maybe_compact(slots, bucket, row_sample)
    return [results[sid] for sid in sorted(results)]

  def _choose_arm(self, bucket, arm, chunks, sd_after_rounds) -> Arm:
    if arm is not None:
      if arm not in self.tuner.allowed[bucket]:
        return self.tuner.arms[OFF]
      return self.tuner.arms[arm]
    if chunks < sd_after_rounds:
      return self.tuner.arms[OFF]
    return self.tuner.choose(bucket)

  def _refill(self, slots, bucket, row_sample, row_prompt, pending, seed):
    free = [r for r, s in enumerate(row_sample) if s is None]
    if slots is not None and (not free or not pending):
      return slots
    take = min(len(free), len(pending))
    k = self._bucket_for(take)
    prompts = np.zeros((k, self.cfg.max_prompt_len), np.int32)
    lengths = np.ones(k, np.int32)
    sample_ids = np.zeros(k, np.int32)
    max_new = np.ones(k, np.int32)
    rows = np.full(k, bucket, np.int32)  # padding rows land out of range: dropped
    for i in range(take):
      sid, prompt, budget = pending.popleft()
      prompts[i, :len(prompt)] = prompt
      lengths[i], sample_ids[i], rows[i], max_new[i] = len(prompt), sid, free[i], budget
      row_sample[free[i]] = sid
      row_prompt[sid] = list(prompt)
    new = self.pool.get("prefill", k)(self.pool.params, self.pool.draft_params, prompts, lengths,
                                      sample_ids, max_new, seed)
    self.target_tokens_processed += k * self.cfg.max_prompt_len
    self.prefill_rows += take
    if slots is None:
      slots = self.pool.get("empty", bucket)()
    return self.pool.get("insert", bucket, k)(slots, new, rows)

  def _apply_stop_strings(self, slots, done, row_sample, stopped, bucket):
    tokens, gen = np.asarray(slots.out_tokens), np.asarray(slots.gen)
    newly = np.zeros(bucket, bool)
    for r, sid in enumerate(row_sample):
      if sid is None or sid in stopped:
        continue
      toks = tokens[r, :int(gen[r])].tolist()
      if not any(stop in self.detokenize(toks) for stop in self.cfg.stop_strings):
        continue
      keep = next(m for m in range(1, len(toks) + 1)
                  if any(stop in self.detokenize(toks[:m]) for stop in self.cfg.stop_strings))
      stopped[sid] = keep
      newly[r] = True
    if newly.any():
      slots = self.pool.get("finish", bucket)(slots, newly)
      done = done | newly
    return slots, done

  def _collect(self, slots, done, row_sample, row_prompt, results, bucket, stopped, on_finish):
    finished = [r for r, sid in enumerate(row_sample) if sid is not None and done[r]]
    if not finished:
      return
    tokens = np.asarray(slots.out_tokens)
    logprobs = np.asarray(slots.out_logprobs)
    gen = np.asarray(slots.gen)
    eos = set(self.cfg.eos_ids)
    for r in finished:
      sid = row_sample[r]
      n = stopped.get(sid, int(gen[r]))
      toks = tokens[r, :n].copy()
      reason = ("stop" if sid in stopped else "eos" if int(toks[-1]) in eos else "length")
      results[sid] = Sample(
          sample_id=sid, prompt=row_prompt.pop(sid), tokens=toks, logprobs=logprobs[r, :n].copy(),
          finish_reason=reason,
          hidden=self.pool.get("hidden_row", bucket)(slots.out_hidden, np.int32(r)))
      row_sample[r] = None
      if on_finish is not None:
        on_finish(results[sid])

  def _maybe_compact(self, slots, bucket, row_sample):
    live_rows = [r for r, s in enumerate(row_sample) if s is not None]
    if not live_rows:
      return slots, bucket, row_sample
    smaller = self._bucket_for(len(live_rows))
    if smaller >= bucket:
      return slots, bucket, row_sample
    # Padding rows copy a live row and are marked free: they never emit or get collected.
    rows = live_rows + [live_rows[0]] * (smaller - len(live_rows))
    live = np.arange(smaller) < len(live_rows)
    slots = self.pool.get("compact", bucket, smaller)(slots, np.asarray(rows, np.int32), live)
    new_rows = [row_sample[r] for r in live_rows] + [None] * (smaller - len(live_rows))
    return slots, smaller, new_rows
