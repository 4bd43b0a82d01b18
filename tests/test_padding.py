"""pad_to_multiple against numpy's pad, on every axis and at exact multiples."""

import numpy as np
import pytest

from glm5_jax.padding import pad_to_multiple


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
