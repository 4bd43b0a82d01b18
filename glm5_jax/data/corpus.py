"""A directory of text files -> tokenized ArrayRecord shards with a train/validation split.

Each record is one document: int32 token ids (`np.ndarray.tobytes`). The split
is by a hash of the file path, so it is stable when files are added. The default
corpus is the Python standard library's own source files on this machine.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig

import numpy as np

from glm5_jax.data import tokenizers

META = "meta.json"


def default_source_dir() -> str:
  return sysconfig.get_paths()["stdlib"]


def _files(src: str, pattern: str) -> list[str]:
  if not os.path.isdir(src):
    raise FileNotFoundError(f"data.source_dir={src!r} is not a directory")
  files = sorted(f for f in glob.glob(os.path.join(src, "**", pattern), recursive=True)
                 if os.path.isfile(f) and "site-packages" not in os.path.relpath(f, src))
  if not files:
    raise FileNotFoundError(f"data.source_dir={src!r} holds no files matching {pattern!r}")
  return files


def _is_validation(path: str, fraction: float) -> bool:
  h = int(hashlib.sha1(path.encode()).hexdigest()[:8], 16)
  return h / 2**32 < fraction


def prepare(src: str, out: str, *, tokenizer: str = "bytes", pattern: str = "*.py",
            val_fraction: float = 0.05, num_shards: int = 4, max_files: int = 0) -> dict:
  """Writes `out/{train,validation}-XXXXX-of-YYYYY.array_record` and `out/meta.json`."""
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top
  tok = tokenizers.get_tokenizer(tokenizer)
  files = _files(src, pattern)
  if max_files:
    files = files[:max_files]
  os.makedirs(out, exist_ok=True)
  writers = {split: [ArrayRecordWriter(os.path.join(out, f"{split}-{i:05d}-of-{num_shards:05d}"
                                                    ".array_record"), "group_size:1")
                     for i in range(num_shards)] for split in ("train", "validation")}
  stats = {split: {"documents": 0, "tokens": 0, "bytes": 0} for split in writers}
  for i, f in enumerate(files):
    with open(f, "rb") as fh:
      raw = fh.read()
    text = raw.decode("utf-8", errors="replace")
    ids = tok.encode(text)
    if len(ids) < 2:
      continue
    split = "validation" if _is_validation(os.path.relpath(f, src), val_fraction) else "train"
    writers[split][i % num_shards].write(ids.astype(np.int32).tobytes())
    s = stats[split]
    s["documents"] += 1
    s["tokens"] += int(len(ids))
    s["bytes"] += len(text.encode("utf-8"))
  for ws in writers.values():
    for w in ws:
      w.close()
  unigram = _unigram_entropy_bits(out, tok.vocab_size)
  meta = {"source_dir": src, "tokenizer": tokenizer, "vocab_size": tok.vocab_size,
          "pattern": pattern, "splits": stats, "train_unigram_entropy_bits_per_token": unigram}
  with open(os.path.join(out, META), "w") as fh:
    json.dump(meta, fh, indent=2)
  return meta


def shard_paths(data_dir: str, split: str) -> list[str]:
  paths = sorted(glob.glob(os.path.join(data_dir, f"{split}-*.array_record")))
  if not paths:
    raise FileNotFoundError(f"data.dir={data_dir!r} has no {split} shards; run "
                            "`python -m experiments.prepare_data` first")
  return paths


def load_meta(data_dir: str) -> dict:
  path = os.path.join(data_dir, META)
  if not os.path.exists(path):
    raise FileNotFoundError(f"data.dir={data_dir!r} has no {META}; run "
                            "`python -m experiments.prepare_data` first")
  with open(path) as fh:
    return json.load(fh)


def _unigram_entropy_bits(out: str, vocab: int) -> float:
  from array_record.python.array_record_module import ArrayRecordReader  # pylint: disable=g-import-not-at-top
  counts = np.zeros(vocab, np.int64)
  for p in shard_paths(out, "train"):
    r = ArrayRecordReader(p)
    for rec in r.read_all():
      counts += np.bincount(np.frombuffer(rec, np.int32), minlength=vocab)
    r.close()
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log2(p)).sum())
