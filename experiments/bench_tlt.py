"""TLT end to end on this CPU: RL steps with SD off, with a static warmed-up drafter, with the
drafter trained on idle devices during the tail, and with model-free history arms instead of a
drafter (the same trajectory, bitwise, in all four); `combined` on request.

    python -m experiments.bench_tlt [--quick] [--steps N] [--repeats 3]
        [--order baseline,static_drafter,tlt,history] [--variants baseline,history]
        [--drafter DIR] [--out NAME.json] [--history-arms ARMS] [--groups 2]
        [--train-problems N] [--combined-arms ARMS]

Setup: the tiny_arith policy on a longer-tailed mix (more 8- and 16-digit problems, so the tail
is where rollout time goes), two data-parallel rollout groups on two host devices, gumbel
verification in batch-invariant numerics. The drafter is warmed up offline first
(`tlt.warmup`, or `--drafter` names one already warmed) on rollouts of the initial policy;
`static_drafter` serves it unchanged, `tlt` keeps training it on the devices of the group that
finishes first and publishes new versions between steps. `history` has no learned drafter: the
tuner chooses between plain decoding and history chains (`rollout.history_arms`, drafted on the
host from each prompt's siblings so far, its earlier responses and a global trie of recent
responses; `rollout/history.py`; `--history-arms` offers others, e.g. the lookup arms drafted on
device). `combined` (not run by default) is the static drafter with the tuner choosing between
plain decoding, its chains and `--combined-arms` (its chain and looked-up ones verified as one
tree). `--groups 1` decodes as one rollout group over both host devices, so no other
group's chunks share the cores while a chunk is timed. `--variants` runs a subset (no drafter
warm-up without static_drafter or tlt). `--train-problems N` trains on N problems instead of
4096, so every prompt comes back every N / 8 steps (epochs over a small dataset), where the
model-free drafters draft from its earlier responses. Step times exclude compilation (each
variant warms its program pool before step 1).

On 2 shared cores one run of a phase varies by 10-25%, so one run per variant cannot tell 1.5x
from 1.7x. Each variant therefore runs `--repeats` times, every run in a fresh process, the
order rotated between repeats (a Latin square), and the speedups are ratios of the medians;
`speedup_end_to_end_by_repeat` shows the spread. The train phase is the same computation in
every variant, so `speedup_train_equalized` also gives each the mean train time. Prints one JSON
object and writes experiments/results/tlt.json (tlt_quick.json with --quick; --out names
another file).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=2").strip()

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

import tlt_jax
from tlt_jax import compile_cache, logs, metrics
from tlt_jax import config as config_lib
from tlt_jax.tlt.warmup import warmup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "experiments", "results")
CONFIG = os.path.join(ROOT, "experiments", "configs", "tiny_arith.py")
MIX = "2:0.25,4:0.25,8:0.25,16:0.25"
# (learned-drafter SD, spot training, history arms, combined arms)
VARIANTS = {"baseline": (False, False, False, False),
            "static_drafter": (True, False, False, False), "tlt": (True, True, False, False),
            "history": (False, False, True, False), "combined": (True, False, False, True)}
HISTORY_ARMS = "history_chain2,history_chain4,history_chain8"
COMBINED_ARMS = "combined_tree4_1,combined_tree4_2"


def base_config(steps: int, workdir: str, groups: int = 2, train_problems: int = 0):
  c = config_lib.load_config_file(CONFIG)
  c.workdir, c.rl.steps = workdir, steps
  c.data.synthetic_mix = MIX
  c.data.synthetic_train = train_problems or c.data.synthetic_train
  c.rollout.prompts_per_step, c.rollout.group_size = 8, 4
  c.rollout.buckets = (1, 2, 4, 8, 16)
  c.rollout.groups = groups
  c.eval.num_problems = 16
  c.checkpoint.every = 0
  c.checkpoint.export_adapter = False
  c.metrics.plots = c.metrics.tensorboard = c.metrics.progress = False
  c.tlt.arms = "chain2,chain4"
  c.tlt.rows, c.tlt.row_len = 8, 256
  return c


def variant_config(name: str, steps: int, workdir: str, drafter_dir: str,
                   history_arms: str = HISTORY_ARMS, groups: int = 2, train_problems: int = 0,
                   combined_arms: str = COMBINED_ARMS):
  c = base_config(steps, workdir, groups, train_problems)
  c.tlt.enabled, c.tlt.spot_training, history, combined = VARIANTS[name]
  if combined:
    c.tlt.arms += "," + combined_arms
  if history:
    c.rollout.history_arms = history_arms
    c.rollout.history_global_tokens = 4096
  if c.tlt.enabled:
    c.tlt.drafter_init = drafter_dir
  return c


def run_variant(name: str, c) -> dict:
  summary = tlt_jax.run_training(c, name)
  rows = [r for r in metrics.read_jsonl(os.path.join(c.workdir, "metrics.jsonl"))
          if "reward_mean" in r]
  keep = ("step_s", "rollout_s", "train_s", "reward_wait_s", "accept_len", "sd_chunk_fraction",
          "drafter_steps", "drafter_version", "drafter_loss", "drafter_top1_agreement",
          "idle_device_s", "reward_mean", "response_len_max")
  return {
      "per_step": [{**{k: r.get(k) for k in keep},
                    **{k: v for k, v in r.items() if k.startswith("arm_")}} for r in rows],
      "step_s_total": float(sum(r["step_s"] for r in rows)),
      "rollout_s_total": float(sum(r["rollout_s"] for r in rows)),
      "train_s_total": float(sum(r["train_s"] for r in rows)),
      "accept_len_mean": float(np.mean([r["accept_len"] for r in rows])),
      "drafter_steps_total": int(sum(r.get("drafter_steps", 0) or 0 for r in rows)),
      "idle_device_s_total": float(sum(r.get("idle_device_s", 0.0) or 0.0 for r in rows)),
      "compile_s": summary["compile_s"],
      "reward_mean_by_step": [r["reward_mean"] for r in rows],
  }


def train_equalized(variants: dict) -> dict[str, float]:
  """baseline / variant with every variant's train time replaced by their mean. The train phase
  is the same computation in all three (the trajectory is bitwise the same), so its spread is
  noise of this 2-core machine; this ratio is the speedup SD and TLT are responsible for."""
  train = float(np.mean([v["train_s_total"] for v in variants.values()]))
  total = lambda v: v["step_s_total"] - v["train_s_total"] + train
  return {name: total(variants["baseline"]) / total(v) for name, v in variants.items()
          if name != "baseline"}


def run_child(name: str, steps: int, drafter_dir: str, workdir: str, history_arms: str,
              groups: int, train_problems: int, combined_arms: str) -> dict:
  """One variant in a fresh process (its own JAX runtime, caches and allocator; the program
  pool loads from the persistent compilation cache after the first run of a variant)."""
  cmd = [sys.executable, "-m", "experiments.bench_tlt", "--variant", name, "--steps", str(steps),
         "--drafter", drafter_dir, "--workdir", workdir, "--history-arms", history_arms,
         "--groups", str(groups), "--train-problems", str(train_problems),
         "--combined-arms", combined_arms]
  subprocess.run(cmd, check=True, cwd=ROOT, stdout=sys.stderr)  # stdout: the one JSON object
  with open(os.path.join(workdir, "variant.json")) as f:
    return json.load(f)


def aggregate(runs: list[dict]) -> dict:
  """A variant over its repeats: the median of each total, and every run as measured."""
  med = lambda key: float(np.median([r[key] for r in runs]))
  return {
      **{key: med(key) for key in ("step_s_total", "rollout_s_total", "train_s_total",
                                   "accept_len_mean", "idle_device_s_total", "compile_s")},
      "drafter_steps_total": int(np.median([r["drafter_steps_total"] for r in runs])),
      "step_s_runs": [r["step_s_total"] for r in runs],
      "per_step": runs[0]["per_step"],  # the first repeat's steps, for the curves
      "runs": [{k: v for k, v in r.items() if k != "per_step"} for r in runs],
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--steps", type=int, default=0)
  parser.add_argument("--repeats", type=int, default=0,
                      help="runs of each variant (default 3, 1 with --quick); medians are reported")
  parser.add_argument("--variants", default="baseline,static_drafter,tlt,history",
                      help="the variants to run (baseline always among them)")
  parser.add_argument("--order", default="",
                      help="the first repeat's order (default: --variants'); each next repeat "
                           "rotates it by one")
  parser.add_argument("--drafter", default="",
                      help="a warmed-up drafter directory (tlt.warmup --out) instead of "
                           "warming one")
  parser.add_argument("--out", default="", help="result file name under experiments/results/")
  parser.add_argument("--history-arms", default=HISTORY_ARMS,
                      help="the history variant's model-free arms (rollout.history_arms)")
  parser.add_argument("--combined-arms", default=COMBINED_ARMS,
                      help="the combined variant's trees, beside tlt.arms' chains")
  parser.add_argument("--groups", type=int, default=2, choices=(1, 2),
                      help="rollout groups over the two host devices (rollout.groups)")
  parser.add_argument("--train-problems", type=int, default=0,
                      help="training problems (data.synthetic_train; default the config's "
                           "4096): fewer come back sooner")
  parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)  # child
  parser.add_argument("--workdir", default="", help=argparse.SUPPRESS)  # child
  args = parser.parse_args()
  logs.configure("warning")
  cache_dir = compile_cache.configure(None)  # the variants' processes share it
  if not args.variant:
    print(f"[bench_tlt] compile cache: {cache_dir or 'off'}", file=sys.stderr)
  steps = args.steps or (2 if args.quick else 10)
  if args.variant:  # one variant in this process (see run_child)
    measured = run_variant(args.variant, variant_config(args.variant, steps, args.workdir,
                                                         args.drafter, args.history_arms,
                                                         args.groups, args.train_problems,
                                                         args.combined_arms))
    with open(os.path.join(args.workdir, "variant.json"), "w") as f:
      json.dump(measured, f)
    return
  chosen = args.variants.split(",")
  if "baseline" not in chosen or not set(chosen) <= set(VARIANTS) or len(set(chosen)) < len(
      chosen):
    parser.error(f"--variants must list baseline and others of {','.join(VARIANTS)} once each")
  order = args.order.split(",") if args.order else chosen
  if sorted(order) != sorted(chosen):
    parser.error(f"--order must list each of {','.join(chosen)} once")
  learned = any(VARIANTS[n][0] for n in chosen)
  load_before = os.getloadavg()
  repeats = args.repeats or (1 if args.quick else 3)
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    drafter_dir = args.drafter
    warm = {}
    if learned and not drafter_dir:
      drafter_dir = os.path.join(tmp, "drafter")
      # 24 batches (768 samples): with 6 the drafter memorized its data (top-1 agreement 0.98
      # on it, 0.76 on fresh rollouts); 1500 steps is about 4 epochs of it.
      warmup(base_config(steps, os.path.join(tmp, "warmup"), 2, args.train_problems),
             rollouts=2 if args.quick else 24, steps=60 if args.quick else 1500, out=drafter_dir)
    if learned:
      with open(os.path.join(drafter_dir, "warmup.json")) as f:
        warm = json.load(f)
    runs = {name: [] for name in chosen}
    orders = []
    for r in range(repeats):
      # A Latin square over the repeats: each variant runs first, middle and last once, so a
      # drift of the machine's speed does not favour one of them.
      this_order = order[r % len(order):] + order[:r % len(order)]
      orders.append(this_order)
      for name in this_order:
        workdir = os.path.join(tmp, f"{name}-{r}")
        os.makedirs(workdir)
        runs[name].append(run_child(name, steps, drafter_dir, workdir, args.history_arms,
                                    args.groups, args.train_problems, args.combined_arms))
  trajectories = [run["reward_mean_by_step"] for rs in runs.values() for run in rs]
  variants = {name: aggregate(rs) for name, rs in runs.items()}
  base = variants["baseline"]
  paired = lambda name: [b["step_s_total"] / t["step_s_total"]
                         for b, t in zip(runs["baseline"], runs[name])]
  speedups = {}
  if "tlt" in variants:  # the learned drafter, spot-trained
    tlt = variants["tlt"]
    speedups.update(speedup_end_to_end=base["step_s_total"] / tlt["step_s_total"],
                    speedup_rollout=base["rollout_s_total"] / tlt["rollout_s_total"],
                    speedup_end_to_end_by_repeat=paired("tlt"))
  if "static_drafter" in variants:
    speedups["speedup_static_end_to_end"] = (base["step_s_total"]
                                             / variants["static_drafter"]["step_s_total"])
  # The tuner free over off and model-free arms (history), or the learned drafter's chains and
  # its combined trees (combined): each variant's figures under its own suffix.
  for name in ("history", "combined"):
    if name in variants:
      v = variants[name]
      speedups.update({
          f"speedup_end_to_end_{name}": base["step_s_total"] / v["step_s_total"],
          f"speedup_rollout_{name}": base["rollout_s_total"] / v["rollout_s_total"],
          f"speedup_end_to_end_{name}_by_repeat": paired(name),
          f"sd_chunk_fraction_{name}_by_step": [[s["sd_chunk_fraction"] for s in run["per_step"]]
                                                for run in runs[name]]})
  result = {
      "machine": f"{platform.machine()} {os.cpu_count()} cpus, 2 host devices",
      "config": f"tiny_arith, mix {MIX}, 8 prompts x 4 samples, {args.groups} rollout groups",
      "train_problems": args.train_problems or config_lib.load_config_file(
          CONFIG).data.synthetic_train,
      "steps": steps,
      "repeats": repeats,
      "orders": orders,
      "history_arms": args.history_arms,
      "combined_arms": args.combined_arms,
      "warmup": {k: warm[k] for k in ("examples", "tokens", "steps", "final", "seconds")
                 if k in warm},
      "variants": variants,
      "same_trajectory": all(t == trajectories[0] for t in trajectories),
      # Medians over the repeats (each run a fresh process); *_by_repeat: baseline / variant
      # within each repeat (the two ran minutes apart), the spread of the figure.
      **speedups,
      "speedup_train_equalized": train_equalized(variants),
      # Amdahl: the baseline's share of step time spent in rollout, and the end-to-end speedup
      # even an infinitely fast rollout could give with this trainer on this machine.
      "rollout_share_baseline": base["rollout_s_total"] / base["step_s_total"],
      "speedup_bound_if_rollout_were_free": base["step_s_total"] / (
          base["step_s_total"] - base["rollout_s_total"]),
      "accept_len_by_step": {name: [[s["accept_len"] for s in run["per_step"]] for run in rs]
                             for name, rs in runs.items()},
      "seconds": time.perf_counter() - start,
      # other processes share these 2 cores: the 1-minute load average before and after
      "load_average": [load_before[0], os.getloadavg()[0]],
  }
  os.makedirs(RESULTS_DIR, exist_ok=True)
  path = os.path.join(RESULTS_DIR, args.out or ("tlt_quick.json" if args.quick else "tlt.json"))
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
