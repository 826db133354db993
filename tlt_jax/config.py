"""ConfigDict defaults and validation. The returned config is locked: an unknown key is an error
that names the key (`--config.model.hiden_size=...` fails instead of being silently ignored)."""

from __future__ import annotations

import importlib.util

import ml_collections
from ml_collections import config_dict

from tlt_jax.model import hf
from tlt_jax.rl import algorithms, scoring
from tlt_jax.model.transformer import ModelConfig, RopeScaling
from tlt_jax.rollout import tuner
from tlt_jax.rollout.config import VERIFICATION_MODES


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.numerics = "xla"  # "xla" | "batch_invariant" (see tlt_jax/ops.py)
  c.numerics_backend = "auto"  # batch_invariant kernels: "auto" | "pallas" | "blocked_jax"
  c.xla_determinism = True  # run-to-run determinism flags on GPU (tlt_jax/determinism.py)
  # XLA's f32 matmuls: "highest" (full f32) | "tf32" (faster on NVIDIA GPUs, ~1e-3 relative)
  c.numerics_f32_matmul = "highest"
  # library log lines shown (absl, Orbax, Grain, JAX): "warning" | "info" | "debug" | "error"
  c.log_level = "warning"
  # JAX's persistent compilation cache (tlt_jax/compile_cache.py): None = $TLT_JAX_CACHE_DIR,
  # else ~/.cache/tlt_jax/xla; "" = off
  # (a str placeholder: --config.compile.cache_dir=... overrides it; other types are refused).
  # workers: threads compiling the warm-up's programs side by side (tlt_jax/compile_queue.py);
  # 0 = one per core up to 8, 1 = one at a time in the main thread
  c.compile = ml_collections.ConfigDict(dict(cache_dir=config_dict.placeholder(str), workers=0))
  c.model = ml_collections.ConfigDict(dict(
      hf_dir="",  # a config.json + safetensors directory; when set, the fields below are ignored
      arch="qwen3", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_eps=1e-6,
      tie_embeddings=True, dtype="float32"))
  c.lora = ml_collections.ConfigDict(dict(
      rank=8, alpha=32.0,
      targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")))
  c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, model=1))
  # --- the RL job (python -m tlt_jax.train) ---
  c.workdir = ""  # "" = runs/<config name>-<time>
  c.data = ml_collections.ConfigDict(dict(
      source="synthetic",  # "synthetic" | "files"
      train_path="", eval_path="",  # .jsonl / .parquet (source="files")
      prompt_field="question", answer_field="answer",
      on_error="raise",  # malformed rows: "raise" (names file:line) | "skip" (counted)
      synthetic_mix="1:0.35,2:0.3,3:0.15,4:0.1,8:0.06,16:0.04",  # digits:share
      synthetic_ops="+",  # "+", "*" or "+*"
      synthetic_train=20000,  # held-out eval problems: eval.num_problems
      use_chat_template=True, system_prompt="",
      shuffle=True,
      # mixed math/code files: the row field naming its reward ("math" | "code"; absent = math),
      # the code rows' tests field, and "eurus" = Eurus-2-RL-Data's own fields (prompt chat,
      # ability, reward_model.ground_truth) instead of the *_field names
      reward_field="reward", tests_field="tests", layout="fields"))
  c.rollout = ml_collections.ConfigDict(dict(
      # the whole step's prompts (several processes decode equal shares of them)
      prompts_per_step=16, group_size=8, max_prompt_len=32, max_new_tokens=192,
      temperature=1.0, top_k=0, top_p=1.0, chunk_steps=8,
      buckets=(1, 2, 4, 8, 16, 32, 64, 128), compaction=True, verification="gumbel",
      # data-parallel rollout groups (the local devices split evenly)
      groups=1,
      # each group's devices split the model (exact tensor parallelism: with the Pallas
      # kernels bitwise the unsplit engine) rather than each holding a whole copy
      tensor_parallel=False,
      # end a sample when its decoded text contains one of these (checked against the
      # tokenizer and the chat template's end marker when the run starts)
      stop_strings=(),
      # model-free SD arms, offered to the tuner beside off (and tlt.arms when tlt.enabled),
      # with or without a learned drafter; "" = none. history_chainN: chains drafted on the
      # host (rollout/history.py) from the prompt, the group's siblings so far and earlier
      # responses to the same prompt, one verify round per program call. lookup_chainN: chains
      # looked up on device (rollout/steps.py) in the bucket's rows and a bank of recent
      # responses, chunk_steps rounds per call. history_treeD_W / lookup_treeD_W: W distinct
      # chains of D tokens verified as one tree (1 + D * W tokens per row). E.g.
      # "lookup_chain4,lookup_tree4_3,history_chain4"
      history_arms="",
      # also draft from a global suffix trie over this many recent response tokens of every
      # prompt (when the group's own text matches nothing); 0 = the group's text only
      history_global_tokens=0,
      # finished responses the lookup arms draft from besides the bucket's rows: earlier
      # responses to the chunk's prompts first, then the newest of any prompt
      lookup_bank=16,
      # tokens of earlier responses kept on the host for that, oldest evicted first (0 = the
      # bank is the newest responses only)
      lookup_history_tokens=1 << 20))
  c.tlt = ml_collections.ConfigDict(dict(
      enabled=False,  # speculative decoding with the tuner and an EAGLE drafter
      arms="chain2,chain4",  # SD arms the tuner may pick, besides off (chainN, treeD_K_V)
      fixed_arm="",  # "" = the tuner chooses per bucket; "chain4" = always that arm (tuner off)
      drafter_init="",  # a drafter from `python -m tlt_jax.tlt.warmup` ("" = random)
      spot_training=True,  # train the drafter on idle devices during the tail
      # the drafter only proposes (verification keeps the target's tokens): "xla" runs it on
      # XLA's fast kernels, "policy" under the run's own numerics
      drafter_numerics="xla",
      window_steps=2, drafter_lr=3e-3, rows=8, row_len=256,
      # the spot (online) steps' LR: RL starts a fresh AdamW on the warmed-up drafter, whose
      # first updates move every weight by about the LR; at the warm-up's 3e-3 that undid part
      # of the warm-up (accept length 3.24 adaptive vs 3.41 static, bench_tlt)
      online_lr=3e-4,
      # draft depths trained per drafter step: 1 = teacher forcing (EAGLE-1); k > 1 also feeds
      # the drafter's own features back for depths 2..k (EAGLE-3's training-time test)
      drafter_unroll=1,
      max_steps_per_rollout=0,  # 0 = as many as the idle time allows
      min_live_share=0.0,  # also lend a group still decoding below this share of live slots
      spill_buffer=True))  # keep the drafter's data window on disk with the checkpoints
  c.rl = ml_collections.ConfigDict(dict(
      steps=40, algorithm="grpo", loss="",  # loss "" = the algorithm's own
      # LoRA without regret: LoRA wants ~10x the full fine-tuning LR (lora.rank=0 = full FT).
      lr=2e-3, warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
      minibatches=1, epochs=1, eps_low=-1.0, eps_high=-1.0,  # < 0 = the loss's default
      chunk_rows=16,  # rows per length-sorted train chunk (gradients accumulate over chunks)
      # chunks are padded to a multiple of this many tokens: one compiled train step per
      # multiple up to the longest row (larger = fewer programs to compile, more padding)
      length_bucket=32,
      # mesh.model > 1 with batch_invariant numerics: split the model exactly (sampler ==
      # trainer log-probs bitwise; the logits' gradient whole on every device), or as XLA does
      # (1/model of it; last-bit differences: logp_abs_diff_max)
      exact_tensor_parallel=True,
      # exact split: the backward all-gathers o_proj's and down_proj's inputs again and
      # recomputes the logits instead of keeping them whole on every device (False: a faster
      # backward, ~rows x tokens x (L x (H*hd + I) + 2V) more bytes per device; `plan` counts it)
      tp_regather=True,
      kl_coef=0.0, kl_estimator="k3", tis_cap=2.0,
      overlong_buffer=0,  # DAPO soft overlong penalty over the last N tokens (0 = off)
      # DAPO dynamic sampling (rl.algorithm="dapo"): groups whose answers are all right or all
      # wrong are dropped, and while fewer than rollout.prompts_per_step mixed groups are in
      # hand the step draws and rolls out the next batch of prompts, up to this many rollouts
      # per step in all (verl's max_num_gen_batches, 10 there; 1 = no over-sampling). Still
      # short after the last one, the step trains on the mixed groups it has, the rest of the
      # batch with weight 0 (metrics: dapo_rollouts, dapo_mixed_groups, dapo_shortfall_groups).
      dapo_max_rollouts=4,
      correct_weight=1.0, format_weight=0.0,
      reward_workers=2, reward_worker_kind="thread",
      # code rewards (tlt_jax/rl/code_reward.py): "all" = 1 only when every test passes,
      # "fraction" = the share passed; each test's sandboxed run has this wall limit
      code_partial="all", code_timeout_s=10.0, code_max_tests=16))
  c.eval = ml_collections.ConfigDict(dict(every=0, num_problems=256, samples=1, seed=1))
  c.checkpoint = ml_collections.ConfigDict(dict(
      every=10, keep=3, async_save=True, resume=True,
      export_adapter=True,  # <workdir>/export/adapter: the PEFT adapter
      export_merged=False))  # <workdir>/export/merged: HF safetensors with LoRA merged in
  c.metrics = ml_collections.ConfigDict(dict(tensorboard=True, plots=True, progress=True))
  # --- `python -m tlt_jax.plan`: per-device memory of the run on its mesh, before renting one
  c.plan = ml_collections.ConfigDict(dict(
      device_count=0,  # devices the mesh spans (all hosts); 0 = the local devices
      device_memory_gib=0.0,  # per device (H100 80, H200 141, v5p 95); 0 = no fit check
      # usable share of device_memory_gib (XLA, the runtime and fragmentation take the rest)
      headroom=0.9,
      lower_layers=2))  # decoder layers in the lowered programs (layers are identical); 0 = all
  # --- multi-host: jax.distributed.initialize (tlt_jax/distributed.py); 1 process = off
  c.distributed = ml_collections.ConfigDict(dict(
      coordinator_address="",  # "host:port" of process 0 ("" = detected: Cloud TPU, SLURM, MPI)
      num_processes=1, process_id=-1,  # -1 = detected from the environment
      local_device_ids=""))  # "0,1,2,3" = this process's devices ("" = all it sees)
  c.lock()
  return c


def validate(c: ml_collections.ConfigDict) -> None:
  problems = []
  if c.numerics not in ("xla", "batch_invariant"):
    problems.append(f"numerics={c.numerics!r} must be 'xla' or 'batch_invariant'")
  if c.numerics_backend not in ("auto", "pallas", "blocked_jax"):
    problems.append(f"numerics_backend={c.numerics_backend!r} must be 'auto', 'pallas' or "
                    "'blocked_jax'")
  if c.numerics_f32_matmul not in ("highest", "tf32"):
    problems.append(f"numerics_f32_matmul={c.numerics_f32_matmul!r} must be 'highest' (full "
                    "f32) or 'tf32' (XLA's f32 matmuls as TF32 on NVIDIA GPUs)")
  if c.log_level not in ("debug", "info", "warning", "error"):
    problems.append(f"log_level={c.log_level!r} must be 'debug', 'info', 'warning' or 'error'")
  if c.compile.workers < 0:
    problems.append(f"compile.workers={c.compile.workers} must be >= 0 (0 = one per core)")
  m = c.model
  if m.num_heads <= 0:
    problems.append(f"model.num_heads={m.num_heads} must be positive")
  elif not m.head_dim and m.hidden_size % m.num_heads:
    problems.append(f"model.hidden_size={m.hidden_size} is not divisible by "
                    f"model.num_heads={m.num_heads} and no model.head_dim is set")
  if m.num_kv_heads <= 0 or m.num_heads % max(m.num_kv_heads, 1):
    problems.append(f"model.num_heads={m.num_heads} is not a multiple of "
                    f"model.num_kv_heads={m.num_kv_heads}")
  if c.lora.rank < 0:
    problems.append(f"lora.rank={c.lora.rank} must be >= 0 (0 = full fine-tuning)")
  elif c.lora.rank > 0:
    if c.lora.alpha <= 0:  # the adapters' scale alpha / rank: 0 trains nothing, < 0 flips it
      problems.append(f"lora.alpha={c.lora.alpha} must be > 0 (the adapters scale by "
                      "alpha / rank)")
    if not tuple(c.lora.targets):
      problems.append("lora.targets=() names no layer: set the layers to adapt, or "
                      "lora.rank=0 for full fine-tuning")
  if c.rl.lr < 0:
    problems.append(f"rl.lr={c.rl.lr} must be >= 0 (a negative rate ascends the loss)")
  if c.rl.max_grad_norm <= 0:
    problems.append(f"rl.max_grad_norm={c.rl.max_grad_norm} must be > 0 (the global norm "
                    "gradients are clipped to)")
  if c.eval.samples < 1 or c.eval.num_problems < 1:
    problems.append(f"eval.samples={c.eval.samples} and eval.num_problems="
                    f"{c.eval.num_problems} must be >= 1")
  r = c.rollout
  if r.prompts_per_step < 1 or r.group_size < 1:
    problems.append("rollout.prompts_per_step and rollout.group_size must be >= 1")
  elif r.group_size == 1:  # every estimator is group-relative (rl/algorithms.py)
    problems.append(f"rollout.group_size=1 with rl.algorithm={c.rl.algorithm!r} makes every "
                    "advantage 0 (a sample is compared with its group): use >= 2")
  elif c.rl.minibatches >= 1 and (r.prompts_per_step * r.group_size) % c.rl.minibatches:
    problems.append(f"rollout.prompts_per_step x group_size = {r.prompts_per_step * r.group_size}"
                    f" sequences do not split into rl.minibatches={c.rl.minibatches}")
  if c.data.source not in ("synthetic", "files"):
    problems.append(f"data.source={c.data.source!r} must be 'synthetic' or 'files'")
  elif c.data.source == "files" and not c.data.eval_path:
    problems.append("data.source='files' needs data.eval_path (and data.train_path to train)")
  if c.data.on_error not in ("raise", "skip"):
    problems.append(f"data.on_error={c.data.on_error!r} must be 'raise' or 'skip'")
  if c.data.layout not in ("fields", "eurus"):
    problems.append(f"data.layout={c.data.layout!r} must be 'fields' or 'eurus'")
  if c.rl.code_partial not in ("all", "fraction"):
    problems.append(f"rl.code_partial={c.rl.code_partial!r} must be 'all' or 'fraction'")
  if c.rl.code_timeout_s <= 0 or c.rl.code_max_tests < 1:
    problems.append("rl.code_timeout_s must be > 0 and rl.code_max_tests >= 1")
  stops = c.rollout.stop_strings
  if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
    problems.append(f"rollout.stop_strings={stops!r} must be a tuple of non-empty strings")
  problems += _arm_problems(c.tlt)
  problems += _history_problems(c.rollout)
  problems += _run_problems(c)
  if c.tlt.drafter_numerics not in ("xla", "policy"):
    problems.append(f"tlt.drafter_numerics={c.tlt.drafter_numerics!r} must be 'xla' or 'policy'")
  if c.tlt.drafter_lr <= 0 or c.tlt.online_lr <= 0:
    problems.append("tlt.drafter_lr and tlt.online_lr must be > 0")
  if c.tlt.drafter_unroll < 1:
    problems.append(f"tlt.drafter_unroll={c.tlt.drafter_unroll} must be >= 1 (draft depths)")
  if sum(v == -1 for v in (c.mesh.data, c.mesh.fsdp, c.mesh.model)) > 1:
    problems.append("at most one of mesh.data / mesh.fsdp / mesh.model may be -1")
  p = c.plan
  if p.device_count < 0 or p.device_memory_gib < 0 or p.lower_layers < 0:
    problems.append("plan.device_count, plan.device_memory_gib and plan.lower_layers must be >= 0")
  if not 0 < p.headroom <= 1:
    problems.append(f"plan.headroom={p.headroom} must be in (0, 1]")
  d = c.distributed
  if d.num_processes < 1 or not -1 <= d.process_id < max(d.num_processes, 1):
    problems.append(f"distributed.process_id={d.process_id} must be -1 (detected) or in "
                    f"[0, distributed.num_processes={d.num_processes})")
  elif c.rollout.prompts_per_step % d.num_processes:
    problems.append(f"rollout.prompts_per_step={c.rollout.prompts_per_step} must be a multiple "
                    f"of distributed.num_processes={d.num_processes} (each process decodes an "
                    "equal share)")
  if problems:
    raise ValueError("invalid config: " + "; ".join(problems))


def _run_problems(c: ml_collections.ConfigDict) -> list[str]:
  """Values the trainer, the engines, the scorer and the checkpointer would refuse (or divide
  by) once built, without naming the key: named here, before anything loads."""
  problems, rl, r = [], c.rl, c.rollout
  if rl.algorithm not in algorithms.ADVANTAGES:
    problems.append(f"rl.algorithm={rl.algorithm!r} must be one of "
                    f"{sorted(algorithms.ADVANTAGES)}")
  if rl.loss and rl.loss not in algorithms.LOSSES:
    problems.append(f"rl.loss={rl.loss!r} must be '' (the algorithm's own) or one of "
                    f"{sorted(algorithms.LOSSES)}")
  if rl.kl_estimator not in ("k1", "k3"):
    problems.append(f"rl.kl_estimator={rl.kl_estimator!r} must be 'k1' or 'k3'")
  for key in ("minibatches", "epochs", "chunk_rows", "length_bucket"):
    if rl[key] < 1:
      problems.append(f"rl.{key}={rl[key]} must be >= 1")
  if rl.dapo_max_rollouts < 1:
    problems.append(f"rl.dapo_max_rollouts={rl.dapo_max_rollouts} must be >= 1 (1 = no "
                    "over-sampling)")
  if rl.steps < 0:
    problems.append(f"rl.steps={rl.steps} must be >= 0")
  if rl.reward_worker_kind not in scoring.WORKER_KINDS or rl.reward_workers < 1:
    problems.append(f"rl.reward_worker_kind={rl.reward_worker_kind!r} must be one of "
                    f"{scoring.WORKER_KINDS} and rl.reward_workers={rl.reward_workers} >= 1")
  if r.temperature < 0:
    problems.append(f"rollout.temperature={r.temperature} must be >= 0 (0 = greedy)")
  if r.top_k < 0:
    problems.append(f"rollout.top_k={r.top_k} must be >= 0 (0 = off)")
  if not 0 < r.top_p <= 1:
    problems.append(f"rollout.top_p={r.top_p} must be in (0, 1] (1 = off)")
  for key in ("max_prompt_len", "max_new_tokens", "chunk_steps"):
    if r[key] < 1:
      problems.append(f"rollout.{key}={r[key]} must be >= 1")
  buckets = tuple(r.buckets)
  if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
    problems.append(f"rollout.buckets={buckets} must be increasing positive batch sizes")
  if r.verification not in VERIFICATION_MODES:
    problems.append(f"rollout.verification={r.verification!r} must be one of "
                    f"{VERIFICATION_MODES}")
  if c.checkpoint.keep < 1 or c.checkpoint.every < 0 or c.eval.every < 0:
    problems.append(f"checkpoint.keep={c.checkpoint.keep} must be >= 1, checkpoint.every="
                    f"{c.checkpoint.every} and eval.every={c.eval.every} >= 0 (0 = only at "
                    "the end)")
  if c.model.dtype not in ("float32", "bfloat16"):
    problems.append(f"model.dtype={c.model.dtype!r} must be 'float32' or 'bfloat16'")
  return problems


def _arm_problems(t: ml_collections.ConfigDict) -> list[str]:
  """tlt.arms must parse and tlt.fixed_arm name one of them (or "off"), checked even while
  tlt.enabled=False: a typo must not wait for the run that turns SD on."""
  try:
    names = {a.name for a in tuner.parse_arms(t.arms)}
  except ValueError as e:
    return [f"tlt.arms={t.arms!r}: {e}"]
  if t.fixed_arm and t.fixed_arm not in names:
    return [f"tlt.fixed_arm={t.fixed_arm!r} is not one of the arms {sorted(names)} "
            f"(tlt.arms={t.arms!r})"]
  return []


def _history_problems(r: ml_collections.ConfigDict) -> list[str]:
  """rollout.history_arms must name model-free chains only (learned arms go in tlt.arms)."""
  try:
    arms = [a for a in tuner.parse_arms(r.history_arms) if a.depth]
  except ValueError as e:
    return [f"rollout.history_arms={r.history_arms!r}: {e}"]
  problems = [f"rollout.history_arms={r.history_arms!r}: {a.name!r} is not a model-free arm "
              "(history_chainN, history_treeD_W, lookup_chainN or lookup_treeD_W; learned-drafter "
              "arms go in tlt.arms)"
              for a in arms if a.needs_drafter]
  if r.history_global_tokens < 0:
    problems.append(f"rollout.history_global_tokens={r.history_global_tokens} must be >= 0 "
                    "(0 = no global trie)")
  if r.lookup_bank < 0:
    problems.append(f"rollout.lookup_bank={r.lookup_bank} must be >= 0 (0 = the bucket's rows "
                    "only)")
  if r.lookup_history_tokens < 0:
    problems.append(f"rollout.lookup_history_tokens={r.lookup_history_tokens} must be >= 0 "
                    "(0 = the newest responses only)")
  return problems


def model_config(c: ml_collections.ConfigDict) -> ModelConfig:
  """The ModelConfig the config describes (from model.hf_dir's config.json when set)."""
  validate(c)
  m = c.model
  if m.hf_dir:
    return hf.load_config(m.hf_dir, dtype=m.dtype)
  return ModelConfig(arch=m.arch, vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                     intermediate_size=m.intermediate_size, num_layers=m.num_layers,
                     num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                     rope_theta=m.rope_theta, rms_eps=m.rms_eps,
                     tie_embeddings=m.tie_embeddings, qkv_bias=m.arch == "qwen2",
                     qk_norm=m.arch == "qwen3", dtype=m.dtype)


__all__ = ["default_config", "validate", "model_config", "RopeScaling"]


def load_config_file(path: str, variant: str | None = None) -> ml_collections.ConfigDict:
  """`get_config(variant)` of an experiment config file, as `--config path[:variant]` loads it."""

  spec = importlib.util.spec_from_file_location("tlt_experiment_config", path)
  if spec is None:
    raise FileNotFoundError(f"no experiment config at {path}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant)


def apply_numerics(c: ml_collections.ConfigDict) -> None:
  """Sets XLA flags (before JAX starts its backends) and the ops switch from the config."""
  from tlt_jax import determinism, ops  # noqa: PLC0415 (config is imported by ops' dependencies: a cycle at module level)

  determinism.configure(c.numerics, c.xla_determinism, c.numerics_f32_matmul)
  ops.set_numerics(c.numerics, c.numerics_backend)
