"""The RL train step: chunked (length-bucketed) gradients equal the whole batch's, against the
paper's loss written out here (not the project's loss code); the KL term and the logged loss do
not depend on the chunking; top-k / top-p runs update and match the sampler's distribution;
on-policy statistics; the LoRA-off reference; NaN safety; full FT."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tests.conftest import on_devices
from tlt_jax import ops
from tlt_jax.model import lora
from tlt_jax.model.transformer import ModelConfig, Transformer
from tlt_jax.rl.trainer import TrainConfig, Trainer, make_batch, policy_logprobs
from tlt_jax.rollout.sampling import SamplingParams, sample_and_logprob, sample_from_masked

CFG = ModelConfig(arch="qwen3", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True, tie_embeddings=True)
SAMPLING = SamplingParams(temperature=0.8)
L = 16


def _model(with_lora=True, cfg=CFG):
  model = Transformer(cfg, nnx.Rngs(0))
  if with_lora:
    lora.apply_lora(model, rank=4, alpha=8.0)
    rng = np.random.default_rng(1)
    for mod in lora.lora_modules(model).values():  # nonzero B: gradients reach A as well
      mod.lora_b.set_value(jnp.asarray(0.1 * rng.standard_normal(mod.lora_b[...].shape),
                                       jnp.float32))
  return model


def _batch(model, n=8):
  """Prompts of 3 tokens, responses of 1..12 tokens, with the policy's own log-probs."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 32, 3).tolist() for _ in range(n)]
  responses = [rng.integers(0, 32, int(k)) for k in rng.integers(1, 13, n)]
  full = make_batch(prompts, responses, [np.zeros(len(r), np.float32) for r in responses],
                    np.zeros(n, np.float32), L)
  # Jitted, as the sampler's programs are: JAX 0.11's XLA:CPU rounds some elementwise logs of
  # an op-by-op (eager) call differently from the same log fused into a program.
  logp, _ = jax.jit(lambda t: policy_logprobs(model, t, SAMPLING))(jnp.asarray(full.tokens_NxL))
  logp = np.asarray(logp)
  sampler = [logp[i, 2:2 + len(r)] for i, r in enumerate(responses)]
  adv = rng.standard_normal(n).astype(np.float32)
  return make_batch(prompts, responses, sampler, adv, L), prompts, responses, adv


def _paper_loss(logp, logp_old, logp_ref, adv, mask, loss_name, kl_coef=0.0, xp=jnp):
  """The clipped surrogate (PPO; GRPO, DeepSeekMath eq. 3: eps 0.2 and the mean over sequences
  of token means; DAPO eq. 8: clip-higher 0.28 and one token mean over the batch) plus
  kl_coef x the k3 estimator (Schulman) aggregated the same way, on response tokens only."""
  m = mask.astype(np.float32)
  eps_high = {"grpo": 0.2, "ppo": 0.28}[loss_name]
  ratio = xp.exp(xp.where(mask, logp - logp_old, 0.0))
  a = adv[:, None]
  per_token = -xp.minimum(ratio * a, xp.clip(ratio, 0.8, 1.0 + eps_high) * a)
  if kl_coef:
    d = xp.where(mask, logp_ref - logp, 0.0)
    per_token = per_token + kl_coef * (xp.exp(d) - d - 1.0)
  if loss_name == "ppo":
    return xp.sum(per_token * m) / m.sum()
  return xp.mean(xp.sum(per_token * m, axis=1) / xp.maximum(m.sum(axis=1), 1.0))


def _reference_grad(model, batch, loss_name, kl_coef=0.0):
  """The loss over the whole padded batch, written directly (no chunks, no trainer, no
  project loss code); returns (gradient, loss)."""
  graphdef, params, rest = nnx.split(model, nnx.LoRAParam, ...)
  tokens = jnp.asarray(batch.tokens_NxL)
  mask = jnp.asarray(batch.mask_NxT)
  ref = None
  if kl_coef:  # the reference: LoRA off
    zero = jax.tree.map(jnp.zeros_like, params)
    ref = policy_logprobs(nnx.merge(graphdef, zero, rest), tokens, SAMPLING)[0]

  def loss(p):
    logp, _ = policy_logprobs(nnx.merge(graphdef, p, rest), tokens, SAMPLING)
    return _paper_loss(logp, jax.lax.stop_gradient(logp), ref,
                       jnp.asarray(batch.advantages_N), mask, loss_name, kl_coef)
  value, grad = jax.value_and_grad(loss)(params)
  return grad, float(value)


@pytest.mark.parametrize("loss_name", ["grpo", "ppo"])  # a per-sequence and a per-token mean
def test_chunked_gradients_equal_the_whole_batch(loss_name):
  model = _model()
  batch, *_ = _batch(model)
  expected, _ = _reference_grad(model, batch, loss_name)
  for rows, bucket in ((8, 32), (3, 8)):  # one chunk; chunks of two lengths with padding rows
    trainer = Trainer(model, TrainConfig(loss=loss_name, chunk_rows=rows, length_bucket=bucket,
                                         sampling=SAMPLING, tis_cap=0.0))
    plan = trainer.plan(batch)
    lengths = sorted({dev[0].shape[1] for dev, _ in plan[0]})
    assert (len(lengths) > 1) == (rows < 8)  # the small chunks really are padded differently
    grads, _ = trainer.gradients(plan[0])
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-5, atol=1e-7)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(expected)) > 1e-3


@pytest.mark.parametrize("loss_name", ["grpo", "ppo"])
def test_kl_term_and_logged_loss_do_not_depend_on_chunk_rows(loss_name):
  """rl.kl_coef > 0: the KL term follows the loss's own aggregation, so chunks of 8 rows (one
  chunk) and of 3 rows (three chunks, one padding row) have the whole batch's gradient; the
  logged pg_loss / kl_ref / loss are the whole batch's, unshrunk by the padding row (NumPy)."""
  model = _model()
  batch, *_ = _batch(model)
  expected, _ = _reference_grad(model, batch, loss_name, kl_coef=0.5)
  # The logged values, in NumPy from the two models' log-probs (policy and LoRA off).
  tokens = jnp.asarray(batch.tokens_NxL)
  logp = np.asarray(jax.jit(lambda t: policy_logprobs(model, t, SAMPLING))(tokens)[0], np.float64)
  base = _model(with_lora=False)
  ref = np.asarray(jax.jit(lambda t: policy_logprobs(base, t, SAMPLING))(tokens)[0], np.float64)
  adv, mask = batch.advantages_N.astype(np.float64), batch.mask_NxT
  pg = _paper_loss(logp, logp, ref, adv, mask, loss_name, xp=np)
  total = _paper_loss(logp, logp, ref, adv, mask, loss_name, kl_coef=0.5, xp=np)
  for rows in (8, 3):
    cfg = TrainConfig(loss=loss_name, chunk_rows=rows, length_bucket=8, sampling=SAMPLING,
                      tis_cap=0.0, kl_coef=0.5)
    trainer = Trainer(_model(), cfg)
    grads, _ = trainer.gradients(trainer.plan(batch)[0])
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
      np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-5, atol=1e-7)
    stats = trainer.step(batch)
    np.testing.assert_allclose(stats["pg_loss"], pg, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(stats["loss"], total, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(stats["kl_ref"], (total - pg) / 0.5, rtol=1e-4, atol=1e-7)
  assert (total - pg) / 0.5 > 1e-3  # the policy really is away from the reference


def _sample_batch(model, sampling, n=8, seed=0):
  """Responses drawn by the sampler's own function (`sample_and_logprob`) token by token from
  full forwards: prompts of 3 tokens, 1..12 response tokens; advantages of mixed sign."""
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, 32, 3).tolist() for _ in range(n)]
  lengths = rng.integers(1, 13, n)
  step = jax.jit(lambda t, pos, ids: sample_and_logprob(
      model(t).logits_BxTxV[jnp.arange(n), pos], 7, ids, pos, sampling))
  tokens = np.zeros((n, L), np.int32)
  tokens[:, :3] = prompts
  logps = np.zeros((n, L), np.float32)
  for t in range(3, 3 + int(lengths.max())):
    tok, lp = step(jnp.asarray(tokens), jnp.full((n,), t - 1), jnp.arange(n))
    tokens[:, t], logps[:, t] = np.asarray(tok), np.asarray(lp)
  responses = [tokens[i, 3:3 + k] for i, k in enumerate(lengths)]
  sampler = [logps[i, 3:3 + k] for i, k in enumerate(lengths)]
  adv = rng.standard_normal(n).astype(np.float32)
  return make_batch(prompts, responses, sampler, adv, L)


TOP_K_P = SamplingParams(temperature=0.8, top_k=5, top_p=0.8)


@pytest.mark.parametrize("algorithm,minibatches", [("grpo", 1), ("dapo", 2)])
def test_top_k_top_p_step_is_finite_and_updates(algorithm, minibatches):
  """With top-k / top-p the prompt and padding tokens outside the kept set have log-prob -inf;
  masked before any ratio, the step is finite (it raised FloatingPointError every step) and
  moves every parameter; the trainer's log-probs of the sampled tokens are the sampler's."""
  model = _model()
  batch = _sample_batch(model, TOP_K_P)
  logp, _ = jax.jit(lambda t: policy_logprobs(model, t, TOP_K_P))(jnp.asarray(batch.tokens_NxL))
  logp = np.asarray(logp)
  assert np.isneginf(logp[~batch.mask_NxT]).any()  # the case: -inf outside the response
  np.testing.assert_allclose(logp[batch.mask_NxT], batch.sampler_logp_NxT[batch.mask_NxT],
                             rtol=1e-5, atol=1e-6)
  trainer = Trainer(_model(), TrainConfig(algorithm=algorithm, minibatches=minibatches,
                                          epochs=minibatches, chunk_rows=3, length_bucket=8,
                                          sampling=TOP_K_P, kl_coef=0.1))
  before = jax.tree.map(np.asarray, trainer.trainable)
  stats = trainer.step(batch)
  assert all(np.isfinite(v) for v in stats.values()), stats
  assert stats["kl_sample_train"] < 1e-5 and stats["logp_abs_diff_max"] < 1e-5
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.trainable)):
    assert not np.array_equal(a, np.asarray(b))


def test_sampler_and_trainer_top_k_top_p_distributions_agree():
  """For one context: the trainer's probability of every next token equals top-k then top-p of
  softmax(logits / T) in NumPy (the smallest set of most likely tokens reaching top_p, zero
  outside), and 20000 draws of the sampler's Gumbel-argmax follow it (chi-square)."""
  model = _model()
  V = CFG.vocab_size
  prompt = [5, 17, 3]
  tokens_VxL = jnp.asarray([prompt + [v] for v in range(V)], jnp.int32)
  trainer_p = np.exp(np.asarray(policy_logprobs(model, tokens_VxL, TOP_K_P)[0][:, 2],
                                np.float64))
  logits = np.asarray(model(tokens_VxL[:1]).logits_BxTxV[0, 2], np.float64)
  z = logits / TOP_K_P.temperature
  keep = z >= np.sort(z)[-TOP_K_P.top_k]
  p = np.where(keep, np.exp(z - z.max()), 0.0)
  p /= p.sum()
  order = np.argsort(-p)
  before = np.cumsum(p[order]) - p[order]
  kept = np.zeros(V, bool)
  kept[order[before < TOP_K_P.top_p]] = True
  expected = np.where(kept, p, 0.0) / p[kept].sum()
  assert 1 < kept.sum() < TOP_K_P.top_k  # both masks cut something here
  np.testing.assert_allclose(trainer_p, expected, atol=1e-6)
  assert np.all(trainer_p[~kept] == 0.0)
  from tlt_jax.rollout.sampling import masked_logits
  n = 20000
  masked = masked_logits(jnp.asarray(logits, jnp.float32)[None], TOP_K_P)
  draws = jax.jit(lambda ids: sample_from_masked(jnp.broadcast_to(masked, (n, V)), 3, ids,
                                                 jnp.full((n,), 2), greedy=False))(jnp.arange(n))
  counts = np.bincount(np.asarray(draws), minlength=V)
  assert counts[~kept].sum() == 0
  import scipy.stats
  chi2 = float(np.sum((counts[kept] - n * expected[kept]) ** 2 / (n * expected[kept])))
  assert chi2 < scipy.stats.chi2.ppf(0.999, kept.sum() - 1), (counts[kept], n * expected[kept])


def test_on_policy_batch_has_zero_mismatch_and_unit_weights():
  with ops.numerics_mode("batch_invariant"):
    model = _model()
    batch, *_ = _batch(model)
    for minibatches, epochs in ((1, 1), (2, 2)):  # the single-update path and the PPO path
      trainer = Trainer(_model(), TrainConfig(loss="ppo", minibatches=minibatches, epochs=epochs,
                                              chunk_rows=4, length_bucket=16, sampling=SAMPLING))
      before = jax.tree.map(np.asarray, trainer.trainable)
      stats = trainer.step(batch)
      assert stats["kl_sample_train"] == 0.0 and stats["logp_abs_diff_max"] == 0.0
      assert stats["is_weight_mean"] == 1.0 and stats["is_truncated_fraction"] == 0.0
      moved = [not np.array_equal(a, np.asarray(b))
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.trainable))]
      assert all(moved)
      if minibatches == 1:  # one update at the sampling-time parameters: every ratio is 1
        assert stats["clip_fraction"] == 0.0
    assert np.isfinite(stats["grad_norm"])


def test_reference_is_the_model_with_lora_off():
  with ops.numerics_mode("batch_invariant"):
    trainer = Trainer(_model(), TrainConfig(kl_coef=0.1, sampling=SAMPLING))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 32, (2, 8)), jnp.int32)
    ref_logp, _ = trainer.fns._logprobs(trainer.reference, trainer.frozen, tokens)
    base_logp, _ = policy_logprobs(_model(with_lora=False), tokens, SAMPLING)
    policy_logp, _ = trainer.fns._logprobs(trainer.trainable, trainer.frozen, tokens)
  np.testing.assert_array_equal(np.asarray(ref_logp), np.asarray(base_logp))
  assert not np.array_equal(np.asarray(policy_logp), np.asarray(base_logp))


@pytest.mark.parametrize("minibatches", [1, 2])
def test_nan_loss_is_refused_and_keeps_the_parameters(minibatches):
  """With 2 minibatches the NaN is in the second: the first one's update, already applied when
  the NaN shows, is undone too."""
  model = _model()
  batch, *_ = _batch(model)
  batch.advantages_N[np.argmax(batch.row_lengths())] = np.nan  # the last chunk: minibatch 2
  trainer = Trainer(model, TrainConfig(sampling=SAMPLING, chunk_rows=4, minibatches=minibatches))
  assert len(trainer.plan(batch)) == minibatches
  before = jax.tree.map(np.asarray, trainer.trainable)
  opt_before = jax.tree.map(np.asarray, trainer.opt_state)
  with pytest.raises(FloatingPointError, match="update was not applied"):
    trainer.step(batch)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.trainable)):
    np.testing.assert_array_equal(a, np.asarray(b))
  for a, b in zip(jax.tree.leaves(opt_before), jax.tree.leaves(trainer.opt_state)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_full_finetuning_trains_every_parameter():
  model = _model(with_lora=False)
  batch, *_ = _batch(model)
  trainer = Trainer(model, TrainConfig(sampling=SAMPLING, kl_coef=0.05))
  assert trainer.full_finetune
  n_params = len(jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert len(jax.tree.leaves(trainer.trainable)) == n_params
  kernel_before = np.asarray(model.layers[0].mlp.up_proj.kernel[...])
  stats = trainer.step(batch)
  assert "kl_ref" in stats
  kernel_after = np.asarray(trainer.policy().layers[0].mlp.up_proj.kernel[...])
  assert not np.array_equal(kernel_before, kernel_after)


def test_bad_config_is_named():
  with pytest.raises(ValueError, match="unknown algorithm 'grpoo'"):
    TrainConfig(algorithm="grpoo")
  with pytest.raises(ValueError, match="sequence 0: prompt 3 \\+ response 20 tokens exceed"):
    make_batch([[1, 2, 3]], [np.zeros(20, np.int32)], [np.zeros(20, np.float32)],
               np.zeros(1, np.float32), L)


def test_sharded_step_matches_the_single_device_step():
  from tlt_jax import mesh as mesh_lib

  with on_devices(8) as devices:
    batch, *_ = _batch(_model())
    single = Trainer(_model(), TrainConfig(chunk_rows=8, sampling=SAMPLING))
    sharded = Trainer(_model(), TrainConfig(chunk_rows=8, sampling=SAMPLING),
                      mesh=mesh_lib.make_mesh(data=8, devices=devices))
    plan = sharded.plan(batch)
    tokens = plan[0][0][0][0]
    assert len(tokens.sharding.device_set) == 8  # rows split over the data axis
    expected, _ = single.gradients(single.plan(batch)[0])
    grads, _ = sharded.gradients(plan[0])
  for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["blocked_jax", "pallas"])
def test_batch_invariant_sharded_trainer_keeps_per_row_logprobs_bitwise(backend):
  """On a data x fsdp mesh the batch-invariant trainer runs its kernels per device on whole
  rows (shard_map): every row's log-probs are bitwise the single-device ones, so the
  sampler/trainer mismatch stays exactly 0; the gradient (summed across devices) matches.
  Pallas (interpreted here) is what runs on GPU/TPU."""
  from tlt_jax import mesh as mesh_lib

  with on_devices(8) as devices, ops.numerics_mode("batch_invariant", backend):
    batch, *_ = _batch(_model())
    single = Trainer(_model(), TrainConfig(chunk_rows=8, sampling=SAMPLING))
    mesh = mesh_lib.make_mesh(data=4, fsdp=2, model=1, devices=devices)
    sharded = Trainer(_model(), TrainConfig(chunk_rows=8, sampling=SAMPLING), mesh=mesh)
    plan = sharded.plan(batch)
    assert plan[0][0][0][0].sharding.spec[0] == mesh_lib.BATCH_AXES  # rows over data x fsdp
    expected, _ = single.gradients(single.plan(batch)[0])
    grads, _ = sharded.gradients(plan[0])
    # The batch's sampler log-probs are the single-device forward's (`_batch`): a last-bit
    # difference in any response token of any row would show here.
    stats = sharded.step(batch)
  assert stats["logp_abs_diff_max"] == 0.0 and stats["kl_sample_train"] == 0.0
  for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-5, atol=1e-7)
  with pytest.raises(ValueError, match=r"rl.chunk_rows=6 is not a multiple of the mesh's data x "
                                       r"fsdp = 8"):
    Trainer(_model(), TrainConfig(chunk_rows=6, sampling=SAMPLING), mesh=mesh)


def test_tensor_parallel_trainer_keeps_per_row_logprobs_bitwise():
  """mesh.model = 2 (exact tensor parallelism: every linear layer split over its outputs, whole
  inputs gathered; tied embeddings split over the vocabulary) with the Pallas kernels: every
  response token's log-prob is bitwise the unsplit sampler's, so the sampler/trainer mismatch
  stays exactly 0 with the model split; the gradients match the single device's."""
  from tlt_jax import mesh as mesh_lib

  cfg = dataclasses.replace(CFG, num_heads=4, num_kv_heads=2)  # whole heads on 2 devices
  with on_devices(8) as devices, ops.numerics_mode("batch_invariant", "pallas"):
    mesh = mesh_lib.make_mesh(data=2, fsdp=2, model=2, devices=devices)
    batch, *_ = _batch(_model(cfg=cfg))  # sampler log-probs from the unsplit forward
    single = Trainer(_model(cfg=cfg), TrainConfig(chunk_rows=8, sampling=SAMPLING))
    # head_chunk_tokens=4: the vocabulary head in chunks of 4 tokens (the last one padded)
    split = Trainer(_model(cfg=cfg), TrainConfig(chunk_rows=8, sampling=SAMPLING,
                                                 head_chunk_tokens=4), mesh=mesh)
    expected, _ = single.gradients(single.plan(batch)[0])
    grads, _ = split.gradients(split.plan(batch)[0])
    stats = split.step(batch)
    with pytest.raises(ValueError, match="mesh.model=2 must divide num_heads=2 and "
                                         "num_kv_heads=1"):
      Trainer(_model(), TrainConfig(chunk_rows=8, sampling=SAMPLING), mesh=mesh)
  assert stats["logp_abs_diff_max"] == 0.0 and stats["kl_sample_train"] == 0.0
  for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=2e-5, atol=1e-7)
  # Stored the way the forward splits it: down_proj over its outputs (model), fsdp on its input.
  specs = {mesh_lib._path_str(path): leaf.sharding.spec
           for path, leaf in jax.tree_util.tree_leaves_with_path(split.frozen)}
  assert specs["layers/0/mlp/down_proj/base/kernel"] == P("fsdp", "model"), specs


def test_tensor_parallel_backward_gathers_again_instead_of_keeping_whole_inputs():
  """rl.tp_regather: o_proj and down_proj keep only their device's share of their input for the
  backward and all-gather it there again (and the logits are recomputed there, the vocabulary
  head in chunks of 4 tokens). The gradients are bitwise those of keeping the whole inputs and
  running the head at once, and the compiled gradient program needs less
  memory, by most of what the plan counts for the inputs (XLA:CPU's buffer assignment realizes
  ~80% of it at this size; measured 2026-12-04)."""
  from tlt_jax import mesh as mesh_lib

  cfg = dataclasses.replace(CFG, num_layers=4, num_heads=16, num_kv_heads=2, head_dim=128,
                            intermediate_size=8192)  # big o_proj / down_proj inputs
  grads, temp = {}, {}
  with on_devices(8) as devices, ops.numerics_mode("batch_invariant", "blocked_jax"):
    mesh = mesh_lib.make_mesh(data=4, fsdp=1, model=2, devices=devices)
    batch, *_ = _batch(_model(cfg=cfg))
    for regather in (False, True):
      trainer = Trainer(_model(cfg=cfg), TrainConfig(chunk_rows=8, sampling=SAMPLING,
                                                     tp_regather=regather, head_chunk_tokens=4),
                        mesh=mesh)
      (dev, weight), = trainer.plan(batch)[0]
      compiled = trainer._grad.lower(trainer.trainable, trainer.frozen, trainer.reference,
                                     weight, *dev, None, None, None).compile()
      temp[regather] = compiled.memory_analysis().temp_size_in_bytes
      grads[regather], _ = trainer.gradients([(dev, weight)])
  for a, b in zip(jax.tree.leaves(grads[False]), jax.tree.leaves(grads[True])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  rows, T = 8 // 4, dev[0].shape[1]
  kept = rows * T * cfg.num_layers * (cfg.num_heads * cfg.head_dim + cfg.intermediate_size) * 4 / 2
  assert temp[False] - temp[True] >= 0.5 * kept, (temp, kept)


@pytest.mark.parametrize("devices,config", [
    (1, dict(chunk_rows=8)),
    (1, dict(chunk_rows=4, loss="ppo", minibatches=2, kl_coef=0.1)),  # prepare pass, reference
    (8, dict(chunk_rows=8, kl_coef=0.1)),                             # rows over a data mesh
])
def test_warm_up_compiles_ahead_so_steps_compile_nothing_and_match(devices, config):
  """Trainer.warm_up compiles ahead of time (nothing runs); the steps after it compile nothing
  and give the metrics and parameters of a trainer that compiled on first use, bitwise."""
  from tlt_jax import mesh as mesh_lib

  compiles = []
  def listener(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(duration)

  with on_devices(devices) as devs:
    mesh = mesh_lib.make_mesh(data=devices, devices=devs) if devices > 1 else None
    batch, *_ = _batch(_model())
    cfg = TrainConfig(length_bucket=8, sampling=SAMPLING, **config)
    cold, warm = Trainer(_model(), cfg, mesh=mesh), Trainer(_model(), cfg, mesh=mesh)
    expected = [cold.step(batch) for _ in range(2)]
    shapes = warm.warm_up(L)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
      got = [warm.step(batch) for _ in range(2)]
    finally:
      jax.monitoring.unregister_event_duration_listener(listener)
  assert shapes == 2 and compiles == []
  assert got == expected  # host metrics of both steps, exactly
  for a, b in zip(jax.tree.leaves(warm.state()), jax.tree.leaves(cold.state())):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
