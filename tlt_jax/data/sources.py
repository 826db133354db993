"""Readers for prompt/answer datasets in JSONL or Parquet, with configurable field names.

A malformed row (bad JSON, missing field, non-text value) either stops the run with an error
that names the file and the line, or is skipped and counted (`on_error="skip"`): never silently
dropped.
"""

from __future__ import annotations

import dataclasses
import json
import os

from tlt_jax.rl.rewards import reference_answer


class DataError(ValueError):
  pass


@dataclasses.dataclass
class ReadReport:
  rows: list[dict]
  skipped: list[str]  # "file:line: reason" for every skipped row


def _row(record, prompt_field: str, answer_field: str, where: str) -> dict:
  if not isinstance(record, dict):
    raise DataError(f"{where}: expected an object, got {type(record).__name__}")
  for field in (prompt_field, answer_field):
    if field not in record:
      raise DataError(f"{where}: missing field {field!r} (has {sorted(record)})")
  prompt, answer = record[prompt_field], record[answer_field]
  if not isinstance(prompt, str) or not prompt.strip():
    raise DataError(f"{where}: field {prompt_field!r} must be non-empty text")
  if isinstance(answer, (int, float)) and not isinstance(answer, bool):
    answer = str(answer)
  if not isinstance(answer, str):
    raise DataError(f"{where}: field {answer_field!r} must be text or a number")
  # "answer" is what the reward compares with; the raw reference stays for reports and evals.
  return {"prompt": prompt, "answer": reference_answer(answer), "answer_raw": answer,
          "source": where}


def read_rows(path: str, *, prompt_field: str = "question", answer_field: str = "answer",
              on_error: str = "raise") -> ReadReport:
  if on_error not in ("raise", "skip"):
    raise ValueError("on_error must be 'raise' or 'skip'")
  if not os.path.exists(path):
    raise FileNotFoundError(f"dataset file {path} does not exist")
  records = []
  if path.endswith(".parquet"):
    import pyarrow.parquet as pq  # noqa: PLC0415
    for i, record in enumerate(pq.read_table(path).to_pylist()):
      records.append((f"{path}:row {i}", record, None))
  elif path.endswith((".jsonl", ".json")):
    with open(path, encoding="utf-8") as f:
      for lineno, line in enumerate(f, start=1):
        if not line.strip():
          continue
        where = f"{path}:{lineno}"
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
      rows.append(_row(record, prompt_field, answer_field, where))
    except DataError as e:
      if on_error == "raise":
        raise
      skipped.append(str(e))
  if not rows:
    raise DataError(f"{path}: no usable rows ({len(skipped)} skipped)")
  return ReadReport(rows, skipped)
