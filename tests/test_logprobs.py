"""Token log-probs (glm5_jax/logprobs.py) against log_softmax in float64 numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import logprobs


def _log_softmax64(logits):
  x = np.asarray(logits, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _gather(x, y):
  return np.take_along_axis(x, np.asarray(y)[..., None], axis=-1)[..., 0]


def _inputs(rng, b, t, d, v):
  """(hidden [b, t, d], head [d, v], tokens [b, t], float64 log_softmax(hidden @ head))."""
  h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
  y = jnp.asarray(rng.integers(0, v, (b, t)))
  return h, w, y, _log_softmax64(np.asarray(h, np.float64) @ np.asarray(w, np.float64))


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-6)])
def test_of_logits_is_the_log_softmax_at_the_token(rng, dtype, atol):
  logits = jnp.asarray(rng.normal(size=(2, 5, 37)) * 4, dtype)      # atol: float32 rounding
  y = rng.integers(0, 37, (2, 5))
  got = logprobs.of_logits(logits, jnp.asarray(y))
  assert got.dtype == jnp.float32
  want = _gather(_log_softmax64(np.asarray(logits.astype(jnp.float32))), y)
  np.testing.assert_allclose(got, want, rtol=0, atol=atol)


def test_with_entropy_adds_minus_sum_p_log_p(rng):
  logits = jnp.asarray(rng.normal(size=(3, 29)) * 3, jnp.float32)
  y = rng.integers(0, 29, (3,))
  logp, ent = logprobs.with_entropy(logits, jnp.asarray(y))
  ref = _log_softmax64(logits)
  np.testing.assert_allclose(logp, _gather(ref, y), atol=2e-6)
  np.testing.assert_allclose(ent, -(np.exp(ref) * ref).sum(-1), atol=1e-5)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_is_the_log_softmax_of_hidden_times_head(rng, chunk, strided):
  t = 13
  h, w, y, ref = _inputs(rng, 2, t, 8, 30)
  fn = lambda h, w: logprobs.chunked(logprobs.with_entropy, h, w, y, chunk_size=chunk,
                                     strided=strided)
  logp, ent = jax.jit(fn)(h, w)
  np.testing.assert_allclose(logp, _gather(ref, y), atol=2e-5)     # float32 logits of size ~10
  np.testing.assert_allclose(ent, -(np.exp(ref) * ref).sum(-1), atol=2e-5)
  # Gradients through the recomputed chunks equal the unchunked ones.
  full = lambda h, w: logprobs.with_entropy(jnp.einsum("btd,dv->btv", h, w), y)
  loss = lambda f: lambda h, w: jnp.sum(f(h, w)[0] * jnp.arange(t)) + jnp.sum(f(h, w)[1])
  for got, want in zip(jax.grad(loss(fn), (0, 1))(h, w), jax.grad(loss(full), (0, 1))(h, w)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_chunked_total_adds_each_chunks_scalar(rng):
  h, w, y, ref = _inputs(rng, 2, 11, 6, 17)
  m = (rng.random(y.shape) < 0.7).astype(np.float32)
  stat = lambda logits, y, m: -jnp.sum(logprobs.of_logits(logits, y) * m)
  got = logprobs.chunked(stat, h, w, y, jnp.asarray(m), chunk_size=4, total=True)
  np.testing.assert_allclose(got, -(_gather(ref, y) * m).sum(), rtol=1e-6)


def test_both_layouts_give_each_position_the_same_bits(rng):
  """A position's logits do not depend on which positions share its chunk (batch-invariant
  CPU numerics, conftest.py), so the layout changes no value, only the head's gradient."""
  h, w, y, _ = _inputs(rng, 3, 50, 20, 70)
  f = jax.jit(lambda s: logprobs.chunked(logprobs.with_entropy, h, w, y, chunk_size=7,
                                         strided=s), static_argnums=0)
  for a, c in zip(f(False), f(True)):
    np.testing.assert_array_equal(a, c)
