#!/usr/bin/env bash
# One GPU check of the whole repo in under 6 minutes (one H200, 16 cores), for a lent device:
#
#   bash experiments/gpu_check.sh OUTDIR [--dry-run]
#
# Parts, in this order, each under its own `timeout` and all under one deadline, continuing past
# failures: env (versions, devices), tests (pytest -n 8), train (tiny_arith:smoke), bench (each
# experiments/bench_*.py at a small size), probe (experiments/gpu_kernel_probe.py).
# OUTDIR gets at most 6 flat files: summary.json (each part's status, exit code and seconds, plus
# the headline figures), logs.txt (every part's output), junit.xml, train_summary.json,
# benches.json, kernel_probe.json. Rewritten after every part, so a run cut short still leaves
# what it had. The last thing printed is a compact summary.
#
# Knobs (environment):
#   GPU_CHECK_PARTS     env,tests,train,bench,probe  (a rerun can name a subset)
#   GPU_CHECK_BENCHES   determinism,forward,decode_steps,rollout,drafter_unroll,tlt
#   GPU_CHECK_DEADLINE  345   seconds for the whole script; later parts keep their reserve
#   GPU_CHECK_TESTS     tests  (pytest targets, e.g. "tests/test_kernels.py tests/test_contracts.py")
#   GPU_CHECK_WORKERS   14     (pytest-xdist workers; compiling is CPU-bound, the GPU is shared)
#   GPU_CHECK_TEST_TIMEOUT 120 (pytest-timeout, per test, when the plugin is there)
#   GPU_CHECK_TRAIN     the train arguments (default: tiny_arith:smoke in /tmp/run_gpu)
#   GPU_CHECK_PROBE     extra probe arguments (e.g. "--only attention,matmul")
#   GPU_CHECK_DRY_RUN=1 (or --dry-run): print each command and the limit it would get, run none
#   PYTHON              python3
# The whole script shares one compilation cache (TLT_JAX_CACHE_DIR, else JAX_COMPILATION_CACHE_DIR,
# default /tmp/jaxcache): the test suite's smoke run and the train part compile the same programs.
# Never `set -e`: every part runs, and its exit code is recorded.
set -u

OUTDIR=${1:-}
if [ -z "$OUTDIR" ] || [ "$OUTDIR" = "-h" ] || [ "$OUTDIR" = "--help" ]; then
  sed -n '2,26p' "$0"; exit 2
fi
DRY=${GPU_CHECK_DRY_RUN:-0}
[ "${2:-}" = "--dry-run" ] && DRY=1

BASE=$(dirname "$0")/..
BASE=$(cd "$BASE" && pwd)
cd "$BASE" || exit 2
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd) || exit 2
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
PY=${PYTHON:-python3}
PARTS=",${GPU_CHECK_PARTS:-env,tests,train,bench,probe},"
BENCHES=${GPU_CHECK_BENCHES:-determinism,forward,decode_steps,rollout,drafter_unroll,tlt}
DEADLINE=${GPU_CHECK_DEADLINE:-345}
TRAIN_DIR=/tmp/run_gpu
TRAIN_ARGS=${GPU_CHECK_TRAIN:-"--config experiments/configs/tiny_arith.py:smoke --config.workdir=$TRAIN_DIR"}
# The tests' conftest would otherwise make a cache of their own for the run.
export TLT_JAX_CACHE_DIR=${TLT_JAX_CACHE_DIR:-${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}}
export JAX_COMPILATION_CACHE_DIR=$TLT_JAX_CACHE_DIR
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$TLT_JAX_CACHE_DIR"
START=$SECONDS
: > "$WORK/parts.tsv"

# ------------------------------------------------------------------ summary writer (Python, stdlib)
cat > "$WORK/summarize.py" <<'PYEOF'
import glob, json, os, sys, time
import xml.etree.ElementTree as ET

work, outdir, final = sys.argv[1], sys.argv[2], len(sys.argv) > 3 and sys.argv[3] == "final"


def load(path):
  try:
    with open(path) as f:
      return json.load(f)
  except Exception:
    return None


def last_json_line(path):
  try:
    with open(path, errors="replace") as f:
      lines = f.read().splitlines()
  except OSError:
    return None
  for line in reversed(lines):
    line = line.strip()
    if line.startswith("{"):
      try:
        return json.loads(line)
      except ValueError:
        pass
  return None


def short(x, n=400):
  s = x if isinstance(x, str) else json.dumps(x)
  return s if len(s) <= n else s[:n] + "..."


parts = []
with open(os.path.join(work, "parts.tsv")) as f:
  for line in f:
    name, status, rc, secs, limit = line.rstrip("\n").split("\t")
    parts.append({"part": name, "status": status, "rc": None if rc == "" else int(rc),
                  "seconds": int(secs), "limit_s": int(limit)})
summary = {"elapsed_s": int(os.environ.get("ELAPSED", "0")), "final": final, "parts": parts}
env = load(os.path.join(work, "env.json"))
if env:
  summary["env"] = env

# tests: junit counts and the failing test ids
junit = os.path.join(outdir, "junit.xml")
if os.path.exists(junit):
  try:
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")}
    counts["time_s"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    failed = []
    for case in root.iter("testcase"):
      for tag in ("failure", "error"):
        el = case.find(tag)
        if el is not None:
          msg = (el.get("message") or "").strip().splitlines()
          failed.append(f"{tag.upper()} {case.get('classname')}::{case.get('name')} - "
                        f"{msg[0][:200] if msg else ''}")
    counts["failed"] = failed
    summary["tests"] = counts
  except Exception as e:
    summary["tests"] = {"junit_error": f"{type(e).__name__}: {e}"}

train = load(os.path.join(outdir, "train_summary.json"))
if train is not None:
  summary["train"] = train if len(json.dumps(train)) < 4000 else short(train, 4000)

# benches: each bench's result file(s) (experiments/results/*.json written during its part),
# else the last JSON line it printed
benches = {}
for marker in sorted(glob.glob(os.path.join(work, "bench_*.marker"))):
  name = os.path.basename(marker)[len("bench_"):-len(".marker")]
  rec = {"files": {}}
  since = os.path.getmtime(marker)
  done = marker[:-len(".marker")] + ".done"
  until = os.path.getmtime(done) if os.path.exists(done) else time.time() + 1
  for path in sorted(glob.glob("experiments/results/*.json")):
    if since <= os.path.getmtime(path) <= until:
      rec["files"][os.path.basename(path)] = load(path)
  if not rec["files"]:
    rec["stdout_json"] = last_json_line(os.path.join(work, f"bench_{name}.log"))
  benches[name] = rec
if benches:
  with open(os.path.join(outdir, "benches.json"), "w") as f:
    json.dump(benches, f, indent=1)
  head = {}
  for name, rec in benches.items():
    res = next(iter(rec["files"].values()), None) or rec.get("stdout_json")
    if isinstance(res, dict):
      head[name] = {k: v for k, v in res.items() if isinstance(v, (int, float, bool))}
  summary["benches"] = head

probe = load(os.path.join(outdir, "kernel_probe.json"))
if probe:
  summary["probe"] = probe.get("summary") or {k: probe.get(k) for k in ("import_error",)}

# one logs.txt: every part's log, in order, each cut to its head and tail if large
with open(os.path.join(outdir, "logs.txt"), "w") as out:
  for p in parts:
    path = os.path.join(work, p["part"] + ".log")
    out.write(f"\n===== {p['part']}: {p['status']} rc={p['rc']} {p['seconds']}s "
              f"(limit {p['limit_s']}s) =====\n")
    if not os.path.exists(path):
      continue
    with open(path, errors="replace") as f:
      text = f.read()
    if len(text) > 3_000_000:
      text = text[:300_000] + "\n[... cut ...]\n" + text[-2_500_000:]
    out.write(text)
with open(os.path.join(outdir, "summary.json"), "w") as f:
  json.dump(summary, f, indent=1)

if final:  # the compact summary, most important last (the tail of the output is what is read)
  files = sorted(os.listdir(outdir))
  print(f"===== gpu_check summary: {summary['elapsed_s']} s, {len(files)} files in OUTDIR: {files}")
  if env:
    print("env:", short({k: env.get(k) for k in ("gpu", "python", "versions", "devices",
                                                   "import_errors")}, 1200))
  if probe:
    ps = probe.get("summary", {})
    print(f"probe: {ps.get('cases')} cases, errors {ps.get('errors')}, cases with mismatched "
          f"rows {ps.get('cases_with_mismatched_rows')}, skipped {ps.get('skipped')} "
          f"{probe.get('import_error') or ''}")
    for c in probe.get("cases", []):
      shape = ",".join(f"{k}{v}" for k, v in c.get("shape", {}).items())
      dt = {"float32": "f32", "bfloat16": "bf16"}.get(c["dtype"], c["dtype"])
      head = f"  {c['kernel'][:9]:<9} {dt:<4} {shape:<20}"
      if "error" in c:
        print(f"{head} ERROR {c['error'][:150]}")
        continue
      rel = c.get("max_rel_err")
      rel = "n/a" if rel is None else f"{rel:.1e}"
      ms = " ".join(f"B{k}:{v:.3g}" for k, v in (c.get("ms") or {}).items())
      ref = " ".join(f"{v:.3g}" for v in (c.get("ref_ms") or {}).values())
      bad = f" NONFINITE {c.get('nonfinite_out')}" if c.get("nonfinite_out") else ""
      print(f"{head} rel {rel} mism {c.get('mismatched_rows')}/{c.get('rows_checked')} "
            f"ms {ms} ref {ref}{bad}")
  for name, head in summary.get("benches", {}).items():
    print(f"bench {name}:", short(head, 450))
  if "train" in summary:
    print("train summary:", short(summary["train"], 600))
  for p in parts:
    line = f"{p['part']:<21} {p['status']:<7} rc={p['rc']} {p['seconds']:>4}s/{p['limit_s']}s"
    if p["part"] == "tests" and "tests" in summary:
      t = summary["tests"]
      line += (f"  tests={t.get('tests')} failures={t.get('failures')} errors={t.get('errors')} "
               f"skipped={t.get('skipped')} {t.get('junit_error', '')}")
    print(line)
  failed = summary.get("tests", {}).get("failed", [])
  for fail in failed[:25]:
    print("  " + fail[:200])
  if len(failed) > 25:
    print(f"  ... {len(failed) - 25} more in summary.json")
PYEOF

summarize() {  # $1 = final or ""
  ELAPSED=$((SECONDS - START)) "$PY" "$WORK/summarize.py" "$WORK" "$OUTDIR" ${1:-} \
    || echo "gpu_check: summary writer failed (rc=$?)"
}

# run_part NAME BUDGET RESERVE CMD...: runs CMD under `timeout`, for at most BUDGET seconds and
# never into the RESERVE seconds that later parts keep before the deadline; output to its log.
run_part() {
  local name=$1 budget=$2 reserve=$3; shift 3
  local left=$((DEADLINE - (SECONDS - START) - reserve))
  local limit=$budget
  [ "$left" -lt "$limit" ] && limit=$left
  local log="$WORK/$name.log"
  if [ "$limit" -lt 15 ]; then
    printf '%s\tskipped\t\t0\t%s\n' "$name" "$limit" >> "$WORK/parts.tsv"
    echo "[gpu_check $((SECONDS - START))s] $name: skipped (only ${limit}s left before the deadline)"
    summarize; return 0
  fi
  echo "[gpu_check $((SECONDS - START))s] $name: limit ${limit}s: $*"
  local t0=$SECONDS rc
  if [ "$DRY" = 1 ]; then
    echo "dry run: $*" > "$log"; rc=0
  else
    { echo "\$ $*"; echo "# limit ${limit}s, started at $(date -u +%H:%M:%S)"; } > "$log"
    # SIGINT first (pytest then still writes its junit XML and summary), SIGKILL 15 s later;
    # timeout signals the command's whole process group (xdist workers, bench subprocesses).
    timeout -s INT -k 15 "$limit" "$@" >> "$log" 2>&1 < /dev/null
    rc=$?
  fi
  local secs=$((SECONDS - t0)) status=ok
  [ "$rc" -ne 0 ] && status=failed
  { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && status=timeout  # timeout's own exit codes
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$secs" "$limit" >> "$WORK/parts.tsv"
  echo "[gpu_check $((SECONDS - START))s] $name: $status rc=$rc ${secs}s"
  summarize
}

has_part() { [[ "$PARTS" == *",$1,"* ]]; }
# Seconds kept back for the parts after: the probe and the train job get at least this much.
R_PROBE=0; has_part probe && R_PROBE=50
R_TRAIN=0; has_part train && R_TRAIN=60

echo "[gpu_check] repo $BASE, out $OUTDIR, work $WORK, deadline ${DEADLINE}s, parts ${PARTS//,/ }"

# ----------------------------------------------------------------------------------- a. environment
if has_part env; then
  cat > "$WORK/env.py" <<'PYEOF'
import importlib, importlib.metadata as md, importlib.util, json, os, platform, subprocess, sys
out = {"python": platform.python_version(), "executable": sys.executable,
       "machine": f"{platform.machine()} {os.cpu_count()} cpus",
       "pythonpath": os.environ.get("PYTHONPATH", ""), "xla_flags": os.environ.get("XLA_FLAGS", "")}
try:
  out["gpu"] = subprocess.run(
      ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,"
       "clocks.max.sm", "--format=csv,noheader"], capture_output=True, text=True,
      timeout=20).stdout.strip()
except Exception as e:
  out["gpu"] = f"no nvidia-smi ({type(e).__name__})"
vers = {}
for p in ["jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "flax",
          "optax", "chex", "orbax-checkpoint", "tensorstore", "etils", "grain", "array-record",
          "ml-collections", "tensorboardX", "portpicker", "numpy", "ml-dtypes", "protobuf",
          "triton", "torch", "transformers", "peft", "safetensors", "tokenizers", "pytest",
          "pytest-xdist", "pytest-timeout"]:
  try:
    vers[p] = md.version(p)
  except Exception:
    vers[p] = None
out["versions"] = vers
where, errors = {}, {}
for m in ["jax", "numpy", "google.protobuf", "orbax.checkpoint", "grain", "ml_collections",
          "tensorboardX", "array_record", "etils.epath", "flax.nnx", "tlt_jax.train",
          "pallas_kernels.matmul", "experiments.bench_determinism"]:
  try:
    mod = importlib.import_module(m)
    where[m] = os.path.dirname(getattr(mod, "__file__", None) or "?")
  except BaseException as e:
    errors[m] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
out["module_dirs"], out["import_errors"] = where, errors
import jax, jax.numpy as jnp
out["backend"] = jax.default_backend()
out["devices"] = [f"{d} ({d.device_kind})" for d in jax.devices()]
x = jnp.ones((1024, 1024), jnp.float32)
out["matmul_check"] = float(jax.block_until_ready(x @ x)[0, 0])  # 1024.0 at any precision
out["default_matmul_precision"] = str(jax.config.jax_default_matmul_precision)
print(json.dumps(out, indent=1))
with open(sys.argv[1], "w") as f:
  json.dump(out, f)
PYEOF
  run_part env 60 0 bash -c "nvidia-smi; nvidia-smi -L; $PY $WORK/env.py $WORK/env.json"
fi

# ------------------------------------------------------------------------------------- b. tests
if has_part tests; then
  rm -f "$OUTDIR/junit.xml"
  TEST_OPTS=()
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    TEST_OPTS+=(--timeout="${GPU_CHECK_TEST_TIMEOUT:-120}")
  fi
  if "$PY" -c "import xdist" 2>/dev/null; then
    TEST_OPTS+=(-n "${GPU_CHECK_WORKERS:-14}" --dist loadgroup)
  fi
  # Many processes share the GPU: no process may preallocate 75% of its memory.
  # shellcheck disable=SC2086
  # 2026-12-04, -n 8: 253 tests passed in 200 s with 32 still to run (tests/test_trainer.py,
  # test_train, test_transformer, part of test_rollout and test_scheduler): hence 14 workers.
  run_part tests 240 $((R_TRAIN + R_PROBE)) env XLA_PYTHON_CLIENT_PREALLOCATE=false \
    "$PY" -m pytest ${GPU_CHECK_TESTS:-tests} -q -p no:cacheprovider \
    --ignore=tests/test_notebooks.py -rfE --durations=15 --junitxml="$OUTDIR/junit.xml" \
    "${TEST_OPTS[@]}"
fi

# ------------------------------------------------------------------------------------- c. train
if has_part train; then
  rm -rf "$TRAIN_DIR" "$OUTDIR/train_summary.json"
  # shellcheck disable=SC2086
  run_part train 90 "$R_PROBE" "$PY" -m tlt_jax.train $TRAIN_ARGS
  if [ -f "$TRAIN_DIR/summary.json" ]; then
    cp "$TRAIN_DIR/summary.json" "$OUTDIR/train_summary.json"
    { echo "--- $TRAIN_DIR/metrics.jsonl (last 20 lines)"; tail -n 20 "$TRAIN_DIR/metrics.jsonl"; } \
      >> "$WORK/train.log" 2>&1
    summarize
  fi
fi

# ---------------------------------------------------------------------------------- d. benches
bench_cmd() {
  case $1 in
    determinism)    echo "-m experiments.bench_determinism --quick" ;;
    forward)        echo "-m experiments.bench_forward" ;;
    decode_steps)   echo "-m experiments.bench_decode_steps --repeats 3" ;;
    rollout)        echo "-m experiments.bench_rollout --quick" ;;
    drafter_unroll) echo "-m experiments.bench_drafter_unroll --steps 100 --rollouts 2 --unrolls 1,2" ;;
    tlt)            echo "-m experiments.bench_tlt --quick" ;;
    *)              echo "" ;;
  esac
}
bench_budget() {
  case $1 in determinism) echo 100 ;; rollout|forward|decode_steps) echo 60 ;; *) echo 75 ;; esac
}
if has_part bench; then
  rm -f "$OUTDIR/benches.json"
  for b in ${BENCHES//,/ }; do
    cmd=$(bench_cmd "$b")
    if [ -z "$cmd" ]; then echo "[gpu_check] unknown bench $b"; continue; fi
    touch "$WORK/bench_$b.marker"
    # shellcheck disable=SC2086
    run_part "bench_$b" "$(bench_budget "$b")" "$R_PROBE" "$PY" $cmd
    touch "$WORK/bench_$b.done"
  done
fi

# ------------------------------------------------------------------------------ e. kernel probe
if has_part probe; then
  rm -f "$OUTDIR/kernel_probe.json"
  left=$((DEADLINE - (SECONDS - START)))
  limit=75; [ "$left" -lt "$limit" ] && limit=$left
  probe_budget=$((limit - 25)); [ "$probe_budget" -lt 10 ] && probe_budget=10
  # shellcheck disable=SC2086
  run_part probe 75 0 "$PY" -m experiments.gpu_kernel_probe --budget "$probe_budget" \
    --out "$OUTDIR/kernel_probe.json" ${GPU_CHECK_PROBE:-}
fi

summarize final
rm -rf "$WORK"
exit 0
