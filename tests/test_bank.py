"""The lookup arms' bank (`rollout.bank.ResponseBank`): which responses a chunk drafts from."""

import numpy as np
import pytest

from tlt_jax.rollout.bank import ResponseBank

A, B, C, D = (1, 2), (3,), (4, 5, 6), (7,)


def _bank(size=4, history_tokens=1 << 10):
  bank = ResponseBank(size, max_new_tokens=6, history_tokens=history_tokens)
  # Responses named by their first token: 11 = the first to A, 12 = the second, ...
  for prompt, first in ((A, 11), (B, 21), (A, 12), (C, 31), (A, 13)):
    bank.add(prompt, np.array([first, 0, first]))
  return bank


def _firsts(bank, prompts):
  return [int(t[0]) for t in bank.choose(prompts)]


def test_a_chunk_gets_its_prompts_earlier_responses_first_then_the_newest():
  bank = _bank()
  assert _firsts(bank, [A]) == [13, 12, 11, 31]
  assert _firsts(bank, [A, B]) == [13, 21, 12, 11]  # newest first, the prompts taking turns
  assert _firsts(bank, [B, A, B]) == [21, 13, 12, 11]
  assert _firsts(bank, [D]) == [13, 31, 12, 21]  # nothing of D's: the newest of any prompt
  assert _firsts(bank, []) == [13, 31, 12, 21]
  assert [bank.holds(p) for p in (A, B, C, D)] == [3, 1, 1, 0]
  tokens, lengths = (np.asarray(x) for x in bank.arrays([C]))
  np.testing.assert_array_equal(tokens[0], [31, 0, 31, 0, 0, 0])
  np.testing.assert_array_equal(lengths, [3, 3, 3, 3])


def test_without_kept_responses_the_bank_is_the_newest():
  bank = _bank(history_tokens=0)
  assert _firsts(bank, [B]) == [13, 31, 12, 21] and bank.holds(A) == 0


def test_kept_responses_are_bounded_per_prompt_and_in_tokens_oldest_first():
  bank = _bank(size=2)
  assert bank.holds(A) == 2 and _firsts(bank, [A]) == [13, 12]  # 11 dropped: no bank holds 3
  assert bank.stored_tokens == 3 * 4
  bank = _bank(history_tokens=9)  # three responses of 3 tokens
  assert [bank.holds(p) for p in (A, B, C)] == [2, 0, 1] and bank.stored_tokens == 9
  assert _firsts(bank, [B]) == [13, 31, 12, 21]  # B's one only as one of the newest 4
  with pytest.raises(ValueError, match="history_tokens must be >= 0"):
    ResponseBank(4, 6, history_tokens=-1)
