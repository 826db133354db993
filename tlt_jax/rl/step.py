"""One RL step, as data:

    prompt rows --rollout--> Rollout (samples, their log-probs, rewards scored as they finish)
                --scores---> Scored (shaped rewards, advantages, the trainer's Batch)
                --update---> train stats; new weights to the engine (and a new drafter, TLT)

`run(job, step)` does the three in order and returns the step's metrics record; each stage is
a function of the job and the previous stage's value, so a notebook can run them one at a time.
In a multi-process run each process decodes its share of the prompts and `rollout` gathers the
whole batch, so every later stage sees the same data on every process.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from tlt_jax import multihost
from tlt_jax.job import PURPOSE_ROLLOUT, Job, derived_seed
from tlt_jax.rl import algorithms
from tlt_jax.rl.scoring import reward_metrics
from tlt_jax.rl.trainer import Batch, make_batch


@dataclasses.dataclass
class Rollout:
  """A step's samples, the whole batch: every process's, in process order, group-major."""
  prompts: list[np.ndarray]
  tokens: list[np.ndarray]
  logprobs: list[np.ndarray]
  rewards_N: np.ndarray           # the scorer's rewards (correctness + format), f32
  correct_N: np.ndarray           # f32 0/1
  finish: list[str]               # "eos" | "stop" | "length"
  local_tokens: int               # tokens this process generated
  report: object                  # rollout.RolloutReport of this process's rollout
  reward_record: dict             # reward means per kind, grader paths (the whole batch)
  drafter_record: dict            # TLT: drafter version, buffer and spot-training figures
  rollout_s: float
  reward_wait_s: float


@dataclasses.dataclass
class Scored:
  """The rollout as the trainer sees it."""
  batch: Batch
  rewards_N: np.ndarray           # after shaping (the overlong penalty), f32
  mixed_N: np.ndarray             # the sample's group has both right and wrong answers
  lengths_N: np.ndarray           # response tokens, int32


def rollout(job: Job, step: int, rows: list[dict], *, on_sample=None) -> Rollout:
  """Decodes `group_size` samples for each row, scoring each as it finishes (in the scorer's
  workers, overlapped with decoding); with TLT the drafter trains on idle devices meanwhile
  and is published for the next step."""
  c, engine, spot, G = job.config, job.engine, job.spot, job.group_size
  formatter, tokenizer = job.policy.formatter, job.policy.tokenizer
  prompts = [formatter.encode(row["prompt"]) for row in rows]

  def score_when_done(sample):
    text = tokenizer.decode(sample.tokens.tolist(), skip_special_tokens=True)
    job.scorer.submit(sample.sample_id, text, rows[sample.sample_id // G])  # math or code row
    if on_sample is not None:
      on_sample(sample)

  if spot is not None:
    spot.refresh_data(job.trainer.local_policy())  # the window so far, current policy features
  t0 = time.perf_counter()
  seed = derived_seed(c.seed, PURPOSE_ROLLOUT, step,
                      *([jax.process_index()] if job.multi_process else []))
  samples = engine.generate(prompts, group_size=G, seed=seed, on_finish=score_when_done,
                            spot=spot, min_live_share=c.tlt.min_live_share, **job.forced_arm)
  rollout_s = time.perf_counter() - t0
  scores, reward_wait_s = job.scorer.results()
  # Per kind (math / code) and which grader decided, over the whole batch like reward_mean.
  kinds = [{k: scores[i].get(k) for k in ("kind", "reward", "correct", "path")}
           for i in range(len(rows) * G)]
  if job.multi_process:
    kinds = [s for process in multihost.gather_json(kinds) for s in process]
  reward_record = reward_metrics(dict(enumerate(kinds)))
  drafter_record = _drafter_side(job, step, samples, engine.last_report)

  N = len(rows) * G
  rewards = np.array([scores[i]["reward"] for i in range(N)], np.float32)
  correct = np.array([scores[i]["correct"] for i in range(N)], np.float32)
  prompts_out = [s.prompt for s in samples]
  tokens, logps = [s.tokens for s in samples], [s.logprobs for s in samples]
  finish = [s.finish_reason for s in samples]
  if job.multi_process:  # the whole batch, every process's samples in process order
    r = c.rollout
    g = multihost.gather_rollouts(prompts_out, tokens, logps, rewards, correct, finish,
                                  max_prompt_len=r.max_prompt_len,
                                  max_new_tokens=r.max_new_tokens)
    prompts_out, tokens, logps = g["prompts"], g["tokens"], g["logprobs"]
    rewards, correct, finish = g["rewards"], g["correct"], g["finish"]
  return Rollout(prompts=prompts_out, tokens=tokens, logprobs=logps, rewards_N=rewards,
                 correct_N=correct, finish=finish,
                 local_tokens=sum(len(s.tokens) for s in samples), report=engine.last_report,
                 reward_record=reward_record, drafter_record=drafter_record, rollout_s=rollout_s,
                 reward_wait_s=reward_wait_s)


def _drafter_side(job: Job, step: int, samples, report) -> dict:
  """TLT after a rollout: its samples join the drafter's window, and what spot training did
  on idle devices is published (one drafter for all processes: their step-weighted average)."""
  buffer, spot, engine = job.buffer, job.spot, job.engine
  if buffer is None:
    return {}
  buffer.add(step, samples)
  # drafter_version: the weights this rollout drafted with (drafter_published: after it).
  record = {"drafter_version": engine.drafter_version, "buffer_tokens": buffer.num_tokens}
  if spot is not None:
    published_steps = report.drafter_steps
    if job.multi_process:
      spot.params, spot.opt_state, published_steps = multihost.sync_drafter(
          spot.params, spot.opt_state, report.drafter_steps)
    if published_steps:
      engine.update_drafter(*spot.publish())  # served from the next rollout on
    record.update(drafter_published=spot.version, drafter_steps=report.drafter_steps,
                  idle_device_s=report.idle_device_s, drafter_steps_total=spot.steps_done,
                  **{f"drafter_{k}": v for k, v in report.drafter_metrics.items()})
  return record


def score(job: Job, ro: Rollout) -> Scored:
  """Shaped rewards -> per-sample advantages (the algorithm's estimator over each group) -> the
  trainer's padded batch. DAPO keeps only groups with both right and wrong answers."""
  c, G = job.config, job.group_size
  rl = c.rl
  lengths = np.array([len(t) for t in ro.tokens], np.int32)
  rewards = ro.rewards_N
  if rl.overlong_buffer:
    rewards = rewards + np.asarray(algorithms.overlong_penalty(lengths, c.rollout.max_new_tokens,
                                                               rl.overlong_buffer))
  advantages = np.asarray(algorithms.ADVANTAGES[rl.algorithm](rewards, G))
  mixed = np.asarray(algorithms.mixed_groups(rewards, G))
  keep = algorithms.dynamic_sampling_weights(rl.algorithm, ro.correct_N, G)  # on accuracy (DAPO)
  batch = make_batch(ro.prompts, ro.tokens, ro.logprobs, advantages, job.train_len,
                     weights_N=keep)
  return Scored(batch=batch, rewards_N=rewards, mixed_N=mixed, lengths_N=lengths)


def update(job: Job, scored: Scored) -> tuple[dict, float]:
  """The trainer's update on the scored batch, then its weights to the rollout engines.
  Raises FloatingPointError (nothing applied) when the update is not finite."""
  t0 = time.perf_counter()
  stats = job.trainer.step(scored.batch)
  job.engine.update_policy(job.trainer.local_policy())
  return stats, time.perf_counter() - t0


def record(ro: Rollout, scored: Scored, stats: dict, train_s: float) -> dict:
  """The step's metrics (one metrics.jsonl line)."""
  rewards, lengths, report = scored.rewards_N, scored.lengths_N, ro.report
  return {
      "reward_mean": float(rewards.mean()), "correct_mean": float(ro.correct_N.mean()),
      "reward_std": float(rewards.std()), "mixed_group_fraction": float(scored.mixed_N.mean()),
      "response_len_mean": float(lengths.mean()), "response_len_max": int(lengths.max()),
      "truncated_fraction": float(np.mean([f == "length" for f in ro.finish])),
      "rollout_s": ro.rollout_s, "reward_wait_s": ro.reward_wait_s, "train_s": train_s,
      "rollout_tokens_per_s": float(ro.local_tokens / ro.rollout_s),
      "accept_len": report.accept_len, "sd_chunk_fraction": report.sd_chunk_fraction,
      **ro.reward_record, **ro.drafter_record, **stats}


def run(job: Job, step: int, rows: list[dict], *, on_sample=None) -> tuple[dict, Rollout]:
  """One whole RL step on `rows` (this process's prompts); returns (metrics record, rollout)."""
  ro = rollout(job, step, rows, on_sample=on_sample)
  scored = score(job, ro)
  stats, train_s = update(job, scored)
  return record(ro, scored, stats, train_s), ro
