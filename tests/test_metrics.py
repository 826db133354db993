from __future__ import annotations

import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax import metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _log(workdir, **kw):
  with metrics.MetricsWriter(str(workdir), **kw) as w:
    w.write(1, {"loss": 0.25, "tokens": 7, "rollout/accept_len": np.float32(2.5),
                "kl": jnp.float32(0.125), "note": "warmup", "grad_norm": float("nan")})
    w.write(2, {"loss": np.float64(0.1), "tokens": np.int64(9), "rollout/accept_len": jnp.array(3),
                "ratio": float("inf"), "eval_accuracy": None})


def test_jsonl_rows_exact(tmp_path):
  _log(tmp_path)
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line) for line in lines] == [
      {"step": 1, "loss": 0.25, "tokens": 7, "rollout/accept_len": 2.5, "kl": 0.125,
       "note": "warmup", "grad_norm": None},
      {"step": 2, "loss": 0.1, "tokens": 9, "rollout/accept_len": 3, "ratio": None,
       "eval_accuracy": None},
  ]
  assert "NaN" not in lines[0] and "Infinity" not in lines[1]
  # ints stay ints (no "9.0"), numpy / jax scalars become plain JSON numbers
  assert '"tokens": 9,' in lines[1] and '"rollout/accept_len": 3,' in lines[1]
  assert metrics.read_jsonl(str(tmp_path / "metrics.jsonl")) == [json.loads(line) for line in lines]


def test_tensorboard_scalars_exact(tmp_path):
  _log(tmp_path)
  got = metrics.read_tensorboard_scalars(str(tmp_path / "tb"))
  # finite numbers only: no note (str), grad_norm (NaN), ratio (inf), eval_accuracy (None)
  assert got == {
      "loss": [(1, 0.25), (2, float(np.float32(0.1)))],
      "tokens": [(1, 7.0), (2, 9.0)],
      "rollout/accept_len": [(1, 2.5), (2, 3.0)],
      "kl": [(1, 0.125)],
  }


def test_reopen_appends_and_tensorboard_off(tmp_path):
  _log(tmp_path)
  with metrics.MetricsWriter(str(tmp_path)) as w:
    w.write(3, {"loss": 0.5})
  with metrics.MetricsWriter(str(tmp_path), tensorboard=False) as w:
    w.write(4, {"loss": 0.75})
  assert [r["step"] for r in metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3, 4]
  # the second writer's event file must not have replaced the first one's
  assert metrics.read_tensorboard_scalars(str(tmp_path / "tb"))["loss"] == [
      (1, 0.25), (2, float(np.float32(0.1))), (3, 0.5)]


def test_rejects_non_scalars_and_step_key(tmp_path):
  with metrics.MetricsWriter(str(tmp_path), tensorboard=False) as w:
    with pytest.raises(TypeError):
      w.write(0, {"x": np.zeros(3)})
    with pytest.raises(ValueError):
      w.write(0, {"step": 1})


def test_truncated_last_line(tmp_path):
  _log(tmp_path)
  path = tmp_path / "metrics.jsonl"
  with open(path, "a") as f:
    f.write('{"step": 3, "loss": 0.')  # a run killed mid-write
  assert [r["step"] for r in metrics.read_jsonl(str(path))] == [1, 2]
  # a resumed run drops the partial line instead of gluing its first row onto it
  with metrics.MetricsWriter(str(tmp_path), tensorboard=False) as w:
    w.write(3, {"loss": 0.5})
  assert [r["step"] for r in metrics.read_jsonl(str(path))] == [1, 2, 3]
  # corruption in the middle is not silently skipped
  path.write_text('{"step": 1}\n{"step": \n{"step": 3}\n')
  with pytest.raises(ValueError):
    metrics.read_jsonl(str(path))


def test_truncated_event_file(tmp_path):
  _log(tmp_path)
  (event_file,) = (tmp_path / "tb").iterdir()
  data = event_file.read_bytes()
  event_file.write_bytes(data[:-3])  # last record cut short
  got = metrics.read_tensorboard_scalars(str(tmp_path / "tb"))
  assert got["loss"] == [(1, 0.25)] and got["kl"] == [(1, 0.125)]
  event_file.write_bytes(data[:20] + bytes([data[20] ^ 1]) + data[21:])  # flipped bit
  with pytest.raises(ValueError):
    metrics.read_tensorboard_scalars(str(tmp_path / "tb"))


RECORDS = [
    {"step": s, "reward_mean": 0.2 + 0.1 * s, "response_len_mean": 40.0 + s,
     "response_len_max": 64 + s, "rollout_s": 3.0, "reward_wait_s": 0.5, "train_s": 1.5,
     "step_s": 6.0, **({"eval_accuracy": 0.5} if s % 2 == 0 else {})}
    for s in range(1, 5)]
TRACE = [{"start_s": 0.0, "seconds": 0.4, "bucket": 8, "live": 8, "arm": "off"},
         {"start_s": 0.4, "seconds": 0.3, "bucket": 8, "live": 6, "arm": "chain4"},
         {"start_s": 0.7, "seconds": 0.2, "bucket": 4, "live": 3, "arm": "chain4"}]


def _assert_pngs(paths, names):
  assert sorted(os.path.basename(p) for p in paths) == sorted(names)
  for p in paths:
    data = open(p, "rb").read()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_plot_run_all(tmp_path):
  # The tuner's per-arm figures, as rl.step.record writes them (an arm it did not run in a step
  # has no keys that step).
  tuned = {"arm_chunk_fraction/off": 0.5, "arm_chunk_fraction/chain4": 0.5,
           "arm_accept_len/chain4": 2.1}
  records = [{**r, **tuned} if i % 2 else {**r, "arm_chunk_fraction/off": 1.0}
             for i, r in enumerate(RECORDS)]
  paths = metrics.plot_run(str(tmp_path), records, TRACE)
  assert all(os.path.dirname(p) == str(tmp_path / "plots") for p in paths)
  _assert_pngs(paths, ["reward_accuracy.png", "response_length.png", "time_split.png",
                       "arms.png", "live_slots.png"])
  only_off = [{**r, "arm_chunk_fraction/off": 1.0} for r in RECORDS]  # no choice: no arms.png
  assert "arms.png" not in {os.path.basename(p) for p in metrics.plot_run(
      str(tmp_path / "plain"), only_off)}


def test_plot_run_skips_missing(tmp_path):
  records = [{k: v for k, v in r.items() if not k.startswith("response_len")} for r in RECORDS]
  records[0]["reward_mean"] = None  # a NaN written as null
  paths = metrics.plot_run(str(tmp_path), records)
  _assert_pngs(paths, ["reward_accuracy.png", "time_split.png"])
  assert not (tmp_path / "plots" / "response_length.png").exists()
  assert metrics.plot_run(str(tmp_path / "empty"), [{"step": 1, "note": "x"}], []) == []
  assert not (tmp_path / "empty" / "plots").exists()


def test_progress_env(monkeypatch):
  monkeypatch.setenv("TLT_NO_PROGRESS", "1")
  with metrics.progress(3, desc="rollout") as bar:
    assert bar.disable
  with metrics.progress(3, desc="rollout", disable=False) as bar:
    assert not bar.disable
  monkeypatch.delenv("TLT_NO_PROGRESS")
  # A transient bar is drawn on a terminal only: in a log file each nested redraw is a line.
  monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
  with metrics.progress(3, desc="rollout", unit="seq", leave=False) as bar:
    assert bar.disable
  with metrics.progress(3, desc="RL", unit="step") as bar:
    assert not bar.disable
  monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
  with metrics.progress(3, desc="rollout", unit="seq", leave=False) as bar:
    assert not bar.disable and bar.unit == "seq" and bar.mininterval == 0.5
    assert bar.dynamic_ncols and not bar.leave
