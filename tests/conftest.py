import contextlib
import os
import shutil
import tempfile

# 8 CPU devices for mesh tests; must be set before JAX is imported anywhere. On a machine with
# an accelerator they are its host devices, beside the default backend's (see `on_devices`).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
# The whole suite runs with the flags batch-invariant numerics need (no FMA contraction on CPU),
# and with XLA's f32 matmuls in full f32 (the default of config.numerics_f32_matmul).
from tlt_jax import determinism

determinism.configure("batch_invariant")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import pytest
import torch

_OWN_CACHE_FOLDER = pytest.StashKey[str]()


def pytest_configure(config):
  """One persistent compilation cache for the whole run, shared by the xdist workers and by the
  processes the tests start (sweep points, subprocess runs): the same programs (the smoke run's,
  the engine's bucket programs) are compiled by several modules, and on another worker or in a
  child process they load from disk instead. The controller makes the folder and names it in
  $TLT_JAX_CACHE_DIR before xdist starts its workers, which inherit it; a folder already named
  there (e.g. one kept between runs) is used as it is."""
  from tlt_jax import compile_cache

  is_xdist_worker = hasattr(config, "workerinput")
  if not is_xdist_worker and compile_cache.ENV_VAR not in os.environ:
    folder = tempfile.mkdtemp(prefix="tlt_jax_test_xla_cache-")
    os.environ[compile_cache.ENV_VAR] = folder
    config.stash[_OWN_CACHE_FOLDER] = folder
  compile_cache.configure(None)


def pytest_unconfigure(config):
  from tlt_jax import compile_cache

  folder = config.stash.get(_OWN_CACHE_FOLDER, None)
  if folder:  # made for this run (the controller's, after its workers have ended)
    shutil.rmtree(folder, ignore_errors=True)
    os.environ.pop(compile_cache.ENV_VAR, None)


# TLT_TEST_ONE_DEFAULT_DEVICE=1 simulates a single-accelerator machine on a CPU one: the default
# backend shows one device (`jax.devices()`, `jax.local_devices()`, `jax.device_count()`), while
# `jax.devices("cpu")` still has all 8 host devices, as on one GPU with the flag above. A test or
# library path that takes "all devices" without going through `on_devices` /
# `tlt_jax.mesh.run_devices` then sees one device, as it would on that GPU machine.
ONE_DEFAULT_DEVICE = os.environ.get("TLT_TEST_ONE_DEFAULT_DEVICE", "") not in ("", "0")


def _simulate_one_default_device() -> None:
  import jax

  all_devices, all_local_devices = jax.devices, jax.local_devices

  def devices(backend=None):
    return all_devices(backend) if backend is not None else all_devices()[:1]

  def local_devices(process_index=None, backend=None, host_id=None):
    found = all_local_devices(process_index, backend, host_id)
    return found if backend is not None else found[:1]

  jax.devices, jax.local_devices = devices, local_devices
  jax.device_count = lambda backend=None: len(devices(backend))
  jax.local_device_count = lambda backend=None: len(local_devices(backend=backend))


if ONE_DEFAULT_DEVICE:
  _simulate_one_default_device()


@contextlib.contextmanager
def on_devices(n: int):
  """`with on_devices(n) as devices:` n devices for a test that needs several, and the block
  runs on their platform: the default backend's devices when it has n (a CPU machine: the host
  devices asked for above), else the host devices (e.g. one GPU), made the default device for
  the block, so that the library (`tlt_jax.mesh.run_devices`: meshes, rollout groups,
  checkpoints) and the kernels (`pallas_kernels.common.target_platform`: CPU kernels, Pallas in
  interpret mode) use them too, and arrays the block creates live there. Every computation a
  test compares must run inside the block (one platform). Fewer than n host devices fails the
  test: never a silent skip."""
  import jax

  default = jax.devices()
  if len(default) >= n:
    yield default[:n]
    return
  host = jax.devices("cpu")
  if len(host) < n:
    pytest.fail(f"this test needs {n} devices: the default backend ({jax.default_backend()}) "
                f"has {len(default)}, the host {len(host)} (XLA_FLAGS "
                "--xla_force_host_platform_device_count)")
  with jax.default_device(host[0]):
    yield host[:n]

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2)


def _hf_model(kind: str):
  import transformers as tf
  torch.manual_seed(0)
  if kind == "qwen2":
    cfg = tf.Qwen2Config(**TINY, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)
    model = tf.Qwen2ForCausalLM(cfg)
  elif kind == "qwen3":
    cfg = tf.Qwen3Config(**TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                         tie_word_embeddings=False)
    model = tf.Qwen3ForCausalLM(cfg)
  elif kind == "llama":
    cfg = tf.LlamaConfig(**TINY, num_attention_heads=8, num_key_value_heads=2,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 16},
                         rope_theta=500000.0, max_position_embeddings=256)
    model = tf.LlamaForCausalLM(cfg)
  else:
    raise ValueError(kind)
  # Random biases/norm weights so that a mix-up of them cannot hide.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  return model.eval()


@pytest.fixture(scope="session", params=["qwen2", "qwen3", "llama"])
def hf_checkpoint(request, tmp_path_factory):
  """(kind, transformers model, directory with config.json + model.safetensors)."""
  model = _hf_model(request.param)
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(str(path))
  return request.param, model, str(path)


@pytest.fixture(scope="session")
def rng():
  return np.random.RandomState(0)


TINY_ARITH_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 "experiments", "configs", "tiny_arith.py")


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
  """(workdir, summary) of one RL job on tiny_arith:smoke, shared by the train / evaluate tests."""
  from tlt_jax import config as config_lib
  from tlt_jax import train

  c = config_lib.load_config_file(TINY_ARITH_CONFIG, "smoke")
  c.workdir = str(tmp_path_factory.mktemp("smoke"))
  return c.workdir, train.run(c, "tiny_arith-smoke")


# The groups that take longest (seconds summed over their tests, `pytest --durations=0` on the
# 2-core CI machine, stop 39): they start first, so no long group is left to start when the
# other worker has run out of work. Only the order depends on it: a stale list costs time, not
# correctness.
SLOWEST_GROUPS_FIRST = ("test_rollout", "smoke_run", "test_faults", "test_trainer",
                        "test_multiprocess", "test_train", "test_contracts", "test_plan",
                        "test_scheduler", "test_bad_input", "test_notebooks", "test_kernels",
                        "test_evaluate")


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
  """Groups for `pytest -n 2 --dist loadgroup`: each module's tests stay on one worker (its
  module fixtures and compiled programs are built once), and the tests of every module that
  use the session's smoke run share a worker too, so that run is trained once. The slowest
  groups come first (xdist hands groups out in collection order)."""
  def group(item) -> str:
    return "smoke_run" if "smoke_run" in item.fixturenames else item.module.__name__

  for item in items:
    item.add_marker(pytest.mark.xdist_group(group(item)))
  rank = {g: i for i, g in enumerate(SLOWEST_GROUPS_FIRST)}
  items.sort(key=lambda item: rank.get(group(item), len(rank)))  # stable: order kept
