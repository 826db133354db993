"""The cost model against XLA's own count, its roofline arithmetic by hand, and the reproduction
script's output schema."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from experiments import reproduce_published
from tlt_jax.model.transformer import ModelConfig, Transformer, init_cache
from tlt_jax.perf import cost_model as cm
from tlt_jax.perf import hardware as hw_lib
from tlt_jax.perf import predict
from tlt_jax.rollout import tuner

# Big enough that the weights (12 MB in f32) dominate a decode step's bytes at batch 1, small
# enough to compile in seconds.
SMALL = ModelConfig("qwen2", 4096, 256, 1024, 2, 4, 2, 64, dtype="float32")


@pytest.fixture(scope="module")
def small_model():
  return nnx.split(Transformer(SMALL, nnx.Rngs(0)))


def _decode_cost(graphdef, state, rows, slots) -> cm.Cost:
  """XLA's count of the engine's decode forward: one token per row over a cache of `slots`,
  the cache donated and returned as the rollout's decode programs do."""
  def decode(state, tokens, cache, slot):
    out = nnx.merge(graphdef, state)(tokens, cache=cache, write_slot_B=slot)
    return out.logits_BxTxV, out.cache

  args = (state, jnp.zeros((rows, 1), jnp.int32), init_cache(SMALL, rows, slots),
          jnp.zeros((rows,), jnp.int32))
  return cm.xla_cost(jax.jit(decode, donate_argnums=(2,)).lower(*args).compile())


def _prefill_cost(graphdef, state, rows, tokens) -> cm.Cost:
  def prefill(state, tokens_BxT):
    return nnx.merge(graphdef, state)(tokens_BxT).logits_BxTxV

  return cm.xla_cost(jax.jit(prefill).lower(state, jnp.zeros((rows, tokens), jnp.int32)).compile())


@pytest.mark.parametrize("rows,slots", [(1, 128), (4, 256)])
def test_decode_flops_and_bytes_match_xla(small_model, rows, slots):
  # FLOPs within 5%: XLA also counts the element-wise ops (softmax, RoPE, norms, SiLU) the
  # model leaves out; they are ~1% here. Bytes: the model counts what an ideal fused program
  # must move (weights once, KV, logits), so XLA's count is never below it; at batch 1 with a
  # short cache the weights dominate and XLA:CPU is within 10% of it. With more rows or slots
  # XLA:CPU's count grows faster than the model's, because it also counts its layout copies of
  # the cache (transposes before the attention dots) that an accelerator kernel fuses away.
  model = cm.forward(SMALL, rows, 1, slots)
  xla = _decode_cost(*small_model, rows, slots)
  assert model.flops == pytest.approx(xla.flops, rel=0.05)
  assert xla.bytes >= 0.98 * model.bytes
  if rows == 1:
    assert model.bytes == pytest.approx(xla.bytes, rel=0.10)


def test_prefill_flops_match_xla(small_model):
  # The forward without a cache attends all T keys under XLA numerics (no causal skip), which
  # is what `forward(..., context=T)` counts.
  rows, tokens = 2, 64
  model = cm.forward(SMALL, rows, tokens, tokens)
  xla = _prefill_cost(*small_model, rows, tokens)
  assert model.flops == pytest.approx(xla.flops, rel=0.05)
  assert xla.bytes >= 0.98 * model.bytes


def test_forward_counts_by_hand():
  cfg = ModelConfig("llama", 10, 4, 6, 1, 2, 1, 2, dtype="bfloat16")
  # one layer: q 4x(2x2) + k, v 4x2 each + o 4x4 + MLP 3 x 4x6 = 16 + 16 + 16 + 72 = 120
  assert cm.layer_matmul_params(cfg) == 120
  c = cm.forward(cfg, rows=3, tokens=1, context=5)
  # 2 x 3 tokens x (120 + lm_head 40) + attention 4 x 3 x 5 slots x 2 heads x 2 dims
  assert c.flops == 2 * 3 * 160 + 4 * 3 * 5 * 2 * 2
  # weights 160 x 2 B + KV read 3 x 5 x (2 x 1 x 2 x 2 B) + written 3 x 8 + embed rows 3 x 4 x 2
  # + f32 logits 3 x 10 x 4
  assert c.bytes == 320 + 120 + 24 + 24 + 120
  assert c.comm_bytes == 0 and c.calls == 1


def test_roofline_arithmetic_by_hand():
  hw = hw_lib.Hardware("toy", peak_flops=100.0, hbm_bytes_per_s=10.0,
                       interconnect_bytes_per_s=5.0, memory_bytes=1.0, step_overhead_s=0.5,
                       efficiency=0.5)
  # compute-bound: max(300/100, 20/10) = 3 s, / 0.5 = 6 s; + 10 B / 5 B/s + 2 calls x 0.5 s
  assert cm.seconds(cm.Cost(300.0, 20.0, 10.0, 2.0), hw) == pytest.approx(9.0)
  assert cm.bound(cm.Cost(300.0, 20.0), hw) == "compute"
  # memory-bound: max(1, 5) / 0.5 = 10 s + 1 call x 0.5 s
  assert cm.seconds(cm.Cost(100.0, 50.0, 0.0, 1.0), hw) == pytest.approx(10.5)
  assert cm.bound(cm.Cost(100.0, 50.0), hw) == "memory"


def test_measurement_wins_over_the_model():
  p = cm.Predictor(hw_lib.H100_SXM, {"decode[1]": 0.004})
  assert p.time("decode[1]", cm.Cost(1.0, 1.0)) == (0.004, "measured")
  t, how = p.time("decode[2]", cm.Cost(0.0, 3.35e9))
  assert how == "model" and t == pytest.approx(1e-3)


def test_a_profile_is_calibrated_once():
  h = hw_lib.calibrated(hw_lib.H20, fits="step_overhead_s", value=1e-3, source="s",
                        quantity="q", published=2.0)
  assert h.step_overhead_s == 1e-3 and h.efficiency == 1.0 and h.calibration["source"] == "s"
  with pytest.raises(ValueError, match="already calibrated"):
    hw_lib.calibrated(h, fits="efficiency", value=0.5, source="t", quantity="q", published=1.0)
  with pytest.raises(ValueError):
    hw_lib.calibrated(hw_lib.H20, fits="peak_flops", value=1.0, source="s", quantity="q",
                      published=1.0)


def test_sd_round_is_one_plain_step_plus_drafts_when_memory_bound():
  # SGLang's 2_2_2 round at batch 1: verify (2 tokens) + 1 draft level + the extend, 3 calls.
  cfg, stack = reproduce_published.QWEN2_5_7B, predict.SGLANG_EAGLE
  rnd = predict.round_cost(cfg, predict.Strategy("2_2_2", 2, 2, 2), 1, 1024, 2, stack)
  drafter = cm.drafter_forward(cfg, 1, 2, 1024, tp=2)
  verify = cm.forward(cfg, 1, 2, 1024, tp=2)
  assert rnd.calls == 3
  assert rnd.bytes == pytest.approx(verify.bytes + drafter.bytes
                                    + cm.drafter_forward(cfg, 1, 3, 1024, tp=2).bytes)


def test_reproduction_rows_satisfy_the_schema():
  report = reproduce_published.build()
  keys = {"source", "quantity", "published", "predicted", "rel_error", "calibration"}
  rows = report["rows"]
  assert all(keys <= set(r) for r in rows)
  predictions = [r for r in rows if not r["calibration"]]
  assert len([r for r in predictions if r["in_issue_list"]]) >= 8
  for r in rows:
    assert r["rel_error"] == pytest.approx(
        reproduce_published.rel_error(r["published"], r["predicted"]), abs=1e-3)
    if not r["calibration"] and r["rel_error"] > reproduce_published.TOLERANCE:
      assert r["where_wrong"], r  # a miss says where the model is wrong
  # each calibration point is reproduced exactly (it is what the profile was fitted to)
  assert all(r["rel_error"] < 1e-3 for r in rows if r["calibration"])
  # at most one fitted figure per profile
  for p in report["profiles"].values():
    assert p["calibration"] is None or p["calibration"]["fits"] in ("step_overhead_s",
                                                                     "efficiency")


def test_paper_config_predictions_name_their_assumptions():
  configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "experiments", "configs")
  out = predict.predict_paper_configs(configs, trials=1)
  assert set(out) == {"qwen2_5_7b_8gpu", "qwen2_5_32b_multihost", "r1_distill_qwen_7b_v5p64"}
  for r in out.values():
    assert r["predicted_speedup_tlt"] >= r["predicted_speedup_static_sd"] - 1e-9
    assert set(r["variants"]) == {"sd_off", "static_sd", "adaptive_sd", "tlt"}
    assert r["variants"]["sd_off"]["speedup"] == 1.0
    assert {"response_lengths", "accept_len_static", "accept_gain_online_drafter",
            "step_overhead_s", "train"} <= set(r["assumptions"])
    programs = {x["program"] for x in r["breakdown"]}
    assert {"prefill", "decode[1]", "drafter forward", "drafter train step",
            "policy train step", "weight sync"} <= programs
    assert any(p.startswith("verify[tree8_4_32]") for p in programs)


def test_plan_prints_the_predicted_breakdown():
  from tlt_jax import plan

  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "experiments", "configs", "qwen2_5_7b_8gpu.py")
  text = plan.format_prediction(predict.load_config(path), "qwen2_5_7b_8gpu")
  assert "x h100_sxm" in text and "predicted speedup: TLT" in text
  for program in ("prefill", "decode[64]", "verify[tree8_4_32][32]", "drafter train step",
                  "policy train step", "weight sync"):
    assert program in text
  assert "no hardware profile" in plan.format_prediction(
      predict.load_config(path.replace("qwen2_5_7b_8gpu", "tiny_arith")), "tiny_arith")


# bench_step_costs end to end at a tiny shape (the 0.5B widths, one layer, a 1024-token
# vocabulary, a 64-slot cache): the report's schema, and the cost model taking its times.
STEP_COSTS_ARGS = ["--model", "qwen2_5_0_5b", "--layers", "1", "--vocab", "1024",
                   "--buckets", "1", "2", "--arms", "chain2", "--context", "64", "--prompt", "8",
                   "--chunk-steps", "2", "--train-rows", "2", "--train-seq", "32",
                   "--drafter-rows", "2", "--drafter-row-len", "32", "--repeats", "2"]


@pytest.fixture(scope="module")
def step_costs_report(tmp_path_factory):
  import json
  import subprocess
  import sys

  out = tmp_path_factory.mktemp("step_costs")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-m", "experiments.bench_step_costs", *STEP_COSTS_ARGS,
                         "--out-dir", str(out)], cwd=repo, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  printed = json.loads(proc.stdout)
  path = out / f"step_costs_qwen2_5_0_5b_{jax.default_backend()}.json"
  assert printed["written"] == str(path)
  return printed, str(out)


def test_bench_step_costs_report_schema(step_costs_report):
  from tlt_jax.perf import measured

  report, out_dir = step_costs_report
  measured.validate(report)
  assert report["model_config"]["hidden_size"] == 896 and report["reduced"]["layers"] == 1
  assert report["model_config"]["num_layers"] == 1 and report["context"] == 64
  assert report["skipped"] == []
  keys = {r["key"] for r in report["programs"]}
  assert keys == {"decode[1]", "decode[2]", "verify[chain2][1]", "verify[chain2][2]",
                  "drafter forward[2]", "drafter train step", "policy train step"}
  for row in report["programs"]:
    assert row["seconds"] > 0 and row["model_seconds"] > 0 and row["gflop"] > 0
    assert row["gbytes"] > 0 and row["bound"] in ("compute", "memory")
    assert row["hbm_roofline_fraction"] == pytest.approx(
        row["gbytes"] * 1e9 / hw_lib.profile(report["hardware_profile"]).hbm_bytes_per_s
        / row["seconds"])
  assert 0 < report["decode_bs1_hbm_roofline_fraction"]
  assert len(measured.load_dir(out_dir)) == 1


def test_predict_uses_measured_step_costs(step_costs_report):
  """Measurement wins: at the measured shape on the measured profile, the long-tail predictor's
  step costs are the bench's times; at another context or on another profile, the model's."""
  from tlt_jax.perf import calibration, measured

  report, out_dir = step_costs_report
  costs = measured.load_dir(out_dir)
  cfg = ModelConfig("qwen2", **{k: v for k, v in report["model_config"].items()
                                if k != "tie_embeddings"},
                    tie_embeddings=report["model_config"]["tie_embeddings"])
  hw = calibration.profile(report["hardware_profile"])
  pred = measured.predictor(hw, cfg, costs)
  by_key = {r["key"]: r["seconds"] for r in report["programs"]}
  stack = predict.tlt_jax_stack(report["chunk_steps"])
  ctx = report["context"]
  assert predict.plain_seconds(cfg, 2, ctx, 1, stack, hw, pred) == (by_key["decode[2]"],
                                                                      "measured")
  arm = predict.Strategy("chain2", 2, 0, 3)
  assert predict.round_seconds(cfg, arm, 1, ctx, 1, stack, hw, pred) == (
      by_key["verify[chain2][1]"], "measured")
  fit = predict.tail_params(cfg, hw, tp=1, context=ctx, arm=arm, stack=stack, max_live=2,
                            sd_threshold=2, pred=pred)
  assert fit["measured_steps"] == 4 and fit["modelled_steps"] == 0
  assert fit["plain_step_s"] == [by_key["decode[1]"], by_key["decode[2]"]]
  # Another context, another profile, another model: the roofline model.
  assert predict.plain_seconds(cfg, 2, ctx * 2, 1, stack, hw, pred)[1] == "model"
  other_hw = measured.predictor(calibration.profile("h100_sxm"), cfg, costs)
  assert predict.plain_seconds(cfg, 2, ctx, 1, stack, calibration.profile("h100_sxm"),
                               other_hw)[1] == "model"
  bigger = dataclasses.replace(cfg, num_layers=2)
  assert measured.predictor(hw, bigger, costs).measurements == {}


def test_history_round_is_the_verify_alone_in_one_call():
  # A history arm drafts on the host: no drafter forward, one program call per round.
  cfg, stack = reproduce_published.QWEN2_5_7B, predict.tlt_jax_stack(8)
  hist = predict.round_cost(cfg, tuner.history_arm(4), 4, 1024, 1, stack)
  learned = predict.round_cost(cfg, tuner.Arm("chain4", 4), 4, 1024, 1, stack)
  verify = cm.forward(cfg, 4, 5, 1024, tp=1)
  assert hist.calls == predict.HISTORY_ROUND_CALLS
  assert hist.flops == pytest.approx(verify.flops) and hist.bytes == pytest.approx(verify.bytes)
  assert hist.flops < learned.flops and hist.bytes < learned.bytes
  assert predict.adapted_accept(tuner.history_arm(4)) == predict.static_accept(
      tuner.history_arm(4))


def test_model_free_accept_lengths_are_the_replay_measurements(tmp_path, monkeypatch):
  # The committed replay (bench_lookup_replay on bench_tlt's job) is what the planner prices
  # lookup and history arms with, arm by arm.
  with open(predict.LOOKUP_REPLAY_JSON) as f:
    committed = {a["arm"]: a["accept_len"] for a in json.load(f)["arms"]}
  for name in ("lookup_chain2", "lookup_chain4", "lookup_tree4_3", "history_chain4"):
    assert predict.static_accept(tuner.parse_arms(name)[-1]) == committed[name]
  # Another replay file changes them; arms it lacks fall back: a lookup tree to its depth's
  # chain (its first chain), a history chain to the earlier replay's figure.
  replay = tmp_path / "lookup_replay.json"
  replay.write_text(json.dumps({"arms": [{"arm": "lookup_chain4", "accept_len": 3.25},
                                         {"arm": "history_chain2", "accept_len": 1.5}]}))
  monkeypatch.setattr(predict, "LOOKUP_REPLAY_JSON", str(replay))
  accept = lambda name: predict.static_accept(tuner.parse_arms(name)[-1])
  assert (accept("lookup_chain4"), accept("lookup_tree4_2")) == (3.25, 3.25)
  assert (accept("history_chain2"), accept("history_chain4")) == (1.5, 2.17)
  assert accept("lookup_chain2") == 1.88  # neither replayed: the earlier history replay's
  assert accept("history_chain4") == predict.adapted_accept(tuner.parse_arms("history_chain4")[-1])
  # Without a replay file (a wheel install): the earlier replay's figures alone.
  monkeypatch.setattr(predict, "LOOKUP_REPLAY_JSON", str(tmp_path / "absent.json"))
  assert (accept("lookup_chain4"), accept("history_chain8")) == (2.17, 2.36)
  assert "no lookup_replay.json" in predict._model_free_sources()["lookup"]
