"""A prompt longer than rollout.max_prompt_len, once rendered and tokenized, stops the run at load
naming its file and line (or is skipped and counted), before any step."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from tlt_jax.data.chat import PromptFormatter
from tlt_jax.data.prompt_lengths import fit_prompts
from tlt_jax.data.sources import DataError, read_rows

TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
            "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant{% endif %}")


def _formatter():
  words = ["<|im_start|>", "<|im_end|>", "user", "assistant", "one", "two", "three", "<unk>"]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  return PromptFormatter(tok, TEMPLATE)


def _rows(tmp_path):
  path = tmp_path / "train.jsonl"
  prompts = ["one", "one two three", "one two three one two three", "two"]
  path.write_text("".join(json.dumps({"question": p, "answer": "1"}) + "\n" for p in prompts))
  return str(path), read_rows(str(path)).rows


def test_a_too_long_prompt_names_its_file_and_line(tmp_path):
  path, rows = _rows(tmp_path)
  fmt = _formatter()
  # Template overhead: <|im_start|> user ... <|im_end|> <|im_start|> assistant = 5 tokens.
  assert [len(fmt.encode(r["prompt"])) for r in rows] == [6, 8, 11, 6]
  kept, skipped = fit_prompts(rows, fmt.encode, 11)
  assert kept == rows and skipped == []
  with pytest.raises(DataError, match=rf"^{path}:3: the prompt is 11 tokens after the chat "
                                      r"template, longer than rollout.max_prompt_len=10$"):
    fit_prompts(rows, fmt.encode, 10)


def test_too_long_prompts_are_skipped_and_counted(tmp_path):
  path, rows = _rows(tmp_path)
  kept, skipped = fit_prompts(rows, _formatter().encode, 7, on_error="skip")
  assert [r["prompt"] for r in kept] == ["one", "two"]
  assert [s.split(": ")[0] for s in skipped] == [f"{path}:2", f"{path}:3"]
  with pytest.raises(ValueError, match="on_error='ignore'"):
    fit_prompts(rows, _formatter().encode, 7, on_error="ignore")
