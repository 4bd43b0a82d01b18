"""The memory floor of a decode step: the bytes it must read over the machine's bandwidth.

A decode step of a model too large for the caches is bound by memory traffic: every weight
it uses is read at least once whatever the batch, and every request's KV-cache rows once.
Counted here for plain decoding (no MTP layer), from the weights as stored (a quantized
leaf counts its packed values and scales):

  weights  every leaf of the decoder layers except the routed experts (attention, indexer,
           dense FFN, shared expert, router, norms), the final norm and the output head;
           of the embedding table, the rows of the step's tokens;
  experts  the routed experts the step selects: the distinct experts of each MoE layer
           (union over the step's tokens), summed over layers, times one expert's bytes
           (gate, up and down);
  kv       per request and layer, with c keys visible: with DSA (`attention_type`
           "sparse") the indexer keys of all c positions in a layer with its own indexer
           ("full"; a "shared" layer reuses the previous one's selection) and the latent
           rows [c_kv | k_rope] of the min(c, index_topk) selected keys; dense attention
           reads all c latent rows.

floor = bytes / bandwidth; a measured step time t reaches floor / t of it.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

_EMBED, _EXPERTS, _MTP = "['embed']", "['experts']", "['mtp']"


def weight_bytes(params) -> dict:
  """Bytes of the decode step's weights by kind: {'dense': every leaf read whole, 'expert':
  one routed expert (gate + up + down), 'embed_row': one row of the embedding table,
  'expert_slots': MoE layers x experts}. The MTP layer is left out."""
  dense = embed_row = expert_total = 0
  expert_slots = None
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    name = jax.tree_util.keystr(path)
    nbytes = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    if name.startswith(_MTP):
      continue
    if name.startswith(_EMBED):
      embed_row = nbytes // x.shape[0]
    elif _EXPERTS in name:
      expert_total += nbytes
      if name.endswith("['w_gate']") or name.endswith("['w_gate'].values"):
        slots = int(np.prod(x.shape[:-2]))                  # [*repeats, E] before [d, I]
        expert_slots = slots if expert_slots is None else expert_slots + slots
    else:
      dense += nbytes
  expert = expert_total // expert_slots if expert_slots else 0
  return {"dense": dense, "expert": expert, "embed_row": embed_row,
          "expert_slots": expert_slots or 0}


def kv_bytes(cfg, context: int, kv_itemsize: int, index_itemsize: int = 4) -> int:
  """Cache bytes one request's decode step reads with `context` keys visible (module
  docstring), over every decoder layer."""
  row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * kv_itemsize
  if cfg.attention_type != "sparse":
    return cfg.num_hidden_layers * context * row
  own = sum(cfg.indexer_type(i) == "full" for i in range(cfg.num_hidden_layers))
  return (own * context * cfg.index_head_dim * index_itemsize
          + cfg.num_hidden_layers * min(context, cfg.index_topk) * row)


def decode_bytes(cfg, params, experts_used: int, contexts: Sequence[int],
                 kv_itemsize: int | None = None, index_itemsize: int = 4) -> dict:
  """Bytes one decode step must read (module docstring).

  experts_used: distinct routed experts the step selects, summed over its MoE layers.
  contexts: each request's visible keys (its position + 1).
  kv_itemsize: bytes per latent-cache element (default: `cfg.dtype`'s).
  Returns {'weights', 'experts', 'kv', 'total'} in bytes.
  """
  w = weight_bytes(params)
  if not 0 <= experts_used <= w["expert_slots"]:
    raise ValueError(f"experts_used={experts_used}: expected 0 .. {w['expert_slots']} (MoE "
                     f"layers x n_routed_experts)")
  if kv_itemsize is None:
    kv_itemsize = np.dtype(cfg.dtype).itemsize
  out = {"weights": w["dense"] + len(contexts) * w["embed_row"],
         "experts": experts_used * w["expert"],
         "kv": sum(kv_bytes(cfg, int(c), kv_itemsize, index_itemsize) for c in contexts)}
  out["total"] = sum(out.values())
  return out


def distinct_experts(routing_per_request: Sequence[np.ndarray]) -> int:
  """Distinct experts of one step summed over MoE layers: `routing_per_request` holds each
  request's routed experts int32 [L_moe, K] at that step."""
  ids = np.stack([np.asarray(r) for r in routing_per_request])          # [b, L, K]
  return int(sum(np.unique(ids[:, layer]).size for layer in range(ids.shape[1])))
