"""Sharded forward on 8 devices (the host's on a single-accelerator machine: `on_devices`) matches
the single-device one; specs are what the rules say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tests.conftest import on_devices
from tlt_jax import mesh as mesh_lib
from tlt_jax.model import hf, lora


@pytest.fixture(scope="module", autouse=True)
def devices():
  with on_devices(8) as devices:
    yield devices


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
  from tests.conftest import _hf_model
  path = tmp_path_factory.mktemp("q3mesh")
  _hf_model("qwen3").save_pretrained(str(path))
  return str(path)


# (data, fsdp, model) -> expected spec of a few parameters in the tiny Qwen3 model
# (hidden 64, 4 heads x 24, 2 kv heads x 24, mlp 128, vocab 96).
EXPECTED = {
    (2, 1, 4): {
        "embed_tokens/embedding": P("model", None),
        "lm_head/kernel": P(None, "model"),
        "layers/0/self_attn/q_proj/kernel": P(None, "model"),
        "layers/0/self_attn/k_proj/kernel": P(None, "model"),
        "layers/0/self_attn/o_proj/kernel": P("model", None),
        "layers/1/mlp/down_proj/kernel": P("model", None),
        "layers/0/self_attn/q_norm/weight": P(None),
        "layers/0/self_attn/q_proj/lora_a": P(None, None),
        "layers/0/self_attn/q_proj/lora_b": P(None, "model"),
    },
    (1, 4, 2): {
        "embed_tokens/embedding": P("model", "fsdp"),
        "lm_head/kernel": P("fsdp", "model"),
        "layers/0/self_attn/q_proj/kernel": P("fsdp", "model"),
        "layers/0/self_attn/o_proj/kernel": P("model", "fsdp"),
        "layers/1/mlp/gate_proj/kernel": P("fsdp", "model"),
        "layers/1/mlp/down_proj/kernel": P("model", "fsdp"),
        "norm/weight": P(None),
        "layers/1/mlp/down_proj/lora_a": P("model", None),
        "layers/1/mlp/down_proj/lora_b": P(None, "fsdp"),
    },
}


def _spec_table(model):
  state = nnx.state(model)
  table = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    table[mesh_lib._path_str(path).replace("base/", "")] = leaf.sharding.spec
  return table


@pytest.mark.parametrize("shape", list(EXPECTED))
def test_sharded_forward_matches_single_device(qwen3_dir, shape, devices):
  assert len(mesh_lib.run_devices()) == 8
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 96, (4, 12)).astype(np.int32))
  single = lora.apply_lora(hf.load_model(qwen3_dir), rank=4, alpha=8.0)
  want = np.asarray(single(tokens).logits_BxTxV)

  mesh = mesh_lib.make_mesh(*shape, devices=devices)
  model = mesh_lib.shard_model(lora.apply_lora(hf.load_model(qwen3_dir), rank=4, alpha=8.0), mesh)
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t).logits_BxTxV)
  got = forward(state, mesh_lib.shard_batch(tokens, mesh))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)

  specs = _spec_table(model)
  for path, spec in EXPECTED[shape].items():
    key = path.replace("base/", "")
    # The LoRALinear keeps the base kernel under base/; the table strips it.
    assert specs[key] == spec, (path, specs[key], spec)
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    p = mesh_lib._path_str(path)
    assert leaf.sharding.spec == mesh_lib.param_spec(p, leaf.shape, mesh), p


def test_indivisible_dim_is_replicated(devices):
  mesh = mesh_lib.make_mesh(1, 1, 8, devices=devices)
  # kv projection of width 2 x 24 = 48 divides by 8; a width of 20 does not.
  assert mesh_lib.param_spec("layers/0/self_attn/k_proj/kernel", (64, 48), mesh) == P(None, "model")
  assert mesh_lib.param_spec("layers/0/self_attn/k_proj/kernel", (64, 20), mesh) == P(None, None)


def test_mesh_sizes_and_errors(devices):
  assert dict(mesh_lib.make_mesh(-1, 2, 2, devices=devices).shape) == {
      "data": 2, "fsdp": 2, "model": 2}
  with pytest.raises(ValueError, match="needs 12 devices, 8 available"):
    mesh_lib.make_mesh(3, 2, 2, devices=devices)
  with pytest.raises(ValueError, match="at most one mesh axis"):
    mesh_lib.make_mesh(-1, -1, 2, devices=devices)


def test_sub_mesh_over_one_data_group(devices):
  mesh = mesh_lib.make_mesh(4, 1, 2, devices=devices)
  group = mesh_lib.data_group_devices(mesh, 3)
  sub = mesh_lib.sub_mesh(mesh, group, data=1, fsdp=1, model=2)
  assert set(sub.devices.flat) == set(mesh.devices[3].flat) and sub.axis_names == mesh.axis_names
  x = jax.device_put(jnp.ones((4, 8)), jax.sharding.NamedSharding(sub, P(None, "model")))
  assert x.sharding.device_set == set(group)
  other = mesh_lib.make_mesh(1, 1, 2, devices=devices[:2])
  with pytest.raises(ValueError, match="not in the mesh"):
    mesh_lib.sub_mesh(other, group, data=1, fsdp=1, model=2)


def test_run_devices_follow_the_default_device(devices):
  """A multi-device run on a single-accelerator machine goes on the host's devices deliberately:
  under `jax.default_device(host device)` the library's devices are the host's, the kernels
  trace for the host, and meshes have Auto axes (JAX >= 0.11 defaults AbstractMesh and
  jax.make_mesh to Explicit axes, under which the embedding gather does not trace)."""
  from pallas_kernels import common

  host = jax.devices("cpu")
  with jax.default_device(host[0]):
    assert mesh_lib.run_devices() == host and mesh_lib.run_devices(local=True) == host
    assert mesh_lib.default_platform() == "cpu" and common.target_platform() == "cpu"
    assert mesh_lib.make_mesh(-1).devices.size == len(host)
  mesh = mesh_lib.make_mesh(2, 2, 2, devices=devices)
  assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 3


def test_too_many_rollout_groups_is_one_line_naming_the_key():
  from tlt_jax import config as config_lib
  from tlt_jax import job

  c = config_lib.default_config()
  c.rollout.groups = len(mesh_lib.run_devices(local=True)) + 1
  with pytest.raises(ValueError, match=rf"^rollout.groups={c.rollout.groups} must be 1\.\.\d+: "
                                       r"each group needs a device .*JAX_PLATFORMS=cpu[^\n]*$"):
    job.build_rollout(c, None, (0,))
