"""One RL step, as data:

    prompt rows --rollout--> Rollout (samples, their log-probs, rewards scored as they finish)
                --scores---> Scored (shaped rewards, advantages, the trainer's Batch)
                --update---> train stats; new weights to the engine (and a new drafter, TLT)

`run(job, step)` does the three in order and returns the step's metrics record; each stage is
a function of the job and the previous stage's value, so a notebook can run them one at a time.
In a multi-process run each process decodes its share of the prompts and `rollout` gathers the
whole batch, so every later stage sees the same data on every process.

DAPO (dynamic sampling, paper section 3.2; verl's `max_num_gen_batches`): groups whose answers
are all right or all wrong teach nothing, so after the rollout `dapo_rollouts` draws the next
batch of prompts from the job's data iterator and rolls it out too, until the step holds
`rollout.prompts_per_step` mixed groups or `rl.dapo_max_rollouts` rollouts; the trainer gets the
first `prompts_per_step` mixed groups (a batch of the usual shape). The decision is taken from
the gathered accuracies, so every process draws the same number of batches, and the extra
batches are read before the step's checkpoint, which saves the iterator's position after them.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import numpy as np

from tlt_jax import multihost
from tlt_jax.job import PURPOSE_DAPO_ROUND, PURPOSE_ROLLOUT, Job, derived_seed
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
  kinds: list = dataclasses.field(default_factory=list)  # per sample: kind, reward, correct, path
  # DAPO: the groups the trainer gets (None = all) and the over-sampling figures for the record
  train_groups: np.ndarray | None = None
  dapo_record: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Scored:
  """The rollout as the trainer sees it."""
  batch: Batch
  # Over every sample the step rolled out (all of DAPO's rollouts, not only the trained groups):
  rewards_N: np.ndarray           # after shaping (the overlong penalty), f32
  mixed_N: np.ndarray             # the sample's group has unequal shaped rewards
  lengths_N: np.ndarray           # response tokens, int32


def rollout(job: Job, step: int, rows: list[dict], *, on_sample=None,
            round_index: int = 0) -> Rollout:
  """Decodes `group_size` samples for each row, scoring each as it finishes (in the scorer's
  workers, overlapped with decoding); with TLT the drafter trains on idle devices meanwhile
  and is published for the next step. `round_index` > 0: DAPO's extra rollouts within the step
  (their own seeds; round 0 is the step's seed as without DAPO)."""
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
  process = [jax.process_index()] if job.multi_process else []
  seed = (derived_seed(c.seed, PURPOSE_DAPO_ROUND, step, round_index, *process) if round_index
          else derived_seed(c.seed, PURPOSE_ROLLOUT, step, *process))
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
                 reward_wait_s=reward_wait_s, kinds=kinds)


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


def dapo_rollouts(job: Job, step: int, first: Rollout, *, on_sample=None) -> Rollout:
  """DAPO's over-sampling: while the rollouts so far hold fewer than `prompts_per_step` groups
  with mixed accuracy, the next batch of this process's prompts from `job.data` is rolled out,
  up to `rl.dapo_max_rollouts` rollouts in all. Returns them as one Rollout (all their samples,
  in order) whose `train_groups` are the groups to train on (`algorithms.dapo_train_groups`)."""
  c, G = job.config, job.group_size
  P = c.rollout.prompts_per_step
  rounds = [first]
  # On the gathered accuracies: every process takes the same decision, draws as many batches.
  mixed = algorithms.dapo_train_groups(first.correct_N, G, P)[1]
  while mixed < P and len(rounds) < c.rl.dapo_max_rollouts:
    rows = next(job.data)
    rounds.append(rollout(job, step, rows, on_sample=on_sample, round_index=len(rounds)))
    mixed += algorithms.dapo_train_groups(rounds[-1].correct_N, G, P)[1]
  ro = _joined(rounds) if len(rounds) > 1 else first
  ro.train_groups, mixed = algorithms.dapo_train_groups(ro.correct_N, G, P)
  shortfall = max(P - mixed, 0)
  ro.dapo_record = {"dapo_rollouts": len(rounds), "dapo_mixed_groups": mixed,
                    "dapo_shortfall_groups": shortfall}
  if shortfall and c.rl.dapo_max_rollouts > 1 and job.primary:
    print(f"[dapo] step {step + 1}: {mixed} of {P} groups with mixed accuracy after "
          f"{len(rounds)} rollouts (rl.dapo_max_rollouts={c.rl.dapo_max_rollouts}); the other "
          f"{shortfall} train with weight 0", file=sys.stderr)
  return ro


def _summed_by_arm(reports) -> dict[str, dict]:
  out: dict[str, dict] = {}
  for r in reports:
    for arm, totals in r.by_arm.items():
      into = out.setdefault(arm, dict.fromkeys(totals, 0))
      for key, value in totals.items():
        into[key] += value
  return out


def arm_metrics(by_arm: dict[str, dict]) -> dict[str, float]:
  """Per arm the tuner ran this step: the fraction of decode chunks, their seconds and tokens
  per live row per round (`arm_chunk_fraction/<arm>`, `arm_seconds/<arm>`,
  `arm_accept_len/<arm>`); arms it did not run have no keys that step."""
  chunks = sum(a["chunks"] for a in by_arm.values())
  out = {}
  for arm, a in sorted(by_arm.items()):
    out[f"arm_chunk_fraction/{arm}"] = a["chunks"] / max(chunks, 1)
    out[f"arm_seconds/{arm}"] = float(a["seconds"])
    out[f"arm_accept_len/{arm}"] = a["emitted"] / max(a["row_rounds"], 1)
  return out


def _joined(rounds: list[Rollout]) -> Rollout:
  """Several rollouts of one step as one: samples, rewards and seconds of all of them; the
  report's per-rollout figures summed (accept_len and sd_chunk_fraction weighted by this
  process's tokens), its timelines (chunk trace, group finish times) the first rollout's; the
  drafter figures the last rollout's, with its steps and idle device-seconds summed."""
  reports = [r.report for r in rounds]
  weights = np.array([r.local_tokens for r in rounds], np.float64)
  weights = weights / weights.sum() if weights.sum() else np.full(len(rounds), 1 / len(rounds))
  report = dataclasses.replace(
      reports[0], seconds=sum(r.seconds for r in reports),
      idle_device_s=sum(r.idle_device_s for r in reports),
      drafter_steps=sum(r.drafter_steps for r in reports),
      drafter_metrics=reports[-1].drafter_metrics,
      accept_len=float(np.dot(weights, [r.accept_len for r in reports])),
      sd_chunk_fraction=float(np.dot(weights, [r.sd_chunk_fraction for r in reports])),
      by_arm=_summed_by_arm(reports))
  drafter_record = dict(rounds[-1].drafter_record)
  for key in ("drafter_steps", "idle_device_s"):
    if key in drafter_record:
      drafter_record[key] = sum(r.drafter_record[key] for r in rounds)
  kinds = [k for r in rounds for k in r.kinds]
  return Rollout(
      prompts=[p for r in rounds for p in r.prompts], tokens=[t for r in rounds for t in r.tokens],
      logprobs=[lp for r in rounds for lp in r.logprobs],
      rewards_N=np.concatenate([r.rewards_N for r in rounds]),
      correct_N=np.concatenate([r.correct_N for r in rounds]),
      finish=[f for r in rounds for f in r.finish],
      local_tokens=sum(r.local_tokens for r in rounds), report=report,
      reward_record=reward_metrics(dict(enumerate(kinds))), drafter_record=drafter_record,
      rollout_s=sum(r.rollout_s for r in rounds),
      reward_wait_s=sum(r.reward_wait_s for r in rounds), kinds=kinds)


def score(job: Job, ro: Rollout) -> Scored:
  """Shaped rewards -> per-sample advantages (the algorithm's estimator over each group) -> the
  trainer's padded batch of `ro.train_groups` (all groups when None). DAPO keeps only groups
  with both right and wrong answers (weight 0 for the others)."""
  c, G = job.config, job.group_size
  rl = c.rl
  lengths = np.array([len(t) for t in ro.tokens], np.int32)
  rewards = ro.rewards_N
  if rl.overlong_buffer:
    rewards = rewards + np.asarray(algorithms.overlong_penalty(lengths, c.rollout.max_new_tokens,
                                                               rl.overlong_buffer))
  mixed = np.asarray(algorithms.mixed_groups(rewards, G))
  rows = np.arange(len(rewards)) if ro.train_groups is None else (
      np.asarray(ro.train_groups)[:, None] * G + np.arange(G)).reshape(-1)
  advantages = np.asarray(algorithms.ADVANTAGES[rl.algorithm](rewards[rows], G))
  keep = algorithms.dynamic_sampling_weights(rl.algorithm, ro.correct_N[rows], G)  # accuracy
  batch = make_batch([ro.prompts[i] for i in rows], [ro.tokens[i] for i in rows],
                     [ro.logprobs[i] for i in rows], advantages, job.train_len, weights_N=keep)
  return Scored(batch=batch, rewards_N=rewards, mixed_N=mixed, lengths_N=lengths)


def update(job: Job, scored: Scored) -> tuple[dict, float]:
  """The trainer's update on the scored batch, then its weights to the rollout engines.
  Raises FloatingPointError (nothing applied) when the update is not finite."""
  t0 = time.perf_counter()
  stats = job.trainer.step(scored.batch)
  job.engine.update_policy(job.trainer.local_policy())
  return stats, time.perf_counter() - t0


def record(ro: Rollout, scored: Scored, stats: dict, train_s: float) -> dict:
  """The step's metrics (one metrics.jsonl line). The reward, correct, length and finish figures
  are over every sample the step rolled out (with DAPO, all its rollouts: the policy on the
  prompts it drew, not only the groups it trained on); rollout_s, reward_wait_s and the tokens
  per second are summed over those rollouts; the train figures are the trained batch's."""
  rewards, lengths, report = scored.rewards_N, scored.lengths_N, ro.report
  return {
      "reward_mean": float(rewards.mean()), "correct_mean": float(ro.correct_N.mean()),
      "reward_std": float(rewards.std()), "mixed_group_fraction": float(scored.mixed_N.mean()),
      "response_len_mean": float(lengths.mean()), "response_len_max": int(lengths.max()),
      "truncated_fraction": float(np.mean([f == "length" for f in ro.finish])),
      "rollout_s": ro.rollout_s, "reward_wait_s": ro.reward_wait_s, "train_s": train_s,
      "rollout_tokens_per_s": float(ro.local_tokens / ro.rollout_s),
      "accept_len": report.accept_len, "sd_chunk_fraction": report.sd_chunk_fraction,
      **arm_metrics(report.by_arm), **ro.reward_record, **ro.drafter_record, **ro.dapo_record,
      **stats}


def run(job: Job, step: int, rows: list[dict], *, on_sample=None) -> tuple[dict, Rollout]:
  """One whole RL step on `rows` (this process's prompts); returns (metrics record, rollout).
  DAPO may draw more rows from `job.data` (`dapo_rollouts`)."""
  ro = rollout(job, step, rows, on_sample=on_sample)
  if job.config.rl.algorithm == "dapo":
    ro = dapo_rollouts(job, step, ro, on_sample=on_sample)
  scored = score(job, ro)
  stats, train_s = update(job, scored)
  return record(ro, scored, stats, train_s), ro
