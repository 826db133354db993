"""Rollout engine: schedule independence, compaction, exact speculative decoding (gumbel),
speculative sampling in distribution (rejection), the mid-rollout SD switch, no compile after
warm-up, the tuner, and bad input. All in batch-invariant numerics (what makes them bitwise)."""

import collections
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import nnx
from jax.sharding import PartitionSpec as P

from tests.conftest import on_devices
from tlt_jax import ops
from tlt_jax.model.drafter import Drafter
from tlt_jax.model.transformer import ModelConfig, Transformer
from tlt_jax.rollout import drafter_text
from tlt_jax.rollout import programs as programs_lib
from tlt_jax.rollout import steps as steps_lib
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.tuner import (OFF, Arm, Tuner, combined_arm, default_arms, history_arm,
                                   history_tree_arm, lookup_arm, lookup_tree_arm, parse_arms,
                                   tree_arm)

VOCAB = 12
EOS = 3
CFG = EngineConfig(buckets=(1, 2, 4, 8), max_prompt_len=6, max_new_tokens=10, chunk_steps=3,
                   sampling=SamplingParams(temperature=1.0), eos_ids=(EOS,),
                   arms=(Arm(OFF), Arm("chain2", 2), Arm("chain4", 4), tree_arm(3, 2, 5),
                         tree_arm(2, 3, 7)))
PROMPTS = [[1, 5, 7], [2], [4, 4, 9, 10, 11], [6, 8], [7, 1, 1, 2], [9]]


@functools.lru_cache(maxsize=None)
def _models():
  cfg = ModelConfig(arch="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True)
  target = Transformer(cfg, nnx.Rngs(0))
  emb = target.embed_tokens.embedding
  emb.set_value(emb.get_value() * 40.0)  # logits of a few units: a non-trivial distribution
  return target, Drafter(cfg, nnx.Rngs(1))


def _run(cfg=CFG, *, drafter=True, **kwargs):
  target, draft = _models()
  with ops.numerics_mode("batch_invariant"):
    engine = RolloutEngine(target, cfg, draft if drafter else None)
    samples = engine.generate(PROMPTS, group_size=2, **kwargs)
  return engine, samples


def _assert_same(a, b):
  assert [s.sample_id for s in a] == [s.sample_id for s in b]
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x.tokens, y.tokens, err_msg=f"sample {x.sample_id}")
    np.testing.assert_array_equal(x.logprobs, y.logprobs, err_msg=f"sample {x.sample_id}")
    assert x.finish_reason == y.finish_reason


@functools.lru_cache(maxsize=None)
def _plain():
  return _run(arm=OFF)


def test_plain_rollout_outputs_are_well_formed():
  engine, samples = _plain()
  assert len(samples) == 2 * len(PROMPTS)
  for s in samples:
    assert s.prompt == PROMPTS[s.sample_id // 2]
    assert 1 <= len(s.tokens) <= CFG.max_new_tokens and len(s.logprobs) == len(s.tokens)
    assert np.all(s.logprobs <= 0.0)
    assert (s.finish_reason == "eos") == (s.tokens[-1] == EOS)
    assert EOS not in s.tokens[:-1]
    assert s.finish_reason == "eos" or len(s.tokens) == CFG.max_new_tokens
    assert s.hidden.shape == (CFG.max_new_tokens, 32)
  assert {s.finish_reason for s in samples} == {"eos", "length"}  # both paths exercised
  # 12 samples through an 8-row bucket: continuous batching refilled freed slots.
  assert engine.prefill_rows == 12 and max(t.bucket for t in engine.trace) == 8


def test_samples_do_not_depend_on_slot_bucket_chunk_or_refill_order():
  _, reference = _plain()
  other = dataclasses.replace(CFG, buckets=(1, 4, 16), chunk_steps=5, compaction=False)
  order = list(np.random.default_rng(0).permutation(12))
  _, samples = _run(other, arm=OFF, order=order)
  _assert_same(reference, samples)


def test_compaction_changes_no_output():
  engine, reference = _plain()
  assert len({t.bucket for t in engine.trace}) > 1  # the reference run did compact
  _, samples = _run(dataclasses.replace(CFG, compaction=False), arm=OFF)
  _assert_same(reference, samples)


@pytest.mark.parametrize("arm", ["chain2", "chain4", "tree3_2_5", "tree2_3_7"])
def test_gumbel_speculative_decoding_is_bitwise_plain_decoding(arm):
  _, reference = _plain()
  engine, samples = _run(arm=arm)
  _assert_same(reference, samples)
  sd_chunks = [t for t in engine.trace if t.arm == arm]
  assert sd_chunks and max(t.accept_len for t in sd_chunks) > 1.0  # some drafts were accepted


HISTORY_CFG = dataclasses.replace(
    CFG, arms=(Arm(OFF), Arm("chain2", 2), history_arm(2), history_arm(4),
               history_tree_arm(3, 3)))


@pytest.mark.parametrize("arm,drafter", [("history_chain2", False), ("history_chain4", True),
                                         ("history_tree3_3", False), ("history_tree3_3", True)])
def test_history_chains_are_bitwise_plain_decoding(arm, drafter):
  """Chains drafted on the host from the group's text, verified on device one at a time or as
  the tree of several: the same tokens and log-probs as plain decoding, with or without a
  learned drafter beside them."""
  _, reference = _plain()
  engine, samples = _run(HISTORY_CFG, drafter=drafter, arm=arm)
  _assert_same(reference, samples)
  chunks = [t for t in engine.trace if t.arm == arm]
  assert chunks and all(t.rounds == 1 for t in chunks)  # one verify round per host trip
  assert max(t.accept_len for t in chunks) > 1.0  # siblings' text was drafted and accepted
  assert engine.history.stats.proposals > 0 and not engine.history.live


LOOKUP_CFG = dataclasses.replace(
    CFG, arms=(Arm(OFF), Arm("chain2", 2), lookup_arm(2), lookup_arm(4),
               lookup_tree_arm(3, 3), lookup_tree_arm(2, 2), combined_arm(3, 2)), lookup_bank=3)


@pytest.mark.parametrize("arm,drafter", [("lookup_chain2", False), ("lookup_chain4", True),
                                         ("lookup_tree3_3", False), ("lookup_tree2_2", True),
                                         ("combined_tree3_2", True)])
def test_lookup_chains_are_bitwise_plain_decoding(arm, drafter):
  """Chains looked up on device in the bucket's rows and the bank, several rounds per chunk,
  verified one by one, as the tree of several distinct chains, or in one tree with the learned
  drafter's chain (combined): the same tokens and log-probs as plain decoding, with or without
  a learned drafter (whose cache the rounds keep current) beside them."""
  _, reference = _plain()
  engine, samples = _run(LOOKUP_CFG, drafter=drafter, arm=arm)
  _assert_same(reference, samples)
  chunks = [t for t in engine.trace if t.arm == arm]
  assert chunks and max(t.rounds for t in chunks) == LOOKUP_CFG.chunk_steps
  # Without an accepted draft a row emits at most one token per round it is active in.
  assert sum(t.emitted for t in chunks) > sum(t.row_rounds for t in chunks)
  # The newest 3 of the 12 finished responses, and all 12 as earlier responses to their
  # prompts (2 per prompt).
  assert len(engine.bank.recent) == 3
  for prompt, tokens in engine.bank.recent:
    assert any(np.array_equal(tokens, x.tokens) and tuple(x.prompt) == prompt for x in samples)
  assert [engine.holds_prompt(p) for p in PROMPTS] == [2] * len(PROMPTS)


def test_a_revisited_prompt_drafts_from_its_earlier_responses():
  """A prompt decoded again (same seed: the same tokens) after other prompts filled the bank of
  the newest responses: with earlier responses kept per prompt its chunks get them and accept
  every draft the response allows; with the newest responses only they are gone. Both are
  bitwise plain decoding."""
  target, _ = _models()
  accept = {}
  for kept in (0, 1 << 20):
    cfg = dataclasses.replace(LOOKUP_CFG, lookup_bank=2, lookup_history_tokens=kept)
    with ops.numerics_mode("batch_invariant"):
      engine = RolloutEngine(target, cfg, None)
      engine.generate(PROMPTS[:1], group_size=2, arm="lookup_chain4")
      engine.generate(PROMPTS[1:5], arm=OFF)  # 4 other responses: the newest 2 fill the bank
      first_chunk = len(engine.trace)
      again = engine.generate(PROMPTS[:1], group_size=2, arm="lookup_chain4")
      reference = RolloutEngine(target, cfg, None).generate(PROMPTS[:1], group_size=2, arm=OFF)
    _assert_same(reference, again)
    chunks = engine.trace[first_chunk:]
    accept[kept] = sum(t.emitted for t in chunks) / sum(t.row_rounds for t in chunks)
    assert engine.holds_prompt(PROMPTS[0]) == (2 if kept else 0)  # at most a bank's worth
  assert accept[1 << 20] == 5.0 - 1.0 and accept[0] < 3.0, accept


def test_a_restarted_engine_drafts_from_the_text_it_restored(tmp_path):
  """The revisit above across a restart: the first engine's history and bank spilled
  (`rollout.drafter_text`) and restored into a new engine, which then drafts the prompt's
  earlier responses as the first would (every draft accepted); a new engine without them
  drafts from its siblings only. Both bitwise plain decoding."""
  target, _ = _models()
  cfg = dataclasses.replace(LOOKUP_CFG, lookup_bank=2, lookup_history_tokens=1 << 20,
                            arms=LOOKUP_CFG.arms + (history_arm(4),))
  path = str(tmp_path / "group_0.npz")
  with ops.numerics_mode("batch_invariant"):
    first = RolloutEngine(target, cfg, None)
    first.generate(PROMPTS[:1], group_size=2, arm="lookup_chain4")
    first.generate(PROMPTS[1:5], arm=OFF)
    drafter_text.spill(first.history, first.bank, path)
    reference = RolloutEngine(target, cfg, None).generate(PROMPTS[:1], group_size=2, arm=OFF)
    accept = {}
    for restored in (True, False):
      for arm in ("lookup_chain4", "history_chain4"):
        engine = RolloutEngine(target, cfg, None)
        if restored:
          drafter_text.restore(engine.history, engine.bank, path)
          assert engine.holds_prompt(PROMPTS[0]) == first.holds_prompt(PROMPTS[0]) == 2 + 2
        _assert_same(reference, engine.generate(PROMPTS[:1], group_size=2, arm=arm))
        accept[restored, arm] = (sum(t.emitted for t in engine.trace)
                                 / sum(t.row_rounds for t in engine.trace))
  assert accept[True, "lookup_chain4"] == 5.0 - 1.0 and accept[False, "lookup_chain4"] < 3.0
  assert accept[True, "history_chain4"] > accept[False, "history_chain4"], accept


def _reference_lookup(rows, bank, depth, max_order, width=1):
  """A plain-Python search for `_lookup_drafts`: for each row, every (source, end) in order
  (rows, then bank), scored by match length of the row's newest tokens (up to max_order),
  then by continuation tokens available (up to depth); first best wins. Returns each row's
  continuation (shorter than depth where the source ends), None where nothing matched.
  width > 1: a list of up to `width` continuations per row, each the best one that is not the
  start of a continuation chosen before it (`_lookup_tree_chains`)."""
  corpus = list(rows) + list(bank)
  out = []
  for seq in rows:
    chosen = []
    for _ in range(width):
      best, best_score = None, -1
      for src in corpus:
        for j in range(len(src)):
          m = 0
          while m < max_order and m < len(seq) and j - m >= 0 and src[j - m] == seq[-1 - m]:
            m += 1
          avail = len(src) - 1 - j
          cont = list(src[j + 1:j + 1 + depth])
          if any(c[:len(cont)] == cont for c in chosen):
            continue
          if m > 0 and avail > 0 and m * (depth + 1) + min(avail, depth) > best_score:
            best, best_score = cont, m * (depth + 1) + min(avail, depth)
      if best is None:
        break
      chosen.append(best)
    out.append(chosen if width > 1 else (chosen[0] if chosen else None))
  return out


def _lookup_case():
  """Rows (prompt + response so far) and a bank over 4 token ids, so matches tie often; the
  last row's newest token occurs nowhere else."""
  rng = np.random.default_rng(0)
  P, N, H = 5, 9, 3
  prompts = [rng.integers(0, 4, size=rng.integers(1, P + 1)).tolist() for _ in range(6)]
  responses = [rng.integers(0, 4, size=rng.integers(1, N + 1)).tolist() for _ in range(6)]
  bank = [rng.integers(0, 4, size=rng.integers(1, N + 1)).tolist() for _ in range(H)]
  prompts.append([5, 1])  # token 6 occurs nowhere else: nothing to look up
  responses.append([2, 6])
  pad = lambda xs, n: np.array([x + [0] * (n - len(x)) for x in xs], np.int32)
  gen = np.array([len(r) for r in responses], np.int32)
  B = len(prompts)
  s = steps_lib.Slots(
      cache=None, draft_cache=None, token=jnp.asarray([r[-1] for r in responses]),
      pos=jnp.asarray([len(p) for p in prompts]) + gen - 1, prev_hidden=jnp.zeros((B, 1)),
      sample_id=jnp.arange(B), gen=jnp.asarray(gen), max_new=jnp.full((B,), N),
      done=jnp.zeros((B,), bool), live=jnp.ones((B,), bool),
      out_tokens=jnp.asarray(pad(responses, N)), out_logprobs=jnp.zeros((B, N)),
      out_hidden=jnp.zeros((B, N, 1)), prompt_tokens=jnp.asarray(pad(prompts, P)))
  bank_args = (jnp.asarray(pad(bank, N)), jnp.asarray([len(b) for b in bank]))
  rows = [p + r for p, r in zip(prompts, responses)]
  return s, bank_args, rows, bank, B * (P + N)


@pytest.mark.parametrize("rows_per_block", [None, 1, 3])
def test_lookup_drafts_match_a_plain_search(rows_per_block):
  """The whole corpus in one block, and walked a block of rows at a time (3 leaves a partial
  last block): the same drafts, the first of equal matches still winning across blocks."""
  depth, max_order = 3, 3
  s, bank_args, rows, bank, row_elements = _lookup_case()
  block = {} if rows_per_block is None else {"block_elements": rows_per_block * row_elements}
  drafts = steps_lib._lookup_drafts(s, *bank_args, depth, max_order, **block)
  expected = _reference_lookup(rows, bank, depth, max_order)
  assert any(w is None for w in expected) and any(w and len(w) == depth for w in expected)
  assert any(w and len(w) < depth for w in expected)  # a source that ends inside the draft
  # Past the end of the matched source a draft is 0 (verification rejects it unless the
  # target would emit 0 there).
  for b, (got, want) in enumerate(zip(np.asarray(drafts).tolist(), expected)):
    assert got == (want or []) + [0] * (depth - len(want or [])), b


@pytest.mark.parametrize("rows_per_block", [None, 2])
def test_lookup_tree_chains_match_a_plain_search(rows_per_block):
  """Each row's best continuations, each not the start of one chosen before it."""
  depth, width, max_order = 3, 3, 2
  s, bank_args, rows, bank, row_elements = _lookup_case()
  block = {} if rows_per_block is None else {"block_elements": rows_per_block * row_elements}
  chains, valid = steps_lib._lookup_tree_chains(s, *bank_args, depth, width, max_order, **block)
  expected = _reference_lookup(rows, bank, depth, max_order, width)
  assert any(len(w) == width for w in expected) and any(len(w) < width for w in expected)
  for b, (got, ok, want) in enumerate(zip(np.asarray(chains).tolist(),
                                          np.asarray(valid).tolist(), expected)):
    assert ok == [i < len(want) for i in range(width)], b
    for i, w in enumerate(want):
      assert got[i] == w + [-1] * (depth - len(w)), (b, i)


def _walk(tokens, parents, path):
  """Node indices a verify walk visits following `path` from the root: at each step the first
  node whose parent is the current one and whose token is the path's next (None: no such)."""
  cur, visited = 0, [0]
  for t in path:
    nxt = [i for i in range(len(tokens)) if parents[i] == cur and tokens[i] == t]
    if not nxt:
      return None
    cur = nxt[0]
    visited.append(cur)
  return visited


def test_lookup_chains_become_the_trie_of_their_tokens():
  """Every prefix of every valid chain is walkable from the root (with the ancestors the
  verify's attention layout needs), nothing else is, and the walk can branch where chains
  differ: against a plain-Python trie of the same chains."""
  chains = [[[1, 2, 3], [1, 2, 4], [5, 6, -1], [1, 7, 8]],    # branches at depth 1 and 2
            [[3, 3, 3], [0, 0, 0], [9, 9, 9], [4, -1, -1]]]   # chain 1 and 2 invalid
  valid = [[True, True, True, True], [True, False, False, True]]
  tok, par, dep, anc = (np.asarray(x).tolist() for x in steps_lib._chains_to_tree(
      jnp.asarray([11, 12]), jnp.asarray(chains), jnp.asarray(valid)))
  for b in range(2):
    assert tok[b][0] == [11, 12][b] and par[b][0] == -1 and dep[b][0] == 0
    trie = set()
    for chain, ok in zip(chains[b], valid[b]):
      real = [t for t in chain if t >= 0] if ok else []
      trie |= {tuple(real[:n]) for n in range(1, len(real) + 1)}
    for prefix in trie:
      visited = _walk(tok[b], par[b], prefix)
      assert visited is not None, (b, prefix)
      node = visited[-1]
      assert dep[b][node] == len(prefix) and anc[b][node][:len(prefix) + 1] == visited
    # The nodes a walk can reach are exactly the trie's (duplicates are never reached first).
    reachable = {tuple(tok[b][i] for i in _path(par[b], i)) for i in range(1, len(tok[b]))
                 if par[b][i] >= 0}
    assert reachable == trie, b
    K = len(chains[b][0])
    for w, (chain, ok) in enumerate(zip(chains[b], valid[b])):
      for k, t in enumerate(chain):
        i = 1 + w * K + k
        if not ok or t < 0:  # not a node: token 0 (a real id to embed), no parent, depth 0
          assert (tok[b][i], par[b][i], dep[b][i]) == (0, -1, 0), (b, w, k)


def _path(parents, i):
  """Node indices from the root's child down to node i."""
  path = []
  while i > 0:
    path.append(i)
    i = parents[i]
  return path[::-1]


def test_the_tuner_free_over_history_and_learned_arms_is_bitwise_plain():
  _, reference = _plain()
  engine, samples = _run(HISTORY_CFG)
  _assert_same(reference, samples)
  # Unseen arms are tried first: plain, learned and history chunks all ran in one rollout.
  assert {OFF, "chain2", "history_chain2"} <= {t.arm for t in engine.trace}
  assert [a.name for a in parse_arms("chain2, history_chain4")] == [
      OFF, "chain2", "history_chain4"]
  with pytest.raises(ValueError, match="history arms draft depth >= 1"):
    parse_arms("history_chain0")
  tree, combined = parse_arms("lookup_tree4_3,combined_tree4_2")[1:]
  assert (tree.verify_tokens, combined.verify_tokens) == (13, 13)
  assert not tree.needs_drafter and combined.needs_drafter and combined.reads_bank
  for bad in ("lookup_tree3_0", "combined_tree4_0", "lookup_tree0_2"):
    with pytest.raises(ValueError, match=bad):
      parse_arms(bad)


def test_switching_sd_on_mid_rollout_needs_no_reprefill():
  _, reference = _plain()
  engine, samples = _run(sd_after_rounds=2)
  _assert_same(reference, samples)
  arms = [t.arm for t in engine.trace]
  assert arms[:2] == [OFF, OFF] and any(a != OFF for a in arms[2:])
  assert engine.prefill_rows == 12  # each prompt prefilled once: the drafter cache was current


def test_plain_chunks_bring_the_drafter_cache_up_to_date():
  """After plain chunks (one catch-up drafter forward each, not a drafter step per token), the
  drafter's cache at every slot before a row's position equals one drafter forward over the
  whole sequence: prompt with zero features, then each emitted token with the target feature
  that produced it. Bitwise, with the drafter under the batch-invariant numerics."""
  target, draft = _models()
  cfg = dataclasses.replace(CFG, drafter_numerics="policy", eos_ids=())
  prompts = PROMPTS[:4]
  lengths = np.array([len(p) for p in prompts], np.int32)
  padded = np.array([p + [0] * (cfg.max_prompt_len - len(p)) for p in prompts], np.int32)
  B, S = len(prompts), cfg.num_slots

  @jax.jit
  def prefill_and_decode():
    s = steps_lib.prefill(target, draft, cfg, jnp.asarray(padded), jnp.asarray(lengths),
                          jnp.arange(B, dtype=jnp.int32),
                          jnp.array([10, 4, 10, 7], jnp.int32), jnp.int32(0))
    for _ in range(3):  # chunks of 3 steps; rows 1 and 3 finish (max_new) inside a chunk
      s, *_ = steps_lib.decode_chunk(target, draft, cfg, Arm(OFF), s, jnp.int32(0))
    return s

  with ops.numerics_mode("batch_invariant"):
    s = prefill_and_decode()
    pos, gen = np.asarray(s.pos), np.asarray(s.gen)
    assert list(gen) == [10, 4, 10, 7] and list(pos) == list(lengths + gen - 1)
    # Reference rows: [prompt, emitted tokens already fed to the target], zero-padded to S.
    tokens_BxS = np.zeros((B, S), np.int32)
    features_BxSxD = np.zeros((B, S, target.cfg.hidden_size), np.float32)
    for b in range(B):
      n = int(gen[b]) - 1
      tokens_BxS[b, :pos[b]] = prompts[b] + np.asarray(s.out_tokens[b, :n]).tolist()
      features_BxSxD[b, lengths[b]:pos[b]] = np.asarray(s.out_hidden[b, :n])
    _, _, ref = jax.jit(lambda t, f: draft(target, t, f, draft.init_cache(B, S),
                                           jnp.zeros((B,), jnp.int32)))(tokens_BxS, features_BxSxD)
  for b in range(B):
    for got, want in ((s.draft_cache.k[0], ref.k[0]), (s.draft_cache.v[0], ref.v[0])):
      np.testing.assert_array_equal(np.asarray(got[b, :pos[b]]), np.asarray(want[b, :pos[b]]),
                                    err_msg=f"row {b}")


def test_history_rounds_keep_the_drafter_cache_up_to_date():
  """After rounds drafted on the host (the drafter never ran on their current token), the
  drafter's cache before each row's position equals one drafter forward over the sequence, as
  after plain chunks: a learned arm chosen next drafts from a current cache."""
  target, draft = _models()
  cfg = dataclasses.replace(HISTORY_CFG, drafter_numerics="policy", eos_ids=())
  prompts = PROMPTS[:4]
  lengths = np.array([len(p) for p in prompts], np.int32)
  padded = np.array([p + [0] * (cfg.max_prompt_len - len(p)) for p in prompts], np.int32)
  B, S = len(prompts), cfg.num_slots
  # Random drafts over a 12-token vocabulary: a few accepted, most rejected.
  drafts = np.random.default_rng(0).integers(0, VOCAB, (12, B, 2)).astype(np.int32)

  @jax.jit
  def prefill_and_verify(drafts):
    s = steps_lib.prefill(target, draft, cfg, jnp.asarray(padded), jnp.asarray(lengths),
                          jnp.arange(B, dtype=jnp.int32),
                          jnp.array([10, 4, 10, 7], jnp.int32), jnp.int32(0))
    for i in range(12):  # at least one token per round: every row reaches its budget
      s, *_ = steps_lib.history_round(target, draft, cfg, s, jnp.int32(0), drafts[i])
    return s

  with ops.numerics_mode("batch_invariant"):
    s = prefill_and_verify(drafts)
    pos, gen = np.asarray(s.pos), np.asarray(s.gen)
    assert list(gen) == [10, 4, 10, 7] and list(pos) == list(lengths + gen - 1)
    tokens_BxS = np.zeros((B, S), np.int32)
    features_BxSxD = np.zeros((B, S, target.cfg.hidden_size), np.float32)
    for b in range(B):
      n = int(gen[b]) - 1
      tokens_BxS[b, :pos[b]] = prompts[b] + np.asarray(s.out_tokens[b, :n]).tolist()
      features_BxSxD[b, lengths[b]:pos[b]] = np.asarray(s.out_hidden[b, :n])
    _, _, ref = jax.jit(lambda t, f: draft(target, t, f, draft.init_cache(B, S),
                                           jnp.zeros((B,), jnp.int32)))(tokens_BxS, features_BxSxD)
  for b in range(B):
    for got, want in ((s.draft_cache.k[0], ref.k[0]), (s.draft_cache.v[0], ref.v[0])):
      np.testing.assert_array_equal(np.asarray(got[b, :pos[b]]), np.asarray(want[b, :pos[b]]),
                                    err_msg=f"row {b}")


def test_no_compile_after_warm_up():
  target, draft = _models()
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, *a, **k: compiles.append(name) if "backend_compile" in name else None)
  with ops.numerics_mode("batch_invariant"):
    small = dataclasses.replace(CFG, buckets=(1, 2), arms=(Arm(OFF), Arm("chain2", 2)))
    engine = RolloutEngine(target, small, draft)
    built = engine.pool.warm_up()
    assert built > 0
    compiles.clear()
    samples = engine.generate(PROMPTS[:3], group_size=1)  # refill, compaction, both arms
  assert compiles == [] and engine.pool.compiles == built
  assert len(samples) == 3 and {t.arm for t in engine.trace} == {OFF, "chain2"}


def test_warm_up_through_a_queue_compiles_in_its_threads_and_matches_one_by_one():
  """`warm_up(queue)` lowers now and compiles in the queue's threads (the job's trainer builds
  its programs meanwhile); only `queue.wait()` installs the programs. The rollout after it
  compiles nothing and is bitwise the rollout of programs compiled one at a time."""
  import threading

  from tlt_jax.compile_queue import CompileQueue
  from tlt_jax.rollout.programs import clear_shared_programs

  target, draft = _models()
  compile_threads = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, *a, **k: compile_threads.append(threading.current_thread().name)
      if "backend_compile" in name else None)
  small = dataclasses.replace(CFG, buckets=(1, 2), arms=(Arm(OFF), Arm("chain2", 2)))
  outputs = []
  for workers in (1, 2):
    clear_shared_programs()  # the second engine must compile, not take the first's programs
    with ops.numerics_mode("batch_invariant"):
      engine = RolloutEngine(target, small, draft)
      queue = CompileQueue(workers)
      compile_threads.clear()
      built = engine.pool.warm_up(queue)
      assert built == len(engine.pool.program_keys()) and not engine.pool.programs
      seconds = queue.wait()
      assert set(engine.pool.programs) == set(engine.pool.program_keys())
      assert sum(seconds.values()) > 0 and "decode:chain2" in seconds
      on_pool = {name.startswith("tlt-compile") for name in compile_threads}
      assert on_pool == ({False} if workers == 1 else {True}), (workers, compile_threads)
      compile_threads.clear()
      outputs.append(engine.generate(PROMPTS[:3], group_size=2, seed=5))
      assert compile_threads == []
  for one, two in zip(*outputs, strict=True):
    np.testing.assert_array_equal(one.tokens, two.tokens)
    np.testing.assert_array_equal(one.logprobs, two.logprobs)


def test_tensor_parallel_groups_are_bitwise_the_unsplit_engine():
  """Two rollout groups of two devices, each splitting the model over its devices (exact tensor
  parallelism, the Pallas kernels), decoding with a tree: every token and log-prob is bitwise
  the single-device engine's plain decoding (per-query cache layouts, accepted paths moved and
  compaction, all within caches split over the KV heads)."""
  from tlt_jax.mesh import group_sharding
  from tlt_jax.rollout.groups import GroupedRollout

  target, draft = _models()
  cfg = dataclasses.replace(CFG, buckets=(2, 4))  # few programs: Pallas interprets on CPU
  # The reference on the groups' platform too (placed on one of their devices): the host's on a
  # single-accelerator machine, where a reference on the accelerator would be another backend.
  with on_devices(4) as devices, ops.numerics_mode("batch_invariant", "pallas"):
    reference = RolloutEngine(target, cfg, draft, placement=group_sharding(devices[:1])).generate(
        PROMPTS, group_size=2, arm=OFF)
    grouped = GroupedRollout(target, cfg, [devices[:2], devices[2:4]], draft,
                             tensor_parallel=True)
    samples = grouped.generate(PROMPTS, group_size=2, arm="tree3_2_5")
    prefill = grouped.engines[1].pool.get("prefill", 4)
    with pytest.raises(ValueError, match="devices per rollout group=4 must divide num_heads=4 "
                                         "and num_kv_heads=2"):
      RolloutEngine(target, cfg, draft, placement=group_sharding(devices[:4]),
                    tensor_parallel=True)
  _assert_same(reference, sorted(samples, key=lambda s: s.sample_id))
  chunks = [t for e in grouped.engines for t in e.trace]
  assert {t.arm for t in chunks} == {"tree3_2_5"} and {t.bucket for t in chunks} == {2, 4}
  assert max(t.accept_len for t in chunks) > 1.0  # some drafts were accepted
  # The second group's KV caches (target and drafter) are split over its two devices' heads.
  for cache in (prefill.output_shardings.cache, prefill.output_shardings.draft_cache):
    assert cache.k[0].spec == P(None, None, "model"), cache.k[0]
    assert list(cache.k[0].mesh.devices.flat) == devices[2:4]


def test_a_revisited_prompt_is_decoded_by_the_group_holding_its_responses():
  """Two rollout groups: the second batch holds the first's prompts in another order, and each
  goes back to the group that decoded it (where a contiguous split would swap them), still
  bitwise the single engine's plain decoding of that batch under the same sample ids."""
  from tlt_jax.mesh import group_sharding
  from tlt_jax.rollout.groups import GroupedRollout

  target, _ = _models()
  first, second = PROMPTS[:4], [PROMPTS[2], PROMPTS[3], PROMPTS[0], PROMPTS[5], PROMPTS[1]]
  with on_devices(2) as devices, ops.numerics_mode("batch_invariant"):
    grouped = GroupedRollout(target, LOOKUP_CFG, [devices[:1], devices[1:]])
    assert grouped.route(first) == [[0, 1], [2, 3]]  # nothing held yet: the even split
    grouped.generate(first, group_size=2, arm="lookup_chain2")
    # PROMPTS[2], [3] to group 1 and [0], [1] to group 0; the new PROMPTS[5] where room is left.
    assert grouped.route(second) == [[2, 3, 4], [0, 1]]
    samples = grouped.generate(second, group_size=2, arm="lookup_chain2")
    reference = RolloutEngine(target, LOOKUP_CFG, None, placement=group_sharding(devices[:1]))
    reference = reference.generate(second, group_size=2, arm=OFF)
  _assert_same(reference, samples)


def _exact_first_three_token_probs(target, prompt, params):
  """p(t1, t2, t3 | prompt) from plain forwards (the distribution rejection sampling must hit).
  A sample ends at EOS: its remaining tokens are counted as 0, so the cell (EOS, 0, 0) holds
  p(t1 = EOS) and (a, EOS, 0) holds p(a, EOS)."""
  from tlt_jax.rollout.sampling import masked_logits
  P = len(prompt)
  with ops.numerics_mode("batch_invariant"):
    seqs = np.array([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)], np.int32)
    logits = target(jnp.asarray(seqs)).logits_BxTxV
    probs = lambda x: np.asarray(jax.nn.softmax(masked_logits(x, params)), np.float64)
    p1 = probs(logits[0, P - 1][None])[0]                        # [V]
    p2 = probs(logits[::VOCAB, P])                               # [V, V]: row a = prompt + [a]
    p3 = probs(logits[:, P + 1]).reshape(VOCAB, VOCAB, VOCAB)    # [V, V, V]
  joint = p1[:, None, None] * p2[:, :, None] * p3
  joint[:, EOS] = 0.0
  joint[:, EOS, 0] = p1 * p2[:, EOS]  # ended after two tokens
  joint[EOS] = 0.0
  joint[EOS, 0, 0] = p1[EOS]          # ended after one
  return joint / joint.sum()  # f32 softmax rounding


def _first_three_counts(engine, prompt, n):
  with ops.numerics_mode("batch_invariant"):
    samples = engine.generate([prompt], group_size=n, arm="chain2", max_new_tokens=3)
  counts = np.zeros((VOCAB, VOCAB, VOCAB))
  for s in samples:
    counts[tuple(np.pad(s.tokens, (0, 3 - len(s.tokens))))] += 1
  return counts


def _chi2_pvalue(counts, probs):
  """Chi-square over (t1, t2, t3) cells; cells expecting fewer than 5 are pooled into one."""
  impossible = probs == 0.0
  if counts[impossible].any():
    return 0.0
  counts, probs = counts[~impossible], probs[~impossible]
  keep = probs * counts.sum() >= 5
  observed, expected = counts[keep], probs[keep] * counts.sum()
  if not keep.all():
    observed = np.append(observed, counts[~keep].sum())
    expected = np.append(expected, probs[~keep].sum() * counts.sum())
  return scipy.stats.chisquare(observed, expected).pvalue


def _rejection_engine():
  target, draft = _models()
  cfg = dataclasses.replace(CFG, buckets=(64,), verification="rejection", max_new_tokens=3,
                            chunk_steps=1, arms=(Arm(OFF), Arm("chain2", 2)))
  return target, RolloutEngine(target, cfg, draft)


PROMPT = [1, 5, 7]


def test_rejection_sampling_matches_the_target_distribution():
  """The first token comes from the prefill; the next two from one chain2 round: the first and
  the second draft position (accepted with prob min(1, p/q), else a sample of
  norm(max(p - q, 0))), or the bonus / a second round after a rejection."""
  target, engine = _rejection_engine()
  counts = _first_three_counts(engine, PROMPT, 20_000)
  assert _chi2_pvalue(counts, _exact_first_three_token_probs(target, PROMPT, CFG.sampling)) > 0.01


def _broken_rule(monkeypatch, position):
  """The acceptance rule with every draft at `position` (0-based) accepted: the test above must
  fail for a fault at either draft position."""
  original = steps_lib._rejection_emit

  def accept_at_position(s, seed, depth, drafts_BxK, *rest):
    emitted, accept = original(s, seed, depth, drafts_BxK, *rest)
    accept = accept.at[:, position].set(True)
    first_reject = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
    # From the first rejection on, `emitted` is already the resample (or the bonus).
    i = jnp.arange(depth + 1)[None, :]
    drafts = jnp.concatenate([drafts_BxK, emitted[:, -1:]], axis=1)  # last column never taken
    return jnp.where(i < first_reject[:, None], drafts, emitted), accept

  monkeypatch.setattr(steps_lib, "_rejection_emit", accept_at_position)
  # Engines share compiled programs: the patched rule gets programs of its own, dropped after.
  monkeypatch.setattr(programs_lib, "_SHARED_PROGRAMS", collections.OrderedDict())


@pytest.mark.parametrize("position", [0, 1])
def test_a_broken_acceptance_rule_fails_the_distribution_test(monkeypatch, position):
  _broken_rule(monkeypatch, position)
  target, engine = _rejection_engine()
  counts = _first_three_counts(engine, PROMPT, 20_000)
  assert _chi2_pvalue(counts, _exact_first_three_token_probs(target, PROMPT, CFG.sampling)) < 0.01


@pytest.mark.parametrize("arm", ["chain2", "chain4"])
def test_rejection_verification_at_temperature_0_is_greedy_decoding(arm):
  """T = 0 is greedy on every path: speculative sampling with rejection verification emits the
  plain greedy decode token for token (it sampled from softmax(logits) instead: a check found
  71 of 200 positions off greedy)."""
  greedy = dataclasses.replace(CFG, sampling=SamplingParams(temperature=0.0))
  _, reference = _run(greedy, arm=OFF)
  rejection = dataclasses.replace(greedy, verification="rejection",
                                  arms=(Arm(OFF), Arm("chain2", 2), Arm("chain4", 4)))
  engine, samples = _run(rejection, arm=arm)
  assert any(t.arm == arm for t in engine.trace)
  _assert_same(reference, samples)


def test_tuner_picks_off_when_sd_is_slower_and_the_best_arm_otherwise():
  arms = default_arms((2, 4))
  tuner = Tuner(arms, (1, 64), epsilon=0.0, window=8, max_verify_tokens_per_bucket=256)
  assert tuner.allowed[64] == [OFF, "chain2"]  # chain4 x 64 rows exceeds the memory bound
  speed = {1: {OFF: 100, "chain2": 180, "chain4": 250}, 64: {OFF: 1000, "chain2": 700}}
  for _ in range(20):
    for bucket in (1, 64):
      arm = tuner.choose(bucket)
      tuner.update(bucket, arm, speed[bucket][arm.name], 1.0)
  assert tuner.best(1) == "chain4" and tuner.best(64) == OFF
  restored = Tuner(arms, (1, 64), epsilon=0.0, window=8, max_verify_tokens_per_bucket=256)
  restored.load_state_dict(tuner.state_dict())
  assert restored.best(1) == "chain4" and restored.choose(64).name == OFF


def test_tuner_reward_is_per_live_row():
  """An arm tried while the bucket was full must not beat a faster arm tried while it drained."""
  arms = default_arms((2,))
  tuner = Tuner(arms, (8,), epsilon=0.0, window=8)
  tuner.update(8, tuner.arms[OFF], tokens=64, seconds=1.0, live=8)      # 8 tokens/row/s
  tuner.update(8, tuner.arms["chain2"], tokens=24, seconds=1.0, live=2)  # 12 tokens/row/s
  assert tuner.best(8) == "chain2"
  with pytest.raises(ValueError, match="drafter_numerics"):
    EngineConfig(drafter_numerics="bf16")


def test_a_chunk_is_timed_to_its_results_not_to_when_the_host_came_back():
  """A host loop that interleaves several engines comes back to one later than its chunk was
  ready; that wait is not the chunk's time (it made every arm as slow as the slowest chunk of
  any group, and the tuner chose slow SD arms)."""
  engine, _ = _plain()
  engine.generate(PROMPTS[:2], arm=OFF)  # every program this rollout calls, built
  engine.trace.clear()
  run = engine.rollout(PROMPTS[:2], arm=OFF)
  away_s, waits = 0.3, 0
  try:
    while True:
      _, _, ready_at = next(run)
      time.sleep(away_s)  # the host is elsewhere (another group's chunk, the host's own work)
      waits += 1
      assert ready_at.done()
  except StopIteration:
    pass
  assert waits == len(engine.trace) >= 2
  assert all(t.seconds < away_s / 2 for t in engine.trace), [t.seconds for t in engine.trace]


def test_a_chunk_after_a_prefill_only_stands_in_until_a_clean_one(monkeypatch):
  """The prefill of a refill runs on the device just before the chunk that decodes its rows, and
  that chunk's time holds it: the tuner keeps such a sample only while the arm has no other
  (charged in full, a full bucket's prefill made `off`, the arm tried first, look slower)."""
  engine, _ = _plain()
  engine.generate(PROMPTS[:2], arm=OFF)  # every program this rollout calls, built
  engine.trace.clear()
  for bucket in (1, 2):  # two prompts, one sample each; one left after compaction
    engine.tuner.rewards[bucket][OFF].clear()
    engine.tuner.provisional[bucket].clear()
  get = engine.pool.get

  @jax.jit
  def slow(leaves):  # the prefill's outputs, ready only after more device work (~0.3 s here)
    busy = jax.lax.fori_loop(0, 150, lambda _, a: jnp.tanh(a @ a), jnp.ones((512, 512)))
    return [jnp.where(busy[0, 0] > -2, x, jnp.zeros_like(x)) for x in leaves]  # busy <= 1

  def get_slow_prefill(kind, *key):
    program = get(kind, *key)
    if kind != "prefill":
      return program

    def prefill(*args):
      leaves, tree = jax.tree.flatten(program(*args))
      return jax.tree.unflatten(tree, slow(leaves))
    return prefill

  monkeypatch.setattr(engine.pool, "get", get_slow_prefill)
  engine.generate(PROMPTS[:2], arm=OFF)
  first, *rest = engine.trace
  assert first.bucket == 2 and any(t.bucket == 2 for t in rest)
  assert first.seconds > 10 * max(t.seconds for t in rest)  # the prefill, in the trace
  for bucket in (1, 2):  # the others, clean; the first one's sample gave way to them
    clean = engine.tuner.rewards[bucket][OFF]
    assert len(clean) == sum(t.bucket == bucket for t in rest)
    assert OFF not in engine.tuner.provisional[bucket]
    assert engine.tuner._figures(bucket)[OFF] == float(np.median(clean))


def test_tuner_takes_a_provisional_sample_only_until_a_clean_one():
  arms = default_arms((2,))
  tuner = Tuner(arms, (4,), epsilon=0.0, window=8)
  tuner.update(4, tuner.arms[OFF], tokens=10, seconds=1.0, provisional=True)  # prefill inside
  assert tuner.choose(4).name == "chain2"  # off has a figure: chain2 is the one unseen
  tuner.update(4, tuner.arms["chain2"], tokens=20, seconds=1.0)
  assert tuner.best(4) == "chain2"
  tuner.update(4, tuner.arms[OFF], tokens=30, seconds=1.0)  # clean: replaces the provisional
  tuner.update(4, tuner.arms[OFF], tokens=1, seconds=1.0, provisional=True)  # ignored now
  assert tuner.best(4) == OFF and list(tuner.rewards[4][OFF]) == [30.0]
  restored = Tuner(arms, (4,), epsilon=0.0, window=8)
  state = tuner.state_dict()
  restored.load_state_dict(state)
  assert restored.best(4) == OFF
  del state["provisional"]  # a checkpoint from before provisional samples
  restored.load_state_dict(state)
  assert restored.best(4) == OFF


def test_bad_input_fails_before_any_compile():
  target, draft = _models()
  engine = RolloutEngine(target, CFG, draft)
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    engine.generate([[1], []])
  with pytest.raises(ValueError, match="prompt 0 has 7 tokens; the engine's max_prompt_len is 6"):
    engine.generate([[1] * 7])
  with pytest.raises(ValueError, match="token ids outside"):
    engine.generate([[VOCAB]])
  other = ModelConfig(arch="qwen3", vocab_size=VOCAB, hidden_size=48, intermediate_size=64,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8)
  with pytest.raises(ValueError, match="hidden_size: drafter 48 != target 32"):
    RolloutEngine(target, CFG, Drafter(other, nnx.Rngs(0)))
  assert engine.pool.compiles == 0


def test_stop_strings_end_a_sample_at_the_string():
  _, reference = _plain()
  detok = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # token i -> one letter
  # A two-token string that occurs in some plain completions (not at their very end).
  text = {s.sample_id: detok(s.tokens.tolist()) for s in reference}
  stop = next(t[i:i + 2] for t in text.values() for i in range(1, len(t) - 2))
  cfg = dataclasses.replace(CFG, stop_strings=(stop,))
  target, draft = _models()
  with ops.numerics_mode("batch_invariant"):
    samples = RolloutEngine(target, cfg, draft, detokenize=detok).generate(
        PROMPTS, group_size=2, arm=OFF)
  for ref, got in zip(reference, samples):
    full = text[ref.sample_id]
    if stop in full:
      end = full.index(stop) + len(stop)
      assert got.finish_reason == "stop" and detok(got.tokens.tolist()) == full[:end]
      np.testing.assert_array_equal(got.logprobs, ref.logprobs[:end])
    else:
      np.testing.assert_array_equal(got.tokens, ref.tokens)
  with pytest.raises(ValueError, match="detokenize"):
    RolloutEngine(target, cfg, draft)


def test_gumbel_sd_with_a_trained_drafter_is_bitwise_plain_and_accepts_more():
  from tlt_jax.tlt.drafter_trainer import train_on_sequences
  target, random_drafter = _models()
  engine, reference = _plain()
  sequences = [s.prompt + s.tokens.tolist() for s in reference]
  with ops.numerics_mode("batch_invariant"):
    more = RolloutEngine(target, dataclasses.replace(CFG, seed=7), None).generate(
        PROMPTS, group_size=8, arm=OFF)
    trained = Drafter(target.cfg, nnx.Rngs(1))
    metrics = train_on_sequences(trained, target, sequences + [s.prompt + s.tokens.tolist()
                                                               for s in more], steps=150)
    assert metrics["top1_agreement"] > 0.5
    accept = {}
    for name, drafter in (("random", random_drafter), ("trained", trained)):
      sd_engine = RolloutEngine(target, CFG, drafter)
      samples = sd_engine.generate(PROMPTS, group_size=2, arm="chain4")
      _assert_same(reference, samples)
      chunks = [t for t in sd_engine.trace if t.arm == "chain4"]
      accept[name] = sum(t.emitted for t in chunks) / sum(t.live * t.rounds for t in chunks)
  assert accept["trained"] > accept["random"]


def test_the_rollout_seed_drives_the_noise():
  _, reference = _plain()
  _, same = _run(arm=OFF, seed=0)
  _, other = _run(arm=OFF, seed=5)
  _assert_same(reference, same)
  assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(reference, other))


def test_the_lookup_search_memory_does_not_grow_with_the_response_length():
  """At paper scale (64 rows, a bank of 16, a 1K prompt and a 32K response) the compiled
  search's scratch memory stays within a few blocks, where the whole corpus compared at once
  would need ~0.7 GB per tensor: compiled, not run, on this machine's CPU."""
  B, P, N, H = 64, 1024, 32768, 16
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  s = steps_lib.Slots(
      cache=None, draft_cache=None, token=i32(B), pos=i32(B), prev_hidden=i32(B, 1),
      sample_id=i32(B), gen=i32(B), max_new=i32(B), done=jax.ShapeDtypeStruct((B,), bool),
      live=jax.ShapeDtypeStruct((B,), bool), out_tokens=i32(B, N), out_logprobs=i32(B, 1),
      out_hidden=i32(B, 1, 1), prompt_tokens=i32(B, P))
  search = jax.jit(steps_lib._lookup_drafts, static_argnums=(3, 4))
  compiled = search.lower(s, i32(H, N), i32(H), 4, 4).compile()
  scratch = compiled.memory_analysis().temp_size_in_bytes
  whole_corpus_int32 = B * (B + H) * (P + N) * 4
  assert scratch < 4 * steps_lib.LOOKUP_BLOCK_ELEMENTS * 4 < whole_corpus_int32 / 8, scratch
