"""Tokenizers: GLM's special tokens are single ids that plain text never produces.

The Hugging Face tokenizer is a byte-level BPE trained here on a few sentences, with GLM's
special tokens added (most as special tokens, the think pair as plain added tokens, as some
tokenizers have them) plus one token the chat layer does not use: nothing is downloaded.
"""

import json
import zlib

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from glm5_jax import config as config_lib
from glm5_jax.data import tokenizers

SENTENCES = ["the cat sat on the mat", "call the weather tool for Oslo", "reasoning before answers",
             "def f(x):\n    return x + 1", "tool results come back as observations"]
NOT_SPECIAL = ("<think>", "</think>")      # added as plain (non-special) added tokens
EXTRA = "<|begin_of_image|>"                 # a special token the chat layer does not use


def write_glm_tokenizer_json(path, missing=()) -> str:
  """A small byte-level BPE tokenizer.json with GLM's special tokens (except `missing`)."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(SENTENCES, trainer)
  names = [t for t in tokenizers.SPECIAL_TOKENS if t not in missing]
  tok.add_special_tokens([t for t in names if t not in NOT_SPECIAL] + [EXTRA])
  tok.add_tokens([t for t in names if t in NOT_SPECIAL])
  tok.save(str(path))
  return str(path)


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory):
  return write_glm_tokenizer_json(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture
def rng(request):
  return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def _text_with_specials(rng) -> str:
  """Random text that spells every special token, between random words and unicode."""
  words = ["cat", " ", "\n", "é", "中文", "<|", "|>", "Oslo", "x + 1"]
  parts = [t + words[rng.integers(len(words))] for t in (*tokenizers.SPECIAL_TOKENS, EXTRA)]
  return "".join(rng.permutation(parts))


def test_byte_special_ids_follow_the_bytes_in_table_order():
  tok = tokenizers.ByteTokenizer()
  ids = [tok.special_id(t) for t in tokenizers.SPECIAL_TOKENS]
  assert ids == list(range(256, 256 + len(tokenizers.SPECIAL_TOKENS)))
  assert tok.vocab_size == 256 + len(tokenizers.SPECIAL_TOKENS) == 277


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_presets_hold_the_byte_vocabulary_and_use_its_special_ids(preset):
  cfg = config_lib.get_preset(preset)
  tok = tokenizers.ByteTokenizer()
  assert cfg.vocab_size >= tok.vocab_size and cfg.vocab_size % 128 == 0
  assert cfg.bos_token_id == tok.special_id("[gMASK]")
  assert cfg.eos_token_id == tuple(tok.special_id(t)
                                   for t in ("<|endoftext|>", "<|user|>", "<|observation|>"))


def test_byte_encode_never_produces_a_special_id(rng):
  tok = tokenizers.ByteTokenizer()
  text = _text_with_specials(rng)
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and ids.max() < 256
  np.testing.assert_array_equal(ids, np.frombuffer(text.encode("utf-8"), np.uint8))
  assert tok.decode(ids) == text


def test_byte_decode_drops_or_names_special_ids():
  tok = tokenizers.ByteTokenizer()
  ids = [*tok.encode("a"), tok.special_id("<|user|>"), *tok.encode("é"), 999]
  assert tok.decode(ids) == "aé"
  assert tok.decode(ids, skip_special_tokens=False) == "a<|user|>é"


def test_hf_encode_never_produces_a_special_id(hf_path, rng):
  tok = tokenizers.HFTokenizer(hf_path)
  text = _text_with_specials(rng)
  special = set(tok.special_tokens.values())
  raw = Tokenizer.from_file(hf_path).encode(text).ids
  assert special & set(raw), "the raw library matches added tokens in text: the test must see it"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and not special & set(ids.tolist())
  assert tok.decode(ids) == text


def test_hf_special_ids_are_found_by_string(hf_path):
  tok = tokenizers.HFTokenizer(hf_path)
  with open(hf_path) as f:
    added = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
  for name in (*tokenizers.SPECIAL_TOKENS, EXTRA):
    assert tok.special_id(name) == added[name]
  assert tok.vocab_size == max(added.values()) + 1


def test_missing_special_token_is_a_clear_error(tmp_path):
  tok = tokenizers.HFTokenizer(write_glm_tokenizer_json(tmp_path / "t.json",
                                                        missing=("<tool_response>",)))
  with pytest.raises(ValueError, match=r"no special token '<tool_response>'"):
    tok.special_id("<tool_response>")
  with pytest.raises(ValueError, match=r"tokenizer 'bytes' has no special token '<img>'"):
    tokenizers.ByteTokenizer().special_id("<img>")


def test_encode_rejects_non_text(hf_path):
  for tok in (tokenizers.ByteTokenizer(), tokenizers.HFTokenizer(hf_path)):
    with pytest.raises(TypeError, match="expected a str"):
      tok.encode([1, 2])
