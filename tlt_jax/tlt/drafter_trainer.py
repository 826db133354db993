"""EAGLE loss and a jitted drafter training step.

At position t the drafter reads (x_t, h_{t-1}) and predicts the target's feature h_t; the loss
is SmoothL1(f_t, h_t) plus a soft cross-entropy between the target's next-token distribution
softmax(lm_head(h_t)) and the drafter's softmax(lm_head(f_t)). The target (embedding, lm_head,
its hidden states) is frozen: gradients flow into the drafter only.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import safetensors.numpy
from flax import nnx

from tlt_jax.model.drafter import Drafter, check_fits
from tlt_jax.model.transformer import ModelConfig, Transformer

DRAFTER_FILE = "drafter.safetensors"


@dataclasses.dataclass(frozen=True)
class DrafterLossConfig:
  feature_weight: float = 1.0
  ce_weight: float = 0.1
  # Draft depths trained per step (`tlt.packed_loss`): 1 = teacher forcing only; k > 1 also
  # feeds the drafter's own features back, as it drafts, for depths 2..k.
  unroll: int = 1
  unroll_decay: float = 0.8  # depth j's loss weight: unroll_decay ** (j - 1)


def eagle_loss(drafter: Drafter, target: Transformer, tokens_BxT: jax.Array,
               hidden_BxTxD: jax.Array, mask_BxT: jax.Array,
               cfg: DrafterLossConfig = DrafterLossConfig()) -> tuple[jax.Array, dict]:
  B, T = tokens_BxT.shape
  hidden = jax.lax.stop_gradient(hidden_BxTxD.astype(jnp.float32))
  features_in = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
  logits, feature, _ = drafter(target, tokens_BxT, features_in, drafter.init_cache(B, T),
                               jnp.zeros((B,), jnp.int32))
  target_logp = jax.lax.stop_gradient(jax.nn.log_softmax(target.logits(hidden), axis=-1))
  draft_logp = jax.nn.log_softmax(logits, axis=-1)
  m = mask_BxT.astype(jnp.float32)
  denom = jnp.maximum(m.sum(), 1.0)
  feat = jnp.sum(optax.huber_loss(feature.astype(jnp.float32), hidden).mean(-1) * m) / denom
  ce = jnp.sum(-jnp.sum(jnp.exp(target_logp) * draft_logp, axis=-1) * m) / denom
  agree = jnp.sum((jnp.argmax(logits, -1) == jnp.argmax(target_logp, -1)) * m) / denom
  loss = cfg.feature_weight * feat + cfg.ce_weight * ce
  return loss, {"loss": loss, "feature_loss": feat, "ce_loss": ce, "top1_agreement": agree}


def make_optimizer(drafter: Drafter, lr: float = 3e-3, weight_decay: float = 0.0) -> nnx.Optimizer:
  return nnx.Optimizer(drafter, optax.adamw(lr, weight_decay=weight_decay), wrt=nnx.Param)


@nnx.jit
def train_step(drafter: Drafter, optimizer: nnx.Optimizer, target: Transformer, tokens_BxT,
               hidden_BxTxD, mask_BxT):
  grad_fn = nnx.value_and_grad(lambda d: eagle_loss(d, target, tokens_BxT, hidden_BxTxD, mask_BxT),
                               has_aux=True)
  (_, metrics), grads = grad_fn(drafter)
  optimizer.update(drafter, grads)
  return metrics


@nnx.jit
def target_hidden(target: Transformer, tokens_BxT):
  return target(tokens_BxT).hidden_BxTxD


def train_on_sequences(drafter: Drafter, target: Transformer, sequences: list[list[int]], *,
                       steps: int, batch_size: int = 16, lr: float = 3e-3, seed: int = 0) -> dict:
  """Offline warm-up: the target's own hidden states over `sequences` (e.g. its rollouts)."""
  T = max(len(s) for s in sequences)
  tokens = np.zeros((len(sequences), T), np.int32)
  mask = np.zeros((len(sequences), T), bool)
  for i, s in enumerate(sequences):
    tokens[i, :len(s)] = s
    mask[i, :len(s)] = True
  hidden = np.asarray(target_hidden(target, jnp.asarray(tokens)))
  optimizer = make_optimizer(drafter, lr)
  rng = np.random.default_rng(seed)
  metrics = {}
  for _ in range(steps):
    idx = rng.choice(len(sequences), size=min(batch_size, len(sequences)), replace=False)
    metrics = train_step(drafter, optimizer, target, tokens[idx], hidden[idx], mask[idx])
  return {k: float(v) for k, v in metrics.items()}


def _flat(drafter: Drafter) -> dict[str, np.ndarray]:
  flat = nnx.to_flat_state(nnx.state(drafter, nnx.Param))
  return {"/".join(str(k) for k in path): np.asarray(v.get_value()) for path, v in flat}


def save_drafter(drafter: Drafter, out_dir: str) -> str:
  """The drafter's weights as one safetensors file (names are NNX paths: 'layer/mlp/...')."""

  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, DRAFTER_FILE)
  safetensors.numpy.save_file(_flat(drafter), path)
  return path


def load_drafter(path: str, target_cfg: ModelConfig) -> Drafter:
  """A drafter for `target_cfg` with the weights in `path` (a file or its directory); a drafter
  saved for another target fails with the names and shapes that differ."""

  if os.path.isdir(path):
    path = os.path.join(path, DRAFTER_FILE)
  tensors = safetensors.numpy.load_file(path)
  drafter = Drafter(target_cfg, nnx.Rngs(0))
  want = _flat(drafter)
  problems = [f"missing {k}" for k in want if k not in tensors]
  problems += [f"unexpected {k}" for k in tensors if k not in want]
  problems += [f"{k}: file {tensors[k].shape} vs drafter {v.shape}" for k, v in want.items()
               if k in tensors and tensors[k].shape != v.shape]
  if problems:
    raise ValueError(f"{path} does not fit this target's drafter: " + "; ".join(problems[:6]))
  state = nnx.state(drafter, nnx.Param)
  for p, var in nnx.to_flat_state(state):
    var.set_value(jnp.asarray(tensors["/".join(str(k) for k in p)], var.get_value().dtype))
  nnx.update(drafter, state)
  check_fits(drafter, target_cfg)
  return drafter
