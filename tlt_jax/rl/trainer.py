"""The RL train step: trainer log-probs, importance weights, the policy loss, an optax update.

Layout of a rollout batch (N sequences, group-major, each row = prompt + response, right-padded
to a fixed length L so the step compiles once): position t predicts token t + 1, so every
per-token array has T = L - 1 columns and `mask_NxT` marks the positions whose next token is a
response token.

The batch is sorted by length and cut into chunks of `chunk_rows` rows, each padded (on the
right) only to its own length bucket: most responses are short, and attention cost grows with
the square of the padded length. Chunks are dealt round-robin into `minibatches`; a minibatch's
chunk gradients are weighted so they add up to the gradient of the minibatch as one batch.
Right padding keeps every row's log-probs bitwise what they are at any other padded length.

Per rollout batch:
  1. (only when there is more than one update) one forward without gradients at the sampling-
     time parameters: the trainer's log-probs for the PPO ratio. With one update (the default,
     fully on-policy) the update's own forward is at those parameters and serves instead;
  2. from the trainer's log-probs at the sampling-time parameters: the sampler/trainer mismatch
     (`kl_sample_train`, exactly 0.0 in batch-invariant numerics) and truncated importance
     weights; reference log-probs for the KL term come from the same model with every LoRA
     parameter zeroed (LoRA off: no second model in memory; full fine-tuning keeps a frozen copy
     of the initial weights);
  3. `epochs` passes of `minibatches` clipped-ratio updates.
Log-probs use the sampler's one definition: log_softmax of the tempered, top-k/top-p masked
logits (`rollout.sampling.masked_logits`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from tlt_jax import mesh as mesh_lib
from tlt_jax import ops
from tlt_jax import tensor_parallel as tp
from tlt_jax.rl import algorithms
from tlt_jax.rollout.sampling import SamplingParams, masked_logits


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  algorithm: str = "grpo"     # advantage estimator (algorithms.ADVANTAGES)
  loss: str = ""              # policy loss (algorithms.LOSSES); "" = the algorithm's own
  lr: float = 1e-3
  warmup_steps: int = 0
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  minibatches: int = 1        # updates per epoch over the rollout batch
  epochs: int = 1
  eps_low: float | None = None   # None = the loss's default (clip-higher for ppo / dapo)
  eps_high: float | None = None
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  tis_cap: float = 2.0        # truncated importance sampling cap; 0 = off
  max_response_len: int = 0   # Dr. GRPO's constant normaliser (tokens)
  chunk_rows: int = 16        # rows per length-bucketed chunk (a multiple of data x fsdp)
  length_bucket: int = 32     # chunks are padded to a multiple of this many tokens
  # mesh.model > 1 in batch_invariant: split the model exactly (tensor_parallel.py; sampler ==
  # trainer bitwise; the logits' gradient whole on every device) or as XLA does (Megatron:
  # 1/model of it; last-bit differences)
  exact_tensor_parallel: bool = True
  # exact split: the backward all-gathers o_proj's and down_proj's inputs again and recomputes
  # the logits (two more all-gathers per layer, one more vocabulary matmul) instead of keeping
  # them whole on every device
  tp_regather: bool = True
  # ... and runs the vocabulary head over this many tokens of a row at a time, so its backward
  # holds [rows, head_chunk_tokens, V] of logits and their gradient rather than the whole rows'
  head_chunk_tokens: int = 1024
  sampling: SamplingParams = SamplingParams()

  def __post_init__(self):
    if self.algorithm not in algorithms.ADVANTAGES:
      raise ValueError(f"unknown algorithm {self.algorithm!r}; choose from "
                       f"{sorted(algorithms.ADVANTAGES)}")
    if self.loss_name not in algorithms.LOSSES:
      raise ValueError(f"unknown loss {self.loss!r}; choose from {sorted(algorithms.LOSSES)}")
    if self.minibatches < 1 or self.epochs < 1 or self.head_chunk_tokens < 1:
      raise ValueError("minibatches, epochs and head_chunk_tokens must be >= 1")
    if self.kl_estimator not in ("k1", "k3"):
      raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {self.kl_estimator!r}")

  @property
  def loss_name(self) -> str:
    return self.loss or self.algorithm

  @classmethod
  def from_config(cls, c) -> TrainConfig:
    """The one translation of a run config (tlt_jax/config.py) into the trainer's settings."""
    rl, r = c.rl, c.rollout
    return cls(
        algorithm=rl.algorithm, loss=rl.loss, lr=rl.lr, warmup_steps=rl.warmup_steps,
        weight_decay=rl.weight_decay, max_grad_norm=rl.max_grad_norm, minibatches=rl.minibatches,
        epochs=rl.epochs, eps_low=rl.eps_low if rl.eps_low >= 0 else None,
        eps_high=rl.eps_high if rl.eps_high >= 0 else None, kl_coef=rl.kl_coef,
        kl_estimator=rl.kl_estimator, tis_cap=rl.tis_cap, max_response_len=r.max_new_tokens,
        chunk_rows=rl.chunk_rows, length_bucket=rl.length_bucket,
        exact_tensor_parallel=rl.exact_tensor_parallel,
        tp_regather=rl.tp_regather,
        sampling=SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p))


@dataclasses.dataclass
class Batch:
  """Host arrays of one rollout batch (see the module docstring for the layout)."""
  tokens_NxL: np.ndarray       # int32
  mask_NxT: np.ndarray         # bool
  sampler_logp_NxT: np.ndarray  # float32, 0 outside the mask
  advantages_N: np.ndarray     # float32
  lengths_N: np.ndarray | None = None  # prompt + response tokens (default: from the mask)

  def take(self, rows: np.ndarray, length: int) -> "Batch":
    """Rows `rows` (-1 = an empty padding row), cut to `length` tokens."""
    real = rows >= 0
    idx = np.where(real, rows, 0)
    tokens = np.where(real[:, None], self.tokens_NxL[idx, :length], 0)
    mask = self.mask_NxT[idx, :length - 1] & real[:, None]
    logp = np.where(mask, self.sampler_logp_NxT[idx, :length - 1], 0.0).astype(np.float32)
    return Batch(tokens, mask, logp, np.where(real, self.advantages_N[idx], 0.0).astype(np.float32))

  def row_lengths(self) -> np.ndarray:
    if self.lengths_N is not None:
      return self.lengths_N
    last = np.where(self.mask_NxT.any(1), self.mask_NxT.shape[1] - np.argmax(
        self.mask_NxT[:, ::-1], axis=1), 1)
    return last + 1


def make_batch(prompts: list[list[int]], responses: list[np.ndarray],
               sampler_logps: list[np.ndarray], advantages_N: np.ndarray, length: int, *,
               weights_N: np.ndarray | None = None) -> Batch:
  """Packs (prompt, response, its sampler log-probs) rows; `weights_N` = 0 drops a sequence
  from the loss (DAPO's filtered groups) without changing the batch shape."""
  N = len(prompts)
  tokens = np.zeros((N, length), np.int32)
  mask = np.zeros((N, length - 1), bool)
  logp = np.zeros((N, length - 1), np.float32)
  for i, (p, r, lp) in enumerate(zip(prompts, responses, sampler_logps)):
    if len(p) + len(r) > length:
      raise ValueError(f"sequence {i}: prompt {len(p)} + response {len(r)} tokens exceed the "
                       f"train length {length}")
    tokens[i, :len(p)] = p
    tokens[i, len(p):len(p) + len(r)] = r
    keep = weights_N is None or weights_N[i] > 0
    mask[i, len(p) - 1:len(p) - 1 + len(r)] = keep
    logp[i, len(p) - 1:len(p) - 1 + len(r)] = lp
  lengths = np.array([len(p) + len(r) for p, r in zip(prompts, responses)], np.int32)
  return Batch(tokens, mask, logp, np.asarray(advantages_N, np.float32), lengths)


def policy_logprobs(model, tokens_NxL: jax.Array, sampling: SamplingParams,
                    head_chunk_tokens: int = 1024):
  """(log-probs [N, T] of tokens 1..L-1, per-position entropy [N, T]) under the masked,
  tempered distribution the sampler draws from."""
  hidden_NxTxD = model(tokens_NxL, logits=False).hidden_BxTxD[:, :-1]
  targets_NxT = tokens_NxL[:, 1:]

  def head(hidden_NxCxD, targets_NxC):
    masked = masked_logits(model.logits(hidden_NxCxD), sampling)
    logp = ops.token_logprobs(masked, targets_NxC)
    logp_all = jax.nn.log_softmax(masked, axis=-1)
    entropy = -jnp.sum(jnp.where(jnp.isfinite(logp_all), jnp.exp(logp_all) * logp_all, 0.0), -1)
    return logp, entropy
  if not tp.regathering():
    return head(hidden_NxTxD, targets_NxT)
  # Split exactly, the logits (and in the backward their gradient) are whole [N, T, V] f32 on
  # every device. So the head runs over chunks of C tokens, and the backward recomputes each
  # chunk's logits (one more vocabulary matmul and gather) rather than keeping them: it holds
  # [N, C, V] at a time. Rows are independent in the batch-invariant kernels: the same bits.
  N, T, D = hidden_NxTxD.shape
  C = min(head_chunk_tokens, T)
  pad = -T % C
  hidden_KxNxCxD = jnp.pad(hidden_NxTxD, ((0, 0), (0, pad), (0, 0))).reshape(
      N, -1, C, D).transpose(1, 0, 2, 3)
  targets_KxNxC = jnp.pad(targets_NxT, ((0, 0), (0, pad))).reshape(N, -1, C).transpose(1, 0, 2)
  chunk = jax.checkpoint(head)
  logp_KxNxC, entropy_KxNxC = jax.lax.map(lambda hc: chunk(*hc), (hidden_KxNxCxD, targets_KxNxC))
  whole = lambda x_KxNxC: x_KxNxC.transpose(1, 0, 2).reshape(N, -1)[:, :T]
  return whole(logp_KxNxC), whole(entropy_KxNxC)


def _on_response(logp_NxT, mask_NxT):
  """Log-probs on response tokens, 0 elsewhere: with top-k / top-p a prompt or padding token
  outside the kept set has log-prob -inf, and -inf in a masked-out product is NaN (in the loss,
  the KL term, the statistics and the gradient)."""
  return jnp.where(mask_NxT, logp_NxT, 0.0)


def _zero_lora(trainable):
  return jax.tree.map(jnp.zeros_like, trainable)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW (after a linear warm-up when `cfg.warmup_steps`)."""
  schedule = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
  return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm),
                     optax.adamw(schedule, weight_decay=cfg.weight_decay))


class StepFunctions:
  """The train step's device functions for one model structure, config and mesh; they hold no
  arrays (parameters, the frozen weights and the batch are all arguments), so one set serves
  every Trainer with that key (`step_functions`), and the memory plan traces them abstractly."""

  def __init__(self, cfg: TrainConfig, graphdef, mesh: jax.sharding.Mesh | None = None):
    self.cfg, self.graphdef, self.mesh = cfg, graphdef, mesh
    self.tx = make_optimizer(cfg)
    self.prepare = jax.jit(self._prepare_fn)
    self.grad = jax.jit(self._grad_fn)
    self.apply = jax.jit(self._apply_fn, donate_argnums=(0, 1))
    self.accumulate = jax.jit(lambda total, g: jax.tree.map(jnp.add, total, g))
    self.copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))  # one program, not one per leaf

  # The frozen weights are an argument of every device function, never a closed-over constant:
  # a constant would be baked into the program (the whole base model, for a LoRA run), and
  # arrays that span processes cannot be constants at all.

  def _logprobs(self, params, frozen, tokens):
    def rows_logprobs(params, frozen, tokens):
      return policy_logprobs(nnx.merge(self.graphdef, params, frozen), tokens, self.cfg.sampling,
                             self.cfg.head_chunk_tokens)
    if self.mesh is None or ops.numerics() != "batch_invariant":
      return rows_logprobs(params, frozen, tokens)  # XLA partitions it (GSPMD)
    # Batch-invariant kernels run per device on that device's whole rows: XLA cannot partition
    # a Pallas call (it would gather the batch onto every device), and the blocked twin's
    # lax.map over a sharded row axis gathers too. Row invariance makes each row's log-probs
    # bitwise the single-device ones; autodiff sums the parameter gradients over the batch
    # axes (psum). Parameters are gathered over fsdp for the whole forward.
    # check_vma=False: Pallas' interpret mode (CPU) mis-types its loop carries in a shard_map
    # that checks how values vary. Unchecked is exact here: every output names all the manual
    # axes but model, and the split forward's gathers transpose accordingly (tensor_parallel).
    rows = P(mesh_lib.BATCH_AXES)
    model_size = self.mesh.shape["model"]
    if model_size == 1 or not self.cfg.exact_tensor_parallel:  # model axis: XLA (Megatron)
      return jax.shard_map(rows_logprobs, mesh=self.mesh, in_specs=(P(), P(), rows),
                           out_specs=(rows, rows), axis_names=set(mesh_lib.BATCH_AXES),
                           check_vma=False)(params, frozen, tokens)
    # mesh.model > 1: exact tensor parallelism (`tensor_parallel`): every linear layer split
    # over its outputs, whole inputs gathered, so each row's log-probs stay bitwise the
    # unsplit sampler's (with the Pallas kernels; see that module for the CPU twin).

    def split_rows_logprobs(params, frozen, tokens):
      with tp.over("model", regather=self.cfg.tp_regather):
        return rows_logprobs(params, frozen, tokens)
    return jax.shard_map(split_rows_logprobs, mesh=self.mesh,
                         in_specs=(tp.param_specs(params, "model", model_size),
                                   tp.param_specs(frozen, "model", model_size), rows),
                         out_specs=(rows, rows), check_vma=False)(params, frozen, tokens)

  def _mismatch(self, trainer_logp, sampler_logp, mask, entropy):
    """Importance weights and the sampler/trainer statistics, from the trainer's log-probs at
    the sampling-time parameters."""
    trainer_logp = jax.lax.stop_gradient(trainer_logp)
    weights, stats = algorithms.truncated_importance_weights(
        trainer_logp, sampler_logp, mask, self.cfg.tis_cap or 2.0)
    m = mask.astype(jnp.float32)
    stats["entropy"] = jnp.sum(jax.lax.stop_gradient(entropy) * m) / jnp.maximum(m.sum(), 1.0)
    # Max over tokens of |trainer - sampler|: the strictest on-policy check (0.0 when invariant).
    stats["logp_abs_diff_max"] = jnp.max(jnp.where(mask, jnp.abs(trainer_logp - sampler_logp),
                                                   0.0))
    return (weights if self.cfg.tis_cap else None), stats

  def _prepare_fn(self, trainable, frozen, reference, tokens, mask, sampler_logp):
    old_logp, entropy = self._logprobs(trainable, frozen, tokens)
    old_logp = _on_response(old_logp, mask)
    weights, stats = self._mismatch(old_logp, sampler_logp, mask, entropy)
    ref_logp = (None if reference is None
                else _on_response(self._logprobs(reference, frozen, tokens)[0], mask))
    return old_logp, weights, ref_logp, dict(stats, response_tokens=jnp.sum(mask))

  def _loss_fn(self, trainable, frozen, reference, chunk_weight, tokens, mask, sampler_logp, adv,
               old_logp, weights, ref_logp):
    cfg = self.cfg
    logp, entropy = self._logprobs(trainable, frozen, tokens)
    logp = _on_response(logp, mask)
    stats = {}
    if old_logp is None:  # the one update: this forward is at the sampling-time parameters
      old_logp = jax.lax.stop_gradient(logp)
      weights, stats = self._mismatch(logp, sampler_logp, mask, entropy)
      if reference is not None:
        ref_logp = jax.lax.stop_gradient(
            _on_response(self._logprobs(reference, frozen, tokens)[0], mask))
    kw = {"max_len": cfg.max_response_len or None, "weights_NxT": weights}
    if cfg.eps_low is not None:
      kw["eps_low"] = cfg.eps_low
    if cfg.eps_high is not None:
      kw["eps_high"] = cfg.eps_high
    pg_loss, loss_stats = algorithms.LOSSES[cfg.loss_name](logp, old_logp, adv, mask, **kw)
    # The chunk's share of the minibatch's loss terms (they add up over its chunks to the
    # minibatch's values: padding rows shrink nothing), and its token count, which weighs its
    # per-token statistics.
    terms = {"pg_loss": pg_loss}
    if ref_logp is not None:
      # Aggregated as the loss aggregates (verl, TRL): a token mean inside a chunk weighted by
      # the chunk's rows would make the objective depend on rl.chunk_rows.
      terms["kl_ref"] = algorithms.aggregate(
          algorithms.kl_penalty(logp, ref_logp, cfg.kl_estimator), mask,
          algorithms.LOSS_AGGREGATION[cfg.loss_name], cfg.max_response_len or None)
    terms["loss"] = pg_loss + cfg.kl_coef * terms.get("kl_ref", 0.0)
    stats = dict(stats, **loss_stats, response_tokens=jnp.sum(mask))
    stats.update({k: v * chunk_weight for k, v in terms.items()})
    return terms["loss"] * chunk_weight, stats

  def _grad_fn(self, trainable, frozen, reference, chunk_weight, *chunk):
    return jax.grad(self._loss_fn, has_aux=True)(trainable, frozen, reference, chunk_weight,
                                                 *chunk)

  def _apply_fn(self, trainable, opt_state, grads):
    updates, new_opt_state = self.tx.update(grads, opt_state, trainable)
    new_trainable = optax.apply_updates(trainable, updates)
    grad_norm = optax.tree.norm(grads)
    # A non-finite gradient keeps the previous parameters and optimizer state (the host then
    # stops the run with the step's statistics): one bad batch never poisons the weights.
    finite = jnp.isfinite(grad_norm)
    keep = lambda new, old: jnp.where(finite, new, old)
    return (jax.tree.map(keep, new_trainable, trainable),
            jax.tree.map(keep, new_opt_state, opt_state), grad_norm)


# A second Trainer of the same model structure, config and mesh in this process (a resumed run,
# a notebook cell run again, the next point of an in-process sweep) reuses the traced and
# compiled step. The numerics mode is part of jax.jit's own key (ops.py). Few are kept: each
# holds its executables, and those hold memory mappings (see engine._SHARED_PROGRAMS).
@functools.lru_cache(maxsize=4)
def step_functions(cfg: TrainConfig, graphdef, mesh: jax.sharding.Mesh | None) -> StepFunctions:
  return StepFunctions(cfg, graphdef, mesh)


class _Compiled:
  """A jitted function with its ahead-of-time compiled programs: `compile(*args)` lowers and
  compiles for the arguments' shapes, dtypes and shardings (arrays or ShapeDtypeStructs, nothing
  runs); a call with matching arguments runs that program, any other call the jitted function.
  (A jit call after `.lower().compile()` traces and compiles again: JAX keeps no link.)"""

  def __init__(self, jitted):
    self.jitted = jitted
    self.programs: dict = {}

  @staticmethod
  def _key(args) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((tuple(x.shape), np.dtype(x.dtype), bool(getattr(x, "weak_type", False)),
                           getattr(x, "sharding", None)) for x in leaves)

  def compile(self, *args):
    key = self._key(args)
    if key not in self.programs:
      self.programs[key] = self.jitted.lower(*args).compile()
    return self.programs[key]

  def __call__(self, *args):
    program = self.programs.get(self._key(args))
    return (program or self.jitted)(*args)

  def lower(self, *args):
    return self.jitted.lower(*args)


class Trainer:
  """Owns the trainable parameters (LoRA, or all of them when the model has no LoRA) and the
  optimizer state; `local_policy()` is the current model for the rollout engine.

  `mesh` may span several processes (a multi-host run): the state then lives as global arrays,
  sharded over every process's devices, and each process passes the same (gathered) batch.
  `model` is resharded in place onto the mesh."""

  def __init__(self, model: nnx.Module, cfg: TrainConfig, mesh: jax.sharding.Mesh | None = None):
    self.cfg = cfg
    self.mesh = mesh
    if mesh is not None:
      row_shards = math.prod(mesh.shape[a] for a in mesh_lib.BATCH_AXES)
      if cfg.chunk_rows % row_shards:
        raise ValueError(f"rl.chunk_rows={cfg.chunk_rows} is not a multiple of the mesh's "
                         f"data x fsdp = {row_shards}: each device takes whole rows of a chunk")
    has_lora = bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    self.full_finetune = not has_lora
    wrt = nnx.LoRAParam if has_lora else nnx.Param
    if (mesh is not None and mesh.shape["model"] > 1 and ops.numerics() == "batch_invariant"
        and cfg.exact_tensor_parallel):
      # Exact tensor parallelism (`_logprobs`): keep the weights split the way it runs them.
      tp.check_model(model.cfg, mesh.shape["model"])
      mesh_lib.shard_model(model, mesh, tp.storage_shardings)
    elif mesh is not None:
      mesh_lib.shard_model(model, mesh)
    self.graphdef, self.trainable, self.frozen = nnx.split(model, wrt, ...)
    self.fns = step_functions(cfg, self.graphdef, mesh)
    self.opt_state = self.fns.tx.init(self.trainable)
    if mesh is not None:  # scalars (the step count) too: a restored state keeps these shardings
      on_mesh = set(mesh.devices.flat)
      replicated = jax.sharding.NamedSharding(mesh, P())
      self.opt_state = jax.tree.map(
          lambda x: x if x.sharding.device_set == on_mesh else jax.device_put(x, replicated),
          self.opt_state)
    # Reference for the KL term: LoRA off (zeroed adapters give exactly the base model), or the
    # initial weights under full fine-tuning.
    self.reference = None
    if cfg.kl_coef:
      self.reference = (jax.tree.map(jnp.copy, self.trainable) if self.full_finetune
                        else _zero_lora(self.trainable))
    self.single_update = cfg.minibatches == 1 and cfg.epochs == 1
    self._prepare, self._grad = _Compiled(self.fns.prepare), _Compiled(self.fns.grad)
    self._apply, self._accumulate = _Compiled(self.fns.apply), _Compiled(self.fns.accumulate)
    self._copy = _Compiled(self.fns.copy)
    self._local_frozen = None

  # -- what the rest of the run sees

  def policy(self) -> nnx.Module:
    """The current model, its arrays on the trainer's mesh."""
    return nnx.merge(self.graphdef, self.trainable, self.frozen)

  def local_trainable(self):
    """The trainable parameters as arrays of this process (gathered when the mesh spans
    processes: every process must call it together)."""
    return mesh_lib.to_local(self.trainable)

  def local_policy(self) -> nnx.Module:
    """The current model with arrays of this process, for the rollout engine, the drafter and
    exports (the same as `policy()` on a single-process mesh). On a multi-host mesh it is an
    all-gather, so every process must call it together; the frozen part is gathered once."""
    if self._local_frozen is None:
      self._local_frozen = mesh_lib.to_local(self.frozen)
    return nnx.merge(self.graphdef, self.local_trainable(), self._local_frozen)

  def state(self) -> dict[str, Any]:
    return {"params": self.trainable, "opt_state": self.opt_state}

  def load_state(self, state: dict[str, Any]) -> None:
    self.trainable, self.opt_state = state["params"], state["opt_state"]

  # -- host side

  def _device(self, x):
    if x is None or self.mesh is None:
      return x
    return mesh_lib.shard_batch(jnp.asarray(x), self.mesh)

  def chunks(self, batch: Batch) -> list[list[tuple[np.ndarray, int]]]:
    """Per minibatch, its chunks as (row indices, padded length); rows sorted by length."""
    cfg = self.cfg
    lengths = batch.row_lengths()
    order = np.argsort(lengths, kind="stable")
    R = cfg.chunk_rows
    pad = (-len(order)) % R
    order = np.concatenate([order, np.full(pad, -1)])
    full = batch.tokens_NxL.shape[1]
    chunks = []
    for i in range(0, len(order), R):
      rows = order[i:i + R]
      longest = int(lengths[rows[rows >= 0]].max())
      chunks.append((rows, min(full, -(-longest // cfg.length_bucket) * cfg.length_bucket)))
    if len(chunks) < cfg.minibatches:
      raise ValueError(f"{len(chunks)} chunks of {R} rows cannot make {cfg.minibatches} "
                       "minibatches: lower trainer chunk_rows or minibatches")
    return [chunks[m::cfg.minibatches] for m in range(cfg.minibatches)]

  def warm_up(self, length: int) -> int:
    """Compiles the step for every chunk shape a batch of rows up to `length` tokens can make
    (one per length bucket), and the gradient sum and the update, so no RL step pays a compile;
    nothing runs (ahead-of-time compilation: on a warm persistent cache this is loading).
    Returns how many chunk shapes."""
    cfg = self.cfg
    lengths = sorted({min(length, b) for b in range(cfg.length_bucket, length + cfg.length_bucket,
                                                     cfg.length_bucket)})
    state = (self.trainable, self.frozen, self.reference)
    for L in lengths:
      R = cfg.chunk_rows
      dev = tuple(self._device(x) for x in (
          np.zeros((R, L), np.int32), np.zeros((R, L - 1), bool),
          np.zeros((R, L - 1), np.float32), np.zeros((R,), np.float32)))
      extra = (None, None, None)
      if not self.single_update:
        extra = self._prepare.compile(*state, *dev[:3]).out_info[:3]
      grads = self._grad.compile(*state, np.float32(0.0), *dev, *extra).out_info[0]
    self._accumulate.compile(grads, grads)
    self._apply.compile(self.trainable, self.opt_state, grads)
    if cfg.minibatches * cfg.epochs > 1:
      self._copy.compile((self.trainable, self.opt_state))
    return len(lengths)

  def plan(self, batch: Batch) -> list[list[tuple[tuple, np.float32]]]:
    """Per minibatch: its chunks on device with their loss weights (summing the weighted chunk
    losses gives the minibatch's loss as if it were one batch)."""
    by_token = algorithms.LOSS_NORMALISER[self.cfg.loss_name] == "tokens"
    plan = []
    for mb_chunks in self.chunks(batch):
      parts = [batch.take(rows, length) for rows, length in mb_chunks]
      tokens_mb = sum(int(p.mask_NxT.sum()) for p in parts)
      rows_mb = sum(int((rows >= 0).sum()) for rows, _ in mb_chunks)
      plan.append([
          ((self._device(p.tokens_NxL), self._device(p.mask_NxT),
            self._device(p.sampler_logp_NxT), self._device(p.advantages_N)),
           np.float32(p.mask_NxT.sum() / max(tokens_mb, 1) if by_token
                      else len(p.advantages_N) / max(rows_mb, 1)))
          for p in parts])
    return plan

  def gradients(self, chunk_list, prepared=None):
    """The minibatch's gradient, accumulated over its chunks, and the per-chunk statistics."""
    grads, stats = None, []
    for c, (dev, w) in enumerate(chunk_list):
      extra = prepared[c] if prepared else (None, None, None)
      g, st = self._grad(self.trainable, self.frozen, self.reference, w, *dev, *extra)
      grads = g if grads is None else self._accumulate(grads, g)
      stats.append(st)
    return grads, stats

  def step(self, batch: Batch) -> dict[str, float]:
    """One rollout batch: epochs x minibatches updates. Returns host metrics."""
    cfg = self.cfg
    plan = self.plan(batch)
    prep_stats, prepared = [], []
    if not self.single_update:  # log-probs at the sampling-time parameters, before any update
      for chunk_list in plan:
        prepared.append([])
        for dev, _ in chunk_list:
          old_logp, is_w, ref_logp, st = self._prepare(self.trainable, self.frozen,
                                                       self.reference, *dev[:3])
          prepared[-1].append((old_logp, is_w, ref_logp))
          prep_stats.append(st)
    update_stats, grad_norms = [], []
    # Several updates per batch: one non-finite update must undo the ones before it too, and
    # the update donates its inputs, so the state before the batch is kept as a copy.
    before = (None if cfg.minibatches * cfg.epochs == 1 else
              self._copy((self.trainable, self.opt_state)))
    for _ in range(cfg.epochs):
      for m, chunk_list in enumerate(plan):
        grads, stats = self.gradients(chunk_list, prepared[m] if prepared else None)
        update_stats.append(stats)
        self.trainable, self.opt_state, grad_norm = self._apply(self.trainable, self.opt_state,
                                                                grads)
        grad_norms.append(float(grad_norm))
    out = _update_stats(update_stats)
    if prep_stats:
      out.update(_token_weighted(prep_stats))
    for k in ("is_weight_max", "logp_abs_diff_max"):
      out[k] = max(float(s[k]) for s in (prep_stats or [s for u in update_stats for s in u]))
    out["grad_norm"] = float(np.mean(grad_norms))
    out["train_tokens_padded"] = int(sum(dev[0].shape[0] * dev[0].shape[1]
                                         for chunk_list in plan for dev, _ in chunk_list))
    if not all(np.isfinite(grad_norms)) or not np.isfinite(out["loss"]):
      if before is not None:
        self.trainable, self.opt_state = before
      raise FloatingPointError(
          "non-finite loss or gradient in the train step; the update was not applied, so the "
          f"parameters and optimizer state are those before this batch. Step statistics: {out}")
    return out


# Loss terms come out of a chunk already weighted by its share of the minibatch (`_loss_fn`).
_LOSS_TERMS = ("pg_loss", "kl_ref", "loss")


def _update_stats(updates: list[list[dict]]) -> dict[str, float]:
  """Per update (minibatch) its loss terms: the sums of its chunks' shares, so the logged loss is
  the one whose gradient was applied; averaged over the updates. The per-token statistics:
  weighted by the chunks' response tokens."""
  out = _token_weighted([s for chunks in updates for s in chunks])
  for k in _LOSS_TERMS:
    if k in updates[0][0]:
      out[k] = float(np.mean([sum(float(s[k]) for s in chunks) for chunks in updates]))
  return out


def _token_weighted(stats: list[dict]) -> dict[str, float]:
  tokens = [float(s["response_tokens"]) for s in stats]
  total = max(sum(tokens), 1.0)
  return {k: float(sum(float(s[k]) * n for s, n in zip(stats, tokens)) / total)
          for k in stats[0] if k not in _LOSS_TERMS and k != "response_tokens"}
