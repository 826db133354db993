"""Tensor parallelism that keeps every row's bits: split outputs, gather inputs.

Megatron-style tensor parallelism splits o_proj and down_proj over their input (K) dimension:
each device sums its part of K and an all-reduce adds the parts. That is another reduction order
than one device's, so a row's values move in the last bits with `mesh.model`, and sampler ==
trainer log-probs no longer hold bitwise.

Here every linear layer is split over its output dimension only. Each device computes whole dot
products (all of K, in the kernel's one fixed order) for its share of the output columns, and an
all-gather joins the shares before anything that reduces over them: o_proj and down_proj get
their whole input, RMSNorm and log-softmax their whole row. A concatenation does no arithmetic,
so every value is bitwise the unsplit model's, provided the matmul kernel's result for a column
does not depend on how many columns it computes. The Pallas matmul gives that by construction
(independent [bm, bn] output tiles). XLA's CPU dot behind the `blocked_jax` twin does not in
f32: its algorithm changes with N. So this is exact with `backend="pallas"`, what
`batch_invariant` runs on GPU and TPU.

Attention (whole heads per device), the MLP's gate/up projections and the vocabulary projection
split as in Megatron. The price is communication. Per layer there are four all-gathers: the
attention output [rows, H*hd], o_proj's output [rows, D], the MLP activation [rows, F] and
down_proj's output [rows, D]. Megatron does two all-reduces of [rows, D]. And memory: kept for
the backward, the gathered inputs of o_proj and down_proj and the logits would be whole on every
device, where Megatron keeps 1/model of them. Under `over(regather=True)` (the trainer's
default, `rl.tp_regather`) the backward gathers those inputs again (`linear_of_gathered`: two
more all-gathers per layer) and the trainer recomputes the logits; the logits' gradient is still
whole (`python -m tlt_jax.plan` counts it; `rl.exact_tensor_parallel=False` chooses XLA's split).

The trainer stores its parameters split the same way (`storage_shardings`: `mesh.py`'s rules,
with o_proj and down_proj split over their outputs rather than their inputs), so entering the
split forward only gathers over fsdp, as the unsplit one does, and moves no weight between the
devices of the model axis.

Use: inside a `jax.shard_map` that is manual over the model axis, with parameters laid out by
`param_specs`, trace the model under `over(axis)`; the model's layers call `gather_features`,
`linear_of_gathered` and `embed_lookup`, which do nothing outside it.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src import config as jax_config
from jax._src.lax import parallel as jax_parallel
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax import mesh as mesh_lib

_AXIS: str | None = None  # the manual mesh axis the model is being traced over, if any
_REGATHER = False  # the backward gathers o_proj's / down_proj's inputs again (see `over`)

# (regex on the '/'-joined NNX path, which dimension is split): every linear layer over its
# output, the embedding table over the vocabulary (its rows). Everything else is whole.
_SPLIT_DIM: tuple[tuple[str, int], ...] = (
    (r"embed_tokens/embedding$", 0),
    (r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|lm_head)/(base/)?kernel$", 1),
    (r"(q_proj|k_proj|v_proj)/(base/)?bias$", 0),
    (r"/lora_b$", 1),
)


@contextlib.contextmanager
def over(axis: str, regather: bool = False):
  """Trace the model split over the manual mesh axis `axis` (see the module docstring).

  regather: o_proj and down_proj keep only this device's share of their input for the backward
  and all-gather it again there, rather than keeping the whole gathered input: 1/size of that
  memory, for one more all-gather of each in the backward (what a trainer wants; a forward
  without autodiff is the same either way). `regathering()` tells the caller to recompute its
  whole logits likewise."""
  global _AXIS, _REGATHER
  previous, _AXIS, _REGATHER = (_AXIS, _REGATHER), axis, regather
  try:
    yield
  finally:
    _AXIS, _REGATHER = previous


def regathering() -> bool:
  """Whether the model is traced split with `over(regather=True)`: a backward that gathers (or
  recomputes) rather than keeping whole activations."""
  return _AXIS is not None and _REGATHER


def gather_features(x: jax.Array) -> jax.Array:
  """The whole last axis from every device's share of it (in device order along the axis)."""
  if _AXIS is None:
    return x
  if jax_config._check_vma.value:
    # A shard_map that types how values vary: the invariant all-gather, whose result is the
    # same on every device of the axis and whose transpose takes each device's slice of the
    # cotangent.
    return jax_parallel.all_gather_invariant(x, _AXIS, axis=x.ndim - 1, tiled=True)
  # Unchecked (check_vma=False; Pallas' interpret mode needs it): shard_map hands each device
  # 1/size of the cotangent of an output replicated over the axis, and this all-gather's
  # transpose (a reduce-scatter) sums those shares back.
  return jax.lax.all_gather(x, _AXIS, axis=x.ndim - 1, tiled=True)


def local_share(count: int) -> int:
  """How many of `count` split units (heads) this device holds: count / axis size under `over`,
  all of them outside it."""
  return count if _AXIS is None else count // jax.lax.axis_size(_AXIS)


def linear_of_gathered(linear, x_local: jax.Array) -> jax.Array:
  """`linear` (a layer that reduces over its input) on the whole input, from this device's share
  of its features; just `linear(x)` outside `over`."""
  if _AXIS is None:
    return linear(x_local)
  if not _REGATHER:
    return linear(gather_features(x_local))
  # The rematerialized function's inputs (the share and the layer's weights) are all its
  # backward keeps; the matmul's own forward is not recomputed (nothing needs its output).
  return nnx.remat(lambda layer, x: layer(gather_features(x)))(linear, x_local)


def embed_lookup(table_VxD: jax.Array, tokens: jax.Array) -> jax.Array:
  """Embedding rows of `tokens` from a table split over its rows: the device holding a token's
  row contributes it, the others contribute zeros, and a sum over the axis joins them. Adding
  zeros is exact, so the rows are bitwise the unsplit table's."""
  if _AXIS is None:
    return jnp.take(table_VxD, tokens, axis=0)
  rows_here = table_VxD.shape[0]
  local = tokens - jax.lax.axis_index(_AXIS) * rows_here
  here = (local >= 0) & (local < rows_here)
  rows = jnp.take(table_VxD, jnp.clip(local, 0, rows_here - 1), axis=0)
  return jax.lax.psum(jnp.where(here[..., None], rows, jnp.zeros_like(rows)), _AXIS)


def check_model(cfg, size: int, where: str = "mesh.model") -> None:
  """Whole heads per device: `size` (named `where` in the error) must divide the query and the
  KV heads."""
  if cfg.num_heads % size or cfg.num_kv_heads % size:
    raise ValueError(f"exact tensor parallelism gives each device whole heads: {where}={size} "
                     f"must divide num_heads={cfg.num_heads} and "
                     f"num_kv_heads={cfg.num_kv_heads}")


def split_dim(path: str) -> int | None:
  """Which dimension of the parameter at `path` is split over the model axis (None: whole)."""
  for pattern, dim in _SPLIT_DIM:
    if re.search(pattern, path):
      return dim
  return None


def param_specs(state, axis_name: str, size: int, where: str = "mesh.model"):
  """PartitionSpecs of an NNX state for `over(axis_name)` on `size` devices (named `where` in
  the error). A split dimension that `size` does not divide is an error: a partial split
  cannot be gathered back."""
  def one(path, leaf):
    name = mesh_lib._path_str(path)
    dim = split_dim(name)
    if dim is None:
      return P()
    if leaf.shape[dim] % size:
      raise ValueError(f"exact tensor parallelism splits {name} (shape {tuple(leaf.shape)}) over "
                       f"dimension {dim}, which {where}={size} does not divide; choose a "
                       f"{where} that divides the heads, kv heads, hidden, intermediate and "
                       "vocabulary sizes")
    return P(*([None] * dim + [axis_name]))
  return jax.tree_util.tree_map_with_path(one, state)


def storage_shardings(state, mesh):
  """NamedShardings to keep an NNX state in for `over("model")` on `mesh`. These are the mesh's
  own rules (`mesh.param_spec`), with one change: a split parameter has "model" on its split
  dimension. For o_proj and down_proj, which the rules split over their input, that means
  swapping the two axes."""
  def one(path, leaf):
    name = mesh_lib._path_str(path)
    spec = list(mesh_lib.param_spec(name, leaf.shape, mesh))
    dim = split_dim(name)
    if dim is not None and spec[dim] != "model":
      other = [i for i, axis in enumerate(spec) if axis == "model"]
      moved = spec[dim]  # what the split dimension had (fsdp or nothing)
      spec = [None if axis == "model" else axis for axis in spec]
      spec[dim] = "model"
      for i in other:  # o_proj / down_proj: fsdp goes where model was, if it divides
        if moved and leaf.shape[i] % mesh.shape[moved] == 0:
          spec[i] = moved
    return NamedSharding(mesh, P(*spec))
  return jax.tree_util.tree_map_with_path(one, state)
