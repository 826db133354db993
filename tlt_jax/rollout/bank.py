"""The lookup arms' bank: the finished responses a decode chunk drafts from besides its rows.

A lookup round (`rollout.steps._lookup_drafts`) searches the bucket's rows and a bank of H
responses. Which H matters most when a prompt comes back: its earlier responses are complete,
so they are ahead of every row decoding it now, where its siblings decode in lockstep beside it
and rarely are. SpecRL drafts from exactly these. So the bank a chunk gets holds, first, the
earlier responses to the prompts live in its bucket (newest first, the prompts taking turns),
then the newest finished responses of any prompt. On bench_tlt's trajectory with 16 training
problems revisited every other step, this raises lookup_chain8's accept length from 2.41 (the
newest 16 only) to 3.57 (BENCHMARKS.md, "Revisited prompts").

Memory: the newest H responses, plus at most `history_tokens` tokens of earlier responses
(oldest evicted first; per prompt only the newest H, as no bank holds more). Building a bank is
O(H * max_new) on the host; it is put on the devices only when the bucket's prompts or the
stored responses changed since the last chunk.
"""

from __future__ import annotations

import collections
from typing import Iterable

import jax
import numpy as np


class ResponseBank:

  def __init__(self, size: int, max_new_tokens: int, history_tokens: int = 0):
    """size: H, the responses one bank holds; history_tokens: how many tokens of earlier
    responses it keeps, all prompts together (0 = the bank is always the newest H responses)."""
    if size < 0 or history_tokens < 0:
      raise ValueError(f"bank size and history_tokens must be >= 0, got {size}, {history_tokens}")
    self.size, self.max_new, self.history_tokens = size, max_new_tokens, history_tokens
    self.recent: collections.deque = collections.deque(maxlen=size)  # (prompt, tokens)
    self.by_prompt: dict[tuple, collections.deque] = {}  # prompt -> serials, oldest first
    self._stored: collections.OrderedDict = collections.OrderedDict()  # serial -> tokens
    self._serial = 0
    self.stored_tokens = 0
    self._version = 0
    self._on_device: tuple[object, tuple] | None = None  # (key, device arrays)

  def add(self, prompt, tokens: np.ndarray) -> None:
    """Records a finished response to `prompt` (its tokens, at most max_new_tokens of them)."""
    if not self.size:
      return
    prompt, tokens = tuple(int(t) for t in prompt), np.asarray(tokens, np.int32)
    self.recent.append((prompt, tokens))
    self._version += 1
    self._store(prompt, tokens)

  def _store(self, prompt: tuple, tokens: np.ndarray) -> None:
    """Keeps an earlier response to `prompt`, evicting the oldest beyond the bounds."""
    if not self.history_tokens or len(tokens) > self.history_tokens:
      return
    self._serial += 1
    self.by_prompt.setdefault(prompt, collections.deque()).append(self._serial)
    self._stored[self._serial] = (prompt, tokens)
    self.stored_tokens += len(tokens)
    if len(self.by_prompt[prompt]) > self.size:  # a bank never holds more of one prompt
      self._forget(self.by_prompt[prompt][0])
    while self.stored_tokens > self.history_tokens:
      self._forget(next(iter(self._stored)))

  def _forget(self, serial: int) -> None:
    """Drops a stored response: the oldest of its prompt's."""
    prompt, tokens = self._stored.pop(serial)
    self.stored_tokens -= len(tokens)
    mine = self.by_prompt[prompt]
    mine.popleft()
    if not mine:
      del self.by_prompt[prompt]

  def holds(self, prompt) -> int:
    """How many earlier responses to `prompt` this bank can draft from."""
    return len(self.by_prompt.get(tuple(int(t) for t in prompt), ()))

  def clear(self) -> None:
    self.__init__(self.size, self.max_new, self.history_tokens)

  def texts(self) -> tuple[list, list]:
    """What the bank holds, to restore it after a restart: (recent, stored), each a list of
    (prompt, tokens) oldest first; an entry in both is the same array object in both."""
    return list(self.recent), list(self._stored.values())

  def restore(self, recent: list, stored: list) -> None:
    """Holds exactly what `texts` gave (pairs whose tokens are one object stay one response)."""
    self.clear()
    if not self.size:
      return
    for prompt, tokens in stored:
      self._store(tuple(int(t) for t in prompt), tokens)
    self.recent.extend((tuple(int(t) for t in p), tokens) for p, tokens in recent)
    self._version += 1

  def choose(self, prompts: Iterable[tuple]) -> list[np.ndarray]:
    """The bank for a bucket whose live rows decode `prompts`: their earlier responses, newest
    first, one per prompt in turn, then the newest responses of any prompt not chosen yet."""
    per_prompt = [[self._stored[i][1] for i in reversed(self.by_prompt.get(p, ()))]
                  for p in dict.fromkeys(prompts)]
    chosen: list[np.ndarray] = []
    for k in range(max((len(x) for x in per_prompt), default=0)):
      chosen += [x[k] for x in per_prompt if k < len(x)]
    chosen = chosen[:self.size]
    taken = {id(x) for x in chosen}
    for _, tokens in reversed(self.recent):
      if len(chosen) == self.size:
        break
      if id(tokens) not in taken:
        chosen.append(tokens)
    return chosen

  def arrays(self, prompts: Iterable[tuple], placement=None) -> tuple[jax.Array, jax.Array]:
    """The bank as the lookup programs take it, on the devices: tokens [H, N] (0-padded) and
    lengths [H] (0 = empty entry)."""
    prompts = tuple(dict.fromkeys(prompts)) if self.history_tokens else ()
    key = (self._version, prompts)
    if self._on_device is None or self._on_device[0] != key:
      tokens_HxN = np.zeros((self.size, self.max_new), np.int32)
      len_H = np.zeros((self.size,), np.int32)
      for i, tokens in enumerate(self.choose(prompts)):
        n = min(len(tokens), self.max_new)
        tokens_HxN[i, :n], len_H[i] = tokens[:n], n
      bank = (tokens_HxN, len_H)
      self._on_device = (key, jax.device_put(bank, placement) if placement is not None
                         else jax.device_put(bank))
    return self._on_device[1]
