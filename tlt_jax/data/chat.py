"""Prompts through the tokenizer's own chat template (`chat_template` in tokenizer_config.json, or
chat_template.jinja next to it).

Rendered with Jinja2 the way transformers' `apply_chat_template` renders it (sandboxed
environment, trim_blocks / lstrip_blocks, `raise_exception`, `add_generation_prompt`, the
special tokens as variables), so a Qwen or Llama checkpoint sees the prompt format it was
tuned on. A model without a template gets the raw prompt text.
"""

from __future__ import annotations

import json
import os

import jinja2
import jinja2.ext
from jinja2 import sandbox


def _raise(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _token_text(value) -> str:
  """tokenizer_config.json stores special tokens as text or as {"content": text, ...}."""
  if isinstance(value, dict):
    return value.get("content", "")
  return value or ""


class PromptFormatter:

  def __init__(self, tokenizer, chat_template: str | None = None, *, system_prompt: str = "",
               special_tokens: dict[str, str] | None = None):
    self.tokenizer = tokenizer
    self.system_prompt = system_prompt
    self.special_tokens = dict(special_tokens or {})
    self._template = None
    if chat_template:
      env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                  extensions=[jinja2.ext.loopcontrols])
      env.filters["tojson"] = _tojson
      env.globals["raise_exception"] = _raise
      self._template = env.from_string(chat_template)

  @classmethod
  def from_hf_dir(cls, model_dir: str, tokenizer, *, system_prompt: str = "",
                  use_chat_template: bool = True) -> "PromptFormatter":
    path = os.path.join(model_dir, "tokenizer_config.json")
    config = {}
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        config = json.load(f)
    template = config.get("chat_template")
    jinja_path = os.path.join(model_dir, "chat_template.jinja")  # where transformers 5 saves it
    if template is None and os.path.exists(jinja_path):
      with open(jinja_path, encoding="utf-8") as f:
        template = f.read()
    if isinstance(template, list):  # several named templates: the default one
      template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not use_chat_template:
      template = None
    specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token",
                                                        "unk_token") if config.get(k)}
    return cls(tokenizer, template, system_prompt=system_prompt, special_tokens=specials)

  def messages(self, prompt: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
    return msgs + [{"role": "user", "content": prompt}]

  def render(self, prompt: str) -> str:
    if self._template is None:
      return prompt
    return self._template.render(messages=self.messages(prompt), add_generation_prompt=True,
                                 **self.special_tokens)

  def encode(self, prompt: str) -> list[int]:
    # The template writes special tokens as text; the tokenizer maps them back to their ids.
    return self.tokenizer.encode(self.render(prompt), add_special_tokens=False).ids
