"""Training checkpoints (Orbax), and the exports of a finished run: merged HF model, PEFT adapter.

A checkpoint step is one Orbax step directory: one StandardSave item per `state` entry (params,
opt_state, drafter, ...) and a JSON item `meta` (tuner, data iterator, RNG counters, config).
Orbax writes a step under `<step>.orbax-checkpoint-tmp` and renames it when every item is
durable, so a run killed mid-save leaves the previous step intact; only committed steps count.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from tlt_jax import mesh as mesh_lib
from tlt_jax.model import hf, lora
from tlt_jax.model.transformer import Transformer

META = "meta"


class CheckpointError(hf.CheckpointError):
  """No checkpoint to restore, or one that does not fit the state it is restored into.

  A ValueError; a subclass of hf.CheckpointError, so one except clause covers both formats."""


# ---------------------------------------------------------------------------------------------
# nnx.State <-> pure dicts: Orbax sees plain nested dicts, callers keep their nnx.State.


def _is_state(x) -> bool:
  return isinstance(x, nnx.State)


def _to_pure(tree):
  return jax.tree.map(lambda x: nnx.to_pure_dict(x) if _is_state(x) else x, tree, is_leaf=_is_state)


def _from_pure(abstract, restored):
  """`restored` (pure dicts where `abstract` has nnx.States) back into abstract's containers."""
  nodes, treedef = jax.tree.flatten(abstract, is_leaf=_is_state)
  out = []
  for node, value in zip(nodes, treedef.flatten_up_to(restored)):
    if _is_state(node):
      # replace_by_pure_dict updates in place: fill a copy, never the caller's abstract state.
      node = jax.tree.map(lambda x: x, node)
      nnx.replace_by_pure_dict(node, value)
      value = node
    out.append(value)
  return treedef.unflatten(out)


def _restore_target(leaf):
  # A concrete array stands for its shape, dtype and sharding (restore never reads its values).
  if isinstance(leaf, jax.Array):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
  return leaf


# Several processes: Orbax writes global arrays. Arrays that already span the processes (the
# trainer's, sharded over the run's whole mesh) are saved and restored as they are. State that
# lives per process (each holds the same values on its own devices: the drafter, averaged at
# every barrier) is saved as one array replicated over all processes' devices (process 0's copy
# is written) and restored onto the devices it came from.


def _replicated_everywhere() -> jax.sharding.NamedSharding:
  # The run's devices (the default device's platform when one is set: a run on a GPU machine's
  # host devices saves its per-process state from and to those, not the GPU).
  mesh = jax.sharding.Mesh(np.array(mesh_lib.run_devices()), ("all",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _to_global(x):
  if not isinstance(x, jax.Array) or not x.is_fully_addressable:
    return x
  sharding = _replicated_everywhere()
  local = x.addressable_data(0)
  shards = [jax.device_put(local, d) for d in sharding.addressable_devices]
  return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def _process_local(leaf) -> bool:
  return isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding.is_fully_addressable


def _global_target(leaf):
  if _process_local(leaf):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=_replicated_everywhere())
  return leaf


def _to_local(restored, target):
  if isinstance(restored, jax.Array) and _process_local(target):
    return jax.device_put(restored.addressable_data(0), target.sharding)
  return restored


def _key_str(k) -> str:
  # Orbax's metadata turns tuples into lists and NamedTuples (optax states) into dicts keyed by
  # field name, so paths are compared as strings: index, field name or dict key alike.
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _flat_by_path(tree) -> dict[str, Any]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {"/".join(_key_str(k) for k in path): leaf for path, leaf in flat}


def _first(items: list[str], n: int = 5) -> str:
  return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


# ---------------------------------------------------------------------------------------------
# Checkpointer


class Checkpointer:
  """Orbax CheckpointManager: async saves, keep the newest `keep`, atomic per step."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    if keep < 1:
      raise ValueError(f"keep must be at least 1, got {keep}")
    self.directory = os.path.abspath(os.fspath(directory))
    self._name_format = ocp.step.standard_name_format()
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
        step_name_format=self._name_format,
        enable_async_checkpointing=async_save,
        # A run killed mid-save leaves `<step>.orbax-checkpoint-tmp` (never listed as a step);
        # without this it stays on disk for good unless that very step is saved again.
        cleanup_tmp_directories=True,
        create=True)
    self._mngr = ocp.CheckpointManager(self.directory, options=options)
    self._async = async_save
    self._pending: int | None = None  # the step of an async save not yet known to be committed

  # -- saving

  def save(self, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Starts writing `state` (name -> pytree of arrays) and `meta` (JSON) as `step`.

    Returns once the arrays are copied to host (async) or written (sync); the caller may then
    donate or overwrite them. A previous pending save is waited for first.
    """
    self.wait()
    step = int(step)
    items = {}
    for name, tree in state.items():
      if not isinstance(name, str) or not name or name == META or name[0] in "._" or "/" in name:
        raise ValueError(f"state entry name {name!r} is not usable as a checkpoint item name "
                         f"(non-empty, no '/', no leading '.' or '_', not {META!r})")
      pure = _to_pure(tree)
      if jax.process_count() > 1:
        pure = jax.tree.map(_to_global, pure)
      items[name] = ocp.args.StandardSave(pure)
    try:
      # A copy taken now: the JSON is written in the background, after the caller has moved on
      # and possibly mutated its tuner / iterator state dicts. Also rejects non-JSON values here
      # instead of in the writer thread.
      meta = json.loads(json.dumps(meta))
    except (TypeError, ValueError) as e:
      raise ValueError(f"checkpoint meta for step {step} is not JSON-serialisable: {e}") from None
    items[META] = ocp.args.JsonSave(meta)
    self._mngr.save(step, args=ocp.args.Composite(**items), force=True)
    if self._async:
      self._pending = step

  def wait(self) -> None:
    """Blocks until pending saves are committed; raises the error of a failed one."""
    try:
      self._mngr.wait_until_finished()
    finally:
      self._pending = None  # committed, or failed and dropped from Orbax's list

  # -- listing

  def all_steps(self) -> list[int]:
    """Committed steps, oldest first (not a save still in flight)."""
    if self._pending is not None and not self._mngr.is_saving_in_progress():
      self.wait()  # it has finished: raises its error if it failed
    steps = sorted(int(s) for s in self._mngr.all_steps())
    # Orbax lists a step as soon as its save starts; it is not a checkpoint until committed.
    if self._pending is not None:
      steps = [s for s in steps if s != self._pending]
    return steps

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  # -- restoring

  def _step_dir(self, step: int) -> epath.Path:
    return epath.Path(self.directory) / self._name_format.build_name(step)

  def _check_entry(self, step: int, name: str, target) -> None:
    """Compares `target` with the saved metadata: Orbax's own errors name neither the entry nor
    the leaf."""
    where = f"{self.directory} step {step}: entry {name!r}"
    handler = ocp.StandardCheckpointHandler()
    try:
      saved_meta = handler.metadata(self._step_dir(step) / name)
    finally:
      handler.close()
    saved = _flat_by_path(getattr(saved_meta, "tree", saved_meta))
    wanted = _flat_by_path(target)
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(set(saved) - set(wanted))
    if missing or unexpected:
      parts = []
      if missing:
        parts.append(f"the abstract state has leaves the checkpoint lacks: {_first(missing)}")
      if unexpected:
        parts.append(f"the checkpoint has leaves the abstract state lacks: {_first(unexpected)}")
      raise CheckpointError(f"{where}: structure differs; " + "; ".join(parts))
    bad = []
    for path, want in wanted.items():
      have = getattr(saved[path], "shape", None)
      want_shape = tuple(getattr(want, "shape", np.shape(want)))
      if have is not None and tuple(have) != want_shape:
        bad.append(f"{path!r} saved with shape {tuple(have)}, abstract shape {want_shape}")
    if bad:
      raise CheckpointError(f"{where}: shape mismatch: {_first(bad)}")

  def restore(self, abstract_state: dict[str, Any],
              step: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restores the entries named in `abstract_state` (name -> pytree of ShapeDtypeStructs or
    arrays giving shapes, dtypes and shardings) and the meta dict of `step` (None: the latest).

    Entries saved but not asked for are not read. nnx.States come back as nnx.States.
    """
    self.wait()
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise CheckpointError(f"no checkpoint in {self.directory}")
      step = steps[-1]
    elif int(step) not in steps:
      raise CheckpointError(f"no checkpoint for step {step} in {self.directory} "
                            f"(committed steps: {steps})")
    step = int(step)
    step_dir = self._step_dir(step)
    saved_entries = sorted(p.name for p in step_dir.iterdir()
                           if p.is_dir() and p.name != META and p.name[0] not in "._")
    args, local_targets = {}, {}
    multi = jax.process_count() > 1
    for name, abstract in abstract_state.items():
      if name not in saved_entries:
        raise CheckpointError(f"{self.directory} step {step}: no entry {name!r} "
                              f"(saved entries: {saved_entries})")
      target = jax.tree.map(_restore_target, _to_pure(abstract))
      self._check_entry(step, name, target)
      local_targets[name] = target
      args[name] = ocp.args.StandardRestore(jax.tree.map(_global_target, target) if multi
                                            else target)
    args[META] = ocp.args.JsonRestore()
    restored = self._mngr.restore(step, args=ocp.args.Composite(**args))
    if multi:
      restored = {name: jax.tree.map(_to_local, restored[name], local_targets[name])
                  if name in local_targets else restored[name] for name in args}
    state = {name: _from_pure(abstract_state[name], restored[name]) for name in abstract_state}
    return state, restored[META]

  def delete(self, step: int) -> None:
    """Removes a committed step (a step saved again with other contents must go first: Orbax
    never overwrites one)."""
    self.wait()
    self._mngr.delete(int(step))

  # -- lifetime

  def close(self) -> None:
    self._pending = None
    self._mngr.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# ---------------------------------------------------------------------------------------------
# Exports


def export_merged_hf(model: Transformer, out_dir: str) -> None:
  """An HF checkpoint (config.json + model.safetensors) of `model` with every LoRA merged:
  W' = W + scale * A @ B, in float32, cast to the kernel dtype. `model` is left as it is."""
  tensors = hf.hf_tensors(model)  # base weights, HF names and layouts (LoRALinear -> its base)
  for name, mod in lora.lora_modules(model).items():
    kernel = mod.base.kernel[...]
    # On the host in float32: an accelerator's default matmul precision may round through bf16.
    a = np.asarray(mod.lora_a[...], np.float32)
    b = np.asarray(mod.lora_b[...], np.float32)
    merged = np.asarray(kernel, np.float32) + np.float32(mod.scale) * (a @ b)
    tensors[f"{name}.weight"] = np.ascontiguousarray(merged.astype(kernel.dtype).T)
  # Abstract init (no random weights computed); load_params_into fills and checks every tensor.
  merged_model = nnx.eval_shape(lambda: Transformer(model.cfg, nnx.Rngs(0)))
  hf.load_params_into(merged_model, tensors, source="merged LoRA export")
  hf.save_model(merged_model, out_dir)


def export_adapter(model: Transformer, out_dir: str, *, base_model_name_or_path: str = "") -> None:
  """The LoRA adapter as PEFT's adapter_config.json + adapter_model.safetensors."""
  lora.export_peft(model, out_dir, base_model_name_or_path=base_model_name_or_path)
