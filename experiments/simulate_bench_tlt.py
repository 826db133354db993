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
  and numerics, one host device, programs timed alone, beside the other group's decoding and
  beside the drafter's training);
- the tuner's choices: tlt.json records, per step and arm, the share of the chunks the tuner ran
  with it and that arm's accept length (`arm_chunk_fraction/*`, `arm_accept_len/*`, the first
  repeat's steps). Each simulated step runs that mix: a round costs the arms' measured rounds
  weighted by their shares ("off" is a plain step), and emits their accept lengths so weighted.
  The bench does not record the arm per bucket, so the mix is the same in every bucket;
- train time: tlt.json's measured train phase (the same computation in every variant; the mean
  over the variants, as `speedup_train_equalized` takes it);
- drafter step: the measured SpotTrainer step (step costs file).
The bench's groups (2 of 1 host device, 16 samples each, all live at once: bucket 16 = the
group's share) and its buckets are config, taken from bench_tlt.base_config. The history
variant is not simulated: its rounds (a lookup on the host, no drafter passes) are not among
the measured step costs.

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
SIMULATED = ("static_drafter", "tlt")  # the variants whose SD rounds step_costs measures


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


def arm_mix(step: dict) -> dict[str, tuple[float, float]]:
  """One measured step's arms: {arm: (share of the chunks, accept length)}. "off" emits one
  token a step, as the simulator's plain decode does (measured 0.91-1.0: rows that finish inside
  a chunk idle to its end, which the simulator's whole-step finish already accounts for)."""
  prefix = "arm_chunk_fraction/"
  return {arm: (share, 1.0 if arm == "off" else step[f"arm_accept_len/{arm}"])
          for arm, share in ((k[len(prefix):], v) for k, v in step.items()
                             if k.startswith(prefix)) if share > 0}


def mean_accept(steps: list[dict], arm: str) -> float:
  """An arm's accept length over a run: its steps' figures weighted by its chunks in each."""
  pairs = [mix[arm] for mix in map(arm_mix, steps) if arm in mix]
  return float(sum(share * accept for share, accept in pairs) / sum(s for s, _ in pairs))


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
  if not any(k.startswith("arm_chunk_fraction/") for k in v["tlt"]["per_step"][0]):
    sys.exit(f"{TLT_JSON} records no arm shares per step (arm_chunk_fraction/*): it predates "
             "them; re-run python -m experiments.bench_tlt")
  # The replay must be this tlt.json's trajectory (checked here, not trusted from the replay).
  same = dict(reward_mean_by_step=lengths["reward_mean_by_step"]
              == v["baseline"]["runs"][0]["reward_mean_by_step"],
              response_len_max=lengths["response_len_max"]
              == [s["response_len_max"] for s in v["baseline"]["per_step"]])
  return dict(tlt=tlt, lengths=lengths, same_trajectory=same, costs=costs, by_key=by_key,
              steps={name: v[name]["per_step"] for name in SIMULATED},
              train_s=float(np.mean([x["train_s_total"] for x in v.values()])) / tlt["steps"],
              drafter_step_s=by_key["drafter train step"],
              buckets=tuple(costs["buckets"]), arms=tuple(costs["arms"]))


def round_table(inp: dict, mix: dict[str, tuple[float, float]], beside: str = "") -> tuple:
  """((bucket, plain step s, mixed round s), ...): a round of `mix` costs its arms' measured
  rounds weighted by their chunk shares (an "off" round is a plain step); `beside`: the costs
  measured with that running on the other host device."""
  key = lambda program: program + (f" + {beside}" if beside else "")
  total = sum(share for share, _ in mix.values())
  return tuple(
      (b, inp["by_key"][key(f"decode[{b}]")],
       sum(share * inp["by_key"][key(f"decode[{b}]" if arm == "off" else f"verify[{arm}][{b}]")]
           for arm, (share, _) in mix.items()) / total)
      for b in inp["buckets"])


def simulate(inp: dict, policy: str, contention: bool = True) -> dict:
  """SD off / static drafter / tlt over the bench's 10 steps. `policy` "measured": each step
  runs the arms the bench's tuner ran in it, in the measured shares with the measured accept
  lengths (tlt.json records them per step and arm: the first repeat's steps); an arm's name:
  that arm in every chunk, at its accept length over the run."""
  from tlt_jax.perf import long_tail  # noqa: PLC0415

  groups = 2
  per_group = len(inp["lengths"]["lengths"][0]) // groups

  def params(mix):
    shared = dict(decoding_bucket_step_s=round_table(inp, mix, "the other group decoding"),
                  contended_bucket_step_s=round_table(inp, mix, "drafter training"),
                  contended_drafter_step_s=inp["by_key"]["drafter train step + decoding"])
    return long_tail.Params(
        fixed_s=0.0, per_row_s=0.0, accept_len=0.0, sd_overhead=0.0,
        drafter_step_device_s=inp["drafter_step_s"], devices_per_group=1,
        samples_per_group=per_group, max_live=max(inp["buckets"]),
        sd_threshold=max(inp["buckets"]), bucket_step_s=round_table(inp, mix),
        **(shared if contention else {}))

  def mix_of(variant, step):
    if policy == "measured":
      return arm_mix(inp["steps"][variant][step])
    return {policy: (1.0, mean_accept(inp["steps"][variant], policy))}

  totals = {k: 0.0 for k in ("baseline",) + SIMULATED}
  accept = {k: [] for k in SIMULATED}
  idle = drafter_steps = 0.0
  for step, lengths in enumerate(inp["lengths"]["lengths"]):
    lengths = np.asarray(lengths)
    totals["baseline"] += long_tail.simulate_rollout(
        lengths, groups, params({"off": (1.0, 1.0)}), None)["rollout_s"]
    for variant in SIMULATED:
      mix = mix_of(variant, step)
      rate = sum(share * a for share, a in mix.values()) / sum(s for s, _ in mix.values())
      accept[variant].append(rate)
      # The drafter's buffer is empty in the first step (it holds the run's own rollouts): no
      # spot training there, as in the bench (drafter_steps 0 at step 1).
      r = long_tail.simulate_rollout(lengths, groups, params(mix), rate,
                                     drafter=variant == "tlt" and step > 0)
      totals[variant] += r["rollout_s"]
      if variant == "tlt":
        idle += r["idle_device_s"]
        drafter_steps += r["drafter_steps"]
  train = inp["train_s"] * len(inp["lengths"]["lengths"])
  step = {k: r + train for k, r in totals.items()}
  return dict(policy=policy, contention=contention, rollout_s=totals, train_s=train, step_s=step,
              accept_len_mean={k: float(np.mean(a)) for k, a in accept.items()},
              speedup_end_to_end=step["baseline"] / step["tlt"],
              speedup_static_end_to_end=step["baseline"] / step["static_drafter"],
              speedup_rollout=totals["baseline"] / totals["tlt"],
              idle_device_s=idle, drafter_steps=drafter_steps)


def build() -> dict:
  inp = inputs()
  tlt = inp["tlt"]
  policies = ("measured",) + inp["arms"]
  sims = {policy: simulate(inp, policy) for policy in policies}
  independent = {policy: simulate(inp, policy, contention=False) for policy in policies}
  v = tlt["variants"]
  measured = dict(speedup_end_to_end=tlt["speedup_end_to_end"],
                  speedup_static_end_to_end=tlt["speedup_static_end_to_end"],
                  speedup_rollout=tlt["speedup_rollout"],
                  rollout_s={k: v[k]["rollout_s_total"] for k in ("baseline",) + SIMULATED},
                  step_s={k: v[k]["step_s_total"] for k in ("baseline",) + SIMULATED},
                  drafter_steps=v["tlt"]["drafter_steps_total"],
                  idle_device_s=v["tlt"]["idle_device_s_total"])
  rel = lambda pred, meas: abs(pred - meas) / meas
  return dict(
      command="python -m experiments.simulate_bench_tlt", tolerance=TOLERANCE,
      measured=measured, simulated=sims, simulated_independent_devices=independent,
      rel_error_end_to_end={p: rel(s["speedup_end_to_end"], measured["speedup_end_to_end"])
                            for p, s in sims.items()},
      rel_error_static={p: rel(s["speedup_static_end_to_end"],
                               measured["speedup_static_end_to_end"])
                        for p, s in sims.items()},
      inputs=dict(
          lengths=f"{os.path.relpath(LENGTHS_JSON, RESULTS_DIR)}: the bench's own responses",
          same_trajectory_as_tlt_json=inp["same_trajectory"],
          step_costs=f"{os.path.relpath(STEP_COSTS_JSON, RESULTS_DIR)}: decode[b] and "
                     "verify[arm][b] per bucket, measured alone on one host device and beside "
                     "the other group's decoding or the drafter's training",
          decode_step_s={b: inp["by_key"][f"decode[{b}]"] for b in inp["buckets"]},
          sd_round_s={arm: {b: inp["by_key"][f"verify[{arm}][{b}]"] for b in inp["buckets"]}
                      for arm in inp["arms"]},
          arms_by_step={name: [arm_mix(s) for s in steps] for name, steps in inp["steps"].items()},
          arms_source="tlt.json per_step arm_chunk_fraction/* and arm_accept_len/* (the first "
                      "repeat's steps; off counted as 1 token a step)",
          accept_len_by_arm={name: {arm: mean_accept(steps, arm) for arm in inp["arms"]}
                             for name, steps in inp["steps"].items()},
          train_s_per_step=inp["train_s"], drafter_step_s=inp["drafter_step_s"],
          groups="2 x 1 host device, 16 samples each, bucket 16 = all live at once; every "
                 "chunk's arm from the measured shares, the same in every bucket"))


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
