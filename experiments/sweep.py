"""Ablation sweeps: one `python -m tlt_jax.train` process per grid point, then one table and plots.

    python -m experiments.sweep --config experiments/configs/tiny_arith.py:smoke \\
        --grid rl.lr=1e-3,2e-3 --grid lora.rank=1,8 --out runs/sweep_lr_rank
    python -m experiments.sweep --config experiments/configs/tiny_arith.py:ablation \\
        --grid lora.rank=1,8,64 --point lora.rank=0,rl.lr=2e-4 \\
        --out experiments/results/ablations/lora

`--grid key=v1,v2` axes multiply; `--point k=v,k=v` adds one explicit point (for settings that
move together, e.g. full fine-tuning with its own learning rate); `--set k=v` applies to every
point. Each point runs in its own process (a point's XLA flags and numerics are its own, and a
crash stays in that point) with its workdir under `<out>/points/<label>/` and its log in
`log.txt` there; a point whose summary.json exists is reused unless `--rerun`. Points run one
after another, or `--jobs N` at a time (with `--devices_per_point K` each gets its own
CUDA_VISIBLE_DEVICES slice). A failed point is reported in the table with the end of its log;
the sweep goes on, and exits non-zero at the end.

Writes `<out>/results.csv`, `<out>/results.md` (a Markdown table) and `<out>/comparison.png`
(reward and held-out accuracy vs step, step time split), and prints one JSON object.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

from tlt_jax import compile_cache as compile_cache_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Columns of the table, from each point's summary.json (None when a point has no such figure).
SUMMARY_COLUMNS = ("eval_accuracy_before", "eval_accuracy_after", "reward_first", "reward_last",
                   "accept_len_mean", "kl_sample_train_max", "logp_abs_diff_max", "wall_s",
                   "compile_s", "rollout_s", "train_s", "drafter_steps")


def split_values(spec: str) -> list[str]:
  """'1,8,(4,16)' -> ['1', '8', '(4,16)']: commas inside brackets belong to the value."""
  values, depth, current = [], 0, ""
  for ch in spec:
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      values.append(current.strip())
      current = ""
    else:
      current += ch
  if current.strip():
    values.append(current.strip())
  return values


def parse_assignment(text: str, flag: str) -> tuple[str, str]:
  key, sep, value = text.partition("=")
  if not sep or not key.strip() or not value.strip():
    raise ValueError(f"{flag} {text!r} must look like key=value (e.g. rl.lr=1e-3)")
  return key.strip(), value.strip()


def grid_points(grids: list[str], points: list[str], fixed: list[str]) -> list[dict[str, str]]:
  """The sweep's points in order: the grid's product, then the explicit points; each a dict
  key -> value string (passed to the config flags as written)."""
  axes = []
  for g in grids:
    key, values = parse_assignment(g, "--grid")
    axes.append([(key, v) for v in split_values(values)])
  out = [dict(combo) for combo in itertools.product(*axes)] if axes else []
  for p in points:
    # 'a.b=1,c.d=(4,16)': split at the commas that start a new key=.
    parts = re.split(r",(?=\s*[A-Za-z_][\w.]*=)", p)
    out.append(dict(parse_assignment(part, "--point") for part in parts))
  common = dict(parse_assignment(f, "--set") for f in fixed)
  out = [{**common, **pt} for pt in out] or ([common] if common else [])
  labels = [point_label(pt, common) for pt in out]
  dupes = {label for label in labels if labels.count(label) > 1}
  if dupes:
    raise ValueError(f"the sweep has duplicate points: {sorted(dupes)}")
  return out


def point_label(point: dict[str, str], common: dict[str, str] | None = None) -> str:
  """A filesystem-safe name from the settings that vary ('lora.rank=8_rl.lr=2e-3')."""
  varying = {k: v for k, v in point.items() if (common or {}).get(k) != v} or point
  text = "_".join(f"{k}={v}" for k, v in varying.items()) or "default"
  return re.sub(r"[^\w.=+-]", "", text.replace(",", "-"))


def run_point(config: str, point: dict[str, str], workdir: str, env: dict[str, str]):
  """Starts one point's training process; returns (process, log file)."""
  os.makedirs(workdir, exist_ok=True)
  log = open(os.path.join(workdir, "log.txt"), "w")  # noqa: SIM115 (closed by the caller)
  cmd = [sys.executable, "-m", "tlt_jax.train", f"--config={config}",
         f"--config.workdir={workdir}"] + [f"--config.{k}={v}" for k, v in point.items()]
  log.write(" ".join(cmd) + "\n")
  log.flush()
  proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
  return proc, log


def log_tail(path: str, lines: int = 6) -> str:
  try:
    with open(path, errors="replace") as f:
      text = [line.rstrip() for line in f if line.strip()]
  except OSError:
    return "(no log)"
  return " | ".join(text[-lines:])


def load_result(label: str, point: dict[str, str], workdir: str, returncode: int | None,
                seconds: float | None) -> dict:
  row = {"label": label, **{f"set:{k}": v for k, v in point.items()}, "workdir": workdir}
  summary_path = os.path.join(workdir, "summary.json")
  if returncode not in (0, None) or not os.path.exists(summary_path):
    row.update(status="failed", returncode=returncode,
               error=log_tail(os.path.join(workdir, "log.txt")))
    return row
  with open(summary_path) as f:
    summary = json.load(f)
  row.update(status="ok", **{k: summary.get(k) for k in SUMMARY_COLUMNS})
  steps = _records(workdir)
  step_s = [r["step_s"] for r in steps if "step_s" in r]
  row["step_s_mean"] = float(np.mean(step_s)) if step_s else None
  row["eval_gain"] = (summary["eval_accuracy_after"] - summary["eval_accuracy_before"]
                      if summary.get("eval_accuracy_after") is not None else None)
  row["process_s"] = seconds
  return row


def _records(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def write_csv(rows: list[dict], path: str) -> list[str]:
  columns = []
  for row in rows:
    columns += [k for k in row if k not in columns]
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
  return columns


def _fmt(value) -> str:
  if value is None:
    return ""
  if isinstance(value, float):
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
  return str(value).replace("|", "\\|")


def markdown_table(rows: list[dict], title: str) -> str:
  varying = []
  for row in rows:
    varying += [k for k in row if k.startswith("set:") and k not in varying]
  varying = [k for k in varying if len({r.get(k) for r in rows}) > 1] or varying
  figures = [("eval_accuracy_before", "acc before"), ("eval_accuracy_after", "acc after"),
             ("eval_gain", "gain"), ("reward_last", "reward last"),
             ("step_s_mean", "step s"), ("rollout_s", "rollout s"), ("train_s", "train s"),
             ("accept_len_mean", "accept len"), ("kl_sample_train_max", "max KL s/t"),
             ("logp_abs_diff_max", "max abs dlogp")]
  figures = [(k, name) for k, name in figures if any(r.get(k) is not None for r in rows)]
  head = [k[4:] for k in varying] + ["status"] + [name for _, name in figures]
  lines = [f"### {title}", "", "| " + " | ".join(head) + " |",
           "|" + "|".join("---" for _ in head) + "|"]
  for r in rows:
    cells = [_fmt(r.get(k)) for k in varying] + [r["status"]]
    cells += [_fmt(r.get(k)) for k, _ in figures]
    lines.append("| " + " | ".join(cells) + " |")
  failed = [r for r in rows if r["status"] != "ok"]
  if failed:
    lines += ["", "Failed points:"] + [f"- `{r['label']}`: {r.get('error', '')}" for r in failed]
  return "\n".join(lines) + "\n"


def plot_comparison(rows: list[dict], path: str, title: str) -> str | None:
  ok = [r for r in rows if r["status"] == "ok"]
  if not ok:
    return None
  import matplotlib  # noqa: PLC0415 (matplotlib (and its Agg backend choice) only when a plot is drawn)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415 (matplotlib (and its Agg backend choice) only when a plot is drawn)

  fig, (ax_r, ax_a, ax_t) = plt.subplots(1, 3, figsize=(15, 4.2))
  for r in ok:
    records = _records(r["workdir"])
    steps = [(x["step"], x["reward_mean"]) for x in records if "reward_mean" in x]
    evals = [(x["step"], x["eval_accuracy"]) for x in records if "eval_accuracy" in x]
    if steps:
      ax_r.plot(*zip(*steps), label=r["label"], lw=1.4)
    if evals:
      ax_a.plot(*zip(*evals), marker="o", label=r["label"], lw=1.4)
  ax_r.set(title="reward (mean per step)", xlabel="RL step", ylabel="reward")
  ax_a.set(title="held-out accuracy", xlabel="RL step", ylabel="avg@K")
  labels = [r["label"] for r in ok]
  rollout = np.array([(r.get("rollout_s") or 0.0) for r in ok])
  train = np.array([(r.get("train_s") or 0.0) for r in ok])
  other = np.array([max((r.get("wall_s") or 0.0) - (r.get("compile_s") or 0.0), 0.0)
                    for r in ok]) - rollout - train
  y = np.arange(len(ok))
  ax_t.barh(y, rollout, label="rollout")
  ax_t.barh(y, train, left=rollout, label="train")
  ax_t.barh(y, np.maximum(other, 0.0), left=rollout + train, label="eval + other")
  ax_t.set_yticks(y, labels, fontsize=7)
  ax_t.set(title="where the time went (compile excluded)", xlabel="seconds")
  ax_t.legend(fontsize=7)
  for ax in (ax_r, ax_a):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def sweep(config: str, points: list[dict[str, str]], out: str, *, jobs: int = 1,
          devices_per_point: int = 0, rerun: bool = False, title: str = "",
          compile_cache: str = "") -> dict:
  out = os.path.abspath(out)
  path, _, variant = config.partition(":")
  config = os.path.abspath(path) + (f":{variant}" if variant else "")
  os.makedirs(os.path.join(out, "points"), exist_ok=True)
  env = dict(os.environ, TLT_NO_PROGRESS="1")
  # One compilation cache for every point (tlt_jax/compile_cache.py): points with the same
  # programs compile once. "" = the default folder; a point's own compile.cache_dir wins.
  cache_dir = compile_cache_lib.resolve(compile_cache or None)
  env[compile_cache_lib.ENV_VAR] = cache_dir or ""
  print(f"[sweep] compile cache: {cache_dir or 'off'}", file=sys.stderr)
  labels = [point_label(p, _common(points)) for p in points]
  rows: dict[str, dict] = {}
  queue = [(label, p) for label, p in zip(labels, points)]
  running: dict[str, tuple] = {}
  free_slots = list(range(max(jobs, 1)))
  t_start = time.perf_counter()
  while queue or running:
    while queue and free_slots:
      label, p = queue.pop(0)
      workdir = os.path.join(out, "points", label)
      if not rerun and os.path.exists(os.path.join(workdir, "summary.json")):
        rows[label] = load_result(label, p, workdir, None, None)
        print(f"[sweep] {label}: reused {workdir}/summary.json", file=sys.stderr)
        continue
      slot = free_slots.pop(0)
      point_env = dict(env)
      if devices_per_point:
        point_env["CUDA_VISIBLE_DEVICES"] = ",".join(
            str(slot * devices_per_point + i) for i in range(devices_per_point))
      print(f"[sweep] {label}: running ({len(rows) + len(running) + 1}/{len(points)})",
            file=sys.stderr)
      proc, log = run_point(config, p, workdir, point_env)
      running[label] = (proc, log, slot, p, workdir, time.perf_counter())
    for label, (proc, log, slot, p, workdir, t0) in list(running.items()):
      if proc.poll() is None:
        continue
      log.close()
      rows[label] = load_result(label, p, workdir, proc.returncode, time.perf_counter() - t0)
      status = rows[label]["status"]
      print(f"[sweep] {label}: {status} in {time.perf_counter() - t0:.0f} s" +
            (f" ({rows[label]['error']})" if status != "ok" else ""), file=sys.stderr)
      free_slots.append(slot)
      del running[label]
    if running:
      time.sleep(0.5)
  ordered = [rows[label] for label in labels]
  title = title or f"sweep of {config}"
  # Written tables name each point's workdir relative to the sweep folder (they get committed).
  write_csv([dict(r, workdir=os.path.relpath(r["workdir"], out)) for r in ordered],
            os.path.join(out, "results.csv"))
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(markdown_table(ordered, title))
  plot = plot_comparison(ordered, os.path.join(out, "comparison.png"), title)
  result = {"config": config, "out": out, "points": len(points),
            "ok": sum(r["status"] == "ok" for r in ordered),
            "failed": [r["label"] for r in ordered if r["status"] != "ok"],
            "seconds": time.perf_counter() - t_start, "plot": plot,
            "rows": [dict(r, workdir=os.path.relpath(r["workdir"], out)) for r in ordered]}
  with open(os.path.join(out, "sweep.json"), "w") as f:
    json.dump(result, f, indent=2)
  return result


def _common(points: list[dict[str, str]]) -> dict[str, str]:
  if not points:
    return {}
  return {k: v for k, v in points[0].items() if all(p.get(k) == v for p in points)}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True, help="experiment config file[:variant]")
  parser.add_argument("--grid", action="append", default=[], help="key=v1,v2 (axes multiply)")
  parser.add_argument("--point", action="append", default=[], help="k=v,k=v: one extra point")
  parser.add_argument("--set", action="append", default=[], dest="fixed",
                      help="k=v for every point")
  parser.add_argument("--out", default="", help="output folder (default runs/sweep-<time>)")
  parser.add_argument("--title", default="")
  parser.add_argument("--jobs", type=int, default=1, help="points run at once")
  parser.add_argument("--devices_per_point", type=int, default=0,
                      help="GPUs per point (sets CUDA_VISIBLE_DEVICES per process)")
  parser.add_argument("--rerun", action="store_true", help="rerun points that have a summary")
  parser.add_argument("--compile_cache", default="",
                      help="the points' shared XLA compilation cache folder (default: "
                           "$TLT_JAX_CACHE_DIR, else ~/.cache/tlt_jax/xla)")
  args = parser.parse_args(argv)
  points = grid_points(args.grid, args.point, args.fixed)
  if not points:
    parser.error("nothing to sweep: give --grid, --point or --set")
  out = args.out or os.path.join("runs", f"sweep-{time.strftime('%Y%m%d-%H%M%S')}")
  result = sweep(args.config, points, out, jobs=args.jobs,
                 devices_per_point=args.devices_per_point, rerun=args.rerun, title=args.title,
                 compile_cache=args.compile_cache)
  print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
  return 1 if result["failed"] else 0


if __name__ == "__main__":
  sys.exit(main())
