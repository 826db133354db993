"""Run metrics: one JSON line per step in <workdir>/metrics.jsonl plus TensorBoard scalars under
<workdir>/tb/, readers for both, the house tqdm bar, and the PNG plots of a run."""

from __future__ import annotations

import glob
import json
import math
import os
import sys
import struct
import time
from typing import Any

import numpy as np
import tqdm


def _python_scalar(key: str, value: Any) -> float | int | bool | str | None:
  if value is None or isinstance(value, (str, bool, int, float)):
    return value
  if np.ndim(value) != 0:  # numpy / jax arrays; np.asarray pulls a jax scalar to the host
    raise TypeError(f"metric {key!r} is not a scalar: shape {np.shape(value)}")
  out = np.asarray(value).item()
  if not isinstance(out, (bool, int, float)):
    raise TypeError(f"metric {key!r} has unsupported type {type(value).__name__}")
  return out


def _drop_partial_line(path: str) -> None:
  # A killed run can leave half a line; appending after it would corrupt a line in the middle.
  if not os.path.exists(path) or os.path.getsize(path) == 0:
    return
  with open(path, "rb+") as f:
    f.seek(-1, os.SEEK_END)
    if f.read(1) == b"\n":
      return
    f.seek(0)
    f.truncate(f.read().rfind(b"\n") + 1)


def _drop_rows_after(path: str, step: int) -> None:
  """Keeps the rows a run resumed from step `step`'s checkpoint will not write again: those
  before it and step `step`'s own row (written before that checkpoint was saved), the first row
  at `step` in the file. Anything after (later steps, and the final eval row of a run killed
  while it exported, which shares the last step's number) goes: the resumed run writes it
  again."""
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    lines = f.readlines()
  kept, seen_step_row = [], False
  for line in lines:
    row_step = json.loads(line)["step"]
    if row_step < step or (row_step == step and not seen_step_row):
      kept.append(line)
      seen_step_row = seen_step_row or row_step == step
  if len(kept) < len(lines):
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      f.writelines(kept)
    os.replace(path + ".tmp", path)


class MetricsWriter:
  """Appends {"step", **metrics} rows to metrics.jsonl and finite numbers to TensorBoard."""

  def __init__(self, workdir: str, *, tensorboard: bool = True, resume_step: int | None = None,
               start_over: bool = False):
    """`resume_step`: a run resumed from that step's checkpoint drops the rows a killed run
    wrote after it (they are written again), so the file is the uninterrupted run's.
    `start_over`: a run that restored no checkpoint drops every row (a killed run's before its
    first checkpoint; they are written again)."""
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self.path = os.path.join(workdir, "metrics.jsonl")
    _drop_partial_line(self.path)
    if start_over and os.path.exists(self.path):
      os.remove(self.path)
    elif resume_step is not None:
      _drop_rows_after(self.path, resume_step)
    self._jsonl = open(self.path, "a", encoding="utf-8")
    self._events = None
    if tensorboard:
      # tensorboardX imports torch when installed; import only when TensorBoard is wanted.
      from tensorboardX.event_file_writer import EventsWriter  # noqa: PLC0415 (tensorboardX imports torch when installed: only when TensorBoard is on)
      tb_dir = os.path.join(workdir, "tb")
      os.makedirs(tb_dir, exist_ok=True)
      # Synchronous writer, not SummaryWriter: its background queue can lose the last events of
      # a killed run. The suffix keeps a reopen within the same second from overwriting a file.
      self._events = EventsWriter(os.path.join(tb_dir, "events"),
                                  f".{os.getpid()}.{time.time_ns()}")

  def write(self, step: int, metrics: dict[str, float | int | str | None]) -> None:
    if "step" in metrics:
      raise ValueError("'step' is the row key; do not pass it in metrics")
    step = int(step)
    row: dict[str, Any] = {"step": step}
    numbers: dict[str, float] = {}
    for key, value in metrics.items():
      value = _python_scalar(key, value)
      if isinstance(value, float) and not math.isfinite(value):
        value = None  # JSON has no NaN/inf; null keeps every line parseable
      row[key] = value
      if isinstance(value, (int, float)):
        numbers[key] = float(value)
    self._jsonl.write(json.dumps(row, allow_nan=False) + "\n")
    self._jsonl.flush()
    if self._events is not None and numbers:
      from tensorboardX.proto import event_pb2, summary_pb2  # noqa: PLC0415 (tensorboardX imports torch when installed: only when TensorBoard is on)
      summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=k, simple_value=v)
                                           for k, v in numbers.items()])
      self._events.write_event(event_pb2.Event(wall_time=time.time(), step=step,
                                               summary=summary))
      self._events.flush()

  def close(self) -> None:
    if not self._jsonl.closed:
      self._jsonl.close()
    if self._events is not None:
      self._events.close()
      self._events = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_jsonl(path: str) -> list[dict]:
  """Rows of a metrics.jsonl; an unparseable last line (a killed run) is skipped."""
  with open(path, encoding="utf-8") as f:
    lines = [line for line in f.read().split("\n") if line.strip()]
  rows = []
  for i, line in enumerate(lines):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      if i == len(lines) - 1:
        break
      raise ValueError(f"{path}: line {i + 1} is not JSON (corrupt file, not a truncated end)")
  return rows


def read_tensorboard_scalars(event_dir: str) -> dict[str, list[tuple[int, float]]]:
  """tag -> [(step, value)] of the simple_value scalars in event_dir's event files, file order.

  TFRecord framing: uint64 length, uint32 masked crc of it, data, uint32 masked crc of data. A
  truncated final record (a killed run) ends that file; a crc mismatch elsewhere raises.
  """
  from tensorboardX.proto import event_pb2  # noqa: PLC0415 (tensorboardX imports torch when installed: only when TensorBoard is on)
  from tensorboardX.record_writer import masked_crc32c  # noqa: PLC0415 (tensorboardX imports torch when installed: only when TensorBoard is on)
  out: dict[str, list[tuple[int, float]]] = {}
  for path in sorted(glob.glob(os.path.join(event_dir, "*tfevents*"))):
    with open(path, "rb") as f:
      buf = f.read()
    pos = 0
    while pos + 12 <= len(buf):
      header = buf[pos:pos + 8]
      (length,) = struct.unpack("<Q", header)
      (header_crc,) = struct.unpack("<I", buf[pos + 8:pos + 12])
      if header_crc != masked_crc32c(header):
        raise ValueError(f"{path}: bad length crc at byte {pos}")
      end = pos + 12 + length + 4
      if end > len(buf):
        break
      data = buf[pos + 12:pos + 12 + length]
      if struct.unpack("<I", buf[end - 4:end])[0] != masked_crc32c(data):
        raise ValueError(f"{path}: bad data crc at byte {pos}")
      event = event_pb2.Event.FromString(data)
      for value in event.summary.value:
        if value.WhichOneof("value") == "simple_value":
          out.setdefault(value.tag, []).append((int(event.step), float(value.simple_value)))
      pos = end
  return out


def progress(total: int | None = None, *, desc: str, unit: str = "it",
             disable: bool | None = None, **kw) -> tqdm.tqdm:
  """A tqdm bar with the house settings; disable=None reads TLT_NO_PROGRESS=1 (for CI / logs).
  A transient bar (leave=False: a rollout's, an eval's) is drawn only on a terminal: written to
  a log file, a nested bar's every redraw becomes a line of its own."""
  if disable is None:
    disable = os.environ.get("TLT_NO_PROGRESS") == "1" or (
        kw.get("leave") is False and not sys.stderr.isatty())
  opts = dict(dynamic_ncols=True, mininterval=0.5)
  opts.update(kw)
  return tqdm.tqdm(total=total, desc=desc, unit=unit, disable=disable, **opts)


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
  steps, values = [], []
  for row in records:
    v = row.get(key)
    if ("step" in row and isinstance(v, (int, float)) and not isinstance(v, bool)
        and math.isfinite(v)):
      steps.append(row["step"])
      values.append(float(v))
  return steps, values


def plot_run(workdir: str, records: list[dict],
             last_rollout_trace: list[dict] | None = None) -> list[str]:
  """PNGs of a run in <workdir>/plots/; returns the paths written, skipping plots without data.

  reward_accuracy.png (reward_mean line, eval_accuracy markers), response_length.png,
  time_split.png (stacked rollout / reward wait / train / other seconds per step), arms.png
  (the fraction of decode chunks each speculative arm ran per step, with its mean accept
  length; only when the tuner had arms besides off) and, given a
  trace of the last rollout's decode chunks, live_slots.png (live slots and bucket over wall time,
  shaded by speculative arm).
  """
  # Figure + Agg canvas instead of pyplot: no global backend switch (notebooks keep theirs) and no
  # figure registry that leaks across calls.
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 (matplotlib only when a plot is drawn)
  from matplotlib.figure import Figure  # noqa: PLC0415 (matplotlib only when a plot is drawn)
  from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 (matplotlib only when a plot is drawn)

  plot_dir = os.path.join(workdir, "plots")
  written: list[str] = []

  def new_axes(title, xlabel, ylabel):
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if xlabel == "RL step":
      ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, ax

  def save(fig, ax, name):
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    os.makedirs(plot_dir, exist_ok=True)
    path = os.path.join(plot_dir, name)
    fig.savefig(path)
    written.append(path)

  reward, acc = _series(records, "reward_mean"), _series(records, "eval_accuracy")
  if reward[0] or acc[0]:
    fig, ax = new_axes("Reward and eval accuracy", "RL step", "mean reward / accuracy (fraction)")
    if reward[0]:
      ax.plot(*reward, label="reward_mean")
    if acc[0]:
      ax.plot(*acc, "o", color="C3", label="eval_accuracy", clip_on=False)
    if all(0.0 <= v <= 1.0 for v in reward[1] + acc[1]):
      ax.set_ylim(0.0, 1.0)
    save(fig, ax, "reward_accuracy.png")

  lengths = {k: _series(records, k) for k in ("response_len_mean", "response_len_max")}
  if any(s for s, _ in lengths.values()):
    fig, ax = new_axes("Response length", "RL step", "response length (tokens)")
    for key, (steps, values) in lengths.items():
      if steps:
        ax.plot(steps, values, label=key)
    save(fig, ax, "response_length.png")

  parts = ("rollout_s", "reward_wait_s", "train_s")
  split = {k: _series(records, k) for k in (*parts, "step_s")}
  steps = sorted({s for key in split for s in split[key][0]})
  if steps:
    at = {key: dict(zip(*split[key])) for key in split}
    known = {key: np.array([at[key].get(s, 0.0) for s in steps]) for key in parts}
    total = np.array([at["step_s"].get(s, np.nan) for s in steps])
    # Only what step_s measured beyond the named parts; rows without step_s have no "other".
    known["other"] = np.nan_to_num(np.maximum(total - sum(known.values()), 0.0))
    fig, ax = new_axes("Where each step's time goes", "RL step", "wall time (s)")
    bottom = np.zeros(len(steps))
    for key, values in known.items():
      if values.any():
        ax.bar(steps, values, bottom=bottom, label=key.removesuffix("_s"))
        bottom += values
    save(fig, ax, "time_split.png")

  by_arm = {k.split("/", 1)[1] for r in records for k in r if k.startswith("arm_chunk_fraction/")}
  if by_arm - {"off"}:  # the tuner had a choice: which arm it ran, step by step
    arms = sorted(by_arm, key=lambda a: (a != "off", a))
    fig, ax = new_axes("Decode chunks by arm (the tuner's choices)", "RL step",
                       "fraction of decode chunks")
    series = {a: dict(zip(*_series(records, f"arm_chunk_fraction/{a}"))) for a in arms}
    steps = sorted({s for a in arms for s in series[a]})
    bottom = np.zeros(len(steps))
    for i, arm in enumerate(arms):
      values = np.array([series[arm].get(s, 0.0) for s in steps])
      accept = _series(records, f"arm_accept_len/{arm}")[1]
      label = f"{arm} (plain)" if arm == "off" else (
          f"{arm}, mean accept {np.mean(accept):.2f}" if accept else arm)
      ax.bar(steps, values, bottom=bottom, color="0.8" if arm == "off" else f"C{i % 9}",
             label=label)
      bottom += values
    ax.set_ylim(0.0, 1.0)
    save(fig, ax, "arms.png")

  trace = [c for c in last_rollout_trace or []
           if all(isinstance(c.get(k), (int, float)) for k in ("start_s", "seconds", "live"))]
  if trace:
    fig, ax = new_axes("Live decode slots in the last rollout", "wall time since rollout start (s)",
                       "sequences (slots)")
    x = [c["start_s"] for c in trace] + [trace[-1]["start_s"] + trace[-1]["seconds"]]
    live = [c["live"] for c in trace]
    ax.step(x, live + live[-1:], where="post", color="k", label="live slots")
    if all(isinstance(c.get("bucket"), (int, float)) for c in trace):
      buckets = [c["bucket"] for c in trace]
      ax.step(x, buckets + buckets[-1:], where="post", color="C0", ls="--", label="bucket size")
    arms = sorted({str(c.get("arm", "off")) for c in trace}, key=lambda a: (a != "off", a))
    colours = {a: "0.85" if a == "off" else f"C{i % 9 + 1}" for i, a in enumerate(arms)}
    labelled = set()
    for c in trace:
      arm = str(c.get("arm", "off"))
      label = None if arm in labelled else f"arm: {arm}" + (" (plain)" if arm == "off" else "")
      labelled.add(arm)
      ax.axvspan(c["start_s"], c["start_s"] + c["seconds"], color=colours[arm], alpha=0.35,
                 lw=0, label=label)
    ax.set_ylim(bottom=0)
    save(fig, ax, "live_slots.png")

  return written
