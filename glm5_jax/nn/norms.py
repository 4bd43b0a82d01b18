"""RMSNorm and LayerNorm, computed in float32 (docs/design.md §2: "All norms compute in fp32")."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from glm5_jax.nn import params as P


def rms_norm(x, scale, eps: float):
  """x / sqrt(mean(x^2) + eps) * scale, in float32, cast back to x.dtype.

  Matches HF GlmMoeDsaRMSNorm: the normalised x is cast to the input dtype
  before the multiply by the weight.
  """
  x32 = x.astype(jnp.float32)
  y = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))
  return scale.astype(jnp.float32) * y.astype(x.dtype).astype(jnp.float32)


def layer_norm(x, scale, bias, eps: float):
  """(x - mean) / sqrt(var + eps) * scale + bias, in float32."""
  x32 = x.astype(jnp.float32)
  mu = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mu), axis=-1, keepdims=True)
  return (x32 - mu) * jnp.reciprocal(jnp.sqrt(var + eps)) * scale + bias


class RMSNorm(nn.Module):
  """RMSNorm with a learned scale; returns `dtype` (default: the input's)."""
  eps: float
  axis_name: str = "norm"
  param_dtype: str = "float32"
  dtype: str | None = None

  @nn.compact
  def __call__(self, x):
    scale = P.param(self, "scale", nn.initializers.ones, (x.shape[-1],), (self.axis_name,),
                    self.param_dtype)
    return rms_norm(x, scale, self.eps).astype(self.dtype or x.dtype)


class LayerNorm(nn.Module):
  """LayerNorm with scale and bias (the indexer's k_norm, docs/design.md §2.4)."""
  eps: float
  axis_name: str = "norm"
  param_dtype: str = "float32"

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    scale = P.param(self, "scale", nn.initializers.ones, (d,), (self.axis_name,), self.param_dtype)
    bias = P.param(self, "bias", nn.initializers.zeros, (d,), (self.axis_name,), self.param_dtype)
    return layer_norm(x, scale, bias, self.eps)
