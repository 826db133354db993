"""Each batch-invariant kernel (Pallas in interpret mode, and the pure-JAX blocked path) against
its independent reference, on ragged shapes, plus row-slicing invariance at the kernel level."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention as att
from pallas_kernels import logsoftmax as lsm
from pallas_kernels import matmul as mm
from pallas_kernels import rmsnorm as rms
from pallas_kernels.common import tree_sum

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
DTYPES = [jnp.float32, jnp.bfloat16]
# "pallas": the kernel as this machine runs it (compiled on GPU/TPU, interpreted on CPU);
# "pallas_gpu" / "pallas_tpu": the GPU's and the TPU's block layouts, interpreted, so their
# values and batch invariance are checked on any machine (compiling them: test_accelerator_compile).
PALLAS_IMPLS = ["pallas", "pallas_gpu", "pallas_tpu"]


def _pallas(kernel, impl, **static):
  if impl == "pallas":
    return functools.partial(kernel, **static)
  return functools.partial(kernel, interpret=True, layout=impl.removeprefix("pallas_"), **static)


def _rel_err(out, ref):
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _normal(seed, shape, dtype, scale=1.0):
  return (scale * jax.random.normal(jax.random.key(seed), shape)).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", [*PALLAS_IMPLS, "blocked_jax"])
def test_matmul_ragged(dtype, impl):
  # M, K, N not multiples of any block (32/16 rows, 128/256 K, 128 N).
  x, w = _normal(0, (37, 300), dtype), _normal(1, (300, 200), dtype)
  fn = jax.jit(mm.matmul_blocked_jax) if impl == "blocked_jax" else _pallas(mm.matmul_pallas, impl)
  out = fn(x, w)
  assert out.shape == (37, 200) and out.dtype == dtype
  assert _rel_err(out, mm.matmul_reference(x, w)) < TOL[dtype]
  full = np.asarray(out)
  for lo, hi in [(0, 1), (5, 6), (3, 20), (36, 37)]:
    np.testing.assert_array_equal(np.asarray(fn(x[lo:hi], w)), full[lo:hi])


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_matmul_one_loop_is_row_invariant(dtype):
  """The three LoRA dots in one blocked loop: right values, and a row's bits do not depend on
  how many rows came with it."""
  x, w = _normal(12, (37, 72), dtype), _normal(13, (72, 40), dtype)
  a, b = _normal(14, (72, 4), dtype), _normal(15, (4, 40), dtype)
  fn = jax.jit(mm.lora_matmul_blocked_jax)
  base, delta = fn(x, w, a, b)
  assert base.shape == delta.shape == (37, 40) and base.dtype == delta.dtype == dtype
  assert _rel_err(base, mm.matmul_reference(x, w)) < TOL[dtype]
  assert _rel_err(delta, mm.matmul_reference(mm.matmul_reference(x, a), b)) < TOL[dtype]
  for lo, hi in [(0, 1), (5, 6), (3, 20)]:
    part = fn(x[lo:hi], w, a, b)
    np.testing.assert_array_equal(np.asarray(part[0]), np.asarray(base)[lo:hi])
    np.testing.assert_array_equal(np.asarray(part[1]), np.asarray(delta)[lo:hi])

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", [*PALLAS_IMPLS, "blocked_jax"])
def test_rms_norm_ragged(dtype, impl):
  x = _normal(2, (3, 7, 300), dtype, 2.0)
  w = (1 + 0.1 * jax.random.normal(jax.random.key(3), (300,))).astype(dtype)
  fn = (jax.jit(rms.rms_norm_blocked_jax, static_argnums=2) if impl == "blocked_jax"
        else _pallas(rms.rms_norm_pallas, impl))
  out = fn(x, w, 1e-6)
  assert out.shape == x.shape and out.dtype == dtype
  assert _rel_err(out, rms.rms_norm_reference(x, w, 1e-6)) < TOL[dtype]
  np.testing.assert_array_equal(np.asarray(fn(x[1:2, 4:5], w, 1e-6)), np.asarray(out)[1:2, 4:5])


@pytest.mark.parametrize("impl", ["pallas", "blocked_jax"])
def test_log_softmax_and_token_logprobs_ragged(impl):
  logits = _normal(4, (5, 3, 1000), jnp.float32, 4.0)  # V = 1000: not a multiple of the chunk
  tokens = jax.random.randint(jax.random.key(5), (5, 3), 0, 1000)
  if impl == "pallas":
    lsm_fn, tok_fn = lsm.log_softmax_pallas, lsm.token_logprobs_pallas
  else:
    lsm_fn, tok_fn = jax.jit(lsm.log_softmax_blocked_jax), jax.jit(lsm.token_logprobs_blocked_jax)
  out = lsm_fn(logits)
  assert _rel_err(out, lsm.log_softmax_reference(logits)) < TOL[jnp.float32]
  tok = tok_fn(logits, tokens)
  assert _rel_err(tok, lsm.token_logprobs_reference(logits, tokens)) < TOL[jnp.float32]
  np.testing.assert_array_equal(np.asarray(tok_fn(logits[2:3, 1:2], tokens[2:3, 1:2])),
                                np.asarray(tok)[2:3, 1:2])
  # Exactly what the log-softmax row says at the token: one definition of log-prob.
  np.testing.assert_array_equal(
      np.asarray(tok),
      np.take_along_axis(np.asarray(out), np.asarray(tokens)[..., None], -1)[..., 0])


def _attention_inputs(dtype, B=3, T=11, H=4, K=2, D=24, S=45):
  q = _normal(6, (B, T, H, D), dtype)
  k, v = _normal(7, (B, S, K, D), dtype), _normal(8, (B, S, K, D), dtype)
  mask = jax.random.bernoulli(jax.random.key(9), 0.6, (B, T, S))
  mask = mask.at[0, 0].set(False)  # a row that sees nothing -> zeros, not NaN
  return q, k, v, mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", [*PALLAS_IMPLS, "blocked_jax"])
def test_attention_ragged_and_masks(dtype, impl):
  # T, S, D ragged w.r.t. BLOCK_Q / KV_SPLIT / TPU_KV_BLOCK, and D=24 not a power of 2.
  q, k, v, mask = _attention_inputs(dtype)
  fn = (jax.jit(att.attention_blocked_jax, static_argnames="scale") if impl == "blocked_jax"
        else _pallas(att.attention_pallas, impl))
  out = fn(q, k, v, mask, scale=0.2)
  assert out.shape == q.shape and out.dtype == dtype
  assert _rel_err(out, att.attention_reference(q, k, v, mask, 0.2)) < TOL[dtype]
  assert not np.any(np.asarray(out[0, 0], np.float32))
  full = np.asarray(out)
  # One query of one row, alone: bitwise the same.
  one = fn(q[1:2, 3:4], k[1:2], v[1:2], mask[1:2, 3:4], scale=0.2)
  np.testing.assert_array_equal(np.asarray(one), full[1:2, 3:4])
  # A longer cache whose extra slots hold garbage but are masked: more splits (and, for the
  # TPU layout, another KV block), same bits.
  extra = 40 if impl != "pallas_tpu" else att.TPU_KV_BLOCK + 40
  pad = ((0, 0), (0, extra), (0, 0), (0, 0))
  k_long, v_long = jnp.pad(k, pad, constant_values=3.0), jnp.pad(v, pad, constant_values=-7.0)
  mask_long = jnp.pad(mask, ((0, 0), (0, 0), (0, extra)))
  longer = fn(q[1:2, 3:7], k_long[1:2], v_long[1:2], mask_long[1:2, 3:7], scale=0.2)
  np.testing.assert_array_equal(np.asarray(longer), full[1:2, 3:7])



@pytest.mark.parametrize("impl", [*PALLAS_IMPLS, "blocked_jax"])
def test_causal_hint_skips_splits_with_the_same_bits(impl):
  """`causal=True` skips the key splits past each query block; the result must be the full
  loop's, bit for bit (T spans three KV splits, and one row sees no key at all)."""
  B, T = (1, att.TPU_KV_BLOCK + 18) if impl == "pallas_tpu" else (2, 70)  # >1 KV block
  q, k, v, _ = _attention_inputs(jnp.float32, B=B, T=T, S=T)
  mask = jnp.tril(jnp.ones((T, T), bool))[None] & jax.random.bernoulli(
      jax.random.key(11), 0.8, (B, T, T))
  mask = mask.at[B - 1, 40].set(False)
  fn = (jax.jit(att.attention_blocked_jax, static_argnames=("scale", "causal"))
        if impl == "blocked_jax" else _pallas(att.attention_pallas, impl))
  full = np.asarray(fn(q, k, v, mask, scale=0.2))
  np.testing.assert_array_equal(np.asarray(fn(q, k, v, mask, scale=0.2, causal=True)), full)
  assert _rel_err(full, att.attention_reference(q, k, v, mask, 0.2)) < TOL[jnp.float32]

def test_tree_sum_is_a_fixed_order():
  x = jax.random.normal(jax.random.key(10), (70, 37))
  f = jax.jit(lambda x: tree_sum(x * x, -1))
  full = np.asarray(f(x))
  np.testing.assert_allclose(full, np.sum(np.asarray(x) ** 2, -1), rtol=1e-5)
  for lo, hi in [(0, 1), (3, 5), (10, 70)]:
    np.testing.assert_array_equal(np.asarray(f(x[lo:hi])), full[lo:hi])
