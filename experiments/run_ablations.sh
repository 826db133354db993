#!/usr/bin/env bash
# The ablations of BENCHMARKS.md ("Ablations"), one sweep each, on tiny_arith:ablation (16 RL
# steps, 128 held-out problems; the speed ablations run 8 steps). About an hour on 2 CPU cores. Each sweep writes results.csv,
# results.md, comparison.png and points/*/ (summary.json, metrics.jsonl, plots) under
# experiments/results/ablations/<name>/; rerunning reuses finished points (--rerun to redo).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=experiments/configs/tiny_arith.py:ablation
OUT=experiments/results/ablations

# LoRA rank at a fixed LR (LoRA without regret: the best LR barely depends on rank) vs full
# fine-tuning at a tenth of it.
python -m experiments.sweep --config $CONFIG --out $OUT/lora_rank \
  --title "LoRA rank 1 / 8 / 64 vs full fine-tuning (GRPO, 16 steps)" \
  --grid lora.rank=1,8,64 --point lora.rank=0,rl.lr=2e-4 || true

# Speculative decoding: off / a warmed-up drafter never updated / the drafter trained on idle
# devices (TLT), and TLT with the tuner off (always chain4). Two rollout groups, so a finished
# group's devices can be lent to the drafter (`python -m tlt_jax.train` asks XLA for one CPU
# device per group).
DRAFTER=runs/ablation_drafter
if [ ! -f $DRAFTER/drafter.safetensors ]; then
  python -m tlt_jax.tlt.warmup --config $CONFIG --rollouts 6 --steps 400 --out $DRAFTER
fi
python -m experiments.sweep --config $CONFIG --out $OUT/speculative \
  --title "SD off / static drafter / adaptive drafter (TLT), tuner on / off (8 steps)" \
  --set rollout.groups=2 --set tlt.drafter_init=$DRAFTER --set rl.steps=8 --set eval.every=0 \
  --point tlt.enabled=false \
  --point tlt.enabled=true,tlt.spot_training=false \
  --point tlt.enabled=true,tlt.spot_training=true \
  --point tlt.enabled=true,tlt.spot_training=true,tlt.fixed_arm=chain4 || true

# Numerics: XLA's kernels vs the batch-invariant ones (speed, and the sampler/trainer mismatch).
python -m experiments.sweep --config $CONFIG --out $OUT/numerics \
  --title "numerics: xla vs batch_invariant (LoRA rank 8, GRPO, 8 steps)" \
  --set rl.steps=8 --set eval.every=0 --grid numerics=xla,batch_invariant || true
