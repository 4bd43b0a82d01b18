"""The on-disk layout of sharded weight snapshots (glm5_jax/rl/orchestration/snapshots.py).

A version's directory holds one zarr3 array per leaf under `leaves/<escaped key path>`
(`leaf_dir`), chunked on the regular grid its shards form (`chunk_shape`), one chunk file
per shard (`chunk_file`); shard boxes are ((start, stop), ...) per dimension (`box`).
Manifests and the commit marker are written atomically (`write_json`); checksums are
SHA-256 of a shard's bytes (`sha256`).
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.parse
import uuid

import numpy as np

from glm5_jax.rl.orchestration.weights import _as_bytes as as_bytes


def name(path) -> str:
  return "/".join(path) or "<root>"


def leaf_dir(path) -> str:
  """leaves/<key path>, each component %-escaped (dots too: no '..' or hidden names)."""
  parts = [urllib.parse.quote(p, safe="").replace(".", "%2E") for p in path]
  return os.path.join("leaves", *(parts or ["%3Croot%3E"]))


def box(index, shape) -> tuple:
  """A tuple of slices (a shard's or device's index) -> ((start, stop), ...)."""
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def slices(box) -> tuple:
  return tuple(slice(a, b) for a, b in box)


def extent(box) -> tuple:
  return tuple(b - a for a, b in box)


def chunk_shape(boxes, shape, name) -> tuple:
  """The regular grid the distinct shard boxes form: their largest extent per dimension."""
  chunk = tuple(max([1] + [b - a for (a, b) in dims]) for dims in zip(*boxes)) if shape else ()
  for box in boxes:
    for (a, b), c, n in zip(box, chunk, shape):
      if a % c or b != min(a + c, n):
        raise ValueError(f"ShardedWeights.publish: {name}'s shards {sorted(boxes)} do not "
                         f"form a regular grid of {list(chunk)} blocks over {list(shape)}")
  return chunk


def zarr_spec(path: str, shape, dtype, chunk) -> dict:
  return {"driver": "zarr3", "kvstore": {"driver": "file", "path": path},
          "fill_missing_data_reads": False,           # a missing chunk is an error, and
          "store_data_equal_to_fill_value": True,     # an all-zero shard is still written
          "metadata": {"shape": list(shape), "data_type": np.dtype(dtype).name,
                       "chunk_grid": {"name": "regular",
                                      "configuration": {"chunk_shape": list(chunk)}},
                       "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]}}


def chunk_file(leaf_dir: str, box, chunk) -> str:
  """The zarr3 default chunk key of the chunk starting at `box`'s corner."""
  return os.path.join(leaf_dir, "c", *(str(a // c) for (a, _), c in zip(box, chunk)))


def sha256(a: np.ndarray) -> str:
  return hashlib.sha256(as_bytes(a)).hexdigest()


def write_json(path: str, obj) -> bytes:
  """Writes JSON under a temporary name, fsyncs, renames it into place; returns the bytes."""
  blob = json.dumps(obj).encode()
  tmp = f"{path}.{uuid.uuid4().hex}.tmp"
  with open(tmp, "wb") as f:
    f.write(blob)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  return blob


def remove(path: str) -> None:
  try:
    os.remove(path)
  except FileNotFoundError:
    pass
