"""An axis padded to whole blocks and walked block by block (chunked losses and log-probs,
blockwise attention, the indexer's KL loss).

  pad_to_multiple   the end of an axis filled with `value` up to a multiple of the block size
  chunks, unchunk   [b, t, ...] <-> [n, b, size, ...]: the chunks a `lax.map` / `lax.scan` walks
  rows, set_rows,   block i of an axis, read, written or added to, for a traced i (the body of
  add_rows          a `lax.fori_loop`)

Padded positions carry no weight: the caller masks them (a `value` such as -1 that marks
them, or a zero weight) and cuts them off after `unchunk`.

Notation: b batch, t positions, n chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pad_to_multiple(x, multiple: int, *, axis: int = 1, value=0):
  """`x` padded at the end of `axis` with `value` to the next multiple of `multiple` (`x`
  itself when it already is one)."""
  pad = (-x.shape[axis]) % multiple
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def chunks(x_bt, size: int, *, strided: bool = False, value=0):
  """x [b, t, ...] -> [n, b, size, ...], n = ceil(t / size), the end padded with `value`.

  contiguous: chunk j holds positions j * size, ..., (j + 1) * size - 1.
  strided:    chunk j holds positions j, j + n, j + 2n, ...: a sequence sharded over devices
              (context parallelism, nn/context_parallel.py) stays sharded within every
              chunk, where a contiguous chunk would sit on one device.
  """
  b, n = x_bt.shape[0], -(-x_bt.shape[1] // size)
  x = pad_to_multiple(x_bt, size, value=value)
  if strided:
    return jnp.moveaxis(x.reshape(b, size, n, *x_bt.shape[2:]), 2, 0)
  return x.reshape(b, n, size, *x_bt.shape[2:]).swapaxes(0, 1)


def unchunk(x_nbc, t: int, *, strided: bool = False):
  """The inverse of `chunks`: [n, b, size, ...] -> [b, t, ...] (the padding cut off)."""
  n, b, size = x_nbc.shape[:3]
  x = jnp.moveaxis(x_nbc, 0, 2) if strided else x_nbc.swapaxes(0, 1)
  return x.reshape(b, n * size, *x_nbc.shape[3:])[:, :t]


def rows(x, i, size: int, axis: int = 1):
  """x[:, i * size : (i + 1) * size] (along `axis`) for a traced block index i."""
  return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=axis)


def set_rows(x, i, size: int, block, axis: int = 1):
  """x with x[:, i * size : (i + 1) * size] = block (along `axis`), in place."""
  return jax.lax.dynamic_update_slice_in_dim(x, block.astype(x.dtype), i * size, axis=axis)


def add_rows(x, i, size: int, block, axis: int = 1):
  """x with x[:, i * size : (i + 1) * size] += block (along `axis`), in place."""
  return set_rows(x, i, size, rows(x, i, size, axis) + block.astype(x.dtype), axis)
