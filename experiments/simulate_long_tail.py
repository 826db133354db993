"""The long-tail simulation's command line: the report and figure of `tlt_jax.perf.long_tail`
(the model, its assumptions and the report's keys are documented there).

    python -m experiments.simulate_long_tail [--quick] [--seed 0] [--devices 8 64 256 1024]

Prints one JSON object and writes experiments/results/simulation.json and simulation.png
(`--quick`: *_quick.json / *_quick.png).

The full run also adds `paper_configs`: for each paper-scale config (experiments/configs/
qwen2_5_7b_8gpu.py, qwen2_5_32b_multihost.py, r1_distill_qwen_7b_v5p64.py) on its hardware, the
simulation driven by the cost model (`tlt_jax.perf.predict`) instead of the CPU fit above:
predicted_speedup_tlt, predicted_speedup_static_sd, the step breakdown, and `assumptions` naming
every assumed input with its source. The CPU-fitted figures above keep their meaning (CPU-model
units); `--quick` and `--no-paper-configs` leave the addition out.
"""

from __future__ import annotations

import argparse
import json
import os

from tlt_jax.perf.long_tail import DEVICES, VARIANTS, build_report, default_params
from tlt_jax.perf.predict import predict_paper_configs

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def plot(report: dict, traces: dict, path: str) -> None:
  import matplotlib  # noqa: PLC0415 (matplotlib (and its Agg backend choice) only when a plot is drawn)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415 (matplotlib (and its Agg backend choice) only when a plot is drawn)

  fig, (ax_a, ax_b, ax_c) = plt.subplots(1, 3, figsize=(16, 4.6))
  colors = dict(baseline="tab:gray", sd_static="tab:blue", tlt="tab:red")
  if traces:
    for name in ("baseline", "tlt"):
      t, live = traces[name]
      ax_a.step(t, live, where="post", color=colors[name], label=name,
                lw=2.2 if name == "baseline" else 1.2)  # tlt hides baseline until SD starts
    ax_a.axhline(traces["threshold"], color="k", ls=":", lw=1, label="SD threshold")
    base = next(c for c in report["configs"] if c["devices"] == traces["devices"])
    first = base["variants"]["baseline"]["rollout_s"] * (
        1 - base["variants"]["baseline"]["idle_fraction"])  # mean group finish, baseline
    ax_a.axvline(first, color="tab:gray", ls="--", lw=1, label="mean group done (baseline)")
    ax_a.set_yscale("log")
    ax_a.set_ylim(0.8, None)
    ax_a.set_xlabel("time (s, CPU-model units)")
    ax_a.set_ylabel("live rows")
    ax_a.set_title(f"(a) slowest group at D={traces['devices']}")
    ax_a.legend(fontsize=8)
  devs = [c["devices"] for c in report["configs"]]
  for name in VARIANTS:
    ax_b.plot(devs, [c["variants"][name]["idle_fraction"] for c in report["configs"]], "o-",
              color=colors[name], label=f"idle, {name}")
  ax_b.plot(devs, [c["variants"]["baseline"]["tail_fraction"] for c in report["configs"]], "s--",
            color="tab:gray", alpha=0.6, label="<= threshold live, baseline")
  ax_b.set_xscale("log", base=2)
  ax_b.set_xticks(devs, [str(d) for d in devs])
  ax_b.set_xlabel("devices D")
  ax_b.set_ylabel("fraction of rollout device-seconds")
  ax_b.set_title("(b) idle devices during rollout")
  ax_b.legend(fontsize=8)
  for name in VARIANTS:
    ax_c.plot(devs, [c["variants"][name]["speedup"] for c in report["configs"]], "o-",
              color=colors[name], label=name)
  mem = report["sensitivity"].get("per_row_over_fixed", {}).get("memory_bound_0.02")
  if mem:
    for name in ("sd_static", "tlt"):
      ax_c.plot(devs, [mem[str(d)][name] for d in devs], "^:", color=colors[name], alpha=0.7,
                label=f"{name}, memory-bound cost")
  ax_c.axhspan(1.7, 2.1, color="tab:green", alpha=0.12, label="TLT paper 1.7-2.1x")
  ax_c.set_xscale("log", base=2)
  ax_c.set_xticks(devs, [str(d) for d in devs])
  ax_c.set_xlabel("devices D")
  ax_c.set_ylabel("end-to-end speedup vs baseline")
  ax_c.set_title("(c) predicted step speedup")
  ax_c.set_ylim(0.95, 2.2)
  ax_c.legend(fontsize=7.5, ncol=2, loc="center")  # the gap between the curves and the band
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--devices", type=int, nargs="+", default=list(DEVICES))
  parser.add_argument("--group-size", type=int, default=8)
  parser.add_argument("--samples-per-group", type=int, default=None)
  parser.add_argument("--trials", type=int, default=None, help="RL steps averaged per D")
  parser.add_argument("--tlt-gain", type=float, default=0.2)
  parser.add_argument("--rollout-fraction", type=float, default=0.85)
  parser.add_argument("--out-dir", default=RESULTS_DIR)
  parser.add_argument("--no-paper-configs", action="store_true",
                      help="leave out the cost-model predictions for the paper-scale configs")
  args = parser.parse_args(argv)
  samples = args.samples_per_group or (64 if args.quick else 256)
  p = default_params(devices_per_group=args.group_size, samples_per_group=samples,
                     tlt_accept_gain=args.tlt_gain, rollout_fraction=args.rollout_fraction)
  devices = tuple(args.devices)
  trace_d = 64 if 64 in devices else devices[-1]
  trials = args.trials or (2 if args.quick else 8)
  report, traces = build_report(p, args.seed, devices, args.quick, trace_d, trials)
  if not (args.quick or args.no_paper_configs):
    report["paper_configs"] = predict_paper_configs(CONFIGS_DIR, seed=args.seed, trials=trials)
  os.makedirs(args.out_dir, exist_ok=True)
  stem = "simulation_quick" if args.quick else "simulation"
  with open(os.path.join(args.out_dir, stem + ".json"), "w") as f:
    json.dump(report, f, indent=2)
  plot(report, traces, os.path.join(args.out_dir, stem + ".png"))
  print(json.dumps(report))
  return report


if __name__ == "__main__":
  main()

