"""Published figures, reproduced by the cost model before it predicts ours.

    python -m experiments.reproduce_published

Prints one JSON object and writes experiments/results/published_reproduction.json: `rows`, each
{"source", "quantity", "published", "predicted", "rel_error", "calibration", "in_issue_list",
"inputs"}, plus `profiles` (the hardware profiles as calibrated here) and `summary`.

Rules: each hardware profile has at most one fitted figure (here the per-call overhead), set
from ONE published point whose row says `calibration: true` and is not a reproduction. Every
other row is a prediction from published inputs, and assumed inputs where a source gives none
(named in the row's `inputs`, decided before the comparison was made, not tuned afterwards).
A published range [lo, hi] counts as met inside it; outside, rel_error is the distance to the
nearer end over that end. Rows outside 15% stay in the table, with `where_wrong`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from tlt_jax.perf import calibration as cal
from tlt_jax.perf import cost_model as cm
from tlt_jax.perf import hardware as hw_lib
from tlt_jax.perf import long_tail, predict
from tlt_jax.rollout.tuner import Arm

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "published_reproduction.json")
TOLERANCE = 0.15

QWEN2_5_7B, LLAMA3_1_8B, QWEN3_8B = cal.QWEN2_5_7B, cal.LLAMA3_1_8B, cal.QWEN3_8B


def rel_error(published, predicted: float) -> float:
  if isinstance(published, (list, tuple)):
    lo, hi = published
    if lo <= predicted <= hi:
      return 0.0
    end = lo if predicted < lo else hi
    return abs(predicted - end) / end
  return abs(predicted - published) / published


def row(source, quantity, published, predicted, *, calibration=False, in_issue_list=True,
        inputs=None, where_wrong=""):
  err = rel_error(published, predicted)
  out = dict(source=source, quantity=quantity, published=published,
             predicted=float(round(predicted, 4)), rel_error=float(round(err, 4)),
             calibration=calibration, in_issue_list=in_issue_list, inputs=inputs or {})
  if where_wrong and err > TOLERANCE and not calibration:
    out["where_wrong"] = where_wrong
  return out


# ---------------------------------------------------------------------------------------------
# fastrl issue 7: Qwen2.5-7B-Instruct, TP 2 on H20, SGLang (TLT's vendored 0.5.3), plain decode
# and the 2_2_2 EAGLE strategy (2 steps, top-2, 2 verified tokens).


def fastrl_issue7() -> tuple[list[dict], hw_lib.Hardware]:
  point = cal.H20_POINT
  src, cfg, tp, ctx = point.source, point.model, point.tp, point.context
  inputs = dict(model="Qwen2.5-7B-Instruct", tp=tp, hardware="h20 (4.0 TB/s, 148 TFLOP/s)",
                stack=predict.SGLANG_EAGLE.source,
                context_tokens="1024, assumed (the issue gives none; KV is <3% of the bytes)")
  h20 = cal.profile("h20")
  overhead = h20.step_overhead_s
  arm = predict.Strategy("2_2_2", 2, 2, 2)
  stack = predict.SGLANG_EAGLE
  plain = lambda b: cm.seconds(predict.plain_cost(cfg, b, ctx, tp, stack), h20)
  sd = lambda b: cm.seconds(predict.round_cost(cfg, arm, b, ctx, tp, stack), h20)
  rows = [
      row(src, "plain decode step ms, batch 1", 3.9, plain(1) * 1e3, calibration=True,
          inputs=dict(inputs, fitted=f"h20 step_overhead_s = {overhead * 1e3:.3f} ms per call")),
      row(src, "plain decode step ms, batch 12", 4.9, plain(12) * 1e3, inputs=inputs,
          where_wrong="the model has no per-row cost beyond KV reads and FLOPs: at batch 12 the "
                      "weight read (1.77 ms per GPU) still hides the 0.57 ms of matmul FLOPs "
                      "(max, not sum), so the model keeps batch 12 at batch 1's time. The "
                      "measured +1.0 ms (and only +0.54 ms under SD) is per-row work the "
                      "roofline does not see: sampling over a 152K vocabulary, skinny-GEMM "
                      "kernel choice on a compute-poor chip, or compute and memory not "
                      "overlapping"),
      row(src, "2_2_2 SD step ms, batch 1", 8.45, sd(1) * 1e3, inputs=inputs),
      row(src, "2_2_2 SD step ms, batch 12", 8.99, sd(12) * 1e3, inputs=inputs),
  ]
  return rows, h20


# ---------------------------------------------------------------------------------------------
# vLLM issue 20780: Llama-3.1-8B-Instruct on one H100, batch 1, vanilla vs EAGLE-3 by K. Not in
# the issue's list: it calibrates the H100 (vLLM) overhead and tests the model on that stack.

VLLM_AL = {2: (2.36, 4.32), 4: (3.08, 4.05), 7: (3.54, 4.29)}  # K: (accept length, TPOT ms)


def vllm_issue20780() -> tuple[list[dict], hw_lib.Hardware]:
  point = cal.H100_POINT
  src, cfg, ctx, stack = point.source, point.model, point.context, predict.VLLM_EAGLE3
  inputs = dict(model="Llama-3.1-8B-Instruct", tp=1, hardware="h100_sxm", stack=stack.source,
                context_tokens="512, assumed (MT-bench turns; the issue gives none)")
  h100 = cal.profile("h100_sxm")
  overhead = h100.step_overhead_s
  rows = [row(src, "vanilla TPOT ms, batch 1", 7.07,
              cm.seconds(predict.plain_cost(cfg, 1, ctx, 1, stack), h100) * 1e3,
              calibration=True, in_issue_list=False,
              inputs=dict(inputs, fitted=f"h100_sxm step_overhead_s = {overhead * 1e3:.3f} ms"))]
  for k, (al, tpot) in VLLM_AL.items():
    rnd = cm.seconds(predict.round_cost(cfg, Arm(f"chain{k}", k), 1, ctx, 1, stack), h100)
    rows.append(row(src, f"EAGLE-3 TPOT ms, K={k} (accept {al})", tpot, rnd / al * 1e3,
                    in_issue_list=False, inputs=dict(inputs, accept_len=al),
                    where_wrong="each vLLM drafter call is charged the full per-call overhead "
                                "calibrated on a 32-layer target step (2.6 ms); the measured "
                                "cost per extra draft token is ~1 ms (TPOT x AL grows 5.0 ms "
                                "from K=2 to K=7): a drafter call's overhead is smaller than a "
                                "target step's, which one overhead figure per profile cannot "
                                "express"))
  return rows, h100


# ---------------------------------------------------------------------------------------------
# NeMo-RL (arXiv 2604.26779): Qwen3-8B, EAGLE-3 in vLLM, GB200, rollout 1.8x at accept 2.47.


def nemo_rl(h100: hw_lib.Hardware) -> list[dict]:
  src = "NeMo-RL speculative decoding (arXiv 2604.26779; tlt.md s6, zubnet/earezki summaries)"
  cfg, k, al, rows_, ctx = QWEN3_8B, 3, 2.47, 32, 4096.0
  gb200 = cal.profile("gb200")  # the h100 vLLM overhead, borrowed (same serving stack)
  stack = predict.VLLM_EAGLE3
  plain = cm.seconds(predict.plain_cost(cfg, rows_, ctx, 1, stack), gb200)
  rnd = cm.seconds(predict.round_cost(cfg, Arm(f"chain{k}", k), rows_, ctx, 1, stack), gb200)
  inputs = dict(model="Qwen3-8B", hardware="gb200, overhead from the h100 vLLM calibration",
                draft_tokens=f"{k} (the summaries: 'k=3 is stable')", accept_len=al,
                concurrent_rows=f"{rows_}, assumed (not published; TLT's SD threshold)",
                context_tokens=f"{ctx:g}, assumed", tp=1, stack=stack.source)
  return [row(src, "rollout speedup from EAGLE-3 (x)", 1.8, al * plain / rnd, inputs=inputs,
              where_wrong="the per-call overhead (calibrated on vLLM at H100 batch 1) is charged "
                          "to each of the K+1 calls of a round; on this stack a drafter call "
                          "costs less than that (see the vllm issue 20780 rows), so the model "
                          "underrates SD here")]


# ---------------------------------------------------------------------------------------------
# marin issues 9079/9114: a one-layer EAGLE-3 draft, 16 streams on one GH200 node (vLLM).


def marin(h100: hw_lib.Hardware) -> list[dict]:
  src = "marin issues 9079 and 9114 (tlt.md s5)"
  al, k, plain_s = 2.545, 3, 1.0 / 96  # accept 2.53-2.56; plain server 96 tok/s per stream
  o = h100.step_overhead_s
  # The target's bytes are not published (Snowball's shape); the drafter's cost relative to the
  # target's step is taken from the EAGLE-3 pair whose shapes are published (Llama-3.1-8B).
  d = cm.drafter_forward(LLAMA3_1_8B, 16, 1, 4096, eagle3=True, draft_vocab=32000)
  t = cm.forward(LLAMA3_1_8B, 16, 1, 4096)
  ratio = d.bytes / t.bytes
  work = plain_s - o  # the plain step's device time, memory-bound at 16 streams
  rnd = work + k * ratio * work + (k + 1) * o  # verify + K drafter forwards + K + 1 calls
  per_stream = al * plain_s / rnd
  inputs = dict(accept_len="2.53-2.56 (marin 9114), 2.545 used", plain_step_ms=1e3 * plain_s,
                draft_tokens=f"{k}, assumed (marin does not say; NeMo-RL's stable k)",
                drafter_over_target_bytes=f"{ratio:.3f}, from the Llama-3.1-8B EAGLE-3 pair "
                                          "(Snowball's shape is not published)",
                overhead_ms=f"{o * 1e3:.3f}, the h100 vLLM calibration (GH200 = H100 compute)",
                stack=predict.VLLM_EAGLE3.source)
  # RL step: marin 9079, ~70% of a 740 s step waits for rollouts and a trajectory is 80% decode.
  decode_share = 0.7 * 0.8
  step = 1.0 / ((1 - decode_share) + decode_share / 1.61)
  return [
      row(src, "per-stream decode speedup (x)", 1.61, per_stream, inputs=inputs,
          where_wrong="as for NeMo-RL: every drafter call pays the target-sized overhead"),
      row(src, "RL step speedup (x)", 1.42, step,
          inputs=dict(per_stream_speedup="1.61 (published, marin 9114)",
                      decode_share="0.7 x 0.8 = 0.56 (marin 9079: ~70% of the step waits for "
                                   "rollouts, a trajectory is 80% decode)",
                      model="Amdahl: 1 / (1 - share + share / per_stream)"),
          where_wrong="Amdahl over the published shares gives less than marin's 1.42x: their "
                      "'three RL steps 1.42x sooner' also counts effects outside decode "
                      "(shorter tail waits, overlap) that a share model does not see"),
  ]


# ---------------------------------------------------------------------------------------------
# TLT (arXiv 2511.16665): rollout ~85% of the step; end to end 1.7-2.1x over the same system
# without SD. Its recipe (fastrl examples/grpo_7B.sh): Qwen2.5-7B, 64 prompts x 8, max response
# 32K, rollout TP 4 on 8 GPUs, full fine-tuning with a KL reference; drafter = the released
# Qwen2.5-7B-Eagle-RL (accept 6.36-6.57 at tree 8_4_48, fastrl issue 13).


def tlt_recipe_params(h100: hw_lib.Hardware, accept: float) -> tuple[long_tail.Params, dict]:
  cfg, tp, group = QWEN2_5_7B, 4, 4
  lengths = long_tail.Params(fixed_s=1, per_row_s=0, accept_len=1, sd_overhead=0,
                             drafter_step_device_s=1)  # only its length defaults are used
  prompt = 512
  context = prompt + lengths.median_tokens
  arm = predict.Strategy("8_4_48", 8, 4, 48)
  fit = predict.tail_params(cfg, h100, tp=tp, context=context, arm=arm,
                            stack=predict.SGLANG_EAGLE, max_live=256, sd_threshold=32)
  drafter = cm.seconds(cm.drafter_train_step(cfg, 2, 512), h100)  # TLT: 2 x 512-token windows
  p = long_tail.Params(fixed_s=fit["fixed_s"], per_row_s=fit["per_row_s"], accept_len=accept,
                       sd_overhead=fit["sd_overhead"], drafter_step_device_s=drafter * group,
                       devices_per_group=group, samples_per_group=256, max_live=512,
                       tlt_accept_gain=0.0)
  mean_len = float(np.mean(long_tail.draw_lengths(np.random.default_rng(0), 20000, lengths)))
  train = cm.seconds(cm.train_step(cfg, 512, int(prompt + mean_len), devices=8,
                                   extra_forwards=2), h100)
  info = dict(model="Qwen2.5-7B", hardware="h100_sxm (TLT's hardware is not published; "
              "assumed), overhead from the vLLM H100 calibration", rollout_tp=tp,
              stack=predict.SGLANG_EAGLE.source, arm="tree 8_4_48 (TLT's default)",
              accept_len=f"{accept} (fastrl issue 13: 6.36-6.57 with TLT's released drafter)",
              lengths=f"long_tail defaults: log-normal median {lengths.median_tokens:g}, sigma "
                      f"{lengths.sigma:g}, cap {lengths.max_tokens} (assumed; the cap is TLT's)",
              prompt_tokens=f"{prompt}, assumed", decode_context=context,
              train="full fine-tuning, old log-probs + KL reference forwards, 512 x "
                    f"{int(prompt + mean_len)} tokens over 8 GPUs at the roofline "
                    "(efficiency 1.0: no H100 training calibration)",
              train_s=train, step_cost_fit=fit)
  return p, info


def tlt_rows(h100: hw_lib.Hardware) -> list[dict]:
  src = "TLT (arXiv 2511.16665 abstract and summaries; tlt.md s1, s3)"
  p, info = tlt_recipe_params(h100, accept=6.4)
  lengths = long_tail.lengths_for(0, 8, p)
  base = long_tail.simulate_rollout(lengths, 8, p, None)["rollout_s"]
  train = info["train_s"]
  p = dataclasses.replace(p, rollout_fraction=base / (base + train))
  config, _ = long_tail.simulate_config(p, seed=0, devices=8, trials=4)
  v = config["variants"]
  info = dict(info, baseline_rollout_s=base, train_s=train)
  return [
      row(src, "rollout share of the step (no SD)", 0.85, base / (base + train), inputs=info,
          where_wrong="training at the H100's full bf16 peak (no efficiency figure for "
                      "training) is too fast, so the rollout's share comes out high"),
      row(src, "end-to-end speedup, TLT vs no SD (x)", [1.7, 2.1], v["tlt"]["speedup"],
          inputs=dict(info, note="the online drafter is represented by its accept length "
                                 "(6.4, TLT's released drafter); tlt_accept_gain 0"),
          where_wrong="see the inputs: the accept length of TLT's drafter on RL rollouts, the "
                      "length distribution and TLT's hardware are assumed"),
  ]


def build() -> dict:
  rows, h20 = fastrl_issue7()
  vrows, h100 = vllm_issue20780()
  rows += nemo_rl(h100) + marin(h100) + tlt_rows(h100)
  rows += vrows
  scored = [r for r in rows if not r["calibration"]]
  listed = [r for r in scored if r["in_issue_list"]]
  summary = dict(
      tolerance=TOLERANCE, rows=len(rows), predictions=len(scored),
      predictions_in_issue_list=len(listed),
      within_tolerance_in_issue_list=sum(r["rel_error"] <= TOLERANCE for r in listed),
      within_tolerance_all=sum(r["rel_error"] <= TOLERANCE for r in scored),
      outside_tolerance=[f"{r['source'].split(' (')[0]}: {r['quantity']} "
                         f"(rel_error {r['rel_error']:.2f})"
                         for r in scored if r["rel_error"] > TOLERANCE])
  return dict(command="python -m experiments.reproduce_published", rows=rows,
              profiles={h.name: h.as_dict() for h in (h20, h100)}, summary=summary)


def main() -> dict:
  report = build()
  os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
  with open(RESULTS, "w") as f:
    json.dump(report, f, indent=2)
  print(json.dumps(report))
  return report


if __name__ == "__main__":
  main()
