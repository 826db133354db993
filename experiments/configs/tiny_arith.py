"""Default RL run: GRPO with LoRA (rank 8, all linear layers) on the tiny pretrained arithmetic
model, batch-invariant numerics (sampler == trainer log-probs), about 10 minutes on 2 CPU cores.

  python -m tlt_jax.train                                                  # this config
  python -m tlt_jax.train --config experiments/configs/tiny_arith.py:smoke  # CI, < 2 minutes
  python -m tlt_jax.train --config experiments/configs/tiny_arith.py:ablation  # sweeps, ~4 min
  python -m tlt_jax.train --config experiments/configs/tiny_arith.py --config.rl.lr=1e-3

The model (experiments/assets/tiny_arith, made by `python -m experiments.pretrain_tiny`) learned
column addition from flawed worked solutions: it drops a carry about 40% of the time when it
samples. The held-out accuracy it gains here is RL teaching it not to.
"""

import os

from tlt_jax.config import default_config

ASSET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "assets", "tiny_arith")


def get_config(arg: str | None = None):
  c = default_config()
  c.seed = 0
  c.numerics = "batch_invariant"
  c.model.hf_dir = os.path.normpath(ASSET)
  c.lora.rank, c.lora.alpha = 8, 32.0
  c.data.synthetic_ops = "+"
  c.data.synthetic_mix = "1:0.35,2:0.3,3:0.15,4:0.1,8:0.06,16:0.04"
  c.data.synthetic_train = 4096
  c.rollout.prompts_per_step, c.rollout.group_size = 16, 8
  c.rollout.max_prompt_len, c.rollout.max_new_tokens = 40, 192
  c.rollout.temperature = 1.0
  c.rollout.buckets = (1, 2, 4, 8, 16, 32, 64, 128)
  c.rl.algorithm = "grpo"
  c.rl.steps = 30
  c.rl.lr = 2e-3
  c.rl.minibatches = 1
  c.eval.num_problems = 256
  c.checkpoint.every = 10
  c.checkpoint.export_merged = True
  if arg == "smoke":
    # Short answers only (1-2 digits), small batches: the whole job, compile included, in CI.
    c.data.synthetic_mix = "1:0.5,2:0.5"
    c.rollout.prompts_per_step, c.rollout.group_size = 8, 4
    c.rollout.max_new_tokens = 40
    c.rollout.buckets = (4, 16, 32)
    c.rl.steps = 6
    c.rl.lr = 2e-3
    c.eval.num_problems = 64
    c.checkpoint.every = 3
    c.metrics.progress = False
  elif arg == "ablation":
    # The ablation sweeps (experiments/results/ablations/): the default job at half the steps
    # and half the eval problems, so a 4-point sweep takes about a quarter of an hour.
    c.rl.steps = 16
    c.eval.num_problems = 128
    c.eval.every = 8
    c.checkpoint.every = 0
    c.checkpoint.export_adapter = c.checkpoint.export_merged = False
    c.metrics.progress = False
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of tiny_arith (known: smoke, ablation)")
  return c
