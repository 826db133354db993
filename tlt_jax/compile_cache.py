"""JAX's persistent compilation cache, on by default: the second run of a job loads its programs
from disk instead of compiling them again.

Compilation is most of a short run's wall time (the default CPU job: 175 s of 342 s; its second
run with the cache: 32 s of 144 s). Every run, sweep point, notebook and test compiles the same
programs, so they share one cache, keyed by JAX on the program, its compile options and flags, the
backend and the JAX version: a changed program or flag is a miss, never a wrong hit.

Where it lives (`config.compile.cache_dir`):
- None (the default): $TLT_JAX_CACHE_DIR, else JAX's own $JAX_COMPILATION_CACHE_DIR, else
  $XDG_CACHE_HOME/tlt_jax/xla (~/.cache/tlt_jax/xla);
- "" turns it off;
- any other string is the folder.

Entries are never evicted (JAX's size limit would take a lock and list the folder on every
write); deleting the folder is safe and only costs one compile of each program.

JAX trusts what it loads from the cache: a folder that others may write to lets them run code in
your process. The default is under your own home.
"""

from __future__ import annotations

import os

from jax.experimental.compilation_cache import compilation_cache

ENV_VAR = "TLT_JAX_CACHE_DIR"
JAX_ENV_VAR = "JAX_COMPILATION_CACHE_DIR"

_UNSET = object()
_configured: object = _UNSET  # the folder the last configure() set (None: off)


def default_dir() -> str:
  cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(cache_home, "tlt_jax", "xla")


def resolve(cache_dir: str | None) -> str | None:
  """The absolute cache folder the config value names, or None when the cache is off."""
  if cache_dir is None:
    cache_dir = (os.environ.get(ENV_VAR) if os.environ.get(ENV_VAR) is not None
                 else os.environ.get(JAX_ENV_VAR) or default_dir())
  if not cache_dir:
    return None
  return os.path.abspath(os.path.expanduser(cache_dir))


def configure(cache_dir: str | None) -> str | None:
  """Points JAX's persistent compilation cache at the folder `cache_dir` resolves to (see the
  module doc) and returns it, or turns the cache off and returns None. Call it before the first
  compile; calling it again with the same value does nothing, and with another value takes
  effect for the programs compiled after it."""
  global _configured
  import jax  # noqa: PLC0415 (setting config options creates no backend)

  path = resolve(cache_dir)
  if path == _configured and jax.config.jax_compilation_cache_dir == path:
    return path
  if path is not None:
    os.makedirs(path, exist_ok=True)
  if _configured is not _UNSET or jax.config.jax_compilation_cache_dir:
    # JAX opens the cache at its first compile and keeps that one: another folder needs it
    # closed again.
    compilation_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", path)
  if path is not None:
    # Every program, however small or quick to compile: a job has hundreds of small ones, and
    # JAX's defaults (1 s of compile time) would leave most of the compile time uncached.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  _configured = path
  return path
