"""The long-tail simulator against bench_tlt's measured CPU end-to-end ratio (issue 23's test).

    python -m experiments.simulate_bench_tlt --replay   # ~3 min: the bench's response lengths
    python -m experiments.simulate_bench_tlt            # ~1 s: simulate, compare, write the JSON

`tlt_jax.perf.long_tail` is run on what was measured on this CPU, never on the end-to-end ratio it
is compared with:
- response lengths: the bench's own. `bench_tlt` runs the same trajectory in every variant
  (`same_trajectory`), so `--replay` runs its baseline variant once (same config, seed, data)
  and records every response's length per step (experiments/results/tlt_lengths.json), checking
  that the replay's per-step rewards and longest responses equal tlt.json's;
- decode and SD-round step costs per bucket: `bench_step_costs --model bench_tlt`
  (experiments/results/step_costs_bench_tlt_cpu.json: the same model shape, engine settings
  and numerics, one host device, programs timed alone);
- accept lengths: tlt.json's measured medians per variant (static drafter, tlt);
- train time: tlt.json's measured train phase (the same computation in every variant; the mean
  over the variants, as `speedup_train_equalized` takes it);
- drafter step: the measured SpotTrainer step (step costs file).
The bench's groups (2 of 1 host device, 16 samples each, all live at once: bucket 16 = the
group's share), its tuner (SD in every bucket: sd_chunk_fraction ~1) and its buckets are
config, taken from bench_tlt.base_config.

Prints one JSON object and writes experiments/results/tlt_simulated.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TLT_JSON = os.path.join(RESULTS_DIR, "tlt.json")
LENGTHS_JSON = os.path.join(RESULTS_DIR, "tlt_lengths.json")
STEP_COSTS_JSON = os.path.join(RESULTS_DIR, "step_costs_bench_tlt_cpu.json")
OUT_JSON = os.path.join(RESULTS_DIR, "tlt_simulated.json")
TOLERANCE = 0.15


def replay(steps: int = 10) -> dict:
  """Runs bench_tlt's baseline variant in this process and records each step's response lengths
  (in sample order: the groups take the batch in order)."""
  from experiments import bench_tlt  # noqa: PLC0415 (sets the 2 host devices before JAX starts)
  import tempfile  # noqa: PLC0415

  import tlt_jax  # noqa: PLC0415
  from tlt_jax import logs, metrics  # noqa: PLC0415
  from tlt_jax.rl import step as step_lib  # noqa: PLC0415

  logs.configure("warning")
  lengths: list[list[int]] = []
  score = step_lib.score

  def recording_score(job, ro):
    scored = score(job, ro)
    lengths.append([int(x) for x in scored.lengths_N])
    return scored
  step_lib.score = recording_score
  try:
    with tempfile.TemporaryDirectory() as tmp:
      c = bench_tlt.variant_config("baseline", steps, tmp, "")
      tlt_jax.run_training(c, "baseline")
      rows = [r for r in metrics.read_jsonl(os.path.join(tmp, "metrics.jsonl"))
              if "reward_mean" in r]
  finally:
    step_lib.score = score
  with open(TLT_JSON) as f:
    measured = json.load(f)
  base = measured["variants"]["baseline"]
  return dict(
      command="python -m experiments.simulate_bench_tlt --replay",
      steps=steps, config=measured["config"], lengths=lengths,
      reward_mean_by_step=[r["reward_mean"] for r in rows],
      response_len_max=[r["response_len_max"] for r in rows],
      matches_tlt_json=dict(
          reward_mean_by_step=[r["reward_mean"] for r in rows] == base["runs"][0][
              "reward_mean_by_step"],
          response_len_max=[r["response_len_max"] for r in rows] == [
              s["response_len_max"] for s in base["per_step"]]))


def inputs() -> dict:
  """Everything the simulation takes, from the three measurement files and the bench's config."""
  from tlt_jax.perf import measured as measured_lib  # noqa: PLC0415

  with open(TLT_JSON) as f:
    tlt = json.load(f)
  with open(LENGTHS_JSON) as f:
    lengths = json.load(f)
  costs = measured_lib.load(STEP_COSTS_JSON).report
  by_key = {r["key"]: r["seconds"] for r in costs["programs"]}
  v = tlt["variants"]
  return dict(tlt=tlt, lengths=lengths, costs=costs, by_key=by_key,
              accept={"static_drafter": v["static_drafter"]["accept_len_mean"],
                      "tlt": v["tlt"]["accept_len_mean"]},
              train_s=float(np.mean([x["train_s_total"] for x in v.values()])) / tlt["steps"],
              drafter_step_s=by_key["drafter train step"],
              buckets=tuple(costs["buckets"]), arms=tuple(costs["arms"]))


def tuner_arms(inp: dict) -> dict[int, str]:
  """The arm the bench's tuner settles on in each bucket: the cheaper measured round. Its reward
  is tokens per second; with one accept length per variant (tlt.json does not split it by arm)
  that ranks arms by round cost alone."""
  return {b: min(inp["arms"], key=lambda a: inp["by_key"][f"verify[{a}][{b}]"])
          for b in inp["buckets"]}


def simulate(inp: dict, arm: str, contention: bool = True) -> dict:
  """SD off / static drafter / tlt over the bench's 10 steps, SD rounds costing `arm`'s measured
  round in each bucket (`arm` "tuner": each bucket's `tuner_arms` choice)."""
  from tlt_jax.perf import long_tail  # noqa: PLC0415

  buckets = inp["buckets"]
  arm_of = tuner_arms(inp) if arm == "tuner" else {b: arm for b in buckets}
  table = tuple((b, inp["by_key"][f"decode[{b}]"], inp["by_key"][f"verify[{arm_of[b]}][{b}]"])
                for b in buckets)
  beside = lambda what: tuple((b, inp["by_key"][f"decode[{b}] + {what}"],
                               inp["by_key"][f"verify[{arm_of[b]}][{b}] + {what}"])
                              for b in buckets)
  shared = dict(decoding_bucket_step_s=beside("the other group decoding"),
                contended_bucket_step_s=beside("drafter training"),
                contended_drafter_step_s=inp["by_key"]["drafter train step + decoding"])
  if not contention:
    shared = {}
  groups = 2
  per_group = len(inp["lengths"]["lengths"][0]) // groups
  p = long_tail.Params(fixed_s=0.0, per_row_s=0.0, accept_len=inp["accept"]["static_drafter"],
                       sd_overhead=0.0, drafter_step_device_s=inp["drafter_step_s"],
                       devices_per_group=1, samples_per_group=per_group,
                       max_live=max(buckets), sd_threshold=max(buckets), bucket_step_s=table,
                       **shared)
  totals = {k: 0.0 for k in ("baseline", "static_drafter", "tlt")}
  idle = drafter_steps = 0.0
  for step, lengths in enumerate(inp["lengths"]["lengths"]):
    lengths = np.asarray(lengths)
    totals["baseline"] += long_tail.simulate_rollout(lengths, groups, p, None)["rollout_s"]
    totals["static_drafter"] += long_tail.simulate_rollout(
        lengths, groups, p, inp["accept"]["static_drafter"])["rollout_s"]
    # The drafter's buffer is empty in the first step (it holds the run's own rollouts): no
    # spot training there, as in the bench (drafter_steps 0 at step 1).
    t = long_tail.simulate_rollout(lengths, groups, p, inp["accept"]["tlt"], drafter=step > 0)
    totals["tlt"] += t["rollout_s"]
    idle += t["idle_device_s"]
    drafter_steps += t["drafter_steps"]
  train = inp["train_s"] * len(inp["lengths"]["lengths"])
  step = {k: r + train for k, r in totals.items()}
  return dict(arm=arm, arm_by_bucket=arm_of, contention=contention, rollout_s=totals,
              train_s=train, step_s=step,
              speedup_end_to_end=step["baseline"] / step["tlt"],
              speedup_static_end_to_end=step["baseline"] / step["static_drafter"],
              speedup_rollout=totals["baseline"] / totals["tlt"],
              idle_device_s=idle, drafter_steps=drafter_steps)


def build() -> dict:
  inp = inputs()
  tlt = inp["tlt"]
  arms = ("tuner",) + inp["arms"]
  sims = {arm: simulate(inp, arm) for arm in arms}
  independent = {arm: simulate(inp, arm, contention=False) for arm in arms}
  measured = dict(speedup_end_to_end=tlt["speedup_end_to_end"],
                  speedup_static_end_to_end=tlt["speedup_static_end_to_end"],
                  speedup_rollout=tlt["speedup_rollout"],
                  rollout_s={k: v["rollout_s_total"] for k, v in tlt["variants"].items()},
                  step_s={k: v["step_s_total"] for k, v in tlt["variants"].items()})
  rel = lambda pred, meas: abs(pred - meas) / meas
  return dict(
      command="python -m experiments.simulate_bench_tlt", tolerance=TOLERANCE,
      measured=measured, simulated=sims, simulated_independent_devices=independent,
      rel_error_end_to_end={arm: rel(s["speedup_end_to_end"], measured["speedup_end_to_end"])
                            for arm, s in sims.items()},
      rel_error_static={arm: rel(s["speedup_static_end_to_end"],
                                 measured["speedup_static_end_to_end"])
                        for arm, s in sims.items()},
      inputs=dict(
          lengths=f"{os.path.relpath(LENGTHS_JSON, RESULTS_DIR)}: the bench's own responses "
                  f"(replay matches tlt.json: {inp['lengths']['matches_tlt_json']})",
          step_costs=f"{os.path.relpath(STEP_COSTS_JSON, RESULTS_DIR)}: decode[b] and "
                     "verify[arm][b] per bucket, measured alone on one host device",
          decode_step_s={b: inp["by_key"][f"decode[{b}]"] for b in inp["buckets"]},
          sd_round_s={arm: {b: inp["by_key"][f"verify[{arm}][{b}]"] for b in inp["buckets"]}
                      for arm in inp["arms"]},
          accept_len=dict(inp["accept"], source="tlt.json accept_len_mean (medians of the runs)"),
          train_s_per_step=inp["train_s"], drafter_step_s=inp["drafter_step_s"],
          groups="2 x 1 host device, 16 samples each, bucket 16 = all live at once, SD in every "
                 "bucket (the bench's sd_chunk_fraction ~1)"))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--replay", action="store_true")
  args = parser.parse_args()
  if args.replay:
    out = replay()
    with open(LENGTHS_JSON, "w") as f:
      json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "lengths"}, indent=2))
    if not all(out["matches_tlt_json"].values()):
      print("replay differs from tlt.json's trajectory", file=sys.stderr)
    return
  report = build()
  with open(OUT_JSON, "w") as f:
    json.dump(report, f, indent=2)
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
