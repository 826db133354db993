"""The rollout's device programs, pure functions of (models, config, slot state) that
`rollout.programs` jits and compiles per (phase, bucket, strategy), and the state they carry
(`Slots`):

  prefill       a bucket of prompts -> fresh slots (first token sampled, drafter cache filled)
  decode_chunk  up to `chunk_steps` rounds on device: plain steps, or chain (`_sd_step`) or tree
                (`_tree_step`, its verify `_verify_tree`) speculative rounds, all ending in
                `_commit`, or lookup rounds: a chain (`_lookup_drafts` then `_verify_drafts`)
                or the trie of several looked-up chains (`_lookup_tree_chains`,
                `_chains_to_tree`, then `_verify_tree`), or the combined arm's rounds (the
                learned chain and looked-up ones in one trie, `_combined_step`); after a
                plain chunk the drafter's cache catches up in one forward
                (`_drafter_catch_up`)
  history_round one round whose drafts come from the host (`rollout.history`): a chain,
                verified by `_verify_drafts`, or a tree's chains, by `_verify_tree`
  insert / compact / empty   move rows between buckets (refill, compaction), start a bucket

Exactness (with `numerics="batch_invariant"`): the slot a sample occupies, the bucket, the
chunk size, the refill order and compaction change none of its tokens or log-probs, and `gumbel`
verification emits exactly the tokens plain decode would: a drafted token is accepted iff it
equals the target's own Gumbel-argmax at that position, and the target's token is emitted at
the first mismatch. In a tree, each node attends its own path laid out at the slots plain
decoding would use (`kv_index`), and the accepted path's KV is moved to consecutive slots.
`rejection` verification (chains) is classic speculative sampling (exact in distribution only).
History and lookup drafts are verified the gumbel way whatever `verification` says: for a
deterministic draft d, speculative sampling accepts with probability p(d), which is exactly the
probability that the target's own Gumbel sample is d, so nothing is lost and the output stays
bitwise plain.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from tlt_jax import ops
from tlt_jax.model.transformer import KVCache, init_cache
from tlt_jax.rollout import sampling
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.tuner import Arm


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
  prompt_tokens: jax.Array  # [B, P] the prompt (what lookup drafts read besides the response)


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


def prefill(target, drafter, cfg: EngineConfig, prompts_BxP, lengths_B, sample_ids_B, max_new_B,
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
      out_hidden=jnp.zeros((B, N, D), hidden_BxD.dtype).at[:, 0].set(hidden_BxD),
      prompt_tokens=prompts_BxP)


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
  drafts_BxK, draft_masked, draft_cache = _draft_chain(target, drafter, cfg, depth, s, seed,
                                                       purpose)
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


def _draft_chain(target, drafter, cfg: EngineConfig, depth: int, s: Slots, seed, purpose):
  """The learned drafter's chain of `depth` tokens: ([B, depth] drafts, each level's masked
  logits, the drafter's cache with entries pos .. pos + depth - 1 written). The first step
  reads the target's feature, later ones the drafter's own."""
  greedy = cfg.sampling.temperature == 0.0
  tok, feat, draft_cache = s.token, s.prev_hidden, s.draft_cache
  drafts, draft_masked = [], []
  for j in range(depth):
    dlogits, dfeat, draft_cache = drafter(target, tok[:, None], feat[:, None], draft_cache,
                                          s.pos + j)
    masked = sampling.masked_logits(dlogits[:, 0], cfg.sampling)
    tok = sampling.sample_from_masked(masked, seed, s.sample_id, s.pos + j + 1, greedy, purpose)
    feat = dfeat[:, 0]
    drafts.append(tok)
    draft_masked.append(masked)
  return jnp.stack(drafts, axis=1), draft_masked, draft_cache


def _combined_step(target, drafter, cfg: EngineConfig, arm: Arm, s: Slots, seed, bank_HxN,
                   bank_len_H):
  """One round of the combined arm: the learned drafter's chain and `arm.topk - 1` distinct
  looked-up chains, merged into one trie (the learned chain first: where a looked-up chain
  agrees with it, it extends that branch) and verified by one tree forward."""
  B = s.token.shape[0]
  learned_BxK, _, draft_cache = _draft_chain(target, drafter, cfg, arm.depth, s, seed,
                                             sampling.PURPOSE_TOKEN)
  looked_up_BxWxK, found_BxW = _lookup_tree_chains(s, bank_HxN, bank_len_H, arm.depth,
                                                   arm.topk - 1, cfg.lookup_max_order)
  chains = jnp.concatenate([learned_BxK[:, None], looked_up_BxWxK], axis=1)
  valid = jnp.concatenate([jnp.ones((B, 1), bool), found_BxW], axis=1)
  return _verify_tree(target, drafter, cfg, s, seed, *_chains_to_tree(s.token, chains, valid),
                      draft_cache)


def _commit(target, drafter, cfg, s: Slots, cache, draft_cache, emitted_BxK1, accepted_B,
            masked_logits_BxK1xV, hidden_BxK1xD, extend_current: bool = False):
  """Emits tokens 0..accepted of `emitted` (cut at EOS and max_new) and advances the slots.

  emitted[:, i] is the i-th token after the current one; its logits and hidden state are row i
  of masked_logits / hidden (the target's output at the i-th node of the accepted path).
  extend_current: the drafter did not see the current token this round (the host drafted), so
  its cache entry at `pos` is written here too.
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
  if drafter is not None and extend_current:
    _, _, draft_cache = drafter(
        target, jnp.concatenate([s.token[:, None], emitted_BxK1[:, :depth]], axis=1),
        jnp.concatenate([s.prev_hidden[:, None], hidden_BxK1xD[:, :depth]], axis=1),
        draft_cache, s.pos)
  elif drafter is not None:
    _, _, draft_cache = drafter(target, emitted_BxK1[:, :depth], hidden_BxK1xD[:, :depth],
                                draft_cache, s.pos + 1)
  moved = n_emit > 0
  s = s._replace(
      cache=cache, draft_cache=draft_cache,
      token=jnp.where(moved, emitted_BxK1[rows, last], s.token), pos=s.pos + n_emit,
      prev_hidden=jnp.where(moved[:, None], hidden_BxK1xD[rows, last], s.prev_hidden),
      gen=gen, done=done, out_tokens=out_tokens, out_logprobs=out_logprobs, out_hidden=out_hidden)
  return s, jnp.sum(n_emit)


def history_round(target, drafter, cfg: EngineConfig, s: Slots, seed, drafts, valid_BxW=None):
  """One round with drafts from the host: a chain [B, K] (`_verify_drafts`), or with
  `valid_BxW` the chains [B, W, K] of a tree (-1 past a chain's end; `_chains_to_tree`, then
  `_verify_tree`). Returns (slots, tokens emitted, rounds = 1, row-rounds), as `decode_chunk`
  does."""
  row_rounds = jnp.sum(s.live & ~s.done).astype(jnp.int32)
  if valid_BxW is None:
    s, emitted = _verify_drafts(target, drafter, cfg, s, seed, drafts)
  else:
    s, emitted = _verify_tree(target, drafter, cfg, s, seed,
                              *_chains_to_tree(s.token, drafts, valid_BxW), s.draft_cache,
                              extend_current=True)
  return s, emitted, jnp.int32(1), row_rounds


def _verify_drafts(target, drafter, cfg: EngineConfig, s: Slots, seed, drafts_BxK):
  """One chain round over drafts made without the drafter: the target sees [token, d_1..d_K]
  at slots pos..pos+K, a draft is accepted while it equals the target's own Gumbel sample
  there (the token plain decoding would emit), and the target's token is emitted at the first
  mismatch."""
  B, depth = drafts_BxK.shape
  K1 = depth + 1
  greedy = cfg.sampling.temperature == 0.0
  out = target(jnp.concatenate([s.token[:, None], drafts_BxK], axis=1), cache=s.cache,
               write_slot_B=s.pos)
  positions_BxK1 = s.pos[:, None] + 1 + jnp.arange(K1)[None, :]
  target_masked = sampling.masked_logits(out.logits_BxTxV.reshape(B * K1, -1), cfg.sampling)
  target_tok = sampling.sample_from_masked(
      target_masked, seed, jnp.repeat(s.sample_id, K1), positions_BxK1.reshape(-1), greedy
  ).reshape(B, K1)
  accept_BxK = drafts_BxK == target_tok[:, :depth]
  accepted = jnp.sum(jnp.cumprod(accept_BxK.astype(jnp.int32), axis=1), axis=1)
  return _commit(target, drafter, cfg, s, out.cache, s.draft_cache, target_tok, accepted,
                 target_masked.reshape(B, K1, -1), out.hidden_BxTxD, extend_current=True)


def _row_sequences(s: Slots):
  """([B, P + N] each row's prompt then its response so far, left-aligned; [B] lengths)."""
  P, N = s.prompt_tokens.shape[1], s.out_tokens.shape[1]
  prompt_len = s.pos - s.gen + 1  # `pos` is where `token` (response token gen - 1) goes
  i = jnp.arange(P + N)
  from_prompt = s.prompt_tokens[:, jnp.clip(i, 0, P - 1)]
  from_response = jnp.take_along_axis(
      s.out_tokens, jnp.clip(i[None, :] - prompt_len[:, None], 0, N - 1), axis=1)
  in_prompt = i[None, :] < prompt_len[:, None]
  return jnp.where(in_prompt, from_prompt, from_response), prompt_len + s.gen


# Elements of one block of the lookup's [B, rows, P + N] comparisons: the search walks the
# corpus a block of rows at a time, so its memory does not grow with the bucket, the bank or the
# response length (the whole corpus at once, at B=64, a bank of 16 and a 32K-token context,
# would be ~0.7 GB per tensor per round). 4M elements: ~40 MB over the block's tensors.
LOOKUP_BLOCK_ELEMENTS = 1 << 22


def _lookup_drafts(s: Slots, bank_HxN, bank_len_H, depth: int, max_order: int,
                   block_elements: int = LOOKUP_BLOCK_ELEMENTS):
  """[B, depth] drafts, each row's continuation of the longest match (up to `max_order`
  tokens) of its own last tokens, looked up in every row of the bucket (its own text
  included: prompt and response so far) and in the bank of recent responses.

  Candidates are scored by match length, then by how many of the `depth` continuation tokens
  they have; ties go to the first (the bucket's rows before the bank, earlier positions
  first). A row with no match drafts zeros, as do the tokens past the end of a matched
  source; verification rejects them unless the target would emit them. Cost per round:
  O(B * (B + H) * (P + N) * max_order) comparisons, done on device between two verifies, so
  a chunk of lookup rounds is one program call; memory: one block of `block_elements`
  comparisons (at least one corpus row for every row of B)."""
  drafts_BxK, found_B = _lookup_search(s, bank_HxN, bank_len_H, depth, max_order, None,
                                       block_elements)
  return jnp.where(found_B[:, None], jnp.maximum(drafts_BxK, 0), 0)


def _lookup_tree_chains(s: Slots, bank_HxN, bank_len_H, depth: int, width: int, max_order: int,
                        block_elements: int = LOOKUP_BLOCK_ELEMENTS):
  """([B, width, depth] chains, [B, width] valid): the best match as `_lookup_drafts` finds it,
  then the best whose continuation differs from every chain found before it (a continuation
  that is a prefix of an earlier chain adds no node to the tree), `width` searches in all.
  A chain is -1 past the end of its source; an invalid one (nothing left to match) is zeros."""
  chains, valid = [], []
  for _ in range(width):
    exclude = jnp.stack(chains, axis=1) if chains else None
    drafts_BxK, found_B = _lookup_search(s, bank_HxN, bank_len_H, depth, max_order, exclude,
                                         block_elements)
    chains.append(jnp.where(found_B[:, None], drafts_BxK, 0))  # -1 past a source's end
    valid.append(found_B)
  return jnp.stack(chains, axis=1), jnp.stack(valid, axis=1)


def _lookup_search(s: Slots, bank_HxN, bank_len_H, depth: int, max_order: int,
                   exclude_BxExK, block_elements: int):
  """([B, depth] drafts, -1 past the end of their source; [B] found): the search of
  `_lookup_drafts`, skipping every candidate whose continuation (as many tokens as it has, up
  to `depth`) equals the start of one of the row's `exclude` chains [B, E, depth] (None:
  none)."""
  seq_BxL, len_B = _row_sequences(s)
  B, L = seq_BxL.shape
  H, N = bank_HxN.shape
  bank_HxL = jnp.pad(bank_HxN, ((0, 0), (0, max(L - N, 0))))[:, :L]
  corpus_RxL = jnp.concatenate([seq_BxL, bank_HxL], axis=0)
  corpus_len_R = jnp.concatenate([len_B, jnp.minimum(bank_len_H, L)])
  j = jnp.arange(L)
  # key[b, i]: row b's i-th token from the end (i = 0 is its newest).
  key_idx_BxM = len_B[:, None] - 1 - jnp.arange(max_order)[None, :]
  key_BxM = jnp.take_along_axis(seq_BxL, jnp.maximum(key_idx_BxM, 0), axis=1)

  def block_best(corpus_CxL, corpus_len_C):
    """(score [B], drafts [B, depth]) of the best match in these corpus rows (-1: none)."""
    # match_len[b, c, j]: how many of row b's newest tokens end at corpus[c, j] (consecutive).
    run_BxCxL = jnp.ones((B, corpus_CxL.shape[0], L), bool)
    match_len_BxCxL = jnp.zeros(run_BxCxL.shape, jnp.int32)
    for i in range(max_order):
      shifted_CxL = jnp.roll(corpus_CxL, i, axis=1)  # [c, j] = corpus[c, j - i]
      eq = shifted_CxL[None] == key_BxM[:, i, None, None]
      run_BxCxL = (run_BxCxL & eq & (j >= i)[None, None, :]
                   & (key_idx_BxM[:, i] >= 0)[:, None, None])
      match_len_BxCxL = match_len_BxCxL + run_BxCxL
    avail_CxL = corpus_len_C[:, None] - 1 - j[None, :]  # tokens after position j
    usable = (match_len_BxCxL > 0) & (avail_CxL > 0)[None]
    if exclude_BxExK is not None:  # the k-th continuation token exists for k < avail
      # next_k[c, j] = corpus[c, j + 1 + k]: candidate (c, j)'s k-th continuation token.
      next_KxCxL = [jnp.roll(corpus_CxL, -(1 + k), axis=1) for k in range(depth)]
      for e in range(exclude_BxExK.shape[1]):
        same_BxCxL = jnp.ones_like(usable)
        for k in range(depth):
          same_BxCxL &= ((next_KxCxL[k][None] == exclude_BxExK[:, e, k, None, None])
                         | (k >= avail_CxL)[None])
        usable &= ~same_BxCxL
    score = match_len_BxCxL * (depth + 1) + jnp.minimum(avail_CxL, depth)[None]
    score = jnp.where(usable, score, -1).reshape(B, -1)
    best = jnp.argmax(score, axis=1)  # the first of equals: earlier rows, earlier positions
    c_B, j_B = best // L, best % L
    k_K = jnp.arange(depth)
    cols_BxK = jnp.clip(j_B[:, None] + 1 + k_K[None, :], 0, L - 1)
    has_BxK = k_K[None, :] < (corpus_len_C[c_B] - 1 - j_B)[:, None]  # within its source
    return jnp.max(score, axis=1), jnp.where(has_BxK, corpus_CxL[c_B[:, None], cols_BxK], -1)

  R = corpus_RxL.shape[0]
  rows_per_block = max(1, min(R, block_elements // (B * L)))
  if rows_per_block == R:
    score_B, drafts_BxK = block_best(corpus_RxL, corpus_len_R)
  else:
    num_blocks = -(-R // rows_per_block)
    pad = num_blocks * rows_per_block - R  # rows of length 0: no continuation, never chosen
    blocks = (jnp.pad(corpus_RxL, ((0, pad), (0, 0))).reshape(num_blocks, rows_per_block, L),
              jnp.pad(corpus_len_R, (0, pad)).reshape(num_blocks, rows_per_block))

    def keep_better(carry, block):
      best_B, drafts_BxK = carry
      score_B, block_drafts_BxK = block_best(*block)
      better = score_B > best_B  # strict: an equal score in a later block is a later row
      return (jnp.where(better, score_B, best_B),
              jnp.where(better[:, None], block_drafts_BxK, drafts_BxK)), None

    init = (jnp.full((B,), -1, jnp.int32), jnp.zeros((B, depth), jnp.int32))
    (score_B, drafts_BxK), _ = jax.lax.scan(keep_better, init, blocks)
  return drafts_BxK.astype(jnp.int32), score_B >= 0


def _chains_to_tree(root_B, chains_BxWxK, valid_BxW):
  """The chains as one draft tree, in `_verify_tree`'s layout: node 0 is the root (the current
  token), node 1 + w * K + i is chain w's token i (0-based, at depth i + 1). A node whose
  prefix equals an earlier valid chain's hangs under that chain's node (the trie of the
  chains), so a walk can branch where the chains differ; a node equal to an earlier one is a
  leaf the walk never takes (it finds the earlier, lower-index one first). The nodes of invalid
  chains and the -1 tokens past a chain's end have no parent (never walked), token 0 and depth
  0. Returns (tokens, parents, depths [B, n], ancestors [B, n, K + 1]: the node's ancestor at
  each depth, itself at its own), n = 1 + W * K."""
  B, W, K = chains_BxWxK.shape
  # same[b, w, v, i]: chains w and v agree on their first i + 1 tokens, and v is valid.
  eq_BxWxWxK = chains_BxWxK[:, :, None, :] == chains_BxWxK[:, None, :, :]
  same_BxWxWxK = ((jnp.cumprod(eq_BxWxWxK.astype(jnp.int32), axis=-1) > 0)
                  & valid_BxW[:, None, :, None])
  first_BxWxK = jnp.argmax(same_BxWxWxK, axis=2)  # first chain holding w's prefix of i + 1
  i_K = jnp.arange(K)
  own_node_BxWxK = jnp.broadcast_to(1 + jnp.arange(W)[:, None] * K + i_K, (B, W, K))
  trie_node_BxWxK = 1 + first_BxWxK * K + i_K  # the node the walk reaches for w's prefix
  parent_BxWxK = jnp.concatenate(
      [jnp.zeros((B, W, 1), jnp.int32), trie_node_BxWxK[:, :, :-1]], axis=2)
  # Ancestors of chain w's token i at depths 1..K: the trie's nodes above it, itself, 0 below.
  above_KxK = i_K[None, :] < i_K[:, None]  # [i, depth index]
  anc_BxWxKxK = jnp.where(above_KxK, trie_node_BxWxK[:, :, None, :],
                          jnp.where(i_K[None, :] == i_K[:, None], own_node_BxWxK[..., None], 0))
  node_BxWxK = valid_BxW[:, :, None] & (chains_BxWxK >= 0)
  n1 = W * K
  tokens = jnp.where(node_BxWxK, chains_BxWxK, 0).reshape(B, n1)
  parents = jnp.where(node_BxWxK, parent_BxWxK, -1).reshape(B, n1)
  depths = jnp.where(node_BxWxK, i_K + 1, 0).reshape(B, n1)
  ancestors = jnp.where(node_BxWxK[..., None], anc_BxWxKxK, 0).reshape(B, n1, K)
  column = lambda value: jnp.full((B, 1), value, jnp.int32)
  return (jnp.concatenate([root_B[:, None].astype(jnp.int32), tokens], axis=1),
          jnp.concatenate([column(-1), parents], axis=1),
          jnp.concatenate([column(0), depths], axis=1),
          jnp.pad(ancestors, ((0, 0), (1, 0), (1, 0))))  # the root: depth 0, itself = 0


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
  ver_parent = jnp.where(parent_of >= 0,
                         jnp.take_along_axis(rank, jnp.maximum(parent_of, 0), 1), -1)
  ver_anc = jnp.take_along_axis(rank[:, None, :],
                                jnp.take_along_axis(node_anc, chosen[..., None], 1), axis=2)
  return _verify_tree(target, drafter, cfg, s, seed, ver_tok, ver_parent, ver_depth, ver_anc,
                      draft_cache)


def _verify_tree(target, drafter, cfg: EngineConfig, s: Slots, seed, ver_tok, ver_parent,
                 ver_depth, ver_anc, draft_cache, extend_current: bool = False):
  """One target forward over a draft tree of n nodes per row (tokens, parents, depths [B, n],
  ancestors [B, n, d + 1]; node 0 the current token), each node seeing exactly its path, so
  its sample is the one plain decoding would draw there (Gumbel verification); the walk from
  the root follows the child equal to that sample while there is one. The accepted path's KV
  moves to consecutive slots; the path plus the sample after it are emitted. extend_current:
  the learned drafter did not draft this round (`_commit`)."""
  B, n = ver_tok.shape
  d = ver_anc.shape[-1] - 1
  rows = jnp.arange(B)
  S = s.cache.num_slots
  greedy = cfg.sampling.temperature == 0.0
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
                 logits_path, hidden_path, extend_current=extend_current)


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


def decode_chunk(target, drafter, cfg: EngineConfig, arm: Arm, s: Slots, seed, bank_HxN=None,
                 bank_len_H=None):
  """Up to `chunk_steps` rounds on device; stops early when no row is active. Returns (slots,
  tokens emitted, rounds, row-rounds): row-rounds counts each row once per round it was active
  in, what the tuner divides by (rows that finish inside a chunk are not charged its later
  rounds, so long chunks and one-round ones compare fairly). bank: recent responses [H, N] and
  their lengths [H], what a lookup arm drafts from besides the bucket's rows."""

  def cond(carry):
    step, s, _, _ = carry
    return (step < cfg.chunk_steps) & jnp.any(s.live & ~s.done)

  def body(carry):
    step, s, emitted, row_rounds = carry
    row_rounds = row_rounds + jnp.sum(s.live & ~s.done).astype(jnp.int32)
    if arm.is_combined:
      s, n = _combined_step(target, drafter, cfg, arm, s, seed, bank_HxN, bank_len_H)
    elif arm.is_lookup and arm.is_tree:
      chains, valid = _lookup_tree_chains(s, bank_HxN, bank_len_H, arm.depth, arm.topk,
                                          cfg.lookup_max_order)
      s, n = _verify_tree(target, drafter, cfg, s, seed, *_chains_to_tree(s.token, chains, valid),
                          s.draft_cache, extend_current=True)
    elif arm.is_lookup:
      drafts = _lookup_drafts(s, bank_HxN, bank_len_H, arm.depth, cfg.lookup_max_order)
      s, n = _verify_drafts(target, drafter, cfg, s, seed, drafts)
    elif arm.is_tree:
      s, n = _tree_step(target, drafter, cfg, arm, s, seed)
    elif arm.depth:
      s, n = _sd_step(target, drafter, cfg, arm.depth, s, seed)
    else:
      s, n = _plain_step(target, cfg, s, seed)
    return step + 1, s, emitted + n, row_rounds

  rounds, out, emitted, row_rounds = jax.lax.while_loop(
      cond, body, (jnp.int32(0), s, jnp.int32(0), jnp.int32(0)))
  if drafter is not None and not arm.depth:
    out = _drafter_catch_up(target, drafter, cfg, s.pos, s.gen, out)
  return out, emitted, rounds, row_rounds


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


def insert(s: Slots, new: Slots, rows_K) -> Slots:
  """Rows rows_K of `s` become the rows of `new` (indices >= bucket are padding, dropped)."""
  put = lambda old, upd: old.at[rows_K].set(upd, mode="drop")
  return jax.tree.map(put, s, new)


def compact(s: Slots, rows_K, live_K) -> Slots:
  """A smaller bucket holding rows rows_K of `s` (in that order); rows not live_K are free."""
  s = jax.tree.map(lambda x: jnp.take(x, rows_K, axis=0), s)
  return s._replace(live=live_K, done=s.done | ~live_K)


def empty(shape: Slots) -> Slots:
  s = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shape)
  return s._replace(done=jnp.ones(s.done.shape, bool))
