"""Multi-host start-up from `c.distributed`: one `jax.distributed.initialize` per process.

With `num_processes > 1` every host runs the same command with its own `process_id` (or -1 where
the cluster says it: Cloud TPU, SLURM and Open MPI are detected by JAX itself, and then an empty
`coordinator_address` is fine too). It must run before anything touches a JAX backend, because
the backend is what learns about the other processes; a second call with the same settings does
nothing, with other settings it is an error (the process is already part of another cluster).
"""

from __future__ import annotations

from typing import Any

import ml_collections

_initialized_with: dict[str, Any] | None = None


def settings(c: ml_collections.ConfigDict) -> dict[str, Any] | None:
  """The `jax.distributed.initialize` keyword arguments `c.distributed` describes, None for a
  single process. Raises ValueError naming the keys when they contradict each other."""
  d = c.distributed
  problems = []
  if d.num_processes < 1:
    problems.append(f"distributed.num_processes={d.num_processes} must be >= 1")
  if d.process_id < -1:
    problems.append(f"distributed.process_id={d.process_id} must be >= 0 (or -1 = detected)")
  elif d.process_id >= max(d.num_processes, 1):
    problems.append(f"distributed.process_id={d.process_id} must be < "
                    f"distributed.num_processes={d.num_processes}")
  address = d.coordinator_address.strip()
  if address:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
      problems.append(f"distributed.coordinator_address={address!r} must be host:port")
  device_ids = None
  if d.local_device_ids.strip():
    try:
      device_ids = [int(x) for x in d.local_device_ids.split(",") if x.strip()]
    except ValueError:
      problems.append(f"distributed.local_device_ids={d.local_device_ids!r} must be comma-"
                      "separated integers, e.g. '0,1,2,3'")
  if d.num_processes == 1 and (address or d.process_id > 0 or device_ids):
    problems.append("distributed.coordinator_address / process_id / local_device_ids are set but "
                    "distributed.num_processes=1 (a single process needs none of them; set "
                    "num_processes to the number of hosts)")
  if problems:
    raise ValueError("invalid distributed settings: " + "; ".join(problems))
  if d.num_processes <= 1:
    return None
  return {"coordinator_address": address or None, "num_processes": int(d.num_processes),
          "process_id": None if d.process_id == -1 else int(d.process_id),
          "local_device_ids": device_ids}


def initialize_from_config(c: ml_collections.ConfigDict) -> None:
  """`jax.distributed.initialize(...)` from `c.distributed` when it names more than one process."""
  global _initialized_with
  kwargs = settings(c)
  if kwargs is None:
    return
  if _initialized_with is not None:
    if kwargs != _initialized_with:
      raise ValueError(f"jax.distributed is already initialized with {_initialized_with}; this "
                       f"config asks for {kwargs} (distributed.* keys differ)")
    return
  import jax  # noqa: PLC0415 (jax only once a multi-process run asks for it)

  if jax.distributed.is_initialized():  # someone else started it; trust them
    _initialized_with = kwargs
    return
  # CPU processes need a collectives backend to all-gather / all-reduce across processes (the
  # setting only concerns CPU devices; GPUs and TPUs use their own interconnect).
  if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(**kwargs)
  except RuntimeError as e:
    raise RuntimeError(f"jax.distributed.initialize({kwargs}) failed: {e}. It has to run before "
                       "the first JAX computation, with the same distributed.coordinator_address "
                       "and num_processes on every host and a distinct distributed.process_id "
                       "per host.") from e
  _initialized_with = kwargs
