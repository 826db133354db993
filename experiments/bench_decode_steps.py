"""Decode step time per batch bucket, XLA against batch-invariant numerics, side by side.

    python -m experiments.bench_decode_steps [--new-tokens 32] [--repeats 5]

`bench_determinism`'s model and decode loop (prefill of 16 tokens, then `--new-tokens` sampled
steps in one jitted loop), timed per bucket 1..64: milliseconds per decoded token step (the
prefill amortized in), the best of `--repeats`. Where `bench_determinism` gives one overhead
over a mix of batch sizes, this says which sizes it comes from. It only imports
`bench_determinism.build_model` / `make_decode`, so running it with PYTHONPATH pointing at an
older checkout times that checkout's kernels on the same machine. Prints one JSON object and
writes experiments/results/decode_steps.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import bench_determinism as bd  # configures batch-invariant XLA flags first
from tlt_jax import compile_cache, logs, ops


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  logs.configure("warning")
  cache_dir = compile_cache.configure(None)
  print(f"[bench_decode_steps] compile cache: {cache_dir or 'off'}", file=sys.stderr)
  graphdef, state = bd.build_model()
  decode = bd.make_decode(graphdef, args.new_tokens,
                          bd.round_up(bd.PROMPT_LEN + args.new_tokens, ops.KV_SPLIT))
  ms = {}
  for mode in ("xla", "batch_invariant"):
    with ops.numerics_mode(mode):
      ms[mode] = {}
      for bucket in bd.BUCKETS:
        prompts = np.zeros((bucket, bd.PROMPT_LEN), np.int32)
        ids = jnp.arange(bucket, dtype=jnp.int32)
        jax.block_until_ready(decode(state, prompts, ids, 0))  # compile
        times = []
        for _ in range(args.repeats):
          start = time.perf_counter()
          jax.block_until_ready(decode(state, prompts, ids, 0))
          times.append(time.perf_counter() - start)
        ms[mode][bucket] = 1e3 * min(times) / args.new_tokens
  result = {
      "model": f"{bd.MODEL.arch} {bd.MODEL.num_layers}x{bd.MODEL.hidden_size} vocab "
               f"{bd.MODEL.vocab_size} {bd.MODEL.dtype}",
      "new_tokens": args.new_tokens, "repeats": args.repeats,
      "ms_per_step": ms,
      "overhead_by_bucket": {b: ms["batch_invariant"][b] / ms["xla"][b] for b in bd.BUCKETS},
      "platform": f"cpu ({platform.machine()}, {os.cpu_count()} cores), jax {jax.__version__}",
  }
  print(json.dumps(result, indent=2))
  os.makedirs(bd.RESULTS_DIR, exist_ok=True)
  with open(os.path.join(bd.RESULTS_DIR, "decode_steps.json"), "w") as f:
    json.dump(result, f, indent=2)


if __name__ == "__main__":
  main()
