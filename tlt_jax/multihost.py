"""One RL step across processes: every process decodes its own share of the prompts on its own
devices, then the rollouts are all-gathered so every process holds the whole batch.

The rollout data of a step is small (token ids, sampler log-probs, rewards), so gathering it is
cheap, and it keeps the update exact: the loss is normalised over the global batch, as in a
single-process run, which averaging per-process gradients would not do when the processes'
token counts differ. The trainer's mesh spans every process's devices (`job.train_mesh`):
each process feeds the same host batch and each device computes only its own rows, and the
updated weights are gathered back to every process for its engine (`Trainer.local_policy`).
"""

from __future__ import annotations

import hashlib
import json

import jax
import numpy as np
from jax.experimental import multihost_utils

FINISH_REASONS = ("eos", "stop", "length")


def gather_rollouts(prompts: list[list[int]], tokens: list[np.ndarray],
                    logprobs: list[np.ndarray], rewards_N: np.ndarray, correct_N: np.ndarray,
                    finish: list[str], *, max_prompt_len: int, max_new_tokens: int) -> dict:
  """The step's rollouts of all processes, in process order: {"prompts", "tokens", "logprobs"
  (lists), "rewards", "correct" (arrays), "finish" (list)}. Every process must pass the same
  number of samples."""

  N = len(tokens)
  prompt_NxP = np.zeros((N, max_prompt_len), np.int32)
  tokens_NxT = np.zeros((N, max_new_tokens), np.int32)
  logp_NxT = np.zeros((N, max_new_tokens), np.float32)
  for i in range(N):
    prompt_NxP[i, :len(prompts[i])] = prompts[i]
    tokens_NxT[i, :len(tokens[i])] = tokens[i]
    logp_NxT[i, :len(logprobs[i])] = logprobs[i]
  local = {"prompt": prompt_NxP, "prompt_len": np.array([len(p) for p in prompts], np.int32),
           "tokens": tokens_NxT, "len": np.array([len(t) for t in tokens], np.int32),
           "logp": logp_NxT, "rewards": np.asarray(rewards_N, np.float32),
           "correct": np.asarray(correct_N, np.float32),
           "finish": np.array([FINISH_REASONS.index(f) for f in finish], np.int32)}
  g = {k: np.asarray(v) for k, v in multihost_utils.process_allgather(local, tiled=True).items()}
  return {"prompts": [g["prompt"][i, :n].tolist() for i, n in enumerate(g["prompt_len"])],
          "tokens": [g["tokens"][i, :n] for i, n in enumerate(g["len"])],
          "logprobs": [g["logp"][i, :n] for i, n in enumerate(g["len"])],
          "rewards": g["rewards"], "correct": g["correct"],
          "finish": [FINISH_REASONS[f] for f in g["finish"]]}


def gather_json(value) -> list:
  """[value of process 0, value of process 1, ...] for a small JSON-able value (iterator and
  tuner states: each process has its own, the checkpoint keeps all of them)."""

  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  lengths = np.asarray(multihost_utils.process_allgather(np.array([len(data)], np.int32)))
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:len(data)] = data
  everyone = np.asarray(multihost_utils.process_allgather(padded))
  return [json.loads(bytes(row[:n]).decode()) for row, n in zip(everyone, lengths.reshape(-1))]


def sync_drafter(params, opt_state, steps: int):
  """Every process's drafter after its spot steps of this rollout -> one drafter for all.

  Each process trains its drafter on its own rollouts, in its own idle time, so the processes
  take different numbers of steps on different data. At the barrier their parameters and AdamW
  moments are averaged, each process weighted by the steps it took this rollout (a process
  that had no idle time adds nothing), and the step count is the largest (Adam's bias
  correction). The average is computed on the host in float64, in process order, from the same
  gathered values, so every process ends with bitwise the same state: all serve the same
  drafter version and the checkpoint's (process 0's) drafter is everyone's.

  Returns (params, opt_state, total steps of all processes); unchanged when nobody stepped."""

  steps_P = np.asarray(multihost_utils.process_allgather(np.array([steps], np.int64))).reshape(-1)
  total = int(steps_P.sum())
  if total == 0:
    return params, opt_state, 0
  weight_P = steps_P / total
  leaves, treedef = jax.tree.flatten((params, opt_state))
  host = [np.asarray(jax.device_get(x)) for x in leaves]
  gathered = multihost_utils.process_allgather(host)  # each leaf with a leading process axis

  def average(stacked, old):
    stacked = np.asarray(stacked)
    if np.issubdtype(stacked.dtype, np.floating):
      mean = np.tensordot(weight_P, stacked.astype(np.float64), axes=1).astype(stacked.dtype)
    else:
      mean = stacked.max(axis=0)
    return jax.device_put(mean, old.sharding)

  synced = [average(g, old) for g, old in zip(gathered, leaves)]
  params, opt_state = jax.tree.unflatten(treedef, synced)
  return params, opt_state, total


def fingerprint(tree) -> str:
  """sha256 of every leaf's bytes, in tree order: equal iff the processes' weights are bitwise
  equal."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    digest.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
  return digest.hexdigest()
