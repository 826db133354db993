"""LoRA: identity at B = 0, frozen base under the optax mask, PEFT interop both ways."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
from flax import nnx

from tlt_jax.model import hf, lora

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tokens(shape, seed=0):
  return jnp.asarray(np.random.RandomState(seed).randint(0, 96, shape).astype(np.int32))


def _randomise_b(model, seed=1):
  key = jax.random.key(seed)
  for i, mod in enumerate(lora.lora_modules(model).values()):
    mod.lora_b.set_value(
        0.05 * jax.random.normal(jax.random.fold_in(key, i), mod.lora_b[...].shape))


def test_zero_b_is_bitwise_identity(hf_checkpoint):
  _, _, path = hf_checkpoint
  base = hf.load_model(path)
  tokens = _tokens((2, 11))
  want = base(tokens).logits_BxTxV
  adapted = lora.apply_lora(hf.load_model(path), rank=4, alpha=32.0, targets=TARGETS)
  assert len(lora.lora_modules(adapted)) == 7 * adapted.cfg.num_layers
  np.testing.assert_array_equal(np.asarray(adapted(tokens).logits_BxTxV), np.asarray(want))


def test_optimizer_step_moves_only_lora(hf_checkpoint):
  _, _, path = hf_checkpoint
  model = lora.apply_lora(hf.load_model(path), rank=4, alpha=32.0, targets=TARGETS)
  _randomise_b(model)
  graphdef, params = nnx.split(model, nnx.Param)
  tx = lora.masked_optimizer(optax.adamw(1e-2, weight_decay=0.1), params)
  opt_state = tx.init(params)
  tokens = _tokens((2, 9))

  def loss_fn(p):
    logits = nnx.merge(graphdef, p)(tokens).logits_BxTxV
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  grads = jax.grad(loss_fn)(params)
  updates, _ = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  mask = lora.trainable_mask(params)
  changed_lora = 0
  for m, old, new in zip(jax.tree.leaves(mask), jax.tree.leaves(params),
                         jax.tree.leaves(new_params)):
    if m:
      changed_lora += int(not np.array_equal(np.asarray(old), np.asarray(new)))
    else:
      np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
  assert changed_lora > 0


def _peft_model(ref, rank, alpha, targets):
  cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)
  return peft.get_peft_model(copy.deepcopy(ref), cfg).eval()


def test_peft_export_loads_in_peft(hf_checkpoint, tmp_path):
  _, ref, path = hf_checkpoint
  model = lora.apply_lora(hf.load_model(path), rank=4, alpha=16.0, targets=TARGETS)
  _randomise_b(model)
  lora.export_peft(model, str(tmp_path / "adapter"))
  peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(ref), str(tmp_path / "adapter")).eval()
  tokens = np.asarray(_tokens((2, 10), seed=4))
  with torch.no_grad():
    theirs = peft_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  ours = np.asarray(model(jnp.asarray(tokens)).logits_BxTxV)
  base = np.asarray(hf.load_model(path)(jnp.asarray(tokens)).logits_BxTxV)
  assert np.abs(ours - base).max() > 1e-3  # the adapter really changes the output
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_peft_adapter_imports_into_ours(hf_checkpoint, tmp_path):
  _, ref, path = hf_checkpoint
  torch.manual_seed(3)
  peft_model = _peft_model(ref, 8, 32, TARGETS)
  with torch.no_grad():
    for name, p in peft_model.named_parameters():
      if "lora_B" in name:
        p.copy_(0.05 * torch.randn_like(p))
  peft_model.save_pretrained(str(tmp_path / "adapter"))
  ours = lora.import_peft(hf.load_model(path), str(tmp_path / "adapter"))
  tokens = np.asarray(_tokens((2, 10), seed=5))
  with torch.no_grad():
    theirs = peft_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens)).logits_BxTxV), theirs,
                             atol=1e-4, rtol=0)


def test_lora_only_save_load_roundtrip(hf_checkpoint, tmp_path):
  _, _, path = hf_checkpoint
  a = lora.apply_lora(hf.load_model(path), rank=2, alpha=8.0, targets=TARGETS, seed=1)
  _randomise_b(a)
  lora.save_lora(a, str(tmp_path / "lora.safetensors"))
  b = lora.load_lora(lora.apply_lora(hf.load_model(path), rank=2, alpha=8.0, targets=TARGETS,
                                     seed=2), str(tmp_path / "lora.safetensors"))
  tokens = _tokens((1, 6))
  np.testing.assert_array_equal(np.asarray(a(tokens).logits_BxTxV),
                                np.asarray(b(tokens).logits_BxTxV))
  wrong_rank = lora.apply_lora(hf.load_model(path), rank=3, alpha=8.0, targets=TARGETS)
  with pytest.raises(ValueError, match="lora_A.weight' has shape"):
    lora.load_lora(wrong_rank, str(tmp_path / "lora.safetensors"))


def test_unknown_target_is_named(hf_checkpoint):
  _, _, path = hf_checkpoint
  with pytest.raises(ValueError, match="qkv_proj"):
    lora.apply_lora(hf.load_model(path), rank=2, alpha=8.0, targets=("qkv_proj",))
