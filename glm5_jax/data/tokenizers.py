"""Tokenizers (byte-level, or a local Hugging Face tokenizer.json) with GLM's special tokens.

GLM's chat format (GLM-5 arXiv 2602.15763; the GLM-4.5 family's `tokenizer_config.json`) marks
roles, reasoning and tool calls with special tokens that are single ids. Both tokenizers here
keep two doors apart:

  encode(text)        plain text -> ids; never produces a special id, even for text that spells
                      one ("<|user|>" in a user message stays text);
  special_id(name)    the id of one special token, looked up by its string.

The chat renderer (`glm5_jax.data.chat`) encodes each piece of text with `encode` and inserts
special ids itself, so no user-controlled text can forge a role marker or a tool call.

ByteTokenizer: UTF-8 bytes are ids 0..255 and `SPECIAL_TOKENS` follow as 256, 257, ... (vocab
277; the `tiny` and `small` presets' 384 and 32768 leave room). HFTokenizer: a `tokenizer.json`
whose added tokens are the special tokens; `tokenizers` matches added tokens inside raw text,
so plain text goes through a copy of the tokenizer with the added tokens removed.
"""

from __future__ import annotations

import json
import os

import numpy as np

# GLM's special tokens that a text-only model uses (GLM-4.5 family tokenizer; llama.cpp's
# GLM-4.5 chat handler lists the same set as preserved tokens). Order = ByteTokenizer ids 256+.
SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "/nothink",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
    "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>",
)
_N_BYTES = 256


def _missing(tok_name: str, name: str, known) -> ValueError:
  return ValueError(f"tokenizer {tok_name!r} has no special token {name!r} (a single id is "
                    f"needed); its special tokens are {sorted(known)}")


def _check_text(text) -> None:
  if not isinstance(text, str):
    raise TypeError(f"encode(text={text!r}): expected a str, got {type(text).__name__}")


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, then `SPECIAL_TOKENS` as 256.. (bits per byte = nats / ln 2)."""
  vocab_size = _N_BYTES + len(SPECIAL_TOKENS)
  name = "bytes"
  special_tokens = {tok: _N_BYTES + i for i, tok in enumerate(SPECIAL_TOKENS)}  # name -> id

  def encode(self, text: str) -> np.ndarray:
    """int32 [n] byte ids (< 256): special-token-looking text stays bytes."""
    _check_text(text)
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    """Bytes decoded with replacement; special ids dropped or written as their strings."""
    names = {i: t for t, i in self.special_tokens.items()}
    out, run = [], []
    for i in (int(i) for i in ids):
      if 0 <= i < _N_BYTES:
        run.append(i)
      elif i in names and not skip_special_tokens:
        out += [bytes(run).decode("utf-8", errors="replace"), names[i]]
        run = []
    out.append(bytes(run).decode("utf-8", errors="replace"))
    return "".join(out)

  def special_id(self, name: str) -> int:
    if name not in self.special_tokens:
      raise _missing(self.name, name, self.special_tokens)
    return self.special_tokens[name]


class HFTokenizer:
  """A local `tokenizer.json` through the `tokenizers` library (no download).

  Every added token of the file (GLM's special tokens among them) is a special token here:
  `special_id` finds it by its string, and `encode` never produces it.
  """

  def __init__(self, path: str):
    try:
      from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError("data.tokenizer=<tokenizer.json> needs the `tokenizers` package") from e
    if not os.path.isfile(path):
      raise FileNotFoundError(f"data.tokenizer={path!r}: no such file (expected a Hugging Face "
                              "tokenizer.json)")
    try:
      self._tok = Tokenizer.from_file(path)
    except Exception as e:  # pylint: disable=broad-except  # `tokenizers` raises bare Exception
      raise ValueError(f"data.tokenizer={path!r} is not a valid Hugging Face tokenizer.json "
                       f"({e})") from None
    self.vocab_size = self._tok.get_vocab_size()
    self.name = path
    self.special_tokens = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
    # Plain text: the same model, normalizer and pre-tokenizer without the added tokens, which
    # `tokenizers` would otherwise match inside the raw text.
    with open(path, encoding="utf-8") as f:
      spec = json.load(f)
    spec["added_tokens"] = []
    self._plain = Tokenizer.from_str(json.dumps(spec))
    self._special_ids = np.asarray(sorted(self.special_tokens.values()), np.int32)

  def encode(self, text: str) -> np.ndarray:
    """int32 [n] ids of plain text (no added tokens, no post-processor tokens)."""
    _check_text(text)
    ids = np.asarray(self._plain.encode(text, add_special_tokens=False).ids, np.int32)
    hit = ids[np.isin(ids, self._special_ids)]
    if hit.size:   # the model's own vocabulary holds a special token's string as a regular token
      names = {i: t for t, i in self.special_tokens.items()}
      raise ValueError(f"tokenizer {self.name!r}: plain text {text[:80]!r} encoded to special "
                       f"token id {int(hit[0])} ({names[int(hit[0])]!r}); the model vocabulary "
                       "must not hold special tokens as regular tokens")
    return ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def special_id(self, name: str) -> int:
    if name not in self.special_tokens:
      raise _missing(self.name, name, self.special_tokens)
    return self.special_tokens[name]


def get_tokenizer(spec: str):
  """`bytes` or a path to a tokenizer.json."""
  if spec in ("bytes", "byte", ""):
    return ByteTokenizer()
  if spec.endswith(".json"):
    return HFTokenizer(spec)
  raise ValueError(f"data.tokenizer={spec!r}: expected 'bytes' or a path to a tokenizer.json")
