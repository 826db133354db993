"""LoRA on any linear: y = W x (+ b) + (alpha / r) B A x, A ~ U(+-1/sqrt(d_in)), B = 0.

Adapters are `nnx.LoRAParam` variables, so a filter (or the optax mask below) separates them from
the frozen base. PEFT interop: `export_peft` / `import_peft` read and write
`adapter_config.json` + `adapter_model.safetensors` with PEFT's tensor names and layouts.
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import safetensors.numpy
from flax import nnx

from tlt_jax import ops
from tlt_jax.model.transformer import Linear, Transformer

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTN_TARGETS + MLP_TARGETS + ("lm_head",)


class LoRALinear(nnx.Module):

  def __init__(self, base: Linear, rank: int, alpha: float, rngs: nnx.Rngs):
    self.base = base
    dtype = base.kernel[...].dtype
    bound = 1.0 / math.sqrt(base.d_in)
    self.lora_a = nnx.LoRAParam(jax.random.uniform(
        rngs.params(), (base.d_in, rank), jnp.float32, -bound, bound).astype(dtype))
    self.lora_b = nnx.LoRAParam(jnp.zeros((rank, base.d_out), dtype))
    self.scale = alpha / rank
    self.rank, self.alpha = rank, alpha
    self.d_in, self.d_out = base.d_in, base.d_out

  def __call__(self, x: jax.Array) -> jax.Array:
    y, delta = ops.lora_matmul(x, self.base.kernel[...], self.lora_a[...], self.lora_b[...])
    if self.base.bias is not None:
      y = y + self.base.bias[...]
    return y + (self.scale * delta).astype(x.dtype)


def _check_targets(targets) -> None:
  unknown = [t for t in targets if t not in ALL_TARGETS]
  if unknown:
    raise ValueError(f"unknown LoRA target(s) {unknown}; choose from {ALL_TARGETS}")


def apply_lora(model: Transformer, *, rank: int, alpha: float, targets=ATTN_TARGETS + MLP_TARGETS,
               seed: int = 0) -> Transformer:
  """Wraps the targeted linears of `model` in place; returns it."""
  _check_targets(targets)
  if rank <= 0:
    raise ValueError(f"LoRA rank must be positive, got {rank}")
  rngs = nnx.Rngs(seed)
  for layer in model.layers:
    for parent in (layer.self_attn, layer.mlp):
      for name in targets:
        base = getattr(parent, name, None)
        if isinstance(base, Linear):
          setattr(parent, name, LoRALinear(base, rank, alpha, rngs))
  if "lm_head" in targets:
    if model.lm_head is None:
      raise ValueError("lm_head LoRA needs an untied lm_head (this model ties it to the embedding)")
    model.lm_head = LoRALinear(model.lm_head, rank, alpha, rngs)
  return model


def lora_modules(model: Transformer) -> dict[str, LoRALinear]:
  """HF-style module name -> LoRALinear, e.g. 'model.layers.0.self_attn.q_proj'."""
  out = {}
  for i, layer in enumerate(model.layers):
    for group, parent in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
      for name in ATTN_TARGETS + MLP_TARGETS:
        mod = getattr(parent, name, None)
        if isinstance(mod, LoRALinear):
          out[f"model.layers.{i}.{group}.{name}"] = mod
  if isinstance(model.lm_head, LoRALinear):
    out["lm_head"] = model.lm_head
  return out


def trainable_mask(params_state) -> object:
  """A pytree of bools over `nnx.state(model, nnx.Param)`: True only at LoRA parameters."""
  return jax.tree_util.tree_map(lambda v: isinstance(v, nnx.LoRAParam), params_state,
                                is_leaf=lambda v: isinstance(v, nnx.Variable))


def masked_optimizer(tx: optax.GradientTransformation,
                     params_state) -> optax.GradientTransformation:
  """`tx` on LoRA parameters; frozen (zero update, no optimizer state) everywhere else."""
  labels = jax.tree_util.tree_map(lambda v: "lora" if v else "frozen", trainable_mask(params_state))
  return optax.multi_transform({"lora": tx, "frozen": optax.set_to_zero()}, labels)


# ---------------------------------------------------------------------------------------------
# LoRA-only save/load and the PEFT format


def lora_tensors(model: Transformer) -> dict[str, np.ndarray]:
  """PEFT names and layouts: lora_A.weight is [r, d_in], lora_B.weight is [d_out, r]."""
  out = {}
  for name, mod in lora_modules(model).items():
    out[f"base_model.model.{name}.lora_A.weight"] = np.ascontiguousarray(
        np.asarray(mod.lora_a[...]).T)
    out[f"base_model.model.{name}.lora_B.weight"] = np.ascontiguousarray(
        np.asarray(mod.lora_b[...]).T)
  return out


def _lora_info(model: Transformer) -> tuple[int, float, list[str]]:
  mods = lora_modules(model)
  if not mods:
    raise ValueError("model has no LoRA adapters (call apply_lora first)")
  first = next(iter(mods.values()))
  targets = sorted({name.rsplit(".", 1)[-1] for name in mods})
  return first.rank, first.alpha, targets


def export_peft(model: Transformer, out_dir: str, *, base_model_name_or_path: str = "") -> None:
  rank, alpha, targets = _lora_info(model)
  os.makedirs(out_dir, exist_ok=True)
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base_model_name_or_path}
  with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  safetensors.numpy.save_file(lora_tensors(model),
                              os.path.join(out_dir, "adapter_model.safetensors"),
                              metadata={"format": "pt"})


def import_peft(model: Transformer, adapter_dir: str, *, seed: int = 0) -> Transformer:
  """Adds the adapter in `adapter_dir` to a base model without LoRA (or fills existing adapters)."""
  cfg_path = os.path.join(adapter_dir, "adapter_config.json")
  with open(cfg_path) as f:
    acfg = json.load(f)
  if acfg.get("peft_type", "LORA") != "LORA":
    raise ValueError(f"{cfg_path}: peft_type={acfg.get('peft_type')!r} is not LORA")
  for flag in ("use_rslora", "use_dora"):
    if acfg.get(flag):
      raise ValueError(f"{cfg_path}: {flag}=true is not supported")
  if acfg.get("rank_pattern") or acfg.get("alpha_pattern"):
    raise ValueError(f"{cfg_path}: per-module rank_pattern / alpha_pattern are not supported")
  targets = acfg["target_modules"]
  targets = [targets] if isinstance(targets, str) else list(targets)
  if not lora_modules(model):
    apply_lora(model, rank=int(acfg["r"]), alpha=float(acfg["lora_alpha"]), targets=targets,
               seed=seed)
  tensors = safetensors.numpy.load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
  # PEFT saves without the adapter name; some tools keep '.default'.
  tensors = {k.replace(".default.", "."): v for k, v in tensors.items()}
  _fill_lora(model, tensors, adapter_dir)
  return model


def _fill_lora(model: Transformer, tensors: dict[str, np.ndarray], source: str) -> None:
  """Checks every adapter tensor against the model, then assigns (PEFT layouts -> ours)."""
  tensors = dict(tensors)
  staged = []
  for name, mod in lora_modules(model).items():
    for attr, key, want in (("lora_a", "lora_A", (mod.d_in, mod.rank)),
                            ("lora_b", "lora_B", (mod.rank, mod.d_out))):
      tname = f"base_model.model.{name}.{key}.weight"
      if tname not in tensors:
        raise ValueError(f"{source}: missing tensor {tname!r}")
      value = tensors.pop(tname).T
      if value.shape != want:
        raise ValueError(f"{source}: tensor {tname!r} has shape {value.T.shape}, the model "
                         f"expects {want[::-1]}")
      staged.append((getattr(mod, attr), value))
  if tensors:
    raise ValueError(f"{source}: unexpected tensor(s) {sorted(tensors)[:5]}")
  for var, value in staged:
    var.set_value(jnp.asarray(value, var[...].dtype))


def save_lora(model: Transformer, path: str) -> None:
  """LoRA-only checkpoint (PEFT names) as one safetensors file."""
  rank, alpha, _ = _lora_info(model)
  safetensors.numpy.save_file(lora_tensors(model), path,
                              metadata={"rank": str(rank), "alpha": str(alpha)})


def load_lora(model: Transformer, path: str) -> Transformer:
  _fill_lora(model, safetensors.numpy.load_file(path), path)
  return model
