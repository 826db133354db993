"""What a rollout engine is asked to do: its buckets, lengths, sampling, end tokens and decoding
strategies (`EngineConfig`), built from a run config by `EngineConfig.from_config`.

The config is part of what a compiled program is: `rollout.programs` keys its shared executables
by it, so it is frozen and hashable.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from pallas_kernels.common import round_up
from tlt_jax import ops
from tlt_jax.rollout.sampling import SamplingParams
from tlt_jax.rollout.tuner import OFF, Arm, default_arms, parse_arms

VERIFICATION_MODES = ("gumbel", "rejection")
DRAFTER_NUMERICS = ("xla", "policy")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
  max_prompt_len: int = 32
  max_new_tokens: int = 64
  chunk_steps: int = 8            # decode steps (or SD rounds) per host round trip
  sampling: SamplingParams = SamplingParams()
  eos_ids: tuple[int, ...] = ()
  verification: str = "gumbel"
  arms: tuple[Arm, ...] = default_arms()
  compaction: bool = True
  max_verify_tokens_per_bucket: int = 1024
  stop_strings: tuple[str, ...] = ()  # checked on the host after each chunk (needs detokenize)
  seed: int = 0
  # The drafter only proposes: gumbel verification emits the target's own samples, and
  # rejection sampling is exact in distribution for any proposal. So it may run on XLA's fast
  # kernels whatever the target's numerics ("policy" = the target's own mode).
  drafter_numerics: str = "xla"
  # Lookup arms (`lookup_chainN`, drafted on device): the longest match of a row's newest
  # tokens they look for (up to this many); how many finished responses a chunk gets to draft
  # from besides the bucket's own rows; and the tokens of earlier responses the engine keeps so
  # that those are first the chunk's own prompts' (`rollout.bank`; 0 = the newest responses).
  lookup_max_order: int = 4
  lookup_bank: int = 16
  lookup_history_tokens: int = 1 << 20

  def __post_init__(self):
    if self.verification not in VERIFICATION_MODES:
      raise ValueError(f"verification must be one of {VERIFICATION_MODES}")
    if self.drafter_numerics not in DRAFTER_NUMERICS:
      raise ValueError(f"drafter_numerics must be one of {DRAFTER_NUMERICS}, "
                       f"got {self.drafter_numerics!r}")
    if list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
      raise ValueError(f"buckets must be increasing positive sizes, got {self.buckets}")
    if self.max_prompt_len < 1 or self.max_new_tokens < 1 or self.chunk_steps < 1:
      raise ValueError("max_prompt_len, max_new_tokens and chunk_steps must be >= 1")
    if self.lookup_max_order < 1 or self.lookup_bank < 0 or self.lookup_history_tokens < 0:
      raise ValueError(f"lookup_max_order must be >= 1 (got {self.lookup_max_order}), "
                       f"lookup_bank >= 0 (got {self.lookup_bank}) and lookup_history_tokens "
                       f">= 0 (got {self.lookup_history_tokens})")
    # Model-free drafts are always checked against the target's own Gumbel sample (they have
    # no draft distribution to reject against), so only the learned trees are refused here.
    if self.verification == "rejection" and any(a.is_tree and a.needs_drafter
                                                 for a in self.arms):
      raise ValueError("tree arms support verification='gumbel' only")

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict, eos_ids: tuple[int, ...],
                  arms: tuple[Arm, ...]) -> EngineConfig:
    """The engine config of a run config (`tlt_jax/config.py`): the one place its `rollout` keys
    become engine settings. eos_ids: the policy's end tokens (`ModelConfig.eos_ids`); arms: the
    decoding strategies the run may use (plain decoding alone when it has no drafter)."""
    r = c.rollout
    return cls(
        buckets=tuple(r.buckets), max_prompt_len=r.max_prompt_len, max_new_tokens=r.max_new_tokens,
        chunk_steps=r.chunk_steps, eos_ids=tuple(eos_ids), verification=r.verification,
        sampling=SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p),
        compaction=r.compaction, seed=c.seed, arms=tuple(arms),
        drafter_numerics=c.tlt.drafter_numerics,
        stop_strings=tuple(c.rollout.stop_strings), lookup_bank=r.lookup_bank,
        lookup_history_tokens=r.lookup_history_tokens)

  @property
  def max_depth(self) -> int:
    return max(a.depth for a in self.arms)

  @property
  def num_slots(self) -> int:
    """Prompt + response + one draft/verify window (or, with SD arms, the drafter's catch-up
    window of `chunk_steps` tokens if wider), padded to the attention's KV split size."""
    window = max(a.draft_slots for a in self.arms)
    if self.max_depth:
      window = max(window, self.chunk_steps)
    return round_up(self.max_prompt_len + self.max_new_tokens + window,
                    ops.kv_cache_multiple())


def config_arms(c: ml_collections.ConfigDict, learned: bool) -> tuple[Arm, ...]:
  """The decoding strategies of a run config: off, `tlt.arms` when a learned drafter serves
  (`learned`), and `rollout.history_arms` (model-free, history or lookup: no drafter needed)."""
  arms = parse_arms(c.tlt.arms) if learned else (Arm(OFF),)
  names = {a.name for a in arms}
  return arms + tuple(a for a in parse_arms(c.rollout.history_arms)[1:] if a.name not in names)
