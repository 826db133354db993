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


@pytest.mark.parametrize("key,value,message", [
    ("rl.lr", -1e-3, r"rl.lr=-0.001 must be >= 0"),
    ("rl.max_grad_norm", -1.0, r"rl.max_grad_norm=-1.0 must be > 0"),
    ("rollout.group_size", 1, (r"rollout.group_size=1 with rl.algorithm='grpo' makes every "
                               r"advantage 0")),
    ("lora.alpha", 0.0, r"lora.alpha=0.0 must be > 0"),
    ("eval.samples", 0, r"eval.samples=0 and eval.num_problems=256 must be >= 1"),
    ("lora.targets", (), r"lora.targets=\(\) names no layer"),
    ("tlt.fixed_arm", "chain3", (r"tlt.fixed_arm='chain3' is not one of the arms \['chain2', "
                                 r"'chain4', 'off'\]")),
    ("tlt.arms", "chain2,chian4", r"tlt.arms='chain2,chian4': unknown SD arm 'chian4'"),
    ("compile.workers", -1, r"compile.workers=-1 must be >= 0"),
    ("rl.length_bucket", 0, r"rl.length_bucket=0 must be >= 1"),
])
def test_values_that_change_the_run_s_meaning_are_refused_by_key(key, value, message):
  """Each is one line naming the key; tlt.fixed_arm is checked with tlt.enabled=False too (it
  would be ignored, and the run that turns SD on would fail or decode with another arm)."""
  c = config_lib.default_config()
  section, name = key.split(".")
  c[section][name] = value
  assert not c.tlt.enabled
  with pytest.raises(ValueError, match=f"^invalid config: {message}") as e:
    config_lib.validate(c)
  assert "\n" not in str(e.value)


def test_dead_keys_are_gone():
  """generate.* (tlt_jax/generate.py takes its arguments explicitly) and data.synthetic_eval
  (eval.num_problems sets the held-out problems) did nothing; setting them is now an error."""
  c = config_lib.default_config()
  with pytest.raises(AttributeError, match="generate"):
    c.generate.temperature = 1.0
  with pytest.raises(AttributeError, match="synthetic_eval"):
    c.data.synthetic_eval = 10
