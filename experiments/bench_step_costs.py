"""Step costs of the compiled programs at real model shapes, measured, beside the cost model's.

    python -m experiments.bench_step_costs --model qwen2_5_0_5b [qwen2_5_1_5b qwen2_5_7b]
    python -m experiments.bench_step_costs --model qwen2_5_0_5b --quick     # CPU, a few minutes
    python -m experiments.bench_step_costs --model bench_tlt   # bench_tlt's own model and engine

Builds a random-weight model of the named shape with the project's own model code (the shapes of
the Hugging Face config.json files; nothing is downloaded), LoRA on every linear as the paper
configs run it, an EAGLE drafter beside it, and times the programs the rollout and the trainer
run, each compiled by the project's own code:
- `decode[b]`: one plain decode step in bucket b (`ProgramPool`'s decode chunk of `chunk_steps`
  rounds, the drafter's catch-up included, divided by the rounds it ran);
- `verify[arm][b]`: one SD round of each arm (chain or tree: drafts + verify + commit + the
  drafter's extend), in the buckets the tuner may use it in (b <= `--sd-threshold` and within
  its verify-token bound);
- `drafter forward`: the drafter's one-token forward over a bucket of rows;
- `drafter train step`: `tlt.spot.SpotTrainer`'s step on `--drafter-rows` x `--drafter-row-len`;
- `policy train step`: `rl.trainer.Trainer.step` (LoRA, one update) on `--train-rows` x
  `--train-seq` tokens.
Every row carries the cost model's FLOPs, HBM bytes and predicted seconds for the same shape on
the backend's hardware profile, the measured / predicted ratio and the fraction of the HBM
roofline reached; `decode_bs1_hbm_roofline_fraction` is decode at batch 1's.

The JSON (printed, and written to experiments/results/step_costs_<model>_<backend>.json, with
`--quick` `..._quick.json`) is what `tlt_jax.perf.measured` reads: where a program's key and
shape (model shape, dtype, context, bucket, rows) match, the planner and the long-tail predictor
take the measured time instead of the model's ("measurement wins").

`--model bench_tlt` measures `experiments/bench_tlt.py`'s setup instead: the tiny_arith policy's
shape (random weights: a program's time does not depend on them), its engine settings (buckets
1..16, prompt 40, 192 new tokens, chunk_steps 8, chain2/chain4) and numerics (batch_invariant),
its drafter step (8 x 256), on one host device: the CPU step costs that
`experiments/simulate_bench_tlt.py` drives the long-tail simulator with.

Budget: the programs are measured in priority order (decode and SD at batch 1 first, then the
train steps, then the other buckets), and once a model's share of `--budget-s` is spent the rest
are skipped and listed under `skipped`; so the three models run in under `--budget-s` (default
270 s) on one GPU whatever the compile times are, minus at most one program in flight.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax import compile_cache, determinism, logs, ops
from tlt_jax.model import lora
from tlt_jax.mesh import group_sharding
from tlt_jax.model.drafter import Drafter
from tlt_jax.model.transformer import ModelConfig, Transformer
from tlt_jax.perf import calibration
from tlt_jax.perf import cost_model as cm
from tlt_jax.perf import measured as measured_lib
from tlt_jax.perf import predict
from tlt_jax.rl.trainer import Trainer, TrainConfig, make_batch
from tlt_jax.rollout import programs as programs_lib
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.programs import ProgramPool
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.tuner import OFF, Arm, parse_arms
from tlt_jax.tlt.buffer import PackedBatch
from tlt_jax.tlt.spot import SpotConfig, SpotTrainer

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# Hugging Face config.json of Qwen/Qwen2.5-{0.5B,1.5B,7B}(-Instruct): hidden, MLP width, layers,
# heads, KV heads, head_dim, vocabulary, tied embeddings (rope_theta 1e6, rms_eps 1e-6, q/k/v bias).
MODELS = {
    "qwen2_5_0_5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                         tie_embeddings=True),
    "qwen2_5_1_5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                         tie_embeddings=True),
    "qwen2_5_7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                       tie_embeddings=False),
}
# The backend's profile for the cost model (device_kind substrings, first match).
PROFILE_OF_DEVICE = (("GH200", "gh200"), ("H200", "h200"), ("H100", "h100_sxm"), ("H20", "h20"),
                     ("GB200", "gb200"), ("v5p", "tpu_v5p"), ("v5 lite", "tpu_v5e"),
                     ("v5e", "tpu_v5e"))


def bench_tlt_config():
  """experiments/bench_tlt.py's run config (its model, engine and drafter settings)."""
  from experiments import bench_tlt  # noqa: PLC0415 (sets 2 host devices if imported first)

  return bench_tlt.base_config(10, "/tmp/unused")


def model_config(name: str, *, layers: int | None = None, vocab: int | None = None,
                 dtype: str = "bfloat16") -> ModelConfig:
  if name == "bench_tlt":
    from tlt_jax import config as config_lib  # noqa: PLC0415

    cfg = config_lib.model_config(bench_tlt_config())
    return dataclasses.replace(cfg, num_layers=layers or cfg.num_layers,
                               vocab_size=vocab or cfg.vocab_size)
  shape = dict(MODELS[name])
  if layers:
    shape["num_layers"] = layers
  if vocab:
    shape["vocab_size"] = vocab
  return ModelConfig("qwen2", rope_theta=1e6, rms_eps=1e-6, qkv_bias=True, dtype=dtype,
                     max_position_embeddings=32768, **shape)


def hardware_profile() -> str:
  device = jax.devices()[0]
  if device.platform == "cpu":
    return "cpu_2core"
  for needle, name in PROFILE_OF_DEVICE:
    if needle.lower() in device.device_kind.lower():
      return name
  return "h100_sxm"


def _median_seconds(fn, repeats: int) -> tuple[float, list[float]]:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), times


class Bench:
  """One model's programs, measured in priority order within a time budget."""

  def __init__(self, name: str, args, hw_name: str):
    self.name, self.args, self.t_start = name, args, time.perf_counter()
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    self.cfg = model_config(name, layers=args.layers, vocab=args.vocab, dtype=dtype)
    if name == "bench_tlt" and not args.dtype:
      self.cfg = dataclasses.replace(self.cfg, dtype=model_config(name).dtype)
    self.hw = calibration.profile(hw_name)
    self.arms = tuple(a for a in parse_arms(args.arms) if a.depth)
    window = max([a.draft_slots for a in self.arms] + [args.chunk_steps])
    self.ecfg = EngineConfig(
        buckets=tuple(args.buckets), max_prompt_len=args.prompt,
        max_new_tokens=args.max_new or max(args.context - args.prompt - window, 1),
        chunk_steps=args.chunk_steps,
        sampling=SamplingParams(temperature=1.0), arms=(Arm(OFF, 0),) + self.arms,
        max_verify_tokens_per_bucket=args.max_verify_tokens)
    self.context = self.ecfg.num_slots  # every step attends the whole cache (static shapes)
    self.stack = predict.tlt_jax_stack(args.chunk_steps)
    self.rows, self.skipped = [], []
    t0 = time.perf_counter()
    self.target = Transformer(self.cfg, nnx.Rngs(0))
    lora.apply_lora(self.target, rank=args.lora_rank, alpha=float(args.lora_rank))
    self.drafter = Drafter(self.cfg, nnx.Rngs(1))
    jax.block_until_ready(nnx.state(self.target))
    self.build_s = time.perf_counter() - t0
    allowed = {b: [OFF] + [a.name for a in self.arms
                           if b <= args.sd_threshold
                           and a.verify_tokens * b <= args.max_verify_tokens]
               for b in self.ecfg.buckets}
    self.pool = ProgramPool(self.target, self.drafter, self.ecfg, allowed)
    self.allowed = allowed
    self._full: dict | None = None

  # -- bookkeeping

  def over_budget(self) -> bool:
    return time.perf_counter() - self.t_start > self.args.budget_s_per_model

  def record(self, key: str, program: str, shape: dict, seconds: float, cost: cm.Cost, *,
             compile_s: float, repeats: list[float], per: str, note: str = ""):
    model_s = cm.seconds(cost, self.hw)
    hbm_s = cost.bytes / self.hw.hbm_bytes_per_s
    flop_s = cost.flops / self.hw.peak_flops
    self.rows.append(dict(
        key=key, program=program, shape=shape, seconds=seconds, per=per,
        call_seconds=[float(x) for x in repeats], compile_s=compile_s,
        model_seconds=model_s, measured_over_model=seconds / model_s if model_s else None,
        gflop=cost.flops / 1e9, gbytes=cost.bytes / 1e9, model_calls=cost.calls,
        bound=cm.bound(cost, self.hw),
        hbm_roofline_fraction=hbm_s / seconds, flops_roofline_fraction=flop_s / seconds,
        note=note))
    print(f"[bench_step_costs] {self.name} {key}: {seconds * 1e3:.3f} ms "
          f"(model {model_s * 1e3:.3f} ms, compile {compile_s:.1f} s)", file=sys.stderr)

  # -- the rollout's programs

  def full_slots(self):
    """Prefilled slots of the largest bucket (every row live at pos = prompt)."""
    if self._full is None:
      B = max(self.ecfg.buckets)
      rng = np.random.default_rng(0)
      prompts = rng.integers(0, self.cfg.vocab_size, (B, self.ecfg.max_prompt_len), np.int32)
      lengths = np.full((B,), self.ecfg.max_prompt_len, np.int32)
      prefill = self.pool.get("prefill", B)
      self._full = prefill(self.pool.params, self.pool.draft_params, prompts, lengths,
                           np.arange(B, dtype=np.int32),
                           np.full((B,), self.ecfg.max_new_tokens, np.int32), np.int32(0))
      jax.block_until_ready(self._full)
    return self._full

  def fresh_slots(self, b: int):
    B = max(self.ecfg.buckets)
    compact = self.pool.get("compact", B, b)
    rows = np.arange(b, dtype=np.int32)
    s = compact(self.full_slots(), rows, np.ones((b,), bool))
    return jax.block_until_ready(s)

  def time_chunk(self, b: int, arm: str):
    """Seconds per round of the (b, arm) decode chunk: each call on fresh slots (every row at
    pos = prompt, made untimed just before it; the program donates them), the median over
    `repeats` calls of call time / rounds run."""
    t0 = time.perf_counter()
    program = self.pool.get("decode", b, arm)
    out = program(self.pool.params, self.pool.draft_params, self.fresh_slots(b), np.int32(0))
    jax.block_until_ready(out)
    del out
    compile_s = time.perf_counter() - t0
    times, rounds = [], []
    for _ in range(self.args.repeats):
      s = self.fresh_slots(b)
      start = time.perf_counter()
      res = program(self.pool.params, self.pool.draft_params, s, np.int32(0))
      jax.block_until_ready(res)
      times.append(time.perf_counter() - start)
      rounds.append(int(res[2]))
      del res, s
    per_round = float(np.median([t / max(r, 1) for t, r in zip(times, rounds)]))
    return per_round, times, compile_s, rounds

  def decode(self, b: int):
    per_round, times, compile_s, rounds = self.time_chunk(b, OFF)
    self.record(f"decode[{b}]", "decode", self.shape(bucket=b), per_round,
                predict.plain_cost(self.cfg, b, self.context, 1, self.stack),
                compile_s=compile_s, repeats=times, per="plain step (chunk / rounds)",
                note=f"chunk of {rounds[0]} rounds + the drafter's catch-up per call")

  def verify(self, b: int, arm: Arm):
    per_round, times, compile_s, rounds = self.time_chunk(b, arm.name)
    self.record(f"verify[{arm.name}][{b}]", "verify", self.shape(bucket=b, arm=arm.name),
                per_round, predict.round_cost(self.cfg, arm, b, self.context, 1, self.stack),
                compile_s=compile_s, repeats=times, per="SD round (chunk / rounds)",
                note=f"{arm.verify_tokens} verified tokens per row; chunk of {rounds[0]} rounds")

  def drafter_forward(self, b: int):
    gd, params = self.pool.graphdef, self.pool.params
    dgd, dparams = self.pool.draft_graphdef, self.pool.draft_params

    def fwd(params, dparams, tokens, features, cache, slot):
      target, drafter = nnx.merge(gd, params), nnx.merge(dgd, dparams)
      with ops.numerics_mode(self.ecfg.drafter_numerics):
        return drafter(target, tokens, features, cache, slot)
    t0 = time.perf_counter()
    cache = self.drafter.init_cache(b, self.context)
    features = jnp.zeros((b, 1, self.cfg.hidden_size), self.cfg.jnp_dtype)
    slot = jnp.full((b,), self.ecfg.max_prompt_len, jnp.int32)
    args = (jnp.zeros((b, 1), jnp.int32), features, cache, slot)
    program = jax.jit(fwd).lower(params, dparams, *args).compile()
    jax.block_until_ready(program(params, dparams, *args))
    compile_s = time.perf_counter() - t0
    median, times = _median_seconds(
        lambda: jax.block_until_ready(program(params, dparams, *args)), self.args.repeats)
    self.record(f"drafter forward[{b}]", "drafter forward", self.shape(rows=b, tokens=1), median,
                cm.drafter_forward(self.cfg, b, 1, self.context), compile_s=compile_s,
                repeats=times, per="call", note="one program call (inside a chunk it pays none)")

  # -- the train steps

  def drafter_train_step(self):
    a = self.args
    spot = SpotTrainer(self.drafter, self.target, buffer=None,
                       cfg=SpotConfig(rows=a.drafter_rows, row_len=a.drafter_row_len))
    devices = (jax.devices()[0],)
    t0 = time.perf_counter()
    spot.warm_up([devices])
    spot.lend(devices)
    B, T, D = a.drafter_rows, a.drafter_row_len, self.cfg.hidden_size
    rng = np.random.default_rng(1)
    feat = lambda: rng.standard_normal((B, T, D)).astype(self.cfg.jnp_dtype)
    spot._batches = [PackedBatch(
        rng.integers(0, self.cfg.vocab_size, (B, T), np.int32), feat(), feat(),
        np.ones((B, T), bool), np.tile(np.arange(T, dtype=np.int32), (B, 1)),
        np.ones((B, T), np.int32))]

    def step():
      spot.step()
      spot.wait()
    step()
    compile_s = time.perf_counter() - t0
    median, times = _median_seconds(step, self.args.repeats)
    self.record("drafter train step", "drafter train step",
                self.shape(train=True, rows=B, row_len=T, devices=1), median,
                cm.drafter_train_step(self.cfg, B, T), compile_s=compile_s, repeats=times,
                per="step", note="tlt.spot.SpotTrainer step (XLA numerics), batch host->device "
                                 "included")

  def policy_train_step(self):
    a = self.args
    R, L = a.train_rows, a.train_seq
    tcfg = TrainConfig(chunk_rows=R, length_bucket=L, lr=1e-5)
    t0 = time.perf_counter()
    # The update donates the LoRA arrays it is given: the trainer gets copies of them, so the
    # rollout programs (measured before and after) keep theirs.
    gd, adapters, rest = nnx.split(self.target, nnx.LoRAParam, ...)
    trainer = Trainer(nnx.merge(gd, jax.tree.map(jnp.copy, adapters), rest), tcfg)
    trainer.warm_up(L)
    rng = np.random.default_rng(2)
    prompt = a.prompt
    prompts = [rng.integers(0, self.cfg.vocab_size, prompt).tolist() for _ in range(R)]
    responses = [rng.integers(0, self.cfg.vocab_size, L - prompt).astype(np.int32)
                 for _ in range(R)]
    logps = [np.full(L - prompt, -3.0, np.float32) for _ in range(R)]
    batch = make_batch(prompts, responses, logps, rng.standard_normal(R).astype(np.float32), L)
    trainer.step(batch)
    compile_s = time.perf_counter() - t0
    median, times = _median_seconds(lambda: trainer.step(batch), self.args.repeats)
    self.record("policy train step", "policy train step",
                self.shape(train=True, rows=R, seq_len=L, lora_rank=a.lora_rank, devices=1,
                           extra_forwards=0), median,
                cm.train_step(self.cfg, R, L, lora_rank=a.lora_rank, extra_forwards=0),
                compile_s=compile_s, repeats=times, per="step",
                note="rl.trainer.Trainer.step: one update (no old-log-prob or reference "
                     "forward), LoRA on every linear; host batch prep included")

  def shape(self, *, train: bool = False, **kw) -> dict:
    """A program's shape as `tlt_jax.perf.measured` keys it (rollout programs: with the
    context their cache holds)."""
    return measured_lib.shape(**kw) if train else measured_lib.shape(context=self.context, **kw)

  # -- the order they are measured in

  def tasks(self):
    bs = list(self.ecfg.buckets)
    small = bs[0]
    out = [("decode", (small,))]
    out += [("verify", (small, arm)) for arm in self.arms if arm.name in self.allowed[small]]
    out += [("policy_train_step", ()), ("drafter_train_step", ())]
    if len(bs) > 1:
      out += [("decode", (bs[-1],)), ("drafter_forward", (bs[-1],))]
    out += [("verify", (bs[-1], arm)) for arm in self.arms
            if len(bs) > 1 and arm.name in self.allowed[bs[-1]]]
    for b in bs[1:-1]:
      out.append(("decode", (b,)))
      out += [("verify", (b, arm)) for arm in self.arms if arm.name in self.allowed[b]]
    if self.args.contention:
      out.append(("contended", ()))
    return out

  # -- contention (bench_tlt on this CPU: host "devices" share the same cores)

  def _beside(self, background_for, what: str):
    """Every decode and SD program again, timed on the first device while `background_for(b,
    arm)()` runs back to back on a second host device (in a thread)."""
    import threading  # noqa: PLC0415

    for b in self.ecfg.buckets:
      for arm in [OFF] + [x.name for x in self.arms if x.name in self.allowed[b]]:
        work = background_for(b, arm)
        stop, started = threading.Event(), threading.Event()

        def loop():
          while not stop.is_set():
            work()
            started.set()
        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
          started.wait()
          per_round, times, _, _ = self.time_chunk(b, arm)
        finally:
          stop.set()
          thread.join()
        name = f"decode[{b}]" if arm == OFF else f"verify[{arm}][{b}]"
        cost = (predict.plain_cost(self.cfg, b, self.context, 1, self.stack) if arm == OFF
                else predict.round_cost(self.cfg, next(x for x in self.arms if x.name == arm),
                                        b, self.context, 1, self.stack))
        shape = dict(bucket=b, concurrent=what)
        if arm != OFF:
          shape["arm"] = arm
        self.record(f"{name} + {what}", "decode" if arm == OFF else "verify",
                    self.shape(**shape), per_round, cost, compile_s=0.0, repeats=times,
                    per="plain step / SD round, contended",
                    note=f"timed while {what} ran on a second host device")

  def _spot_on(self, devices, seed: int) -> SpotTrainer:
    a = self.args
    spot = SpotTrainer(self.drafter, self.target, buffer=None,
                       cfg=SpotConfig(rows=a.drafter_rows, row_len=a.drafter_row_len))
    spot.warm_up([devices])
    spot.lend(devices)
    B, T, D = a.drafter_rows, a.drafter_row_len, self.cfg.hidden_size
    rng = np.random.default_rng(seed)
    feat = lambda: rng.standard_normal((B, T, D)).astype(self.cfg.jnp_dtype)
    spot._batches = [PackedBatch(
        rng.integers(0, self.cfg.vocab_size, (B, T), np.int32), feat(), feat(),
        np.ones((B, T), bool), np.tile(np.arange(T, dtype=np.int32), (B, 1)),
        np.ones((B, T), np.int32))]
    return spot

  def contended(self):
    """bench_tlt's two rollout groups on two host devices of the same two cores: every decode
    and SD program timed (a) while the other group runs the same program (both groups decode
    until the first one finishes) and (b) while `SpotTrainer` steps run on the other device
    (the finished group's device trains the drafter during the tail); and the drafter step's
    own time during (b). On accelerators the devices share nothing; here they share cores."""
    other = (jax.devices()[1],)
    pool = ProgramPool(self.target, self.drafter, self.ecfg, self.allowed,
                       placement=group_sharding(other))
    B = max(self.ecfg.buckets)
    rng = np.random.default_rng(4)
    prompts = rng.integers(0, self.cfg.vocab_size, (B, self.ecfg.max_prompt_len), np.int32)
    full = pool.get("prefill", B)(
        pool.params, pool.draft_params, prompts, np.full((B,), self.ecfg.max_prompt_len, np.int32),
        np.arange(B, dtype=np.int32), np.full((B,), self.ecfg.max_new_tokens, np.int32),
        np.int32(0))

    def decoding(b, arm):
      program, compact = pool.get("decode", b, arm), pool.get("compact", B, b)
      rows, live = np.arange(b, dtype=np.int32), np.ones((b,), bool)
      program(pool.params, pool.draft_params, compact(full, rows, live), np.int32(0))  # compile
      return lambda: jax.block_until_ready(
          program(pool.params, pool.draft_params, compact(full, rows, live), np.int32(0)))
    self._beside(decoding, "the other group decoding")

    spot = self._spot_on(other, seed=3)
    step_times = []

    def train_step():
      t0 = time.perf_counter()
      spot.step()
      spot.wait()
      step_times.append(time.perf_counter() - t0)
    train_step()
    step_times.clear()
    self._beside(lambda b, arm: train_step, "drafter training")
    a = self.args
    self.record("drafter train step + decoding", "drafter train step",
                self.shape(train=True, rows=a.drafter_rows, row_len=a.drafter_row_len,
                           devices=1, concurrent="decode"),
                float(np.median(step_times)),
                cm.drafter_train_step(self.cfg, a.drafter_rows, a.drafter_row_len),
                compile_s=0.0, repeats=step_times, per="step, contended",
                note="SpotTrainer steps on a second host device while the programs above ran")

  def run(self) -> dict:
    for method, args in self.tasks():
      label = f"{method}{list(a if isinstance(a, int) else a.name for a in args)}"
      if self.over_budget():
        self.skipped.append(label)
        continue
      getattr(self, method)(*args)
    return self.report()

  def report(self) -> dict:
    bs1 = next((r for r in self.rows if r["key"] == f"decode[{self.ecfg.buckets[0]}]"), None)
    a = self.args
    return dict(
        schema=measured_lib.SCHEMA, model=self.name,
        model_config=measured_lib.config_dict(self.cfg),
        reduced=dict(layers=a.layers, vocab=a.vocab) if (a.layers or a.vocab) else None,
        backend=jax.default_backend(), device=jax.devices()[0].device_kind,
        hardware_profile=self.hw.name, numerics=ops.numerics(), lora_rank=a.lora_rank,
        context=self.context, prompt_len=self.ecfg.max_prompt_len,
        chunk_steps=self.ecfg.chunk_steps, buckets=list(self.ecfg.buckets),
        arms=[x.name for x in self.arms], repeats=a.repeats,
        decode_bs1_hbm_roofline_fraction=bs1["hbm_roofline_fraction"] if bs1 else None,
        programs=self.rows, skipped=self.skipped, build_s=self.build_s,
        budget_s_per_model=a.budget_s_per_model,
        wall_s=time.perf_counter() - self.t_start,
        platform=f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}",
        quick=a.quick)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", nargs="+", default=["qwen2_5_0_5b"],
                 choices=sorted(MODELS) + ["bench_tlt"])
  p.add_argument("--quick", action="store_true",
                 help="CPU scale: 2 layers, buckets 1 4, context 128, chain2 + tree2_2_4, "
                      "train 2 x 64")
  p.add_argument("--layers", type=int, default=None, help="override the layer count")
  p.add_argument("--vocab", type=int, default=None, help="override the vocabulary (tests)")
  p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 elsewhere")
  p.add_argument("--numerics", default=None, choices=ops.NUMERICS_MODES, help="default xla")
  p.add_argument("--buckets", type=int, nargs="+", default=None)
  p.add_argument("--arms", default=None, help="SD arms (default chain4,tree8_4_32)")
  p.add_argument("--context", type=int, default=None, help="cache slots (default 1024)")
  p.add_argument("--prompt", type=int, default=None)
  p.add_argument("--max-new", type=int, default=None,
                 help="response slots (default: context - prompt - the draft window)")
  p.add_argument("--chunk-steps", type=int, default=None)
  p.add_argument("--sd-threshold", type=int, default=None, help="default 32")
  p.add_argument("--max-verify-tokens", type=int, default=1024)
  p.add_argument("--lora-rank", type=int, default=None, help="default 32")
  p.add_argument("--train-rows", type=int, default=None)
  p.add_argument("--train-seq", type=int, default=None)
  p.add_argument("--drafter-rows", type=int, default=None)
  p.add_argument("--drafter-row-len", type=int, default=None)
  p.add_argument("--repeats", type=int, default=None)
  p.add_argument("--budget-s", type=float, default=None,
                 help="wall budget for all models together (each gets an equal share; default "
                      "270 s, bench_tlt 1800 s: every program there feeds simulate_bench_tlt)")
  p.add_argument("--out-dir", default=RESULTS_DIR)
  p.add_argument("--contention", action="store_true",
                 help="also time every rollout program while the drafter trains on a second "
                      "host device (default with --model bench_tlt)")
  args = p.parse_args(argv)
  common = dict(numerics="xla", sd_threshold=32, lora_rank=32, budget_s=270.0)
  quick = dict(common, layers=2, buckets=[1, 4], arms="chain2,tree2_2_4", context=128, prompt=16,
               chunk_steps=4, train_rows=2, train_seq=64, drafter_rows=2, drafter_row_len=64,
               repeats=3)
  full = dict(common, layers=None, buckets=[1, 4, 16, 64], arms="chain4,tree8_4_32", context=1024,
              prompt=64, chunk_steps=16, train_rows=4, train_seq=1024, drafter_rows=8,
              drafter_row_len=512, repeats=5)
  if args.model == ["bench_tlt"]:  # bench_tlt.py's settings (base_config) as they run there
    c = bench_tlt_config()
    full = dict(full, buckets=list(c.rollout.buckets), arms=c.tlt.arms,
                prompt=c.rollout.max_prompt_len, max_new=c.rollout.max_new_tokens,
                chunk_steps=c.rollout.chunk_steps,
                drafter_rows=c.tlt.rows, drafter_row_len=c.tlt.row_len, lora_rank=c.lora.rank,
                train_rows=c.rl.chunk_rows, train_seq=c.rollout.max_prompt_len
                + c.rollout.max_new_tokens, sd_threshold=max(c.rollout.buckets),
                numerics=c.numerics, repeats=21,  # ms-long chunks: more repeats, same cost
                budget_s=1800.0)
    args.contention = True
  for k, v in (quick if args.quick else full).items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  args.budget_s_per_model = args.budget_s / len(args.model)
  return args


def out_path(args, name: str) -> str:
  suffix = "_quick" if args.quick else ""
  return os.path.join(args.out_dir, f"step_costs_{name}_{jax.default_backend()}{suffix}.json")


def main(argv=None) -> dict:
  args = parse_args(argv)
  # The XLA flags the numerics need (as tlt_jax.train sets them), before the first computation.
  determinism.configure(args.numerics)
  logs.configure("warning")
  cache_dir = compile_cache.configure(None)
  print(f"[bench_step_costs] compile cache: {cache_dir or 'off'}", file=sys.stderr)
  ops.set_numerics(args.numerics)
  hw_name = hardware_profile()
  reports = {}
  t0 = time.perf_counter()
  for name in args.model:
    bench = Bench(name, args, hw_name)
    report = bench.run()
    report["command"] = "python -m experiments.bench_step_costs " + " ".join(
        sys.argv[1:] if argv is None else argv)
    os.makedirs(args.out_dir, exist_ok=True)
    path = out_path(args, name)
    with open(path, "w") as f:
      json.dump(report, f, indent=2)
    report["written"] = path
    reports[name] = report
    del bench
    programs_lib.clear_shared_programs()
    gc.collect()
  out = reports[args.model[0]] if len(reports) == 1 else dict(
      models=reports, wall_s=time.perf_counter() - t0)
  print(json.dumps(out, indent=2))
  return out


if __name__ == "__main__":
  main()
