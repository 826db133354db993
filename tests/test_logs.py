import os
import re
import subprocess
import sys

import pytest

from tlt_jax import config as config_lib
from tlt_jax import logs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# An absl app (as `python -m tlt_jax.train` is: `app.run` raises absl's verbosity to INFO) that
# sets the log level from argv, saves a real Orbax checkpoint, then logs one warning through
# Orbax's logger and one through absl's.
_SAVE_A_CHECKPOINT = """
from absl import app

def main(argv):
  from tlt_jax import logs
  logs.configure(argv[1])
  import logging
  import jax.numpy as jnp
  from absl import logging as absl_logging
  from tlt_jax import checkpoint
  with checkpoint.Checkpointer(argv[2], keep=1) as ckpt:
    ckpt.save(1, {"params": {"w": jnp.ones(3)}}, {"step": 1})
    ckpt.wait()
  logging.getLogger("orbax").warning("orbax warning stays")
  absl_logging.warning("absl warning stays")

app.run(main)
"""
ABSL_INFO_LINE = re.compile(r"^I\d{4} ", re.MULTILINE)


def _save_with_log_level(level: str, directory: str) -> str:
  proc = subprocess.run([sys.executable, "-c", _SAVE_A_CHECKPOINT, level, directory],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert os.listdir(directory), "no checkpoint written"
  return proc.stdout + proc.stderr


def test_default_level_drops_orbax_info_and_keeps_warnings(tmp_path):
  default = config_lib.default_config().log_level
  output = _save_with_log_level(default, str(tmp_path / "quiet"))
  assert not ABSL_INFO_LINE.search(output), output[:2000]
  assert "orbax warning stays" in output and "absl warning stays" in output

  loud = _save_with_log_level("info", str(tmp_path / "loud"))
  assert len(ABSL_INFO_LINE.findall(loud)) > 5, loud[:2000]  # Orbax's save lines are back


def test_unknown_level_is_refused_by_name():
  with pytest.raises(ValueError, match="log_level='verbose'"):
    logs.configure("verbose")
  c = config_lib.default_config()
  c.log_level = "loud"
  with pytest.raises(ValueError, match="log_level='loud'"):
    config_lib.validate(c)
