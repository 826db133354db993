"""Dataset readers (JSONL, Parquet, malformed rows), grain pipeline determinism, sharding and
resume from iterator state, and the synthetic arithmetic task."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt_jax.data.pipeline import prompt_dataset
from tlt_jax.data.sources import DataError, read_rows
from tlt_jax.data.synthetic import make_dataset, scratchpad_add
from tlt_jax.rl.rewards import math_reward


def _write_jsonl(path, lines):
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def test_jsonl_and_parquet_with_configurable_fields(tmp_path):
  f = _write_jsonl(tmp_path / "gsm.jsonl", [json.dumps({"question": "1+1?", "answer": 2}),
                                             json.dumps({"question": "2+2?", "answer": "4"})])
  rows = read_rows(f).rows
  assert [r["answer"] for r in rows] == ["2", "4"] and rows[1]["source"] == f"{f}:2"
  table = pa.table({"problem": ["3*3?"], "solution": ["\\boxed{9}"]})
  pq.write_table(table, tmp_path / "math.parquet")
  rows = read_rows(str(tmp_path / "math.parquet"), prompt_field="problem",
                   answer_field="solution").rows
  assert rows == [{"prompt": "3*3?", "reward": "math", "answer": "9", "answer_raw": "\\boxed{9}",
                   "source": f"{tmp_path / 'math.parquet'}:row 0"}]


def test_malformed_rows_name_file_and_line_or_are_skipped_and_counted(tmp_path):
  f = _write_jsonl(tmp_path / "bad.jsonl", [
      json.dumps({"question": "ok?", "answer": "1"}),
      "{not json",
      json.dumps({"question": "no answer"}),
      json.dumps({"question": "", "answer": "3"}),
      json.dumps({"question": "list?", "answer": [1]}),
  ])
  with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
    read_rows(f)
  report = read_rows(f, on_error="skip")
  assert len(report.rows) == 1 and len(report.skipped) == 4
  assert "bad.jsonl:3: missing field 'answer'" in report.skipped[1]
  assert "bad.jsonl:5: field 'answer' must be text or a number" in report.skipped[3]
  with pytest.raises(FileNotFoundError):
    read_rows(str(tmp_path / "missing.jsonl"))


ROWS = [{"prompt": str(i), "answer": str(i)} for i in range(20)]


def _take(it, n):
  return [[r["prompt"] for r in next(it)] for _ in range(n)]


def test_pipeline_is_deterministic_per_seed_and_reshuffles_per_epoch():
  a = _take(iter(prompt_dataset(ROWS, batch_size=4, seed=1)), 10)
  b = _take(iter(prompt_dataset(ROWS, batch_size=4, seed=1)), 10)
  c = _take(iter(prompt_dataset(ROWS, batch_size=4, seed=2)), 10)
  assert a == b and a != c
  epoch1, epoch2 = sum(a[:5], []), sum(a[5:], [])
  assert sorted(epoch1, key=int) == [r["prompt"] for r in ROWS] and epoch1 != epoch2


def test_pipeline_resumes_from_iterator_state():
  it = iter(prompt_dataset(ROWS, batch_size=4, seed=3))
  _take(it, 3)
  state = it.get_state()
  rest = _take(it, 4)
  resumed = iter(prompt_dataset(ROWS, batch_size=4, seed=3))
  resumed.set_state(state)
  assert _take(resumed, 4) == rest


def test_per_process_shards_are_disjoint_and_cover_the_data():
  seen = []
  for p in range(2):
    it = iter(prompt_dataset(ROWS, batch_size=5, seed=0, process_index=p, process_count=2,
                             num_epochs=1))
    seen.append({x for batch in it for x in (r["prompt"] for r in batch)})
  assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 20
  with pytest.raises(ValueError, match="fewer than one batch"):
    prompt_dataset(ROWS[:3], batch_size=4, seed=0)


def test_synthetic_arithmetic_is_correct_and_heavy_tailed():
  data = make_dataset(2000, seed=0)
  for row in data[:200]:
    a, op, b = row["prompt"][:-1].partition("+") if "+" in row["prompt"] else \
        row["prompt"][:-1].partition("*")
    assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) * int(b))
    assert math_reward(row["solution"], row["answer"]) == 1.0
  lengths = np.array([len(r["solution"]) for r in data])
  assert np.percentile(lengths, 95) > 2.5 * np.median(lengths)  # a long tail of long solutions
  assert scratchpad_add(58, 67) == ("8+7+0=15; 5+6+1=12; carry 1", 125)
  assert make_dataset(5, seed=4) == make_dataset(5, seed=4)
  assert all("*" not in r["prompt"] for r in make_dataset(50, seed=1, ops=("+",)))


def test_slipped_solutions_follow_their_flawed_scratchpad():
  # slip=1 drops every carry: column 1 writes 5 and loses its carry, column 2 (5+6+0=11) writes 1
  # and loses its carry, so the flawed answer is 15.
  rng = np.random.default_rng(0)
  assert scratchpad_add(58, 67, rng, slip=1.0) == ("8+7+0=15; 5+6+0=11", 15)
  rows = make_dataset(400, seed=2, ops=("+",), slip=0.5)
  wrong = [r for r in rows if math_reward(r["solution"], r["answer"]) == 0.0]
  assert 0.1 * len(rows) < len(wrong) < 0.6 * len(rows)
  clean = make_dataset(400, seed=2, ops=("+",))
  assert all(math_reward(r["solution"], r["answer"]) == 1.0 for r in clean)
