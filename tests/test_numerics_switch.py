"""The numerics switch: one place, part of the jit cache key, guarded by the XLA flags it needs."""

import os

import jax
import jax.numpy as jnp
import pytest

from tlt_jax import config as config_lib
from tlt_jax import determinism, ops


def test_mode_is_part_of_the_jit_cache_key():
  traced_under = []

  @jax.jit
  def f(x):
    traced_under.append(ops.backend())
    return ops.matmul(x, x.T)

  x = jnp.ones((3, 5))
  f(x)
  with ops.numerics_mode("batch_invariant", "blocked_jax"):
    f(x)
    f(x)
  f(x)
  assert traced_under == ["xla", "blocked_jax"]  # one trace per mode, each reused


def test_unknown_modes_are_rejected():
  with pytest.raises(ValueError, match="numerics must be one of"):
    ops.set_numerics("fast")
  with pytest.raises(ValueError, match="backend must be one of"):
    with ops.numerics_mode("batch_invariant", "triton"):
      pass
  c = config_lib.default_config()
  c.numerics_backend = "cuda"
  with pytest.raises(ValueError, match="numerics_backend='cuda'"):
    config_lib.validate(c)


def test_flags_are_required_before_the_backend_exists(monkeypatch):
  assert determinism.CPU_NO_FMA in determinism.required_flags("batch_invariant")
  assert determinism.CPU_NO_FMA not in determinism.required_flags("xla")
  # This process started with the flags (conftest): configuring again is a no-op.
  assert determinism.configure("batch_invariant") == determinism.required_flags("batch_invariant")
  # Without them, and with JAX's backend already up, it is an error that says what to do.
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  with pytest.raises(RuntimeError, match="xla_cpu_max_isa=AVX.*before the first JAX computation"):
    determinism.configure("batch_invariant")
  with jax.default_device(jax.devices("cpu")[0]), pytest.raises(RuntimeError, match="no FMA"):
    ops.set_numerics("batch_invariant")  # on CPU (the host's, on a machine with a GPU)
  assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_cpu_has_no_fma_contraction_in_this_process():
  """What the flag buys: a * b + c rounds twice, as written, whatever XLA fuses."""
  a, b, c = (jax.random.normal(jax.random.key(i), (4096,)) for i in range(3))
  fused = jax.jit(lambda a, b, c: a * b + c)(a, b, c)
  product = jax.jit(lambda a, b: a * b)(a, b)
  assert bool(jnp.all(fused == jax.jit(lambda p, c: p + c)(product, c)))


def _dot_precisions(fn, *args) -> list[str]:
  """The precision of every dot in fn's lowered program."""
  text = jax.jit(fn).lower(*args).as_text()
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  assert dots
  return [line.split("precision = [")[1].split("]")[0] if "precision = [" in line else "DEFAULT"
          for line in dots]


def test_xla_f32_matmuls_are_full_f32_unless_tf32_is_asked_for():
  """XLA runs an f32 dot as TF32 on NVIDIA GPUs unless told otherwise (HF parity at 1e-4, PEFT
  round trips and unit importance weights failed on an H200). `determinism.configure` (conftest,
  every CLI) asks for full f32; config.numerics_f32_matmul="tf32" is the named opt-in. CPU has
  no TF32, so this checks what every dot of the model's forward and backward asks XLA for."""
  from flax import nnx

  from tlt_jax.model.transformer import ModelConfig, Transformer

  assert config_lib.default_config().numerics_f32_matmul == "highest"
  assert jax.config.jax_default_matmul_precision == "highest"
  cfg = ModelConfig(arch="qwen3", vocab_size=32, hidden_size=32, intermediate_size=64,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True)
  graphdef, state = nnx.split(Transformer(cfg, nnx.Rngs(0)))
  tokens = jnp.zeros((2, 5), jnp.int32)

  def loss(state, tokens):
    return nnx.merge(graphdef, state)(tokens).logits_BxTxV.sum()

  with ops.numerics_mode("xla"):
    assert set(_dot_precisions(jax.grad(loss), state, tokens)) == {"HIGHEST, HIGHEST"}
    try:
      determinism.configure("batch_invariant", f32_matmul="tf32")
      assert jax.config.jax_default_matmul_precision == "tensorfloat32"
      assert "HIGHEST, HIGHEST" not in _dot_precisions(loss, state, tokens)
    finally:
      determinism.configure("batch_invariant")
  assert jax.config.jax_default_matmul_precision == "highest"
  with pytest.raises(ValueError, match="numerics_f32_matmul='fp16' must be one of"):
    determinism.configure("batch_invariant", f32_matmul="fp16")
  c = config_lib.default_config()
  c.numerics_f32_matmul = "bf16"
  with pytest.raises(ValueError, match="numerics_f32_matmul='bf16' must be 'highest'"):
    config_lib.validate(c)
