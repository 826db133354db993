"""One switch for what the libraries print: `config.log_level` ("warning" by default).

A default run printed about 194 Orbax/absl INFO lines (`I1204 ... checkpoint_manager.py:...`)
between its progress bars: `absl.app.run` raises absl's verbosity to INFO, and Orbax, Grain and
JAX log every save, restore and backend probe through it. Their warnings and errors are what a
user needs to see, so the default keeps those and drops the rest; "info" (or "debug") brings the
INFO lines back when a checkpoint or data problem needs them. An explicit `--verbosity`/`-v` on
an absl command line still decides absl's own verbosity.
"""

from __future__ import annotations

import logging
import os

from absl import flags
from absl import logging as absl_logging

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}
# Python loggers of the libraries that log through the standard logging module (Orbax and Grain
# use absl's, i.e. "absl"; JAX its own "jax.*").
LIBRARY_LOGGERS = ("absl", "orbax", "grain", "jax")
# XLA's C++ logging (`I0000 00:00:...` lines, e.g. GPU and TPU backend start-up): 1 = no INFO.
# Read when the backend starts, so it only helps when set before the first computation.
_XLA_CPP_ENV = "TF_CPP_MIN_LOG_LEVEL"
_set_xla_cpp_env = False  # whether configure() set it (and so may take it back)


def configure(level: str = "warning") -> None:
  """Shows library log records of `level` ("debug" | "info" | "warning" | "error") and above,
  on stderr. Idempotent; call it at the start of an entry point (inside `app.run`'s main, which
  would otherwise raise absl's verbosity to INFO afterwards)."""
  global _set_xla_cpp_env

  if level not in LEVELS:
    raise ValueError(f"log_level={level!r} must be one of {list(LEVELS)}")
  number = LEVELS[level]
  verbosity_given = flags.FLAGS.is_parsed() and flags.FLAGS["verbosity"].present
  if not verbosity_given:
    absl_logging.set_verbosity(level)
  if number < logging.WARNING:
    # Outside `app.run` nothing shows INFO records (Python's last-resort handler shows WARNING
    # and above); absl's handler prints them as an absl app does.
    absl_logging.use_absl_handler()
  for name in LIBRARY_LOGGERS:
    if not (name == "absl" and verbosity_given):
      logging.getLogger(name).setLevel(number)
  if number >= logging.WARNING and _XLA_CPP_ENV not in os.environ:
    os.environ[_XLA_CPP_ENV] = "1"
    _set_xla_cpp_env = True
  elif number < logging.WARNING and _set_xla_cpp_env:
    os.environ.pop(_XLA_CPP_ENV, None)
    _set_xla_cpp_env = False
