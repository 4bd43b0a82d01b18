"""Passkey documents: a number hidden at a chosen depth of filler code, asked for at the end.

The passkey-retrieval test (Mohtashami & Jaggi 2023, "Landmark Attention", §4.2), the simplest
of the needle-in-a-haystack tests that GLM-5 reports for long context (paper §2, RULER NIAH),
written so that a byte-level model trained on Python source can read it:

    <filler: lines of corpus source ...>
    PASSKEY = 48213                 the needle, at the line start nearest `depth` of the filler
    <... filler>
    assert PASSKEY == 48213         the query; the answer is the document's last tokens

A document is exactly `length` token ids. The filler is a contiguous run of one corpus split's
tokens (glm5_jax/data/corpus.py shards) that ends at a line end: evaluation documents take it
from the validation split, training documents (`write_mixed_corpus`) from the train split, so
the two never share filler. Document `index` of a stream draws from
`np.random.default_rng((seed, split salt, index))`: it is the same whatever else is drawn, and
the validation and train streams never share a random stream.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from glm5_jax.data import corpus
from glm5_jax.data import tokenizers

NEEDLE = "PASSKEY = {}\n"
QUERY = "\nassert PASSKEY == "
_SALT = {"validation": 1, "train": 2}          # disjoint random streams per split


@dataclasses.dataclass(frozen=True)
class Filler:
  """Token ids of one corpus split, documents concatenated, and where its lines end.

  Attributes:
    tokens: int32 [n].
    line_ends: int64 [m] sorted indices i where tokens[i] ends a line (a newline token).
  """
  tokens: np.ndarray
  line_ends: np.ndarray


@dataclasses.dataclass(frozen=True)
class PasskeyDoc:
  """One passkey document: tokens [length]; the answer is tokens[answer_start:]."""
  tokens: np.ndarray
  passkey: str
  depth: float                   # requested fraction of the filler before the needle
  needle_start: int              # index of the needle's first token
  answer_start: int


def _line_end_ids(tok, ids: np.ndarray) -> np.ndarray:
  """The ids among `ids` whose text ends with a newline (for bytes: 10)."""
  uniq = np.unique(ids)
  return np.asarray([i for i in uniq if tok.decode([int(i)]).endswith("\n")], np.int32)


def filler_from_ids(ids: np.ndarray, tok) -> Filler:
  ids = np.asarray(ids, np.int32)
  return Filler(ids, np.flatnonzero(np.isin(ids, _line_end_ids(tok, ids))))


def filler_from_corpus(data_dir: str, split: str, *, max_tokens: int = 0) -> Filler:
  """The `split` documents of a prepared corpus (in shard order), at most `max_tokens`."""
  if split not in _SALT:
    raise ValueError(f"split={split!r}: expected one of {sorted(_SALT)}")
  meta = corpus.load_meta(data_dir)
  source = corpus.ShardSource(corpus.shard_paths(data_dir, split))
  docs, n = [], 0
  for i in range(len(source)):
    docs.append(np.frombuffer(source[i], np.int32))
    n += len(docs[-1])
    if max_tokens and n >= max_tokens:
      break
  ids = np.concatenate(docs)[:max_tokens or None]
  return filler_from_ids(ids, tokenizers.get_tokenizer(meta["tokenizer"]))


def draw_passkey(rng: np.random.Generator, n_digits: int) -> str:
  """`n_digits` decimal digits, the first non-zero (a valid Python int literal)."""
  if n_digits < 1:
    raise ValueError(f"n_digits={n_digits}: expected >= 1")
  return str(rng.integers(1, 10)) + "".join(str(d) for d in rng.integers(0, 10, n_digits - 1))


def make_document(filler: Filler, tok, rng: np.random.Generator, *, length: int, depth: float,
                  n_digits: int = 5) -> PasskeyDoc:
  """filler[:p] + needle + filler[p:] + query + answer, exactly `length` tokens.

  p is the line start of the filler window nearest `depth * len(window)` (0 and the window's
  end are line starts: the window ends with a line end).
  """
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth={depth}: expected a fraction in [0, 1]")
  passkey = draw_passkey(rng, n_digits)
  needle = tok.encode(NEEDLE.format(passkey))
  query = tok.encode(QUERY)
  answer = tok.encode(passkey)
  n_fill = length - len(needle) - len(query) - len(answer)
  if n_fill < 0:
    raise ValueError(f"length={length}: a passkey document needs at least "
                     f"{length - n_fill} tokens")
  end = 0
  if n_fill:
    ends = filler.line_ends[filler.line_ends >= n_fill - 1]
    if not len(ends):
      raise ValueError(f"the filler ({len(filler.tokens)} tokens, {len(filler.line_ends)} "
                       f"lines) has no line-ended window of {n_fill} tokens")
    end = int(ends[rng.integers(len(ends))]) + 1
  window = filler.tokens[end - n_fill:end]
  local_ends = filler.line_ends[(filler.line_ends >= end - n_fill) & (filler.line_ends < end)]
  starts = np.unique(np.concatenate([[0], local_ends - (end - n_fill) + 1]))
  p = int(starts[np.argmin(np.abs(starts - depth * n_fill))])
  tokens = np.concatenate([window[:p], needle, window[p:], query, answer]).astype(np.int32)
  return PasskeyDoc(tokens, passkey, depth, needle_start=p, answer_start=length - len(answer))


def document(filler: Filler, tok, *, split: str, seed: int, index: int, length: int,
             depth: float | None = None, n_digits: int = 5) -> PasskeyDoc:
  """Document `index` of the (split, seed) stream; depth None draws it uniformly in [0, 1]."""
  if split not in _SALT:
    raise ValueError(f"split={split!r}: expected one of {sorted(_SALT)}")
  rng = np.random.default_rng((seed, _SALT[split], index))
  if depth is None:
    depth = float(rng.uniform())
  return make_document(filler, tok, rng, length=length, depth=depth, n_digits=n_digits)


def write_mixed_corpus(data_dir: str, out_dir: str, *, length: int, fraction: float,
                       seed: int = 0, n_digits: int = 5) -> dict:
  """A corpus directory: `data_dir`'s shards (linked) plus passkey documents in the train split.

  The passkey documents are `length` tokens long (give the training seq_len: the meta.json
  flag `whole_full_length_documents` makes data/pipeline.py keep a document of exactly seq_len
  whole in one row, so needle and query stay together),
  at uniform random depths, with train-split filler, and make up `fraction` of the train
  tokens. The validation split is unchanged. Returns the new meta.json.
  """
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top
  if not 0.0 < fraction < 1.0:
    raise ValueError(f"fraction={fraction}: expected a fraction of the train tokens in (0, 1)")
  meta = corpus.load_meta(data_dir)
  tok = tokenizers.get_tokenizer(meta["tokenizer"])
  train_tokens = meta["splits"]["train"]["tokens"]
  n_docs = math.ceil(fraction / (1.0 - fraction) * train_tokens / length)
  filler = filler_from_corpus(data_dir, "train", max_tokens=max(64 * length, 4_000_000))
  os.makedirs(out_dir, exist_ok=True)
  for split in ("train", "validation"):
    for p in corpus.shard_paths(data_dir, split):
      dst = os.path.join(out_dir, os.path.basename(p))
      if not os.path.lexists(dst):
        os.symlink(os.path.abspath(p), dst)
  w = ArrayRecordWriter(os.path.join(out_dir, "train-passkey-00000-of-00001.array_record"),
                        "group_size:1")
  n_bytes = 0
  for i in range(n_docs):
    doc = document(filler, tok, split="train", seed=seed, index=i, length=length,
                   n_digits=n_digits)
    w.write(doc.tokens.tobytes())
    n_bytes += len(tok.decode(doc.tokens).encode("utf-8"))
  w.close()
  out = json.loads(json.dumps(meta))
  s = out["splits"]["train"]
  s["documents"] += n_docs
  s["tokens"] += n_docs * length
  s["bytes"] += n_bytes
  out["whole_full_length_documents"] = True
  out["passkey"] = {"source": os.path.abspath(data_dir), "length": length, "fraction": fraction,
                    "documents": n_docs, "seed": seed, "n_digits": n_digits}
  with open(os.path.join(out_dir, corpus.META), "w") as f:
    json.dump(out, f, indent=2)
  return out
