"""Parameter-shared Multi-Token Prediction (docs/design.md §2.7; DeepSeek-V3 §2.2; GLM-5 §2).

One MTP module (HF checkpoint layer `num_hidden_layers`) applied D times with
the same weights. Step k = 1..D, h^0 = the main model's last hidden state
before the final norm, embedding and output head shared with the main model:

    h'^k_i = eh_proj([RMSNorm(Emb(t_{i+k}); enorm) ; RMSNorm(h^{k-1}_i; hnorm)])
    h^k_i  = DecoderLayer(h'^k_i)           (same positions p_i, causal)
    logits^k_i = lm_head(RMSNorm(h^k_i; head_norm))   predicts t_{i+k+1}

Positions i > t-1-k have no token t_{i+k}; they get token 0 and are masked out
of the loss (causal attention keeps them from influencing earlier positions).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from glm5_jax.nn import decoder as decoder_lib
from glm5_jax.nn import norms
from glm5_jax.nn import params as P


def shift_tokens(tokens_bt, k: int):
  """tokens[:, i + k], zero-padded at the end: [b, t]."""
  return jnp.pad(tokens_bt[:, k:], ((0, 0), (0, k)))


class MTPStep(nn.Module):
  """One application of the shared MTP module.

  Returns (h^k [b,t,d], normed h^k, indices, kl, load, updated cache or None); `cache`,
  `cache_index`: the MTP layer's KV pool (nn/kv_cache.py), for the inference engine.
  """
  cfg: "ModelConfig"  # noqa: F821

  @nn.compact
  def __call__(self, emb_btd, h_prev_btd, cos, sin, doc_start=None, with_indexer_loss=False,
               order=None, cache=None, cache_index=None):
    cfg, pd = self.cfg, self.cfg.param_dtype
    d = cfg.hidden_size
    e = norms.RMSNorm(cfg.rms_norm_eps, param_dtype=pd, name="enorm")(emb_btd)
    hh = norms.RMSNorm(cfg.rms_norm_eps, param_dtype=pd, name="hnorm")(h_prev_btd)
    eh_proj = P.param(self, "eh_proj", P.dense_init(cfg), (2 * d, d), ("mtp_concat", "embed"), pd)
    x = jnp.concatenate([e, hh], axis=-1) @ eh_proj.astype(e.dtype)    # embedding FIRST
    layer = decoder_lib.remat_layer(cfg)(cfg, moe=cfg.is_moe_layer(cfg.num_hidden_layers),
                                         name="layer")
    h, indices, kl, load, cache, _ = layer(x, cos, sin, None, doc_start, with_indexer_loss,
                                           order, cache, cache_index)
    normed = norms.RMSNorm(cfg.rms_norm_eps, param_dtype=pd, name="head_norm")(h)
    return h, normed, indices, kl, load, cache
