"""Rotary position embedding: interleaved (GPT-J / DeepSeek) and half-split (NeoX).

docs/design.md §2.1: theta_i = base^(-2i/d); interleaved pairs (x_2i, x_2i+1),
half-split pairs (x_i, x_{i+d/2}); no YaRN, no mscale (GLM-5).
"""

from __future__ import annotations

import jax.numpy as jnp


def rope_angles(positions_bt, dim: int, theta: float):
  """cos, sin [b, t, dim/2] in float32 for integer positions."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  ang = positions_bt.astype(jnp.float32)[..., None] * inv_freq
  return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos_btf, sin_btf, *, interleave: bool):
  """Rotates the last dim of x [b, t, (heads,) dim] by the angles [b, t, dim/2].

  Interleaved output keeps the interleaved layout (y_0, y_1, y_2, ...); HF
  returns the same values de-interleaved, a permutation applied to q and k
  alike, so every dot product is identical.
  """
  extra = x.ndim - cos_btf.ndim
  cos = cos_btf.reshape(cos_btf.shape[:2] + (1,) * extra + cos_btf.shape[2:])
  sin = sin_btf.reshape(sin_btf.shape[:2] + (1,) * extra + sin_btf.shape[2:])
  x32 = x.astype(jnp.float32)
  if interleave:
    x1, x2 = x32[..., 0::2], x32[..., 1::2]
    y = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
  else:
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    y = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return y.astype(x.dtype)
