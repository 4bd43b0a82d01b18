"""The vocabulary ends of the model: token embedding and lm_head.

One of each, shared by the main model and every MTP step (DeepSeek-V3 §2.2; GLM-5 §2).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from glm5_jax.nn import params as P


class Embed(nn.Module):
  """tokens int [.., t] -> h [.., t, d] in cfg.dtype."""
  cfg: "ModelConfig"  # noqa: F821

  @nn.compact
  def __call__(self, tokens_bt):
    cfg = self.cfg
    table = P.param(self, "embedding", P.dense_init(cfg), (cfg.vocab_size, cfg.hidden_size),
                    ("vocab", "embed"), cfg.param_dtype)
    return jnp.take(table, tokens_bt, axis=0).astype(cfg.dtype)


class Head(nn.Module):
  """lm_head: float32 logits [.., V] = h [.., d] @ kernel [d, V]."""
  cfg: "ModelConfig"  # noqa: F821

  @nn.compact
  def __call__(self, h, return_logits=True):
    cfg = self.cfg
    kernel = P.param(self, "kernel", P.dense_init(cfg), (cfg.hidden_size, cfg.vocab_size),
                     ("embed", "vocab"), cfg.param_dtype)
    if not return_logits:
      return None
    # Streamed (an engine's decode steps) up to 16 rows: above, the matmul is bound by its
    # multiply-adds more than by reading the kernel, and XLA's (no slice to copy here) wins.
    return P.dense(self, "kernel", h, kernel.astype(h.dtype), preferred_element_type=jnp.float32,
                   max_rows=16)
