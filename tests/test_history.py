"""The history drafter's suffix tries against brute force: counts, longest matches and chains
equal a scan over the recorded sequences, after interleaved appends and after evictions."""

import collections

import numpy as np
import pytest

from tlt_jax.rollout.history import HistoryDrafter, SuffixTrie

M = 4  # max_order: small, so matches often hit the bound


def _brute_counts(sequences, max_order):
  """substring -> occurrences ending at a recorded position (a head's positions are not)."""
  counts = collections.Counter()
  for head, tokens in sequences:
    text = list(head) + list(tokens)
    for j in range(len(head), len(text)):
      for n in range(1, max_order + 1):
        if j - n + 1 >= 0:
          counts[tuple(text[j - n + 1:j + 1])] += 1
  return counts


def _brute_propose(sequences, context, depth, max_order):
  """Longest suffix (< max_order tokens, possibly empty) with a continuation, its most frequent
  continuation (ties: lower token), repeated."""
  counts = _brute_counts(sequences, max_order)
  context = list(context)
  out = []
  for _ in range(depth):
    for m in range(min(len(context), max_order - 1), -1, -1):
      s = tuple(context[len(context) - m:])
      nexts = {k[-1]: c for k, c in counts.items() if len(k) == m + 1 and k[:-1] == s}
      if nexts:
        t = max(nexts, key=lambda k: (nexts[k], -k))
        out.append(t)
        context.append(t)
        break
    else:
      break
  return out


def _brute_chains(sequences, context, depth, width, max_order):
  """`propose_chains` by brute force: the greedy chain, then the best other paths of a beam of
  `width` over the continuations of the longest matching suffix at each step, a path scored by
  the product of count / total of its tokens' alternatives."""
  counts = _brute_counts(sequences, max_order)

  def options(context):
    for m in range(min(len(context), max_order - 1), -1, -1):
      s = tuple(context[len(context) - m:])
      nexts = {k[-1]: c for k, c in counts.items() if len(k) == m + 1 and k[:-1] == s}
      if nexts:
        return nexts
    return {}

  first = _brute_propose(sequences, context, depth, max_order)
  if not first:
    return []
  beam = [(1.0, [])]
  for _ in range(depth):
    grown = []
    for score, tokens in beam:
      nexts = options(list(context) + tokens)
      if not nexts:
        grown.append((score, tokens))
        continue
      total = sum(nexts.values())
      for t in sorted(nexts, key=lambda k: (-nexts[k], k))[:width]:
        grown.append((score * nexts[t] / total, tokens + [t]))
    beam = sorted(grown, key=lambda x: (-x[0], x[1]))[:width]
  chains = [first]
  for _, tokens in beam:
    if len(chains) < width and tokens and tokens not in chains:
      chains.append(tokens)
  return chains


@pytest.mark.parametrize("seed", range(3))
def test_tree_chains_equal_a_brute_force_beam(seed):
  rng = np.random.default_rng(10 + seed)
  vocab = 3 + seed
  trie = SuffixTrie(M)
  recorded = {}
  for k in range(4):
    tokens = rng.integers(0, vocab, int(rng.integers(5, 30))).tolist()
    trie.add(k, tokens)
    recorded[k] = ((), tokens)
  branched = 0
  for n in (0, 1, 2, 3, 6):
    for _ in range(4):
      context = rng.integers(0, vocab, n).tolist()
      for depth, width in ((1, 3), (3, 2), (4, 3)):
        got, _ = trie.propose_chains(context, depth, width)
        assert got == _brute_chains(recorded.values(), context, depth, width, M)
        assert got[:1] == [trie.propose(context, depth)[0]][:len(got)]
        assert len({tuple(c) for c in got}) == len(got)  # distinct
        branched += len(got) > 1
  assert branched  # the beam found alternatives


def _trie_counts(trie):
  counts = {}

  def walk(node, path):
    for t, child in node.children.items():
      counts[path + (t,)] = child.count
      walk(child, path + (t,))
  walk(trie.root, ())
  return counts


@pytest.mark.parametrize("seed", range(4))
def test_counts_and_chains_equal_a_brute_force_scan(seed):
  rng = np.random.default_rng(seed)
  vocab = 4 + seed  # small vocabularies: many repeats, many ties
  trie = SuffixTrie(M)
  prompt = rng.integers(0, vocab, 7).tolist()
  trie.add("prompt", prompt)
  recorded = {"prompt": ((), list(prompt))}
  # Siblings grow interleaved, each after the prompt (its uncounted head).
  for k in range(3):
    trie.add(k, head=prompt)
    recorded[k] = (tuple(prompt[-(M - 1):]), [])
  for _ in range(40):
    k = int(rng.integers(3))
    new = rng.integers(0, vocab, int(rng.integers(1, 4))).tolist()
    trie.extend(k, new)
    recorded[k][1].extend(new)
    assert _trie_counts(trie) == dict(_brute_counts(recorded.values(), M))
    context = (list(recorded[k][0]) + recorded[k][1])
    for depth in (1, 3, 6):
      got, scores, _ = trie.propose(context, depth)
      assert got == _brute_propose(recorded.values(), context, depth, M)
      assert len(scores) == len(got) and all(c >= 1 for c in scores)
  for context in (rng.integers(0, vocab, n).tolist() for n in (0, 1, 2, 5, 9)):
    got, _, _ = trie.propose(context, 5)
    assert got == _brute_propose(recorded.values(), context, 5, M)


def test_removing_sequences_undoes_their_counts_exactly():
  rng = np.random.default_rng(7)
  trie = SuffixTrie(M)
  prompt = rng.integers(0, 5, 6).tolist()
  trie.add("prompt", prompt)
  recorded = {"prompt": ((), prompt)}
  for k in range(4):
    tokens = rng.integers(0, 5, 12).tolist()
    trie.add(k, tokens, head=prompt)
    recorded[k] = (tuple(prompt[-(M - 1):]), tokens)
  for k in (2, 0):
    trie.remove(k)
    del recorded[k]
    assert _trie_counts(trie) == dict(_brute_counts(recorded.values(), M))
    assert trie.num_tokens == sum(len(t) for _, t in recorded.values())
    for context in (prompt, recorded[1][1], [4, 4, 4]):
      assert trie.propose(context, 4)[0] == _brute_propose(recorded.values(), context, 4, M)
  for k in (1, 3, "prompt"):
    trie.remove(k)
  assert trie.root.children == {} and trie.num_tokens == 0  # no node left behind
  assert trie.propose([1, 2], 3) == ([], [], -1)


def test_siblings_draft_what_an_earlier_sibling_wrote():
  drafter = HistoryDrafter(max_order=6)
  prompt = [9, 8, 7]
  drafter.begin(0, prompt)
  drafter.begin(1, prompt)
  drafter.extend(0, [1, 2, 3, 4, 5, 6])
  drafter.extend(1, [1, 2])
  assert drafter.propose(1, 4) == [3, 4, 5, 6]
  drafter.finish(0, [1, 2, 3, 4, 5, 6])
  drafter.finish(1, [1, 2, 0])
  # A later rollout of the same prompt starts from its earlier responses; `1` follows the
  # prompt twice, then `2` twice, then 3 (once) vs 0 (once): the lower token on a tie.
  drafter.begin(2, prompt)
  assert drafter.propose(2, 3) == [1, 2, 0]


def test_bounded_memory_evicts_the_oldest_responses_and_groups():
  drafter = HistoryDrafter(max_order=4, max_group_tokens=12, max_groups=2, global_tokens=8)
  prompt = [1, 1]
  for sid in range(5):
    drafter.begin(sid, prompt)
    drafter.finish(sid, [10 + sid] * 5)
  trie = drafter.groups[tuple(prompt)]
  # Prompt (2) + the newest responses up to 12 tokens: the two newest (10 tokens) remain.
  assert trie.num_tokens == 12 and sorted(len(s.tokens) for s in trie.sequences.values()) == [
      2, 5, 5]
  assert drafter.global_trie.num_tokens == 5  # only the newest response fits in 8 tokens
  # A new prompt whose own text continues nothing: the global trie (recent responses of any
  # prompt) drafts instead.
  drafter.begin(10, [6])
  drafter.extend(10, [14])
  assert drafter.propose(10, 2) == [14, 14] and drafter.stats.from_global == 1
  drafter.begin(11, [3])  # a third group: the least recently used idle one is dropped
  assert tuple(prompt) not in drafter.groups and set(drafter.groups) == {(6,), (3,)}
  drafter.begin(12, [4])  # every group busy: none is dropped under a live sample
  assert set(drafter.groups) == {(6,), (3,), (4,)}


def test_the_global_trie_drafts_where_it_matches_a_longer_suffix_than_the_group():
  drafter = HistoryDrafter(max_order=4, global_tokens=64)
  drafter.begin(0, [9])
  drafter.finish(0, [1, 2, 3, 4, 5])  # another prompt's response: "1 2 3" -> 4 5
  drafter.begin(1, [3, 7])  # this group's text continues "3" with 7 (a match of 1)
  drafter.extend(1, [1, 2, 3])
  assert drafter.propose(1, 2) == [4, 5] and drafter.stats.from_global == 1
  drafter.begin(2, [3, 7])
  drafter.extend(2, [8, 3])  # "8 3" occurs nowhere, "3" only in the group: the group drafts
  assert drafter.propose(2, 1) == [7] and drafter.stats.from_global == 1
