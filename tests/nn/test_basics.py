"""RMSNorm, LayerNorm and RoPE against float64 numpy references."""

import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.nn import norms, rope


def test_rms_norm_matches_float64(rng):
  x, w = rng.normal(size=(3, 5, 16)), rng.normal(size=16)
  ref = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * w
  got = norms.rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), 1e-6)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_layer_norm_matches_float64(rng):
  x, w, b = rng.normal(size=(4, 8)), rng.normal(size=8), rng.normal(size=8)
  ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6) * w + b
  got = norms.layer_norm(*(jnp.asarray(a, jnp.float32) for a in (x, w, b)), 1e-6)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def _rope_ref(x, pos, theta, interleave):
  """Complex-number RoPE (DeepSeek `apply_rotary_emb`), float64."""
  d = x.shape[-1]
  freqs = theta ** (-np.arange(0, d, 2) / d)
  rot = np.exp(1j * pos[..., None] * freqs)                # [b, t, d/2]
  rot = rot.reshape(rot.shape[:2] + (1,) * (x.ndim - 3) + rot.shape[2:])
  if interleave:
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * rot
    return np.stack([z.real, z.imag], -1).reshape(x.shape)
  z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * rot
  return np.concatenate([z.real, z.imag], -1)


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_matches_complex_rotation(rng, interleave):
  x = rng.normal(size=(2, 6, 3, 8))
  pos = rng.integers(0, 1000, size=(2, 6))
  cos, sin = rope.rope_angles(jnp.asarray(pos), 8, 1e4)
  got = rope.apply_rope(jnp.asarray(x, jnp.float32), cos, sin, interleave=interleave)
  np.testing.assert_allclose(got, _rope_ref(x, pos, 1e4, interleave), atol=2e-4)


def test_rope_dot_products_depend_only_on_offset(rng):
  q, k = rng.normal(size=(1, 1, 8)), rng.normal(size=(1, 1, 8))
  def dot(pq, pk):
    cq, sq = rope.rope_angles(jnp.array([[pq]]), 8, 1e4)
    ck, sk = rope.rope_angles(jnp.array([[pk]]), 8, 1e4)
    a = rope.apply_rope(jnp.asarray(q, jnp.float32), cq, sq, interleave=True)
    b = rope.apply_rope(jnp.asarray(k, jnp.float32), ck, sk, interleave=True)
    return float(jnp.sum(a * b))
  assert dot(7, 3) == pytest.approx(dot(104, 100), rel=1e-4)
