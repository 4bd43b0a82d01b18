"""grain pipelines: shuffled documents packed into fixed-length rows, batched per process.

Rows carry `tokens`, `segment_ids` (1, 2, ... per document, 0 = padding) and
`positions` (restarting at 0 in every document), from grain's
ConcatThenSplitIterDataset; the model uses them so that neither MLA nor the
indexer attends across documents. The iterator's state is checkpointable
(`get_state` / `set_state`, or `grain.checkpoint.CheckpointSave`).
"""

from __future__ import annotations

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
                   shuffle: bool = True, repeat: bool = True) -> grain.IterDataset:
  """IterDataset of {tokens, segment_ids, positions}: int32 [batch_per_process, seq_len]."""
  if seq_len < 2:
    raise ValueError(f"seq_len={seq_len}: expected >= 2")
  if batch_per_process < 1:
    raise ValueError(f"batch per process={batch_per_process}: expected >= 1 (batch_size must be "
                     f">= the number of processes)")
  source = grain.sources.ArrayRecordDataSource(corpus.shard_paths(data_dir, split))
  ds = grain.MapDataset.source(source)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  if repeat:
    ds = ds.repeat()
  ds = ds[process_index::process_count].map(_decode)
  packed = grain_exp.ConcatThenSplitIterDataset(ds.to_iter_dataset(),
                                                length_struct={"tokens": seq_len})
  return packed.map(_rename).batch(batch_per_process, drop_remainder=True)


def loss_mask(segment_ids, offset: int = 1):
  """[b, t] float: 1 where token i + offset exists in the same (non-padding) document."""
  seg = np.asarray(segment_ids)
  t = seg.shape[1]
  m = np.zeros(seg.shape, np.float32)
  if offset < t:
    same = (seg[:, offset:] == seg[:, :-offset]) & (seg[:, :-offset] != 0)
    m[:, : t - offset] = same
  return m
