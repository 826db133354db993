"""Determinism benchmark: many copies of one prompt decoded in randomly composed batches.

    python -m experiments.bench_determinism [--quick]

For each numerics mode ("xla", "batch_invariant") the same schedule runs: batches of random size
1..64 (padded to the engine's bucket sizes with other prompts), each holding a random number of
copies of the target prompt at random rows. Sampling is at temperature 1.0 with Gumbel noise keyed
by (seed, request, position) only, so any difference between copies comes from the numerics.
Reports unique completions, the first diverging token, tokens/s, and the largest difference
between sampler log-probs (decode) and trainer log-probs (one full-sequence forward).
Prints one JSON object and writes experiments/results/determinism.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from tlt_jax import determinism

if "--xla-default-flags" not in sys.argv:
  determinism.configure("batch_invariant")  # before JAX creates its backend

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from pallas_kernels.common import round_up
from tlt_jax import compile_cache, logs, ops
from tlt_jax.model.transformer import ModelConfig, Transformer, init_cache
from tlt_jax.rollout.sampling import sample_tokens

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PROMPT_LEN = 16
TEMPERATURE = 1.0
EMBED_SCALE = 8.0
MODEL = ModelConfig(arch="qwen3", vocab_size=512, hidden_size=256, intermediate_size=768,
                    num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32, qk_norm=True,
                    dtype="bfloat16")


def build_model() -> tuple[nnx.GraphDef, nnx.State]:
  model = Transformer(MODEL, nnx.Rngs(0))
  # Logits of a few units (a trained model's range) rather than the near-zero ones of the 0.02
  # init: a tiny numeric difference can then flip a Gumbel-argmax, as it does in real rollouts.
  emb = model.embed_tokens.embedding
  emb.set_value((emb.get_value().astype(jnp.float32) * EMBED_SCALE).astype(emb.get_value().dtype))
  return nnx.split(model)


def make_decode(graphdef, new_tokens: int, num_slots: int):
  @jax.jit
  def decode(state, prompts_BxP, sample_ids_B, seed):
    model = nnx.merge(graphdef, state)
    B, P = prompts_BxP.shape
    out = model(prompts_BxP, cache=init_cache(MODEL, B, num_slots),
                write_slot_B=jnp.zeros((B,), jnp.int32))
    logits = out.logits_BxTxV[:, -1]

    def step(i, carry):
      cache, logits_BxV, tokens_BxN, logprobs_BxN = carry
      pos_B = jnp.full((B,), P + i, jnp.int32)
      tok_B = sample_tokens(logits_BxV, seed, sample_ids_B, pos_B, TEMPERATURE)
      logp_B = ops.token_logprobs(logits_BxV[:, None], tok_B[:, None], TEMPERATURE)[:, 0]
      o = model(tok_B[:, None], cache=cache, write_slot_B=pos_B)
      return (o.cache, o.logits_BxTxV[:, 0], tokens_BxN.at[:, i].set(tok_B),
              logprobs_BxN.at[:, i].set(logp_B))

    init = (out.cache, logits, jnp.zeros((B, new_tokens), jnp.int32),
            jnp.zeros((B, new_tokens), jnp.float32))
    _, _, tokens, logprobs = jax.lax.fori_loop(0, new_tokens, step, init)
    return tokens, logprobs

  return decode


def make_trainer_logprobs(graphdef):
  @jax.jit
  def trainer_logprobs(state, sequences_BxL):
    logits = nnx.merge(graphdef, state)(sequences_BxL).logits_BxTxV
    return ops.token_logprobs(logits[:, PROMPT_LEN - 1:-1], sequences_BxL[:, PROMPT_LEN:],
                              TEMPERATURE)

  return trainer_logprobs


def make_schedule(requests: int, rng: np.random.Generator):
  """Batches as (bucket, rows of target copies, actual size). The first is the prompt alone."""
  schedule = [(1, [0], 1)]
  copies = 1
  while copies < requests:
    size = int(rng.integers(1, 65))
    bucket = next(b for b in BUCKETS if b >= size)
    n = min(int(rng.integers(1, size + 1)), requests - copies)
    rows = sorted(rng.choice(bucket, size=n, replace=False).tolist())
    schedule.append((bucket, rows, size))
    copies += n
  return schedule


def run_mode(mode: str, schedule, target_prompt, state, decode, trainer_logprobs, rng_seed: int):
  rng = np.random.default_rng(rng_seed)
  completions, sampler_lp = [], []
  generated = 0
  with ops.numerics_mode(mode):
    backend = ops.backend()
    for bucket in sorted({b for b, _, _ in schedule}):  # compile outside the timed loop
      prompts = np.zeros((bucket, PROMPT_LEN), np.int32)
      jax.block_until_ready(decode(state, prompts, jnp.arange(bucket, dtype=jnp.int32), 0))
    start = time.perf_counter()
    for bucket, rows, size in tqdm(schedule, desc=f"decode [{mode}]", leave=False):
      prompts = rng.integers(0, MODEL.vocab_size, (bucket, PROMPT_LEN), dtype=np.int32)
      sample_ids = rng.integers(1, 2**30, bucket, dtype=np.int32)
      prompts[rows] = target_prompt
      sample_ids[rows] = 0  # every copy is the same request: same noise
      tokens, logprobs = decode(state, prompts, sample_ids, 0)
      tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
      completions += [tokens[r] for r in rows]
      sampler_lp += [logprobs[r] for r in rows]
      generated += size * tokens.shape[1]
    elapsed = time.perf_counter() - start
    # Trainer side: one full-sequence forward over up to 64 copies (a bucket of 64 rows).
    picks = np.linspace(0, len(completions) - 1, min(64, len(completions))).astype(int)
    seqs = np.stack([np.concatenate([target_prompt, completions[i]]) for i in picks])
    seqs = np.concatenate([seqs, np.repeat(seqs[:1], 64 - len(seqs), 0)])
    trainer = np.asarray(trainer_logprobs(state, seqs))[:len(picks)]
  diff = float(np.max(np.abs(trainer - np.stack([sampler_lp[i] for i in picks]))))
  # Copies whose tokens all agree with the one decoded alone may still differ in log-probs.
  same = [i for i, c in enumerate(completions) if np.array_equal(c, completions[0])]
  copies_diff = float(max(np.max(np.abs(sampler_lp[i] - sampler_lp[0])) for i in same))
  return completions, generated / elapsed, diff, backend, copies_diff


def first_divergence(completions) -> int | None:
  ref = completions[0]  # decoded alone
  firsts = [int(np.argmax(c != ref)) for c in completions if not np.array_equal(c, ref)]
  return min(firsts) if firsts else None


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="64 requests x 32 tokens (for CI)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--xla-default-flags", action="store_true",
                      help="internal: only time numerics=xla with XLA's default CPU flags")
  args = parser.parse_args()
  logs.configure("warning")
  cache_dir = compile_cache.configure(None)
  print(f"[bench_determinism] compile cache: {cache_dir or 'off'}", file=sys.stderr)
  requests, new_tokens = (64, 32) if args.quick else (512, 128)
  rng = np.random.default_rng(args.seed)
  schedule = make_schedule(requests, rng)
  target_prompt = rng.integers(0, MODEL.vocab_size, PROMPT_LEN, dtype=np.int32)
  graphdef, state = build_model()
  decode = make_decode(graphdef, new_tokens, round_up(PROMPT_LEN + new_tokens, ops.KV_SPLIT))
  trainer_logprobs = make_trainer_logprobs(graphdef)
  if args.xla_default_flags:
    _, tps, _, _, _ = run_mode("xla", schedule, target_prompt, state, decode, trainer_logprobs, 1)
    print(json.dumps({"tokens_per_s_xla": tps}))
    return

  results = {}
  for mode in ("xla", "batch_invariant"):
    completions, tps, diff, backend, copies_diff = run_mode(mode, schedule, target_prompt, state,
                                                            decode, trainer_logprobs, args.seed + 1)
    results[mode] = dict(unique=len({c.tobytes() for c in completions}), tps=tps, diff=diff,
                         first=first_divergence(completions), n=len(completions),
                         backend=backend, copies_diff=copies_diff)
  # XLA with its default CPU flags (FMA on), in a fresh process: what a user of plain XLA gets.
  cmd = [sys.executable, "-m", "experiments.bench_determinism", "--xla-default-flags",
         "--seed", str(args.seed)] + (["--quick"] if args.quick else [])
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
  tps_xla_default = json.loads(proc.stdout.strip().splitlines()[-1])["tokens_per_s_xla"]

  xla, bi = results["xla"], results["batch_invariant"]
  report = {
      "requests": xla["n"],
      "new_tokens_per_request": new_tokens,
      "batches": len(schedule),
      "batch_sizes": "uniform 1..64, padded to buckets " + ",".join(map(str, BUCKETS)),
      "model": f"{MODEL.arch} {MODEL.num_layers}x{MODEL.hidden_size} vocab {MODEL.vocab_size} "
               f"{MODEL.dtype}",
      "temperature": TEMPERATURE,
      "unique_xla": xla["unique"],
      "unique_batch_invariant": bi["unique"],
      "first_divergence_xla": xla["first"],
      "first_divergence_batch_invariant": bi["first"],
      "tokens_per_s_xla": xla["tps"],
      "tokens_per_s_batch_invariant": bi["tps"],
      "overhead": xla["tps"] / bi["tps"],
      "tokens_per_s_xla_default_flags": tps_xla_default,
      "overhead_vs_xla_default_flags": tps_xla_default / bi["tps"],
      "max_abs_logprob_diff_across_identical_copies_xla": xla["copies_diff"],
      "max_abs_logprob_diff_across_identical_copies_batch_invariant": bi["copies_diff"],
      "max_abs_logprob_diff_sampler_trainer_xla": xla["diff"],
      "max_abs_logprob_diff_sampler_trainer_batch_invariant": bi["diff"],
      "numerics_backend": bi["backend"],
      "platform": f"{jax.default_backend()} ({platform.processor() or platform.machine()}, "
                  f"{os.cpu_count()} cores), jax {jax.__version__}",
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "quick": args.quick,
  }
  os.makedirs(RESULTS_DIR, exist_ok=True)
  name = "determinism_quick.json" if args.quick else "determinism.json"
  with open(os.path.join(RESULTS_DIR, name), "w") as f:
    json.dump(report, f, indent=2)
  print(json.dumps(report))


if __name__ == "__main__":
  main()
