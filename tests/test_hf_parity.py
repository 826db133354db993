"""Our decoder vs HF transformers on random tiny Qwen2 / Qwen3 / Llama checkpoints (f32)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from tlt_jax.generate import generate
from tlt_jax.model import hf


def _tokens(vocab, shape, seed=0):
  return np.random.RandomState(seed).randint(0, vocab, shape).astype(np.int32)


def _hf_forward(model, tokens):
  with torch.no_grad():
    out = model(torch.tensor(tokens, dtype=torch.long), output_hidden_states=True)
  return out.logits.float().numpy(), out.hidden_states[-1].float().numpy()


def test_config_flags(hf_checkpoint):
  kind, _, path = hf_checkpoint
  cfg = hf.load_config(path)
  assert cfg.arch == kind
  assert cfg.qkv_bias == (kind == "qwen2")
  assert cfg.qk_norm == (kind == "qwen3")
  assert cfg.tie_embeddings == (kind == "qwen2")
  if kind == "qwen3":
    assert cfg.head_dim == 24 != cfg.hidden_size // cfg.num_heads
  if kind == "llama":
    assert cfg.num_heads // cfg.num_kv_heads == 4 and cfg.rope_scaling.factor == 8.0


def test_logits_and_hidden_match_hf(hf_checkpoint):
  _, ref, path = hf_checkpoint
  model = hf.load_model(path)
  # 40 > original context 16: llama3 scaling matters
  tokens = _tokens(model.cfg.vocab_size, (3, 40))
  ref_logits, ref_hidden = _hf_forward(ref, tokens)
  out = model(jnp.asarray(tokens))
  np.testing.assert_allclose(np.asarray(out.logits_BxTxV), ref_logits, atol=1e-4, rtol=0)
  np.testing.assert_allclose(np.asarray(out.hidden_BxTxD), ref_hidden, atol=1e-4, rtol=0)


def test_greedy_generation_matches_hf(hf_checkpoint):
  _, ref, path = hf_checkpoint
  model = hf.load_model(path)
  prompt = _tokens(model.cfg.vocab_size, (1, 7), seed=1)
  ours = generate(model, [list(prompt[0])], 32, temperature=0.0)
  with torch.no_grad():
    theirs = ref.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=32,
                          min_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=None)
  np.testing.assert_array_equal(ours[0], theirs[0, 7:].numpy())


def test_ragged_batch_generation_equals_one_by_one(hf_checkpoint):
  _, _, path = hf_checkpoint
  model = hf.load_model(path)
  prompts = [[3, 5, 7], [11, 13, 17, 19, 23, 29], [31]]
  batched = generate(model, prompts, 8)
  for i, p in enumerate(prompts):
    np.testing.assert_array_equal(batched[i], generate(model, [p], 8)[0])


def test_save_roundtrip_loads_in_transformers(hf_checkpoint, tmp_path):
  kind, ref, path = hf_checkpoint
  model = hf.load_model(path)
  out_dir = str(tmp_path / "saved")
  hf.save_model(model, out_dir, max_shard_bytes=60_000 if kind == "llama" else None)
  if kind == "llama":
    assert os.path.exists(os.path.join(out_dir, hf.SAFE_INDEX))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir).eval()
  tokens = _tokens(model.cfg.vocab_size, (2, 12), seed=2)
  ref_logits, _ = _hf_forward(ref, tokens)
  new_logits, _ = _hf_forward(reloaded, tokens)
  np.testing.assert_allclose(new_logits, ref_logits, atol=1e-5, rtol=0)
  # And our own loader reads the (possibly sharded) copy back bitwise.
  again = hf.load_model(out_dir)
  np.testing.assert_array_equal(np.asarray(again(jnp.asarray(tokens)).logits_BxTxV),
                                np.asarray(model(jnp.asarray(tokens)).logits_BxTxV))


def test_bf16_close_to_f32(hf_checkpoint):
  _, _, path = hf_checkpoint
  tokens = jnp.asarray(_tokens(96, (2, 10), seed=3))
  f32 = hf.load_model(path)(tokens).logits_BxTxV
  bf16_model = hf.load_model(path, dtype="bfloat16")
  assert bf16_model.layers[0].mlp.up_proj.kernel[...].dtype == jnp.bfloat16
  bf16 = bf16_model(tokens).logits_BxTxV
  assert float(jnp.max(jnp.abs(bf16 - f32))) < 0.05


# ---------------------------------------------------------------------------------------------
# Bad checkpoints


def _copy_checkpoint(path, dst, edit_config=None, edit_tensors=None):
  import safetensors.numpy
  os.makedirs(dst, exist_ok=True)
  with open(os.path.join(path, "config.json")) as f:
    config = json.load(f)
  if edit_config:
    edit_config(config)
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(config, f)
  tensors = hf.read_safetensors(path)
  if edit_tensors:
    edit_tensors(tensors)
  safetensors.numpy.save_file(tensors, os.path.join(dst, "model.safetensors"))
  return dst


def test_wrong_shape_names_tensor_and_shapes(hf_checkpoint, tmp_path):
  kind, _, path = hf_checkpoint
  name = "model.layers.1.mlp.up_proj.weight"
  def edit(t):
    t[name] = t[name][:, :-1].copy()
  bad = _copy_checkpoint(path, str(tmp_path / "bad"), edit_tensors=edit)
  with pytest.raises(hf.CheckpointError) as e:
    hf.load_model(bad)
  msg = str(e.value)
  assert name in msg and "(128, 63)" in msg and "(128, 64)" in msg


def test_missing_tensor_is_named(hf_checkpoint, tmp_path):
  _, _, path = hf_checkpoint
  name = "model.layers.0.self_attn.k_proj.weight"
  bad = _copy_checkpoint(path, str(tmp_path / "bad"), edit_tensors=lambda t: t.pop(name))
  with pytest.raises(hf.CheckpointError, match=name.replace(".", r"\.")):
    hf.load_model(bad)


def test_unsupported_architecture_is_named(hf_checkpoint, tmp_path):
  _, _, path = hf_checkpoint
  def edit(c):
    c["model_type"] = "mixtral"
  bad = _copy_checkpoint(path, str(tmp_path / "bad"), edit_config=edit)
  with pytest.raises(hf.CheckpointError, match="model_type='mixtral'"):
    hf.load_config(bad)


def test_bad_head_counts(hf_checkpoint, tmp_path):
  _, _, path = hf_checkpoint
  def edit(c):
    c["num_key_value_heads"] = 3
  bad = _copy_checkpoint(path, str(tmp_path / "bad"), edit_config=edit)
  with pytest.raises(hf.CheckpointError, match="num_kv_heads=3"):
    hf.load_config(bad)
