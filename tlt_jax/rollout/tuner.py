"""Per-bucket strategy tuner: epsilon-greedy on the median reward of each arm over a window.

Reward = tokens emitted per live row per second of a decode chunk. A chunk costs the same
whatever share of its bucket is live (the shapes are fixed), so dividing by the live rows lets
arms tried while a bucket was full and while it was draining compare fairly. "Live rows" is the
mean over the chunk's rounds of the rows still active (the engine passes row-rounds / rounds):
counted at the chunk's start, rows that finish early in an 8-round plain chunk diluted its reward
and one-round history chunks won the long tail while decoding it 2.9x slower (bench_rollout).
Each batch bucket has its own bandit over the arms allowed there (speculative arms whose verify
tokens x bucket exceed the memory bound are not offered), plus `off` (plain decode). Unseen
arms are tried first. History arms (chains drafted on the host, `rollout.history`) and lookup
arms (chains looked up on device in the bucket's own rows, `rollout.steps`) compete like the
others: a history chunk's time includes the host's drafting. A chunk right after a refill also
includes its prefill (it runs on the device just before); its sample is provisional, the arm's
figure only until a clean one comes (as the first sample of `off`, the arm tried first in each
bucket, it made plain decoding look slower than the arms tried after it). The state is plain data
(`state_dict` / `load_state_dict`) so it is checkpointed with the run.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

OFF = "off"
LEARNED, HISTORY, LOOKUP, COMBINED = "learned", "history", "lookup", "combined"
MODEL_FREE = (HISTORY, LOOKUP)


@dataclasses.dataclass(frozen=True)
class Arm:
  """A decode strategy: plain (depth 0), a chain of `depth` drafts, or a tree of `depth` levels
  with `topk` children per node of which `verify` tokens (root included) go to the target.
  drafter: who drafts: the learned drafter on device, the history drafter (`rollout.history`)
  on the host, one round per program call, or the lookup drafter, on device inside a decode
  chunk (the longest match of each row's last tokens in the bucket's rows and a bank of recent
  responses, `rollout.steps._lookup_drafts`). A model-free tree's `topk` is its number of
  distinct chains (looked up, or proposed by the history drafter), merged into one trie and
  verified whole (`verify` = 1 + depth * topk). The combined arm's tree holds the learned
  drafter's chain and `topk - 1` looked-up chains, one verify for both drafters' candidates."""
  name: str
  depth: int = 0
  topk: int = 0    # 0 = chain
  verify: int = 0  # tree only
  drafter: str = LEARNED

  def __post_init__(self):
    if self.drafter not in (LEARNED, COMBINED, *MODEL_FREE):
      raise ValueError(f"arm {self.name}: drafter must be one of "
                       f"{(LEARNED, COMBINED, *MODEL_FREE)}")
    if self.drafter in MODEL_FREE and not self.depth:
      raise ValueError(f"arm {self.name}: {self.drafter} arms draft depth >= 1 tokens per chain")
    if (self.drafter in MODEL_FREE and self.topk or self.drafter == COMBINED) and (
        self.depth < 1 or self.topk < (2 if self.drafter == COMBINED else 1)
        or self.verify != 1 + self.depth * self.topk):
      raise ValueError(f"arm {self.name}: a {self.drafter} tree of depth >= 1 verifies all its "
                       f"chains' nodes (verify = 1 + depth * chains), the combined one at least "
                       f"one looked-up chain beside the learned one")
    if self.topk and not 2 <= self.verify <= 1 + self.depth * self.topk:
      raise ValueError(f"arm {self.name}: a tree of depth {self.depth} x top-{self.topk} has "
                       f"{1 + self.depth * self.topk} nodes; verify={self.verify} must be in "
                       f"[2, {1 + self.depth * self.topk}]")

  @property
  def is_history(self) -> bool:
    return self.drafter == HISTORY

  @property
  def is_lookup(self) -> bool:
    return self.drafter == LOOKUP

  @property
  def is_combined(self) -> bool:
    return self.drafter == COMBINED

  @property
  def reads_bank(self) -> bool:
    """Whether its program takes the bank of recent responses (it looks drafts up on device)."""
    return self.drafter in (LOOKUP, COMBINED)

  @property
  def needs_drafter(self) -> bool:
    """Whether the arm needs the learned drafter."""
    return self.depth > 0 and self.drafter in (LEARNED, COMBINED)

  @property
  def is_tree(self) -> bool:
    return self.topk > 0

  @property
  def verify_tokens(self) -> int:
    if self.is_tree:
      return self.verify
    return self.depth + 1 if self.depth else 1

  @property
  def draft_slots(self) -> int:
    """Cache slots past the current position that drafting and verifying write."""
    return 1 + self.depth * self.topk if self.is_tree else self.depth + 1


def default_arms(depths=(2, 4, 6)) -> tuple[Arm, ...]:
  return (Arm(OFF),) + tuple(Arm(f"chain{d}", d) for d in depths)


def tree_arm(depth: int, topk: int, verify: int) -> Arm:
  return Arm(f"tree{depth}_{topk}_{verify}", depth, topk, verify)


def history_arm(depth: int) -> Arm:
  return Arm(f"history_chain{depth}", depth, drafter=HISTORY)


def history_tree_arm(depth: int, chains: int) -> Arm:
  return Arm(f"history_tree{depth}_{chains}", depth, chains, 1 + depth * chains, drafter=HISTORY)


def lookup_arm(depth: int) -> Arm:
  return Arm(f"lookup_chain{depth}", depth, drafter=LOOKUP)


def lookup_tree_arm(depth: int, chains: int) -> Arm:
  return Arm(f"lookup_tree{depth}_{chains}", depth, chains, 1 + depth * chains, drafter=LOOKUP)


def combined_arm(depth: int, looked_up: int) -> Arm:
  """The learned drafter's chain of `depth` and `looked_up` looked-up chains, one tree."""
  chains = 1 + looked_up
  return Arm(f"combined_tree{depth}_{looked_up}", depth, chains, 1 + depth * chains,
             drafter=COMBINED)


# The trees of several chains, by name prefix: (constructor, what a name with 0 chains lacks).
CHAIN_TREES = {
    "history_tree": (history_tree_arm, "a history tree needs at least one chain"),
    "lookup_tree": (lookup_tree_arm, "a lookup tree needs at least one chain"),
    "combined_tree": (combined_arm, "the combined tree needs at least one looked-up chain"),
}


def parse_arms(spec: str) -> tuple[Arm, ...]:
  """'chain2,tree6_4_32,history_chain4,lookup_chain4,lookup_tree4_3' -> (off, chain2,
  tree6_4_32, history_chain4, lookup_chain4, lookup_tree4_3): `off` is always an arm.
  history_treeDEPTH_CHAINS / lookup_treeDEPTH_CHAINS: that many distinct chains of DEPTH
  tokens (from the history drafter / looked up on device) as one tree;
  combined_treeDEPTH_CHAINS: the learned drafter's chain and that many looked-up ones."""
  arms = [Arm(OFF)]
  for name in (n.strip() for n in spec.split(",") if n.strip()):
    if re.fullmatch(r"chain\d+", name):
      arms.append(Arm(name, int(name[5:])))
    elif re.fullmatch(r"tree\d+_\d+_\d+", name):
      arms.append(tree_arm(*(int(x) for x in name[4:].split("_"))))
    elif re.fullmatch(r"history_chain\d+", name):
      arms.append(history_arm(int(name[13:])))
    elif re.fullmatch(r"lookup_chain\d+", name):
      arms.append(lookup_arm(int(name[12:])))
    elif tree := re.fullmatch(r"(history_tree|lookup_tree|combined_tree)(\d+)_(\d+)", name):
      make, needs = CHAIN_TREES[tree[1]]
      depth, chains = int(tree[2]), int(tree[3])
      if chains < 1:
        raise ValueError(f"SD arm {name!r}: {needs}")
      arms.append(make(depth, chains))
    elif name != OFF:
      raise ValueError(f"unknown SD arm {name!r}: use chainN, treeDEPTH_TOPK_VERIFY, "
                       "history_chainN, history_treeDEPTH_CHAINS, lookup_chainN, "
                       "lookup_treeDEPTH_CHAINS or combined_treeDEPTH_CHAINS")
  return tuple(arms)


class Tuner:

  def __init__(self, arms: tuple[Arm, ...], buckets: tuple[int, ...], *, epsilon: float = 0.1,
               window: int = 32, max_verify_tokens_per_bucket: int = 1024, seed: int = 0):
    if not any(a.name == OFF for a in arms):
      raise ValueError("the tuner needs the 'off' arm (plain decode) among its arms")
    self.arms = {a.name: a for a in arms}
    self.epsilon, self.window = epsilon, window
    self.allowed = {b: [a.name for a in arms if a.verify_tokens * b <= max_verify_tokens_per_bucket]
                    for b in buckets}
    self.rewards = {b: {a: collections.deque(maxlen=window) for a in self.allowed[b]}
                    for b in buckets}
    # Per arm, the newest sample of a chunk that also timed other work (a prefill before it):
    # the arm's figure only while it has no clean sample.
    self.provisional: dict[int, dict[str, float]] = {b: {} for b in buckets}
    self.rng = np.random.default_rng(seed)

  def _figures(self, bucket: int) -> dict[str, float]:
    """Each tried arm's figure: the median of its clean samples, else its provisional one."""
    out = dict(self.provisional[bucket])
    out.update({a: float(np.median(r)) for a, r in self.rewards[bucket].items() if r})
    return out

  def choose(self, bucket: int) -> Arm:
    figures = self._figures(bucket)
    unseen = [a for a in self.allowed[bucket] if a not in figures]
    if unseen:
      return self.arms[unseen[0]]
    if self.rng.random() < self.epsilon:
      return self.arms[self.allowed[bucket][int(self.rng.integers(len(self.allowed[bucket])))]]
    return self.arms[self.best(bucket)]

  def best(self, bucket: int) -> str:
    figures = self._figures(bucket)
    return max(figures, key=figures.get) if figures else OFF

  def update(self, bucket: int, arm: Arm, tokens: int, seconds: float,
             live: float = 1.0, provisional: bool = False) -> None:
    """A chunk of `arm`: tokens emitted in `seconds` with `live` rows active on average.
    provisional: its seconds also hold other work, so it counts only until a clean sample."""
    if not (seconds > 0 and live > 0):
      return
    reward = tokens / (live * seconds)
    if not provisional:
      self.rewards[bucket][arm.name].append(reward)
      self.provisional[bucket].pop(arm.name, None)
    elif not self.rewards[bucket][arm.name]:
      self.provisional[bucket][arm.name] = reward

  def state_dict(self) -> dict:
    return {"rewards": {str(b): {a: list(r) for a, r in arms.items()}
                        for b, arms in self.rewards.items()},
            "provisional": {str(b): dict(p) for b, p in self.provisional.items()},
            "rng": self.rng.bit_generator.state}

  def load_state_dict(self, state: dict) -> None:
    for b, arms in state["rewards"].items():
      for a, values in arms.items():
        self.rewards[int(b)][a] = collections.deque(values, maxlen=self.window)
    for b, figures in state.get("provisional", {}).items():  # absent: a run from before it
      self.provisional[int(b)] = dict(figures)
    self.rng.bit_generator.state = state["rng"]
