"""Reward scoring pool: the same scores from every worker kind, timeouts score 0, clear errors."""

import time

import pytest

from tlt_jax.rl.scoring import RewardScorer, RewardSpec, score

CASES = [("so \\boxed{12}", "12"), ("answer: 3/4", "0.75"), ("no answer here", "5"),
         ("#### 1,000", "1000"), ("\\boxed{\\frac{1}{2}}", "0.5")]


@pytest.mark.parametrize("kind", ["inline", "thread", "process"])
def test_every_worker_kind_gives_the_same_scores(kind):
  spec = RewardSpec(correct_weight=1.0, format_weight=0.25)
  with RewardScorer(spec, workers=2, kind=kind) as scorer:
    for i, (text, ref) in enumerate(CASES):
      scorer.submit(i, text, ref)
    start = time.perf_counter()
    results, wait_s = scorer.results()
    elapsed = time.perf_counter() - start
  assert [results[i]["correct"] for i in range(len(CASES))] == [1.0, 1.0, 0.0, 1.0, 1.0]
  assert results[2]["reward"] == 0.0 and results[0]["reward"] == 1.25
  assert results[1]["format"] == 1.0 and results[2]["format"] == 0.0
  assert results == {i: score(t, r, spec) for i, (t, r) in enumerate(CASES)}
  assert 0.0 <= wait_s <= elapsed  # the time results() blocked, not the time since submit


def test_a_slow_verifier_times_out_to_zero_instead_of_hanging(monkeypatch):
  from tlt_jax.rl import scoring

  def slow(completion, reference, spec):
    time.sleep(2.0)
    return {"reward": 1.0, "correct": 1.0, "format": 0.0}

  monkeypatch.setattr(scoring, "score", slow)
  scorer = RewardScorer(workers=1, kind="thread", timeout_s=0.1)
  scorer.submit(0, "x", "1")
  results, wait_s = scorer.results()
  assert results[0]["reward"] == 0.0 and scorer.timeouts == 1
  assert 0.1 <= wait_s < 2.0  # it waited out the timeout, not the verifier
  scorer.close()


def test_bad_use_is_named():
  with pytest.raises(ValueError, match="worker kind must be one of"):
    RewardScorer(kind="gpu")
  scorer = RewardScorer(kind="inline")
  scorer.submit(3, "\\boxed{1}", "1")
  with pytest.raises(ValueError, match="sample 3 was submitted twice"):
    scorer.submit(3, "\\boxed{1}", "1")
