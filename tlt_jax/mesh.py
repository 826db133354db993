"""Meshes from config, logical-axis rules from parameter names, shardings, sub-meshes.

Parameters get logical axes from their path (`PARAM_LOGICAL_AXES`), logical axes map to mesh
axes (`LOGICAL_TO_MESH`). A dimension that the mesh axes do not divide is replicated: that
fallback is part of the rules (`param_spec`), so tests can state exactly what each spec is.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "model")


def auto_axes(names: Sequence[str]) -> tuple[AxisType, ...]:
  """Axis types for a mesh over `names`: every mesh of the library has Auto axes (shardings are
  annotations the compiler propagates), said explicitly rather than left to JAX's default, which
  is Explicit (sharding in types) for an AbstractMesh from JAX 0.11 on; under Explicit axes an
  embedding gather has no unambiguous output sharding and tracing fails."""
  return (AxisType.Auto,) * len(names)


def default_platform() -> str | None:
  """The platform of the default device when one is set (`jax.default_device(...)`), else None
  (the default backend's)."""
  device = jax.config.jax_default_device
  if device is None:
    return None
  return device if isinstance(device, str) else device.platform


def run_devices(local: bool = False) -> list[jax.Device]:
  """The devices a run spans (all processes', or this process's with `local`): the default
  backend's, or those of the default device's platform when one is set. So a multi-device run
  can be put on a GPU machine's host devices deliberately (`--xla_force_host_platform_device_
  count=N` in XLA_FLAGS, then `with jax.default_device(jax.devices("cpu")[0]):`), and its
  kernels see the platform they run on (`pallas_kernels.common.target_platform` reads the
  same default device). `JAX_PLATFORMS=cpu` does the same for a whole process."""
  platform = default_platform()
  return list(jax.local_devices(backend=platform) if local else jax.devices(platform))


# (regex on the '/'-joined NNX path, logical axes of the array). First match wins.
PARAM_LOGICAL_AXES: tuple[tuple[str, tuple], ...] = (
    (r"embed_tokens/embedding$", ("vocab", "embed")),
    (r"lm_head/(base/)?kernel$", ("embed", "vocab")),
    (r"(q_proj|k_proj|v_proj)/(base/)?kernel$", ("embed", "heads")),
    (r"(q_proj|k_proj|v_proj)/(base/)?bias$", ("heads",)),
    (r"o_proj/(base/)?kernel$", ("heads", "embed")),
    (r"(gate_proj|up_proj)/(base/)?kernel$", ("embed", "mlp")),
    (r"down_proj/(base/)?kernel$", ("mlp", "embed")),
    # LoRA: A follows the input axis of its base, B the output axis; the rank is replicated.
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/lora_a$", ("embed", None)),
    (r"(o_proj)/lora_a$", ("heads", None)),
    (r"(down_proj)/lora_a$", ("mlp", None)),
    (r"lm_head/lora_a$", ("embed", None)),
    (r"(q_proj|k_proj|v_proj)/lora_b$", (None, "heads")),
    (r"(gate_proj|up_proj)/lora_b$", (None, "mlp")),
    (r"(o_proj|down_proj)/lora_b$", (None, "embed")),
    (r"lm_head/lora_b$", (None, "vocab")),
    (r"(norm|layernorm)/weight$", (None,)),
)

BATCH_AXES = ("data", "fsdp")  # the mesh axes a batch's rows are split over

LOGICAL_TO_MESH: dict[str | None, str | tuple[str, ...] | None] = {
    "vocab": "model", "embed": "fsdp", "heads": "model", "mlp": "model", None: None,
    "batch": BATCH_AXES,
}


def make_mesh(data: int = -1, fsdp: int = 1, model: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, model) mesh; one size may be -1 (= the remaining devices). Devices: those
  given, else all of the run's (`run_devices()`)."""
  devices = list(devices if devices is not None else run_devices())
  sizes = [data, fsdp, model]
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} model={model}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices are not divisible by the fixed mesh axes ({known})")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x model={sizes[2]} needs "
                     f"{math.prod(sizes)} devices, {len(devices)} available")
  return Mesh(np.array(devices).reshape(sizes), MESH_AXES, axis_types=auto_axes(MESH_AXES))


def mesh_from_config(mesh_cfg, devices=None) -> Mesh:
  return make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.model, devices)


def sub_mesh(mesh: Mesh, devices: Sequence[jax.Device], *, data: int = -1, fsdp: int = 1,
             model: int = 1) -> Mesh:
  """A mesh with the same axis names over a subset of `mesh`'s devices (e.g. for the drafter)."""
  outside = [d for d in devices if d not in set(mesh.devices.flat)]
  if outside:
    raise ValueError(f"devices {outside} are not in the mesh")
  return make_mesh(data, fsdp, model, devices)


def data_group_devices(mesh: Mesh, index: int) -> list[jax.Device]:
  """The devices of one data-parallel group (one index along `data`)."""
  return list(mesh.devices[index].flat)


def group_sharding(devices: Sequence[jax.Device], batch: bool = False) -> NamedSharding:
  """Everything replicated over a group's devices (or the leading axis split over them): where
  a rollout group's engine (`rollout.groups`) and the drafter trainer lent to it place arrays."""
  mesh = Mesh(np.array(list(devices)), ("data",))
  return NamedSharding(mesh, P("data") if batch else P())


def logical_axes(path: str) -> tuple:
  for pattern, axes in PARAM_LOGICAL_AXES:
    if re.search(pattern, path):
      return axes
  raise KeyError(f"no logical-axis rule for parameter {path!r}")


def param_spec(path: str, shape: tuple[int, ...], mesh: Mesh) -> P:
  axes = logical_axes(path)
  if len(axes) != len(shape):
    raise ValueError(f"rule for {path!r} has {len(axes)} axes, the array has shape {shape}")
  spec = []
  for dim, logical in zip(shape, axes):
    mesh_axis = LOGICAL_TO_MESH[logical]
    names = (mesh_axis,) if isinstance(mesh_axis, str) else (mesh_axis or ())
    size = math.prod(mesh.shape[n] for n in names)
    if mesh_axis is None or size == 1 or dim % size:
      spec.append(None)  # unsharded, or not divisible: replicate this dimension
    else:
      spec.append(mesh_axis)
  return P(*spec)


def _path_str(path) -> str:
  parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
  return "/".join(p for p in parts if p not in (".value", "value"))


def param_shardings(state, mesh: Mesh):
  """NamedShardings for an `nnx.state(model)` pytree, from the rules."""
  def one(path, leaf):
    return NamedSharding(mesh, param_spec(_path_str(path), leaf.shape, mesh))
  return jax.tree_util.tree_map_with_path(one, state)


def shard_model(model: nnx.Module, mesh: Mesh, shardings=param_shardings) -> nnx.Module:
  """Places every parameter of `model` on `mesh` per the rules, or per another
  `shardings(state, mesh)` (in place); returns the model."""
  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, shardings(state, mesh)))
  return model


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Leading (batch) axis over data x fsdp; the rest replicated."""
  return NamedSharding(mesh, P(LOGICAL_TO_MESH["batch"], *([None] * (ndim - 1))))


def shard_batch(x: jax.Array, mesh: Mesh) -> jax.Array:
  return jax.device_put(x, batch_sharding(mesh, x.ndim))


def to_local(tree):
  """The same values as process-local arrays on this process's first device: leaves of a mesh
  that spans several processes (the multi-host trainer's) are all-gathered first, so every
  process must call this together. Fully addressable leaves come back unchanged."""
  leaves, treedef = jax.tree.flatten(tree)
  spanning = [i for i, x in enumerate(leaves)
              if isinstance(x, jax.Array) and not x.is_fully_addressable]
  if not spanning:
    return tree
  replicated = tuple(NamedSharding(leaves[i].sharding.mesh, P()) for i in spanning)
  gathered = _gather_to(replicated)(tuple(leaves[i] for i in spanning))
  for i, x in zip(spanning, gathered):
    leaves[i] = x.addressable_data(0)
  return jax.tree.unflatten(treedef, leaves)


@functools.lru_cache(maxsize=16)
def _gather_to(shardings: tuple[NamedSharding, ...]):
  # One jitted gather per layout, so an RL step's gather compiles once, not at every step.
  return jax.jit(lambda xs: xs, out_shardings=shardings)
