"""Parameter creation with logical axis names (docs/design.md decision 1)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from glm5_jax import quant


def param(module: nn.Module, name: str, init, shape, axes, dtype, *, packed: bool = False):
  """Creates `module.<name>` with logical axis names `axes` (one per dim).

  A quantized weight (`quant.QArray`, the inference engine's INT4 / FP8 weights) is returned
  dequantized here, where the module uses it, or as it is with `packed=True` (the MoE gathers
  the experts it needs before dequantizing them).
  """
  if len(axes) != len(shape):
    raise ValueError(f"{name}: {len(axes)} axis names {axes} for shape {shape}")
  if module.has_variable("params", name):
    value = module.get_variable("params", name)
    if quant.is_qarray(value):
      if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name}: a quantized weight of shape {value.shape}, the module "
                         f"expects {tuple(shape)}")
      return value if packed else quant.dequantize(value, dtype)
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape),
                      jnp.dtype(dtype))


def dense_init(cfg):
  """HF `_init_weights`: normal(0, initializer_range) for every matrix."""
  return nn.initializers.normal(stddev=cfg.initializer_range)


def host_initializer(path, cfg):
  """numpy initializer following the modules' rule: `scale` -> 1, biases -> 0, else N(0, std).

  `path` is a jax key path; the rule looks at the leaf name only. Kept next to
  `dense_init` so that both stay one rule (tests/nn/test_model.py checks them).
  """
  name = str(getattr(path[-1], "key", path[-1]))
  if name == "scale":
    return lambda gen, shape: np.ones(shape, np.float32)
  if name in ("bias", "e_score_correction_bias"):
    return lambda gen, shape: np.zeros(shape, np.float32)
  return lambda gen, shape: gen.normal(0.0, cfg.initializer_range, shape).astype(np.float32)
