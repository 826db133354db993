"""Probe of the batch-invariant Pallas kernels on the device at hand (GPU, TPU, or CPU interpret).

    python -m experiments.gpu_kernel_probe [--out FILE.json] [--budget 90]        # GPU / TPU
    python -m experiments.gpu_kernel_probe --cpu [--layout gpu]                   # tiny shapes

For each public kernel of `pallas_kernels` (matmul, rms_norm, attention, log_softmax,
token_logprobs) at a few realistic shapes (head_dim 64 / 80 / 128, hidden 896 / 3584, vocabulary
1000 / 151936, f32 and bf16 inputs), one case reports:
- `max_abs_err` (and `max_rel_err`, relative to the largest |reference|) of the kernel on a batch
  of `--rows` rows against the module's `*_reference` (f32 HIGHEST precision);
- batch invariance: row r computed alone (a batch of 1) and inside a batch of 3 must be bitwise
  the rows of the big batch (`mismatched_rows` of `rows_checked`, compared bit for bit);
- `ms`: milliseconds per call at 1 row and at `--rows` rows (after a warm-up call, timed over
  enough back-to-back calls to fill ~0.1 s, the median of 3 such loops), and the reference's
  (XLA) at `--rows` rows, for scale.
Each case runs in its own try/except; a failure records the exception's type and first line.
Cases run in priority order until `--budget` seconds are spent; the rest are listed as skipped.
Prints one JSON object (last line of stdout) and writes it to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

try:  # the flags the real runs use (no FMA on x86 CPU, deterministic ops on GPU), before JAX starts
  from tlt_jax import determinism
  determinism.configure("batch_invariant")
  CONFIGURE_ERROR = None
except Exception as e:  # noqa: BLE001 (the probe must run whatever the tree's state)
  CONFIGURE_ERROR = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention, logsoftmax, matmul, rmsnorm


def first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def bits(x) -> np.ndarray:
  """A row-major array of the raw bits (bitwise comparison; NaN == NaN when its bits are)."""
  a = np.asarray(jax.device_get(x))
  if a.dtype.itemsize == 2:
    return a.view(np.uint16)
  if a.dtype.itemsize == 4:
    return a.view(np.uint32)
  return a.view(np.uint64) if a.dtype.itemsize == 8 else a


def time_ms(fn, *args, loops: int = 3, target_s: float = 0.1) -> float:
  """Median ms per call over `loops` loops of back-to-back calls (warm: compiled already)."""
  jax.block_until_ready(fn(*args))
  t = time.perf_counter()
  jax.block_until_ready(fn(*args))
  one = max(time.perf_counter() - t, 1e-6)
  n = int(min(max(target_s / one, 3), 200))
  times = []
  for _ in range(loops):
    t = time.perf_counter()
    out = None
    for _ in range(n):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t) / n * 1e3)
  return float(np.median(times))


# ------------------------------------------------------------------------------------------ cases
# A case: (kernel name, dtype, shape dict). `make(rng, B)` builds the inputs of a batch of B rows
# as a tuple of arrays whose axis 0 is the row; `call` / `ref` take them.


def _kernels(layout: str | None):

  kw = {"layout": layout} if layout else {}

  def with_layout(fn):  # `layout=` only where the kernel takes it
    if not kw:
      return fn
    return lambda *a, **k: fn(*a, **k, **kw)

  return {
      "matmul": (with_layout(matmul.matmul_pallas), matmul.matmul_reference),
      "rms_norm": (with_layout(rmsnorm.rms_norm_pallas), rmsnorm.rms_norm_reference),
      "attention": (with_layout(attention.attention_pallas), attention.attention_reference),
      "log_softmax": (logsoftmax.log_softmax_pallas, logsoftmax.log_softmax_reference),
      "token_logprobs": (logsoftmax.token_logprobs_pallas, logsoftmax.token_logprobs_reference),
  }


def case_list(cpu: bool):
  """(kernel, dtype, shape) in priority order: one realistic shape of each kernel in f32 and
  bf16 first, then the other shapes."""
  if cpu:
    first = [
        ("matmul", {"K": 96, "N": 160}),
        ("rms_norm", {"D": 96}),
        ("attention", {"T": 1, "H": 4, "KV": 2, "D": 80, "S": 64}),
        ("log_softmax", {"V": 1000}),
        ("token_logprobs", {"V": 1000}),
    ]
    more = [("attention", {"T": 3, "H": 4, "KV": 2, "D": 64, "S": 64})]
  else:
    first = [
        ("matmul", {"K": 896, "N": 4864}),                       # Qwen2.5-0.5B gate/up
        ("rms_norm", {"D": 896}),
        ("attention", {"T": 1, "H": 14, "KV": 2, "D": 64, "S": 512}),   # 0.5B decode
        ("log_softmax", {"V": 151936}),                          # Qwen vocabulary
        ("token_logprobs", {"V": 151936}),
    ]
    more = [
        ("attention", {"T": 1, "H": 28, "KV": 4, "D": 128, "S": 1024}),  # 7B decode
        ("attention", {"T": 1, "H": 8, "KV": 2, "D": 80, "S": 512}),     # head_dim 80 (pad to 128)
        ("attention", {"T": 3, "H": 14, "KV": 2, "D": 64, "S": 512}),    # SD verify of 3 tokens
        ("matmul", {"K": 3584, "N": 3584}),                               # 7B q/o proj
        ("matmul", {"K": 896, "N": 1000}),                                # N not a multiple of 128
        ("rms_norm", {"D": 3584}),
        ("rms_norm", {"D": 128}),                                         # q/k norm
        ("log_softmax", {"V": 1000}),                                     # V not a multiple of 512
        ("token_logprobs", {"V": 1000}),
    ]
  out = []
  for group in (first, more):
    for dtype in ("float32", "bfloat16"):
      out += [(k, dtype, s) for k, s in group]
  return out


def make_inputs(kernel: str, dtype, shape: dict, B: int, rng: np.random.Generator):
  """(batched args, shared args, static kwargs): the kernel is fn(*batched, *shared, **static)
  with every batched arg split along axis 0."""
  def normal(*s, scale=1.0):
    return jnp.asarray(rng.standard_normal(s, dtype=np.float32) * scale, dtype)

  if kernel == "matmul":
    K, N = shape["K"], shape["N"]
    return (normal(B, K),), (normal(K, N, scale=K ** -0.5),), {}
  if kernel == "rms_norm":
    D = shape["D"]
    return (normal(B, D),), (1.0 + normal(D, scale=0.1),), {"eps": 1e-6}
  if kernel == "attention":
    T, H, KV, D, S = (shape[k] for k in ("T", "H", "KV", "D", "S"))
    q, k, v = normal(B, T, H, D), normal(B, S, KV, D), normal(B, S, KV, D)
    # row b sees its first L_b slots (a ragged batch of caches), query t also slot L_b - T + t
    lengths = rng.integers(T, S + 1, size=B)
    pos = np.arange(S)[None, None, :]
    last = (lengths[:, None] - T + np.arange(T)[None, :])[:, :, None]
    mask = jnp.asarray(pos <= last)
    return (q, k, v, mask), (), {"scale": float(D) ** -0.5}
  if kernel in ("log_softmax", "token_logprobs"):
    V = shape["V"]
    logits = normal(B, V, scale=4.0)
    if kernel == "log_softmax":
      return (logits,), (), {}
    return (logits, jnp.asarray(rng.integers(0, V, size=B), jnp.int32)), (), {}
  raise ValueError(kernel)


def call_with(fn, shared, static):
  """fn(*batched) with the shared arrays passed as arguments (not baked in as constants) and the
  static args bound; the kernels' own jit is inside."""
  statics = tuple(static.values())
  jitted = jax.jit(lambda b, s: fn(*b, *s, *statics))
  return lambda *batched: jitted(batched, shared)


def run_case(kernels, kernel, dtype_name, shape, rows, rng, do_time: bool) -> dict:
  dtype = jnp.dtype(dtype_name)
  rec = {"kernel": kernel, "dtype": dtype_name, "shape": shape, "rows": rows}
  start = time.perf_counter()
  pallas_fn, ref_fn = kernels[kernel]
  batched, shared, static = make_inputs(kernel, dtype, shape, rows, rng)
  f = call_with(pallas_fn, shared, static)
  ref = call_with(ref_fn, shared, static)
  # (i) accuracy on the full batch
  t = time.perf_counter()
  out = jax.block_until_ready(f(*batched))
  rec["first_call_s"] = round(time.perf_counter() - t, 3)
  want = jax.block_until_ready(ref(*batched))
  o32 = np.asarray(jax.device_get(out)).astype(np.float32)
  w32 = np.asarray(jax.device_get(want)).astype(np.float32)
  rec["out_shape"] = list(o32.shape)
  rec["out_dtype"] = str(out.dtype)
  rec["nonfinite_out"] = int(np.sum(~np.isfinite(o32)))
  rec["nonfinite_ref"] = int(np.sum(~np.isfinite(w32)))
  finite = np.isfinite(o32) & np.isfinite(w32)
  err = np.abs(o32 - w32)[finite]
  scale = float(np.max(np.abs(w32[finite]))) if finite.any() else 0.0
  rec["max_abs_err"] = float(err.max()) if err.size else None
  rec["max_rel_err"] = float(err.max() / scale) if err.size and scale else None
  rec["ref_scale"] = scale
  # (ii) batch invariance: rows alone and in a batch of 3, against the same rows in the batch
  full = bits(out)
  windows = [(0, 1), (rows // 2 + 1, 1), (rows - 1, 1), (1, 3), (rows - 3, 3)]
  windows = [(s, n) for s, n in windows if 0 <= s and s + n <= rows]
  checked, bad, bad_rows = 0, 0, []
  for s, n in windows:
    part = bits(f(*(x[s:s + n] for x in batched)))
    for i in range(n):
      checked += 1
      if not np.array_equal(part[i], full[s + i]):
        bad += 1
        bad_rows.append(f"{s + i}@B{n}")
  rec["rows_checked"], rec["mismatched_rows"] = checked, bad
  if bad_rows:
    rec["mismatches"] = bad_rows[:10]
  # (iii) time per call
  if do_time:
    one = tuple(x[:1] for x in batched)
    rec["ms"] = {"1": round(time_ms(f, *one), 4), str(rows): round(time_ms(f, *batched), 4)}
    rec["ref_ms"] = {str(rows): round(time_ms(ref, *batched), 4)}
  rec["seconds"] = round(time.perf_counter() - start, 2)
  return rec


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cpu", "--quick", dest="cpu", action="store_true",
                      help="tiny shapes (CPU interpret mode); default: on when the backend is cpu")
  parser.add_argument("--gpu-shapes", action="store_true",
                      help="the device shapes even on a CPU backend (slow in interpret mode)")
  parser.add_argument("--rows", type=int, default=0, help="big batch (default 64; 8 with --cpu)")
  parser.add_argument("--budget", type=float, default=90.0, help="seconds; later cases skipped")
  parser.add_argument("--layout", default="", help="pass layout= to the kernels that take it "
                      "(e.g. gpu, to run the GPU blocking in interpret mode on a CPU)")
  parser.add_argument("--no-time", action="store_true", help="skip the timings")
  parser.add_argument("--only", default="", help="comma-separated kernel names")
  parser.add_argument("--out", default="", help="write the JSON here too")
  args = parser.parse_args()
  start = time.perf_counter()
  backend = jax.default_backend()
  cpu = args.cpu or (backend == "cpu" and not args.gpu_shapes)
  rows = args.rows or (8 if cpu else 64)
  report = {
      "backend": backend,
      "devices": [str(d) for d in jax.devices()],
      "device_kind": jax.devices()[0].device_kind,
      "jax": jax.__version__,
      "python": platform.python_version(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "jax_default_matmul_precision": str(jax.config.jax_default_matmul_precision),
      "configure_error": CONFIGURE_ERROR,
      "cpu_shapes": cpu, "rows": rows, "layout": args.layout or None, "budget_s": args.budget,
  }
  cases, errors, skipped = [], 0, []
  try:
    kernels = _kernels(args.layout or None)
  except Exception as e:  # noqa: BLE001
    report["import_error"] = first_line(e)
    report["traceback"] = traceback.format_exc()[-3000:]
    kernels = None
  only = set(filter(None, args.only.split(",")))
  rng = np.random.default_rng(0)
  for kernel, dtype, shape in (case_list(cpu) if kernels else []):
    if only and kernel not in only:
      continue
    if time.perf_counter() - start > args.budget:
      skipped.append(f"{kernel} {dtype} {shape}")
      continue
    try:
      rec = run_case(kernels, kernel, dtype, shape, rows, rng, not args.no_time)
    except Exception as e:  # noqa: BLE001 (one broken case must not hide the others)
      errors += 1
      rec = {"kernel": kernel, "dtype": dtype, "shape": shape, "error": first_line(e)}
    cases.append(rec)
    print(json.dumps(rec), file=sys.stderr, flush=True)  # progress (stdout gets the report)
  report["cases"] = cases
  report["skipped"] = skipped
  report["summary"] = {
      "cases": len(cases), "errors": errors, "skipped": len(skipped),
      "cases_with_mismatched_rows": sum(1 for c in cases if c.get("mismatched_rows")),
      "max_rel_err": {f"{c['kernel']}/{c['dtype']}/" + ",".join(f"{k}{v}" for k, v in
                                                              c["shape"].items()):
                      c.get("max_rel_err") for c in cases if "error" not in c},
  }
  report["seconds"] = round(time.perf_counter() - start, 2)
  text = json.dumps(report)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
