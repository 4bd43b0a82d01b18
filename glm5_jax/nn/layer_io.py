"""What every decoder layer of a forward pass reads, and what it reports besides h.

    h, aux, cache = DecoderLayer(...)(h, inputs, prev_indices=..., cache=...)

`LayerInputs` holds what is the same for every layer of one forward pass (RoPE tables,
document starts, context parallelism's layout, the KV cache index, whether to compute the
indexer loss); `LayerAux` holds a layer's outputs besides the hidden states (DSA top-k,
indexer KL, expert load, routed experts). Both are pytrees: they pass through `nn.scan`
and `nn.remat` whole, and `with_indexer_loss` is static (part of the tree's structure, so
remat and jit see a Python bool).

Notation: b batch, t positions, p qk_rope_head_dim, k top-k slots, E experts, K experts
per token.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp

from glm5_jax.nn import context_parallel as cp
from glm5_jax.nn import rope


def document_starts(segment_ids_bt):
  """[b, t] int32: position where each token's (contiguous) document begins."""
  t = segment_ids_bt.shape[1]
  pos = jnp.arange(t, dtype=jnp.int32)
  change = jnp.concatenate([jnp.ones_like(segment_ids_bt[:, :1], bool),
                            segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1)
  return jax.lax.cummax(jnp.where(change, pos[None], 0), axis=1)


@flax.struct.dataclass
class LayerInputs:
  """The inputs every decoder layer of one forward pass reads.

  Attributes:
    cos, sin: float32 [b, t, p/2] RoPE tables of the tokens' positions.
    doc_start: int32 [b, t] where each token's document begins (packed rows), or None.
    order: int32 [t] context parallelism's layout (nn/context_parallel.py): entry i is
      natural position order[i] of its row; None: natural order.
    cache_index: where the chunk's tokens go in the KV pool (nn/kv_cache.py `CacheIndex`),
      or None without a cache.
    with_indexer_loss: also compute the indexer KL (static).
  """
  cos: jax.Array
  sin: jax.Array
  doc_start: jax.Array | None = None
  order: jax.Array | None = None
  cache_index: Any = None
  with_indexer_loss: bool = flax.struct.field(pytree_node=False, default=False)

  @classmethod
  def create(cls, cfg, positions_bt, segment_ids_bt=None, order=None, cache_index=None,
             with_indexer_loss: bool = False) -> "LayerInputs":
    """From the tokens' positions int32 [b, t] and document ids int32 [b, t] (or None);
    both in the layout `order`."""
    cos, sin = rope.rope_angles(positions_bt, cfg.qk_rope_head_dim, cfg.rope_theta)
    doc_start = None
    if segment_ids_bt is not None:
      doc_start = (document_starts(segment_ids_bt) if order is None else
                   cp.permute(document_starts(cp.natural(segment_ids_bt, order)), order))
    return cls(cos, sin, doc_start, order, cache_index, with_indexer_loss)


@flax.struct.dataclass
class LayerAux:
  """A layer's outputs besides the hidden states; None where the layer has none.

  Attributes (one layer; `layer_stack.run_stacks` returns them stacked over the layers):
    indexer_kl: float32 [] the indexer's KL to the attention (with `with_indexer_loss`,
      on layers with their own indexer).
    expert_load: float32 [E] fraction of routed slots per expert (MoE layers).
    routing: int32 [b, t, K] the experts each token was routed to (MoE layers).
    topk_indices: int32 [b, t, k] the DSA top-k key positions, -1 for empty slots (sparse
      attention; an IndexShare "shared" layer passes on the previous layer's).
  """
  indexer_kl: Any = None
  expert_load: Any = None
  routing: Any = None
  topk_indices: Any = None
