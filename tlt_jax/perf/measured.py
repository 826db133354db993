"""Measured program times (`experiments/bench_step_costs.py`'s JSON), for the cost model to use
where they exist: "measurement wins".

A measurement applies to a prediction only when everything that sets the program's time is the
same: the hardware profile, the model's shape and dtype (`config_dict`), and the program's own
shape (`shape`: context slots, bucket or rows, arm, tokens, LoRA rank, devices). Anything else
(another context, a reduced model, another chip) falls back to the roofline model: a measurement
is never scaled to a shape it was not taken at.

    costs = measured.load_dir()                  # every step_costs_*.json under results/
    pred = measured.predictor(hw, cfg, costs)    # a cost_model.Predictor with the matching ones
    seconds, source = pred.time(measured.key("decode", cfg, bucket=4, context=1024), cost)
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

from tlt_jax.model.transformer import ModelConfig
from tlt_jax.perf import cost_model as cm
from tlt_jax.perf.hardware import Hardware

SCHEMA = "tlt_jax.step_costs/1"
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_DIR = os.path.join(_REPO, "experiments", "results")
# What a program's time depends on in a model config (names, ids and rope details do not).
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "tie_embeddings", "qkv_bias", "qk_norm", "dtype")
REQUIRED = ("schema", "model", "model_config", "backend", "hardware_profile", "context",
            "programs")
PROGRAM_REQUIRED = ("key", "program", "shape", "seconds", "model_seconds", "gflop", "gbytes")


def config_dict(cfg: ModelConfig) -> dict:
  return {k: getattr(cfg, k) for k in SHAPE_FIELDS}


def shape(**kw) -> dict:
  """A program's shape as measurements and predictions both key it: ints for counts (a float
  context is rounded), names as given (the model's shape is not part of it: see `key`)."""
  return {k: (int(round(v)) if isinstance(v, float) else v) for k, v in sorted(kw.items())
          if v is not None}


def key(program: str, cfg: ModelConfig, tp: int = 1, **shape_kw) -> str:
  """The lookup key of a program: its name, the model's shape and its own shape."""
  model = ",".join(f"{k}={v}" for k, v in config_dict(cfg).items())
  dims = ",".join(f"{k}={v}" for k, v in shape(tp=tp, **shape_kw).items())
  return f"{program}|{model}|{dims}"


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """One bench_step_costs report."""
  path: str
  report: dict

  @property
  def hardware(self) -> str:
    return self.report["hardware_profile"]

  @property
  def model_config(self) -> dict:
    return self.report["model_config"]

  def times(self) -> dict[str, float]:
    """{key: seconds} of every measured program (seconds per plain step / SD round / call /
    train step, as the cost model's costs of the same name count them)."""
    cfg = self.model_config
    out = {}
    for row in self.report["programs"]:
      model = ",".join(f"{k}={cfg[k]}" for k in SHAPE_FIELDS)
      dims = ",".join(f"{k}={v}" for k, v in shape(tp=1, **row["shape"]).items())
      out[f"{row['program']}|{model}|{dims}"] = float(row["seconds"])
    return out


def validate(report: dict, where: str = "step costs") -> dict:
  missing = [k for k in REQUIRED if k not in report]
  if report.get("schema") != SCHEMA:
    missing.append(f"schema == {SCHEMA!r}")
  for i, row in enumerate(report.get("programs", [])):
    missing += [f"programs[{i}].{k}" for k in PROGRAM_REQUIRED if k not in row]
  if missing:
    raise ValueError(f"{where}: not a bench_step_costs report (missing {missing})")
  return report


def load(path: str) -> StepCosts:
  with open(path) as f:
    return StepCosts(path, validate(json.load(f), path))


def load_dir(directory: str = RESULTS_DIR) -> list[StepCosts]:
  """Every step_costs_*.json in `directory` (the bench's own outputs)."""
  return [load(p) for p in sorted(glob.glob(os.path.join(directory, "step_costs_*.json")))]


def predictor(hw: Hardware, cfg: ModelConfig, costs: list[StepCosts]) -> cm.Predictor:
  """A `cost_model.Predictor` on `hw` holding the measurements taken on `hw`'s profile at
  `cfg`'s shape (later files win on the same key)."""
  want = config_dict(cfg)
  matching = [c for c in costs if c.hardware == hw.name and c.model_config == want]
  times: dict[str, float] = {}
  for c in matching:
    times.update(c.times())
  return cm.Predictor(hw, times, ", ".join(os.path.relpath(c.path, _REPO) for c in matching))
