"""One pre-norm GLM-5 decoder layer (docs/design.md §2):

    h = h + MLA_DSA(RMSNorm(h))
    h = h + FFN(RMSNorm(h))          FFN = dense SwiGLU or MoE
"""

from __future__ import annotations

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.nn import ffn
from glm5_jax.nn import layer_io
from glm5_jax.nn import mla as mla_lib
from glm5_jax.nn import moe as moe_lib
from glm5_jax.nn import norms

_ACT = ("activation_batch", "activation_length", "activation_embed")


class DecoderLayer(nn.Module):
  """Returns (h [b,t,d], LayerAux (nn/layer_io.py), updated cache or None).

  `inputs`: the forward pass's LayerInputs; `prev_indices`: the previous layer's top-k
  (an IndexShare "shared" layer reuses it); `cache`: this layer's KV pool (nn/kv_cache.py);
  `replay`: MoE experts to use (rollout routing replay, nn/moe.py `route`); `experts_stack`:
  the MoE's experts as its whole scanned stack and this layer's index in it (the engine's
  forward, nn/moe.py `select_dispatch`).
  """
  cfg: "ModelConfig"  # noqa: F821
  moe: bool
  has_indexer: bool = True

  @nn.compact
  def __call__(self, h_btd, inputs: layer_io.LayerInputs, prev_indices=None, cache=None,
               replay=None, experts_stack=None):
    cfg = self.cfg
    h_btd = checkpoint_name(nn.with_logical_constraint(h_btd, _ACT), "decoder_layer_input")
    x = norms.RMSNorm(cfg.rms_norm_eps, param_dtype=cfg.param_dtype, name="input_norm")(h_btd)
    attn, aux, cache = mla_lib.MLA(cfg, self.has_indexer, name="attn")(
        x, inputs, prev_indices=prev_indices, cache=cache)
    h_btd = h_btd + checkpoint_name(attn, "attention_out").astype(h_btd.dtype)
    x = norms.RMSNorm(cfg.rms_norm_eps, param_dtype=cfg.param_dtype,
                      name="post_attention_norm")(h_btd)
    if self.moe:
      y, load, ids = moe_lib.MoE(cfg, name="moe")(x, replay, cache is not None, experts_stack)
      aux = aux.replace(expert_load=load, routing=ids)
    else:
      y = ffn.MLP(cfg, cfg.intermediate_size, name="mlp")(x)
    h_btd = h_btd + y.astype(h_btd.dtype)
    return nn.with_logical_constraint(h_btd, _ACT), aux, cache


def _offload(*names):
  """Keep nothing on the device; move the values marked `names` to host memory in the
  forward and back before the backward (GLM-5 paper §2, activation offloading; MaxText's
  offloaded remat policies)."""
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(names),
      offload_src="device", offload_dst="pinned_host")


# config.remat -> the jax.checkpoint policy of one decoder layer ("none": no remat; a policy
# of None saves nothing and recomputes the layer in the backward). The layer marks its
# input "decoder_layer_input" and its attention output "attention_out" (`checkpoint_name`).
REMAT_POLICIES = {
    "full": lambda: None,
    "save_dots": lambda: jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "offload_inputs": lambda: _offload("decoder_layer_input"),
    "offload_inputs_attention": lambda: _offload("decoder_layer_input", "attention_out"),
}


def remat_layer(cfg):
  """DecoderLayer wrapped by the remat policy `cfg.remat` (`REMAT_POLICIES`). Its one static
  input, `LayerInputs.with_indexer_loss`, is a static field of the inputs' pytree: no
  `static_argnums`."""
  if cfg.remat == "none":
    return DecoderLayer
  return nn.remat(DecoderLayer, policy=REMAT_POLICIES[cfg.remat]())
