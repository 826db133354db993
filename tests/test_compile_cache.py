import json
import os
import subprocess
import sys

import pytest

from tlt_jax import compile_cache
from tlt_jax import config as config_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A fresh process that configures the cache from argv[1] (None when absent), compiles one jitted
# function and reports the folder and JAX's own count of persistent-cache hits.
_COMPILE_ONCE = """
import json, sys
import jax, jax.numpy as jnp
from tlt_jax import compile_cache
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" \
else None)
folder = compile_cache.configure(sys.argv[1] if len(sys.argv) > 1 else None)
jax.block_until_ready(jax.jit(lambda x: jnp.tanh(x) @ x.T + 1.0)(jnp.ones((8, 8))))
print(json.dumps({"folder": folder, "hits": len(hits)}))
"""


def _compile_in_new_process(*argv: str, env: dict[str, str]) -> dict:
  proc = subprocess.run([sys.executable, "-c", _COMPILE_ONCE, *argv], cwd=REPO_ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _clean_env(**extra: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items()
         if k not in (compile_cache.ENV_VAR, compile_cache.JAX_ENV_VAR)}
  env.update(extra)
  return env


def test_second_process_loads_the_program_instead_of_compiling(tmp_path):
  folder = str(tmp_path / "xla")
  first = _compile_in_new_process(folder, env=_clean_env())
  entries = sorted(os.listdir(folder))
  assert first == {"folder": folder, "hits": 0}
  assert any(name.startswith("jit_") for name in entries), entries

  second = _compile_in_new_process(folder, env=_clean_env())
  assert second["hits"] >= 1
  assert sorted(os.listdir(folder)) == entries  # nothing compiled, so nothing new written


def test_unset_config_follows_the_environment_and_empty_turns_it_off(tmp_path):
  from_env = str(tmp_path / "from_env")
  report = _compile_in_new_process(env=_clean_env(TLT_JAX_CACHE_DIR=from_env))
  assert report["folder"] == from_env and os.listdir(from_env)

  off = _compile_in_new_process("", env=_clean_env(TLT_JAX_CACHE_DIR=from_env))
  assert off == {"folder": None, "hits": 0}  # the same program, in a cache it is not reading


def test_resolve(monkeypatch, tmp_path):
  monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
  monkeypatch.delenv(compile_cache.JAX_ENV_VAR, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache_home"))
  assert compile_cache.resolve(None) == str(tmp_path / "cache_home" / "tlt_jax" / "xla")
  monkeypatch.setenv(compile_cache.JAX_ENV_VAR, str(tmp_path / "jax_own"))
  assert compile_cache.resolve(None) == str(tmp_path / "jax_own")
  monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "ours"))
  assert compile_cache.resolve(None) == str(tmp_path / "ours")
  monkeypatch.setenv(compile_cache.ENV_VAR, "")  # set but empty: off, as in the config
  assert compile_cache.resolve(None) is None
  assert compile_cache.resolve("") is None
  monkeypatch.chdir(tmp_path)
  assert compile_cache.resolve("relative") == str(tmp_path / "relative")


def test_config_key_takes_a_folder_or_empty_and_nothing_else():
  c = config_lib.default_config()
  assert c.compile.cache_dir is None
  c.compile.cache_dir = ""
  c.compile.cache_dir = "/tmp/xla"
  with pytest.raises(TypeError, match="cache_dir"):
    c.compile.cache_dir = 3
