"""Chat templates render exactly as transformers' apply_chat_template renders them."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from tlt_jax.data.chat import PromptFormatter

# Qwen2.5's template, shortened (system default, generation prompt, im_start / im_end tokens).
QWEN_STYLE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA_STYLE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] "
               "{{ m['content'] | trim }}"
               "{% if not loop.last %}\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
               " [ASSISTANT]{% endif %}")


def _tokenizer():
  words = ["<|im_start|>", "<|im_end|>", "<s>", "system", "user", "assistant", "You", "are", "a",
           "helpful", "assistant.", "What", "is", "2+2?", "Be", "brief.", "[USER]", "[SYSTEM]",
           "[ASSISTANT]", "\n", "<unk>"]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<s>"])
  return tok


@pytest.mark.parametrize("template", [QWEN_STYLE, LLAMA_STYLE], ids=["qwen", "llama"])
@pytest.mark.parametrize("system", ["", "Be brief."])
def test_render_matches_transformers(tmp_path, template, system):
  import transformers

  hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), bos_token="<s>",
                                                eos_token="<|im_end|>", unk_token="<unk>")
  hf_tok.chat_template = template
  hf_tok.save_pretrained(str(tmp_path))  # the files a real checkpoint ships
  messages = ([{"role": "system", "content": system}] if system else []) + [
      {"role": "user", "content": "What is 2+2?"}]
  expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  formatter = PromptFormatter.from_hf_dir(str(tmp_path), _tokenizer(), system_prompt=system)
  assert formatter.render("What is 2+2?") == expected
  assert formatter.encode("What is 2+2?") == _tokenizer().encode(
      expected, add_special_tokens=False).ids


def test_no_template_is_the_raw_prompt(tmp_path):
  formatter = PromptFormatter.from_hf_dir(str(tmp_path), _tokenizer())
  assert formatter.render("What is 2+2?") == "What is 2+2?"
  templated = PromptFormatter(_tokenizer(), LLAMA_STYLE)
  assert templated.render("x") == "[USER] x [ASSISTANT]"  # no bos_token given: renders empty


def test_template_errors_surface():
  formatter = PromptFormatter(_tokenizer(), "{{ raise_exception('only user turns') }}")
  with pytest.raises(Exception, match="only user turns"):
    formatter.render("hi")
