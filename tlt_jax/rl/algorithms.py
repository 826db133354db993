"""Advantage estimators and policy losses of the GRPO family, as registries of pure functions.

Shapes: N sequences in groups of G (N = num_groups * G, group-major), T response tokens.
`logp_*_NxT` are per-token log-probs of the sampled tokens, `mask_NxT` marks response tokens.

Estimators (rewards [N] -> advantages [N]):
  grpo     (r - mean_group) / (std_group + eps), std with Bessel's correction (as TRL / verl)
  dr_grpo  r - mean_group (no std: Dr. GRPO removes the difficulty bias)
  rloo     r_i - mean_{j != i} r_j = G / (G - 1) (r_i - mean_group)
  dapo     grpo's advantages; groups whose rewards are all equal are dropped by `mixed_groups`
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


@_register(ADVANTAGES, "grpo")
def grpo_advantages(rewards_N, group_size: int, eps: float = 1e-6):
  r = _groups(rewards_N, group_size)
  std = jnp.std(r, axis=1, keepdims=True, ddof=1) if group_size > 1 else jnp.zeros_like(r[:, :1])
  return ((r - r.mean(axis=1, keepdims=True)) / (std + eps)).reshape(-1)


@_register(ADVANTAGES, "dr_grpo")
def dr_grpo_advantages(rewards_N, group_size: int):
  r = _groups(rewards_N, group_size)
  return (r - r.mean(axis=1, keepdims=True)).reshape(-1)


@_register(ADVANTAGES, "rloo")
def rloo_advantages(rewards_N, group_size: int):
  if group_size < 2:
    raise ValueError("rloo needs groups of at least 2")
  r = _groups(rewards_N, group_size)
  others = (r.sum(axis=1, keepdims=True) - r) / (group_size - 1)
  return (r - others).reshape(-1)


ADVANTAGES["dapo"] = grpo_advantages
ADVANTAGES["gspo"] = grpo_advantages


def mixed_groups(rewards_N, group_size: int) -> jax.Array:
  """DAPO dynamic sampling: True for the sequences of groups with at least two distinct rewards."""
  r = _groups(rewards_N, group_size)
  mixed = jnp.any(r != r[:, :1], axis=1)
  return jnp.repeat(mixed, group_size)


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
  return -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv)


def _token_clip_loss(logp_NxT, logp_old_NxT, adv_N, mask_NxT, eps_low, eps_high, agg, max_len,
                     weights_NxT=None):
  ratio = jnp.exp(logp_NxT - logp_old_NxT)
  loss = _clipped(ratio, adv_N[:, None], eps_low, eps_high)
  if weights_NxT is not None:  # truncated importance weights (exactly 1.0 when on-policy)
    loss = loss * weights_NxT
  clipped = (jnp.abs(ratio - 1.0) > jnp.where(adv_N[:, None] >= 0, eps_high, eps_low)) & mask_NxT
  stats = {"clip_fraction": jnp.sum(clipped) / jnp.maximum(jnp.sum(mask_NxT), 1)}
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
  log_ratio = jnp.sum((logp_NxT - logp_old_NxT) * m, axis=1) / n_N
  ratio = jnp.exp(log_ratio)
  loss = _clipped(ratio, adv_N, eps_low, eps_high)
  if weights_NxT is not None:  # a sequence's weight: the mean of its tokens' weights
    loss = loss * jnp.sum(weights_NxT * m, axis=1) / n_N
  clipped = jnp.abs(ratio - 1.0) > jnp.where(adv_N >= 0, eps_high, eps_low)
  return loss.mean(), {"clip_fraction": clipped.mean()}


# How each loss normalises, so a batch can be split into chunks whose gradients add up to the
# whole batch's: "tokens" losses divide by the number of response tokens, "sequences" losses by
# the number of rows.
LOSS_NORMALISER = {"ppo": "tokens", "dapo": "tokens", "grpo": "sequences", "rloo": "sequences",
                   "dr_grpo": "sequences", "gspo": "sequences"}


def kl_penalty(logp_NxT, logp_ref_NxT, estimator: str = "k3"):
  """Per-token KL(pi || ref) estimates from samples of pi: k1 = log r, k3 = r' - log r' - 1
  with r' = pi_ref / pi (unbiased and non-negative)."""
  log_ratio = logp_NxT - logp_ref_NxT
  if estimator == "k1":
    return log_ratio
  if estimator == "k3":
    return jnp.exp(-log_ratio) + log_ratio - 1.0
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
