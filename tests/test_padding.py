"""glm5_jax/padding.py against numpy: pad_to_multiple on every axis and at exact multiples,
the chunk layouts position by position, block reads and writes at a traced index."""

import jax
import numpy as np
import pytest

from glm5_jax.padding import add_rows, chunks, pad_to_multiple, rows, set_rows, unchunk


@pytest.mark.parametrize("axis,multiple", [(0, 4), (1, 5), (2, 3), (-1, 8), (1, 1)])
def test_pads_the_end_of_the_axis_with_the_value(rng, axis, multiple):
  x = rng.normal(size=(3, 7, 5)).astype(np.float32)
  n = x.shape[axis]
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, -n % multiple)
  want = np.pad(x, widths, constant_values=-2.0)
  got = np.asarray(pad_to_multiple(x, multiple, axis=axis, value=-2.0))
  assert got.shape[axis] % multiple == 0 and got.shape[axis] - n < multiple
  np.testing.assert_array_equal(got, want)


def test_an_exact_multiple_is_returned_as_it_is(rng):
  x = rng.integers(0, 9, (2, 6))
  assert pad_to_multiple(x, 3) is x


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("t,size", [(7, 3), (8, 4), (5, 8), (1, 1)])
def test_chunks_hold_the_positions_their_layout_names(rng, t, size, strided):
  x = rng.normal(size=(2, t, 3)).astype(np.float32)
  n = -(-t // size)
  got = np.asarray(chunks(x, size, strided=strided, value=-1.0))
  assert got.shape == (n, 2, size, 3)
  for j in range(n):
    for i in range(size):
      pos = j + i * n if strided else j * size + i
      want = x[:, pos] if pos < t else np.full((2, 3), -1.0, np.float32)
      np.testing.assert_array_equal(got[j, :, i], want)
  np.testing.assert_array_equal(unchunk(got, t, strided=strided), x)


@pytest.mark.parametrize("axis", [1, 2])
def test_rows_set_rows_and_add_rows_touch_block_i_only(rng, axis):
  x = rng.normal(size=(2, 12, 12)).astype(np.float32)
  block = rng.normal(size=(2, 4, 12)).astype(np.float32)
  block = np.swapaxes(block, 1, 2) if axis == 2 else block
  i, size = 2, 4
  sl = [slice(None)] * 3
  sl[axis] = slice(i * size, (i + 1) * size)
  sl = tuple(sl)
  f = jax.jit(lambda x, i, b: (rows(x, i, size, axis), set_rows(x, i, size, b, axis),
                               add_rows(x, i, size, b, axis)))
  got_rows, got_set, got_add = (np.asarray(a) for a in f(x, i, block))
  np.testing.assert_array_equal(got_rows, x[sl])
  want = x.copy()
  want[sl] = block
  np.testing.assert_array_equal(got_set, want)
  want[sl] = x[sl] + block
  np.testing.assert_array_equal(got_add, want)
