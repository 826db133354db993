"""Ahead-of-time compiles for TPU v4 / v5e / v5p / v6e and H100 on a CPU (`pallas_kernels.targets`).

Every Pallas kernel at realistic shapes, compiled standalone (one case per shape), and the
programs that run them (prefill, decode, verify, the drafter's and the policy's train steps of
small Qwen2 / Qwen3 / Llama models; one decoder layer at Qwen2.5-7B and -32B shapes) under
`ops.numerics_mode("batch_invariant", "pallas")`, for each target. A test id names the kernel or
program, its shapes and the target, e.g.
`test_kernel[attention-decode-bf16-B8-T1-H28-K4-D128-S32768-h100]`.

Targets this environment cannot build (a wheel of `requirements-accel.txt` missing) are skipped
with the reason, or fail when `TLT_REQUIRE_ACCEL_COMPILE=1` (CI's compile-check step sets it):

    pip install -q --no-deps --upgrade --target /tmp/tlt-accel -r requirements-accel.txt
    PYTHONPATH=/tmp/tlt-accel JAX_PLATFORMS=cpu TLT_REQUIRE_ACCEL_COMPILE=1 \
        python -m pytest tests/test_accelerator_compile.py -q -p no:cacheprovider

About 3.5 minutes on 2 CPU cores in one process (287 compiles; XLA's compiles use both cores,
so `-n 2` does not help): every head_dim, GQA ratio and attention path on every target, dtypes
and row counts spread over the cases rather than crossed, and the programs spread over the
targets (see `_program_params`, `PAPER_LAYERS`).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from pallas_kernels import targets as targets_lib
from tlt_jax import ops

REQUIRE = os.environ.get("TLT_REQUIRE_ACCEL_COMPILE", "") not in ("", "0")
S = jax.ShapeDtypeStruct
F32, I32, BOOL = jnp.float32, jnp.int32, jnp.bool_


@functools.cache
def _available() -> dict[str, str | None]:
  return targets_lib.available_targets()


def _need(target: str) -> None:
  """Skips (or, with TLT_REQUIRE_ACCEL_COMPILE=1, fails) a test whose target is not buildable."""
  reason = _available()[target]
  if reason is not None:
    message = f"{target} cannot be built here: {reason}"
    if REQUIRE:
      pytest.fail(f"{message} (TLT_REQUIRE_ACCEL_COMPILE=1)")
    pytest.skip(message)


TARGETS = list(targets_lib.TARGETS)


def _on(cases, targets=TARGETS):
  """(case, target) parameters, ids '<case>-<target>'."""
  return [pytest.param(c, t, id=f"{c.id}-{t}") for c in cases for t in targets]


# ---------------------------------------------------------------------------------------------
# Kernels, standalone


KERNEL_CASES = targets_lib.kernel_cases()


@pytest.mark.parametrize("case,target", _on(KERNEL_CASES))
def test_kernel(case: targets_lib.KernelCase, target: str):
  """Every kernel standalone at each shape of `targets.kernel_cases()`, on every target."""
  _need(target)
  case.compile(target)


# ---------------------------------------------------------------------------------------------
# Programs of small models: what the engine, the drafter trainer and the RL trainer compile


def _tiny_config(arch: str):
  """The HF test models of tests/conftest.py (`_hf_model`), as tlt_jax configs."""
  from tlt_jax.model.transformer import ModelConfig, RopeScaling

  tiny = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2)
  if arch == "qwen2":
    return ModelConfig(arch="qwen2", **tiny, num_heads=4, num_kv_heads=2, head_dim=16,
                       qkv_bias=True, tie_embeddings=True)
  if arch == "qwen3":
    return ModelConfig(arch="qwen3", **tiny, num_heads=4, num_kv_heads=2, head_dim=24,
                       qk_norm=True)
  return ModelConfig(arch="llama", **tiny, num_heads=8, num_kv_heads=2, head_dim=8,
                     rope_theta=500000.0, max_position_embeddings=256,
                     rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16))


@functools.cache
def _tiny_models(arch: str):
  from tlt_jax.model.drafter import Drafter
  from tlt_jax.model.transformer import Transformer

  cfg = _tiny_config(arch)
  return Transformer(cfg, nnx.Rngs(0)), Drafter(cfg, nnx.Rngs(1))


def _engine_program(arch: str, phase: str, target: str):
  """The rollout engine's own program (`ProgramPool._lower`), its parameters abstract on the
  target's device: prefill, plain decode, chain verify (drafter included), tree verify, or a
  lookup chunk (drafts searched on device, verified as a chain or a tree, alone or with the
  learned drafter's chain), or a history tree round (its chains an input)."""
  from tlt_jax.rollout.config import EngineConfig
  from tlt_jax.rollout.programs import ProgramPool
  from tlt_jax.rollout.tuner import (OFF, Arm, combined_arm, history_tree_arm, lookup_arm,
                                     lookup_tree_arm, tree_arm)

  model, drafter = _tiny_models(arch)
  arms = {"decode": Arm(OFF), "verify_chain": Arm("chain4", 4),
          "verify_tree": tree_arm(3, 2, 5), "verify_lookup": lookup_arm(4),
          "verify_lookup_tree": lookup_tree_arm(3, 2), "verify_combined": combined_arm(3, 2),
          "verify_history_tree": history_tree_arm(3, 2)}
  arm = arms.get(phase, Arm(OFF))
  cfg = EngineConfig(buckets=(4,), max_prompt_len=16, max_new_tokens=32, chunk_steps=4,
                     arms=(Arm(OFF), arm) if arm.depth else (arm,), drafter_numerics="policy")
  pool = ProgramPool(model, drafter, cfg, {4: [a.name for a in cfg.arms]})
  device = targets_lib.abstract_device(target)
  pool.params = targets_lib.on_device(pool.params, device)
  pool.draft_params = targets_lib.on_device(pool.draft_params, device)
  key = ("prefill", 4, 0) if phase == "prefill" else ("decode", 4, arm.name)
  with targets_lib.target_context(target):
    lowered = pool._lower(key)  # noqa: SLF001 (the Lowered: its Pallas calls are counted)
  return lowered


def _drafter_step(arch: str):
  """`drafter_trainer.train_step` (EAGLE loss, its gradient, the AdamW update) as a function of
  the drafter's, the optimizer's and the target's state."""
  from tlt_jax.tlt import drafter_trainer

  model, drafter = _tiny_models(arch)
  drafter = nnx.clone(drafter)
  optimizer = drafter_trainer.make_optimizer(drafter)
  (d_graph, d_state), (o_graph, o_state), (t_graph, t_state) = (
      nnx.split(drafter), nnx.split(optimizer), nnx.split(model))

  def step(d_state, o_state, t_state, tokens, hidden, mask):
    d, o, t = nnx.merge(d_graph, d_state), nnx.merge(o_graph, o_state), nnx.merge(t_graph, t_state)
    metrics = drafter_trainer.train_step(d, o, t, tokens, hidden, mask)
    return nnx.state(d), nnx.state(o), metrics

  B, T, D = 4, 32, model.cfg.hidden_size
  return step, (d_state, o_state, t_state, S((B, T), I32), S((B, T, D), F32), S((B, T), BOOL))


def _train_step(arch: str):
  """The RL trainer's gradient program (`StepFunctions.grad`: GRPO loss over one chunk, LoRA)."""
  from tlt_jax.model import lora
  from tlt_jax.rl import trainer as trainer_lib

  model = nnx.clone(_tiny_models(arch)[0])
  lora.apply_lora(model, rank=4, alpha=8.0)
  graphdef, trainable, frozen = nnx.split(model, nnx.LoRAParam, ...)
  fns = trainer_lib.StepFunctions(trainer_lib.TrainConfig(chunk_rows=4), graphdef)
  R, L = 4, 32

  def grad(trainable, frozen, weight, tokens, mask, sampler_logp, adv):
    return fns.grad(trainable, frozen, None, weight, tokens, mask, sampler_logp, adv,
                    None, None, None)

  return grad, (trainable, frozen, S((), F32), S((R, L), I32), S((R, L - 1), BOOL),
                S((R, L - 1), F32), S((R,), F32))


ARCHS = ("qwen2", "qwen3", "llama")
PROGRAMS = ("prefill", "decode", "verify_chain", "drafter_train", "rl_train")


def _program_params():
  """Every program on every target, the architecture rotating with the target, so each
  (architecture, program) pair compiles on at least one TPU generation, and the tree verify
  (its drafting and per-query cache layouts: the slowest program) on one TPU. The kernels'
  shapes per architecture are in KERNEL_CASES for every target; what a program adds is the
  glue around them (Pallas calls in while loops, custom VJPs, gathers of the cache)."""
  params = []
  for i, target in enumerate(TARGETS):
    for j, program in enumerate(PROGRAMS):
      arch = ARCHS[(i + j) % len(ARCHS)]
      params.append(pytest.param(arch, program, target, id=f"{arch}-{program}-{target}"))
  params.append(pytest.param("qwen3", "verify_tree", "tpu_v6e", id="qwen3-verify_tree-tpu_v6e"))
  # The lookup arms' chunks: drafts searched on device (a scan over corpus blocks) between
  # verifies, the bank of recent responses an input, verified as a chain, as the tree of
  # several chains, or with the learned drafter's chain (combined); and the history drafter's
  # tree round (its chains from the host); each once on a TPU, once on the GPU.
  params += [pytest.param(arch, program, target, id=f"{arch}-{program}-{target}")
             for program in ("verify_lookup", "verify_lookup_tree", "verify_combined",
                             "verify_history_tree")
             for arch, target in (("qwen2", "tpu_v5e"), ("llama", "h100"))]
  return params


@pytest.mark.parametrize("arch,program,target", _program_params())
def test_small_model_program(arch: str, program: str, target: str):
  """The program as its module builds it, under batch-invariant numerics with the Pallas
  kernels: it must hold Pallas calls (not the interpreted or XLA path) and compile."""
  _need(target)
  label = f"{arch}-{program}"
  with ops.numerics_mode("batch_invariant", "pallas"):
    if program in ("drafter_train", "rl_train"):
      fn, specs = _drafter_step(arch) if program == "drafter_train" else _train_step(arch)
      targets_lib.compile_for(target, fn, *specs, label=label, min_pallas_calls=1)
      return
    try:
      lowered = _engine_program(arch, program, target)
    except Exception as e:
      raise targets_lib.TargetCompileError(
          f"{label} on {target}: lowering failed: {targets_lib.first_line(e)}") from e
    targets_lib.compile_lowered(target, lowered, f"{label} on {target}", min_pallas_calls=1)


# ---------------------------------------------------------------------------------------------
# Paper-scale layer shapes (experiments/configs): one decoder layer, bf16


PAPER_MODELS = {
    # qwen2_5_7b_8gpu.py / r1_distill_qwen_7b_v5p64.py
    "qwen2.5-7b": dict(arch="qwen2", vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_layers=1, num_heads=28, num_kv_heads=4,
                       head_dim=128, qkv_bias=True, rope_theta=1e6, dtype="bfloat16"),
    # qwen2_5_32b_multihost.py
    "qwen2.5-32b": dict(arch="qwen2", vocab_size=152064, hidden_size=5120,
                        intermediate_size=27648, num_layers=1, num_heads=40, num_kv_heads=8,
                        head_dim=128, qkv_bias=True, rope_theta=1e6, rms_eps=1e-5,
                        dtype="bfloat16"),
}
# (model, phase, bucket rows, new tokens, context, targets). The context is prompt + response +
# the decode window (tree8_4_32's 33 slots), as `EngineConfig.num_slots` counts it; the cache
# has that many slots rounded up to the target's `ops.kv_cache_multiple()`. Prompts of 1024 into
# a 1K + 8K cache, decode at a few buckets, r1-distill's 24K responses, and tree8_4_32's verify
# (32 tokens, each query its own cache layout). The slowest (the tree verify and the 32B
# prefill: 8-15 s on a TPU) run on one TPU generation and the H100.
CTX_8K = 1024 + 8192 + 33
CTX_24K = 1024 + 24576 + 33
PAPER_LAYERS = [
    ("qwen2.5-7b", "prefill", 1, 1024, CTX_8K, TARGETS),
    ("qwen2.5-7b", "decode", 64, 1, CTX_8K, TARGETS),
    ("qwen2.5-7b", "decode", 8, 1, CTX_24K, TARGETS),
    ("qwen2.5-32b", "decode", 32, 1, CTX_8K, TARGETS),
    ("qwen2.5-7b", "decode", 1, 1, CTX_8K, ["tpu_v4", "h100"]),
    ("qwen2.5-7b", "verify_tree", 16, 32, CTX_8K, ["tpu_v5p", "h100"]),
    ("qwen2.5-32b", "prefill", 1, 1024, CTX_8K, ["tpu_v6e", "h100"]),
]


def _layer_program(model: str, phase: str, B: int, T: int, num_slots: int):
  """One decoder layer of the model, abstract (no weights), as a function of its state: T new
  tokens of B rows written into a cache of `num_slots`, then attended over all of it."""
  from tlt_jax.model.transformer import DecoderLayer, ModelConfig

  cfg = ModelConfig(**PAPER_MODELS[model])
  layer = nnx.eval_shape(lambda: DecoderLayer(cfg, nnx.Rngs(0)))
  graphdef, state = nnx.split(layer)
  dt, Kv, hd, D = cfg.jnp_dtype, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
  tree = phase == "verify_tree"

  def fn(state, x, positions, mask, cache_k, cache_v, write_slot, kv_index):
    out, ck, cv = nnx.merge(graphdef, state)(x, positions, mask, cache_k, cache_v, write_slot,
                                             kv_index)
    return out, ck, cv

  cache = S((B, num_slots, Kv, hd), dt)
  specs = (state, S((B, T, D), dt), S((B, T), I32), S((B, T, num_slots), BOOL), cache, cache,
           S((B,), I32), S((B, T, num_slots), I32) if tree else None)
  return fn, specs


@pytest.mark.parametrize("layer,target", [
    pytest.param(p[:5], t, id=f"{p[0]}-{p[1]}-B{p[2]}-T{p[3]}-ctx{p[4]}-{t}")
    for p in PAPER_LAYERS for t in p[5]])
def test_paper_scale_layer(layer, target: str):
  _need(target)
  model, phase, B, T, context = layer
  with targets_lib.target_context(target):
    num_slots = -(-context // ops.kv_cache_multiple()) * ops.kv_cache_multiple()
  fn, specs = _layer_program(model, phase, B, T, num_slots)
  with ops.numerics_mode("batch_invariant", "pallas"):
    targets_lib.compile_for(target, fn, *specs, min_pallas_calls=1,
                            label=f"{model}-layer-{phase}-B{B}-T{T}-S{num_slots}")


@pytest.mark.parametrize("target", ["tpu_v5e", "h100"])
def test_paper_scale_lookup_search(target: str):
  """The lookup arm's draft search (`steps._lookup_drafts`) at 64 rows, a bank of 16 and a
  1K prompt + 32K response: compiles for the target, its scratch within a few corpus blocks
  (the whole corpus compared at once would need ~0.7 GB per tensor per round)."""
  from tlt_jax.rollout import steps

  _need(target)
  B, P, N, H = 64, 1024, 32768, 16
  s = steps.Slots(cache=None, draft_cache=None, token=S((B,), I32), pos=S((B,), I32),
                  prev_hidden=S((B, 1), F32), sample_id=S((B,), I32), gen=S((B,), I32),
                  max_new=S((B,), I32), done=S((B,), BOOL), live=S((B,), BOOL),
                  out_tokens=S((B, N), I32), out_logprobs=S((B, N), F32),
                  out_hidden=S((B, N, 1), F32), prompt_tokens=S((B, P), I32))
  compiled = targets_lib.compile_for(target, steps._lookup_drafts, s, S((H, N), I32),
                                     S((H,), I32), depth=4, max_order=4,
                                     label="lookup-search-B64-ctx33K")
  scratch = compiled.memory_analysis().temp_size_in_bytes
  assert scratch < 16 * steps.LOOKUP_BLOCK_ELEMENTS * 4, f"{target}: {scratch} bytes of scratch"


@pytest.mark.parametrize("target", TARGETS)
def test_target_platform_follows_the_abstract_device(target: str):
  """Under the target's default device the kernels pick its code path: Pallas, not interpreted,
  with the target's block layout (what the AOT compiles above rely on)."""
  from pallas_kernels import common

  _need(target)
  expected = "tpu" if targets_lib.TARGETS[target].platform == "tpu" else "gpu"
  with targets_lib.target_context(target):
    assert common.target_platform() == expected
    assert not common.default_interpret()
    assert common.kernel_layout(None, False) == expected
    with ops.numerics_mode("batch_invariant"):
      assert ops.backend() == "pallas"


def test_gpu_kernels_lower_to_triton_as_a_run_sets_up():
  """A real run gets whatever Pallas lowering the process configured (tests/conftest.py
  configures it as `tlt_jax.train` does). JAX 0.10's Pallas GPU default is Mosaic GPU, where
  these kernels do not compile (shared memory, copy sizes), so the kernels ask for Triton
  themselves (`common.compiler_params`): with the process default, they still lower to Triton."""
  _need("h100")
  case = next(c for c in KERNEL_CASES if c.id.startswith("rms_norm-hidden-bf16"))
  device = targets_lib.abstract_device("h100")
  where = (f"{case.id} on h100 as configured (jax_pallas_use_mosaic_gpu="
           f"{jax.config.jax_pallas_use_mosaic_gpu})")
  try:
    with targets_lib.target_context("h100"):
      lowered = jax.jit(functools.partial(case.fn, **case.static)).lower(
          *targets_lib.on_device(case.specs, device))
  except Exception as e:  # noqa: BLE001
    pytest.fail(f"{where}: lowering failed: {targets_lib.first_line(e)}")
  assert targets_lib.pallas_calls("h100", lowered) > 0, f"{where}: no Triton call"
