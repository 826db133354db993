import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tlt_jax.model import hf


def test_tokenizer_json_roundtrip(tmp_path):
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  corpus = ["12 + 34 = 46", "the answer is 46", "7 * 8 = 56"] * 20
  tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
  tok.save(str(tmp_path / "tokenizer.json"))
  loaded = hf.load_tokenizer(str(tmp_path))
  ids = loaded.encode("the answer is 56").ids
  assert ids == tok.encode("the answer is 56").ids
  assert loaded.decode(ids).replace(" ", "") == "theansweris56"


def test_missing_tokenizer_is_named(tmp_path):
  with pytest.raises(hf.CheckpointError, match="no tokenizer.json"):
    hf.load_tokenizer(str(tmp_path))
