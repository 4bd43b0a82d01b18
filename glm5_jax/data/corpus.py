"""A directory of text files -> tokenized ArrayRecord shards with a train/validation split.

Each record is one document: int32 token ids (`np.ndarray.tobytes`). The split
is by a hash of the file path, so it is stable when files are added. The default
corpus is the Python standard library's own source files on this machine.

Only text is tokenized: a file holding a NUL byte (binary) or bytes that are not UTF-8 is
skipped, logged with its path and why, and listed in `meta.json` (`skipped`). A split that
ends up with no document is an error naming the counts, before `meta.json` is written.

`meta.json` records what the directory was prepared from (`prepared_from`: source
directory, file pattern, tokenizer, split) and each shard's size and record count
(`shards`). `ensure` refuses to reuse a directory prepared from other sources, and
`shard_paths` refuses a shard whose size or record count differs from the record (a
truncated or overwritten file), naming it, before any reader touches its contents. An
overwrite that keeps the size is caught by ArrayRecord's own per-chunk hashes when the
chunk is read; `ShardSource` names the shard and record in that error.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
import logging
import os
import sysconfig

import grain
import numpy as np

from glm5_jax.data import tokenizers

META = "meta.json"
# Fields of `prepared_from` that must match for a directory to be reused. val_fraction and
# max_files are recorded only: a directory prepared from a subset (tests, smoke runs) stays
# usable by a config that names the whole source.
CHECKED = ("source_dir", "tokenizer", "pattern")
_FIX = "prepare the data again (delete its data.dir or use a new one)"


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


MAX_SHARDS = 4096


def check_split_fields(*, val_fraction, num_shards, max_files, prefix: str = "") -> None:
  """Raises ValueError naming the field when a split setting is out of its range."""
  if not (isinstance(val_fraction, (int, float)) and not isinstance(val_fraction, bool)
          and 0 < val_fraction < 1):
    raise ValueError(f"{prefix}val_fraction={val_fraction!r}: expected a number in (0, 1) "
                     "(the fraction of files held out for validation)")
  for name, v, lo, hi in (("num_shards", num_shards, 1, MAX_SHARDS),
                          ("max_files", max_files, 0, 2**31 - 1)):
    if not (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi):
      raise ValueError(f"{prefix}{name}={v!r}: expected an integer in [{lo}, {hi}]"
                       + (" (0 = all files)" if name == "max_files" else ""))


def as_text(raw: bytes) -> tuple[str | None, str]:
  """(the text, "") for UTF-8 text; (None, why) for a binary or non-UTF-8 file."""
  nul = raw.find(b"\0")
  if nul >= 0:
    return None, f"binary (a NUL byte at offset {nul})"
  try:
    return raw.decode("utf-8"), ""
  except UnicodeDecodeError as e:
    return None, f"not UTF-8 ({e.reason} at offset {e.start})"


def fingerprint(src: str, *, tokenizer: str, pattern: str, val_fraction: float,
                max_files: int) -> dict:
  """What a data directory is prepared from (meta.json `prepared_from`)."""
  tok = "bytes" if tokenizer in ("bytes", "byte", "") else os.path.abspath(tokenizer)
  return {"source_dir": os.path.abspath(src or default_source_dir()), "pattern": pattern,
          "tokenizer": tok, "val_fraction": val_fraction, "max_files": max_files}


def prepare(src: str, out: str, *, tokenizer: str = "bytes", pattern: str = "*.py",
            val_fraction: float = 0.05, num_shards: int = 4, max_files: int = 0) -> dict:
  """Writes `out/{train,validation}-XXXXX-of-YYYYY.array_record` and `out/meta.json`."""
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top
  check_split_fields(val_fraction=val_fraction, num_shards=num_shards, max_files=max_files)
  tok = tokenizers.get_tokenizer(tokenizer)
  files = _files(src, pattern)
  if max_files:
    files = files[:max_files]
  os.makedirs(out, exist_ok=True)
  paths = {split: [os.path.join(out, f"{split}-{i:05d}-of-{num_shards:05d}.array_record")
                   for i in range(num_shards)] for split in ("train", "validation")}
  writers = {split: [ArrayRecordWriter(p, "group_size:1") for p in ps]
             for split, ps in paths.items()}
  stats = {split: {"documents": 0, "tokens": 0, "bytes": 0} for split in writers}
  records = {split: [0] * num_shards for split in writers}
  skipped = []
  for i, f in enumerate(files):
    with open(f, "rb") as fh:
      raw = fh.read()
    text, why = as_text(raw)
    if text is None:
      skipped.append({"path": os.path.relpath(f, src), "why": why})
      logging.warning("data: skipping %s: %s", f, why)
      continue
    ids = tok.encode(text)
    if len(ids) < 2:
      continue
    split = "validation" if _is_validation(os.path.relpath(f, src), val_fraction) else "train"
    writers[split][i % num_shards].write(ids.astype(np.int32).tobytes())
    records[split][i % num_shards] += 1
    s = stats[split]
    s["documents"] += 1
    s["tokens"] += int(len(ids))
    s["bytes"] += len(text.encode("utf-8"))
  for ws in writers.values():
    for w in ws:
      w.close()
  empty = [split for split, st in stats.items() if st["documents"] == 0]
  if empty:
    for ps in paths.values():
      for path in ps:
        os.remove(path)
    counts = ", ".join(f"{split} {st['documents']}" for split, st in stats.items())
    raise ValueError(
        f"data: the {' and '.join(empty)} split of {src!r} would hold no document ({counts} "
        f"of {len(files)} files matching {pattern!r}; {len(skipped)} skipped as not text, "
        f"val_fraction={val_fraction}, max_files={max_files}); use more files or another "
        "val_fraction")
  shards = {os.path.basename(p): {"bytes": os.path.getsize(p), "records": n}
            for split, ps in paths.items() for p, n in zip(ps, records[split])}
  unigram = _unigram_entropy_bits(paths["train"], tok.vocab_size)
  meta = {"source_dir": src, "tokenizer": tokenizer, "vocab_size": tok.vocab_size,
          "pattern": pattern, "splits": stats, "train_unigram_entropy_bits_per_token": unigram,
          "prepared_from": fingerprint(src, tokenizer=tokenizer, pattern=pattern,
                                       val_fraction=val_fraction, max_files=max_files),
          "shards": shards, "skipped": skipped}
  with open(os.path.join(out, META), "w") as fh:
    json.dump(meta, fh, indent=2)
  return meta


def shard_paths(data_dir: str, split: str) -> list[str]:
  """The split's shards, each checked against meta.json's record (size, record count)."""
  paths = sorted(glob.glob(os.path.join(data_dir, f"{split}-*.array_record")))
  if not paths:
    raise FileNotFoundError(f"data.dir={data_dir!r} has no {split} shards; run "
                            "`python -m experiments.prepare_data` first")
  recorded = (_read_meta(os.path.join(data_dir, META)).get("shards", {})
              if os.path.exists(os.path.join(data_dir, META)) else {})
  for p in paths:
    check_shard(p, recorded.get(os.path.basename(p)))
  return paths


class ShardSource:
  """grain's ArrayRecord source over several shards, whose read errors name the shard and
  the record (ArrayRecord's own say only "chunk data hash mismatch ... at byte N")."""

  def __init__(self, paths: list[str]):
    self._paths = list(paths)
    self._sources = [grain.sources.ArrayRecordDataSource([p]) for p in self._paths]
    self._starts = np.cumsum([0] + [len(s) for s in self._sources]).tolist()

  def __len__(self) -> int:
    return self._starts[-1]

  def __getitem__(self, index: int) -> bytes:
    k = bisect.bisect_right(self._starts, index) - 1
    try:
      return self._sources[k][index - self._starts[k]]
    except RuntimeError as e:
      raise ValueError(f"data shard {self._paths[k]!r}, record {index - self._starts[k]}: "
                       f"{e}; {_FIX}") from None

  def __repr__(self) -> str:
    return f"ShardSource({len(self._paths)} shards, {len(self)} records)"


def check_shard(path: str, record: dict | None = None) -> None:
  """Raises ValueError naming `path` if it is not the shard that was written.

  The size is compared first, without opening the file (a truncated file is never handed
  to the ArrayRecord reader); then the reader opens it and its record count is compared.
  """
  from array_record.python.array_record_module import ArrayRecordReader  # pylint: disable=g-import-not-at-top
  size = os.path.getsize(path)
  if record is not None and size != record["bytes"]:
    raise ValueError(f"data shard {path!r} is {size} bytes, but {record['bytes']} were written "
                     f"(meta.json): truncated or overwritten; {_FIX}")
  try:
    reader = ArrayRecordReader(path)
    n = reader.num_records()
    reader.close()
  except RuntimeError as e:
    raise ValueError(f"data shard {path!r} is not a readable ArrayRecord file ({e}); "
                     f"{_FIX}") from None
  want = None if record is None else record["records"]
  if (want is not None and n != want) or (want is None and n == 0 and size > 0):
    raise ValueError(f"data shard {path!r} holds {n} records, expected "
                     f"{want if want is not None else 'at least 1'}: truncated or corrupt; {_FIX}")


def _read_meta(path: str) -> dict:
  try:
    with open(path) as fh:
      return json.load(fh)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{path} is not valid JSON ({e}); {_FIX}") from None


def load_meta(data_dir: str) -> dict:
  path = os.path.join(data_dir, META)
  if not os.path.exists(path):
    raise FileNotFoundError(f"data.dir={data_dir!r} has no {META}; run "
                            "`python -m experiments.prepare_data` first")
  return _read_meta(path)


def ensure(data_dir: str, *, source_dir: str, tokenizer: str = "bytes", pattern: str = "*.py",
           val_fraction: float = 0.05, num_shards: int = 4, max_files: int = 0) -> dict:
  """Prepares `data_dir` on first use; refuses one prepared from other sources (`CHECKED`).

  source_dir "" is the default corpus (`default_source_dir`). A directory prepared before
  meta.json recorded its sources is accepted with a warning.
  """
  if not os.path.exists(os.path.join(data_dir, META)):
    return prepare(source_dir or default_source_dir(), data_dir, tokenizer=tokenizer,
                   pattern=pattern, val_fraction=val_fraction, num_shards=num_shards,
                   max_files=max_files)
  meta = load_meta(data_dir)
  if meta.get("kind") == "sft":
    raise ValueError(f"data.dir={data_dir!r} holds SFT conversations, not a pretraining corpus")
  now = fingerprint(source_dir, tokenizer=tokenizer, pattern=pattern,
                    val_fraction=val_fraction, max_files=max_files)
  was = meta.get("prepared_from")
  if was is None:
    logging.warning("data.dir=%r records no sources (prepared before meta.json held them); "
                    "assuming it was prepared from %s", data_dir, now)
    return meta
  if "skipped" not in meta:
    logging.warning("data.dir=%r was prepared before binary and non-UTF-8 files were skipped: "
                    "any such file is in it as text with replacement characters; delete it "
                    "to prepare it again", data_dir)
  for field in CHECKED:
    value = now[field]
    if was.get(field) != value:
      raise ValueError(
          f"data.dir={data_dir!r} was prepared with data.{field}={was.get(field)!r}, but the "
          f"config now gives data.{field}={value!r}; use a new data.dir or delete this one to "
          "prepare it again")
  return meta


def _unigram_entropy_bits(paths: list[str], vocab: int) -> float:
  from array_record.python.array_record_module import ArrayRecordReader  # pylint: disable=g-import-not-at-top
  counts = np.zeros(vocab, np.int64)
  for p in paths:
    r = ArrayRecordReader(p)
    for rec in r.read_all():
      counts += np.bincount(np.frombuffer(rec, np.int32), minlength=vocab)
    r.close()
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log2(p)).sum())
