"""Step costs from the cost model, for the long-tail simulator and the planner.

`long_tail` takes a decode step cost fixed + per_row x b, an SD round's overhead over a plain
step and an accept length. `tail_params` derives the first two from `cost_model` on a hardware
profile (in seconds of that hardware, not CPU units), for a serving stack that calls programs
its own way (`Stack`); accept lengths stay inputs, named with their sources by the caller.
`predict_config` does it for a tlt-jax config: the per-program breakdown (prefill, decode per
bucket, verify per arm and bucket, drafter forward and train step, policy train step, weight
sync) and the long-tail simulation of SD off, static SD and TLT driven by those costs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
from typing import NamedTuple

import numpy as np

from tlt_jax.model.transformer import ModelConfig
from tlt_jax.perf import calibration, long_tail, measured
from tlt_jax.perf import cost_model as cm
from tlt_jax.perf.hardware import Hardware
from tlt_jax.rollout.tuner import Arm, parse_arms


@dataclasses.dataclass(frozen=True)
class Stack:
  """How a serving stack turns decode work into program calls (each pays the profile's
  step_overhead_s): `plain_calls` per plain step; an SD round makes `round_calls_fixed` calls
  plus `round_calls_per_draft` per draft forward."""
  name: str
  plain_calls: float
  round_calls_fixed: float
  round_calls_per_draft: float
  extend_is_first_draft: bool = False  # the extend's output is the first draft level
  eagle3: bool = False
  draft_vocab: int | None = None
  source: str = ""

  def round_calls(self, depth: int) -> float:
    return self.round_calls_fixed + self.round_calls_per_draft * depth


# SGLang's EAGLE worker: the whole multi-step draft is one CUDA graph, then verify, then the
# draft extend: 3 calls per round whatever the depth (sglang eagle_worker.py / eagle draft
# cuda graph runner, as vendored in fastrl, tlt.md s2.3).
# The draft loop runs depth - 1 drafter forwards: its first level is the top-k of the previous
# round's extend.
SGLANG_EAGLE = Stack("sglang_eagle", 1.0, 3.0, 0.0, extend_is_first_draft=True,
                     source="SGLang EAGLE worker: draft graph (depth - 1 drafter forwards) + "
                            "verify + draft extend per round")
# vLLM V1's EAGLE proposer: one drafter call per draft token (the first over the accepted
# tokens), then the target's verify step.
VLLM_EAGLE3 = Stack("vllm_eagle3", 1.0, 1.0, 1.0, extend_is_first_draft=True, eagle3=True,
                    draft_vocab=32000,
                    source="vLLM V1 EagleProposer: K drafter forwards (the first over the "
                           "accepted tokens) + 1 target step; EAGLE-3 drafters with a 32K draft "
                           "vocabulary")


class Strategy(NamedTuple):
  """An SD strategy as the cost model needs it (a tlt-jax `Arm` has the same attributes; SGLang's
  trees, e.g. TLT's 8_4_48, may verify more tokens than an Arm allows)."""
  name: str
  depth: int
  topk: int  # 0 = chain
  verify_tokens: int


def tlt_jax_stack(chunk_steps: int) -> Stack:
  """tlt-jax: `rollout/steps.decode_chunk` runs chunk_steps rounds (plain or SD, drafter
  catch-up included) in ONE compiled program, so a round pays 1/chunk_steps of a call."""
  k = 1.0 / chunk_steps
  return Stack(f"tlt_jax(chunk_steps={chunk_steps})", k, k, 0.0,
               source="rollout/steps.py: one decode_chunk program per chunk_steps rounds")


def plain_cost(cfg: ModelConfig, rows: int, context: float, tp: int, stack: Stack) -> cm.Cost:
  return cm.forward(cfg, rows, 1, context, tp=tp, calls=stack.plain_calls)


def round_cost(cfg: ModelConfig, arm: Arm | Strategy, rows: int, context: float, tp: int,
               stack: Stack, extend_tokens: int | None = None) -> cm.Cost:
  """One SD round: the drafter's forwards per draft level (top-k tokens per row for a tree, one
  for a chain; depth - 1 of them where the extend's output is the first level), the target's
  verify of arm.verify_tokens per row, and the drafter's extend over the accepted tokens
  (default depth + 1, the most a round accepts on a path).

  A history arm (`rollout.history`, drafted on the host) runs no drafter forward: its round is
  the verify alone, but it is one program call per round (the next drafts continue the tokens
  this round accepts, which only the device knows), not 1/chunk_steps of one; its host drafting
  (~10 us per row, bench_history) is left out. A lookup arm (drafted on device inside a decode
  chunk) is the verify alone at the stack's per-round calls; its search, integer compares over
  the bucket's rows and the bank, is left out too; a combined arm (the learned chain and
  looked-up ones in one tree) pays the learned chain's drafter forwards and the whole tree's
  verify."""
  if getattr(arm, "is_history", False):
    return (cm.forward(cfg, rows, arm.verify_tokens, context, tp=tp, calls=0.0)
            + cm.Cost(calls=HISTORY_ROUND_CALLS))
  if getattr(arm, "is_lookup", False):
    return (cm.forward(cfg, rows, arm.verify_tokens, context, tp=tp, calls=0.0)
            + cm.Cost(calls=stack.round_calls_fixed))
  # A combined arm's drafter drafts one chain; the looked-up chains cost only the search.
  d, width = arm.depth, 1 if getattr(arm, "is_combined", False) else max(arm.topk, 1)
  kw = dict(tp=tp, eagle3=stack.eagle3, draft_vocab=stack.draft_vocab, calls=0.0)
  levels = d - 1 if stack.extend_is_first_draft else d
  drafts = cm.drafter_forward(cfg, rows, width, context, **kw).times(levels)
  extend = cm.drafter_forward(cfg, rows, d + 1 if extend_tokens is None else extend_tokens,
                              context, **kw)
  verify = cm.forward(cfg, rows, arm.verify_tokens, context, tp=tp, calls=0.0)
  return verify + drafts + extend + cm.Cost(calls=stack.round_calls(d))


def timed(pred: cm.Predictor | None, hw: Hardware, program: str, cost: cm.Cost,
          cfg: ModelConfig, tp: int = 1, **shape) -> tuple[float, str]:
  """(seconds, "measured" | "model"): a measured time of the same program at the same shape on
  `hw` (`perf.measured`, held by `pred`) wins over the roofline model."""
  if pred is None:
    return cm.seconds(cost, hw), "model"
  return pred.time(measured.key(program, cfg, tp=tp, **shape), cost)


def plain_seconds(cfg, b, context, tp, stack, hw, pred=None) -> tuple[float, str]:
  return timed(pred, hw, "decode", plain_cost(cfg, b, context, tp, stack), cfg, tp, bucket=b,
               context=context)


def round_seconds(cfg, arm, b, context, tp, stack, hw, pred=None) -> tuple[float, str]:
  return timed(pred, hw, "verify", round_cost(cfg, arm, b, context, tp, stack), cfg, tp,
               arm=arm.name, bucket=b, context=context)


HISTORY_ROUND_CALLS = 1.0  # rollout/engine.py: one history_round program per host round trip


def tail_params(cfg: ModelConfig, hw: Hardware, *, tp: int, context: float, arm: Arm | Strategy,
                stack: Stack, max_live: int, sd_threshold: int,
                pred: cm.Predictor | None = None) -> dict:
  """cost(b) = fixed + per_row x b: least squares over b = 1, 2, 4, ... max_live of the
  plain step; sd_overhead: the mean over the tail's buckets (b <= sd_threshold) of
  round / plain - 1, as `long_tail.fit_sd` takes it from measurements. Each step's time is the
  model's, or a measurement of the same program and shape held by `pred` (`sources` says which)."""
  bs = [b for b in (2 ** i for i in range(16)) if b <= max_live]
  plain_t = [plain_seconds(cfg, b, context, tp, stack, hw, pred) for b in bs]
  plain = np.array([t for t, _ in plain_t])
  per_row, fixed = (np.polyfit(np.array(bs, np.float64), plain, 1) if len(bs) > 1
                    else (0.0, plain[0]))
  tail = [b for b in bs if b <= sd_threshold]
  rounds_t = [round_seconds(cfg, arm, b, context, tp, stack, hw, pred) for b in tail]
  rounds = np.array([t for t, _ in rounds_t])
  ratio = rounds / plain[:len(tail)]
  sources = [src for _, src in plain_t + rounds_t]
  return dict(fixed_s=float(fixed), per_row_s=float(max(per_row, 0.0)),
              sd_overhead=float(ratio.mean() - 1.0), batches=bs, plain_step_s=plain.tolist(),
              tail_batches=tail, round_s=rounds.tolist(),
              measured_steps=sources.count("measured"), modelled_steps=sources.count("model"))


# ---------------------------------------------------------------------------------------------
# A tlt-jax config on its hardware: the step breakdown and the long-tail simulation.

# Accept lengths (tokens per SD round per row) of a drafter that has NOT followed the policy.
# Chains: EAGLE-1 on Llama-3.1-8B in vLLM (vllm issue 20780: K=2 2.10, K=4 2.39; an EAGLE-2-style
# feature drafter like ours). Trees: TLT's released drafter on its own rollouts gives 6.36-6.57
# at tree 8_4_48 (fastrl issue 13) - that is a drafter adapted to its policy, so the static
# figure is it divided by (1 + TLT_ACCEPT_GAIN).
TLT_ACCEPT_GAIN = 0.2  # long_tail.Params.tlt_accept_gain: assumed, no ablation published
ADAPTED_TREE_ACCEPT = 6.4
STATIC_ACCEPT = {"chain2": 2.10, "chain4": 2.39}
ACCEPT_SOURCES = {
    "chain2": "2.10: EAGLE-1, K=2, Llama-3.1-8B (vllm issue 20780)",
    "chain4": "2.39: EAGLE-1, K=4, Llama-3.1-8B (vllm issue 20780)",
    "tree": f"{ADAPTED_TREE_ACCEPT / (1 + TLT_ACCEPT_GAIN):.2f} = 6.4 / 1.2: TLT's released "
            "drafter at tree 8_4_48 reaches 6.36-6.57 (fastrl issue 13) on its own policy; a "
            "stale one assumed 1/1.2 of that",
    "tlt_gain": f"adaptive drafter = static x {1 + TLT_ACCEPT_GAIN:g} (long_tail's "
                "tlt_accept_gain; no published ablation), capped at depth + 1",
}
HARDWARE_OF = {"qwen2_5_7b_8gpu": "h100_sxm", "qwen2_5_32b_multihost": "h100_sxm",
               "r1_distill_qwen_7b_v5p64": "tpu_v5p"}


# Model-free arms (history / lookup): tokens per round measured on this repository's own GRPO
# rollouts, by `experiments/bench_lookup_replay.py` (bench_tlt's job: tiny_arith, 8 prompts x 4
# samples, 10 steps, every prompt new; its lookup_replay.json holds one `accept_len` per arm:
# lookup chains and trees, history_chain4 and history trees). Arms it does not replay take
# HISTORY_ACCEPT, an earlier replay of 24 groups (3 steps) through `HistoryDrafter` with a
# 4096-token global trie. An assumption anywhere else: no published accept lengths of Seer /
# SuffixDecoding fit these drafters as configured here.
LOOKUP_REPLAY_JSON = os.path.join(measured.RESULTS_DIR, "lookup_replay.json")
HISTORY_ACCEPT = {"history_chain2": 1.88, "history_chain4": 2.17, "history_chain8": 2.36}


def replayed_accept() -> dict[str, float]:
  """{arm name: accept length} from LOOKUP_REPLAY_JSON; {} without it (a wheel install has no
  experiments/results)."""
  return _read_replay(LOOKUP_REPLAY_JSON)


@functools.cache
def _read_replay(path: str) -> dict[str, float]:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return {a["arm"]: float(a["accept_len"]) for a in json.load(f)["arms"]}


def _model_free_sources() -> dict[str, str]:
  replayed = replayed_accept()
  fallback = ("history_chain2/4/8 1.88/2.17/2.36 where not replayed: an earlier replay of 24 "
              "tiny_arith GRPO groups through rollout.history (this repo); a lookup tree not "
              "replayed: its depth's lookup chain (a lower bound)")
  if not replayed:
    return {"history": fallback, "lookup": "lookup_chainN / lookup_treeD_W: history_chainN's / "
                                           "history_chainD's (no lookup_replay.json here)"}
  figures = ", ".join(f"{k} {v:.2f}" for k, v in sorted(replayed.items()))
  return {"model_free": f"{figures}: experiments/bench_lookup_replay.py on bench_tlt's job "
                        f"(experiments/results/lookup_replay.json, every prompt new); "
                        f"{fallback}; spot training does not change them"}


def static_accept(arm: Arm) -> float:
  if arm.is_history or arm.is_lookup:
    replayed = replayed_accept()
    if arm.name in replayed:
      return replayed[arm.name]
    if arm.is_lookup and f"lookup_chain{arm.depth}" in replayed:  # a tree's first chain: a bound
      return replayed[f"lookup_chain{arm.depth}"]
    return HISTORY_ACCEPT.get(f"history_chain{arm.depth}",
                              min(HISTORY_ACCEPT["history_chain8"], arm.depth + 1.0))
  if getattr(arm, "is_combined", False):  # its learned chain's, a lower bound
    return STATIC_ACCEPT.get(f"chain{arm.depth}", min(1.0 + 0.3 * arm.depth, arm.depth + 1.0))
  if arm.is_tree:
    return min(ADAPTED_TREE_ACCEPT / (1 + TLT_ACCEPT_GAIN), arm.depth + 1.0)
  return STATIC_ACCEPT.get(arm.name, min(1.0 + 0.3 * arm.depth, arm.depth + 1.0))


def adapted_accept(arm: Arm) -> float:
  if not arm.needs_drafter:  # the drafter trained on idle devices does not draft for these
    return static_accept(arm)
  return min(static_accept(arm) * (1 + TLT_ACCEPT_GAIN), arm.depth + 1.0)


def _job(c):
  """The config's shapes as the rollout and trainer see them."""
  from tlt_jax import config as config_lib  # noqa: PLC0415 (a config-free import for the rest)

  mcfg = config_lib.model_config(c)
  r = c.rollout
  groups = max(r.groups, 1) * max(c.distributed.num_processes, 1)
  devices = c.plan.device_count or c.mesh.data * c.mesh.fsdp * c.mesh.model
  per_group = devices // groups
  tp = per_group if r.tensor_parallel else 1
  samples = r.prompts_per_step * r.group_size
  arms = [a for a in parse_arms(c.tlt.arms) if a.depth]
  history = [a for a in parse_arms(c.rollout.history_arms) if a.depth]
  return mcfg, dict(history_arms=history, groups=groups, devices=devices, per_group=per_group,
                    tp=tp,
                    samples=samples, samples_per_group=samples // groups,
                    max_live=max(r.buckets), buckets=tuple(r.buckets), arms=arms,
                    prompt=r.max_prompt_len, max_new=r.max_new_tokens,
                    chunk_steps=r.chunk_steps)


def breakdown(c, hw: Hardware, *, context: float, train_seq: int,
              pred: cm.Predictor | None = None) -> list[dict]:
  """Seconds per call of every program the run compiles, on `hw`: the model's, or a measured
  time of the same program at the same shape (`pred`, see `perf.measured`); `source` says
  which."""
  mcfg, j = _job(c)
  stack = tlt_jax_stack(j["chunk_steps"])
  tp, rows = j["tp"], j["max_live"]
  out = []

  def add(program, cost, note="", key=None, **shape):
    seconds, source = (timed(pred, hw, key, cost, mcfg, tp, **shape) if key
                       else (cm.seconds(cost, hw), "model"))
    out.append(dict(program=program, seconds=seconds, source=source, bound=cm.bound(cost, hw),
                    gflop=cost.flops / 1e9, gbytes=cm.Cost(bytes=cost.bytes).bytes / 1e9,
                    note=note))

  add("prefill", cm.forward(mcfg, rows, j["prompt"], j["prompt"], tp=tp, logits_tokens=rows),
      f"{rows} rows x {j['prompt']} tokens, one call")
  for b in j["buckets"]:
    add(f"decode[{b}]", plain_cost(mcfg, b, context, tp, stack),
        f"one plain step, {context:g} slots attended; 1/{j['chunk_steps']} call",
        key="decode", bucket=b, context=context)
  for a in j["arms"] + j["history_arms"]:
    for b in j["buckets"]:
      if a.verify_tokens * b <= 1024:  # the tuner's memory bound (rollout/tuner.py)
        add(f"verify[{a.name}][{b}]", round_cost(mcfg, a, b, context, tp, stack),
            "one history round: verify of host-drafted tokens, one call" if a.is_history
            else "one lookup round: verify of drafts looked up on device" if a.is_lookup
            else "one SD round: drafts + verify + drafter catch-up", key="verify", arm=a.name,
            bucket=b, context=context)
  add("drafter forward", cm.drafter_forward(mcfg, rows, 1, context, tp=tp,
                                            calls=stack.plain_calls),
      f"{rows} rows x 1 token (inside a decode chunk)")
  t = c.tlt
  add("drafter train step", cm.drafter_train_step(mcfg, t.rows, t.row_len,
                                                  devices=j["per_group"]),
      f"{t.rows} x {t.row_len} tokens over a group's {j['per_group']} devices",
      key="drafter train step", rows=t.rows, row_len=t.row_len, devices=j["per_group"])
  add("policy train step", cm.train_step(mcfg, j["samples"], train_seq,
                                         lora_rank=c.lora.rank, devices=j["devices"],
                                         extra_forwards=1 + (1 if c.rl.kl_coef else 0)),
      f"{j['samples']} rows x {train_seq} tokens over {j['devices']} devices, LoRA rank "
      f"{c.lora.rank}", key="policy train step", rows=j["samples"], seq_len=train_seq,
      lora_rank=c.lora.rank, devices=j["devices"],
      extra_forwards=1 + (1 if c.rl.kl_coef else 0))
  drafter_bytes = (cm.layer_matmul_params(mcfg) + 2 * mcfg.hidden_size ** 2) * cm.itemsize(mcfg)
  add("weight sync", cm.weight_sync(drafter_bytes, j["per_group"]),
      "the drafter's weights to a group's devices (the engine serves the policy's own params)")
  return out


def predict_config(c, name: str, hw: Hardware, *, seed: int = 0, trials: int = 4,
                   measurements: list[measured.StepCosts] | None = None) -> dict:
  """SD off / static SD / adaptive SD / TLT for config `c` on `hw`, from the cost model, with
  measured program times where `measurements` (default: every bench_step_costs report under
  experiments/results) hold the same program at the same shape on `hw`."""
  mcfg, j = _job(c)
  pred = measured.predictor(hw, mcfg, measured.load_dir() if measurements is None
                            else measurements)
  base_p = long_tail.Params(fixed_s=1.0, per_row_s=0.0, accept_len=1.0, sd_overhead=0.0,
                            drafter_step_device_s=1.0)
  lengths_p = dataclasses.replace(base_p, max_tokens=min(base_p.max_tokens, j["max_new"]))
  mean_len = float(np.mean(long_tail.draw_lengths(np.random.default_rng(seed), 20000,
                                                  lengths_p)))
  context = j["prompt"] + float(np.median(long_tail.draw_lengths(
      np.random.default_rng(seed), 20000, lengths_p)))
  train_seq = int(j["prompt"] + mean_len)
  stack = tlt_jax_stack(j["chunk_steps"])
  table = breakdown(c, hw, context=context, train_seq=train_seq, pred=pred)
  by_name = {x["program"]: x["seconds"] for x in table}
  train_s = by_name["policy train step"]
  drafter_s = by_name["drafter train step"] * j["per_group"]
  threshold = min(32, j["max_live"])

  def params(arm, accept):
    fit = tail_params(mcfg, hw, tp=j["tp"], context=context, arm=arm, stack=stack,
                      max_live=j["max_live"], sd_threshold=threshold, pred=pred)
    return dataclasses.replace(
        lengths_p, fixed_s=fit["fixed_s"], per_row_s=fit["per_row_s"], accept_len=accept,
        sd_overhead=fit["sd_overhead"], drafter_step_device_s=drafter_s,
        devices_per_group=j["per_group"], samples_per_group=j["samples_per_group"],
        max_live=j["max_live"], sd_threshold=threshold, tlt_accept_gain=0.0), fit

  def run(arm, accept):
    p, fit = params(arm, accept)
    lengths = long_tail.lengths_for(seed, j["devices"], p)
    base = long_tail.simulate_rollout(lengths, j["devices"], p, None)["rollout_s"]
    p = dataclasses.replace(p, rollout_fraction=base / (base + train_s))
    config, _ = long_tail.simulate_config(p, seed, j["devices"], trials)
    return config["variants"], fit

  # Static SD: the config's largest arm with a stale drafter. Adaptive SD: the arm whose round
  # emits the most tokens per second in the tail (what the tuner converges to). TLT: adaptive
  # SD with the drafter trained on idle devices (accept x (1 + gain), if any idle device
  # trains it).
  largest = max(j["arms"], key=lambda a: a.verify_tokens)
  tail_b = [b for b in j["buckets"] if b <= threshold]

  def tokens_per_s(arm, accept):
    return np.mean([accept / round_seconds(mcfg, arm, b, context, j["tp"], stack, hw, pred)[0]
                    for b in tail_b])

  adaptive = max(j["arms"], key=lambda a: tokens_per_s(a, static_accept(a)))
  adaptive_tlt = max(j["arms"], key=lambda a: tokens_per_s(a, adapted_accept(a)))
  static_v, fit = run(largest, static_accept(largest))
  adaptive_v, _ = run(adaptive, static_accept(adaptive))
  tlt_v, tlt_fit = run(adaptive_tlt, adapted_accept(adaptive_tlt))
  trained = tlt_v["tlt"]["drafter_steps"] >= 1.0
  tlt = tlt_v["sd_static"] if trained else adaptive_v["sd_static"]

  def needed(target):
    """The accept length the TLT arm needs for `target` end to end (None if out of reach)."""
    lo, hi = 1.0, adaptive_tlt.depth + 1.0
    if run(adaptive_tlt, hi)[0]["sd_static"]["speedup"] < target:
      return None
    for _ in range(12):
      mid = (lo + hi) / 2
      lo, hi = ((mid, hi) if run(adaptive_tlt, mid)[0]["sd_static"]["speedup"] < target
                else (lo, mid))
    return round(hi, 2)

  keep = ("accept_len", "rollout_s", "step_s", "speedup", "speedup_range", "idle_device_s",
          "drafter_steps")
  variants = dict(
      sd_off={k: static_v["baseline"][k] for k in keep},
      static_sd=dict({k: static_v["sd_static"][k] for k in keep}, arm=largest.name),
      adaptive_sd=dict({k: adaptive_v["sd_static"][k] for k in keep}, arm=adaptive.name),
      tlt=dict({k: tlt[k] for k in keep}, arm=adaptive_tlt.name, drafter_trained=trained))
  return dict(
      config=name, hardware=hw.name, devices=j["devices"], groups=j["groups"], tp=j["tp"],
      samples=j["samples"], predicted_speedup_tlt=variants["tlt"]["speedup"],
      predicted_speedup_static_sd=variants["static_sd"]["speedup"],
      predicted_speedup_adaptive_sd=variants["adaptive_sd"]["speedup"],
      rollout_share_sd_off=static_v["baseline"]["rollout_s"] / static_v["baseline"]["step_s"],
      train_s=train_s, idle_device_s_for_drafter=tlt_v["sd_static"]["idle_device_s"],
      drafter_steps_possible=tlt_v["sd_static"]["drafter_steps"],
      accept_needed={f"{t:g}x": needed(t) for t in (1.7, 2.1)},
      accept_needed_arm=adaptive_tlt.name, variants=variants,
      step_cost_fit={k: tlt_fit[k] for k in ("fixed_s", "per_row_s", "sd_overhead",
                                             "measured_steps", "modelled_steps")},
      measurements=dict(files=pred.measurement_source or "none matching",
                        programs_measured=sum(x["source"] == "measured" for x in table)),
      breakdown=table, assumptions=assumptions(c, hw, j, context, train_seq))


def assumptions(c, hw: Hardware, j: dict, context: float, train_seq: int) -> dict:
  cal = hw.calibration
  return {
      "hardware": f"{hw.name}: {hw.sources}",
      "efficiency": f"{hw.efficiency:g} (" + ("fitted: " + cal["source"] if cal and
                                               cal["fits"] == "efficiency" else "not fitted")
                    + ")",
      "step_overhead_s": f"{hw.step_overhead_s:.4g} s per program call, "
                         + (f"fitted to {cal['source']} ({cal['quantity']})" if cal else
                            hw.notes or "none")
                         + f"; tlt-jax pays it once per decode chunk of {j['chunk_steps']} "
                           "rounds",
      "response_lengths": "log-normal, median 3000 tokens, sigma 0.85 (tlt_jax/perf/long_tail.py"
                          f": assumed), cut at max_new_tokens {j['max_new']}",
      "decode_context": f"{context:g} slots attended per step (prompt {j['prompt']} + median "
                        "response): one context for the whole rollout",
      "accept_len_static": {**{k: v for k, v in ACCEPT_SOURCES.items() if k != "tlt_gain"},
                            **_model_free_sources()},
      "accept_gain_online_drafter": ACCEPT_SOURCES["tlt_gain"],
      "train": f"policy step at the roofline: {j['samples']} x {train_seq} tokens, LoRA rank "
               f"{c.lora.rank}, old-log-prob forward (+ reference if rl.kl_coef), all "
               f"{j['devices']} devices; efficiency as above",
      "drafter_training": "on idle devices of finished groups only (interference-free); "
                          f"tlt.rows {c.tlt.rows} x row_len {c.tlt.row_len} per step",
      "not_modelled": "prefill (once per row, small next to decode), rewards, host-side "
                      "scheduling between chunks, the tuner's exploration",
  }


def load_config(path: str):
  """`get_config(variant)` of an experiment config file (path[:variant])."""

  path, _, variant = path.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(f"_tlt_config_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant or None)


def predict_paper_configs(configs_dir: str, *, seed: int = 0, trials: int = 4) -> dict:
  """`predict_config` for each paper-scale config on its hardware (HARDWARE_OF)."""


  return {name: predict_config(load_config(os.path.join(configs_dir, name + ".py")), name,
                               calibration.profile(hw), seed=seed, trials=trials)
          for name, hw in HARDWARE_OF.items()}


MEMORY_GIB_HARDWARE = {80: "h100_sxm", 141: "h200", 96: "h20", 95: "tpu_v5p", 16: "tpu_v5e"}


def hardware_for(c, name: str) -> str | None:
  """The profile a config runs on: its name's (HARDWARE_OF), else its plan.device_memory_gib's."""
  base = name.split(":")[0]
  return HARDWARE_OF.get(base) or MEMORY_GIB_HARDWARE.get(int(c.plan.device_memory_gib))
