"""Held-out evaluation with K samples per problem: avg@K (mean accuracy over all samples, the
AIME-style protocol) and pass@K (a problem counts when any of its K samples is right), overall and
per group (`difficulty_key`: the number of digits, or the dataset name). The RL loop calls
`evaluate` for its before / periodic / after evals; the CLI evaluates a checkpoint:

    python -m tlt_jax.evaluate --config experiments/configs/tiny_arith.py --samples 8
    python -m tlt_jax.evaluate --config experiments/configs/tiny_arith.py \\
        --checkpoint runs/tiny_arith-20261202-1200 --samples 8 --out report.json
    python -m tlt_jax.evaluate --config X.py --config.data.eval_path=gsm8k.jsonl,math500.jsonl \\
        --checkpoint runs/x/export/adapter

`--checkpoint` is a run's workdir (its newest Orbax checkpoint, or `--step`), a PEFT adapter
directory (export/adapter, on the config's base model), or a whole HF checkpoint
(export/merged); without it the config's base model is evaluated. The problems are the ones the
RL job holds out (`eval.num_problems` per dataset, none of them in the training rows), sampled
under the eval seed, so a run's final eval is reproduced exactly from its workdir.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import numpy as np
from flax import nnx

from tlt_jax import checkpoint as ckpt_lib
from tlt_jax import cli, compile_cache, determinism, logs, metrics, ops
from tlt_jax import config as config_lib
from tlt_jax import job as job_lib
from tlt_jax.data import splits
from tlt_jax.data.stop_strings import engine_detokenize
from tlt_jax.model import hf, lora
from tlt_jax.rl.scoring import RewardSpec, score


def evaluate(engine, formatter, tokenizer, rows: list[dict], *, samples: int = 1, seed: int = 0,
             difficulty_key: str | None = None, on_finish=None, progress: bool = False,
             desc: str = "eval", records: bool = False) -> dict:
  """Generates `samples` answers per row with `engine` and scores them. `records=True` adds
  every sample (problem index, sample index, text, correct) to the report."""
  bar = metrics.progress(total=len(rows) * samples, desc=desc, unit="sample", leave=False,
                         disable=None if progress else True)

  def finished(sample):
    bar.update(1)
    if on_finish is not None:
      on_finish(sample)

  prompts = [formatter.encode(r["prompt"]) for r in rows]
  outputs = engine.generate(prompts, group_size=samples, seed=seed, on_finish=finished)
  bar.close()
  correct_PxK = np.zeros((len(rows), samples), np.float32)
  lengths_PxK = np.zeros((len(rows), samples), np.int32)
  texts = {}
  for s in outputs:
    i, k = divmod(s.sample_id, samples)
    text = tokenizer.decode(s.tokens.tolist(), skip_special_tokens=True)
    correct_PxK[i, k] = score(text, rows[i], RewardSpec())["correct"]  # math or code row
    lengths_PxK[i, k] = len(s.tokens)
    texts[i, k] = text
  report = {"problems": len(rows), "samples": samples, **_scores(correct_PxK),
            "response_len_mean": float(lengths_PxK.mean())}
  if difficulty_key:
    groups = collections.defaultdict(list)
    for i, r in enumerate(rows):
      groups[str(r.get(difficulty_key, "?"))].append(i)
    report["by_" + difficulty_key] = {
        g: {"problems": len(ix), **_scores(correct_PxK[ix])}
        for g, ix in sorted(groups.items(), key=lambda kv: _sort_key(kv[0]))}
  if records:
    report["records"] = [
        {"problem": i, "sample": k, "prompt": rows[i]["prompt"], "answer": rows[i]["answer"],
         "text": texts[i, k], "correct": bool(correct_PxK[i, k])}
        for i in range(len(rows)) for k in range(samples)]
  return report


def _scores(correct_PxK: np.ndarray) -> dict:
  K = correct_PxK.shape[1]
  return {f"avg@{K}": float(correct_PxK.mean()), f"pass@{K}": float(correct_PxK.max(1).mean()),
          "accuracy": float(correct_PxK.mean())}


def _sort_key(group: str):
  return (0, int(group)) if group.isdigit() else (1, group)


# -- checkpoints


def load_checkpoint(c, checkpoint: str = "", step: int | None = None):
  """(policy model, tokenizer, formatter, eos ids, what was loaded) for `checkpoint` (see the
  module docstring for the kinds it takes)."""
  model, tokenizer, formatter, eos_ids = job_lib.load_policy(c)
  if not checkpoint:
    return model, tokenizer, formatter, eos_ids, f"base model {c.model.hf_dir}"
  if not os.path.isdir(checkpoint):
    raise FileNotFoundError(f"--checkpoint {checkpoint}: no such directory")
  if os.path.isfile(os.path.join(checkpoint, "adapter_config.json")):
    lora.import_peft(model, checkpoint, seed=c.seed)
    return model, tokenizer, formatter, eos_ids, f"PEFT adapter {checkpoint} on {c.model.hf_dir}"
  if os.path.isfile(os.path.join(checkpoint, "config.json")) and any(
      f.endswith(".safetensors") for f in os.listdir(checkpoint)):
    return (hf.load_model(checkpoint, dtype=c.model.dtype), tokenizer, formatter, eos_ids,
            f"HF checkpoint {checkpoint}")
  ckpt_dir = checkpoint
  if os.path.isdir(os.path.join(checkpoint, "checkpoints")):
    _check_run_config(c, checkpoint)
    ckpt_dir = os.path.join(checkpoint, "checkpoints")
  return (_restore_run_params(c, model, ckpt_dir, step), tokenizer, formatter, eos_ids,
          f"RL checkpoint {ckpt_dir} step {step if step is not None else 'latest'}")


def _check_run_config(c, workdir: str) -> None:
  """A run's params only fit the model + LoRA shape they were trained with: say which key
  differs instead of failing inside the restore."""
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return
  with open(path) as f:
    run = json.load(f)
  wrong = []
  for section, key in (("lora", "rank"), ("lora", "alpha"), ("lora", "targets"),
                       ("model", "hf_dir")):
    have, want = run.get(section, {}).get(key), c[section][key]
    if isinstance(want, tuple):
      want, have = list(want), list(have or [])
    if have is not None and have != want:
      wrong.append(f"{section}.{key}: run {have!r}, config {want!r}")
  if wrong:
    raise ValueError(f"{workdir} was trained with a different model/LoRA than the config "
                     f"({'; '.join(wrong)}): pass --config.<key>=<the run's value>")


def _restore_run_params(c, model, ckpt_dir: str, step: int | None):
  job_lib.apply_lora(c, model)
  wrt = nnx.LoRAParam if c.lora.rank > 0 else nnx.Param
  graphdef, trainable, frozen = nnx.split(model, wrt, ...)
  with ckpt_lib.Checkpointer(ckpt_dir, async_save=False) as ckpt:
    state, _ = ckpt.restore({"params": trainable}, step)
  return nnx.merge(graphdef, state["params"], frozen)


# -- the CLI


def run_eval(c, *, checkpoint: str = "", step: int | None = None, samples: int | None = None,
             out: str = "", records: bool = False) -> dict:
  """Evaluates `checkpoint` on the config's held-out problems; writes the JSON report to `out`
  (when given) and returns it."""
  config_lib.validate(c)
  # before JAX creates its backends
  determinism.configure(c.numerics, c.xla_determinism, c.numerics_f32_matmul)
  samples = samples or c.eval.samples
  with ops.numerics_mode(c.numerics, c.numerics_backend):
    t0 = time.perf_counter()
    model, tokenizer, formatter, eos_ids, loaded = load_checkpoint(c, checkpoint, step)
    _, rows, data_report = splits.load_rows(c)
    engine = job_lib.build_rollout(c, model, eos_ids,
                                   detokenize=engine_detokenize(c, tokenizer, formatter, eos_ids))
    report = evaluate(engine, formatter, tokenizer, rows, samples=samples,
                      seed=job_lib.derived_seed(c.seed, job_lib.PURPOSE_EVAL, 0),
                      difficulty_key=splits.eval_group_key(c), progress=c.metrics.progress,
                      desc=f"eval {samples} x {len(rows)}", records=records)
  report = {"checkpoint": loaded, "numerics": c.numerics, "seconds": time.perf_counter() - t0,
            "skipped_rows": data_report["skipped_rows"], **report}
  if out:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
      json.dump(report, f, indent=2)
  return report


def main(argv) -> None:
  del argv
  from absl import flags  # noqa: PLC0415 (absl's flags exist once the CLI has defined them)

  f = flags.FLAGS
  logs.configure(f.config.log_level)
  cache_dir = compile_cache.configure(f.config.compile.cache_dir)
  print(f"[evaluate] compile cache: {cache_dir or 'off'}", file=sys.stderr)
  out = f.out
  if not out and f.checkpoint and os.path.isdir(os.path.join(f.checkpoint, "checkpoints")):
    out = os.path.join(f.checkpoint, f"eval_report_{f.samples or f.config.eval.samples}.json")
  report = run_eval(f.config, checkpoint=f.checkpoint, step=f.step, samples=f.samples, out=out,
                    records=f.records)
  shown = {k: v for k, v in report.items() if k != "records"}
  print(json.dumps(shown, indent=2))
  if out:
    print(f"[evaluate] report written to {out}", file=sys.stderr)


if __name__ == "__main__":
  from absl import app, flags

  cli.define_config(job_lib.DEFAULT_CONFIG)
  flags.DEFINE_string("checkpoint", "", "run workdir, PEFT adapter dir or HF checkpoint dir")
  flags.DEFINE_integer("step", None, "checkpoint step of a run workdir (default: the newest)")
  flags.DEFINE_integer("samples", None, "samples per problem K (default: eval.samples)")
  flags.DEFINE_string("out", "", "JSON report path (default: <workdir>/eval_report_K.json)")
  flags.DEFINE_bool("records", False, "include every sample's text and score in the report")
  app.run(cli.guarded(main), flags_parser=cli.parse_flags)
