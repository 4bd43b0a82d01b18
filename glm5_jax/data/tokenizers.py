"""Tokenizers: byte-level (default, vocab 256) or a local Hugging Face tokenizer.json."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
  """UTF-8 bytes as token ids 0..255 (bits per byte = nats per token / ln 2)."""
  vocab_size = 256
  name = "bytes"

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
  """A local `tokenizer.json` through the `tokenizers` library (no download)."""

  def __init__(self, path: str):
    try:
      from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError("data.tokenizer=<tokenizer.json> needs the `tokenizers` package") from e
    self._tok = Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size()
    self.name = path

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text).ids, np.int32)

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids])


def get_tokenizer(spec: str):
  """`bytes` or a path to a tokenizer.json."""
  if spec in ("bytes", "byte", ""):
    return ByteTokenizer()
  if spec.endswith(".json"):
    return HFTokenizer(spec)
  raise ValueError(f"data.tokenizer={spec!r}: expected 'bytes' or a path to a tokenizer.json")
