"""glm5_jax/row_reduce.py: each row's maximum is XLA's `jnp.max` bit for bit and its argmax
`jnp.argmax`'s index, on ties, signed zeros, infinities and NaNs (their payloads and signs),
at row lengths around the vector width; `log_softmax` and `logsumexp` with that maximum are
jax's, bit for bit; the paged block table's rows are the gather they replace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import logprobs
from glm5_jax import row_reduce
from glm5_jax.inference import sampling
from glm5_jax.nn import kv_cache
from pallas_kernels.sparse_attention import xla as sparse_xla

pytestmark = pytest.mark.skipif(not row_reduce.available(),
                                reason="row_reduce: no C++ compiler or not a CPU backend")

SPECIALS = np.concatenate([
    np.array([0.0, -0.0, np.inf, -np.inf, 1.5, -1.5], np.float32),
    np.array([0x7FC00001, 0xFFC00002, 0x7F800003, 0xFFFFFFFF, 0x00000001, 0x80000001],
             np.uint32).view(np.float32)])
# (NaNs of both signs and other payloads, a signalling one; the two smallest subnormals)


def _rows(rng, n_rows, v, p_special):
  """Rows with exact ties and special values at random places; some rows all zeros of both
  signs, all -inf, or all -0."""
  x = np.round(rng.standard_normal((n_rows, v)) * 2).astype(np.float32)         # ties
  special = rng.random((n_rows, v)) < p_special
  x = np.where(special, SPECIALS[rng.integers(0, len(SPECIALS), (n_rows, v))], x)
  x[0] = np.where(rng.random(v) < 0.5, -0.0, 0.0)
  x[1] = -np.inf
  x[2] = -0.0
  return x.astype(np.float32)


def _bits(x):
  return np.asarray(x).view(np.int32)


@pytest.mark.parametrize("v", [1, 15, 16, 17, 31, 32, 33, 100, 4096])
@pytest.mark.parametrize("p_special", [0.0, 0.01, 0.3])
def test_row_max_and_argmax_equal_xla(rng, v, p_special):
  x = jnp.asarray(_rows(rng, 8, v, p_special))
  np.testing.assert_array_equal(_bits(jax.jit(row_reduce.row_max)(x)),
                                _bits(jax.jit(lambda x: jnp.max(x, -1))(x)))
  np.testing.assert_array_equal(np.asarray(jax.jit(row_reduce.row_argmax)(x)),
                                np.asarray(jax.jit(lambda x: jnp.argmax(x, -1))(x)))
  np.testing.assert_array_equal(np.asarray(jax.jit(row_reduce.argmax_xla)(x)),
                                np.asarray(jnp.argmax(x, -1)))


def test_a_nan_anywhere_in_a_long_row(rng):
  """The first NaN (its sign cleared) wins wherever it lies, before or after a later NaN of
  the other sign, across vector lanes."""
  v = 32768
  x = rng.standard_normal((6, v)).astype(np.float32)
  nans = np.array([0x7FC00005, 0xFFC00009], np.uint32).view(np.float32)
  for r, (i, j) in enumerate([(5000, 17), (17, 5000), (v - 1, 0), (0, v - 1), (31, 32),
                              (16, 15)]):
    x[r, i], x[r, j] = nans[0], nans[1]
  x = jnp.asarray(x)
  np.testing.assert_array_equal(_bits(row_reduce.row_max(x)), _bits(jnp.max(x, -1)))
  np.testing.assert_array_equal(np.asarray(row_reduce.row_argmax(x)),
                                np.asarray(jnp.argmax(x, -1)))


def test_leading_axes_and_other_dtypes(rng):
  x = jnp.asarray(_rows(rng, 6, 40, 0.05).reshape(2, 3, 40))
  np.testing.assert_array_equal(_bits(row_reduce.row_max(x)), _bits(jnp.max(x, -1)))
  np.testing.assert_array_equal(np.asarray(row_reduce.row_argmax(x)),
                                np.asarray(jnp.argmax(x, -1)))
  xb = x.astype(jnp.bfloat16)              # not float32: XLA's reduction / a cast
  np.testing.assert_array_equal(np.asarray(row_reduce.row_max(xb)),
                                np.asarray(jnp.max(xb, -1)))
  np.testing.assert_array_equal(np.asarray(row_reduce.row_argmax(xb)),
                                np.asarray(jnp.argmax(xb, -1)))
  np.testing.assert_array_equal(np.asarray(sampling.greedy(x, kernel=True)),
                                np.asarray(sampling.greedy(x)))
  with pytest.raises(ValueError, match="row_reduce.row_argmax: x must have a last axis"):
    row_reduce.row_argmax(jnp.float32(1.0))


def test_log_softmax_and_logsumexp_with_the_kernel_maximum_are_jax_bitwise(rng):
  x = _rows(rng, 8, 300, 0.0) * 3.0
  x[3, :5] = -np.inf                                    # masked entries
  x[4, 7] = 88.0                                        # exp(x - max) underflows elsewhere
  x = jnp.asarray(x)
  y = jnp.asarray(rng.integers(0, 300, 8), jnp.int32)
  got = jax.jit(lambda x, y: logprobs.of_logits(x, y, row_reduce.row_max))(x, y)
  np.testing.assert_array_equal(_bits(got), _bits(jax.jit(logprobs.of_logits)(x, y)))
  np.testing.assert_array_equal(
      _bits(jax.jit(lambda x: sparse_xla.logsumexp(x, row_reduce.row_max))(x)),
      _bits(jax.jit(lambda x: jax.nn.logsumexp(x, axis=-1))(x)))
  # The maximum carries no gradient (its input's is stopped), as in jax's.
  g = jax.grad(lambda x: jnp.sum(logprobs.log_softmax(x, row_reduce.row_max)[:, 0]))(x[5:])
  want = jax.grad(lambda x: jnp.sum(jax.nn.log_softmax(x, -1)[:, 0]))(x[5:])
  np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6, atol=1e-7)


def test_block_rows_are_the_tables_gather(rng):
  table = rng.integers(0, 50, (3, 7)).astype(np.int32)
  j = np.arange(7 * 4)
  want = table[:, j // 4] * 4 + j % 4
  np.testing.assert_array_equal(np.asarray(kv_cache.block_rows(jnp.asarray(table), 4)), want)
