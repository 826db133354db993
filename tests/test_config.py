import pytest
from ml_collections import config_flags  # noqa: F401  (the CLI path the configs are made for)

from tlt_jax import config as config_lib
from tlt_jax.model.transformer import ModelConfig


def test_unknown_key_is_refused_by_name():
  c = config_lib.default_config()
  with pytest.raises(AttributeError, match="hiden_size"):
    c.model.hiden_size = 3
  with pytest.raises(AttributeError, match="numerix"):
    c.numerix = "xla"


def test_bad_head_counts():
  c = config_lib.default_config()
  c.model.num_heads, c.model.num_kv_heads = 4, 3
  with pytest.raises(ValueError, match="num_heads=4 is not a multiple of model.num_kv_heads=3"):
    config_lib.model_config(c)
  with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
    ModelConfig(arch="llama", vocab_size=8, hidden_size=24, intermediate_size=8, num_layers=1,
                num_heads=6, num_kv_heads=4, head_dim=4)


def test_bad_values_are_named():
  c = config_lib.default_config()
  c.numerics = "fast"
  with pytest.raises(ValueError, match="numerics='fast'"):
    config_lib.validate(c)
  with pytest.raises(ValueError, match="arch='gpt2'"):
    ModelConfig(arch="gpt2", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                num_heads=2, num_kv_heads=2, head_dim=4)


def test_default_builds_a_model_config():
  cfg = config_lib.model_config(config_lib.default_config())
  assert cfg.arch == "qwen3" and cfg.qk_norm
