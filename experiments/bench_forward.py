"""Batch-invariant forward of the tiny_arith policy at the shapes the RL job runs: decode (T=1),
SD verify (T=3, 5) and the trainer's chunk (16 rows x 232 tokens), with the blocked attention
looping over query positions (what `attention_blocked_jax` does) vs all positions at once (its
single-pass core, which the loop calls per position). Both give the same bits (asserted here);
only the time differs. XLA numerics for reference.

    python -m experiments.bench_forward

Each figure: median ms per forward over repeated calls inside one jitted loop, side by side in
one process. Prints one JSON object and writes experiments/results/forward.json.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

from tlt_jax import determinism

determinism.configure("batch_invariant")  # before JAX creates its backend

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import attention as attention_kernels
from tlt_jax import (compile_cache, logs, ops)
from tlt_jax import config as config_lib
from tlt_jax import job as job_lib
from tlt_jax.model.transformer import init_cache

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "tiny_arith.py")
SHAPES = ((1, 1), (1, 3), (1, 5), (16, 1), (16, 5), (16, 232))  # (rows B, query tokens T)
SLOTS = 256  # the RL job's cache: 40 prompt + 192 response + the SD window, padded to 32


def forward_loop(model, B: int, T: int, reps: int):
  """`reps` forwards of B x T tokens written at slot 0 of a SLOTS cache, in one jitted loop."""
  graphdef, params = nnx.split(model)
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, model.cfg.vocab_size, (B, T)),
                       jnp.int32)

  def body(_, carry):
    cache, _ = carry
    out = nnx.merge(graphdef, params)(tokens, cache=cache, write_slot_B=jnp.zeros((B,), jnp.int32))
    return out.cache, out.logits_BxTxV

  zeros = jnp.zeros((B, T, model.cfg.vocab_size), jnp.float32)
  return jax.jit(lambda: jax.lax.fori_loop(0, reps, body, (init_cache(model.cfg, B, SLOTS),
                                                           zeros))[1])


def time_ms(fn, reps: int, trials: int = 3) -> tuple[float, np.ndarray]:
  out = jax.block_until_ready(fn())  # compile + first run
  times = []
  for _ in range(trials):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append((time.perf_counter() - t) / reps * 1000)
  return float(np.median(times)), np.asarray(out)


def main() -> None:
  c = config_lib.load_config_file(CONFIG)
  logs.configure(c.log_level)
  cache_dir = compile_cache.configure(c.compile.cache_dir)
  print(f"[bench_forward] compile cache: {cache_dir or 'off'}", file=sys.stderr)
  model = job_lib.load_policy(c)[0]
  looped = attention_kernels.attention_blocked_jax
  def one_pass(q, k, v, mask, scale, causal=False):  # the single-pass core, to compare
    del causal  # these forwards write a cache: never the causal hint
    return attention_kernels._attention_splits(q, k, v, mask, scale)  # noqa: SLF001
  rows = []
  for B, T in SHAPES:
    reps = max(2, min(200, 20000 // (B * T)))
    row = {"B": B, "T": T}
    with ops.numerics_mode("batch_invariant"):
      row["looped_ms"], looped_out = time_ms(forward_loop(model, B, T, reps), reps)
      attention_kernels.attention_blocked_jax = one_pass
      try:
        row["one_pass_ms"], one_pass_out = time_ms(forward_loop(model, B, T, reps), reps)
      finally:
        attention_kernels.attention_blocked_jax = looped
    with ops.numerics_mode("xla"):
      row["xla_ms"], _ = time_ms(forward_loop(model, B, T, reps), reps)
    row["same_bits"] = bool(np.array_equal(looped_out, one_pass_out))
    row["one_pass_over_looped"] = row["one_pass_ms"] / row["looped_ms"]
    row["looped_over_xla"] = row["looped_ms"] / row["xla_ms"]
    rows.append(row)
    print(row, flush=True)
  result = {"machine": f"{platform.machine()} {os.cpu_count()} cpus", "model": "tiny_arith 4 x 128",
            "slots": SLOTS, "rows": rows}
  os.makedirs(RESULTS_DIR, exist_ok=True)
  with open(os.path.join(RESULTS_DIR, "forward.json"), "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
