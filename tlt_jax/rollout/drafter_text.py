"""The model-free drafters' text across a restart: one file per rollout group.

The history drafter's tries and the lookup arms' bank are built from finished responses. A run
resumed without them drafts from nothing until it has decoded them again, a whole epoch for the
earlier responses to a prompt (the drafts SpecRL and the prompt-aware bank rely on). Output does
not depend on them (verification is exact), only speed does; so `run_state` writes this file
beside the checkpoints, per process (each holds its own groups' text), before the step's
checkpoint starts, and a step whose file is missing still resumes, its drafters empty.

The file is one .npz of int arrays: the distinct responses (`tokens` concatenated, `offsets`),
the distinct prompts (`prompt_tokens`, `prompt_offsets`) and `records` [R, 3]: one row
(kind, prompt index or -1, response index) per entry, each kind in its structure's order:
`HISTORY_GROUP` (a prompt group's earlier responses, groups least recently used first),
`HISTORY_GLOBAL`, `BANK_STORED` and `BANK_RECENT` (oldest first). A response the bank holds in
both its lists is one index, so it stays one response (`ResponseBank.choose` dedups by object).
Size: the tokens held, 4 bytes each (at most `rollout.lookup_history_tokens` plus the history's
bounds).
"""

from __future__ import annotations

import os

import numpy as np

from tlt_jax.rollout.bank import ResponseBank
from tlt_jax.rollout.history import HistoryDrafter

FORMAT_VERSION = 1
HISTORY_GROUP, HISTORY_GLOBAL, BANK_STORED, BANK_RECENT = range(4)


def keeps_text(engine) -> bool:
  """Whether the engine has model-free drafters whose text outlives a rollout."""
  return engine.history is not None or any(a.reads_bank for a in engine.cfg.arms)


class _Table:
  """Distinct sequences by object identity (or by value for prompts), in first-seen order."""

  def __init__(self, by_value: bool):
    self.by_value, self.index, self.items = by_value, {}, []

  def __call__(self, seq) -> int:
    key = tuple(int(t) for t in seq) if self.by_value else id(seq)
    if key not in self.index:
      self.index[key] = len(self.items)
      self.items.append(seq)
    return self.index[key]

  def arrays(self) -> tuple[np.ndarray, np.ndarray]:
    lengths = [len(s) for s in self.items]
    tokens = (np.concatenate([np.asarray(s, np.int32) for s in self.items]) if self.items
              else np.zeros((0,), np.int32))
    return tokens.astype(np.int32), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def spill(history: HistoryDrafter | None, bank: ResponseBank, path: str) -> None:
  """Writes the history's (if any) and the bank's text to `path` (atomically: a killed write
  leaves the previous file or none)."""
  responses, prompts, records = _Table(by_value=False), _Table(by_value=True), []
  if history is not None:
    groups, global_ = history.texts()
    for prompt, texts in groups:
      records += [(HISTORY_GROUP, prompts(prompt), responses(t)) for t in texts]
    records += [(HISTORY_GLOBAL, -1, responses(t)) for t in global_]
  recent, stored = bank.texts()
  records += [(BANK_STORED, prompts(p), responses(t)) for p, t in stored]
  records += [(BANK_RECENT, prompts(p), responses(t)) for p, t in recent]
  tokens, offsets = responses.arrays()
  prompt_tokens, prompt_offsets = prompts.arrays()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    np.savez(f, format_version=np.int64(FORMAT_VERSION), tokens=tokens, offsets=offsets,
             prompt_tokens=prompt_tokens, prompt_offsets=prompt_offsets,
             records=np.asarray(records, np.int64).reshape(-1, 3))
  os.replace(tmp, path)


def restore(history: HistoryDrafter | None, bank: ResponseBank, path: str) -> None:
  """Puts what `spill` wrote into the history (if any) and the bank, in place of what they
  hold."""
  with np.load(path) as f:
    if int(f["format_version"]) != FORMAT_VERSION:
      raise ValueError(f"{path}: drafter text format {int(f['format_version'])}, expected "
                       f"{FORMAT_VERSION}")
    tokens, offsets = f["tokens"], f["offsets"]
    prompt_tokens, prompt_offsets = f["prompt_tokens"], f["prompt_offsets"]
    records = f["records"]
  responses = [tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
  prompts = [tuple(prompt_tokens[prompt_offsets[i]:prompt_offsets[i + 1]].tolist())
             for i in range(len(prompt_offsets) - 1)]
  by_kind: dict[int, list] = {k: [] for k in range(4)}
  for kind, p, r in records.tolist():
    by_kind[kind].append((prompts[p] if p >= 0 else None, responses[r]))
  if history is not None:
    groups: dict[tuple, list] = {}  # insertion order: least recently used first, as written
    for prompt, t in by_kind[HISTORY_GROUP]:
      groups.setdefault(prompt, []).append(t.tolist())
    history.restore(list(groups.items()), [t.tolist() for _, t in by_kind[HISTORY_GLOBAL]])
  bank.restore(by_kind[BANK_RECENT], by_kind[BANK_STORED])
