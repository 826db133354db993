"""`rollout.stop_strings`, checked against the tokenizer and the chat template before a run.

The engine (tlt_jax/rollout/engine.py) ends a sample when a stop string appears in its decoded
text, so a stop string must be text the tokenizer can produce and decode back (special tokens
kept: `detokenize`). A stop string that is an EOS token is refused: generation already ends there.
The chat template's end-of-turn marker (the special token that closes a user turn, e.g. Qwen's
`<|im_end|>`) is reported when it is neither an EOS token nor a stop string: the model may then
write past its own turn.
"""

from __future__ import annotations

import logging

_PROBE = "tlt stop probe"


def detokenizer(tokenizer):
  """The engine's detokenize: special tokens kept, so end markers written as text can match."""
  return lambda ids: tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def turn_end_marker(formatter) -> str | None:
  """The special token the chat template writes right after a user's message, if any."""
  rendered = formatter.render(_PROBE)
  after = rendered[rendered.find(_PROBE) + len(_PROBE):] if _PROBE in rendered else ""
  specials = [t.content for t in formatter.tokenizer.get_added_tokens_decoder().values()
              if t.special]
  for token in sorted(specials, key=len, reverse=True):
    if after.startswith(token):
      return token
  return None


def check_stop_strings(stop_strings, tokenizer, formatter, eos_ids) -> tuple[tuple[str, ...],
                                                                             list[str]]:
  """(the stop strings as the engine takes them, notes for the log); ValueError names the
  `rollout.stop_strings` entry that cannot work."""
  stops = tuple(stop_strings)
  eos_text = {tokenizer.id_to_token(int(i)): int(i) for i in eos_ids}
  decode = detokenizer(tokenizer)
  for s in stops:
    if not isinstance(s, str) or not s:
      raise ValueError(f"rollout.stop_strings: {s!r} must be non-empty text")
    if s in eos_text:
      raise ValueError(f"rollout.stop_strings: {s!r} is the EOS token (id {eos_text[s]}): "
                       "generation already ends there; remove it")
    if s not in decode(tokenizer.encode(s, add_special_tokens=False).ids):
      raise ValueError(f"rollout.stop_strings: {s!r} does not survive the tokenizer's "
                       "encode/decode, so decoded samples can never contain it")
  notes = []
  marker = turn_end_marker(formatter)
  if marker is not None and marker not in eos_text and marker not in stops:
    notes.append(f"the chat template ends turns with {marker!r}, which is neither an EOS token "
                 f"nor in rollout.stop_strings: samples may run past their turn (add it)")
  return stops, notes


def engine_detokenize(c, tokenizer, formatter, eos_ids):
  """For build_rollout: checks `c.rollout.stop_strings` (logging the notes) and returns the
  engine's detokenize when there are any, else None."""
  _, notes = check_stop_strings(c.rollout.stop_strings, tokenizer, formatter, eos_ids)
  for note in notes:
    logging.warning("rollout.stop_strings: %s", note)
  return detokenizer(tokenizer) if c.rollout.stop_strings else None
