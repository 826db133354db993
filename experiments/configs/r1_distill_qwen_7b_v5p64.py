"""DeepSeek-R1-Distill-Qwen-7B, GRPO with LoRA (rank 32) on DeepScaleR/DeepMath-style problems,
16K-token reasoning rollouts with the adaptive drafter, on a TPU v5p-64 slice (32 chips, 8 hosts).

Every host of the slice runs the same command (Cloud TPU tells JAX the coordinator and each
host's process id, so the distributed.* keys can stay as they are):
  python -m tlt_jax.train --config experiments/configs/r1_distill_qwen_7b_v5p64.py \\
      --config.model.hf_dir=/path/to/DeepSeek-R1-Distill-Qwen-7B \\
      --config.data.train_path=/path/to/deepscaler_train.parquet --config.data.eval_path=/path/to/aime24.parquet
  python -m tlt_jax.plan --config experiments/configs/r1_distill_qwen_7b_v5p64.py       # per-chip memory
  python -m tlt_jax.plan --config experiments/configs/r1_distill_qwen_7b_v5p64.py:8k    # stage 1
Outside Cloud TPU (or to pin it), add per host:
      --config.distributed.coordinator_address=HOST0:8476 --config.distributed.process_id=$HOST_INDEX

Hardware: v5p-64 is a 2x4x4 slice: 64 TensorCores = 32 chips (JAX devices, one megacore each),
8 hosts x 4 chips, 95 GB of HBM2e per chip (Cloud TPU v5p docs).

Data: Parquet rows with text fields; DeepScaleR-Preview-Dataset has "problem" / "answer"
(DeepMath-103K: --config.data.prompt_field=question --config.data.answer_field=final_answer).
The reference is compared as given (`tlt_jax/rl/rewards.py`); completions are read from their
last \\boxed{...}. DeepSeek advises no system prompt: put "Please reason step by step, and put
your final answer within \\boxed{}." at the end of each problem when preparing the file.

Lengths: DeepScaleR's schedule is 8K -> 16K -> 24K. 16K fits a v5p chip with this trainer
(`python -m tlt_jax.plan`: ~79 of 85.5 usable GiB); 24K+ needs remat and a blockwise attention
backward in the trainer (the plan of the `:24k` variant says how far it is over).
"""

from tlt_jax.config import default_config


def get_config(arg: str | None = None):
  c = default_config()
  c.seed = 0
  c.numerics = "batch_invariant"
  m = c.model
  # Point hf_dir at the downloaded checkpoint; its config.json then wins over these fields.
  m.hf_dir = ""
  # Qwen2.5-Math-7B's shapes: rope_theta 1e4 (not 1e6 as Qwen2.5-7B), 152064 tokens, untied.
  m.arch, m.vocab_size, m.hidden_size, m.intermediate_size = "qwen2", 152064, 3584, 18944
  m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 28, 28, 4, 128
  m.rope_theta, m.rms_eps, m.tie_embeddings, m.dtype = 10000.0, 1e-6, False, "bfloat16"
  c.lora.rank, c.lora.alpha = 32, 32.0
  # 32 chips: model=4 splits the 4 KV heads (and one 17K-token row's activations) 4 ways, so the
  # train step fits; data=4 x fsdp=2 give 8 rows at a time; fsdp gathers stay within 2 chips.
  c.mesh.data, c.mesh.fsdp, c.mesh.model = 4, 2, 4
  # Exact tensor parallelism (the default: sampler == trainer log-probs bitwise) fits because its
  # backward gathers o_proj's / down_proj's inputs again and recomputes the logits
  # (rl.tp_regather); keeping them whole would need 101.6 GiB of 85.5 (`python -m tlt_jax.plan
  # --config.rl.tp_regather=False`).
  c.plan.device_count, c.plan.device_memory_gib = 32, 95.0
  # 8 hosts; Cloud TPU reports coordinator and process id to jax.distributed itself.
  c.distributed.num_processes, c.distributed.process_id = 8, -1
  c.distributed.coordinator_address = ""
  d = c.data
  d.source = "files"
  d.train_path, d.eval_path = "/path/to/deepscaler_train.parquet", "/path/to/aime24.parquet"
  d.prompt_field, d.answer_field = "problem", "answer"
  d.system_prompt = ""
  r = c.rollout
  r.prompts_per_step, r.group_size = 64, 8
  r.max_prompt_len, r.max_new_tokens = 1024, 16384
  r.temperature = 0.6  # DeepSeek's recommendation for the R1 distills (and DeepScaleR's)
  r.chunk_steps = 16
  # 64 prompts in all: each of the 8 hosts decodes 8 x 8 samples on its 4 chips, which split the
  # model as the trainer's mesh.model=4 does (exact tensor parallelism, KV heads over chips),
  # 32 at a time: 256 of the 512 samples decode at once.
  r.tensor_parallel = True
  r.buckets = (1, 2, 4, 8, 16, 32)
  t = c.tlt
  t.enabled = True
  t.arms = "chain2,chain4,tree8_4_32"
  t.drafter_init = ""  # e.g. a drafter warmed up on this model's rollouts (`tlt_jax.tlt.warmup`)
  t.window_steps = 1
  t.drafter_lr, t.rows, t.row_len = 5e-5, 8, 512
  t.online_lr = 5e-5
  rl = c.rl
  rl.algorithm, rl.steps = "grpo", 300
  # LoRA without regret: ~10x the 1e-6 full fine-tuning LR of DeepScaleR / TLT.
  rl.lr, rl.warmup_steps, rl.max_grad_norm = 1e-5, 10, 1.0
  rl.minibatches = 1
  rl.chunk_rows = 8  # one row per data x fsdp shard
  rl.kl_coef = 0.0
  rl.reward_workers = 16
  c.eval.every, c.eval.num_problems, c.eval.samples = 25, 30, 16  # AIME: 30 problems, avg@16
  c.checkpoint.every, c.checkpoint.keep, c.checkpoint.export_merged = 25, 3, False
  if arg == "8k":
    r.max_new_tokens = 8192
  elif arg == "24k":
    r.max_new_tokens = 24576
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of r1_distill_qwen_7b_v5p64 (known: 8k, 24k)")
  return c
