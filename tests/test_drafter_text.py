"""The model-free drafters' text written beside a checkpoint comes back as the same drafters."""

import numpy as np
import pytest

from tlt_jax.rollout import drafter_text
from tlt_jax.rollout.bank import ResponseBank
from tlt_jax.rollout.history import HistoryDrafter


def _counts(node):
  """A trie as nested (count, {token: child}): what every proposal is computed from."""
  return node.count, {t: _counts(c) for t, c in sorted(node.children.items())}


def _fill(history: HistoryDrafter, bank: ResponseBank, rng, prompts, rounds: int, first_id: int):
  """Decodes `rounds` GRPO-style groups of 3 per prompt: begun together, extended in turns,
  finished in a shuffled order, as the engine drives them."""
  sample_id = first_id
  for _ in range(rounds):
    for prompt in prompts:
      ids = list(range(sample_id, sample_id + 3))
      sample_id += 3
      responses = {i: rng.integers(0, 6, rng.integers(1, 12)).tolist() for i in ids}
      for i in ids:
        history.begin(i, prompt)
      for i in ids:
        history.extend(i, responses[i][:len(responses[i]) // 2])
      for i in rng.permutation(ids).tolist():
        history.finish(i, responses[i])
        bank.add(prompt, np.asarray(responses[i], np.int32))
  return sample_id


def _state(history: HistoryDrafter, bank: ResponseBank, prompts):
  return dict(
      groups=[(p, _counts(t.root), list(t.sequences[k].tokens for k in history.finished[p]))
              for p, t in history.groups.items()],
      global_trie=_counts(history.global_trie.root),
      global_tokens=history.global_trie.num_tokens,
      holds=[(history.holds(p), bank.holds(p)) for p in prompts],
      banks=[[x.tolist() for x in bank.choose(chosen)]
             for chosen in ([], prompts[:1], prompts[1:3], prompts)],
      stored_tokens=bank.stored_tokens,
      recent=[(p, t.tolist()) for p, t in bank.recent])


@pytest.mark.parametrize("bounded", [False, True])
def test_the_text_restores_the_tries_and_the_bank_and_they_go_on_alike(tmp_path, bounded):
  """Spilled and restored into fresh drafters: the same trie counts per group (in the same
  least-recently-used order), the same global trie, the same banks chosen for any prompts; and
  fed the same responses afterwards, they evict and draft alike. Bounded: every limit binds
  (groups, tokens per group, global tokens, bank tokens, responses per prompt)."""
  limits = (dict(max_group_tokens=20, max_groups=3, global_tokens=25) if bounded
            else dict(max_group_tokens=2048, max_groups=64, global_tokens=4096))
  bank_tokens = 30 if bounded else 1 << 20
  rng = np.random.default_rng(0)
  prompts = [(1, 2, 3), (4,), (5, 5), (2, 1, 3, 0), (3, 3)]
  history = HistoryDrafter(max_order=4, **limits)
  bank = ResponseBank(size=2, max_new_tokens=12, history_tokens=bank_tokens)
  next_id = _fill(history, bank, rng, prompts, rounds=2, first_id=0)
  path = str(tmp_path / "group_0.npz")
  drafter_text.spill(history, bank, path)

  restored = HistoryDrafter(max_order=4, **limits)
  restored_bank = ResponseBank(size=2, max_new_tokens=12, history_tokens=bank_tokens)
  _fill(restored, restored_bank, np.random.default_rng(1), prompts[:2], 1, 0)  # replaced whole
  drafter_text.restore(restored, restored_bank, path)
  before = _state(history, bank, prompts)
  assert before["global_tokens"] > 0 and any(h for h, _ in before["holds"])
  if bounded:
    assert len(history.groups) == 3 and before["global_tokens"] <= 25
    assert max(b for _, b in before["holds"]) == 2  # a bank's worth per prompt
  assert _state(restored, restored_bank, prompts) == before
  for sid in range(next_id - 3, next_id):  # samples decoding now start from the same text
    for h in (history, restored):
      h.begin(sid + 100, prompts[-1])
      h.extend(sid + 100, [1, 2])
    assert (history.propose_chains(sid + 100, 3, 2) == restored.propose_chains(sid + 100, 3, 2))
    for h in (history, restored):
      h.finish(sid + 100, [1, 2, 0])

  _fill(history, bank, np.random.default_rng(2), prompts, 1, 1000)
  _fill(restored, restored_bank, np.random.default_rng(2), prompts, 1, 1000)
  assert _state(restored, restored_bank, prompts) == _state(history, bank, prompts)


def test_one_response_in_both_bank_lists_stays_one(tmp_path):
  """The bank's newest responses are also its stored ones (one array each): restored, a bank
  for a prompt does not hold the same response twice."""
  bank = ResponseBank(size=3, max_new_tokens=4, history_tokens=100)
  bank.add((1,), np.asarray([7, 7, 7], np.int32))
  bank.add((2,), np.asarray([8, 8], np.int32))
  path = str(tmp_path / "g.npz")
  drafter_text.spill(None, bank, path)
  restored = ResponseBank(size=3, max_new_tokens=4, history_tokens=100)
  drafter_text.restore(None, restored, path)
  assert [x.tolist() for x in restored.choose([(1,)])] == [[7, 7, 7], [8, 8]]


def test_a_text_file_of_another_format_is_refused_by_name(tmp_path):
  path = tmp_path / "g.npz"
  np.savez(path, format_version=np.int64(99))
  with pytest.raises(ValueError, match=r"g\.npz: drafter text format 99, expected 1"):
    drafter_text.restore(None, ResponseBank(2, 4), str(path))
