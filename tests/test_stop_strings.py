"""rollout.stop_strings: checked against the tokenizer and the chat template's end marker."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from tlt_jax.config import default_config, validate
from tlt_jax.data.chat import PromptFormatter
from tlt_jax.data.stop_strings import check_stop_strings, detokenizer, turn_end_marker

QWEN_STYLE = ("{%- for message in messages %}"
              "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
              "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
              "{%- endif %}")


def _tokenizer():
  words = ["Answer", ":", "done", "\n", "user", "assistant", "tlt", "stop", "probe", "<unk>"]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
  return tok


def test_template_end_marker_and_notes():
  tok = _tokenizer()
  formatter = PromptFormatter(tok, QWEN_STYLE)
  assert turn_end_marker(formatter) == "<|im_end|>"
  assert turn_end_marker(PromptFormatter(tok, None)) is None
  endoftext = tok.token_to_id("<|endoftext|>")
  stops, notes = check_stop_strings((), tok, formatter, (endoftext,))
  assert stops == () and "<|im_end|>" in notes[0]  # the model could write past its turn
  stops, notes = check_stop_strings(("<|im_end|>", "done"), tok, formatter, (endoftext,))
  assert stops == ("<|im_end|>", "done") and notes == []
  # A special token is matched in the engine's decoded text because detokenize keeps it.
  assert "<|im_end|>" in detokenizer(tok)([tok.token_to_id("done"), tok.token_to_id("<|im_end|>")])


def test_stop_strings_that_cannot_work_are_named():
  tok = _tokenizer()
  formatter = PromptFormatter(tok, QWEN_STYLE)
  im_end = tok.token_to_id("<|im_end|>")
  with pytest.raises(ValueError, match="is the EOS token"):
    check_stop_strings(("<|im_end|>",), tok, formatter, (im_end,))
  with pytest.raises(ValueError, match="does not survive the tokenizer"):
    check_stop_strings(("Zebra",), tok, formatter, (im_end,))  # unknown to the vocabulary


def test_config_key_is_validated():
  c = default_config()
  assert tuple(c.rollout.stop_strings) == ()
  c.rollout.stop_strings = ("</answer>",)
  validate(c)
  c.rollout.stop_strings = ("",)
  with pytest.raises(ValueError, match="rollout.stop_strings"):
    validate(c)
