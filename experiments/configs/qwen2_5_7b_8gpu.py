"""Qwen2.5-7B-Instruct, GRPO with LoRA (rank 32, all linear layers) on GSM8K/MATH, 8k-token
reasoning rollouts with the adaptive drafter (TLT), batch-invariant numerics; 8 x H100 80GB.

  python -m tlt_jax.train --config experiments/configs/qwen2_5_7b_8gpu.py \\
      --config.model.hf_dir=/path/to/Qwen2.5-7B-Instruct \\
      --config.data.train_path=/path/to/gsm8k_train.jsonl --config.data.eval_path=/path/to/gsm8k_test.jsonl
  python -m tlt_jax.plan --config experiments/configs/qwen2_5_7b_8gpu.py      # per-GPU memory, ~10 s on CPU
  python -m tlt_jax.plan --config experiments/configs/qwen2_5_7b_8gpu.py:math  # Qwen2.5-Math-7B

Data: JSONL rows {"question": ..., "answer": ...}. The reference answer is compared as given
(`tlt_jax/rl/rewards.py`: exact rationals, LaTeX normalisation, sympy), so GSM8K's answers, which
end in "#### 72" after a worked solution, must be cut to the number first:
  jq -c '{question, answer: (.answer | split("#### ") | last)}' gsm8k_train.jsonl > train.jsonl
MATH: {"problem", "answer"} rows (e.g. the MATH-500 / hendrycks "answer" column):
--config.data.prompt_field=problem. The model's completion may end in \\boxed{...}, "#### x",
"the answer is x" or just a number (`rewards.extract_answer`, in that order of trust).

Settings and where they come from:
- 64 prompts x 8 samples, prompt 1K tokens: TLT's `examples/grpo_7B.sh` (which goes to 32K
  responses with sequence parallelism, remat and offload; this trainer has none of those, so 8K
  is what fits 80 GB here: `python -m tlt_jax.plan` says so).
- LoRA: "LoRA without regret" (Thinking Machines, 2025): all linear layers, the optimal LR about
  10x full fine-tuning's and nearly independent of rank; TLT's full-FT GRPO LR is 1e-6 -> 1e-5.
"""

from tlt_jax.config import default_config


def get_config(arg: str | None = None):
  c = default_config()
  c.seed = 0
  c.numerics = "batch_invariant"  # sampler == trainer log-probs, bitwise
  m = c.model
  # Point hf_dir at the downloaded checkpoint (config.json + *.safetensors + tokenizer.json);
  # when it is set, its config.json is used and the fields below only serve the planner.
  m.hf_dir = ""
  m.arch, m.vocab_size, m.hidden_size, m.intermediate_size = "qwen2", 152064, 3584, 18944
  m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 28, 28, 4, 128
  m.rope_theta, m.rms_eps, m.tie_embeddings, m.dtype = 1e6, 1e-6, False, "bfloat16"
  c.lora.rank, c.lora.alpha = 32, 32.0
  c.lora.targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
  # model=4: the 4 KV heads (and 28 heads, 18944 MLP) split 4 ways, so one 9K-token row's
  # activations and the KV cache are a quarter per GPU; fsdp=2 shards the rest. Pure FSDP
  # (fsdp=8) needs 106 GiB per GPU for the train step (the trainer has no remat), this 55 GiB.
  c.mesh.data, c.mesh.fsdp, c.mesh.model = 1, 2, 4
  c.plan.device_count, c.plan.device_memory_gib = 8, 80.0
  d = c.data
  d.source = "files"
  d.train_path, d.eval_path = "/path/to/gsm8k_train.jsonl", "/path/to/gsm8k_test.jsonl"
  d.prompt_field, d.answer_field = "question", "answer"
  d.system_prompt = "Please reason step by step, and put your final answer within \\boxed{}."
  r = c.rollout
  r.prompts_per_step, r.group_size = 64, 8
  r.max_prompt_len, r.max_new_tokens = 1024, 8192
  r.temperature = 1.0
  r.chunk_steps = 16
  # Two rollout groups of 4 GPUs, each splitting the model 4 ways as the trainer's mesh does
  # (exact tensor parallelism: the Pallas kernels keep every token bitwise the unsplit engine's).
  # At most 2 x 64 sequences decode at once (the other 384 wait for a free slot): 64 slots of
  # 9.2K tokens are 12 GiB of KV per GPU, and prefilling 64 prompts another 25 GiB.
  r.groups, r.tensor_parallel = 2, True
  r.buckets = (1, 2, 4, 8, 16, 32, 64)
  t = c.tlt
  t.enabled = True
  t.arms = "chain2,chain4,tree8_4_32"  # TLT's default tree is 8 deep x top-4
  t.drafter_init = ""  # a warmed-up drafter (`python -m tlt_jax.tlt.warmup`), "" = random
  t.window_steps = 1  # every sample's hidden states stay on device: 14 GiB per GPU per step
  t.drafter_lr, t.rows, t.row_len = 5e-5, 8, 512  # TLT's EAGLE LR and <= 512-token windows
  t.online_lr = 5e-5
  rl = c.rl
  rl.algorithm, rl.steps = "grpo", 200
  rl.lr, rl.warmup_steps, rl.max_grad_norm = 1e-5, 10, 1.0
  rl.minibatches = 1  # one update per rollout batch: exactly on-policy
  rl.chunk_rows = 2  # one 9K-token row per data x fsdp shard at a time
  rl.kl_coef = 0.0
  rl.reward_workers = 8
  c.eval.every, c.eval.num_problems = 20, 500
  c.checkpoint.every, c.checkpoint.keep, c.checkpoint.export_merged = 20, 3, False
  if arg == "math":
    # Qwen2.5-Math-7B(-Instruct): the same shapes, rope_theta 1e4 and a 4K context.
    m.rope_theta = 10000.0
    r.max_prompt_len, r.max_new_tokens = 512, 3072
  elif arg:
    raise ValueError(f"unknown variant {arg!r} of qwen2_5_7b_8gpu (known: math)")
  return c
