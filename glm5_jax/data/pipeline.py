"""grain pipelines: shuffled documents packed into fixed-length rows, batched per process.

Rows carry `tokens`, `segment_ids` (1, 2, ... per document, 0 = padding) and
`positions` (restarting at 0 in every document), from grain's
ConcatThenSplitIterDataset; the model uses them so that neither MLA nor the
indexer attends across documents. The iterator's state is checkpointable
(`get_state` / `set_state`, or `grain.checkpoint.CheckpointSave`).
"""

from __future__ import annotations

import os

import grain
import grain.experimental as grain_exp
import numpy as np

from glm5_jax.data import corpus


def _decode(record: bytes):
  return {"tokens": np.frombuffer(record, np.int32).copy()}


def _rename(row):
  return {"tokens": row["tokens"], "segment_ids": row["tokens_segment_ids"],
          "positions": row["tokens_positions"]}


def packed_dataset(data_dir: str, split: str, *, seq_len: int, batch_per_process: int,
                   seed: int, process_index: int = 0, process_count: int = 1,
                   shuffle: bool = True, repeat: bool = True,
                   shard: str = "rows") -> grain.IterDataset:
  """IterDataset of {tokens, segment_ids, positions}: int32 [batch_per_process, seq_len].

  shard="rows": every process packs the same global batch and keeps its rows,
    so the global batch does not depend on the number of processes (a run on 2
    hosts equals the run on 1); every process reads the whole stream.
  shard="documents": each process reads every process_count-th document and
    packs its own rows (no redundant reading; the batches depend on the process
    count).
  """
  if shard not in ("rows", "documents"):
    raise ValueError(f"data.shard={shard!r}: expected 'rows' or 'documents'")
  if seq_len < 2:
    raise ValueError(f"seq_len={seq_len}: expected >= 2")
  if batch_per_process < 1:
    raise ValueError(f"batch per process={batch_per_process}: expected >= 1 (batch_size must be "
                     f">= the number of processes)")
  source = corpus.ShardSource(corpus.shard_paths(data_dir, split))
  ds = grain.MapDataset.source(source)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  if repeat:
    ds = ds.repeat()
  if shard == "documents":
    ds = ds[process_index::process_count]
  # A corpus with passkey documents (data/passkey.py) keeps its documents of exactly seq_len
  # whole, one per row (grain's default splits them at the current row's end).
  whole = (os.path.exists(os.path.join(data_dir, corpus.META))
           and corpus.load_meta(data_dir).get("whole_full_length_documents", False))
  packed = grain_exp.ConcatThenSplitIterDataset(ds.map(_decode).to_iter_dataset(),
                                                length_struct={"tokens": seq_len},
                                                split_full_length_features=not whole)
  packed = packed.map(_rename)
  if shard == "documents":
    return packed.batch(batch_per_process, drop_remainder=True)
  lo, hi = process_index * batch_per_process, (process_index + 1) * batch_per_process
  return (packed.batch(batch_per_process * process_count, drop_remainder=True)
          .map(lambda b: {k: v[lo:hi] for k, v in b.items()}))
