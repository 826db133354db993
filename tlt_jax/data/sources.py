"""Readers for prompt/answer datasets in JSONL or Parquet, with configurable field names; rows
may mix math problems (a reference answer) and code problems (tests), one reward kind per row.

A malformed row (bad JSON, missing field, non-text value) either stops the run with an error
that names the file and the line, or is skipped and counted (`on_error="skip"`): never silently
dropped.
"""

from __future__ import annotations

import dataclasses
import json
import os

from tlt_jax.rl.code_reward import parse_tests
from tlt_jax.rl.rewards import reference_answer


class DataError(ValueError):
  pass


@dataclasses.dataclass
class ReadReport:
  rows: list[dict]
  skipped: list[str]  # "file:line: reason" for every skipped row


LAYOUTS = ("fields", "eurus")
REWARD_KINDS = ("math", "code")


def _eurus_fields(record: dict) -> dict:
  """Eurus-2-RL-Data (PRIME-RL): `prompt` is a chat (the last user turn is the problem),
  `ability` math | code, `reward_model.ground_truth` the answer or the code tests (JSON)."""
  chat, truth = record.get("prompt"), (record.get("reward_model") or {}).get("ground_truth")
  if isinstance(chat, list):
    users = [m.get("content") for m in chat if isinstance(m, dict) and m.get("role") == "user"]
    chat = users[-1] if users else None
  kind = record.get("ability", "math")
  return {"prompt": chat, "reward": kind, ("tests" if kind == "code" else "answer"): truth}


def _utf8(value, field: str, where: str):
  """A Parquet binary column gives bytes: text when they are UTF-8, else the row is named."""
  if not isinstance(value, bytes):
    return value
  try:
    return value.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{where}: field {field!r} is not UTF-8 text (byte {e.start}: "
                    f"{value[e.start:e.start + 1]!r})") from None


def _row(record, prompt_field: str, answer_field: str, where: str, *, reward_field: str = "reward",
         tests_field: str = "tests", layout: str = "fields") -> dict:
  if not isinstance(record, dict):
    raise DataError(f"{where}: expected an object, got {type(record).__name__}")
  if layout == "eurus":
    record, prompt_field, answer_field, reward_field, tests_field = (
        _eurus_fields(record), "prompt", "answer", "reward", "tests")
  kind = record.get(reward_field, "math")
  if kind not in REWARD_KINDS:
    raise DataError(f"{where}: field {reward_field!r} is {kind!r}, expected one of {REWARD_KINDS}")
  needed = (prompt_field, tests_field) if kind == "code" else (prompt_field, answer_field)
  for field in needed:
    if field not in record or record[field] is None:
      raise DataError(f"{where}: missing field {field!r} (has {sorted(record)})")
  prompt = _utf8(record[prompt_field], prompt_field, where)
  if not isinstance(prompt, str) or not prompt.strip():
    raise DataError(f"{where}: field {prompt_field!r} must be non-empty text")
  if kind == "code":
    try:  # a malformed test spec is the file's fault: name it at load time, not mid-run
      cases = parse_tests(record[tests_field])
    except (ValueError, TypeError) as e:
      raise DataError(f"{where}: field {tests_field!r}: {e}") from None
    if not cases:
      raise DataError(f"{where}: field {tests_field!r} holds no tests")
    return {"prompt": prompt, "reward": "code", "tests": record[tests_field], "answer": "",
            "answer_raw": "", "source": where}
  answer = _utf8(record[answer_field], answer_field, where)
  if isinstance(answer, (int, float)) and not isinstance(answer, bool):
    answer = str(answer)
  if not isinstance(answer, str):
    raise DataError(f"{where}: field {answer_field!r} must be text or a number")
  # "answer" is what the reward compares with; the raw reference stays for reports and evals.
  return {"prompt": prompt, "reward": "math", "answer": reference_answer(answer),
          "answer_raw": answer, "source": where}


def read_rows(path: str, *, prompt_field: str = "question", answer_field: str = "answer",
              on_error: str = "raise", reward_field: str = "reward", tests_field: str = "tests",
              layout: str = "fields") -> ReadReport:
  """Rows {prompt, reward: "math" | "code", answer (math: the final answer), answer_raw, tests
  (code), source}. `reward_field` picks each row's reward (absent: math); layout "eurus" reads
  Eurus-2-RL-Data's own fields instead of the *_field names."""
  if on_error not in ("raise", "skip"):
    raise ValueError("on_error must be 'raise' or 'skip'")
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  if not os.path.exists(path):
    raise FileNotFoundError(f"dataset file {path} does not exist")
  records = []
  if path.endswith(".parquet"):
    import pyarrow  # noqa: PLC0415 (pyarrow only for Parquet files)
    import pyarrow.parquet as pq  # noqa: PLC0415
    try:
      table = pq.read_table(path)
    except pyarrow.ArrowException as e:  # its message does not name the file
      raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    for i, record in enumerate(table.to_pylist()):
      records.append((f"{path}:row {i}", record, None))
  elif path.endswith((".jsonl", ".json")):
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is named, not the whole file
      for lineno, raw in enumerate(f, start=1):
        where = f"{path}:{lineno}"
        try:
          line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
          records.append((where, None, f"{where}: not UTF-8 text (byte {e.start}: "
                                       f"{raw[e.start:e.start + 1]!r})"))
          continue
        if not line.strip():
          continue
        try:
          records.append((where, json.loads(line), None))
        except json.JSONDecodeError as e:
          records.append((where, None, f"{where}: not valid JSON ({e.msg})"))
  else:
    raise DataError(f"{path}: unknown format (expected .jsonl or .parquet)")
  rows, skipped = [], []
  for where, record, problem in records:
    try:
      if problem:
        raise DataError(problem)
      rows.append(_row(record, prompt_field, answer_field, where, reward_field=reward_field,
                       tests_field=tests_field, layout=layout))
    except DataError as e:
      if on_error == "raise":
        raise
      skipped.append(str(e))
  if not rows:
    raise DataError(f"{path}: no usable rows ({len(skipped)} skipped)")
  return ReadReport(rows, skipped)
