"""Rollout benchmark: plain vs speculative decoding per batch bucket, and one long-tail batch.

    python -m experiments.bench_rollout [--quick]

Target: a Qwen3-style decoder of 8 layers; drafter: the EAGLE-style layer, warmed up on the
target's own rollouts (its hidden states) before measuring. For each batch size the engine runs
plain decode and then lets the tuner pick among its arms (the reported `arm` is its choice
after exploring). The long-tail part decodes one batch of 64 samples whose length budgets are
heavy-tailed (Pareto, like reasoning RL responses) three ways: `static` (no compaction, no SD),
`compaction`, and `compaction_sd` (compaction + the adaptive tuner).

History arms (`rollout.history`: chains drafted on the host from text already produced, no
drafter) run on their own engine (no learned drafter, so their rounds pay no drafter forward),
side by side with the others in the same run: per batch size the best history arm as measured
(`history`), on the same batch and seed as the other arms, its history cleared before each timed
run (the untimed runs decoded the same tokens: they would be drafts that cannot miss). These
batches are distinct random prompts with one sample each, so there are no siblings and no
earlier responses to the same prompt: the case where a history drafter has least to draft from
(`bench_history` measures GRPO-shaped groups and revisits). In the long tail,
`compaction_history` is compaction with the tuner free over off and the model-free arms, having
explored on other seeds, its history cleared before the timed run.
Lookup arms (`lookup_chainN`: chains looked up on device in the bucket's rows and a bank of recent
responses, `chunk_steps` rounds per program call) run on the history engine too, measured the same
way (`lookup`: the best lookup arm per batch size), their bank emptied with the history.
The trees (`lookup_treeD_W`: W looked-up chains verified as one trie; `combined_treeD_W`: the
learned drafter's chain and W looked-up ones in one trie) run on a third engine, with the drafter
and without history arms, once the other engines are freed, on the same batches, measured the
same way (`lookup_tree` and `combined`: the best of each per batch size); in the long tail
`compaction_combined` is compaction with the tuner free over off, those trees and the learned
chains 2 and 4, explored on other seeds, its bank emptied before the timed run.
Prints one JSON object and writes experiments/results/rollout.json.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import os
import platform
import sys
import time

import jax
import numpy as np
from flax import nnx

from tlt_jax import compile_cache, logs, ops
from tlt_jax.model.drafter import Drafter
from tlt_jax.model.transformer import ModelConfig, Transformer
from tlt_jax.rollout import programs
from tlt_jax.rollout.config import EngineConfig
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.history import HistoryDrafter
from tlt_jax.rollout.tuner import (OFF, combined_arm, default_arms, history_arm, lookup_arm,
                                   lookup_tree_arm, tree_arm)
from tlt_jax.tlt.drafter_trainer import train_on_sequences

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TARGET = ModelConfig(arch="qwen3", vocab_size=512, hidden_size=256, intermediate_size=768,
                     num_layers=8, num_heads=8, num_kv_heads=2, head_dim=32, qk_norm=True)
PROMPT_LEN = 16
HISTORY_DEPTHS = (2, 4, 8)
HISTORY_GLOBAL_TOKENS = 4096  # as bench_tlt's history variant
LOOKUP_TREES = ((4, 2), (4, 3))  # (depth, chains): verify 9 and 13 tokens
COMBINED_TREES = ((4, 1), (4, 2))  # (depth, looked-up chains) beside the learned chain of depth


def build_target() -> Transformer:
  target = Transformer(TARGET, nnx.Rngs(0))
  emb = target.embed_tokens.embedding  # logits of a few units: a distribution with structure
  emb.set_value(emb.get_value() * 30.0)
  return target


def prompts(n: int, rng: np.random.Generator) -> list[list[int]]:
  return [rng.integers(0, TARGET.vocab_size, PROMPT_LEN).tolist() for _ in range(n)]


def copy_bandwidth_gbs() -> float:
  a = np.ones(64 * 2**20 // 4, np.float32)
  b = np.empty_like(a)
  start = time.perf_counter()
  for _ in range(5):
    np.copyto(b, a)
  return 5 * 2 * a.nbytes / (time.perf_counter() - start) / 1e9


def fresh_history(engine: RolloutEngine) -> None:
  """Forget every response the model-free drafters could draft from (history and bank)."""
  engine.clear_bank()
  engine.history = HistoryDrafter(global_tokens=HISTORY_GLOBAL_TOKENS)


def measure(engine: RolloutEngine, batch: list[list[int]], arm: str) -> dict:
  tps, trace = tokens_per_s(engine, batch, arm=arm)
  rounds = [t for t in trace if t.arm == arm]
  out = dict(tokens_per_s=tps, accept_len=sum(t.emitted for t in rounds) / max(
      sum(t.live * t.rounds for t in rounds), 1))
  if engine.history is not None and rounds and arm.startswith("history"):
    out["host_ms_per_round"] = 1e3 * sum(t.host_s for t in rounds) / len(rounds)
  return out


def release() -> None:
  """Frees the programs of engines no longer referenced: their executables, the ones engines
  share within the process (`programs.clear_shared_programs`) and JAX's caches."""
  gc.collect()
  programs.clear_shared_programs()
  jax.clear_caches()


def tokens_per_s(engine: RolloutEngine, batch: list[list[int]], **kwargs) -> tuple[float, list]:
  engine.trace.clear()
  start = time.perf_counter()
  samples = engine.generate(batch, **kwargs)
  elapsed = time.perf_counter() - start
  return sum(len(s.tokens) for s in samples) / elapsed, list(engine.trace)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--numerics", default="xla", choices=ops.NUMERICS_MODES)
  args = parser.parse_args()
  logs.configure("warning")
  cache_dir = compile_cache.configure(None)
  print(f"[bench_rollout] compile cache: {cache_dir or 'off'}", file=sys.stderr)
  ops.set_numerics(args.numerics)
  load_before = os.getloadavg()[0]
  rng = np.random.default_rng(0)
  new_tokens = 32 if args.quick else 96
  buckets = (1, 4, 16) if args.quick else BUCKETS
  arms = default_arms((2, 4, 6)) + (tree_arm(4, 2, 8),)
  cfg = EngineConfig(buckets=BUCKETS, max_prompt_len=PROMPT_LEN, max_new_tokens=new_tokens,
                     chunk_steps=8, sampling=SamplingParams(temperature=1.0), arms=arms,
                     max_verify_tokens_per_bucket=256)
  target = build_target()

  # Warm up the drafter on the target's own outputs.
  t0 = time.perf_counter()
  plain_engine = RolloutEngine(target, cfg)
  warm = plain_engine.generate(prompts(64 if args.quick else 256, rng), arm=OFF)
  drafter = Drafter(TARGET, nnx.Rngs(1))
  drafter_metrics = train_on_sequences(drafter, target,
                                       [s.prompt + s.tokens.tolist() for s in warm],
                                       steps=150 if args.quick else 600, batch_size=32)
  warmup_s = time.perf_counter() - t0

  del plain_engine
  release()

  engine = RolloutEngine(target, cfg, drafter)
  engine.pool.warm_up()
  hist_engine = RolloutEngine(target, dataclasses.replace(
      cfg, arms=(arms[0],) + tuple(history_arm(d) for d in HISTORY_DEPTHS)
      + tuple(lookup_arm(d) for d in HISTORY_DEPTHS)))
  fresh_history(hist_engine)
  hist_engine.pool.warm_up()
  batches, per_bucket = {}, []
  for b in buckets:
    batch = batches[b] = prompts(b, rng)
    allowed = engine.tuner.allowed[b]
    for arm in allowed:  # first executions are slow (allocation): run each once untimed
      engine.generate(batch, arm=arm)
    for _ in range(2 if args.quick else 3):  # the tuner explores this bucket on warm programs
      engine.generate(prompts(b, rng))
    best = engine.tuner.best(b)
    hist_allowed = [a for a in hist_engine.tuner.allowed[b] if a != OFF]
    for arm in hist_allowed:
      hist_engine.generate(batch, arm=arm)
    by_arm = {}
    for arm in allowed:
      by_arm[arm] = measure(engine, batch, arm)
    for arm in hist_allowed:
      fresh_history(hist_engine)
      by_arm[arm] = measure(hist_engine, batch, arm)
    plain = by_arm[OFF]["tokens_per_s"]
    per_bucket.append(dict(batch_size=b, plain_tokens_per_s=plain,
                           sd_tokens_per_s=by_arm[best]["tokens_per_s"],
                           speedup=by_arm[best]["tokens_per_s"] / plain,
                           accept_len=by_arm[best]["accept_len"], arm=best, arms=by_arm))
    print(f"[bench_rollout] batch {b}: plain {plain:.0f} tok/s, {best} "
          f"{by_arm[best]['tokens_per_s']:.0f}", file=sys.stderr)

  # One long-tail batch: 64 samples, Pareto length budgets (most short, a few at the cap).
  budgets = np.minimum(np.ceil(4 * (1 + rng.pareto(1.2, 64))), new_tokens).astype(int).tolist()
  tail_prompts = prompts(64, rng)
  static_engine = RolloutEngine(target, dataclasses.replace(cfg, compaction=False), drafter)
  long_tail = {}
  for name, eng, arm in (("static", static_engine, OFF), ("compaction", engine, OFF),
                         ("compaction_sd", engine, None)):
    for _ in range(1 if arm == OFF else 3):  # compile, first executions, tuner exploration
      eng.generate(tail_prompts, arm=arm, max_new_per_sample=budgets)
    start = time.perf_counter()
    eng.trace.clear()
    eng.generate(tail_prompts, arm=arm, max_new_per_sample=budgets)
    long_tail[name] = time.perf_counter() - start
    if name == "compaction_sd":
      long_tail["trace"] = [dataclasses.asdict(t) for t in eng.trace]
  del eng
  for seed in (1, 2, 3):  # the tuner explores the model-free arms on other seeds' tokens
    hist_engine.generate(tail_prompts, max_new_per_sample=budgets, seed=seed)
  fresh_history(hist_engine)
  hist_engine.trace.clear()
  start = time.perf_counter()
  hist_engine.generate(tail_prompts, max_new_per_sample=budgets)
  long_tail["compaction_history"] = time.perf_counter() - start
  long_tail["history_chunks_by_arm"] = dict(collections.Counter(t.arm for t in hist_engine.trace))
  # A CPU process maps each compiled program's code separately, and three warmed-up engines'
  # programs pass Linux's default limit of 65530 maps ("LLVM compilation error: Cannot allocate
  # memory", then a crash): the tree engine runs once the others are gone.
  del engine, hist_engine, static_engine
  release()

  tree_engine = RolloutEngine(target, dataclasses.replace(
      cfg, arms=arms[:3] + tuple(lookup_tree_arm(d, w) for d, w in LOOKUP_TREES)
      + tuple(combined_arm(d, w) for d, w in COMBINED_TREES)), drafter)
  tree_engine.pool.warm_up()
  for row in per_bucket:
    b, batch = row["batch_size"], batches[row["batch_size"]]
    tree_allowed = [a for a in tree_engine.tuner.allowed[b] if "_tree" in a]
    for arm in tree_allowed:
      tree_engine.generate(batch, arm=arm)
    for arm in tree_allowed:
      tree_engine.clear_bank()
      row["arms"][arm] = measure(tree_engine, batch, arm)
  for seed in (1, 2, 3):  # the tuner explores off, the learned chains and the trees
    tree_engine.generate(tail_prompts, max_new_per_sample=budgets, seed=seed)
  tree_engine.clear_bank()
  tree_engine.trace.clear()
  start = time.perf_counter()
  tree_engine.generate(tail_prompts, max_new_per_sample=budgets)
  long_tail["compaction_combined"] = time.perf_counter() - start
  long_tail["combined_chunks_by_arm"] = dict(collections.Counter(t.arm for t in tree_engine.trace))

  kinds = {"history": "history_", "lookup": "lookup_chain", "lookup_tree": "lookup_tree",
           "combined": "combined_tree"}
  for row in per_bucket:  # per batch size the best arm of each kind, as measured
    by_arm, plain = row["arms"], row["plain_tokens_per_s"]
    for kind, prefix in kinds.items():
      arm = max((a for a in by_arm if a.startswith(prefix)),
                key=lambda a: by_arm[a]["tokens_per_s"], default=None)
      if arm is not None:
        row[kind] = dict(arm=arm, accept_len=by_arm[arm]["accept_len"],
                         tokens_per_s=by_arm[arm]["tokens_per_s"],
                         speedup=by_arm[arm]["tokens_per_s"] / plain)
    row["arms"] = row.pop("arms")  # after the per-kind entries, as before
    print(f"[bench_rollout] batch {row['batch_size']}: plain {plain:.0f} tok/s, "
          + ", ".join(f"{row[k]['arm']} {row[k]['tokens_per_s']:.0f}" for k in kinds if k in row),
          file=sys.stderr)
  long_tail["speedup"] = long_tail["static"] / long_tail["compaction_sd"]
  long_tail["speedup_history"] = long_tail["static"] / long_tail["compaction_history"]
  long_tail["speedup_combined"] = long_tail["static"] / long_tail["compaction_combined"]
  long_tail["budgets"] = budgets

  params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(target, nnx.Param)))
  kv_bytes = 2 * TARGET.num_layers * cfg.num_slots * TARGET.num_kv_heads * TARGET.head_dim * 4
  bs1 = per_bucket[0]
  bandwidth = copy_bandwidth_gbs()
  report = {
      "target": f"{TARGET.arch} {TARGET.num_layers}x{TARGET.hidden_size} vocab "
                f"{TARGET.vocab_size} {TARGET.dtype}",
      "numerics": args.numerics,
      "new_tokens": new_tokens,
      "drafter_warmup": dict(seconds=warmup_s, **drafter_metrics),
      "batch_sizes": per_bucket,
      "long_tail": long_tail,
      "roofline_fraction_bs1": (params + kv_bytes) * bs1["plain_tokens_per_s"] / (bandwidth * 1e9),
      "copy_bandwidth_gbs": bandwidth,
      "platform": f"{jax.default_backend()} ({platform.machine()}, {os.cpu_count()} cores), "
                  f"jax {jax.__version__}",
      "quick": args.quick,
      # other processes share these cores: the 1-minute load average at the start and the end
      "load_average": [load_before, os.getloadavg()[0]],
  }
  os.makedirs(RESULTS_DIR, exist_ok=True)
  with open(os.path.join(RESULTS_DIR, "rollout_quick.json" if args.quick else "rollout.json"),
            "w") as f:
    json.dump(report, f, indent=2)
  summary = {k: v for k, v in report.items() if k != "long_tail"}
  summary["long_tail"] = {k: v for k, v in long_tail.items() if k not in ("trace", "budgets")}
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
