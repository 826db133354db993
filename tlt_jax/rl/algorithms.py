"""Advantage estimators and policy losses of the GRPO family, as registries of pure functions.

Shapes: N sequences in groups of G (N = num_groups * G, group-major), T response tokens.
`logp_*_NxT` are per-token log-probs of the sampled tokens, `mask_NxT` marks response tokens.

Estimators (rewards [N] -> advantages [N]):
  grpo     (r - mean_group) / (std_group + eps), std with Bessel's correction (as TRL / verl)
  dr_grpo  r - mean_group (no std: Dr. GRPO removes the difficulty bias)
  rloo     r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean_group)
  dapo     grpo's advantages; groups whose answers are all right or all wrong are dropped
           (`dynamic_sampling_weights`, on accuracy as in the paper, not on the shaped reward)
           and the step rolls out more prompts until the batch is full (`dapo_train_groups`,
           rl/step.py)
  gspo     grpo's advantages; the loss uses a sequence-level ratio
Losses (aggregation in parentheses):
  ppo      token-level clipped ratio, eps_low / eps_high (clip-higher) (`token_mean`, DAPO)
  grpo     the same clipped objective (`seq_mean_token_mean`)
  dr_grpo  the same (`seq_mean_token_sum_norm`: sum over tokens / a constant max length)
  gspo     sequence ratio exp(mean_t (logp - logp_old)), clipped per sequence (`seq_mean`)
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

ADVANTAGES: dict[str, Callable] = {}
LOSSES: dict[str, Callable] = {}


def _register(table, name):
  def deco(fn):
    table[name] = fn
    return fn
  return deco


def _groups(rewards_N: jax.Array, group_size: int) -> jax.Array:
  if rewards_N.shape[0] % group_size:
    raise ValueError(f"{rewards_N.shape[0]} rewards do not split into groups of {group_size}")
  return rewards_N.reshape(-1, group_size).astype(jnp.float32)


def _deviations(r_GxS):
  """r - mean over each group, with the mean taken of differences from the group's first reward:
  a group of equal rewards gets deviations exactly 0 even where the f32 mean of its values is
  not exact (four 0.1s or 1.1s: a mean one ulp off, and an advantage of +-0.1 after dividing by
  a std of a few ulps). It is also the more accurate sum when rewards are large."""
  d = r_GxS - r_GxS[:, :1]
  return d - d.mean(axis=1, keepdims=True)


@_register(ADVANTAGES, "grpo")
def grpo_advantages(rewards_N, group_size: int, eps: float = 1e-6):
  dev = _deviations(_groups(rewards_N, group_size))
  std = (jnp.sqrt(jnp.sum(dev * dev, axis=1, keepdims=True) / (group_size - 1))
         if group_size > 1 else jnp.zeros_like(dev[:, :1]))
  return (dev / (std + eps)).reshape(-1)


@_register(ADVANTAGES, "dr_grpo")
def dr_grpo_advantages(rewards_N, group_size: int):
  return _deviations(_groups(rewards_N, group_size)).reshape(-1)


@_register(ADVANTAGES, "rloo")
def rloo_advantages(rewards_N, group_size: int):
  if group_size < 2:
    raise ValueError("rloo needs groups of at least 2")
  # r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean_group)
  return (_deviations(_groups(rewards_N, group_size)) * (group_size / (group_size - 1))).reshape(-1)


ADVANTAGES["dapo"] = grpo_advantages
ADVANTAGES["gspo"] = grpo_advantages


def mixed_groups(values_N, group_size: int) -> jax.Array:
  """True for the sequences of groups with at least two distinct values."""
  r = _groups(values_N, group_size)
  mixed = jnp.any(r != r[:, :1], axis=1)
  return jnp.repeat(mixed, group_size)


def dynamic_sampling_weights(algorithm: str, correct_N, group_size: int):
  """Per-sequence loss weights (None = all 1): DAPO's dynamic sampling drops the groups whose
  answers are all correct or all wrong. It filters on accuracy (DAPO, eq. 11: 0 < |{correct}| <
  G), not on the shaped reward: a format bonus or an overlong penalty makes a group of equal
  accuracy look mixed, and its advantages then only teach the shaping."""
  if algorithm != "dapo":
    return None
  return np.asarray(mixed_groups(np.asarray(correct_N) > 0, group_size), np.float32)


def dapo_train_groups(correct_N, group_size: int, num_groups: int) -> tuple[np.ndarray, int]:
  """DAPO's dynamic sampling over a step's rollouts (group-major, in the order rolled out): the
  indices of the `num_groups` groups the trainer gets, and how many groups have mixed accuracy
  (0 < correct < G). The first `num_groups` mixed groups when there are as many; otherwise every
  mixed group and, to keep the batch's shape, the first uniform ones (weight 0 in the loss);
  indices in rollout order. With one rollout of `num_groups` groups: all of them, in order."""
  correct_GxS = np.asarray(correct_N).reshape(-1, group_size) > 0
  hits = correct_GxS.sum(axis=1)
  mixed = np.flatnonzero((hits > 0) & (hits < group_size))
  uniform = np.flatnonzero((hits == 0) | (hits == group_size))
  if len(mixed) + len(uniform) < num_groups:
    raise ValueError(f"{len(mixed) + len(uniform)} groups rolled out, fewer than {num_groups}")
  chosen = np.concatenate([mixed[:num_groups], uniform[:max(num_groups - len(mixed), 0)]])
  return np.sort(chosen), len(mixed)


def overlong_penalty(lengths_N, max_len: int, buffer: int) -> jax.Array:
  """DAPO soft overlong shaping, in tokens: 0 up to max_len - buffer, then falling linearly to -1
  at max_len (and -1 beyond)."""
  over = lengths_N.astype(jnp.float32) - (max_len - buffer)
  return -jnp.clip(over / buffer, 0.0, 1.0)


def aggregate(loss_NxT, mask_NxT, mode: str, max_len: int | None = None):
  m = mask_NxT.astype(jnp.float32)
  if mode == "token_mean":
    return jnp.sum(loss_NxT * m) / jnp.maximum(m.sum(), 1.0)
  if mode == "seq_mean_token_mean":
    per_seq = jnp.sum(loss_NxT * m, axis=1) / jnp.maximum(m.sum(axis=1), 1.0)
    return per_seq.mean()
  if mode == "seq_mean_token_sum_norm":
    if not max_len:
      raise ValueError("seq_mean_token_sum_norm needs max_len (Dr. GRPO's constant normaliser)")
    return jnp.sum(loss_NxT * m) / (loss_NxT.shape[0] * max_len)
  raise ValueError(f"unknown loss aggregation {mode!r}")


def _clipped(ratio, adv, eps_low, eps_high):
  """The clipped surrogate's loss and where the clipped term is the one taken (its gradient 0):
  ratio above 1 + eps_high for a positive advantage, below 1 - eps_low for a negative one (the
  other side is pessimistic and unclipped; verl's pg_clipfrac)."""
  unclipped = -ratio * adv
  clipped = -jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
  return jnp.maximum(unclipped, clipped), clipped > unclipped


def _log_ratio(logp_NxT, logp_old_NxT, mask_NxT):
  """log(pi / pi_old) on response tokens, 0 elsewhere. Masked before the exp: with top-k / top-p
  a prompt or padding token outside the kept set has log-prob -inf under both, and
  exp(-inf - -inf) * 0 is NaN in the loss and in its gradient."""
  return jnp.where(mask_NxT, logp_NxT - logp_old_NxT, 0.0)


def _token_clip_loss(logp_NxT, logp_old_NxT, adv_N, mask_NxT, eps_low, eps_high, agg, max_len,
                     weights_NxT=None):
  ratio = jnp.exp(_log_ratio(logp_NxT, logp_old_NxT, mask_NxT))
  loss, clipped = _clipped(ratio, adv_N[:, None], eps_low, eps_high)
  if weights_NxT is not None:  # truncated importance weights (exactly 1.0 when on-policy)
    loss = loss * weights_NxT
  stats = {"clip_fraction": jnp.sum(clipped & mask_NxT) / jnp.maximum(jnp.sum(mask_NxT), 1)}
  return aggregate(loss, mask_NxT, agg, max_len), stats


@_register(LOSSES, "ppo")
def ppo_loss(logp_NxT, logp_old_NxT, adv_N, mask_NxT, *, eps_low=0.2, eps_high=0.28,
             max_len=None, weights_NxT=None):
  return _token_clip_loss(logp_NxT, logp_old_NxT, adv_N, mask_NxT, eps_low, eps_high,
                          "token_mean", max_len, weights_NxT)


@_register(LOSSES, "grpo")
def grpo_loss(logp_NxT, logp_old_NxT, adv_N, mask_NxT, *, eps_low=0.2, eps_high=0.2,
              max_len=None, weights_NxT=None):
  return _token_clip_loss(logp_NxT, logp_old_NxT, adv_N, mask_NxT, eps_low, eps_high,
                          "seq_mean_token_mean", max_len, weights_NxT)


@_register(LOSSES, "dr_grpo")
def dr_grpo_loss(logp_NxT, logp_old_NxT, adv_N, mask_NxT, *, eps_low=0.2, eps_high=0.2,
                 max_len=None, weights_NxT=None):
  return _token_clip_loss(logp_NxT, logp_old_NxT, adv_N, mask_NxT, eps_low, eps_high,
                          "seq_mean_token_sum_norm", max_len, weights_NxT)


LOSSES["dapo"] = ppo_loss  # token-mean with clip-higher
LOSSES["rloo"] = grpo_loss


@_register(LOSSES, "gspo")
def gspo_loss(logp_NxT, logp_old_NxT, adv_N, mask_NxT, *, eps_low=3e-4, eps_high=4e-4,
              max_len=None, weights_NxT=None):
  del max_len
  m = mask_NxT.astype(jnp.float32)
  n_N = jnp.maximum(m.sum(axis=1), 1.0)
  log_ratio = jnp.sum(_log_ratio(logp_NxT, logp_old_NxT, mask_NxT), axis=1) / n_N
  ratio = jnp.exp(log_ratio)
  loss, clipped = _clipped(ratio, adv_N, eps_low, eps_high)
  if weights_NxT is not None:  # a sequence's weight: the mean of its tokens' weights
    loss = loss * jnp.sum(jnp.where(mask_NxT, weights_NxT, 0.0), axis=1) / n_N
  real_N = jnp.any(mask_NxT, axis=1)  # padding rows of a chunk are neither clipped nor counted
  return loss.mean(), {"clip_fraction": jnp.sum(clipped & real_N) / jnp.maximum(real_N.sum(), 1)}


# How each loss aggregates over tokens and rows; the KL term follows its loss's (as in verl and
# TRL), so a batch cut into chunks has the same objective as the whole batch. "token_mean"
# losses divide by the number of response tokens, the others by the number of rows: a chunk's
# loss weight (trainer.plan) is its share of the one or the other.
LOSS_AGGREGATION = {"ppo": "token_mean", "dapo": "token_mean", "grpo": "seq_mean_token_mean",
                    "rloo": "seq_mean_token_mean", "dr_grpo": "seq_mean_token_sum_norm",
                    "gspo": "seq_mean_token_mean"}
LOSS_NORMALISER = {name: "tokens" if agg == "token_mean" else "sequences"
                   for name, agg in LOSS_AGGREGATION.items()}


def kl_penalty(logp_NxT, logp_ref_NxT, estimator: str = "k3"):
  """Per-token KL(pi || ref) estimates from samples of pi: k1 = log r, k3 = r' - log r' - 1
  with r' = pi_ref / pi (unbiased and non-negative). Clamped as verl clamps them (log-ratio to
  +-20, k3 to at most 10): with top-k / top-p a token the policy samples may lie outside the
  reference's kept set, log pi_ref = -inf, and one such token would make the objective and its
  gradient infinite. A token outside both (after an update moved the policy's set) counts 0."""
  both_out = jnp.isneginf(logp_NxT) & jnp.isneginf(logp_ref_NxT)
  log_ratio = jnp.where(both_out, 0.0, jnp.clip(logp_NxT - logp_ref_NxT, -20.0, 20.0))
  if estimator == "k1":
    return log_ratio
  if estimator == "k3":
    return jnp.minimum(jnp.exp(-log_ratio) + log_ratio - 1.0, 10.0)
  raise ValueError(f"unknown KL estimator {estimator!r} (k1 or k3)")


def truncated_importance_weights(logp_trainer_NxT, logp_sampler_NxT, mask_NxT, cap: float = 2.0):
  """Per-token min(pi_trainer / pi_sampler, cap) for sampler/trainer mismatch, with statistics.
  In batch-invariant numerics the ratio is exactly 1 and `kl_sample_train` is 0.0."""
  log_w = jax.lax.stop_gradient(logp_trainer_NxT - logp_sampler_NxT)
  w = jnp.minimum(jnp.exp(log_w), cap)
  m = mask_NxT.astype(jnp.float32)
  n = jnp.maximum(m.sum(), 1.0)
  # Means as sums of deviations from their on-policy values (0 and 1), divided: XLA:GPU divides
  # f32 with a 2-ulp instruction (div.full.f32), so sum(w) / n can be 0.99999994 for w == 1
  # everywhere, while 0 / n is 0 exactly. Off-policy values lose nothing by it.
  stats = {
      "kl_sample_train": jnp.sum(-log_w * m) / n,  # mean log(pi_sampler / pi_trainer)
      "is_weight_mean": 1.0 + jnp.sum((w - 1.0) * m) / n,
      "is_weight_max": jnp.max(jnp.where(mask_NxT, jnp.exp(log_w), 0.0)),
      "is_truncated_fraction": jnp.sum((jnp.exp(log_w) > cap) * m) / n,
  }
  return w, stats
