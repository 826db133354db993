"""Prompts that do not fit `rollout.max_prompt_len`, found at load rather than mid-run.

A prompt is only measured once it is rendered (chat template, system prompt) and tokenized, so
this check needs the run's formatter and runs in the run's setup, over every train and eval row,
before any step: a too-long row then stops the run naming its file and line (or is skipped and
counted, `data.on_error="skip"`) instead of failing in the rollout of whichever step draws it.
"""

from __future__ import annotations

from collections.abc import Callable

from tlt_jax.data.sources import DataError


def fit_prompts(rows: list[dict], encode: Callable[[str], list[int]], max_prompt_len: int,
                on_error: str = "raise") -> tuple[list[dict], list[str]]:
  """(the rows whose encoded prompt has at most `max_prompt_len` tokens, "where: reason" for
  each row skipped). With on_error="raise" the first row too long raises DataError naming its
  source (file:line, from `sources.read_rows`) and the lengths."""
  if on_error not in ("raise", "skip"):
    raise ValueError(f"on_error={on_error!r} must be 'raise' or 'skip'")
  kept, skipped = [], []
  for i, row in enumerate(rows):
    n = len(encode(row["prompt"]))
    if n <= max_prompt_len:
      kept.append(row)
      continue
    problem = (f"{row.get('source') or f'row {i}'}: the prompt is {n} tokens after the chat "
               f"template, longer than rollout.max_prompt_len={max_prompt_len}")
    if on_error == "raise":
      raise DataError(problem)
    skipped.append(problem)
  return kept, skipped
