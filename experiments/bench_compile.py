"""Compile time of the rollout's programs, one at a time against side by side (`CompileQueue`).

    python -m experiments.bench_compile [--workers 1,2] [--accel-site /tmp/tlt-accel]

The default job's rollout programs (`ProgramPool.program_keys()` of
experiments/configs/tiny_arith.py: prefill, decode, insert, compaction per bucket) are lowered
in the main thread and compiled by a `CompileQueue` of each `--workers` count, each count in a
fresh process with the persistent compilation cache off, so nothing is loaded or remembered.
Targets: this CPU, and an H100 (sm_90, Triton kernels, ptxas) when `--accel-site` holds
requirements-accel.txt's wheels (the CUDA plugin compiles for an abstract H100 without one).
Prints one JSON object and writes experiments/results/compile.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from flax import nnx

from pallas_kernels import targets as targets_lib
from tlt_jax import config as config_lib
from tlt_jax import determinism, logs, ops
from tlt_jax import job as job_lib
from tlt_jax.compile_queue import CompileQueue
from tlt_jax.rollout.programs import ProgramPool

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "tiny_arith.py")


def child(target: str, workers: int) -> dict:
  """In this process: the pool's programs for `target`, compiled by `workers` threads."""
  c = config_lib.load_config_file(CONFIG)
  c.workdir = tempfile.mkdtemp(prefix="bench_compile-")
  config_lib.validate(c)
  logs.configure("warning")
  determinism.configure(c.numerics, c.xla_determinism, c.numerics_f32_matmul)
  with ops.numerics_mode(c.numerics, c.numerics_backend):
    job = job_lib.build(c, "bench_compile")
  built = job.engine.engines[0].pool
  drafter = nnx.merge(built.draft_graphdef, built.draft_params) if built.draft_graphdef else None
  pool = ProgramPool(nnx.merge(built.graphdef, built.params), drafter, built.cfg,
                     built.allowed_arms)
  job.close()
  backend, context = c.numerics_backend, contextlib.nullcontext()
  if target == "h100":  # the kernels through Triton, on an abstract H100
    device = targets_lib.abstract_device("h100")
    pool.params = targets_lib.on_device(pool.params, device)
    pool.draft_params = targets_lib.on_device(pool.draft_params, device)
    backend, context = "pallas", targets_lib.target_context("h100")
  queue = CompileQueue(workers)
  with ops.numerics_mode(c.numerics, backend):
    t0 = time.perf_counter()
    with context:
      programs = pool.warm_up(queue)
    lowered_s = time.perf_counter() - t0
    queue.wait()
    wall_s = time.perf_counter() - t0
  return {"target": target, "workers": workers, "programs": programs,
          "lower_s": round(lowered_s, 2), "wall_s": round(wall_s, 2)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workers", default="1,2", help="comma-separated thread counts")
  parser.add_argument("--accel-site", default="",
                      help="a `pip install --target` folder of requirements-accel.txt (H100)")
  parser.add_argument("--child", default="", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    target, workers = args.child.split(":")
    print(json.dumps(child(target, int(workers))))
    return
  workers = [int(w) for w in args.workers.split(",")]
  targets = ["cpu"] + (["h100"] if args.accel_site else [])
  runs = []
  for target in targets:
    env = dict(os.environ, TLT_JAX_CACHE_DIR="", JAX_COMPILATION_CACHE_DIR="")
    if target == "h100":
      env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
          p for p in (args.accel_site, env.get("PYTHONPATH", "")) if p))
    for w in workers:
      out = subprocess.run([sys.executable, "-m", "experiments.bench_compile", "--child",
                            f"{target}:{w}"], env=env, capture_output=True, text=True,
                           check=False)
      if out.returncode:
        sys.exit(f"bench_compile {target} workers={w} failed:\n{out.stderr[-3000:]}")
      runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
      print(f"[bench_compile] {runs[-1]}", file=sys.stderr)
  speedup = {}
  for target in targets:
    by_workers = {r["workers"]: r["wall_s"] for r in runs if r["target"] == target}
    one = by_workers.get(1)
    speedup[target] = {w: round(one / s, 3) for w, s in by_workers.items() if one and w != 1}
  result = {"config": os.path.relpath(CONFIG), "runs": runs, "speedup_vs_one_worker": speedup,
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
            "command": "python -m experiments.bench_compile " + " ".join(sys.argv[1:])}
  os.makedirs("experiments/results", exist_ok=True)
  with open("experiments/results/compile.json", "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
