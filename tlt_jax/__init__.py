"""tlt-jax: RL training of reasoning LLMs in JAX, with Taming-the-Long-Tail rollouts,
batch-invariant numerics and LoRA.

The public API, for notebooks and scripts (each name is imported on first use, so
`import tlt_jax` stays cheap and sets nothing up):

    c = tlt_jax.load_config("experiments/configs/tiny_arith.py", "smoke")
    summary = tlt_jax.run_training(c)              # the RL job (python -m tlt_jax.train)
    report = tlt_jax.run_eval(c, checkpoint=...)  # held-out eval (python -m tlt_jax.evaluate)
    table = tlt_jax.make_plan(c)                   # memory plan (python -m tlt_jax.plan)
    job = tlt_jax.build_job(c)                     # every part of a run, to drive by hand
    policy = tlt_jax.load_policy(c)                # model, tokenizer, formatter, eos ids
    engine = tlt_jax.RolloutEngine(policy.model, tlt_jax.EngineConfig(...))
"""

from __future__ import annotations

import importlib

_API = {
    "load_config": ("tlt_jax.config", "load_config_file"),
    "default_config": ("tlt_jax.config", "default_config"),
    "run_training": ("tlt_jax.train", "run"),
    "run_eval": ("tlt_jax.evaluate", "run_eval"),
    "evaluate_rows": ("tlt_jax.evaluate", "evaluate"),
    "make_plan": ("tlt_jax.plan", "plan"),
    "build_job": ("tlt_jax.job", "build"),
    "load_policy": ("tlt_jax.job", "load_policy"),
    "RolloutEngine": ("tlt_jax.rollout.engine", "RolloutEngine"),
    "GroupedRollout": ("tlt_jax.rollout.groups", "GroupedRollout"),
    "EngineConfig": ("tlt_jax.rollout.config", "EngineConfig"),
    "SamplingParams": ("tlt_jax.rollout.sampling", "SamplingParams"),
}
__all__ = sorted(_API)


def __getattr__(name: str):
  if name not in _API:
    raise AttributeError(f"module 'tlt_jax' has no attribute {name!r}")
  module, attr = _API[name]
  return getattr(importlib.import_module(module), attr)


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_API))
