"""The drafter's training data: a sliding window of recent rollouts, packing into fixed rows
(the loss over them: `tlt.packed_loss`), and a tensorstore (zarr) spill for offline warm-up and
resume.

What one rollout sample gives (`rollout.engine.Sample`): the prompt, the P + N token sequence,
and `hidden[j]` for j < N, the target's last-layer hidden state (after the final norm) whose
logits produced response token j, i.e. h at sequence position P - 1 + j. The drafter at
position t reads (x_t, h_{t-1}) and predicts h_t, so in sequence positions:

  target at t     = h_t     = hidden[t - P + 1]   known for P - 1 <= t <= L - 2
  feature in at t = h_{t-1} = hidden[t - P]       known for P     <= t <= L - 1

The loss is on P <= t <= L - 2, where both exist (N - 1 positions). Position P - 1 (response
token j = 0) would need h_{P-2}, a prompt hidden state the engine does not return; feeding zeros
there would teach the drafter an input it never sees at decode time, so it is left out. Prompt
positions stay in the row as attention context, with zero input features (as `eagle_loss` does
at a row's start): the drafter sees the prompt's tokens but not its features.

A document longer than `row_len` is cut into consecutive windows of `row_len` tokens (the last
one shorter), each its own segment. Each window keeps its true positions and its true input
features (h_{t0-1} at a window starting at t0), so every loss position is trained exactly once;
what a window loses is attention to the windows before it. Left truncation would instead throw
away the early part of exactly the long responses the drafter is for.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Iterable, NamedTuple, Sequence

import jax
import numpy as np
import tensorstore as ts

from tlt_jax.rollout.engine import Sample

SPILL_FORMAT = "tlt-jax-drafter-buffer"
SPILL_VERSION = 1
_INDEX = "index.json"


@dataclasses.dataclass(frozen=True)
class Example:
  """One rollout sample as the drafter trains on it.

  `hidden` is the engine's on-device array ([max_new_tokens, D], rows [:response_len] valid) or,
  after `DrafterBuffer.load`, a host array of exactly the valid rows."""
  step: int
  sample_id: int
  tokens: np.ndarray          # [L] int32: prompt + response
  response_mask: np.ndarray   # [L] bool: False on the prompt, True on the response
  hidden: jax.Array | np.ndarray

  @property
  def response_len(self) -> int:
    return int(self.response_mask.sum())

  @property
  def prompt_len(self) -> int:
    return len(self.tokens) - self.response_len

  @property
  def num_loss_positions(self) -> int:
    return max(self.response_len - 1, 0)


def _check_example(ex: Example) -> None:
  L, P, N = len(ex.tokens), ex.prompt_len, ex.response_len
  if ex.tokens.shape != (L,) or ex.response_mask.shape != (L,):
    raise ValueError(f"tokens {ex.tokens.shape} and response_mask {ex.response_mask.shape} must "
                     "be 1-D of one length")
  if P < 1 or ex.response_mask[:P].any():
    raise ValueError(f"sample {ex.sample_id}: need a non-empty prompt followed by the response")
  if len(ex.hidden.shape) != 2 or ex.hidden.shape[0] < N:
    raise ValueError(f"sample {ex.sample_id}: hidden {tuple(ex.hidden.shape)} must be "
                     f"[>= {N} response tokens, D]")


class DrafterBuffer:
  """The last `window_steps` RL steps of rollouts (a step s is kept while s > latest -
  window_steps: staleness is counted in policy updates, not in how often `add` was called),
  capped at `max_tokens` sequence tokens (prompt + response, what packing lays out), oldest
  examples dropped first. Hidden states stay where the engine put them: nothing here copies
  them to the host until `pack` or `spill`, which run off the rollout path."""

  def __init__(self, window_steps: int, max_tokens: int | None = None):
    if window_steps < 1:
      raise ValueError(f"window_steps must be >= 1, got {window_steps}")
    if max_tokens is not None and max_tokens < 1:
      raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
    self.window_steps = window_steps
    self.max_tokens = max_tokens
    self._by_step: dict[int, collections.deque[Example]] = {}
    self._latest: int | None = None
    self._num_tokens = 0
    self._hidden_kind: tuple[int, np.dtype] | None = None  # (D, dtype), one for all examples

  def add(self, step: int, samples: Sequence[Sample]) -> None:
    exs = []
    for s in samples:
      prompt = np.asarray(s.prompt, np.int32)
      response = np.asarray(s.tokens, np.int32)
      mask = np.concatenate([np.zeros(len(prompt), bool), np.ones(len(response), bool)])
      exs.append(Example(step, int(s.sample_id), np.concatenate([prompt, response]), mask,
                         s.hidden))
    self._insert(step, exs)

  def _insert(self, step: int, examples: Iterable[Example]) -> None:
    examples, known = list(examples), self._hidden_kind
    for ex in examples:  # all checked before any is stored
      _check_example(ex)
      kind = (ex.hidden.shape[1], np.dtype(ex.hidden.dtype))
      if (known or kind) != kind:
        raise ValueError(f"hidden [., {kind[0]}] {kind[1]} != the buffer's "
                         f"[., {known[0]}] {known[1]}")
      known = kind
    self._hidden_kind = known
    for ex in examples:
      self._by_step.setdefault(step, collections.deque()).append(ex)
      self._num_tokens += len(ex.tokens)
    self._latest = step if self._latest is None else max(self._latest, step)
    self._trim()

  def _trim(self) -> None:
    for s in sorted(self._by_step):
      if s <= self._latest - self.window_steps:
        self._num_tokens -= sum(len(e.tokens) for e in self._by_step.pop(s))
    while self.max_tokens is not None and self._num_tokens > self.max_tokens:
      oldest = min(self._by_step)
      self._num_tokens -= len(self._by_step[oldest].popleft().tokens)
      if not self._by_step[oldest]:
        del self._by_step[oldest]

  def __len__(self) -> int:
    return sum(len(d) for d in self._by_step.values())

  @property
  def num_tokens(self) -> int:
    return self._num_tokens

  def steps(self) -> list[int]:
    return sorted(self._by_step)

  def examples(self) -> list[Example]:
    """Oldest step first; within a step, in the order added."""
    return [e for s in self.steps() for e in self._by_step[s]]

  def pack(self, rows: int, row_len: int, *, seed: int | None = None) -> PackedBatch:
    return pack(self.examples(), rows, row_len, seed=seed)

  def batches(self, rows: int, row_len: int, *, seed: int | None = None) -> list[PackedBatch]:
    return pack_all(self.examples(), rows, row_len, seed=seed)

  # -- spill / load ------------------------------------------------------------------------

  def spill(self, directory: str) -> None:
    """Writes the window as ragged zarr arrays (concatenated + offsets) and `index.json`.

    Only the valid hidden rows are written. The index goes last (atomic rename) and an old one
    is removed first, so an interrupted spill leaves no index rather than a mixed one."""
    exs = self.examples()
    os.makedirs(directory, exist_ok=True)
    index_path = os.path.join(directory, _INDEX)
    if os.path.exists(index_path):
      os.remove(index_path)
    hidden = _host_hidden(exs)
    D = exs[0].hidden.shape[1] if exs else 0
    hidden_dtype = np.dtype(hidden[0].dtype) if exs else np.dtype(np.float32)
    arrays = {
        "tokens": _concat([e.tokens for e in exs], np.int32),
        "response_mask": _concat([e.response_mask for e in exs], bool),
        "token_offsets": _offsets([len(e.tokens) for e in exs]),
        "hidden": (np.concatenate(hidden) if exs else np.zeros((0, D), hidden_dtype)),
        "hidden_offsets": _offsets([e.response_len for e in exs]),
        "steps": np.asarray([e.step for e in exs], np.int64),
        "sample_ids": np.asarray([e.sample_id for e in exs], np.int64),
    }
    writes = [_open_zarr(os.path.join(directory, name), arr).write(arr)
              for name, arr in arrays.items()]
    for w in writes:
      w.result()
    index = {"format": SPILL_FORMAT, "version": SPILL_VERSION, "window_steps": self.window_steps,
             "max_tokens": self.max_tokens, "latest_step": self._latest,
             "num_examples": len(exs), "hidden_size": D, "hidden_dtype": hidden_dtype.name,
             "arrays": {name: {"dtype": np.dtype(a.dtype).name, "shape": list(a.shape)}
                        for name, a in arrays.items()}}
    with open(index_path + ".tmp", "w") as f:
      json.dump(index, f, indent=1)
    os.replace(index_path + ".tmp", index_path)

  @staticmethod
  def is_spill(directory: str) -> bool:
    """Whether `directory` holds a whole spill (its index is written last)."""
    return os.path.exists(os.path.join(directory, _INDEX))

  @classmethod
  def load(cls, directory: str, window_steps: int | None = None,
           max_tokens: int | None = None) -> DrafterBuffer:
    """The spilled buffer, bitwise (hidden states come back as host arrays of the valid rows).
    A smaller window or cap than the spilled one trims as `add` would."""
    index_path = os.path.join(directory, _INDEX)
    if not os.path.exists(index_path):
      raise FileNotFoundError(f"{index_path}: not a drafter buffer spill (or an interrupted one)")
    with open(index_path) as f:
      index = json.load(f)
    if index.get("format") != SPILL_FORMAT or index.get("version") != SPILL_VERSION:
      raise ValueError(f"{index_path}: format {index.get('format')!r} v{index.get('version')}, "
                       f"expected {SPILL_FORMAT!r} v{SPILL_VERSION}")
    reads = {name: ts.open(_zarr_spec(os.path.join(directory, name))).result().read()
             for name in index["arrays"]}
    a = {name: r.result() for name, r in reads.items()}
    for name, meta in index["arrays"].items():
      if a[name].dtype.name != meta["dtype"] or list(a[name].shape) != meta["shape"]:
        raise ValueError(f"{directory}/{name}: {a[name].dtype}{list(a[name].shape)} != index "
                         f"{meta['dtype']}{meta['shape']}")
    buf = cls(index["window_steps"] if window_steps is None else window_steps,
              index["max_tokens"] if max_tokens is None else max_tokens)
    buf._latest = index["latest_step"]  # the window counts from the newest step ever added
    to, ho = a["token_offsets"], a["hidden_offsets"]
    by_step: dict[int, list[Example]] = {}
    for i in range(index["num_examples"]):
      step = int(a["steps"][i])
      by_step.setdefault(step, []).append(Example(
          step, int(a["sample_ids"][i]), a["tokens"][to[i]:to[i + 1]],
          a["response_mask"][to[i]:to[i + 1]], a["hidden"][ho[i]:ho[i + 1]]))
    for step in sorted(by_step):
      buf._insert(step, by_step[step])
    return buf


def _concat(parts: list[np.ndarray], dtype) -> np.ndarray:
  return np.concatenate(parts).astype(dtype) if parts else np.zeros((0,), dtype)


def _offsets(lengths: list[int]) -> np.ndarray:
  return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def _zarr_spec(path: str) -> dict:
  return {"driver": "zarr", "kvstore": {"driver": "file", "path": path}}


def _open_zarr(path: str, arr: np.ndarray):
  # tensorstore's zarr (v2) driver takes "bfloat16" as a dtype of its own (an extension other
  # zarr readers may not know); ml_dtypes' numpy bfloat16 arrays write and read back as is.
  return ts.open(_zarr_spec(path), create=True, delete_existing=True,
                 dtype=ts.dtype(np.dtype(arr.dtype).name), shape=arr.shape).result()


def _host_hidden(examples: Sequence[Example]) -> list[np.ndarray]:
  """Valid hidden rows of each example on the host, fetched in one transfer."""
  host = jax.device_get([e.hidden for e in examples])
  return [np.asarray(h)[:e.response_len] for h, e in zip(host, examples)]


# ---------------------------------------------------------------------------------------------
# Packing


class PackedBatch(NamedTuple):
  """Documents packed into `rows` rows of `row_len` tokens (host arrays; a pytree)."""
  tokens_BxT: np.ndarray           # int32
  features_in_BxTxD: np.ndarray    # h_{t-1}, the hidden dtype; zeros where unknown
  target_hidden_BxTxD: np.ndarray  # h_t, the hidden dtype; zeros where unknown
  loss_mask_BxT: np.ndarray        # bool
  positions_BxT: np.ndarray        # int32: the token's position in its own sequence
  segment_ids_BxT: np.ndarray      # int32: 1 + the example's index in `examples`; 0 = padding


class _Piece(NamedTuple):
  example: int
  start: int  # window [start, stop) of the example's sequence
  stop: int


def _pieces(examples: Sequence[Example], order: Sequence[int], row_len: int) -> list[_Piece]:
  """Windows of `row_len` tokens per document, in `order`; windows without a loss position
  (a prompt longer than a row, a one-token response) would only take room and are left out."""
  pieces = []
  for i in order:
    ex = examples[i]
    lo, hi = ex.prompt_len, len(ex.tokens) - 1  # loss positions: lo <= t < hi
    for start in range(0, len(ex.tokens), row_len):
      stop = min(start + row_len, len(ex.tokens))
      if max(start, lo) < min(stop, hi):
        pieces.append(_Piece(i, start, stop))
  return pieces


def _first_fit(pieces: Sequence[_Piece], row_len: int) -> list[list[_Piece]]:
  """Each piece goes to the first row with room that holds no other window of its document
  (one segment id per document must never span two windows in a row)."""
  rows: list[list[_Piece]] = []
  fill: list[int] = []
  for p in pieces:
    n = p.stop - p.start
    for r, row in enumerate(rows):
      if fill[r] + n <= row_len and all(q.example != p.example for q in row):
        row.append(p)
        fill[r] += n
        break
    else:
      rows.append([p])
      fill.append(n)
  return rows


def _fill(examples: Sequence[Example], host_hidden: dict[int, np.ndarray],
          rows: list[list[_Piece]], num_rows: int, row_len: int) -> PackedBatch:
  D = examples[0].hidden.shape[1]
  dtype = next(iter(host_hidden.values())).dtype
  B, T = num_rows, row_len
  tokens = np.zeros((B, T), np.int32)
  positions = np.zeros((B, T), np.int32)
  segments = np.zeros((B, T), np.int32)
  loss = np.zeros((B, T), bool)
  feat_in = np.zeros((B, T, D), dtype)
  target = np.zeros((B, T, D), dtype)
  for b, row in enumerate(rows):
    col = 0
    for p in row:
      ex, h = examples[p.example], host_hidden[p.example]
      P, L = ex.prompt_len, len(ex.tokens)
      t = np.arange(p.start, p.stop)
      c = slice(col, col + len(t))
      tokens[b, c] = ex.tokens[p.start:p.stop]
      positions[b, c] = t
      segments[b, c] = p.example + 1
      loss[b, c] = (t >= P) & (t <= L - 2)
      has_in, has_target = t >= P, (t >= P - 1) & (t <= L - 2)
      feat_in[b, col + np.nonzero(has_in)[0]] = h[t[has_in] - P]
      target[b, col + np.nonzero(has_target)[0]] = h[t[has_target] - P + 1]
      col += len(t)
  return PackedBatch(tokens, feat_in, target, loss, positions, segments)


def pack_all(examples: Sequence[Example], rows: int, row_len: int, *,
             seed: int | None = None) -> list[PackedBatch]:
  """Every loss position of `examples` exactly once, first-fit into batches of `rows` x
  `row_len`. Documents go in the given order, or in a permutation drawn from `seed`; the result
  is a function of (examples, rows, row_len, seed) only."""
  if rows < 1 or row_len < 2:
    raise ValueError(f"need rows >= 1 and row_len >= 2, got {rows} x {row_len}")
  if not examples:
    raise ValueError("nothing to pack")
  order = (range(len(examples)) if seed is None
           else np.random.default_rng(seed).permutation(len(examples)).tolist())
  placed = _first_fit(_pieces(examples, order, row_len), row_len)
  used = sorted({p.example for row in placed for p in row})
  host = dict(zip(used, _host_hidden([examples[i] for i in used])))
  if not host:
    raise ValueError("no example has a loss position (each needs >= 2 response tokens)")
  return [_fill(examples, host, placed[i:i + rows], rows, row_len)
          for i in range(0, len(placed), rows)]


def pack(examples: Sequence[Example], rows: int, row_len: int, *,
         seed: int | None = None) -> PackedBatch:
  """One batch: the first `rows` rows of `pack_all` (first-fit into the first k rows does not
  depend on later rows), i.e. what fits; the rest is left out."""
  return pack_all(examples, rows, row_len, seed=seed)[0]
