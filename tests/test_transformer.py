"""Cache and mask paths of the decoder agree with the plain full-sequence forward (XLA numerics)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.model import lora
from tlt_jax.model.transformer import ModelConfig, Transformer, causal_mask, init_cache

CFG = ModelConfig(arch="llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def model():
  return Transformer(CFG, nnx.Rngs(0))


def test_prefill_then_decode_equals_full_forward(model):
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 50, (2, 10)).astype(np.int32))
  full = model(tokens)
  cache = init_cache(CFG, 2, 16)
  pre = model(tokens[:, :6], cache=cache, write_slot_B=jnp.zeros(2, jnp.int32))
  cache, logits = pre.cache, [pre.logits_BxTxV]
  for t in range(6, 10):
    step = model(tokens[:, t:t + 1], cache=cache, write_slot_B=jnp.full((2,), t, jnp.int32))
    cache = step.cache
    logits.append(step.logits_BxTxV)
  np.testing.assert_allclose(np.concatenate(logits, 1), full.logits_BxTxV, atol=1e-5)


def test_explicit_mask_with_shared_positions(model):
  """Two 'tree' branches in consecutive slots, both at position 4, each seeing only the prefix."""
  prefix = jnp.asarray([[3, 1, 4, 1]], jnp.int32)
  cache = init_cache(CFG, 1, 8)
  cache = model(prefix, cache=cache, write_slot_B=jnp.zeros(1, jnp.int32)).cache
  branches = jnp.asarray([[5, 9]], jnp.int32)
  mask = np.zeros((1, 2, 8), bool)
  mask[0, 0, :4] = mask[0, 1, :4] = True
  mask[0, 0, 4] = True  # branch 0 in slot 4 sees itself
  mask[0, 1, 5] = True  # branch 1 in slot 5 sees itself, not branch 0
  out = model(branches, jnp.asarray([[4, 4]]), cache=cache,
              write_slot_B=jnp.full((1,), 4, jnp.int32), mask_BxTxS=jnp.asarray(mask))
  for i, tok in enumerate([5, 9]):
    seq = jnp.concatenate([prefix, jnp.asarray([[tok]], jnp.int32)], 1)
    np.testing.assert_allclose(out.logits_BxTxV[0, i], model(seq).logits_BxTxV[0, -1], atol=1e-5)
  with pytest.raises(ValueError, match="mask shape"):
    model(branches, cache=cache, write_slot_B=jnp.zeros(1, jnp.int32),
          mask_BxTxS=jnp.asarray(mask[:, :, :5]))


def test_causal_mask_helper():
  m = causal_mask(jnp.asarray([[2, 3]]), 5)
  assert m.tolist() == [[[True, True, True, False, False], [True, True, True, True, False]]]


def test_lm_head_lora_targets():
  m = lora.apply_lora(Transformer(CFG, nnx.Rngs(1)), rank=2, alpha=4.0, targets=("lm_head",))
  assert list(lora.lora_modules(m)) == ["lm_head"]
  tied = Transformer(ModelConfig(**{**CFG.__dict__, "tie_embeddings": True}), nnx.Rngs(1))
  with pytest.raises(ValueError, match="untied lm_head"):
    lora.apply_lora(tied, rank=2, alpha=4.0, targets=("lm_head",))
