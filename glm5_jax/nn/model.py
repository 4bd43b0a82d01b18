"""GLM5: the GLM-5 decoder (glm_moe_dsa) with parameter-shared MTP.

    h^0 = Emb(tokens)
    h^l = DecoderLayer_l(h^{l-1})          l < first_k_dense_replace: dense FFN, else MoE
                                           (scanned stacks of layers: layer_stack.py)
    logits = lm_head(RMSNorm(h^L))
    mtp_logits[k-1] = MTP step k (mtp.py), k = 1..mtp_num_steps, from h^L (pre-norm)

Parameter tree (plain pytree; every leaf created with logical axis names):
    embed/embedding [V, d]            lm_head/kernel [d, V]      final_norm/scale [d]
    dense_layers/layer_{j}/{input_norm, attn, post_attention_norm, mlp}   [layers, ...]
    moe_layers/layer_{j}/{input_norm, attn, post_attention_norm, moe}     [layers, ...]
        (j: position in the stack's repeating block; `layer_stack.layer_params(cfg, p, i)`
        gives decoder layer i's own tree)
    mtp/{enorm, hnorm, eh_proj, layer, head_norm}     (when num_nextn_predict_layers = 1)
"""

from __future__ import annotations

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.nn import embed as embed_lib
from glm5_jax.nn import layer_io
from glm5_jax.nn import layer_stack
from glm5_jax.nn import mtp as mtp_lib
from glm5_jax.nn import norms
from glm5_jax.nn import params as P


@flax.struct.dataclass
class ModelOutput:
  """What a forward pass returns.

  Attributes:
    logits: float32 [b, t, V], or None when `return_logits=False`.
    mtp_logits: float32 [D, b, t, V] (step k at position i predicts token
      i + k + 1), or None without MTP or logits.
    hidden: [b, t, d] final-normed hidden states (input of lm_head; the chunked
      cross entropy consumes these instead of logits).
    mtp_hidden: [D, b, t, d] head-normed MTP hidden states, or None.
    indexer_kl: float32 [L] per-layer indexer KL (0 on layers without an
      indexer), or None unless `with_indexer_loss`.
    mtp_indexer_kl: float32 [D] the MTP layer's indexer KL per step, or None.
    expert_load: float32 [L_moe, E] fraction of routed slots per expert.
    mtp_expert_load: float32 [D, E], or None.
    topk_indices: tuple of int32 [b, t, min(index_topk, s)] per layer (None for dense
      attention), only with `return_topk=True`.
    last_hidden: [b, t, d] the last layer's hidden states before the final norm (the
      MTP module's input).
    routing: int32 [L_moe, b, t, K] the experts each MoE layer used per token (with
      `return_routing=True`; the MTP layer's not included), or None.
  """
  logits: Any
  mtp_logits: Any
  hidden: Any
  mtp_hidden: Any
  indexer_kl: Any
  mtp_indexer_kl: Any
  expert_load: Any
  mtp_expert_load: Any
  topk_indices: Any = None
  last_hidden: Any = None
  routing: Any = None


def _check_tokens(cfg, tokens):
  if tokens.ndim != 2:
    raise ValueError(f"tokens: expected int [batch, seq], got shape {tokens.shape}")
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"tokens: expected an integer dtype, got {tokens.dtype}")
  if tokens.shape[1] > cfg.max_position_embeddings:
    raise ValueError(f"sequence length {tokens.shape[1]} > ModelConfig.max_position_embeddings="
                     f"{cfg.max_position_embeddings}")


class GLM5(nn.Module):
  """The GLM-5 causal LM. `GLM5(cfg).apply({'params': p}, tokens)` -> ModelOutput."""
  cfg: "ModelConfig"  # noqa: F821

  @nn.compact
  def __call__(self, tokens, positions=None, segment_ids=None, *,
               with_indexer_loss: bool = False,
               return_logits: bool = True, return_topk: bool = False, mtp: bool | None = None,
               order=None, cache=None, cache_index=None, return_routing: bool = False,
               routing_replay=None):
    """Forward pass; over a KV cache (the inference engine) `-> (ModelOutput, cache)`.

    Args:
      tokens: int32 [b, t].
      positions: int32 [b, t] RoPE positions (default 0..t-1; per document when packed).
      segment_ids: int32 [b, t] document ids of packed rows (contiguous runs);
        attention and the indexer never cross a document boundary.
      with_indexer_loss: also compute the per-layer indexer KL (dense form for
        `attention_type="dense"`, sparse form for "sparse"; docs/design.md §2.5).
      return_logits: False skips the [b, t, V] logits (use `hidden` with
        `losses.chunked_cross_entropy`).
      return_topk: return each layer's DSA top-k indices.
      mtp: run the MTP steps (default: whenever the config has MTP).
      order: int32 [t], context parallelism's layout (nn/context_parallel.py): entry i of
        every [b, t] input is natural position order[i] of the row. None: natural order.
      cache, cache_index: a KV pool (`layer_stack.init_cache`) and where this chunk's tokens
        go (`kv_cache.CacheIndex`; `positions` are then the tokens' absolute positions).
        The decoder layers write their rows and attend over the cached sequence; the MTP
        steps do not run (the engine runs the MTP layer over its own cache with
        `mtp.mtp_step`). Returns (ModelOutput, updated cache).
      return_routing: return each MoE layer's routed experts (`ModelOutput.routing`).
      routing_replay: int32 [L_moe, b, t, K] experts for the MoE layers to use instead of
        their own top-K (rollout routing replay: the engine's recorded routing; -1 rows route
        as usual). The routing weights still come from this forward's router.
    """
    cfg = self.cfg
    _check_tokens(cfg, tokens)
    if (cache is None) != (cache_index is None):
      raise ValueError("GLM5: pass cache and cache_index together (nn/kv_cache.py)")
    if cache is not None and (segment_ids is not None or order is not None or
                              with_indexer_loss):
      raise ValueError("GLM5 with a KV cache: segment_ids, order and with_indexer_loss are "
                       "training inputs; expected None / False")
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    inputs = layer_io.LayerInputs.create(cfg, positions, segment_ids, order, cache_index,
                                         with_indexer_loss)
    embed = embed_lib.Embed(cfg, name="embed")
    head = embed_lib.Head(cfg, name="lm_head")
    final_norm = norms.RMSNorm(cfg.rms_norm_eps, param_dtype=cfg.param_dtype, name="final_norm")
    h = embed(tokens)
    if routing_replay is not None:
      want = (layer_stack.num_moe_layers(cfg), b, t, cfg.num_experts_per_tok)
      if tuple(routing_replay.shape) != want:
        raise ValueError(f"routing_replay: shape {tuple(routing_replay.shape)}, expected "
                         f"[L_moe, b, t, K] = {list(want)}")
    h, aux, new_cache = layer_stack.run_stacks(
        self, cfg, h, inputs, return_topk=return_topk,
        cache=None if cache is None else cache["layers"], return_routing=return_routing,
        replay=routing_replay)
    hidden = final_norm(h)
    out = ModelOutput(
        logits=head(hidden, return_logits), mtp_logits=None, hidden=hidden, mtp_hidden=None,
        indexer_kl=aux.indexer_kl if with_indexer_loss else None, mtp_indexer_kl=None,
        expert_load=aux.expert_load, mtp_expert_load=None,
        topk_indices=aux.topk_indices if return_topk else None, last_hidden=h,
        routing=aux.routing)
    if cache is not None:
      return out, {**cache, "layers": new_cache}

    run_mtp = cfg.has_mtp if mtp is None else (mtp and cfg.has_mtp)
    if cfg.num_nextn_predict_layers and (run_mtp or self.is_initializing()):
      mtp_logits, mtp_hidden, mtp_aux = mtp_lib.run_steps(
          mtp_lib.MTPStep(cfg, name="mtp"), embed, head, tokens, h, inputs,  # one module, D calls
          max(cfg.mtp_num_steps, 1), return_logits)
      out = out.replace(mtp_logits=mtp_logits, mtp_hidden=mtp_hidden,
                        mtp_indexer_kl=mtp_aux.indexer_kl, mtp_expert_load=mtp_aux.expert_load)
    return out


def init_params(cfg, rng, *, on_host: bool = True):
  """Random parameters (unboxed plain arrays) for `cfg`.

  on_host=True draws them with numpy from the shapes of `jax.eval_shape` and
  the same rule the modules' initializers follow (`params.host_initializer`):
  no XLA compilation, which on CPU costs about a second per parameter for
  threefry. on_host=False runs `GLM5.init` under jit (the way to initialize
  directly into a sharding; see glm5_jax.sharding).

  Args:
    cfg: ModelConfig.
    rng: a jax PRNG key or an int seed.
    on_host: see above.
  """
  if not on_host:
    key = jax.random.PRNGKey(rng) if isinstance(rng, int) else rng
    variables = jax.jit(GLM5(cfg).init)(key, jnp.zeros((1, 8), jnp.int32))
    return nn.unbox(variables["params"])
  seed = rng if isinstance(rng, int) else np.asarray(jax.random.key_data(rng)).ravel().tolist()
  gen = np.random.default_rng(seed)
  shapes, _ = abstract_params(cfg)
  def draw(path, s):
    return jnp.asarray(P.host_initializer(path, cfg)(gen, s.shape), s.dtype)
  return jax.tree_util.tree_map_with_path(draw, shapes)


def abstract_params(cfg):
  """(ShapeDtypeStruct tree, logical PartitionSpec tree) with nothing allocated."""
  boxed = jax.eval_shape(lambda: GLM5(cfg).init(jax.random.PRNGKey(0),
                                                jnp.zeros((1, 8), jnp.int32)))["params"]
  return nn.unbox(boxed), nn.get_partition_spec(boxed)
