"""Parameter-shared Multi-Token Prediction (docs/design.md §2.7; DeepSeek-V3 §2.2; GLM-5 §2).

One MTP module (HF checkpoint layer `num_hidden_layers`) applied D times with
the same weights. Step k = 1..D, h^0 = the main model's last hidden state
before the final norm, embedding and output head shared with the main model:

    h'^k_i = eh_proj([RMSNorm(Emb(t_{i+k}); enorm) ; RMSNorm(h^{k-1}_i; hnorm)])
    h^k_i  = DecoderLayer(h'^k_i)           (same positions p_i, causal)
    logits^k_i = lm_head(RMSNorm(h^k_i; head_norm))   predicts t_{i+k+1}

Positions i > t-1-k have no token t_{i+k}; they get token 0 and are masked out
of the loss (causal attention keeps them from influencing earlier positions).

Training runs the D steps in one forward pass (`run_steps`, called by nn/model.py); the
inference engine runs one step at a time over the MTP layer's own KV pool (`mtp_step`).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from glm5_jax.nn import context_parallel as cp
from glm5_jax.nn import decoder as decoder_lib
from glm5_jax.nn import embed as embed_lib
from glm5_jax.nn import layer_io
from glm5_jax.nn import norms
from glm5_jax.nn import params as P


def shift_tokens(tokens_bt, k: int, order=None):
  """tokens[:, i + k] of each entry's natural position i, zero-padded at the end: [b, t].

  order: int32 [t], context parallelism's layout of the row (nn/context_parallel.py), or
  None (natural order): the shift crosses chunk boundaries, so it runs in natural order.
  """
  if order is not None:
    return cp.permute(shift_tokens(cp.natural(tokens_bt, order), k), order)
  return jnp.pad(tokens_bt[:, k:], ((0, 0), (0, k)))


class MTPStep(nn.Module):
  """One application of the shared MTP module.

  Returns (h^k [b,t,d], normed h^k, LayerAux of its decoder layer, updated cache or None);
  `cache`: the MTP layer's KV pool (nn/kv_cache.py; `inputs.cache_index` its index), for
  the inference engine.
  """
  cfg: "ModelConfig"  # noqa: F821

  @nn.compact
  def __call__(self, emb_btd, h_prev_btd, inputs: layer_io.LayerInputs, cache=None):
    cfg, pd = self.cfg, self.cfg.param_dtype
    d = cfg.hidden_size
    e = norms.RMSNorm(cfg.rms_norm_eps, param_dtype=pd, name="enorm")(emb_btd)
    hh = norms.RMSNorm(cfg.rms_norm_eps, param_dtype=pd, name="hnorm")(h_prev_btd)
    eh_proj = P.param(self, "eh_proj", P.dense_init(cfg), (2 * d, d), ("mtp_concat", "embed"), pd)
    x = P.dense(self, "eh_proj", jnp.concatenate([e, hh], axis=-1),   # embedding FIRST
                eh_proj.astype(e.dtype))
    layer = decoder_lib.remat_layer(cfg)(cfg, moe=cfg.is_moe_layer(cfg.num_hidden_layers),
                                         name="layer")
    h, aux, cache = layer(x, inputs, cache=cache)
    normed = norms.RMSNorm(cfg.rms_norm_eps, param_dtype=pd, name="head_norm")(h)
    return h, normed, aux, cache


def run_steps(step: MTPStep, embed: embed_lib.Embed, head: embed_lib.Head, tokens_bt, h_btd,
              inputs: layer_io.LayerInputs, num_steps: int, return_logits: bool = True):
  """The D = num_steps chained steps of one forward pass over `tokens_bt` [b, t].

  One module `step` called D times (shared weights), step k from the embedding of the
  tokens k ahead and h^{k-1} (h^0 = h_btd, the main model's last hidden state before the
  final norm); `embed` and `head` are the main model's.

  Returns (logits float32 [D, b, t, V] or None without `return_logits`, normed h^k
  [D, b, t, d] (the head's input), LayerAux over the steps: indexer_kl [D] (with
  `inputs.with_indexer_loss`), expert_load [D, E] (an MoE MTP layer)).
  """
  h, normed, kls, loads = h_btd, [], [], []
  for k in range(1, num_steps + 1):
    h, normed_k, aux, _ = step(embed(shift_tokens(tokens_bt, k, inputs.order)), h, inputs)
    normed.append(normed_k)
    kls.append(aux.indexer_kl)
    loads.append(aux.expert_load)
  normed = jnp.stack(normed)
  return head(normed, return_logits), normed, layer_io.LayerAux(
      indexer_kl=jnp.stack(kls) if inputs.with_indexer_loss else None,
      expert_load=jnp.stack(loads) if loads[0] is not None else None)


def mtp_step(cfg, params, next_tokens_bt, h_prev_btd, positions_bt, mtp_cache, cache_index,
             collections=None):
  """One step of the shared MTP module over its own KV pool (the engine's drafts).

  The same modules as the training steps (Embed, MTPStep on their parameter subtrees of
  the GLM5 tree): row i combines the embedding of the token after position
  positions[i] with the hidden state h_prev at positions[i] (embedding first, paper §2.1).

  Returns (h [b,t,d] before the head norm, the head's input (head-normed h) [b,t,d],
  updated MTP pool): the engine applies the lm_head (`Head`) to the second. `collections`:
  more variable collections of the MTP module (the engine's streamed weights,
  nn/params.py `stream_collections`), or None.
  """
  inputs = layer_io.LayerInputs.create(cfg, positions_bt, cache_index=cache_index)
  emb = embed_lib.Embed(cfg).apply({"params": params["embed"]}, next_tokens_bt)
  variables = {"params": params["mtp"], **(collections or {})}
  h, normed, _, mtp_cache = MTPStep(cfg).apply(variables, emb, h_prev_btd.astype(emb.dtype),
                                               inputs, mtp_cache)
  return h, normed, mtp_cache
