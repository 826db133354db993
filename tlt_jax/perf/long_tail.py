"""Discrete-event simulation of one RL step (rollout + train) on D devices: the long tail.

Its command line, which writes the report and its figure: `experiments/simulate_long_tail.py`

    python -m experiments.simulate_long_tail [--quick] [--seed 0] [--devices 8 64 256 1024]

Plans what CPU runs cannot reach: D devices split into data-parallel rollout groups (8 devices
each by default), each group decoding its share of the batch with continuous batching. A group
that has finished all its sequences idles until the rollout barrier (the slowest group); that
idle time is what TLT lends to drafter training. Three variants, on the same drawn lengths:
`baseline` (no SD), `sd_static` (SD once a group has <= `sd_threshold` live rows, with the
measured accept length) and `tlt` (the same, with an adaptive drafter whose accept length is
`1 + tlt_accept_gain` times higher). Each D is simulated for `--trials` independent steps (8;
`--quick`: 2, with 64 rather than 256 samples per group), and the report holds their means (and
the range of speedups): one step's slowest group is a noisy statistic. The CLI prints the
report as one JSON object and writes experiments/results/simulation.json and simulation.png
(`--quick`: *_quick.json / *_quick.png).

Assumptions (all in `Params`; the report repeats them under "assumptions"):
- Lengths: log-normal, median 3000 tokens, sigma 0.85, cut at 32768 (rounded, at least 16).
  ../shared/reference/tlt.md states no length statistics beyond the cap: TLT's recipes use a
  max response of 32K (grpo_7B.sh, 32B recipe) and the ByteDance trace has its max "far above the
  75th percentile". sigma 0.85 puts 2.9% of responses above 5x the median and 0.3% above 10x,
  i.e. "a few % are 5-10x the median"; a median of 3K puts 10x the median at the 32K cap. The
  median is an assumption, not a published number.
- Batch: 256 responses per 8-device group (both TLT recipes: 64 prompts x 8 on a node with
  rollout TP 4 = 2 replicas of 256; 32B: 32 prompts x 8 per node, TP 8), weak scaling (the batch
  grows with D). `max_live` 512 = SGLang's max_running_requests in TLT's rollout, so by default
  every row starts at once; a smaller `max_live` refills slots first come, first served.
- Decode step cost(b) = fixed_s + per_row_s * b, a least-squares line through the step times
  b / plain_tokens_per_s at batch 1, 2, 4 of experiments/results/rollout.json (`fit_step_cost`).
  Time is therefore in seconds of this CPU running the 8-layer test model; only ratios mean
  anything. On this CPU per_row/fixed is ~0.19 (decode is compute-bound, the weights sit in
  cache); a memory-bound accelerator is nearer 0.02 (our roofline estimate for a 32B model at
  TP 8, see `build_report`; `sensitivity` reruns with it), where a few rows cost nearly as much
  as a full batch. Prefill, the SD switch and rewards are not modelled.
- SD: once live rows <= sd_threshold (32, TLT's bs_threshold), each round emits `accept_len`
  tokens per row and costs (1 + sd_overhead) x cost(b). Both from rollout.json at batch <= 4
  (the tail's batch sizes), with the tuner's chosen arm: accept = mean accept length,
  overhead = mean(accept / measured speedup) - 1 (`fit_sd`). Assumed flat in b up to the
  threshold: optimistic for this compute-bound CPU (chain4's overhead grows to ~2.3 at b = 16),
  fair for memory-bound decode. No hysteresis (TLT waits 10 small batches).
- tlt_accept_gain 0.2: tlt.md has no adaptive-vs-static ablation (section 3 lists acceptance
  over RL steps and the ablations as not obtained). The evidence bounds it loosely: marin saw no
  decay over 36 RL steps without updates (a gain near 0 over short horizons), challenge C1 says
  a static drafter goes stale over a run; 20% is the spread between the two accept lengths
  NeMo-RL reports (2.47 vs 2.05). `sensitivity` sweeps 0-40%. With no idle devices (one group)
  nothing trains, so `tlt` falls back to the static accept length.
- Train time: rollout is 85% of the baseline step (tlt.md section 1: "~85% of step time"), set
  per D, so train_s = baseline rollout_s * 0.15 / 0.85; drafter training on idle devices adds
  nothing (interference-free). End-to-end speedup = baseline step / variant step.
- Drafter capacity = idle device-seconds / drafter_step_device_s, with 0.40 device-s per step =
  rollout.json's drafter warm-up (240.6 s for 600 steps of 32 sequences, which also includes the
  warm-up's rollout and compiles, so an upper bound) in the same CPU seconds as the decode model;
  data-parallel training is assumed to scale perfectly over a group's devices.

Report keys: seed, quick, params, assumptions, derivation, configs (one per D: devices, groups,
samples, trials, train_s, variants{baseline, sd_static, tlt} each with VARIANT_KEYS), sensitivity
(speedups per D for other per_row/fixed ratios and other tlt_accept_gain values).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import os

import numpy as np

# The measurements the model is fitted to: `experiments/bench_rollout.py`'s report, kept with
# the repository's results (the package is installed editable: `pip install -e .`).
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROLLOUT_JSON = os.path.join(_REPO, "experiments", "results", "rollout.json")
DEVICES = (8, 64, 256, 1024)
VARIANTS = ("baseline", "sd_static", "tlt")
VARIANT_KEYS = ("accept_len", "drafter_trained", "rollout_s", "step_s", "idle_fraction",
                "tail_fraction", "idle_device_s", "drafter_steps", "rollout_speedup",
                "speedup", "speedup_range")
CONFIG_KEYS = ("devices", "groups", "samples", "trials", "train_s", "variants")
REPORT_KEYS = ("seed", "quick", "params", "assumptions", "derivation", "configs", "sensitivity")
DRAFTER_WARMUP_STEPS = 600  # bench_rollout.py's full run (`steps=150 if quick else 600`)
FIT_BATCHES = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class Params:
  fixed_s: float  # decode step cost at batch b: fixed_s + per_row_s * b
  per_row_s: float
  accept_len: float  # tokens per row per SD round (static drafter)
  sd_overhead: float  # an SD round costs (1 + sd_overhead) plain steps
  drafter_step_device_s: float  # device-seconds per drafter training step
  devices_per_group: int = 8
  samples_per_group: int = 256
  max_live: int = 512
  median_tokens: float = 3000.0
  sigma: float = 0.85
  min_tokens: int = 16
  max_tokens: int = 32768
  sd_threshold: int = 32
  tlt_accept_gain: float = 0.2
  min_drafter_steps: float = 1.0  # below this the adaptive drafter cannot adapt
  rollout_fraction: float = 0.85
  # Measured step costs per bucket, ((bucket, plain step s, SD round s), ...) in increasing
  # buckets: when given, a step with `live` rows costs the smallest bucket >= live (the engine
  # runs bucket-shaped programs), replacing fixed_s + per_row_s * live and sd_overhead.
  bucket_step_s: tuple[tuple[int, float, float], ...] = ()
  # Devices that share compute (host devices of one CPU's cores): the same table measured while
  # another group decodes beside it (`decoding_bucket_step_s`) and while the drafter trains on
  # another device (`contended_bucket_step_s`, the drafter's step then taking
  # `contended_drafter_step_s`). When given, every group pays the first until the first group
  # finishes; from then on the others pay the second in a variant that trains the drafter there
  # (else their own costs), and that variant's rollout waits at the barrier for the drafter step
  # in flight (its rest at the uncontended speed). Exact for two groups (bench_tlt's), an
  # approximation beyond (the others still decode beside each other after the first finish).
  decoding_bucket_step_s: tuple[tuple[int, float, float], ...] = ()
  contended_bucket_step_s: tuple[tuple[int, float, float], ...] = ()
  contended_drafter_step_s: float = 0.0

  def step_s(self, live: int, sd: bool, beside: str = "") -> float:
    """One plain step (or SD round, `sd`) with `live` rows; `beside`: what shares the group's
    compute ("decoding": another group, "drafter": the drafter's training; "" nothing)."""
    table = {"decoding": self.decoding_bucket_step_s,
             "drafter": self.contended_bucket_step_s}.get(beside) or self.bucket_step_s
    if table:
      for bucket, plain, sd_round in table:
        if live <= bucket:
          return sd_round if sd else plain
      raise ValueError(f"{live} live rows exceed the largest bucket {self.bucket_step_s[-1][0]}")
    return (self.fixed_s + self.per_row_s * live) * ((1.0 + self.sd_overhead) if sd else 1.0)


def load_rollout(path: str = ROLLOUT_JSON) -> dict:
  with open(path) as f:
    return json.load(f)


def fit_step_cost(rollout: dict, batches: tuple[int, ...] = FIT_BATCHES) -> dict:
  """Least-squares cost(b) = fixed + per_row * b through measured plain step times b / tok/s."""
  rows = {r["batch_size"]: r for r in rollout["batch_sizes"]}
  b = np.array(batches, np.float64)
  step_s = np.array([x / rows[x]["plain_tokens_per_s"] for x in batches])  # one step emits b tokens
  per_row, fixed = np.polyfit(b, step_s, 1)
  return dict(batches=list(batches), step_s_measured=step_s.tolist(),
              step_s_fit=(fixed + per_row * b).tolist(), fixed_s=float(fixed),
              per_row_s=float(per_row), per_row_over_fixed=float(per_row / fixed))


def fit_sd(rollout: dict, batches: tuple[int, ...] = FIT_BATCHES) -> dict:
  """Accept length and per-round overhead of the tuner's arm at the tail's batch sizes.

  A round emits `accept` tokens per row in (1 + overhead) plain steps, so the measured speedup
  is accept / (1 + overhead) and overhead = accept / speedup - 1.
  """
  rows = {r["batch_size"]: r for r in rollout["batch_sizes"]}
  accept = np.array([rows[x]["accept_len"] for x in batches])
  overhead = accept / np.array([rows[x]["speedup"] for x in batches]) - 1.0
  return dict(batches=list(batches), arms=[rows[x]["arm"] for x in batches],
              accept_len_measured=accept.tolist(), overhead_measured=overhead.tolist(),
              accept_len=float(accept.mean()), sd_overhead=float(overhead.mean()))


def default_params(rollout: dict | None = None, **overrides) -> Params:
  rollout = load_rollout() if rollout is None else rollout
  cost, sd = fit_step_cost(rollout), fit_sd(rollout)
  drafter_s = rollout["drafter_warmup"]["seconds"] / DRAFTER_WARMUP_STEPS
  kw = dict(fixed_s=cost["fixed_s"], per_row_s=cost["per_row_s"], accept_len=sd["accept_len"],
            sd_overhead=sd["sd_overhead"], drafter_step_device_s=drafter_s)
  kw.update(overrides)
  return Params(**kw)


def draw_lengths(rng: np.random.Generator, n: int, p: Params) -> np.ndarray:
  """Response lengths in tokens: log-normal(median, sigma), cut to [min_tokens, max_tokens]."""
  raw = p.median_tokens * np.exp(p.sigma * rng.standard_normal(n))
  return np.clip(np.rint(raw), p.min_tokens, p.max_tokens).astype(np.int64)


@dataclasses.dataclass
class GroupResult:
  finish_s: float  # when its last row finished
  tail_s: float  # time spent with 1..sd_threshold live rows
  steps: int  # decode steps (SD rounds count as one)
  trace_t: list[float]  # (time, live rows after it) at every change, if asked
  trace_live: list[int]


def simulate_group(lengths: np.ndarray, p: Params, accept: float | None,
                   trace: bool = False,
                   phases: tuple[tuple[float, str], ...] = ((0.0, ""),)) -> GroupResult:
  """Continuous batching of one group's rows; `accept` None = no SD.

  Every live row advances at the same rate (1 token per step, or `accept` per SD round), so a
  row's finish is fixed in "progress" (tokens per live row since the start): admitted at
  progress P, it ends at P + length. A heap of those finishes gives the next event; between
  events the live count, hence the step cost, is constant. Steps are whole: the event step is
  the first one at which the shortest row has all its tokens. `phases`: ((from_s, beside), ...)
  in increasing time, what shares the group's compute from then on (`Params.step_s`); a run of
  steps is cut where a phase begins.
  """
  lengths = [int(x) for x in lengths]
  heap = lengths[:p.max_live]
  heapq.heapify(heap)
  pending = p.max_live
  progress = t = tail_s = 0.0
  steps = 0
  trace_t, trace_live = ([0.0], [len(heap)]) if trace else ([], [])
  while heap:
    live = len(heap)
    sd = accept is not None and live <= p.sd_threshold
    rate = accept if sd else 1.0
    now = [i for i, (start, _) in enumerate(phases) if start <= t]
    phase = now[-1] if now else 0
    step_s = p.step_s(live, sd, phases[phase][1])
    k = max(1, math.ceil((heap[0] - progress) / rate - 1e-9))
    if phase + 1 < len(phases):
      k = min(k, max(1, math.ceil((phases[phase + 1][0] - t) / step_s - 1e-9)))
    progress += k * rate
    t += k * step_s
    steps += k
    if live <= p.sd_threshold:
      tail_s += k * step_s
    while heap and heap[0] <= progress + 1e-9:
      heapq.heappop(heap)
      if pending < len(lengths):  # a freed slot takes the next waiting sample
        heapq.heappush(heap, progress + lengths[pending])
        pending += 1
    if trace:
      trace_t.append(t)
      trace_live.append(len(heap))
  return GroupResult(t, tail_s, steps, trace_t, trace_live)


def simulate_rollout(lengths: np.ndarray, devices: int, p: Params, accept: float | None,
                     trace_group: int | None = None, drafter: bool = False) -> dict:
  """One rollout on `devices` devices: the batch split evenly (in order) over the groups.
  `drafter`: the drafter trains on finished groups' devices (only changes anything when devices
  share compute, `p.decoding_bucket_step_s` / `p.contended_bucket_step_s`: then a drafter step
  starts the moment the first group finishes and the barrier waits for the one in flight)."""
  groups = devices // p.devices_per_group
  if groups < 1 or devices % p.devices_per_group:
    raise ValueError(f"{devices} devices do not split into groups of {p.devices_per_group}")
  if len(lengths) % groups:
    raise ValueError(f"{len(lengths)} samples do not split over {groups} groups")
  parts = np.split(np.asarray(lengths), groups)
  shared = groups > 1 and bool(p.decoding_bucket_step_s or p.contended_bucket_step_s)
  start = ((0.0, "decoding"),) if shared else ((0.0, ""),)
  res = [simulate_group(part, p, accept, trace=(g == trace_group), phases=start)
         for g, part in enumerate(parts)]
  finish = np.array([r.finish_s for r in res])
  if shared:  # from the first finish on: the drafter's steps beside the others, or nothing
    first = int(finish.argmin())
    after = (float(finish[first]), "drafter" if drafter else "")
    res = [r if g == first else simulate_group(part, p, accept, trace=(g == trace_group),
                                               phases=start + (after,))
           for g, (r, part) in enumerate(zip(res, parts))]
    finish = np.array([r.finish_s for r in res])
  shared = shared and drafter and p.contended_drafter_step_s > 0
  rollout_s = float(finish.max())  # the barrier: everyone waits for the slowest group
  idle = float(p.devices_per_group * (rollout_s - finish).sum())
  drafter_steps = idle / p.drafter_step_device_s
  if shared:
    # Steps run back to back from the first finish (one in flight at a time); at the barrier
    # the step in flight finishes alone, at the uncontended speed.
    done = (rollout_s - float(finish.min())) / p.contended_drafter_step_s
    drafter_steps = float(math.ceil(done)) if done > 0 else 0.0
    rollout_s += (drafter_steps - done) * p.drafter_step_device_s
    idle = float(p.devices_per_group * (rollout_s - finish).sum())
  total = devices * rollout_s
  tail = float(p.devices_per_group * sum(r.tail_s for r in res))
  out = dict(rollout_s=rollout_s, idle_device_s=idle, idle_fraction=idle / total if total else 0.0,
             tail_fraction=tail / total if total else 0.0, drafter_steps=drafter_steps,
             slowest_group=int(finish.argmax()), first_done_s=float(finish.min()))
  if trace_group is not None:
    out["trace"] = (res[trace_group].trace_t, res[trace_group].trace_live)
  return out


def simulate_step(lengths: np.ndarray, devices: int, p: Params,
                  trace_group: int | None = None) -> dict:
  """The three variants on the same lengths; train time is set from the baseline rollout."""
  runs = {"baseline": (None, simulate_rollout(lengths, devices, p, None, trace_group)),
          "sd_static": (p.accept_len, simulate_rollout(lengths, devices, p, p.accept_len,
                                                       trace_group))}
  boosted = p.accept_len * (1.0 + p.tlt_accept_gain)
  tlt = simulate_rollout(lengths, devices, p, boosted, trace_group, drafter=True)
  trained = tlt["drafter_steps"] >= p.min_drafter_steps
  runs["tlt"] = (boosted, tlt) if trained else runs["sd_static"]
  base_rollout = runs["baseline"][1]["rollout_s"]
  train_s = base_rollout * (1.0 - p.rollout_fraction) / p.rollout_fraction
  variants, traces = {}, {}
  for name, (accept, r) in runs.items():
    step_s = r["rollout_s"] + train_s
    variants[name] = dict(
        accept_len=1.0 if accept is None else accept, drafter_trained=name == "tlt" and trained,
        rollout_s=r["rollout_s"], step_s=step_s, idle_fraction=r["idle_fraction"],
        tail_fraction=r["tail_fraction"], idle_device_s=r["idle_device_s"],
        drafter_steps=r["drafter_steps"], rollout_speedup=base_rollout / r["rollout_s"],
        speedup=(base_rollout + train_s) / step_s)
    if "trace" in r:
      traces[name] = r["trace"]
  return dict(devices=devices, groups=devices // p.devices_per_group, samples=len(lengths),
              train_s=train_s, variants=variants,
              slowest_group=runs["baseline"][1]["slowest_group"], traces=traces)


def lengths_for(seed: int, devices: int, p: Params, trial: int = 0) -> np.ndarray:
  # One stream per (seed, D, trial): adding a D or a trial does not change the others' draws.
  n = (devices // p.devices_per_group) * p.samples_per_group
  return draw_lengths(np.random.default_rng([seed, devices, trial]), n, p)


def simulate_config(p: Params, seed: int, devices: int, trials: int,
                    trace: bool = False) -> tuple[dict, dict]:
  """`trials` independent RL steps at D devices, averaged (one step's max is a noisy statistic).

  Returns (config, traces); traces are trial 0's slowest group, if asked.
  """
  steps, traces = [], {}
  for trial in range(trials):
    lengths = lengths_for(seed, devices, p, trial)
    group = None
    if trace and trial == 0:  # trace the group that sets the barrier (found on a first pass)
      group = simulate_rollout(lengths, devices, p, None)["slowest_group"]
    steps.append(simulate_step(lengths, devices, p, trace_group=group))
    if group is not None:
      traces = dict(steps[-1]["traces"], devices=devices, group=group, threshold=p.sd_threshold)
  variants = {}
  for name in VARIANTS:
    runs = [s["variants"][name] for s in steps]
    v = {k: float(np.mean([r[k] for r in runs])) for k in VARIANT_KEYS
         if k not in ("drafter_trained", "speedup_range")}
    v["drafter_trained"] = all(r["drafter_trained"] for r in runs)
    v["speedup_range"] = [min(r["speedup"] for r in runs), max(r["speedup"] for r in runs)]
    variants[name] = {k: v[k] for k in VARIANT_KEYS}
  config = dict(devices=devices, groups=steps[0]["groups"], samples=steps[0]["samples"],
                trials=trials, train_s=float(np.mean([s["train_s"] for s in steps])),
                variants=variants)
  return config, traces


def assumptions(p: Params) -> list[str]:
  return [
      f"lengths: log-normal median {p.median_tokens:g} tokens, sigma {p.sigma:g}, cut to "
      f"[{p.min_tokens}, {p.max_tokens}]; 32K cap from TLT's recipes (tlt.md s4), shape chosen "
      "so a few % are 5-10x the median; the median is assumed",
      f"{p.samples_per_group} responses per {p.devices_per_group}-device group (TLT recipes: "
      f"256 per rollout replica), weak scaling; max_live {p.max_live} (SGLang "
      "max_running_requests in TLT)",
      f"step cost(b) = {p.fixed_s:.4g} s + {p.per_row_s:.4g} s * b: fit to rollout.json plain "
      "tok/s at batch 1, 2, 4 (CPU, 8-layer model); only ratios are meaningful",
      f"SD when live <= {p.sd_threshold} (TLT bs_threshold): accept {p.accept_len:.3g}, round "
      f"cost (1 + {p.sd_overhead:.3g}) x step, from rollout.json at batch <= 4",
      f"tlt accept = static x {1 + p.tlt_accept_gain:g} (assumed: no ablation in tlt.md); no "
      "gain when no idle device can train the drafter",
      f"rollout = {p.rollout_fraction:g} of the baseline step at every D (tlt.md s1, ~85%); "
      "drafter training on idle devices costs the step nothing",
      f"drafter step = {p.drafter_step_device_s:.3g} device-s (rollout.json warm-up / 600 steps)",
      "not modelled: prefill, the SD switch's re-prefill, SD hysteresis, rewards, context-length "
      "dependence of the step cost",
  ]


def speedups(p: Params, seed: int, devices: tuple[int, ...], trials: int) -> dict:
  return {str(d): {v: r["speedup"] for v, r in
                   simulate_config(p, seed, d, trials)[0]["variants"].items()} for d in devices}


def build_report(p: Params, seed: int = 0, devices: tuple[int, ...] = DEVICES,
                 quick: bool = False, trace_devices: int | None = 64, trials: int = 8,
                 sensitivity: bool = True, rollout: dict | None = None) -> tuple[dict, dict]:
  """(report, traces): traces[name] = (times, live rows) of the slowest group at trace_devices."""
  rollout = load_rollout() if rollout is None else rollout
  configs, traces = [], {}
  for d in devices:
    config, tr = simulate_config(p, seed, d, trials, trace=d == trace_devices)
    configs.append(config)
    traces = tr or traces
  sens: dict = {}
  if sensitivity:
    # The CPU fit is compute-bound; a 32B model at TP 8 reads ~8 GB of weights per GPU per step
    # against ~33 KB of KV per token of context per GPU, i.e. per_row/fixed ~ 0.02 at ~5K-token
    # contexts: memory-bound, the regime where a few rows cost nearly a full batch.
    ratios = {"cpu_fit": p.per_row_s / p.fixed_s, "0.05": 0.05, "memory_bound_0.02": 0.02}
    sens["per_row_over_fixed"] = {
        name: speedups(dataclasses.replace(p, per_row_s=r * p.fixed_s), seed, devices, trials)
        for name, r in ratios.items()}
    sens["tlt_accept_gain"] = {
        f"{g:g}": {d: s["tlt"] for d, s in
                   speedups(dataclasses.replace(p, tlt_accept_gain=g), seed, devices,
                            trials).items()}
        for g in (0.0, 0.1, 0.2, 0.4)}
  report = dict(seed=seed, quick=quick, params=dict(dataclasses.asdict(p), trials=trials),
                assumptions=assumptions(p),
                derivation=dict(step_cost=fit_step_cost(rollout), sd=fit_sd(rollout),
                                drafter_step_device_s=dict(
                                    warmup_seconds=rollout["drafter_warmup"]["seconds"],
                                    steps=DRAFTER_WARMUP_STEPS)),
                configs=configs, sensitivity=sens)
  return report, traces
