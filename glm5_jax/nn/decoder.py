"""One pre-norm GLM-5 decoder layer (docs/design.md §2):

    h = h + MLA_DSA(RMSNorm(h))
    h = h + FFN(RMSNorm(h))          FFN = dense SwiGLU or MoE
"""

from __future__ import annotations

import flax.linen as nn
import jax

from glm5_jax.nn import ffn
from glm5_jax.nn import mla as mla_lib
from glm5_jax.nn import moe as moe_lib
from glm5_jax.nn import norms

_ACT = ("activation_batch", "activation_length", "activation_embed")


class DecoderLayer(nn.Module):
  """Returns (h [b,t,d], top-k indices or None, indexer KL or None, expert load [E] or None,
  updated cache or None, routed expert ids [b,t,K] or None). `cache`, `cache_index`: this
  layer's KV pool (nn/kv_cache.py); `replay`: MoE experts to use (rollout routing replay,
  nn/moe.py `route`)."""
  cfg: "ModelConfig"  # noqa: F821
  moe: bool
  has_indexer: bool = True

  @nn.compact
  def __call__(self, h_btd, cos, sin, prev_indices=None, doc_start=None,
               with_indexer_loss=False, order=None, cache=None, cache_index=None, replay=None):
    cfg = self.cfg
    h_btd = nn.with_logical_constraint(h_btd, _ACT)
    x = norms.RMSNorm(cfg.rms_norm_eps, param_dtype=cfg.param_dtype, name="input_norm")(h_btd)
    attn, indices, kl, cache = mla_lib.MLA(cfg, self.has_indexer, name="attn")(
        x, cos, sin, prev_indices=prev_indices, doc_start=doc_start,
        with_indexer_loss=with_indexer_loss, order=order, cache=cache, cache_index=cache_index)
    h_btd = h_btd + attn.astype(h_btd.dtype)
    x = norms.RMSNorm(cfg.rms_norm_eps, param_dtype=cfg.param_dtype,
                      name="post_attention_norm")(h_btd)
    if self.moe:
      y, load, ids = moe_lib.MoE(cfg, name="moe")(x, replay)
    else:
      y, load, ids = ffn.MLP(cfg, cfg.intermediate_size, name="mlp")(x), None, None
    h_btd = h_btd + y.astype(h_btd.dtype)
    return nn.with_logical_constraint(h_btd, _ACT), indices, kl, load, cache, ids


def remat_layer(cfg):
  """DecoderLayer wrapped by the remat policy `cfg.remat`."""
  if cfg.remat == "none":
    return DecoderLayer
  policy = (None if cfg.remat == "full"
            else jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims)
  return nn.remat(DecoderLayer, policy=policy, static_argnums=(6,))
