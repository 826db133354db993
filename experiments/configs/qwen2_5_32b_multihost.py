"""Qwen2.5-32B, GRPO with LoRA (rank 32) on Eurus-2-RL-style math prompts, 8K-token rollouts with
the adaptive drafter, on 4 hosts x 8 H100 80GB (32 GPUs).

On each host i (0..3), the same command with its own process id (HOST0 = host 0's address):
  python -m tlt_jax.train --config experiments/configs/qwen2_5_32b_multihost.py \\
      --config.distributed.coordinator_address=HOST0:8476 --config.distributed.process_id=i \\
      --config.model.hf_dir=/path/to/Qwen2.5-32B \\
      --config.data.train_path=/path/to/eurus_math_train.jsonl --config.data.eval_path=/path/to/eurus_math_val.jsonl
  python -m tlt_jax.plan --config experiments/configs/qwen2_5_32b_multihost.py    # per-GPU memory
Under SLURM or Open MPI, process_id=-1 (the default) reads the rank from the environment.

Data: Eurus-2-RL-Data stores a chat ("prompt": [{"role", "content"}, ...]) and the reference in
"reward_model": {"ground_truth"}; flatten its math rows (ability == "math"; coding rows need an
executor, which the rewards here do not have) to JSONL {"prompt": text, "answer": ground truth},
e.g. with pandas:  df[df.ability == "math"].assign(prompt=lambda d: d.prompt.map(lambda m:
m[-1]["content"]), answer=lambda d: d.reward_model.map(lambda r: r["ground_truth"]))[["prompt",
"answer"]].to_json(out, orient="records", lines=True). Its system prompt (the [ASSESS] /
[ADVANCE] action tags) goes into --config.data.system_prompt if wanted.

Fit (`python -m tlt_jax.plan`): ~70 of 72 usable GiB per GPU; 8K responses is the limit without
remat in the trainer. More room: --config.rollout.max_new_tokens=6144, or buckets up to 16.
"""

from tlt_jax.config import default_config


def get_config(arg: str | None = None):
  c = default_config()
  c.seed = 0
  c.numerics = "batch_invariant"
  m = c.model
  # Point hf_dir at the downloaded checkpoint; its config.json then wins over these fields.
  m.hf_dir = ""
  m.arch, m.vocab_size, m.hidden_size, m.intermediate_size = "qwen2", 152064, 5120, 27648
  m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 64, 40, 8, 128
  # rms_eps: 1e-5 in Qwen2.5-32B's config.json (1e-6 in -Instruct's).
  m.rope_theta, m.rms_eps, m.tie_embeddings, m.dtype = 1e6, 1e-5, False, "bfloat16"
  c.lora.rank, c.lora.alpha = 32, 32.0
  # model=8 = one host's NVLink domain (the mesh's last axis is a host's 8 GPUs): the 8 KV heads,
  # 40 heads and the MLP split 8 ways. fsdp=4 across the hosts shards the 61 GiB of weights;
  # data=4 instead (LoRA grads only over the network) would keep 7.6 GiB of weights per GPU and
  # go 3.7 GiB over.
  c.mesh.data, c.mesh.fsdp, c.mesh.model = 1, 4, 8
  # Exact tensor parallelism (the default: sampler == trainer log-probs bitwise) fits because its
  # backward gathers o_proj's / down_proj's inputs again and recomputes the logits a head chunk
  # at a time (rl.tp_regather); keeping them whole would need 111 GiB of 72
  # (`python -m tlt_jax.plan --config.rl.tp_regather=False`).
  c.plan.device_count, c.plan.device_memory_gib = 32, 80.0
  dist = c.distributed
  dist.num_processes, dist.process_id = 4, -1
  dist.coordinator_address = "host0.example:8476"  # placeholder: host 0's address, any free port
  d = c.data
  d.source = "files"
  d.train_path, d.eval_path = "/path/to/eurus_math_train.jsonl", "/path/to/eurus_math_val.jsonl"
  d.prompt_field, d.answer_field = "prompt", "answer"
  d.system_prompt = "Please reason step by step, and put your final answer within \\boxed{}."
  r = c.rollout
  r.prompts_per_step, r.group_size = 64, 8
  r.max_prompt_len, r.max_new_tokens = 1024, 8192
  r.temperature = 1.0
  r.chunk_steps = 16
  # 64 prompts in all: each of the 4 hosts decodes 16 x 8 samples on its 8 GPUs, which split the
  # model 8 ways (exact tensor parallelism, KV heads over GPUs), 32 at a time: 128 of the 512
  # samples decode at once.
  r.tensor_parallel = True
  r.buckets = (1, 2, 4, 8, 16, 32)
  t = c.tlt
  t.enabled = True
  t.arms = "chain2,chain4,tree8_4_32"
  t.drafter_init = ""  # e.g. mit-han-lab/Qwen2.5-32B-Eagle-RL converted, or a warm-up drafter
  t.window_steps = 1
  t.drafter_lr, t.rows, t.row_len = 5e-5, 8, 512
  t.online_lr = 5e-5
  rl = c.rl
  rl.algorithm, rl.steps = "grpo", 200
  # LoRA without regret: ~10x DAPO's 1e-6 full fine-tuning LR for Qwen2.5-32B.
  rl.lr, rl.warmup_steps, rl.max_grad_norm = 1e-5, 10, 1.0
  rl.minibatches = 1
  rl.chunk_rows = 4  # one row per fsdp shard
  rl.kl_coef = 0.0
  rl.reward_workers = 8
  c.eval.every, c.eval.num_problems = 20, 256
  c.checkpoint.every, c.checkpoint.keep, c.checkpoint.export_merged = 20, 3, False
  if arg:
    raise ValueError(f"unknown variant {arg!r} of qwen2_5_32b_multihost (none)")
  return c
