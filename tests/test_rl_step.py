"""One RL step (tlt_jax/rl/step.py) on a real tiny job: DAPO's dynamic sampling over-samples.

The rollouts and the update are the job's own; only the scorer is scripted, so that which groups
have mixed accuracy in each rollout is known up front (a sampled model decides it otherwise).
"""

import os

import jax
import numpy as np
import pytest

from tlt_jax import config as config_lib
from tlt_jax import job as job_lib
from tlt_jax.rl import step as rl_step

P, G = 4, 4  # prompts per step, samples per prompt
# Per rollout of the step, each group's answers: all right, all wrong, or half and half.
SCRIPT = [["right", "wrong", "right", "wrong"],   # no mixed group: the step must roll out more
          ["mixed", "right", "mixed", "wrong"],   # groups 4 and 6
          ["wrong", "mixed", "mixed", "right"],   # groups 9 and 10: 4 in hand, stop here
          ["mixed", "mixed", "mixed", "mixed"]]   # never reached


class ScriptedScorer:
  """The RewardScorer's interface; the k-th `results()` call scores by SCRIPT[k]."""

  def __init__(self):
    self.calls, self._ids = 0, []

  def submit(self, sample_id, completion, reference):
    self._ids.append(sample_id)

  def results(self):
    plan = SCRIPT[self.calls]
    self.calls += 1
    out = {}
    for sid in self._ids:
      kind = plan[sid // G]
      correct = float(kind == "right" or (kind == "mixed" and sid % 2 == 0))
      out[sid] = {"reward": correct, "correct": correct, "format": 0.0, "kind": "math",
                  "path": "exact"}
    self._ids = []
    return out, 0.0

  def close(self):
    pass


@pytest.fixture(scope="module")
def dapo_job(tmp_path_factory):
  c = config_lib.load_config_file(
      os.path.join(job_lib.REPO_ROOT, "experiments", "configs", "tiny_arith.py"), "smoke")
  c.workdir = str(tmp_path_factory.mktemp("dapo"))
  c.rl.algorithm = "dapo"
  c.rollout.prompts_per_step, c.rollout.group_size = P, G
  c.rollout.max_new_tokens, c.rollout.buckets = 16, (4, 16)
  c.data.synthetic_train, c.eval.num_problems = 64, 8
  c.checkpoint.async_save, c.metrics.tensorboard = False, False
  config_lib.validate(c)
  j = job_lib.build(c)
  real_scorer = j.scorer
  yield j
  j.scorer = real_scorer
  j.close()


def _step(j, max_rollouts, monkeypatch):
  """A step as train.py runs it; returns (record, rollout, the trained batch, the batches the
  data iterator gives from the step's position on, read again independently, and the batch it
  gives after the step)."""
  j.config.rl.dapo_max_rollouts = max_rollouts
  j.scorer = ScriptedScorer()
  start = j.data.get_state()
  trained, update = [], rl_step.update
  monkeypatch.setattr(rl_step, "update",
                      lambda job, scored: (trained.append(scored.batch), update(job, scored))[1])
  record, ro = rl_step.run(j, 0, next(j.data))
  after = next(j.data)
  j.data.set_state(start)
  batches = [next(j.data) for _ in range(5)]
  return record, ro, trained[0], batches, after


def _prompt_of(j, row):
  return np.asarray(j.policy.formatter.encode(row["prompt"]), np.int32)


def test_dapo_oversamples_until_the_batch_holds_mixed_groups(dapo_job, monkeypatch):
  j = dapo_job
  record, ro, batch, batches, after = _step(j, 4, monkeypatch)
  # Independently: the groups with 0 < correct < G, in rollout order, first P of them.
  hits = np.asarray(ro.correct_N).reshape(-1, G).sum(axis=1)
  mixed = np.flatnonzero((hits > 0) & (hits < G))
  assert len(hits) == 3 * P and mixed.tolist() == [4, 6, 9, 10]
  assert record["dapo_rollouts"] == 3 and record["dapo_mixed_groups"] == 4
  assert record["dapo_shortfall_groups"] == 0
  assert after == batches[3]  # the step read its batch and 2 more from the iterator
  # The trained batch: exactly P groups, each a mixed group with weight (its response tokens
  # in the loss), holding that group's prompt (from the batch and row it was drawn from) and
  # its samples' responses.
  assert batch.tokens_NxL.shape[0] == P * G
  assert batch.mask_NxT.any(axis=1).all()
  for slot, g in enumerate(mixed[:P]):
    prompt = _prompt_of(j, batches[g // P][g % P])
    for s in range(G):
      i, n = slot * G + s, g * G + s
      tokens = batch.tokens_NxL[i]
      np.testing.assert_array_equal(tokens[:len(prompt)], prompt)
      np.testing.assert_array_equal(tokens[len(prompt):len(prompt) + len(ro.tokens[n])],
                                    ro.tokens[n])
    adv = batch.advantages_N[slot * G:(slot + 1) * G]
    assert np.all(np.sign(adv) == np.where(ro.correct_N[g * G:(g + 1) * G] > 0, 1, -1))
  # The record is over all 48 samples rolled out; its tokens per second over all rollouts.
  assert record["correct_mean"] == pytest.approx(float(np.mean(ro.correct_N)))
  assert len(ro.tokens) == 3 * P * G
  assert record["rollout_tokens_per_s"] * record["rollout_s"] == pytest.approx(
      sum(len(t) for t in ro.tokens))


def test_dapo_short_after_its_last_rollout_trains_the_mixed_groups_only(dapo_job, monkeypatch):
  j = dapo_job
  record, ro, batch, batches, after = _step(j, 2, monkeypatch)
  assert record["dapo_rollouts"] == 2 and record["dapo_mixed_groups"] == 2
  assert record["dapo_shortfall_groups"] == 2
  assert after == batches[2]
  # Groups 0 and 1 fill the batch with weight 0 (no token in the loss), then mixed 4 and 6.
  np.testing.assert_array_equal(ro.train_groups, [0, 1, 4, 6])
  in_loss = batch.mask_NxT.any(axis=1).reshape(P, G)
  assert not in_loss[:2].any() and in_loss[2:].all()


class NanOnSecondStep(ScriptedScorer):
  """Scores the first rollout half right (every group mixed), every later one NaN."""

  def results(self):
    out, wait = super().results()
    for r in out.values():
      if self.calls > 1:
        r["reward"] = float("nan")
    return out, wait


def test_a_nan_update_saves_the_state_before_it_over_the_step_s_own_checkpoint(tmp_path):
  """Step 2's update is not finite: the run saves the state before it as checkpoint 1 (which
  step 1's regular save already wrote: replaced, not StepAlreadyExistsError), stops with a
  message naming it, and a new job on the workdir resumes there with the data iterator past
  the failed batch."""
  from tlt_jax import run_state
  from tlt_jax import train as train_lib

  global SCRIPT
  c = config_lib.load_config_file(
      os.path.join(job_lib.REPO_ROOT, "experiments", "configs", "tiny_arith.py"), "smoke")
  c.workdir = str(tmp_path / "nan")
  c.rollout.prompts_per_step, c.rollout.group_size = P, G
  c.rollout.max_new_tokens, c.rollout.buckets = 16, (4, 16)
  c.data.synthetic_train, c.eval.num_problems, c.rl.steps = 64, 8, 2
  c.checkpoint.every, c.eval.every = 1, 0
  c.metrics.tensorboard, c.metrics.plots, c.metrics.progress = False, False, False
  config_lib.validate(c)
  j = job_lib.build(c)
  real_scorer, j.scorer = j.scorer, NanOnSecondStep()
  script, SCRIPT = SCRIPT, [["mixed"] * P] * 2
  try:
    with pytest.raises(FloatingPointError, match=r"^RL step 2: .*update was not applied.*The "
                                                 r"state before this step is saved in .*"
                                                 r"checkpoints/1;"):
      train_lib.train(j)
    params, data_state = j.trainer.trainable, j.data.get_state()
  finally:
    SCRIPT = script
    j.scorer = real_scorer
    j.close()
  resumed = job_lib.build(c)
  try:
    progress = run_state.restore(resumed)
    assert progress.step == 1 and resumed.checkpointer.all_steps() == [1]
    assert resumed.data.get_state() == data_state  # the failed batch is not drawn again
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(resumed.trainer.trainable)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  finally:
    resumed.close()
