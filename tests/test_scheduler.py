"""Long-tail scheduler on 8 devices (the host's on a single-accelerator machine): grouped rollouts
are bitwise one engine's; drafter steps run only on devices whose group has finished; stopping at
the barrier loses nothing; the engines serve the newest published drafter."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from tests.conftest import on_devices
from tlt_jax import ops
from tlt_jax.model.drafter import Drafter
from tlt_jax.model.transformer import ModelConfig, Transformer
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.groups import GroupedRollout
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.tuner import OFF, Arm
from tlt_jax.tlt.buffer import DrafterBuffer
from tlt_jax.tlt.spot import SpotConfig, SpotTrainer

EOS = 3
CFG = EngineConfig(buckets=(2, 4), max_prompt_len=4, max_new_tokens=12, chunk_steps=2,
                   sampling=SamplingParams(temperature=1.0), eos_ids=(EOS,),
                   arms=(Arm(OFF), Arm("chain3", 3)))
PROMPTS = [[1, 5, 7], [2], [4, 4, 9], [6, 8], [7, 1], [9, 2, 2], [5], [8, 8]]
SPOT = SpotConfig(rows=2, row_len=32, lr=1e-2)


@pytest.fixture(scope="module", autouse=True)
def devices():
  """Every test of the module on these 8 devices' platform; the cached models and engines are
  built there too."""
  with on_devices(8) as devices:
    yield tuple(devices)


@functools.lru_cache(maxsize=None)
def _models():
  cfg = ModelConfig(arch="qwen3", vocab_size=16, hidden_size=32, intermediate_size=64,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True,
                    tie_embeddings=True)
  target = Transformer(cfg, nnx.Rngs(0))
  emb = target.embed_tokens.embedding
  emb.set_value(emb.get_value() * 40.0)
  return target, Drafter(cfg, nnx.Rngs(1))


@functools.lru_cache(maxsize=None)
def _grouped(devices: tuple):
  target, drafter = _models()
  with ops.numerics_mode("batch_invariant"):
    grouped = GroupedRollout(target, CFG, [devices[:1], devices[1:2]], drafter)
    grouped.warm_up()
  return grouped


def _budgets(short: int, long: int):
  """Group 0 (the first half of the batch) gets short budgets, group 1 long ones."""
  half = len(PROMPTS)  # group_size 2: samples 0..7 are group 0's
  return [short] * half + [long] * half


@functools.lru_cache(maxsize=None)
def _buffer(devices: tuple):
  """Rollouts of the target itself: the drafter's training data."""
  target, _ = _models()
  with ops.numerics_mode("batch_invariant"):
    samples = _grouped(devices).generate(PROMPTS, group_size=2, seed=5, arm=OFF)
  buffer = DrafterBuffer(window_steps=2)
  buffer.add(0, samples)
  return buffer


def test_grouped_rollout_is_bitwise_one_engine(devices):
  target, drafter = _models()
  with ops.numerics_mode("batch_invariant"):
    single = RolloutEngine(target, CFG, drafter).generate(PROMPTS, group_size=2, seed=7, arm=OFF)
    grouped = _grouped(devices).generate(PROMPTS, group_size=2, seed=7)  # the tuner picks SD
    report = _grouped(devices).last_report
  assert [s.sample_id for s in grouped] == list(range(16))
  for a, b in zip(single, grouped):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
  # Each group's arrays live on its own device.
  placed = {s.sample_id: next(iter(s.hidden.sharding.device_set)) for s in grouped}
  assert {placed[i] for i in range(8)} == {devices[0]}
  assert {placed[i] for i in range(8, 16)} == {devices[1]}
  assert any(t.arm == "chain3" for e in _grouped(devices).engines for t in e.trace)
  assert report.seconds > 0 and len(report.group_finish_s) == 2


def test_drafter_trains_only_on_devices_of_finished_groups(devices):
  target, drafter = _models()
  spot = SpotTrainer(drafter, target, _buffer(devices), SPOT)
  assert spot.refresh_data() > 0
  with ops.numerics_mode("batch_invariant"):
    _grouped(devices).generate(PROMPTS, group_size=2, seed=3, arm=OFF, spot=spot,
                               max_new_per_sample=_budgets(1, 12))
    report = _grouped(devices).last_report
  assert report.drafter_steps > 0 and report.group_finish_s[0] < report.group_finish_s[1]
  group0, group1 = frozenset(devices[:1]), frozenset(devices[1:2])
  for busy, live in zip(report.drafter_busy_devices, report.live_devices_at_step):
    assert busy == group0 and live == group1 and not busy & live
  assert report.idle_device_s > 0 and np.isfinite(report.drafter_metrics["loss"])
  assert not spot.in_flight()  # the barrier waited for the one step that could be in flight


def test_stopping_at_the_barrier_loses_no_state(devices):
  target, drafter = _models()
  with ops.numerics_mode("batch_invariant"):
    interrupted = SpotTrainer(drafter, target, _buffer(devices), SPOT)
    interrupted.refresh_data()
    interrupted.lend(devices[2:3])
    for _ in range(3):
      interrupted.step()
    interrupted.wait()          # the barrier
    interrupted.publish()
    interrupted.lend(devices[5:6])  # the next rollout's first idle group
    for _ in range(2):
      interrupted.step()
    straight = SpotTrainer(drafter, target, _buffer(devices), SPOT)
    straight.refresh_data()
    straight.lend(devices[7:8])
    for _ in range(5):
      straight.step()
  for a, b in zip(jax.tree.leaves((interrupted.params, interrupted.opt_state)),
                  jax.tree.leaves((straight.params, straight.opt_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert interrupted.steps_done == 5 and interrupted.version == 1


def test_engines_serve_the_newest_published_drafter(devices):
  target, drafter = _models()
  grouped = _grouped(devices)
  with ops.numerics_mode("batch_invariant"):
    grouped.update_drafter(drafter, 0)
    grouped.generate(PROMPTS, group_size=2, seed=11, arm="chain3")
    before = grouped.last_report
    spot = SpotTrainer(drafter, target, _buffer(devices), SpotConfig(rows=2, row_len=32, lr=3e-2))
    spot.refresh_data()
    spot.lend(devices[3:4])
    for _ in range(30):
      spot.step()
    new, version = spot.publish()
    grouped.update_drafter(new, version)
    grouped.generate(PROMPTS, group_size=2, seed=11, arm="chain3")
    after = grouped.last_report
  assert grouped.drafter_version == 1
  for engine, group in zip(grouped.engines, grouped.device_groups):
    served = engine.pool.draft_params
    for a, b in zip(jax.tree.leaves(served), jax.tree.leaves(nnx.split(new)[1])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
      assert a.sharding.device_set == set(group)
  # The trained drafter drafts what the target samples far more often than the random one.
  assert after.accept_len > before.accept_len + 0.3, (before.accept_len, after.accept_len)


def test_bad_groups_are_refused(devices):
  target, _ = _models()
  with pytest.raises(ValueError, match="disjoint"):
    GroupedRollout(target, CFG, [devices[:2], devices[1:3]])
