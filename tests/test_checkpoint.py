"""Checkpoints: bitwise round trip, keep-N, a killed save, errors; merged-HF and PEFT exports."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx

from tests.conftest import on_devices
from tlt_jax import ops
from tlt_jax.checkpoint import Checkpointer, CheckpointError, export_adapter, export_merged_hf
from tlt_jax.model import hf, lora
from tlt_jax.model.transformer import ModelConfig, Transformer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True, tie_embeddings=True)


def _lora_model(rank: int = 4, seed: int = 0) -> Transformer:
  return lora.apply_lora(Transformer(CFG, nnx.Rngs(0)), rank=rank, alpha=32, seed=seed)


def _abstract_lora(rank: int = 4) -> nnx.State:
  return nnx.state(nnx.eval_shape(lambda: _lora_model(rank)), nnx.LoRAParam)


def _randomise_b(model: Transformer, seed: int = 1) -> None:
  key = jax.random.key(seed)
  for i, mod in enumerate(lora.lora_modules(model).values()):
    shape = mod.lora_b[...].shape
    mod.lora_b.set_value(0.05 * jax.random.normal(jax.random.fold_in(key, i), shape))


def _tokens(shape=(2, 7)) -> jax.Array:
  return jnp.asarray(np.random.RandomState(0).randint(0, CFG.vocab_size, shape).astype(np.int32))


def _assert_trees_equal(got, want) -> None:
  got_flat, got_def = jax.tree_util.tree_flatten_with_path(got)
  want_flat, want_def = jax.tree_util.tree_flatten_with_path(want)
  assert got_def == want_def
  for (path, g), (_, w) in zip(got_flat, want_flat):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype, (jax.tree_util.keystr(path), g.dtype, w.dtype)
    np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))


def test_round_trip_is_bitwise(tmp_path):
  model = _lora_model()
  _randomise_b(model)
  params = nnx.state(model, nnx.LoRAParam)
  pure = nnx.to_pure_dict(params)
  tx = optax.adamw(1e-2, weight_decay=0.1)
  opt_state = tx.init(pure)
  grads = jax.tree.map(lambda x: jnp.sin(x * 7.0) + 0.1, pure)
  _, opt_state = tx.update(grads, opt_state, pure)
  drafter = {"w": jnp.linspace(-1, 1, 12, dtype=jnp.float32).astype(jnp.bfloat16).reshape(3, 4),
             "rng": np.arange(5, dtype=np.uint32)}
  meta = {"step": 7, "seed": 1234, "tuner": {"name": "gamma", "history": [[1, 2.5], [3, -4.0]]},
          "data": {"epoch": 2, "order": [3, 1, 2], "files": ["a.jsonl", "b.jsonl"]},
          "config": {"lr": 1e-2, "targets": ["q_proj", "v_proj"], "use_drafter": True}}
  with Checkpointer(str(tmp_path / "ckpt")) as ck:
    ck.save(7, {"params": params, "opt_state": opt_state, "drafter": drafter}, meta)
    ck.wait()
    assert ck.latest_step() == 7

  # A new Checkpointer on the same directory, as a restarted run sees it.
  abstract = {"params": _abstract_lora(), "opt_state": jax.eval_shape(tx.init, pure),
              "drafter": jax.tree.map(lambda x: x * 0, drafter)}  # concrete arrays as templates
  with Checkpointer(str(tmp_path / "ckpt")) as ck:
    state, got_meta = ck.restore(abstract)
  assert got_meta == meta
  assert isinstance(state["params"], nnx.State)
  _assert_trees_equal(nnx.to_pure_dict(state["params"]), pure)
  _assert_trees_equal(state["opt_state"], opt_state)  # NamedTuples, EmptyStates, int32 count
  assert int(state["opt_state"][0].count) == 1
  _assert_trees_equal(state["drafter"], drafter)
  # The abstract state is a template, not overwritten.
  assert isinstance(nnx.to_pure_dict(abstract["params"])["layers"][0]["mlp"]["up_proj"]["lora_a"],
                    jax.ShapeDtypeStruct)

  # The restored adapters drive a model with other adapters to the saved model's logits.
  other = _lora_model(seed=5)
  nnx.update(other, state["params"])
  np.testing.assert_array_equal(np.asarray(other(_tokens()).logits_BxTxV),
                                np.asarray(model(_tokens()).logits_BxTxV))


def test_keeps_newest_n(tmp_path):
  d = str(tmp_path / "ckpt")
  with Checkpointer(d, keep=2) as ck:
    for step in (1, 2, 3):
      ck.save(step, {"w": {"x": jnp.full((4,), step, jnp.float32)}}, {"step": step})
    ck.wait()
    assert ck.all_steps() == [2, 3]
    assert ck.latest_step() == 3
  assert sorted(p for p in os.listdir(d) if p.isdigit()) == ["2", "3"]
  with Checkpointer(d, keep=2) as ck:
    state, meta = ck.restore({"w": {"x": jax.ShapeDtypeStruct((4,), jnp.float32)}}, step=2)
  np.testing.assert_array_equal(np.asarray(state["w"]["x"]), np.full((4,), 2, np.float32))
  assert meta == {"step": 2}


def test_restores_into_the_given_sharding(tmp_path):
  with on_devices(8) as devices, Checkpointer(str(tmp_path / "ckpt")) as ck:
    mesh = jax.make_mesh((8,), ("x",), devices=devices)
    value = jnp.arange(64, dtype=jnp.float32).reshape(16, 4)
    ck.save(1, {"w": {"x": value}}, {})
    sharding = jax.NamedSharding(mesh, jax.P("x", None))
    abstract = jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=sharding)
    state, _ = ck.restore({"w": {"x": abstract}})
  assert state["w"]["x"].sharding == sharding
  np.testing.assert_array_equal(np.asarray(state["w"]["x"]), np.asarray(value))


# Saves step 1, then starts step 2 and is SIGKILLed before step 2 commits. Orbax commits a step by
# renaming `<step>.orbax-checkpoint-tmp` once every item is written; that rename is blocked here
# so the kill lands mid-save however fast the disk is.
_KILLED_SAVE = r"""
import asyncio, json, os, signal, sys, time
import jax.numpy as jnp
import numpy as np
from orbax.checkpoint._src.path import atomicity
from tlt_jax.checkpoint import Checkpointer

d = sys.argv[1]
ck = Checkpointer(d, keep=3)
ck.save(1, {"w": {"x": jnp.arange(16, dtype=jnp.float32)}}, {"step": 1})
ck.wait()

async def never_commit(self, *args, **kwargs):
  await asyncio.sleep(3600)

atomicity.AtomicRenameTemporaryPath.finalize = never_commit
big = jnp.asarray(np.random.RandomState(0).standard_normal((1024, 1024)).astype(np.float32))
ck.save(2, {"w": {"x": big}}, {"step": 2})
latest = ck.latest_step()
deadline = time.time() + 60
while not any(p.startswith("2.") for p in os.listdir(d)) and time.time() < deadline:
  time.sleep(0.02)
print(json.dumps({"latest_while_pending": latest, "entries": sorted(os.listdir(d))}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_killed_save_leaves_previous_checkpoint(tmp_path):
  d = str(tmp_path / "ckpt")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, d], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=180)
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  assert report["latest_while_pending"] == 1  # the in-flight step is not reported
  assert [e for e in report["entries"] if e.startswith("2")], report  # the kill landed mid-save
  killed = glob.glob(os.path.join(d, "2.orbax-checkpoint-tmp*"))
  assert killed and not os.path.exists(os.path.join(d, "2"))
  # The same leftover for a step the resumed run never saves again (only cleanup removes it).
  shutil.copytree(killed[0], os.path.join(d, "4" + os.path.basename(killed[0])[1:]))

  with Checkpointer(d, keep=3) as ck:
    assert ck.latest_step() == 1
    assert ck.all_steps() == [1]
    state, meta = ck.restore({"w": {"x": jax.ShapeDtypeStruct((16,), jnp.float32)}})
    np.testing.assert_array_equal(np.asarray(state["w"]["x"]), np.arange(16, dtype=np.float32))
    assert meta == {"step": 1}
    ck.save(2, {"w": {"x": jnp.full((16,), 2.0, jnp.float32)}}, {"step": 2})
    ck.wait()
    assert ck.all_steps() == [1, 2]
    state, meta = ck.restore({"w": {"x": jax.ShapeDtypeStruct((16,), jnp.float32)}})
  np.testing.assert_array_equal(np.asarray(state["w"]["x"]), np.full((16,), 2.0, np.float32))
  assert meta == {"step": 2}
  assert not glob.glob(os.path.join(d, "*.orbax-checkpoint-tmp*"))


def test_clear_errors(tmp_path):
  empty = str(tmp_path / "empty")
  with Checkpointer(empty) as ck:
    assert ck.latest_step() is None and ck.all_steps() == []
    with pytest.raises(CheckpointError, match="no checkpoint in .*empty"):
      ck.restore({"params": _abstract_lora()})
  assert issubclass(CheckpointError, ValueError)

  d = str(tmp_path / "ckpt")
  with Checkpointer(d, async_save=False) as ck:
    ck.save(1, {"params": nnx.state(_lora_model(rank=4), nnx.LoRAParam)}, {"step": 1})
    # A rank change between runs: every LoRA leaf differs; the error names entry, leaf, shapes.
    with pytest.raises(CheckpointError) as err:
      ck.restore({"params": _abstract_lora(rank=8)})
    msg = str(err.value)
    assert d in msg and "entry 'params'" in msg and "lora_a" in msg
    assert "(32, 4)" in msg and "(32, 8)" in msg
    with pytest.raises(CheckpointError, match="no entry 'drafter'"):
      ck.restore({"drafter": {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}})
    with pytest.raises(CheckpointError, match="step 5"):
      ck.restore({"params": _abstract_lora()}, step=5)
    with pytest.raises(ValueError, match="JSON"):
      ck.save(2, {}, {"bad": object()})


def test_exports(tmp_path):
  model = _lora_model()
  _randomise_b(model)
  before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
  out = str(tmp_path / "merged")
  tokens = _tokens()
  with ops.numerics_mode("xla"):
    want = np.asarray(model(tokens).logits_BxTxV)
    base = np.asarray(Transformer(CFG, nnx.Rngs(0))(tokens).logits_BxTxV)
    export_merged_hf(model, out)
    merged = hf.load_model(out)
    got = np.asarray(merged(tokens).logits_BxTxV)
  assert not lora.lora_modules(merged)
  assert np.abs(want - base).max() > 1e-3  # the adapters change the logits: the merge matters
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
  _assert_trees_equal(jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model))), before)

  ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  with torch.no_grad():
    ref_logits = ref(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits
  assert ref_logits.dtype == torch.float32
  np.testing.assert_allclose(ref_logits.numpy(), want, rtol=0, atol=1e-4)

  adapter = str(tmp_path / "adapter")
  export_adapter(model, adapter, base_model_name_or_path="tiny-qwen3")
  with open(os.path.join(adapter, "adapter_config.json")) as f:
    acfg = json.load(f)
  assert (acfg["r"], acfg["lora_alpha"], acfg["base_model_name_or_path"]) == (4, 32, "tiny-qwen3")
  tensors = safetensors.numpy.load_file(os.path.join(adapter, "adapter_model.safetensors"))
  want_tensors = lora.lora_tensors(model)
  assert sorted(tensors) == sorted(want_tensors) and len(tensors) == 2 * 7
  for name, value in want_tensors.items():
    np.testing.assert_array_equal(tensors[name], value)
