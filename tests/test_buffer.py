"""tlt.buffer: the window, the token cap, packing, the packed EAGLE loss, the zarr spill."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tlt_jax.model.drafter import Drafter
from tlt_jax.model.transformer import ModelConfig, Transformer
from tlt_jax.rollout.engine import Sample
from tlt_jax.tlt import buffer as buf_lib
from tlt_jax.tlt import packed_loss
from tlt_jax.tlt.drafter_trainer import DrafterLossConfig, eagle_loss

CFG = ModelConfig(arch="qwen3", vocab_size=32, hidden_size=32, intermediate_size=64,
                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True,
                  tie_embeddings=True)
MAX_NEW = 16   # the engine's max_new_tokens: Sample.hidden has this many rows
SEQ = 24       # every target forward here is over this many tokens (one compile)


@pytest.fixture(scope="module")
def models():
  return Transformer(CFG, nnx.Rngs(0)), Drafter(CFG, nnx.Rngs(1))


@nnx.jit
def _hidden(target, tokens_BxT):
  return target(tokens_BxT).hidden_BxTxD


def _full_hidden(target, seq: np.ndarray) -> np.ndarray:
  """h_t for every position of `seq` (causal: right padding changes none of them)."""
  padded = np.zeros((1, SEQ), np.int32)
  padded[0, :len(seq)] = seq
  return np.asarray(_hidden(target, jnp.asarray(padded)))[0, :len(seq)]


def _sample(target, sid: int, prompt_len: int, response_len: int, *, dtype=jnp.float32):
  """What the engine hands over: hidden[j] = h at position P - 1 + j, zero rows past N."""
  rng = np.random.default_rng(sid)
  seq = rng.integers(1, CFG.vocab_size, prompt_len + response_len).astype(np.int32)
  h = _full_hidden(target, seq)
  rows = np.zeros((MAX_NEW, CFG.hidden_size), np.float32)
  rows[:response_len] = h[prompt_len - 1:prompt_len - 1 + response_len]
  s = Sample(sample_id=sid, prompt=seq[:prompt_len].tolist(), tokens=seq[prompt_len:],
             logprobs=np.zeros(response_len, np.float32), finish_reason="length",
             hidden=jnp.asarray(rows, dtype))
  return s, seq, h


def _tiny_sample(sid: int, prompt_len: int, response_len: int, D: int = 4):
  """No model: for the bookkeeping tests, hidden rows just have to be there."""
  return Sample(sid, list(range(1, prompt_len + 1)), np.arange(response_len, dtype=np.int32),
                np.zeros(response_len, np.float32), "length",
                jnp.full((MAX_NEW, D), float(sid), jnp.float32))


# -- window and cap -----------------------------------------------------------------------------


def test_window_keeps_the_last_steps_only():
  b = buf_lib.DrafterBuffer(window_steps=2)
  for step in range(3):
    b.add(step, [_tiny_sample(10 * step + i, 3, 4) for i in range(2)])
  assert b.steps() == [1, 2]
  assert len(b) == 4 and b.num_tokens == 4 * 7
  assert [e.sample_id for e in b.examples()] == [10, 11, 20, 21]
  b.add(4, [_tiny_sample(40, 2, 2)])  # step 3 never came: step 2 is two updates old now
  assert b.steps() == [4] and len(b) == 1 and b.num_tokens == 4
  b.add(1, [_tiny_sample(99, 2, 2)])  # older than the window on arrival
  assert b.steps() == [4]


def test_hidden_stays_the_engines_device_array():
  s = _tiny_sample(1, 2, 3)
  b = buf_lib.DrafterBuffer(window_steps=1)
  b.add(0, [s])
  ex = b.examples()[0]
  assert ex.hidden is s.hidden
  np.testing.assert_array_equal(ex.tokens, [1, 2, 0, 1, 2])
  np.testing.assert_array_equal(ex.response_mask, [False, False, True, True, True])
  assert (ex.prompt_len, ex.response_len, ex.num_loss_positions) == (2, 3, 2)


def test_max_tokens_drops_oldest_first():
  b = buf_lib.DrafterBuffer(window_steps=10, max_tokens=20)
  b.add(0, [_tiny_sample(0, 3, 3), _tiny_sample(1, 3, 3)])   # 12 tokens
  b.add(1, [_tiny_sample(2, 3, 3)])                          # 18
  assert b.num_tokens == 18 and len(b) == 3
  b.add(2, [_tiny_sample(3, 2, 2)])                          # 22 -> drop sample 0
  assert [e.sample_id for e in b.examples()] == [1, 2, 3] and b.num_tokens == 16
  b.add(3, [_tiny_sample(4, 5, 6)])                          # 27 -> drop 1, then 2
  assert [e.sample_id for e in b.examples()] == [3, 4] and b.num_tokens == 15
  assert b.steps() == [2, 3]


def test_add_rejects_malformed_samples():
  b = buf_lib.DrafterBuffer(window_steps=1)
  bad = _tiny_sample(0, 2, 3)
  bad.hidden = jnp.zeros((2, 4))  # fewer rows than response tokens
  with pytest.raises(ValueError, match="hidden"):
    b.add(0, [_tiny_sample(1, 2, 3), bad])
  assert len(b) == 0  # nothing of a rejected call is kept
  b.add(0, [_tiny_sample(1, 2, 3)])
  with pytest.raises(ValueError, match="hidden"):
    b.add(0, [_tiny_sample(2, 2, 3, D=8)])


# -- packing ------------------------------------------------------------------------------------


def test_attention_mask_is_block_diagonal_causal():
  seg = np.array([[1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 3, 3]], np.int32)
  m = np.asarray(packed_loss.attention_mask_BxTxT(seg))
  want0 = np.zeros((6, 6), bool)
  want0[0, 0] = want0[1, :2] = True
  want0[2, 2] = want0[3, 2:4] = want0[4, 2:5] = True
  np.testing.assert_array_equal(m[0], want0)
  np.testing.assert_array_equal(m[1], np.tril(np.ones((6, 6), bool)))


def test_pack_places_every_token_once(models):
  target, _ = models
  shapes = [(3, 5), (2, 8), (6, 2), (4, 4), (5, 7), (2, 3), (4, 16), (3, 1)]  # (P, N)
  data = [_sample(target, i, p, n) for i, (p, n) in enumerate(shapes)]
  b = buf_lib.DrafterBuffer(window_steps=1)
  b.add(0, [s for s, _, _ in data])
  exs = b.examples()
  row_len = 10
  batches = buf_lib.pack_all(exs, rows=2, row_len=row_len, seed=3)
  seen = {}
  for pb in batches:
    assert pb.tokens_BxT.shape == (2, row_len)
    assert pb.features_in_BxTxD.shape == (2, row_len, CFG.hidden_size)
    for r in range(2):
      seg = pb.segment_ids_BxT[r]
      for sid in set(seg[seg > 0].tolist()):
        cols = np.nonzero(seg == sid)[0]
        assert np.all(np.diff(cols) == 1), "a document's window is contiguous in its row"
        assert np.all(np.diff(pb.positions_BxT[r, cols]) == 1)
      for c in np.nonzero(seg)[0]:
        key = (int(seg[c]) - 1, int(pb.positions_BxT[r, c]))
        assert key not in seen, f"token {key} packed twice"
        seen[key] = (r, c, pb)
  # The 1-token response has no loss position (N - 1 = 0): left out. All else, exactly once.
  want = {(i, t) for i, (p, n) in enumerate(shapes) if n >= 2 for t in range(p + n)}
  assert set(seen) == want
  n_loss = sum(int(pb.loss_mask_BxT.sum()) for pb in batches)
  assert n_loss == sum(n - 1 for _, n in shapes)
  # Values against the target's own full forward (not the buffer's indexing of Sample.hidden).
  for (i, t), (r, c, pb) in seen.items():
    _, seq, h = data[i]
    P, L = shapes[i][0], sum(shapes[i])
    assert pb.tokens_BxT[r, c] == seq[t]
    assert pb.loss_mask_BxT[r, c] == (P <= t <= L - 2)
    want_in = h[t - 1] if t >= P else np.zeros(CFG.hidden_size)
    want_target = h[t] if P - 1 <= t <= L - 2 else np.zeros(CFG.hidden_size)
    np.testing.assert_array_equal(pb.features_in_BxTxD[r, c], want_in)
    np.testing.assert_array_equal(pb.target_hidden_BxTxD[r, c], want_target)
  # Deterministic per seed; the seed does change the layout.
  again = buf_lib.pack_all(exs, rows=2, row_len=row_len, seed=3)
  for x, y in zip(batches, again):
    for u, v in zip(x, y):
      np.testing.assert_array_equal(u, v)
  other = buf_lib.pack_all(exs, rows=2, row_len=row_len, seed=4)
  assert any(not np.array_equal(x.segment_ids_BxT, y.segment_ids_BxT)
             for x, y in zip(batches, other))
  # `pack` is the first batch of `pack_all`.
  first = buf_lib.pack(exs, rows=2, row_len=row_len, seed=3)
  np.testing.assert_array_equal(first.segment_ids_BxT, batches[0].segment_ids_BxT)


def test_pack_first_fit_order():
  b = buf_lib.DrafterBuffer(window_steps=1)
  b.add(0, [_tiny_sample(i, 2, n) for i, n in enumerate([4, 6, 2, 2, 9])])  # 6 8 4 4 11
  exs = b.examples()
  pb = buf_lib.pack(exs, rows=2, row_len=10)
  # doc0 (6) -> row 0; doc1 (8) -> row 1; doc2 (4) -> row 0 (fills it); doc3 (4) fits nowhere.
  np.testing.assert_array_equal(pb.segment_ids_BxT[0], [1] * 6 + [3] * 4)
  np.testing.assert_array_equal(pb.segment_ids_BxT[1], [2] * 8 + [0] * 2)
  # doc4 (11 tokens) splits into [0, 10) and [10, 11); the second window holds only the last
  # token, whose target h_10 the engine never computed: no loss position, left out.
  batches = buf_lib.pack_all(exs, rows=2, row_len=10)
  assert len(batches) == 2
  rest = batches[1]
  np.testing.assert_array_equal(rest.segment_ids_BxT[0], [4] * 4 + [0] * 6)
  np.testing.assert_array_equal(rest.positions_BxT[0, :4], [0, 1, 2, 3])
  np.testing.assert_array_equal(rest.segment_ids_BxT[1], [5] * 10)
  np.testing.assert_array_equal(rest.positions_BxT[1], np.arange(10))
  assert rest.loss_mask_BxT[1].sum() == 8  # positions 2..9


# -- the packed loss ------------------------------------------------------------------------------


def test_single_document_packed_loss_equals_eagle_loss(models):
  target, drafter = models
  s, seq, h = _sample(target, 7, 4, 8)
  b = buf_lib.DrafterBuffer(window_steps=1)
  b.add(0, [s])
  pb = buf_lib.pack(b.examples(), rows=1, row_len=16)  # the document plus 4 padding tokens
  _, got = packed_loss.eagle_loss_packed(drafter, target, pb)
  # eagle_loss on the document alone, with what the buffer knows: h_t for P-1 <= t <= L-2
  # (it shifts them into h_{t-1} itself), loss on P <= t <= L-2.
  P, L = 4, 12
  known = np.zeros_like(h)
  known[P - 1:L - 1] = h[P - 1:L - 1]
  mask = (np.arange(L) >= P) & (np.arange(L) <= L - 2)
  _, want = eagle_loss(drafter, target, jnp.asarray(seq[None]), jnp.asarray(known[None]),
                       jnp.asarray(mask[None]))
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, atol=1e-6,
                               err_msg=k)
  assert float(want["loss"]) > 0


def test_packed_documents_do_not_see_each_other(models):
  target, drafter = models
  sa, sb = _sample(target, 1, 3, 6)[0], _sample(target, 2, 2, 5)[0]
  b = buf_lib.DrafterBuffer(window_steps=1)
  b.add(0, [sa, sb])
  exs = b.examples()
  both = buf_lib.pack(exs, rows=1, row_len=16)
  np.testing.assert_array_equal(both.segment_ids_BxT[0], [1] * 9 + [2] * 7)
  np.testing.assert_array_equal(both.positions_BxT[0], list(range(9)) + list(range(7)))
  terms = packed_loss.eagle_terms_packed(drafter, target, both)
  for i, cols in ((0, slice(0, 9)), (1, slice(9, 16))):
    alone = packed_loss.eagle_terms_packed(drafter, target, buf_lib.pack([exs[i]], 1, 16))
    n = cols.stop - cols.start
    for k in ("feature_loss", "ce_loss", "feature"):
      np.testing.assert_allclose(np.asarray(terms[k])[0, cols], np.asarray(alone[k])[0, :n],
                                 rtol=1e-6, atol=1e-6, err_msg=f"doc {i} {k}")
  # Change document A's tokens: B's drafter outputs stay put, A's move.
  tokens = both.tokens_BxT.copy()
  tokens[0, :9] = (tokens[0, :9] + 5) % CFG.vocab_size
  moved = packed_loss.eagle_terms_packed(drafter, target, both._replace(tokens_BxT=tokens))
  for k in ("logits", "feature"):
    np.testing.assert_array_equal(np.asarray(moved[k])[0, 9:], np.asarray(terms[k])[0, 9:])
    assert not np.allclose(np.asarray(moved[k])[0, :9], np.asarray(terms[k])[0, :9])


def _draft_incrementally(drafter, target, seq: np.ndarray, features_in: np.ndarray,
                         depth: int, t: int) -> np.ndarray:
  """The drafter's feature at position t drafted at `depth`, as the engine drafts: a cache
  filled teacher-forced (target features), then depth - 1 one-token steps, each reading the
  feature the step before predicted."""
  L = len(seq)
  tokens = jnp.asarray(seq[None])
  zeros = jnp.zeros((1,), jnp.int32)
  _, feature, cache = drafter(target, tokens, jnp.asarray(features_in[None]),
                              drafter.init_cache(1, L), zeros)
  feat = feature[:, t - depth + 1]
  for pos in range(t - depth + 2, t + 1):
    _, out, cache = drafter(target, tokens[:, pos:pos + 1], feat[:, None], cache, zeros + pos)
    feat = out[:, 0]
  return np.asarray(feat[0])


def test_unrolled_passes_equal_incremental_drafting(models):
  """Depth j of the training-time test at position t is what the drafter computes when it
  drafts t at depth j (its own features fed back, its cache as decoding leaves it), for every
  loss position of each of two packed documents; depth 1 is the plain packed loss."""
  target, drafter = models
  (sa, seq_a, h_a), (sb, seq_b, h_b) = _sample(target, 3, 3, 8), _sample(target, 4, 2, 7)
  b = buf_lib.DrafterBuffer(window_steps=1)
  b.add(0, [sa, sb])
  batch = buf_lib.pack(b.examples(), rows=1, row_len=20)
  passes = packed_loss.unrolled_terms_packed(drafter, target, batch, unroll=3)
  plain = packed_loss.eagle_terms_packed(drafter, target, batch)
  np.testing.assert_allclose(np.asarray(passes[0][0]["feature"]), np.asarray(plain["feature"]),
                             rtol=1e-5, atol=1e-5)
  for col0, (seq, h, P) in ((0, (seq_a, h_a, 3)), (11, (seq_b, h_b, 2))):
    L = len(seq)
    features_in = np.zeros_like(h)
    features_in[P:] = h[P - 1:L - 1]  # what the buffer knows: zeros over the prompt
    for depth, (terms, valid) in enumerate(passes, start=1):
      got_valid = np.nonzero(np.asarray(valid)[0, col0:col0 + L])[0].tolist()
      assert got_valid == list(range(P + depth - 1, L - 1)), (depth, got_valid)
      for t in got_valid:
        want = _draft_incrementally(drafter, target, seq, features_in, depth, t)
        np.testing.assert_allclose(np.asarray(terms["feature"])[0, col0 + t], want,
                                   rtol=1e-5, atol=1e-5, err_msg=f"depth {depth} t {t}")
  loss1, m1 = packed_loss.eagle_loss_packed(drafter, target, batch)
  loss3, m3 = packed_loss.eagle_loss_packed(drafter, target, batch, DrafterLossConfig(unroll=3))
  assert float(m3["top1_agreement"]) == float(m1["top1_agreement"])
  assert {"top1_agreement_depth2", "top1_agreement_depth3"} <= set(m3)
  assert float(loss3) != float(loss1)


# -- spill / load ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_spill_load_round_trip_is_bitwise(models, tmp_path, dtype):
  target, _ = models
  b = buf_lib.DrafterBuffer(window_steps=2, max_tokens=1000)
  b.add(3, [_sample(target, i, 3, n, dtype=dtype)[0] for i, n in enumerate([5, 2])])
  b.add(4, [_sample(target, 9, 4, 7, dtype=dtype)[0]])
  d = str(tmp_path / "spill")
  b.spill(d)
  with open(os.path.join(d, "hidden", ".zarray")) as f:
    # zarr v2 dtype strings: numpy's "<f4"; bfloat16 is tensorstore's own "bfloat16" (not a view)
    want = "bfloat16" if dtype == jnp.bfloat16 else np.dtype(dtype).str
    assert json.load(f)["dtype"] == want
  c = buf_lib.DrafterBuffer.load(d)
  assert (c.window_steps, c.max_tokens, c.steps(), len(c), c.num_tokens) == (
      2, 1000, [3, 4], 3, b.num_tokens)
  for x, y in zip(b.examples(), c.examples()):
    assert (x.step, x.sample_id) == (y.step, y.sample_id)
    np.testing.assert_array_equal(x.tokens, y.tokens)
    np.testing.assert_array_equal(x.response_mask, y.response_mask)
    assert y.tokens.dtype == np.int32 and y.response_mask.dtype == bool
    valid = np.asarray(x.hidden)[:x.response_len]
    assert y.hidden.dtype == valid.dtype == np.dtype(dtype)
    assert y.hidden.shape == valid.shape
    assert valid.tobytes() == y.hidden.tobytes()
  for u, v in zip(b.pack(rows=2, row_len=8), c.pack(rows=2, row_len=8)):
    assert u.dtype == v.dtype and u.tobytes() == v.tobytes()
  # The window still counts from the newest step: one more step ages step 3 out.
  c.add(5, [_sample(target, 11, 2, 2, dtype=dtype)[0]])
  assert c.steps() == [4, 5]
  # Spilling again over the same directory replaces it.
  c.spill(d)
  assert buf_lib.DrafterBuffer.load(d).steps() == [4, 5]


def test_load_refuses_what_is_not_a_spill(tmp_path):
  with pytest.raises(FileNotFoundError):
    buf_lib.DrafterBuffer.load(str(tmp_path))
  buf_lib.DrafterBuffer(window_steps=1).spill(str(tmp_path / "empty"))
  e = buf_lib.DrafterBuffer.load(str(tmp_path / "empty"))
  assert len(e) == 0 and e.steps() == []
