"""Pretrains the embedded default model: a small Qwen3-style decoder on the synthetic addition task.

    python -m experiments.pretrain_tiny [--out experiments/assets/tiny_arith] [--steps 3000]

Writes an HF checkpoint directory (config.json, model.safetensors, a character-level
tokenizer.json, tokenizer_config.json with the chat template) plus pretrain.json with the
training curve and the accuracy per digit count, sampled at temperature 1 and greedy.

The corpus has flawed worked solutions (`slip`: each carry dropped with that probability), so
the model samples a wrong carry at about that rate: the headroom that `python -m tlt_jax.train`
then recovers with RL against the verifiable answer. Documents are packed into fixed-length
rows with per-document positions and attention masks (no attention across documents).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from flax import nnx
from tokenizers import Tokenizer, decoders, models

from tlt_jax.data.synthetic import DEFAULT_MIX, make_problem
from tlt_jax.model import hf
from tlt_jax.model.transformer import ModelConfig, Transformer, init_cache
from tlt_jax.rl.rewards import math_reward

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "assets", "tiny_arith")
PAD, EOS = "<pad>", "<eos>"
ALPHABET = "0123456789+*=; ecarysumb\\oxd{}"
# The prompt is the user's text as is: the tiny model has never seen chat markup.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def build_tokenizer() -> Tokenizer:
  """One token per character of the task's alphabet; ids 0 and 1 are <pad> and <eos>."""
  vocab = {PAD: 0, EOS: 1}
  for ch in ALPHABET:
    vocab.setdefault(ch, len(vocab))
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens([PAD, EOS])
  return tok


def model_config(tok: Tokenizer) -> ModelConfig:
  return ModelConfig(arch="qwen3", vocab_size=64, hidden_size=128, intermediate_size=384,
                     num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True,
                     tie_embeddings=True, rope_theta=10000.0, max_position_embeddings=512,
                     eos_token_id=tok.token_to_id(EOS))


def pack(docs: list[tuple[list[int], list[int]]], rows: int, row_len: int):
  """Packs (prompt, response) documents into rows; returns tokens, positions, segment ids
  (0 = padding) and the loss mask (1 where the next token is a response token)."""
  tokens = np.zeros((rows, row_len), np.int32)
  positions = np.zeros((rows, row_len), np.int32)
  segments = np.zeros((rows, row_len), np.int32)
  loss_mask = np.zeros((rows, row_len), np.float32)
  r, col, used = 0, 0, 0
  for prompt, response in docs:
    doc = prompt + response
    if col + len(doc) > row_len:
      r, col = r + 1, 0
      if r == rows:
        break
    n = len(doc)
    tokens[r, col:col + n] = doc
    positions[r, col:col + n] = np.arange(n)
    segments[r, col:col + n] = used + 1
    loss_mask[r, col + len(prompt) - 1:col + n - 1] = 1.0  # predicts response[0..]
    col, used = col + n, used + 1
  return tokens, positions, segments, loss_mask, used


def doc_mask(segments_BxT: jax.Array) -> jax.Array:
  same = segments_BxT[:, :, None] == segments_BxT[:, None, :]
  causal = jnp.tril(jnp.ones(segments_BxT.shape[1:] * 2, bool))
  return same & causal[None] & (segments_BxT[:, :, None] > 0)


def loss_fn(model: Transformer, tokens, positions, segments, loss_mask):
  logits = model(tokens, positions, mask_BxTxS=doc_mask(segments)).logits_BxTxV
  ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
  m = loss_mask[:, :-1]
  return jnp.sum(ce * m) / jnp.maximum(m.sum(), 1.0)


@nnx.jit
def train_step(model, optimizer, tokens, positions, segments, loss_mask):
  loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, positions, segments, loss_mask)
  optimizer.update(model, grads)
  return loss


@nnx.jit(static_argnames=("max_new", "temperature"))
def _decode(model, prompts_BxP, lengths_B, key, max_new: int, temperature: float):
  """Left-aligned prompts, KV cache; greedy or sampled; no early stop (eos is cut on the host)."""
  B, P = prompts_BxP.shape
  cache = init_cache(model.cfg, B, P + max_new)
  out = model(prompts_BxP, cache=cache, write_slot_B=jnp.zeros((B,), jnp.int32))
  rows = jnp.arange(B)
  logits = out.logits_BxTxV[rows, lengths_B - 1]

  def pick(logits, k):
    if temperature == 0.0:
      return jnp.argmax(logits, -1).astype(jnp.int32)
    return jax.random.categorical(k, logits / temperature).astype(jnp.int32)

  def step(carry, k):
    cache, logits, pos = carry
    tok = pick(logits, k)
    o = model(tok[:, None], cache=cache, write_slot_B=pos)
    return (o.cache, o.logits_BxTxV[:, 0], pos + 1), tok

  _, toks = jax.lax.scan(step, (out.cache, logits, lengths_B), jax.random.split(key, max_new))
  return toks.T


def evaluate(model, tok: Tokenizer, mix, slip_free_seed: int, per_digit: int, temperature: float,
             max_new: int) -> dict[str, float]:
  eos = tok.token_to_id(EOS)
  rng = np.random.default_rng(slip_free_seed)
  out = {}
  for digits in sorted(mix):
    probs = [make_problem(rng, digits, ("+",)) for _ in range(per_digit)]
    enc = [tok.encode(p["prompt"]).ids for p in probs]
    P = max(map(len, enc))
    prompts = np.zeros((len(enc), P), np.int32)
    for i, e in enumerate(enc):
      prompts[i, :len(e)] = e
    toks = np.asarray(_decode(model, prompts, np.array([len(e) for e in enc], np.int32),
                              jax.random.key(digits), max_new, temperature))
    correct = 0
    for p, row in zip(probs, toks.tolist()):
      row = row[:row.index(eos)] if eos in row else row
      correct += math_reward(tok.decode(row), p["answer"])
    out[str(digits)] = correct / len(probs)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default=DEFAULT_OUT)
  parser.add_argument("--steps", type=int, default=3000)
  parser.add_argument("--rows", type=int, default=16)
  parser.add_argument("--row_len", type=int, default=256)
  parser.add_argument("--lr", type=float, default=2e-3)
  parser.add_argument("--slip", type=float, default=0.4)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--eval_per_digit", type=int, default=64)
  args = parser.parse_args()

  tok = build_tokenizer()
  cfg = model_config(tok)
  model = Transformer(cfg, nnx.Rngs(args.seed))
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.lr, min(100, args.steps // 10), args.steps, args.lr * 0.05)
  optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0),
                                               optax.adamw(schedule, weight_decay=0.01)),
                            wrt=nnx.Param)
  rng = np.random.default_rng(args.seed)
  mix = DEFAULT_MIX
  digit_choices, probs = np.array(list(mix)), np.array(list(mix.values()))
  eos = tok.token_to_id(EOS)
  curve, start = [], time.perf_counter()
  bar = tqdm.trange(args.steps, desc="pretrain", unit="step")
  for step in bar:
    docs = []
    while sum(len(p) + len(r) for p, r in docs) < args.rows * args.row_len:
      prob = make_problem(rng, int(rng.choice(digit_choices, p=probs)), ("+",), args.slip)
      docs.append((tok.encode(prob["prompt"]).ids, tok.encode(prob["solution"]).ids + [eos]))
    tokens, positions, segments, loss_mask, _ = pack(docs, args.rows, args.row_len)
    loss = train_step(model, optimizer, tokens, positions, segments, loss_mask)
    if step % 50 == 0 or step == args.steps - 1:
      loss = float(loss)
      curve.append({"step": step, "loss": loss, "wall_s": time.perf_counter() - start})
      bar.set_postfix(loss=f"{loss:.4f}")
  train_s = time.perf_counter() - start

  max_new = 200
  report = {
      "model": f"{cfg.arch} {cfg.num_layers}x{cfg.hidden_size} vocab {cfg.vocab_size}",
      "params": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
      "args": vars(args) | {"out": os.path.relpath(args.out, HERE)},
      "train_s": train_s, "final_loss": curve[-1]["loss"], "curve": curve,
      "accuracy_sampled_t1": evaluate(model, tok, mix, 1234, args.eval_per_digit, 1.0, max_new),
      "accuracy_greedy": evaluate(model, tok, mix, 1234, args.eval_per_digit, 0.0, max_new),
  }
  os.makedirs(args.out, exist_ok=True)
  hf.save_model(model, args.out)
  tok.save(os.path.join(args.out, "tokenizer.json"))
  with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
    json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": EOS, "pad_token": PAD,
               "model_max_length": cfg.max_position_embeddings}, f, indent=2)
  with open(os.path.join(args.out, "pretrain.json"), "w") as f:
    json.dump(report, f, indent=2)
  print(json.dumps({k: v for k, v in report.items() if k != "curve"}, indent=2))


if __name__ == "__main__":
  main()
