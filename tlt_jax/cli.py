"""The command lines' error contract (train, evaluate): input the user got wrong (a flag, a config
key or value, a dataset row, an HF or Orbax checkpoint) ends the command before any step with
one line on stderr, `error: <what, naming the key, file:line or tensor>`, and exit status 2. The
traceback comes too only when asked for: absl's `--verbosity=1` (`-v 1`) or `log_level=debug`.

    cli.define_config(DEFAULT_CONFIG)
    app.run(cli.guarded(main), flags_parser=cli.parse_flags)
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import sys
import traceback

from absl import flags
from ml_collections import config_flags

EXIT_BAD_INPUT = 2
# What bad input raises: ValueError covers DataError, hf.CheckpointError and
# checkpoint.CheckpointError; FileNotFoundError a dataset, checkpoint or config file not there.
BAD_INPUT = (ValueError, FileNotFoundError)


# TensorStore (under every Orbax restore) ends each error with the whole spec of the array it
# was opening, about 1.5 kB of JSON (context, drivers, cache sizes); the path and byte range
# before it say what is wrong.
_TENSORSTORE_SPEC = re.compile(r" \[tensorstore_spec='.*?'\]")


def one_line(message: str) -> str:
  """A message on one line; a traceback embedded in it (ml_collections puts the config file's
  into its flag error) is cut down to the line before it and the exception it ends with, and
  TensorStore's spec is dropped."""
  lines = [line.strip() for line in _TENSORSTORE_SPEC.sub("", message).splitlines()
           if line.strip()]
  if any(line.startswith("Traceback (most recent call last)") for line in lines):
    lines = [lines[0], lines[-1]]
  return " ".join(lines)


def _traceback_asked(argv) -> bool:
  """--verbosity=N / -v N (N >= 1) or --config.log_level=debug on the command line; read from
  argv, as the flags may not have parsed."""
  for i, arg in enumerate(argv[1:], start=1):
    name, _, value = arg.lstrip("-").partition("=")
    if name in ("verbosity", "v"):
      value = value or (argv[i + 1] if i + 1 < len(argv) else "")
      if value.lstrip("-").isdigit() and int(value) >= 1:
        return True
    if name == "config.log_level" and value == "debug":
      return True
  return False


def fail(message: str, *, show_traceback: bool = False) -> None:
  """Prints the one line (after the traceback of the error being handled, when asked for) and
  exits with EXIT_BAD_INPUT."""
  if show_traceback and sys.exc_info()[0] is not None:
    traceback.print_exc()
  print(f"error: {one_line(message)}", file=sys.stderr)
  sys.exit(EXIT_BAD_INPUT)


def _unknown_override(argv, config) -> str | None:
  """`--config.rl.lrr=1: no config key rl.lrr (did you mean rl.lr?)` for the first override
  that names a key the config lacks; None when every override names a key."""
  for arg in argv[1:]:
    if not arg.startswith("--config."):
      continue
    key = arg[len("--config."):].split("=", 1)[0]
    node, parts = config, key.split(".")
    for i, part in enumerate(parts):
      if hasattr(node, "keys") and part in node:
        node = node[part]
        continue
      known = list(node.keys()) if hasattr(node, "keys") else []
      close = difflib.get_close_matches(part, known, n=1)
      hint = f" (did you mean {'.'.join([*parts[:i], close[0]])}?)" if close else ""
      return f"--config.{key}: no config key {'.'.join(parts[:i + 1])}{hint}"
  return None


def _config_arg(argv) -> str | None:
  """The --config value on the command line (None: not given, the default is used)."""
  for i, arg in enumerate(argv[1:], start=1):
    if arg.startswith("--config="):
      return arg[len("--config="):]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _loaded_config(argv):
  """The config the command line names, for naming an unknown key (None: it does not load)."""
  flag = flags.FLAGS["config"]
  if flag.value is not None:
    return flag.value
  try:
    return flag.parser.parse(_config_arg(argv) or _default_config[0])
  except Exception:  # noqa: BLE001 (the key is then named from ml_collections' own message)
    return None


_default_config = [""]


def define_config(default: str) -> None:
  """--config FILE[:variant] (locked: an unknown key is an error). ml_collections applies the
  command line's --config.<key> overrides to the default config here, when it is defined: an
  unknown key is already named then."""
  _default_config[0] = default
  try:
    config_flags.DEFINE_config_file("config", default, "experiment config file[:variant]",
                                    lock_config=True)
  except (AttributeError, KeyError) as e:
    fail(_unknown_override(sys.argv, config_flags.ConfigFileFlagParser("config").parse(default))
         or f"--config: {e}", show_traceback=_traceback_asked(sys.argv))


def parse_flags(argv) -> list[str]:
  """absl's flag parsing with the contract above: an unknown flag, a value of the wrong type,
  an unknown config key, a config file that is missing or raises (a bad variant)."""
  f = flags.FLAGS
  try:
    rest = f(argv)
  except flags.Error as e:
    fail(str(e), show_traceback=_traceback_asked(argv))
  except (AttributeError, KeyError) as e:  # ml_collections: a key the (locked) config lacks
    config = _loaded_config(argv) if "config" in f else None
    fail(_unknown_override(argv, config) or f"--config: {e}",
         show_traceback=_traceback_asked(argv))
  except OSError as e:  # an override applied to a config file that did not load
    fail(_missing_config(argv) or f"--config: {e}", show_traceback=_traceback_asked(argv))
  if "config" in f:
    try:  # ml_collections defers a config file's load error to its first use
      f.config.get("seed")
    except OSError as e:
      fail(_missing_config(argv) or f"--config: {e}", show_traceback=_traceback_asked(argv))
  return rest


def _missing_config(argv) -> str | None:
  path = (_config_arg(argv) or _default_config[0]).split(":")[0]
  return None if os.path.isfile(path) else f"--config {path}: no such file"


def guarded(main):
  """`main` with BAD_INPUT errors turned into the one-line contract (ours name what and where:
  see config.validate, data.sources, model.hf, run_state)."""
  @functools.wraps(main)
  def wrapper(argv):
    try:
      return main(argv)
    except BAD_INPUT as e:
      asked = _traceback_asked(sys.argv) or (
          "config" in flags.FLAGS and flags.FLAGS.config.log_level == "debug")
      fail(str(e) or type(e).__name__, show_traceback=asked)
  return wrapper
