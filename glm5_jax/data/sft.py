"""SFT data: conversation JSONL -> token ids + loss masks (ArrayRecord) -> packed grain rows.

  prepare(sources, out, tokenizer="bytes")   every conversation validated and rendered to ids
                                              with `chat.render` (never text re-tokenized);
                                              one record per conversation
  packed_dataset(out, "train", seq_len=...)   rows {tokens, loss_mask, segment_ids, positions}

Packing is grain's first-fit (`FirstFitPackIterDataset`): whole conversations go into
rows, never split across two; a conversation longer than `seq_len` cannot fit and is
dropped before packing; `dropped(meta, split, seq_len)` counts them (the loop reports it).
`loss_mask` is 1 on the tokens the assistant produced (see `chat.render`); the trainer
takes next-token targets where the *target* token carries loss.

The split is by a hash of each conversation's messages, so it is stable when files grow and
a conversation repeated across files always lands in the same split. `meta.json` records what the directory was prepared from (files, sizes,
tokenizer); `ensure` refuses to reuse a directory prepared from other sources.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

import grain
import grain.experimental as grain_exp
import numpy as np

from glm5_jax.data import chat
from glm5_jax.data import corpus

META = "meta.json"
SPLITS = ("train", "validation")


def _expand(sources) -> list[str]:
  if isinstance(sources, str):
    sources = [s for s in sources.split(",") if s]
  files = []
  for s in sources:
    found = sorted(glob.glob(os.path.expanduser(s)))
    if not found:
      raise FileNotFoundError(f"data.sources: {s!r} matches no file")
    files += found
  return files


def fingerprint(sources, tokenizer: str, val_fraction: float) -> dict:
  """What a data directory is prepared from: tokenizer, split and each file's path and size."""
  return {"tokenizer": tokenizer, "val_fraction": val_fraction,
          "files": [[os.path.abspath(f), os.path.getsize(f)] for f in _expand(sources)]}


def _split_of(key: str, val_fraction: float) -> str:
  h = int(hashlib.sha1(key.encode()).hexdigest()[:8], 16)
  return "validation" if h / 2**32 < val_fraction else "train"


def read_conversations(path: str):
  """Yields (where, record) for each non-empty line of a JSONL file; bad JSON names the line."""
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{n}"
      try:
        yield where, json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None


def encode_record(ids, loss_mask) -> bytes:
  """One conversation as int32 [2, n] bytes: ids over the 0/1 loss mask."""
  return np.stack([np.asarray(ids, np.int32), np.asarray(loss_mask, np.int32)]).tobytes()


def decode_record(record: bytes) -> dict:
  arr = np.frombuffer(record, np.int32).reshape(2, -1)
  return {"tokens": arr[0].copy(), "loss_mask": arr[1].copy()}


def prepare(sources, out: str, *, tokenizer: str = "bytes", val_fraction: float = 0.05,
            num_shards: int = 2, preserve_reasoning: bool = True) -> dict:
  """Renders every conversation of `sources` (JSONL paths or globs) into `out`'s shards."""
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top
  if not 0.0 <= val_fraction < 1.0:
    raise ValueError(f"data.val_fraction={val_fraction}: expected in [0, 1)")
  tok = chat.get_chat_tokenizer(tokenizer)
  os.makedirs(out, exist_ok=True)
  writers = {s: [ArrayRecordWriter(os.path.join(out, f"{s}-{i:05d}-of-{num_shards:05d}"
                                                    ".array_record"), "group_size:1")
                 for i in range(num_shards)] for s in SPLITS}
  lengths = {s: [] for s in SPLITS}
  loss_tokens = {s: 0 for s in SPLITS}
  try:
    for path in _expand(sources):
      for where, record in read_conversations(path):
        conv = chat.validate(record, where)
        r = chat.render(conv, tok, preserve_reasoning=preserve_reasoning)
        split = _split_of(json.dumps(conv["messages"], sort_keys=True), val_fraction)
        writers[split][len(lengths[split]) % num_shards].write(encode_record(r.ids,
                                                                             r.loss_mask))
        lengths[split].append(len(r.ids))
        loss_tokens[split] += int(np.sum(r.loss_mask))
  finally:
    for ws in writers.values():
      for w in ws:
        w.close()
  if not lengths["train"]:
    raise ValueError(f"data.sources={sources!r}: no training conversations")
  for s in SPLITS:
    np.save(os.path.join(out, f"{s}-lengths.npy"), np.asarray(lengths[s], np.int32))
  meta = {"kind": "sft", "vocab_size": tok.vocab_size, "val_fraction": val_fraction,
          "source": fingerprint(sources, tokenizer, val_fraction),
          "splits": {s: {"conversations": len(lengths[s]), "tokens": int(sum(lengths[s])),
                         "loss_tokens": loss_tokens[s]} for s in SPLITS}}
  with open(os.path.join(out, META), "w") as f:
    json.dump(meta, f, indent=2)
  return meta


def load_meta(data_dir: str) -> dict:
  path = os.path.join(data_dir, META)
  if not os.path.exists(path):
    raise FileNotFoundError(f"data.dir={data_dir!r} has no {META}: not a prepared SFT directory")
  with open(path) as f:
    meta = json.load(f)
  if meta.get("kind") != "sft":
    raise ValueError(f"data.dir={data_dir!r} holds a pretraining corpus, not SFT conversations")
  return meta


def ensure(data_dir: str, sources, *, tokenizer: str = "bytes", val_fraction: float = 0.05) -> dict:
  """Prepares `data_dir` on first use; refuses a directory prepared from other sources."""
  if not os.path.exists(os.path.join(data_dir, META)):
    return prepare(sources, data_dir, tokenizer=tokenizer, val_fraction=val_fraction)
  meta = load_meta(data_dir)
  now = fingerprint(sources, tokenizer, val_fraction) if sources else None
  if now and meta["source"] != now:
    raise ValueError(
        f"data.dir={data_dir!r} was prepared from {meta['source']}, but data.sources / "
        f"data.tokenizer / data.val_fraction now give {now}; use another data.dir or delete "
        "this one")
  return meta


def dropped(data_dir: str, split: str, seq_len: int) -> int:
  """Conversations of `split` longer than `seq_len` (they never enter a row)."""
  return int(np.sum(np.load(os.path.join(data_dir, f"{split}-lengths.npy")) > seq_len))


def _rename(row):
  return {"tokens": row["tokens"], "loss_mask": row["loss_mask"],
          "segment_ids": row["tokens_segment_ids"], "positions": row["tokens_positions"]}


def packed_dataset(data_dir: str, split: str, *, seq_len: int, batch_per_process: int,
                   seed: int, process_index: int = 0, process_count: int = 1,
                   shuffle: bool = True, repeat: bool = True,
                   num_packing_bins: int = 0) -> grain.IterDataset:
  """IterDataset of {tokens, loss_mask, segment_ids, positions}: int32 [batch, seq_len].

  Every process packs the same global batch and keeps its rows (as the pretraining
  pipeline's shard="rows"), so the batches do not depend on the process count.
  num_packing_bins: first-fit bins (0 = the global batch size).
  """
  if split not in SPLITS:
    raise ValueError(f"split={split!r}: expected one of {SPLITS}")
  if seq_len < 2 or batch_per_process < 1:
    raise ValueError(f"seq_len={seq_len}, batch per process={batch_per_process}: expected "
                     ">= 2 and >= 1")
  paths = sorted(glob.glob(os.path.join(data_dir, f"{split}-*.array_record")))
  lengths = np.load(os.path.join(data_dir, f"{split}-lengths.npy")) if paths else np.zeros(0)
  if not lengths.size:
    raise ValueError(f"data.dir={data_dir!r} has no {split} conversations "
                     f"(data.val_fraction={load_meta(data_dir)['val_fraction']})")
  if np.all(lengths > seq_len):
    raise ValueError(f"seq_len={seq_len}: every {split} conversation is longer (shortest "
                     f"{int(lengths.min())} tokens); raise config.seq_len")
  ds = grain.MapDataset.source(corpus.ShardSource(paths)).map(decode_record)
  ds = ds.filter(lambda r: len(r["tokens"]) <= seq_len)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  if repeat:
    ds = ds.repeat()
  global_batch = batch_per_process * process_count
  packed = grain_exp.FirstFitPackIterDataset(
      ds.to_iter_dataset(), length_struct={"tokens": seq_len, "loss_mask": seq_len},
      num_packing_bins=num_packing_bins or global_batch, seed=seed, shuffle_bins=shuffle)
  lo, hi = process_index * batch_per_process, (process_index + 1) * batch_per_process
  return (packed.map(_rename).batch(global_batch, drop_remainder=True)
          .map(lambda b: {k: v[lo:hi] for k, v in b.items()}))
