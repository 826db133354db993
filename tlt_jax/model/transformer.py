"""One decoder for the Llama / Qwen2 / Qwen3 family, in Flax NNX.

Differences between the three are flags of `ModelConfig`: q/k/v bias (Qwen2), per-head q/k
RMSNorm (Qwen3), head_dim independent of hidden/heads (Qwen3), Llama-3 RoPE scaling, tied
embeddings.

The KV cache is a plain pytree passed in and returned (not NNX state), so programs that decode can
donate it and update it in place. Cache slots and RoPE positions are separate inputs: a tree of
drafted tokens occupies consecutive cache slots but several nodes share one position.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tlt_jax import ops
from tlt_jax import tensor_parallel as tp

ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency scaling ("rope_type": "llama3")."""
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  arch: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_eps: float = 1e-6
  tie_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False
  max_position_embeddings: int = 4096
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  dtype: str = "float32"  # parameters and activations; norms, softmax and logits run in f32

  def __post_init__(self):
    validate_model_config(self)

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def eos_ids(self) -> tuple[int, ...]:
    """The end-of-sequence ids as a tuple (HF configs give one id, a list, or none)."""
    eos = self.eos_token_id
    return tuple(eos) if isinstance(eos, (tuple, list)) else ((eos,) if eos is not None else ())


def validate_model_config(c: ModelConfig) -> None:
  problems = []
  if c.arch not in ARCHITECTURES:
    problems.append(f"arch={c.arch!r} is not one of {ARCHITECTURES}")
  for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_dim"):
    if getattr(c, name) <= 0:
      problems.append(f"{name}={getattr(c, name)} must be positive")
  if c.num_heads > 0 and c.num_kv_heads > 0 and c.num_heads % c.num_kv_heads:
    problems.append(f"num_heads={c.num_heads} is not a multiple of num_kv_heads={c.num_kv_heads} "
                    "(grouped-query attention shares each KV head among a whole group)")
  if c.head_dim % 2:
    problems.append(f"head_dim={c.head_dim} must be even for rotary embeddings")
  if c.dtype not in ("float32", "bfloat16"):
    problems.append(f"dtype={c.dtype!r} must be 'float32' or 'bfloat16'")
  if problems:
    raise ValueError("invalid model config: " + "; ".join(problems))


class KVCache(NamedTuple):
  """Per layer keys and values: k[i] has shape [B, S, K, D] (S cache slots)."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @property
  def num_slots(self) -> int:
    return self.k[0].shape[1]


def init_cache(cfg: ModelConfig, batch: int, num_slots: int) -> KVCache:
  # Under tensor parallelism (`tp.over`) a device caches the KV heads it computes.
  shape = (batch, num_slots, tp.local_share(cfg.num_kv_heads), cfg.head_dim)
  zeros = tuple(jnp.zeros(shape, cfg.jnp_dtype) for _ in range(cfg.num_layers))
  return KVCache(k=zeros, v=tuple(jnp.zeros(shape, cfg.jnp_dtype) for _ in range(cfg.num_layers)))


class ForwardOut(NamedTuple):
  logits_BxTxV: jax.Array | None  # f32 (None when not asked for)
  hidden_BxTxD: jax.Array  # after the final norm: what lm_head (and the drafter) consume
  cache: KVCache | None


# ---------------------------------------------------------------------------------------------
# Building blocks


class Linear(nnx.Module):
  """y = x @ kernel (+ bias); kernel is [d_in, d_out] (HF stores the transpose)."""

  def __init__(self, d_in: int, d_out: int, *, use_bias: bool, dtype, rngs: nnx.Rngs):
    bound = 1.0 / math.sqrt(d_in)
    self.kernel = nnx.Param(
        jax.random.uniform(rngs.params(), (d_in, d_out), jnp.float32, -bound, bound).astype(dtype))
    self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if use_bias else None
    self.d_in, self.d_out = d_in, d_out

  def __call__(self, x: jax.Array) -> jax.Array:
    y = ops.matmul(x, self.kernel[...])
    if self.bias is not None:
      y = y + self.bias[...]
    return y


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype):
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    return ops.rms_norm(x, self.weight[...], self.eps)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies [head_dim/2] in f32, the way HF computes them (incl. Llama-3 scaling)."""
  dim = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta
                    ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
  inv_freq = inv_freq.astype(np.float32)
  s = cfg.rope_scaling
  if s is None:
    return inv_freq
  low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x_BxTxHxD: jax.Array, positions_BxT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  freqs_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  emb_BxTxD = jnp.concatenate([freqs_BxTxF, freqs_BxTxF], axis=-1)
  cos = jnp.cos(emb_BxTxD)[:, :, None, :].astype(x_BxTxHxD.dtype)
  sin = jnp.sin(emb_BxTxD)[:, :, None, :].astype(x_BxTxHxD.dtype)
  half = x_BxTxHxD.shape[-1] // 2
  rotated = jnp.concatenate([-x_BxTxHxD[..., half:], x_BxTxHxD[..., :half]], axis=-1)
  return x_BxTxHxD * cos + rotated * sin


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    dt = cfg.jnp_dtype
    D, H, K, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q_proj = Linear(D, H * hd, use_bias=cfg.qkv_bias, dtype=dt, rngs=rngs)
    self.k_proj = Linear(D, K * hd, use_bias=cfg.qkv_bias, dtype=dt, rngs=rngs)
    self.v_proj = Linear(D, K * hd, use_bias=cfg.qkv_bias, dtype=dt, rngs=rngs)
    self.o_proj = Linear(H * hd, D, use_bias=False, dtype=dt, rngs=rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, cfg.rms_eps, dt)
      self.k_norm = RMSNorm(hd, cfg.rms_eps, dt)
    else:
      self.q_norm = self.k_norm = None
    self.num_heads, self.num_kv_heads, self.head_dim = H, K, hd
    self.cfg = cfg

  def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS, cache_k, cache_v, write_slot_B,
               kv_index_BxTxS=None, causal: bool = False):
    B, T, _ = x_BxTxD.shape
    hd = self.head_dim
    # -1 heads: under tensor parallelism (`tp`) a device holds a whole share of the heads.
    q = self.q_proj(x_BxTxD).reshape(B, T, -1, hd)
    k = self.k_proj(x_BxTxD).reshape(B, T, -1, hd)
    v = self.v_proj(x_BxTxD).reshape(B, T, -1, hd)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope_inv_freq(self.cfg)  # a trace-time constant
    q = apply_rope(q, positions_BxT, inv_freq)
    k = apply_rope(k, positions_BxT, inv_freq)
    if cache_k is not None:
      # Write first, then attend over the whole cache: every path reads keys from the same place.
      write = jax.vmap(lambda c, new, s: jax.lax.dynamic_update_slice_in_dim(c, new, s, axis=0))
      cache_k = write(cache_k, k.astype(cache_k.dtype), write_slot_B)
      cache_v = write(cache_v, v.astype(cache_v.dtype), write_slot_B)
      k_all, v_all = cache_k, cache_v
    else:
      k_all, v_all = k, v
    if kv_index_BxTxS is None:
      out = ops.attention(q, k_all, v_all, mask_BxTxS, scale=1.0 / math.sqrt(hd), causal=causal)
    else:
      out = _per_query_attention(q, k_all, v_all, mask_BxTxS, kv_index_BxTxS, 1.0 / math.sqrt(hd))
    # o_proj reduces over all heads: it gets them all
    out = tp.linear_of_gathered(self.o_proj, out.reshape(B, T, -1))
    return tp.gather_features(out), cache_k, cache_v


def _per_query_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, kv_index_BxTxS, scale):
  """Each query attends its own layout of the cache: virtual slot s holds physical slot
  kv_index[b, t, s]. A tree node then sees its path's keys at the slots plain decoding would
  have put them in, so its outputs are bitwise plain decoding's (the kernels reduce in slot
  order). Every query becomes a batch row of its own; batch-invariant kernels make that free
  of any numeric effect."""
  B, T, H, D = q_BxTxHxD.shape
  S, K = k_BxSxKxD.shape[1], k_BxSxKxD.shape[2]
  gather = jax.vmap(lambda c, idx: c[idx])  # [S, K, D], [T, S] -> [T, S, K, D]
  k_q = gather(k_BxSxKxD, kv_index_BxTxS).reshape(B * T, S, K, D)
  v_q = gather(v_BxSxKxD, kv_index_BxTxS).reshape(B * T, S, K, D)
  out = ops.attention(q_BxTxHxD.reshape(B * T, 1, H, D), k_q, v_q,
                      mask_BxTxS.reshape(B * T, 1, S), scale=scale)
  return out.reshape(B, T, H, D)


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    dt = cfg.jnp_dtype
    self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, use_bias=False, dtype=dt,
                            rngs=rngs)
    self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, use_bias=False, dtype=dt,
                          rngs=rngs)
    self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, use_bias=False, dtype=dt,
                            rngs=rngs)

  def __call__(self, x):
    h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
    return tp.gather_features(tp.linear_of_gathered(self.down_proj, h))


class DecoderLayer(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.jnp_dtype)
    self.self_attn = Attention(cfg, rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.jnp_dtype)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x, positions, mask, cache_k, cache_v, write_slot, kv_index=None,
               causal: bool = False):
    attn_out, cache_k, cache_v = self.self_attn(
        self.input_layernorm(x), positions, mask, cache_k, cache_v, write_slot, kv_index, causal)
    x = x + attn_out
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x, cache_k, cache_v


class Embed(nnx.Module):

  def __init__(self, vocab: int, dim: int, dtype, rngs: nnx.Rngs):
    self.embedding = nnx.Param(
        (0.02 * jax.random.normal(rngs.params(), (vocab, dim), jnp.float32)).astype(dtype))

  def __call__(self, tokens):
    return tp.embed_lookup(self.embedding[...], tokens)


# ---------------------------------------------------------------------------------------------
# The model


def causal_mask(query_slots_BxT: jax.Array, num_slots: int) -> jax.Array:
  """Query at cache slot s sees slots 0..s."""
  return jnp.arange(num_slots)[None, None, :] <= query_slots_BxT[:, :, None]


class Transformer(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, cfg.jnp_dtype, rngs)
    self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.jnp_dtype)
    if cfg.tie_embeddings:
      self.lm_head = None
    else:
      self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=cfg.jnp_dtype,
                            rngs=rngs)

  def logits(self, hidden_BxTxD: jax.Array) -> jax.Array:
    if self.lm_head is None:
      logits = ops.matmul(hidden_BxTxD, self.embed_tokens.embedding[...].T)
    else:
      logits = self.lm_head(hidden_BxTxD)
    return tp.gather_features(logits).astype(jnp.float32)

  def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array | None = None, *,
               cache: KVCache | None = None, write_slot_B: jax.Array | None = None,
               mask_BxTxS: jax.Array | None = None,
               kv_index_BxTxS: jax.Array | None = None, logits: bool = True) -> ForwardOut:
    """Forward over T new tokens per row.

    Without a cache, attention is over the T tokens themselves (causal unless `mask_BxTxS` is
    given, S = T). With a cache, the new keys/values are written at slots
    `write_slot_B[b] + 0..T-1` first and attention runs over all S cache slots; the default mask
    is causal in slot order (slot <= the query's slot). Positions default to the slots.
    `kv_index_BxTxS` (with a cache and an explicit mask over virtual slots) gives each query its
    own slot layout: virtual slot s reads physical slot kv_index[b, t, s] (tree verification).
    `logits=False` stops at the final norm (the caller applies `self.logits` itself).
    """
    B, T = tokens_BxT.shape
    if cache is None:
      slots_BxT = jnp.broadcast_to(jnp.arange(T), (B, T))
      num_slots = T
    else:
      if write_slot_B is None:
        raise ValueError("a forward with a KV cache needs write_slot_B (where the new tokens go)")
      slots_BxT = write_slot_B[:, None] + jnp.arange(T)[None, :]
      num_slots = cache.num_slots
    if positions_BxT is None:
      positions_BxT = slots_BxT
    # Without a cache the default mask is causal over the T tokens themselves: attention may
    # skip the keys past each query block (a cache may hold keys at any slot, so not there).
    causal = cache is None and mask_BxTxS is None
    if mask_BxTxS is None:
      mask_BxTxS = causal_mask(slots_BxT, num_slots)
    elif mask_BxTxS.shape != (B, T, num_slots):
      raise ValueError(f"mask shape {mask_BxTxS.shape} != (batch, new tokens, slots) = "
                       f"{(B, T, num_slots)}")
    x = self.embed_tokens(tokens_BxT)
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      ck = cache.k[i] if cache is not None else None
      cv = cache.v[i] if cache is not None else None
      x, ck, cv = layer(x, positions_BxT, mask_BxTxS, ck, cv, write_slot_B, kv_index_BxTxS,
                        causal)
      new_k.append(ck)
      new_v.append(cv)
    hidden = self.norm(x)
    new_cache = KVCache(tuple(new_k), tuple(new_v)) if cache is not None else None
    return ForwardOut(self.logits(hidden) if logits else None, hidden, new_cache)
