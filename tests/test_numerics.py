"""Batch-invariant CPU numerics (glm5_jax/numerics.py; conftest turns them on)."""

import zlib

import jax
import numpy as np
import pytest

from glm5_jax import numerics


def test_a_row_of_a_matmul_does_not_depend_on_the_batch():
  # Without the flag, XLA:CPU's YNNPACK dot gives this row 1.4e-6 apart at M=1 and M=64.
  if jax.default_backend() != "cpu":
    pytest.skip("an XLA:CPU property")
  assert numerics.is_set()
  rng = np.random.default_rng(zlib.crc32(b"test_a_row_of_a_matmul_does_not_depend_on_the_batch"))
  w = rng.standard_normal((64, 32)).astype(np.float32)
  x = rng.standard_normal((64, 64)).astype(np.float32)
  f = jax.jit(lambda x: x @ w)
  full = np.asarray(f(x))
  for m in (1, 2, 8, 32):
    np.testing.assert_array_equal(np.asarray(f(x[:m])), full[:m])


def test_rows_of_matmuls_of_at_least_min_invariant_rows_do_not_depend_on_the_batch():
  """The engine's lane floor (`MIN_INVARIANT_ROWS`) on `small`'s widest decode matmul
  ([M, 1536] @ [1536, 512], its dense FFN's down projection): M = 8 and 16 give each row
  the bits it has in a 64-row matmul (below 8 rows this VM's Eigen may not)."""
  if jax.default_backend() != "cpu":
    pytest.skip("an XLA:CPU property")
  name = b"test_rows_of_matmuls_of_at_least_min_invariant_rows_do_not_depend_on_the_batch"
  rng = np.random.default_rng(zlib.crc32(name))
  w = rng.standard_normal((1536, 512)).astype(np.float32)
  x = rng.standard_normal((64, 1536)).astype(np.float32)
  f = jax.jit(lambda x: x @ w)
  full = np.asarray(f(x))
  for m in (numerics.MIN_INVARIANT_ROWS, 2 * numerics.MIN_INVARIANT_ROWS):
    np.testing.assert_array_equal(np.asarray(f(x[:m])), full[:m])


def test_setting_it_after_jax_started_is_an_error(monkeypatch):
  jax.numpy.zeros(1).block_until_ready()           # the backend exists
  monkeypatch.setenv("XLA_FLAGS", "")
  with pytest.raises(RuntimeError, match="before JAX's first computation"):
    numerics.batch_invariant_cpu()
