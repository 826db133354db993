"""The numerics contracts of DESIGN.md, bitwise (==), on the full model in batch-invariant mode.

Model: Qwen3-style (q/k norm) with qkv bias, GQA 4:2, untied lm_head, LoRA with non-zero B on
every linear layer including lm_head, so each kind of reduction the model has is exercised.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax import ops
from tlt_jax.model.lora import apply_lora, lora_modules
from tlt_jax.model.transformer import ModelConfig, Transformer, init_cache

VOCAB = 97
SEQ = 24
NUM_SLOTS = 64  # two KV splits: the full forward (24 -> one split) and the cache paths differ
# Every row of every batch is checked against its batch-of-one result, so a size needs no
# repeats for its row positions: small sizes, then both sides of the 8/16/32-row block
# boundaries up to 64. Each size is a compile.
BATCH_SIZES = {"float32": [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64],
               "bfloat16": [1, 2, 3, 8, 9, 16, 17, 33, 64]}
BACKEND = "blocked_jax"  # what batch_invariant runs on CPU ("auto"); Pallas has its own test


@functools.lru_cache(maxsize=None)
def _model(dtype: str, num_layers: int = 2):
  cfg = ModelConfig(arch="qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=160,
                    num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                    qkv_bias=True, tie_embeddings=False, dtype=dtype)
  model = Transformer(cfg, nnx.Rngs(0))
  apply_lora(model, rank=4, alpha=32.0, seed=1,
             targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                      "down_proj", "lm_head"))
  for i, module in enumerate(lora_modules(model).values()):
    b = module.lora_b.get_value()
    module.lora_b.set_value(
        (0.05 * jax.random.normal(jax.random.key(100 + i), b.shape)).astype(b.dtype))
  graphdef, state = nnx.split(model)

  @jax.jit
  def full(state, tokens_BxT):
    out = nnx.merge(graphdef, state)(tokens_BxT)
    return out.logits_BxTxV, out.hidden_BxTxD

  @jax.jit
  def cached(state, tokens_BxT, cache, write_slot_B):
    out = nnx.merge(graphdef, state)(tokens_BxT, cache=cache, write_slot_B=write_slot_B)
    return out.logits_BxTxV, out.hidden_BxTxD, out.cache

  return cfg, state, full, cached


def _sequence(seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (1, SEQ), dtype=np.int32)


DTYPES = ["float32", "bfloat16"]


def _check_row_in_batch(full, state, seq, B, rng, ref_logits, ref_hidden):
  """`seq` at a random row among B - 1 random rows gives bitwise its batch-of-one outputs."""
  batch = rng.integers(0, VOCAB, (B, SEQ), dtype=np.int32)
  row = int(rng.integers(B))
  batch[row] = seq[0]
  logits, hidden = full(state, batch)
  np.testing.assert_array_equal(np.asarray(logits[row]), ref_logits[0], err_msg=f"B={B}")
  np.testing.assert_array_equal(np.asarray(hidden[row]), ref_hidden[0], err_msg=f"B={B}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariance_1_to_64(dtype):
  """Every row of batches of 1..64 random sequences equals that sequence's batch-of-one
  logits and hidden states, bitwise."""
  cfg, state, full, _ = _model(dtype, num_layers=1)  # one layer: half the compile per size
  rng = np.random.default_rng(1)
  pool = rng.integers(0, VOCAB, (64, SEQ), dtype=np.int32)
  with ops.numerics_mode("batch_invariant", BACKEND):
    alone = [full(state, pool[i:i + 1]) for i in range(len(pool))]  # one compile, B = 1
    ref_logits = np.concatenate([np.asarray(a[0]) for a in alone])
    ref_hidden = np.concatenate([np.asarray(a[1]) for a in alone])
    for B in BATCH_SIZES[dtype]:
      rows = rng.permutation(len(pool))[:B]  # each row lands at a fresh position
      logits, hidden = full(state, pool[rows])
      np.testing.assert_array_equal(np.asarray(logits), ref_logits[rows], err_msg=f"B={B}")
      np.testing.assert_array_equal(np.asarray(hidden), ref_hidden[rows], err_msg=f"B={B}")


def _prefill(cfg, state, cached, seq, length):
  cache = init_cache(cfg, 1, NUM_SLOTS)
  return cached(state, seq[:, :length], cache, jnp.zeros((1,), jnp.int32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_path_invariance_prefill_decode_verify(dtype):
  cfg, state, full, cached = _model(dtype)
  seq = _sequence(2)
  with ops.numerics_mode("batch_invariant", BACKEND):
    ref_logits, ref_hidden = (np.asarray(a) for a in full(state, seq))
    # Prefill of a prefix, then one-token decodes.
    prefix = 5
    logits, hidden, cache = _prefill(cfg, state, cached, seq, prefix)
    np.testing.assert_array_equal(np.asarray(logits), ref_logits[:, :prefix])
    np.testing.assert_array_equal(np.asarray(hidden), ref_hidden[:, :prefix])
    for t in range(prefix, SEQ):
      logits, hidden, cache = cached(state, seq[:, t:t + 1], cache, jnp.array([t], jnp.int32))
      np.testing.assert_array_equal(np.asarray(logits), ref_logits[:, t:t + 1], err_msg=f"t={t}")
      np.testing.assert_array_equal(np.asarray(hidden), ref_hidden[:, t:t + 1], err_msg=f"t={t}")
    # Multi-token verify chunks of 2..9 tokens after a prefix (what chain SD runs).
    for size in range(2, 10):
      start = 7
      _, _, cache = _prefill(cfg, state, cached, seq, start)
      logits, hidden, _ = cached(state, seq[:, start:start + size], cache,
                                 jnp.array([start], jnp.int32))
      np.testing.assert_array_equal(np.asarray(logits), ref_logits[:, start:start + size],
                                    err_msg=f"chunk {size}")
      np.testing.assert_array_equal(np.asarray(hidden), ref_hidden[:, start:start + size],
                                    err_msg=f"chunk {size}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_on_policy_sampler_logprobs_equal_trainer_logprobs(dtype):
  cfg, state, full, cached = _model(dtype)
  seq = _sequence(3)
  temperature = 0.7
  logprob = jax.jit(ops.token_logprobs, static_argnums=2)
  with ops.numerics_mode("batch_invariant", BACKEND):
    # Sampler side: a prefill, then one token per step; the log-prob of each next token is
    # computed from that step's logits, as the rollout engine does.
    prompt = 6
    logits, _, cache = _prefill(cfg, state, cached, seq, prompt)
    sampler = [logprob(logits[:, -1:], jnp.asarray(seq[:, prompt:prompt + 1]), temperature)]
    for t in range(prompt, SEQ - 1):
      logits, _, cache = cached(state, seq[:, t:t + 1], cache, jnp.array([t], jnp.int32))
      sampler.append(logprob(logits, jnp.asarray(seq[:, t + 1:t + 2]), temperature))
    sampler = np.concatenate([np.asarray(s) for s in sampler], axis=1)
    # Trainer side: one forward over the whole sequence, log-probs of all response tokens.
    logits, _ = full(state, seq)
    trainer = np.asarray(logprob(logits[:, prompt - 1:-1], jnp.asarray(seq[:, prompt:]),
                                 temperature))
  np.testing.assert_array_equal(sampler, trainer)
  assert float(np.mean(sampler - trainer)) == 0.0  # the logged kl_sample_train


def test_xla_numerics_are_not_batch_invariant_here():
  """The contracts above are not vacuous: XLA's own kernels break them on this model."""
  cfg, state, full, cached = _model("float32")
  seq = _sequence(2)
  with ops.numerics_mode("xla"):
    ref_logits = np.asarray(full(state, seq)[0])
    logits, _, cache = _prefill(cfg, state, cached, seq, SEQ - 1)
    logits, _, _ = cached(state, seq[:, -1:], cache, jnp.array([SEQ - 1], jnp.int32))
  assert not np.array_equal(np.asarray(logits), ref_logits[:, -1:])


def test_pallas_kernels_keep_the_contracts_on_the_full_model():
  """The Pallas kernels (interpret mode here; compiled on GPU/TPU) in the same model."""
  cfg, state, full, cached = _model("float32")
  seq = _sequence(4)
  rng = np.random.default_rng(5)
  with ops.numerics_mode("batch_invariant", "pallas"):
    ref_logits, ref_hidden = (np.asarray(a) for a in full(state, seq))
    for B in (1, 3, 17):
      _check_row_in_batch(full, state, seq, B, rng, ref_logits, ref_hidden)
    logits, hidden, cache = _prefill(cfg, state, cached, seq, 10)
    np.testing.assert_array_equal(np.asarray(logits), ref_logits[:, :10])
    for t in (10, 11):
      logits, hidden, cache = cached(state, seq[:, t:t + 1], cache, jnp.array([t], jnp.int32))
      np.testing.assert_array_equal(np.asarray(logits), ref_logits[:, t:t + 1])
      np.testing.assert_array_equal(np.asarray(hidden), ref_hidden[:, t:t + 1])
    logits, hidden, _ = cached(state, seq[:, 12:17], cache, jnp.array([12], jnp.int32))
    np.testing.assert_array_equal(np.asarray(logits), ref_logits[:, 12:17])
