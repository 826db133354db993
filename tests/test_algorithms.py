"""Advantages and losses of the GRPO family against values computed by hand or in NumPy (f64)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rl import algorithms as alg


def close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def test_grpo_advantages():
  close(alg.ADVANTAGES["grpo"](jnp.array([1.0, 0.0, 0.0, 1.0]), 2),
        [0.70711, -0.70711, -0.70711, 0.70711])
  # mean 0.25, Bessel std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
  close(alg.ADVANTAGES["grpo"](jnp.array([1.0, 0.0, 0.0, 0.0]), 4), [1.5, -0.5, -0.5, -0.5])
  close(alg.ADVANTAGES["grpo"](jnp.array([1.0, 1.0]), 2), [0.0, 0.0])  # no signal, no NaN


def test_dr_grpo_and_rloo_advantages():
  r = jnp.array([1.0, 0.0, 0.0, 0.0])
  close(alg.ADVANTAGES["dr_grpo"](r, 4), [0.75, -0.25, -0.25, -0.25])
  close(alg.ADVANTAGES["rloo"](r, 4), [1.0, -1 / 3, -1 / 3, -1 / 3])
  with pytest.raises(ValueError, match="groups of 4"):
    alg.ADVANTAGES["grpo"](jnp.ones(6), 4)


def _numpy_advantages(rewards, G, name, eps=1e-6):
  """The estimators in float64 NumPy, from the papers (GRPO: Bessel std as TRL / verl)."""
  r = np.asarray(rewards, np.float64).reshape(-1, G)
  d = r - r.mean(axis=1, keepdims=True)
  if name == "grpo":
    return (d / (r.std(axis=1, ddof=1, keepdims=True) + eps)).reshape(-1)
  if name == "dr_grpo":
    return d.reshape(-1)
  return (r - (r.sum(axis=1, keepdims=True) - r) / (G - 1)).reshape(-1)  # rloo


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("G", [3, 8, 16])
def test_equal_rewards_give_exactly_zero_advantages(name, G):
  """Groups of equal rewards that are not exact in f32 (0.1, 1.1, 0.3) have advantages exactly 0
  (grpo's were up to +-0.11: the f32 mean is an ulp off and the std below it ~1e-8); a mixed
  group and random groups match the f64 NumPy estimators."""
  mixed = np.resize([1.1, 0.1], G)
  rewards = np.concatenate([[0.1] * G, [1.1] * G, [0.3] * G, mixed]).astype(np.float32)
  got = np.asarray(alg.ADVANTAGES[name](jnp.asarray(rewards), G))
  expected = _numpy_advantages(rewards, G, name)
  assert np.all(got[:3 * G] == 0.0) and np.all(expected[:3 * G] == 0.0), got
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  rewards = np.random.default_rng(G).normal(size=4 * G).astype(np.float32)
  np.testing.assert_allclose(np.asarray(alg.ADVANTAGES[name](jnp.asarray(rewards), G)),
                             _numpy_advantages(rewards, G, name), rtol=1e-5, atol=1e-6)


def test_dapo_dynamic_sampling_and_overlong_shaping():
  assert alg.mixed_groups(jnp.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2).tolist() == [
      False, False, True, True, False, False]
  close(alg.overlong_penalty(jnp.array([5, 6, 8, 10, 12]), max_len=10, buffer=4),
        [0.0, 0.0, -0.5, -1.0, -1.0])
  # DAPO filters on accuracy: a group all correct stays dropped when shaping (an overlong
  # penalty here) makes its rewards differ; a group half correct is kept.
  correct = np.array([1, 1, 0, 1, 0, 0], np.float32)
  assert alg.dynamic_sampling_weights("dapo", correct, 2).tolist() == [0, 0, 1, 1, 0, 0]
  assert alg.dynamic_sampling_weights("grpo", correct, 2) is None


def test_dapo_train_groups_takes_the_first_mixed_groups_and_fills_a_shortfall():
  rng = np.random.default_rng(0)
  for _ in range(20):
    correct = (rng.random(6 * 3) < rng.choice([0.1, 0.5, 0.9])).astype(np.float32)
    hits = correct.reshape(-1, 3).sum(1)
    mixed = [g for g in range(6) if 0 < hits[g] < 3]  # groups of 3, 2 rollouts of 3 prompts
    uniform = [g for g in range(6) if g not in mixed]
    chosen, n = alg.dapo_train_groups(correct, 3, 3)
    assert n == len(mixed)
    assert chosen.tolist() == sorted(mixed[:3] + uniform[:max(3 - len(mixed), 0)])
  # One rollout of exactly the batch: every group, in order (DAPO as before over-sampling).
  np.testing.assert_array_equal(alg.dapo_train_groups(np.ones(8), 2, 4)[0], [0, 1, 2, 3])


def test_ppo_clip_higher():
  old = jnp.log(jnp.array([[0.5, 0.5]]))
  new = jnp.log(jnp.array([[0.6, 0.75]]))  # ratios 1.2 and 1.5
  mask = jnp.ones((1, 2), bool)
  loss, stats = alg.LOSSES["ppo"](new, old, jnp.array([1.0]), mask)  # clip at 1.28 upward
  close(loss, -(1.2 + 1.28) / 2)
  close(stats["clip_fraction"], 0.5)
  loss, stats = alg.LOSSES["ppo"](new, old, jnp.array([-1.0]), mask)  # pessimistic side
  close(loss, (1.2 + 1.5) / 2)
  assert float(stats["clip_fraction"]) == 0.0  # unclipped: its gradient is the ratio's


@pytest.mark.parametrize("name", ["ppo", "grpo", "gspo"])
def test_clip_fraction_counts_the_clipped_side(name):
  """Clipped = the clipped term is the one the min takes (its gradient 0): ratio > 1 + eps_high
  with A > 0, ratio < 1 - eps_low with A < 0 (verl's pg_clipfrac); NumPy reference."""
  rng = np.random.default_rng(0)
  ratio = np.exp(rng.normal(scale=0.4, size=(6, 5)))
  adv = np.array([1.0, -1.0, 0.5, -2.0, 0.0, 1.0])
  mask = rng.random((6, 5)) < 0.8
  mask[-1] = False  # a padding row (a chunk's): neither clipped nor counted
  new = jnp.asarray(np.log(ratio), jnp.float32)
  lo, hi = (0.05, 0.08) if name == "gspo" else (0.2, 0.3)  # a sequence's ratio is nearer 1
  _, stats = alg.LOSSES[name](new, jnp.zeros_like(new), jnp.asarray(adv, jnp.float32),
                              jnp.asarray(mask), eps_low=lo, eps_high=hi)
  if name == "gspo":
    m = mask.astype(np.float64)
    ratio = np.exp(np.sum(np.log(ratio) * m, 1) / np.maximum(m.sum(1), 1))
    mask = mask.any(axis=1)
  a = adv if name == "gspo" else adv[:, None]
  clipped = np.where(a > 0, ratio > 1 + hi, np.where(a < 0, ratio < 1 - lo, False)) & mask
  assert 0 < clipped.sum() < mask.sum()
  np.testing.assert_allclose(float(stats["clip_fraction"]), clipped.sum() / mask.sum(), rtol=1e-6)


def test_loss_aggregations():
  logp = jnp.zeros((2, 3))  # ratio 1: per-token loss = -advantage
  mask = jnp.array([[True, False, False], [True, True, True]])
  adv = jnp.array([1.0, -1.0])  # tokens: [-1 | 1 1 1]
  close(alg.LOSSES["dapo"](logp, logp, adv, mask)[0], 2 / 4)            # token mean
  close(alg.LOSSES["grpo"](logp, logp, adv, mask)[0], (-1 + 1) / 2)     # mean of sequence means
  close(alg.LOSSES["dr_grpo"](logp, logp, adv, mask, max_len=4)[0], 2 / (2 * 4))
  with pytest.raises(ValueError, match="max_len"):
    alg.LOSSES["dr_grpo"](logp, logp, adv, mask)


def test_gspo_sequence_ratio():
  old = jnp.zeros((1, 3))
  new = jnp.array([[0.1, 0.3, 9.0]])
  mask = jnp.array([[True, True, False]])  # mean log-ratio 0.2 over the response
  loss, _ = alg.LOSSES["gspo"](new, old, jnp.array([1.0]), mask, eps_low=0.5, eps_high=0.5)
  close(loss, -math.exp(0.2))
  loss, stats = alg.LOSSES["gspo"](new, old, jnp.array([1.0]), mask)  # default clip 4e-4
  close(loss, -(1 + 4e-4))
  assert float(stats["clip_fraction"]) == 1.0


def test_kl_estimators_and_truncated_importance_sampling():
  logp, ref = jnp.log(jnp.array([[0.5]])), jnp.log(jnp.array([[0.25]]))
  close(alg.kl_penalty(logp, ref, "k1"), [[math.log(2)]])
  close(alg.kl_penalty(logp, ref, "k3"), [[0.5 + math.log(2) - 1]])
  # A sampled token outside the reference's top-k / top-p (log pi_ref = -inf): clamped as verl
  # clamps (log-ratio +-20, k3 <= 10), with a finite gradient, not an infinite objective.
  outside = jnp.array([[-jnp.inf]])
  close(alg.kl_penalty(logp, outside, "k1"), [[20.0]])
  close(alg.kl_penalty(logp, outside, "k3"), [[10.0]])
  assert float(alg.kl_penalty(outside, outside, "k3")[0, 0]) == 0.0  # outside both: no NaN
  grad = jax.grad(lambda x: alg.kl_penalty(x, outside, "k3").sum())(logp)
  assert np.all(np.isfinite(np.asarray(grad)))
  trainer, sampler = jnp.log(jnp.array([[0.5, 0.4]])), jnp.log(jnp.array([[0.2, 0.4]]))
  w, stats = alg.truncated_importance_weights(trainer, sampler, jnp.ones((1, 2), bool), cap=2.0)
  close(w, [[2.0, 1.0]])  # 2.5 capped at 2
  close(stats["kl_sample_train"], (math.log(0.2 / 0.5) + 0.0) / 2)
  close(stats["is_weight_max"], 2.5)
  close(stats["is_truncated_fraction"], 0.5)
  same, stats = alg.truncated_importance_weights(trainer, trainer, jnp.ones((1, 2), bool))
  assert float(stats["kl_sample_train"]) == 0.0 and np.all(np.asarray(same) == 1.0)
