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
  with pytest.raises(RuntimeError, match="no FMA"):
    ops.set_numerics("batch_invariant")
  assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_cpu_has_no_fma_contraction_in_this_process():
  """What the flag buys: a * b + c rounds twice, as written, whatever XLA fuses."""
  a, b, c = (jax.random.normal(jax.random.key(i), (4096,)) for i in range(3))
  fused = jax.jit(lambda a, b, c: a * b + c)(a, b, c)
  product = jax.jit(lambda a, b: a * b)(a, b)
  assert bool(jnp.all(fused == jax.jit(lambda p, c: p + c)(product, c)))
