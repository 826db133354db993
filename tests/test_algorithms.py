"""Advantages and losses of the GRPO family against values computed by hand."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rl import algorithms as alg


def close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def test_grpo_advantages():
  close(alg.ADVANTAGES["grpo"](jnp.array([1.0, 0.0, 0.0, 1.0]), 2), [0.70711, -0.70711, -0.70711, 0.70711])
  # mean 0.25, Bessel std sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
  close(alg.ADVANTAGES["grpo"](jnp.array([1.0, 0.0, 0.0, 0.0]), 4), [1.5, -0.5, -0.5, -0.5])
  close(alg.ADVANTAGES["grpo"](jnp.array([1.0, 1.0]), 2), [0.0, 0.0])  # no signal, no NaN


def test_dr_grpo_and_rloo_advantages():
  r = jnp.array([1.0, 0.0, 0.0, 0.0])
  close(alg.ADVANTAGES["dr_grpo"](r, 4), [0.75, -0.25, -0.25, -0.25])
  close(alg.ADVANTAGES["rloo"](r, 4), [1.0, -1 / 3, -1 / 3, -1 / 3])
  with pytest.raises(ValueError, match="groups of 4"):
    alg.ADVANTAGES["grpo"](jnp.ones(6), 4)


def test_dapo_dynamic_sampling_and_overlong_shaping():
  assert alg.mixed_groups(jnp.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2).tolist() == [
      False, False, True, True, False, False]
  close(alg.overlong_penalty(jnp.array([5, 6, 8, 10, 12]), max_len=10, buffer=4),
        [0.0, 0.0, -0.5, -1.0, -1.0])


def test_ppo_clip_higher():
  old = jnp.log(jnp.array([[0.5, 0.5]]))
  new = jnp.log(jnp.array([[0.6, 0.75]]))  # ratios 1.2 and 1.5
  mask = jnp.ones((1, 2), bool)
  loss, stats = alg.LOSSES["ppo"](new, old, jnp.array([1.0]), mask)  # clip at 1.28 upward
  close(loss, -(1.2 + 1.28) / 2)
  close(stats["clip_fraction"], 0.5)
  loss, _ = alg.LOSSES["ppo"](new, old, jnp.array([-1.0]), mask)  # pessimistic side: unclipped
  close(loss, (1.2 + 1.5) / 2)


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
  trainer, sampler = jnp.log(jnp.array([[0.5, 0.4]])), jnp.log(jnp.array([[0.2, 0.4]]))
  w, stats = alg.truncated_importance_weights(trainer, sampler, jnp.ones((1, 2), bool), cap=2.0)
  close(w, [[2.0, 1.0]])  # 2.5 capped at 2
  close(stats["kl_sample_train"], (math.log(0.2 / 0.5) + 0.0) / 2)
  close(stats["is_weight_max"], 2.5)
  close(stats["is_truncated_fraction"], 0.5)
  same, stats = alg.truncated_importance_weights(trainer, trainer, jnp.ones((1, 2), bool))
  assert float(stats["kl_sample_train"]) == 0.0 and np.all(np.asarray(same) == 1.0)
