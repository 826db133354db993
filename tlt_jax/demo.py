"""Generation demo: `python -m tlt_jax.demo [--hf_dir DIR] [--max_new_tokens N] [--numerics M]`.

Without --hf_dir it builds a tiny random Qwen3-style model, saves it as an HF checkpoint, loads it
back through the HF loader and generates greedily and with sampling (KV cache)."""

from __future__ import annotations

import argparse
import tempfile
import time

from flax import nnx

from tlt_jax import config as config_lib
from tlt_jax import determinism, ops
from tlt_jax.generate import generate
from tlt_jax.model import hf
from tlt_jax.model.transformer import Transformer


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--hf_dir", default="")
  parser.add_argument("--max_new_tokens", type=int, default=24)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--numerics", default="xla", choices=ops.NUMERICS_MODES)
  args = parser.parse_args()
  determinism.configure(args.numerics)  # before the first JAX computation
  ops.set_numerics(args.numerics)
  if args.hf_dir:
    model = hf.load_model(args.hf_dir)
  else:
    cfg = config_lib.model_config(config_lib.default_config())
    with tempfile.TemporaryDirectory() as d:
      hf.save_model(Transformer(cfg, nnx.Rngs(args.seed)), d)
      model = hf.load_model(d)
  c = model.cfg
  print(f"model: {c.arch}, {c.num_layers} layers, d={c.hidden_size}, vocab={c.vocab_size}, "
        f"numerics={ops.numerics()} ({ops.backend()})")
  prompts = [[1, 2, 3, 4], [5, 6, 7], [8]]
  for temperature in (0.0, 1.0):
    start = time.perf_counter()
    tokens = generate(model, prompts, args.max_new_tokens, temperature=temperature, seed=args.seed)
    took = time.perf_counter() - start
    print(f"temperature={temperature} ({took:.2f}s incl. compile)")
    for p, t in zip(prompts, tokens):
      print(f"  {p} -> {t.tolist()}")


if __name__ == "__main__":
  main()
