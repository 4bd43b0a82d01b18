"""Reads and writes safetensors files one row range / one tensor at a time.

The safetensors format: 8 bytes little-endian header length N,
N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{...}}`, then the tensor bytes, offsets relative to byte 8 + N, row-major.

Reading parses the header itself (so a truncated file or a bad dtype is named with its
file and tensor before anything is loaded) and reads a range of rows of one tensor with
plain `readinto` (no mmap: what a process reads stays out of its resident set once
dropped). Writing streams tensors into a file whose header is written first, so a writer
holds one tensor at a time.
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple, Sequence

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")      # what a GLM-5 weight may be stored as
_NAMES = {v: k for k, v in DTYPES.items()}


class TensorInfo(NamedTuple):
  file: str
  dtype: str                 # safetensors name, e.g. "BF16"
  shape: tuple[int, ...]
  begin: int                 # absolute byte offsets in `file`
  end: int


def read_header(file: str) -> dict[str, TensorInfo]:
  """{tensor name: TensorInfo}; raises ValueError naming the file (and tensor) if damaged."""
  size = os.path.getsize(file)
  with open(file, "rb") as f:
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 0 or 8 + n > size:
      raise ValueError(f"{file}: {size} bytes, too short for its safetensors header "
                       f"({n} + 8 bytes): the file is truncated or not safetensors")
    try:
      meta = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"{file}: the safetensors header is not valid JSON ({e})") from e
  meta.pop("__metadata__", None)
  out = {}
  for name, m in meta.items():
    dtype, shape, (b, e) = m["dtype"], tuple(m["shape"]), m["data_offsets"]
    if dtype not in DTYPES:
      raise ValueError(f"{file}: tensor {name!r} has dtype {dtype!r}; known: {sorted(DTYPES)}")
    if 8 + n + e > size:
      raise ValueError(f"{file} is truncated: tensor {name!r} needs bytes up to {8 + n + e}, "
                       f"the file has {size}")
    if e - b != math.prod(shape) * DTYPES[dtype].itemsize:
      raise ValueError(f"{file}: tensor {name!r} has {e - b} bytes, its shape {list(shape)} "
                       f"and dtype {dtype} need {math.prod(shape) * DTYPES[dtype].itemsize}")
    out[name] = TensorInfo(file, dtype, shape, 8 + n + b, 8 + n + e)
  return out


def read_rows(info: TensorInfo, lo: int, hi: int) -> np.ndarray:
  """Rows [lo, hi) of the tensor's first axis (the whole tensor if it is 0-d)."""
  dtype = DTYPES[info.dtype]
  if not info.shape:
    lo, hi, shape = 0, 1, ()
  else:
    shape = (hi - lo,) + info.shape[1:]
  row = math.prod(info.shape[1:]) * dtype.itemsize
  out = np.empty(shape, dtype)
  view = memoryview(out.reshape(-1).view(np.uint8))
  with open(info.file, "rb", buffering=0) as f:
    f.seek(info.begin + lo * row)
    got = 0
    while got < len(view):
      k = f.readinto(view[got:])
      if not k:
        raise ValueError(f"{info.file} is truncated while reading its tensor")
      got += k
  return out


def dtype_name(dtype) -> str:
  return _NAMES[np.dtype(dtype)]


class Writer:
  """Writes `entries` [(name, shape, dtype)] to `file`; `add` them in that order."""

  def __init__(self, file: str, entries: Sequence[tuple[str, tuple, np.dtype]]):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in entries:
      nbytes = math.prod(shape) * np.dtype(dtype).itemsize
      header[name] = {"dtype": dtype_name(dtype), "shape": list(shape),
                      "data_offsets": [offset, offset + nbytes]}
      offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)                   # data starts 8-byte aligned
    self._todo = [(n, tuple(s), np.dtype(d)) for n, s, d in entries][::-1]
    self._f = open(file, "wb")
    self._f.write(len(text).to_bytes(8, "little") + text)
    self.file = file

  def add(self, name: str, x: np.ndarray):
    want = self._todo.pop()
    if (name, tuple(x.shape), x.dtype) != want:
      raise ValueError(f"{self.file}: writing {name} {x.shape} {x.dtype}, expected {want}")
    self._f.write(np.ascontiguousarray(x).reshape(-1).view(np.uint8).data)

  def close(self):
    self._f.close()
    if self._todo:
      raise ValueError(f"{self.file}: {len(self._todo)} tensors were not written")
