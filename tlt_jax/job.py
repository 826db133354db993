"""Everything one run needs, built once from its config: `build(c)` -> `Job`.

The config (tlt_jax/config.py) is translated here and nowhere else: the policy and its tokenizer
from the HF checkpoint, the train/eval rows, the rollout engines over their device groups, the
trainer on its mesh, the drafter side of TLT, the prompt pipeline, the checkpointer and the
reward scorer. `train`, `evaluate`, `tlt.warmup`, the benches and the notebooks build what they
need with the same constructors, so a run, its evaluation and its benchmark are the same objects.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from tlt_jax import checkpoint as ckpt_lib
from tlt_jax import mesh as mesh_lib
from tlt_jax.compile_queue import CompileQueue
from tlt_jax.data import splits
from tlt_jax.data.chat import PromptFormatter
from tlt_jax.data.pipeline import prompt_dataset
from tlt_jax.data.prompt_lengths import fit_prompts
from tlt_jax.data.stop_strings import engine_detokenize
from tlt_jax.model import hf, lora
from tlt_jax.model.drafter import Drafter
from tlt_jax.rl.scoring import RewardScorer, RewardSpec
from tlt_jax.rl.trainer import TrainConfig, Trainer
from tlt_jax.rollout.config import EngineConfig, config_arms
from tlt_jax.rollout.groups import GroupedRollout
from tlt_jax.tlt.buffer import DrafterBuffer
from tlt_jax.tlt.drafter_trainer import DrafterLossConfig, load_drafter
from tlt_jax.tlt.spot import SpotConfig, SpotTrainer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "experiments", "configs", "tiny_arith.py")
# Named purposes for host-side seeds: a seed is a function of (run seed, purpose, step), never
# of call order, so a resumed run and an uninterrupted one draw the same numbers.
PURPOSE_ROLLOUT, PURPOSE_EVAL, PURPOSE_WARMUP, PURPOSE_WARMUP_PROMPTS = 1, 2, 3, 4
PURPOSE_DAPO_ROUND = 5  # DAPO's extra rollouts within a step: (seed, purpose, step, round, ...)


def derived_seed(seed: int, purpose: int, step: int, *more: int) -> np.int32:
  return np.int32(np.random.SeedSequence([seed, purpose, step, *more]).generate_state(1)[0]
                  & 0x7FFFFFFF)


class Policy(NamedTuple):
  """The policy model of a config with what turns text into its prompts and back."""
  model: Any            # tlt_jax.model.transformer.Transformer
  tokenizer: Any        # tokenizers.Tokenizer
  formatter: PromptFormatter
  eos_ids: tuple[int, ...]


def load_policy(c) -> Policy:
  """The config's HF checkpoint (`model.hf_dir`) as a Policy, without LoRA."""
  if not c.model.hf_dir:
    raise ValueError("model.hf_dir is empty: it must name an HF checkpoint with a tokenizer.json")
  model = hf.load_model(c.model.hf_dir, dtype=c.model.dtype)
  tokenizer = hf.load_tokenizer(c.model.hf_dir)
  formatter = PromptFormatter.from_hf_dir(c.model.hf_dir, tokenizer,
                                          system_prompt=c.data.system_prompt,
                                          use_chat_template=c.data.use_chat_template)
  return Policy(model, tokenizer, formatter, model.cfg.eos_ids)


def apply_lora(c, model) -> None:
  if c.lora.rank > 0:
    lora.apply_lora(model, rank=c.lora.rank, alpha=c.lora.alpha, targets=tuple(c.lora.targets),
                    seed=c.seed)


def train_mesh(c) -> jax.sharding.Mesh:
  """The trainer's mesh: `config.mesh` over all devices of the run. In a multi-process run that
  is every process's devices: the trainer's state is sharded across hosts (fsdp can span them)
  and each device computes its own rows of the gathered batch, so no host repeats another's
  work. Raises ValueError naming `config.mesh` when the devices do not fit it."""
  devices = mesh_lib.run_devices()
  try:
    return mesh_lib.mesh_from_config(c.mesh, devices)
  except ValueError as e:
    kind = devices[0].platform
    where = (f"{len(devices)} {kind} devices over {jax.process_count()} processes"
             if jax.process_count() > 1 else f"{len(devices)} {kind} devices")
    raise ValueError(f"config.mesh ({where}): {e}") from None


def build_rollout(c, model, eos_ids, drafter=None, detokenize=None) -> GroupedRollout:
  """The rollout engines of the config: `rollout.groups` data-parallel groups over the local
  devices, with the tuner's SD arms when a drafter is given (plain decode otherwise) and the
  history arms of `rollout.history_arms` (each group keeps its own history: a prompt's siblings
  decode in one group, so their text never crosses devices or hosts).
  `detokenize` (token ids -> text) is what `rollout.stop_strings` are matched against."""
  devices = mesh_lib.run_devices(local=True)
  if not 1 <= c.rollout.groups <= len(devices):
    raise ValueError(
        f"rollout.groups={c.rollout.groups} must be 1..{len(devices)}: each group needs a "
        f"device and this process has {len(devices)} {devices[0].platform} device(s) (host "
        "devices instead: start with JAX_PLATFORMS=cpu; the CLI asks XLA for enough of them)")
  arms = config_arms(c, learned=drafter is not None)
  if drafter is not None and c.tlt.fixed_arm and c.tlt.fixed_arm not in {a.name for a in arms}:
    raise ValueError(f"tlt.fixed_arm={c.tlt.fixed_arm!r} is not one of tlt.arms={c.tlt.arms!r}")
  groups = [list(g) for g in np.array_split(np.array(devices, dtype=object), c.rollout.groups)]
  return GroupedRollout(model, EngineConfig.from_config(c, eos_ids, arms), groups, drafter,
                        tensor_parallel=c.rollout.tensor_parallel, detokenize=detokenize,
                        history_global_tokens=c.rollout.history_global_tokens)


def spot_config(c, *, online: bool = True) -> SpotConfig:
  """The drafter trainer's settings: online during RL, or for the offline warm-up."""
  t = c.tlt
  return SpotConfig(lr=t.online_lr if online else t.drafter_lr, rows=t.rows,
                    row_len=t.row_len, max_steps_per_rollout=t.max_steps_per_rollout,
                    loss=DrafterLossConfig(unroll=t.drafter_unroll), seed=c.seed)


@dataclasses.dataclass
class Job:
  """One RL run's parts. Several processes (config.distributed): each decodes its share of the
  prompts on its own devices, the rollouts are gathered (tlt_jax/multihost.py) and one trainer
  sharded over all processes' devices trains on them; process 0 writes metrics, plots, exports
  and the summary, checkpoints are written by all together."""
  config: Any                      # the ml_collections.ConfigDict the job was built from
  name: str
  workdir: str
  policy: Policy
  train_rows: list[dict]
  eval_rows: list[dict]
  data_report: dict
  engine: GroupedRollout
  trainer: Trainer
  data: Any                        # grain DatasetIterator of prompt-row batches (state in ckpts)
  checkpointer: ckpt_lib.Checkpointer
  scorer: RewardScorer
  drafter: Drafter | None = None   # TLT only
  buffer: DrafterBuffer | None = None
  spot: SpotTrainer | None = None  # spot drafter training on idle devices
  buffer_dir: str = ""             # drafter buffer spills: <buffer_dir>/step_<s>[/process_<i>]

  @property
  def multi_process(self) -> bool:
    return jax.process_count() > 1

  @property
  def primary(self) -> bool:
    return jax.process_index() == 0

  @property
  def group_size(self) -> int:
    return self.config.rollout.group_size

  @property
  def local_prompts(self) -> int:
    """This process's prompts per step: an equal share of `rollout.prompts_per_step`."""
    return self.config.rollout.prompts_per_step // jax.process_count()

  @property
  def train_len(self) -> int:
    return self.config.rollout.max_prompt_len + self.config.rollout.max_new_tokens

  @property
  def forced_arm(self) -> dict:
    """tlt.fixed_arm: the tuner is off and every chunk decodes with that arm."""
    t = self.config.tlt
    return {"arm": t.fixed_arm} if t.enabled and t.fixed_arm else {}

  def warm_up(self) -> dict[str, float]:
    """Compiles every program the run will use, before the first step; returns the seconds
    per kind of program ("prefill", "decode:<arm>", ..., "train_step", "drafter_step"). The
    rollout's and the drafter's programs compile in background threads while this thread
    builds the trainer's (whose programs feed each other's shapes, so they go one by one)."""
    queue = CompileQueue(self.config.compile.workers)
    self.engine.warm_up(queue)
    if self.spot is not None:
      self.spot.warm_up(self.engine.device_groups, queue)  # none inside a rollout's tail
    t0 = time.perf_counter()
    self.trainer.warm_up(self.train_len)
    train_s = time.perf_counter() - t0
    seconds = queue.wait()
    seconds["train_step"] = train_s
    return seconds

  def close(self) -> None:
    self.scorer.close()
    self.checkpointer.wait()
    self.checkpointer.close()


def workdir_of(c, name: str) -> str:
  if c.workdir:
    return c.workdir
  if jax.process_count() > 1:
    raise ValueError("a multi-process run needs config.workdir (the same path on every process)")
  return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def build(c, name: str = "run") -> Job:
  """Builds the RL job of config `c` (validated) under its workdir (created)."""
  if c.data.source == "files" and not c.data.train_path:
    raise ValueError("data.source='files' needs data.train_path for the RL job")
  r, t = c.rollout, c.tlt
  if r.prompts_per_step % jax.process_count():
    raise ValueError(f"rollout.prompts_per_step={r.prompts_per_step} must be a multiple of the "
                     f"{jax.process_count()} processes (each decodes an equal share)")
  workdir = workdir_of(c, name)
  os.makedirs(workdir, exist_ok=True)

  policy = load_policy(c)
  apply_lora(c, policy.model)
  train_rows, eval_rows, data_report = splits.load_rows(c)
  # Prompts longer than rollout.max_prompt_len: named (file:line) now, not mid-run.
  skipped = []
  for rows in (train_rows, eval_rows):
    rows[:], too_long = fit_prompts(rows, policy.formatter.encode, r.max_prompt_len,
                                    c.data.on_error)
    skipped += too_long
  if skipped:
    data_report.update(skipped_rows=data_report["skipped_rows"] + len(skipped),
                       skipped_examples=(data_report.get("skipped_examples", []) + skipped)[:5])
  drafter = None
  if t.enabled:
    drafter = (load_drafter(t.drafter_init, policy.model.cfg) if t.drafter_init
               else Drafter(policy.model.cfg, nnx.Rngs(c.seed + 1)))
  engine = build_rollout(c, policy.model, policy.eos_ids, drafter,
                         detokenize=engine_detokenize(c, *policy[1:]))
  buffer = DrafterBuffer(t.window_steps) if t.enabled else None
  spot = (SpotTrainer(drafter, policy.model, buffer, spot_config(c))
          if t.enabled and t.spot_training else None)
  multi = jax.process_count() > 1
  # The trainer reshards its model onto its mesh in place. Across processes that mesh spans
  # hosts, so it gets its own copy of the module: the engine and the spot trainer keep process-
  # local weights (and are handed trainer.local_policy() after each update).
  trainer = Trainer(nnx.clone(policy.model) if multi else policy.model,
                    TrainConfig.from_config(c), mesh=train_mesh(c))
  data = iter(prompt_dataset(train_rows, batch_size=r.prompts_per_step // jax.process_count(),
                             seed=c.seed, process_index=jax.process_index(),
                             process_count=jax.process_count(), shuffle=c.data.shuffle))
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       keep=c.checkpoint.keep, async_save=c.checkpoint.async_save)
  scorer = RewardScorer(RewardSpec.from_config(c.rl),
                        workers=c.rl.reward_workers, kind=c.rl.reward_worker_kind)
  buffer_dir = os.path.join(workdir, "drafter_buffer")  # run_state: step_<s>[/process_<i>]
  return Job(config=c, name=name, workdir=workdir, policy=policy, train_rows=train_rows,
             eval_rows=eval_rows, data_report=data_report, engine=engine, trainer=trainer,
             data=data, checkpointer=checkpointer, scorer=scorer, drafter=drafter, buffer=buffer,
             spot=spot, buffer_dir=buffer_dir)
