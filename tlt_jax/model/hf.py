"""HF checkpoints in and out: `config.json` + safetensors (single file or sharded index),
tokenizer.json.

Loading checks every tensor against the model it fills: a missing tensor, an unexpected one, or a
wrong shape is an error that names the tensor and both shapes, before anything is overwritten.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx
from tokenizers import Tokenizer

from tlt_jax.model.transformer import ModelConfig, RopeScaling, Transformer

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


class CheckpointError(ValueError):
  """A checkpoint does not fit the model: names the tensor or field, and the shapes."""


# ---------------------------------------------------------------------------------------------
# config.json


def _rope_from_hf(d: dict, path: str) -> tuple[float, RopeScaling | None]:
  # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints write
  # `rope_theta` + `rope_scaling`. Accept both.
  params = d.get("rope_parameters") or d.get("rope_scaling") or {}
  theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type in (None, "default"):
    return theta, None
  if rope_type != "llama3":
    raise CheckpointError(f"{path}: rope_type={rope_type!r} is not supported (supported: "
                          "'default', 'llama3')")
  try:
    return theta, RopeScaling(
        factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]))
  except KeyError as e:
    raise CheckpointError(f"{path}: llama3 rope scaling is missing field {e.args[0]!r}") from None


def config_from_hf(d: dict, *, dtype: str = "float32", path: str = "config.json") -> ModelConfig:
  model_type = d.get("model_type")
  if model_type not in _MODEL_TYPES:
    raise CheckpointError(f"{path}: model_type={model_type!r} is not supported "
                          f"(supported: {sorted(_MODEL_TYPES)})")
  if d.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"{path}: hidden_act={d['hidden_act']!r} is not supported (only 'silu')")
  if d.get("mlp_bias", False):
    raise CheckpointError(f"{path}: mlp_bias=true is not supported")
  if model_type == "qwen2" and d.get("use_sliding_window", False):
    raise CheckpointError(f"{path}: use_sliding_window=true is not supported")
  for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
    if field not in d:
      raise CheckpointError(f"{path}: required field {field!r} is missing")
  heads = int(d["num_attention_heads"])
  head_dim = d.get("head_dim") or d["hidden_size"] // heads
  if "head_dim" not in d and d["hidden_size"] % heads:
    raise CheckpointError(f"{path}: hidden_size={d['hidden_size']} is not divisible by "
                          f"num_attention_heads={heads} and no head_dim is given")
  theta, scaling = _rope_from_hf(d, path)
  qkv_bias = True if model_type == "qwen2" else bool(d.get("attention_bias", False))
  eos = d.get("eos_token_id")
  try:
    return ModelConfig(
        arch=model_type, vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]), num_layers=int(d["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(head_dim), rope_theta=theta, rope_scaling=scaling,
        rms_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
        qk_norm=model_type == "qwen3",
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos, dtype=dtype)
  except ValueError as e:
    raise CheckpointError(f"{path}: {e}") from None


def config_to_hf(cfg: ModelConfig) -> dict:
  rope: dict = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_position_embeddings)
  eos = cfg.eos_token_id
  d = {
      "architectures": [_ARCH_CLASSES[cfg.arch]], "model_type": cfg.arch,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_eps,
      "max_position_embeddings": cfg.max_position_embeddings,
      "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope,
      # Older readers look for these two at the top level.
      "rope_theta": cfg.rope_theta,
      "bos_token_id": cfg.bos_token_id,
      "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
      "torch_dtype": cfg.dtype, "dtype": cfg.dtype,
  }
  if cfg.rope_scaling is not None:
    d["rope_scaling"] = dict(rope)
  if cfg.arch != "qwen2":
    d["attention_bias"] = cfg.qkv_bias
  return d


def load_config(model_dir: str, *, dtype: str = "float32") -> ModelConfig:
  path = os.path.join(model_dir, "config.json")
  if not os.path.exists(path):
    raise CheckpointError(f"{model_dir}: no config.json"
                          + ("" if os.path.isdir(model_dir) else " (no such directory)"))
  with open(path) as f:
    try:
      d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise CheckpointError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(d, dict):
    raise CheckpointError(f"{path}: expected a JSON object, got {type(d).__name__}")
  return config_from_hf(d, dtype=dtype, path=path)


# ---------------------------------------------------------------------------------------------
# Parameter names: ours (an NNX path) <-> HF's, with the transposes in between.


def hf_param_map(cfg: ModelConfig) -> dict[str, tuple[tuple, bool]]:
  """HF tensor name -> (our NNX state path, transpose?)."""
  m: dict[str, tuple[tuple, bool]] = {
      "model.embed_tokens.weight": (("embed_tokens", "embedding"), False),
      "model.norm.weight": (("norm", "weight"), False),
  }
  if not cfg.tie_embeddings:
    m["lm_head.weight"] = (("lm_head", "kernel"), True)
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."
    ours = ("layers", i)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      m[f"{pre}self_attn.{proj}.weight"] = (ours + ("self_attn", proj, "kernel"), True)
    if cfg.qkv_bias:
      for proj in ("q_proj", "k_proj", "v_proj"):
        m[f"{pre}self_attn.{proj}.bias"] = (ours + ("self_attn", proj, "bias"), False)
    if cfg.qk_norm:
      m[f"{pre}self_attn.q_norm.weight"] = (ours + ("self_attn", "q_norm", "weight"), False)
      m[f"{pre}self_attn.k_norm.weight"] = (ours + ("self_attn", "k_norm", "weight"), False)
    for proj in ("gate_proj", "up_proj", "down_proj"):
      m[f"{pre}mlp.{proj}.weight"] = (ours + ("mlp", proj, "kernel"), True)
    m[f"{pre}input_layernorm.weight"] = (ours + ("input_layernorm", "weight"), False)
    m[f"{pre}post_attention_layernorm.weight"] = (ours + ("post_attention_layernorm", "weight"),
                                                  False)
  return m


def _weight_files(model_dir: str) -> list[str]:
  index = os.path.join(model_dir, SAFE_INDEX)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return sorted({os.path.join(model_dir, v) for v in weight_map.values()})
  single = os.path.join(model_dir, SAFE_WEIGHTS)
  if os.path.exists(single):
    return [single]
  raise CheckpointError(f"{model_dir}: neither {SAFE_WEIGHTS} nor {SAFE_INDEX} found")


def read_safetensors(model_dir: str) -> dict[str, np.ndarray]:
  tensors: dict[str, np.ndarray] = {}
  for path in _weight_files(model_dir):
    if not os.path.exists(path):
      raise CheckpointError(f"{path}: listed in {SAFE_INDEX} but missing")
    tensors.update(_load_file_any_dtype(path))
  return tensors


def _load_file_any_dtype(path: str) -> dict[str, np.ndarray]:
  # numpy has no bfloat16; safetensors' numpy loader returns ml_dtypes.bfloat16 arrays for it.
  try:
    return safetensors.numpy.load_file(path)
  except Exception as e:  # noqa: BLE001 (SafetensorError is no ValueError; it names no file)
    raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _get_path(tree, path):
  for p in path:
    if p not in tree and "base" in tree:  # a LoRALinear: the HF tensor is its base weight
      tree = tree["base"]
    tree = tree[p]
  return tree


def load_params_into(model: Transformer, tensors: dict[str, np.ndarray], *,
                     source: str = "checkpoint") -> None:
  """Checks all tensors first, then assigns them into `model` (in the model's dtype)."""
  cfg = model.cfg
  mapping = hf_param_map(cfg)
  state = nnx.state(model, nnx.Param)
  missing = [name for name in mapping if name not in tensors]
  if missing:
    raise CheckpointError(f"{source}: missing tensor(s) {missing[:5]}"
                          + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
  ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
  unexpected = [n for n in tensors if n not in mapping and n not in ignorable
                and not n.endswith("rotary_emb.inv_freq")]
  if unexpected:
    raise CheckpointError(f"{source}: unexpected tensor(s) {unexpected[:5]} for a {cfg.arch} model "
                          f"with {cfg.num_layers} layers")
  staged = []
  for name, (path, transpose) in mapping.items():
    value = tensors[name]
    value = value.T if transpose else value
    var = _get_path(state, path)
    if value.shape != var.get_value().shape:
      want = var.get_value().shape[::-1] if transpose else var.get_value().shape
      raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                            f"the model expects {tuple(want)}")
    if not jnp.issubdtype(value.dtype, jnp.floating):  # cast silently, ids would be weights
      raise CheckpointError(f"{source}: tensor {name!r} has dtype {value.dtype}, the model "
                            "expects floating-point weights")
    staged.append((var, value))
  for var, value in staged:
    var.set_value(jnp.asarray(value, dtype=var.get_value().dtype))
  nnx.update(model, state)


def load_model(model_dir: str, *, dtype: str = "float32", seed: int = 0) -> Transformer:
  cfg = load_config(model_dir, dtype=dtype)
  # Abstract init (no random weights are computed); every parameter is then filled from disk.
  model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(seed)))
  load_params_into(model, read_safetensors(model_dir), source=model_dir)
  return model


def hf_tensors(model: Transformer, *, dtype=None) -> dict[str, np.ndarray]:
  """Our parameters under HF names (HF layout), as numpy arrays."""
  state = nnx.state(model, nnx.Param)
  out = {}
  for name, (path, transpose) in hf_param_map(model.cfg).items():
    value = np.asarray(_get_path(state, path).get_value())
    if dtype is not None:
      value = value.astype(dtype)
    out[name] = np.ascontiguousarray(value.T if transpose else value)
  return out


def _shards(tensors: dict[str, np.ndarray], max_shard_bytes: int) -> Iterator[dict]:
  shard, size = {}, 0
  for name, value in tensors.items():
    if shard and size + value.nbytes > max_shard_bytes:
      yield shard
      shard, size = {}, 0
    shard[name] = value
    size += value.nbytes
  if shard:
    yield shard


def save_model(model: Transformer, model_dir: str, *, max_shard_bytes: int | None = None) -> None:
  """Writes config.json + model.safetensors (or shards + index when max_shard_bytes is set)."""
  os.makedirs(model_dir, exist_ok=True)
  with open(os.path.join(model_dir, "config.json"), "w") as f:
    json.dump(config_to_hf(model.cfg), f, indent=2)
  tensors = hf_tensors(model)
  meta = {"format": "pt"}
  if max_shard_bytes is None:
    safetensors.numpy.save_file(tensors, os.path.join(model_dir, SAFE_WEIGHTS), metadata=meta)
    return
  shards = list(_shards(tensors, max_shard_bytes))
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    safetensors.numpy.save_file(shard, os.path.join(model_dir, fname), metadata=meta)
    weight_map.update({name: fname for name in shard})
  total = sum(v.nbytes for v in tensors.values())
  with open(os.path.join(model_dir, SAFE_INDEX), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def load_tokenizer(model_dir: str):
  """A `tokenizers.Tokenizer` from `tokenizer.json` in model_dir."""
  path = os.path.join(model_dir, "tokenizer.json")
  if not os.path.exists(path):
    raise CheckpointError(f"{model_dir}: no tokenizer.json")
  try:
    return Tokenizer.from_file(path)
  except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception naming no file)
    raise CheckpointError(f"{path}: not a readable tokenizer ({e})") from None
