"""Lightning indexer of DeepSeek Sparse Attention (DSA), GLM-5 flavour.

docs/design.md §2.4 (DeepSeek-V3.2 paper §2.1):

Steps
  1. q_I = (c_q W_Iq)_j                       [b, t, h_i, d_i]  c_q: MLA's normed q latent
  2. k_I = LayerNorm(x W_Ik; eps 1e-6)        [b, s, d_i]       one key per token
  3. RoPE on the FIRST qk_rope_head_dim dims of q_I and k_I (layout [rope | nope]);
     interleaved for GLM-5, half-split for DeepSeek-V3.2 (`indexer_rope_interleave`).
  4. w = (x W_Iw) * h_i^-0.5                   [b, t, h_i]      float32
  5. I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s] * d_i^-0.5)
  6. top-k of I over causal s, ties -> lower s (pallas_kernels.lightning_indexer),
     with min(index_topk, s) slots (`num_slots`): a query sees at most s keys, so the
     slots beyond s could only hold -1, and `index_topk` larger than the context
     would otherwise size every [b, t, k] buffer by it.

Gradient isolation: x and c_q are `stop_gradient`-ed before the indexer sees
them, so its parameters learn only from the indexer KL loss (docs/design.md §2.5, Megatron
`DSAttention.forward` detaches them) and the LM loss never reaches it (top-k
indices are integers). The indexer runs in float32, as in HF.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.nn import dsa
from glm5_jax.nn import norms
from glm5_jax.nn import params as P
from glm5_jax.nn import rope


class Indexer(nn.Module):
  """Returns the indexer's (q [b,t,h_i,d_i], k [b,t,d_i], w [b,t,h_i]), scales folded in."""
  cfg: "ModelConfig"  # noqa: F821

  @nn.compact
  def __call__(self, x_btd, cq_btr, cos, sin):
    cfg = self.cfg
    hi, di, rd = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    init = P.dense_init(cfg)
    wq_b = P.param(self, "wq_b", init, (cfg.q_lora_rank, hi, di),
                   ("q_lora", "index_heads", "index_head_dim"), cfg.param_dtype)
    wk = P.param(self, "wk", init, (cfg.hidden_size, di), ("embed", "index_head_dim"),
                 cfg.param_dtype)
    w_proj = P.param(self, "weights_proj", init, (cfg.hidden_size, hi),
                     ("embed", "index_heads"), cfg.param_dtype)
    # Gradient isolation (see module docstring).
    x = jax.lax.stop_gradient(x_btd).astype(jnp.float32)
    cq = jax.lax.stop_gradient(cq_btr).astype(jnp.float32)

    q = P.dense(self, "wq_b", cq, wq_b.astype(jnp.float32))
    k = norms.LayerNorm(eps=1e-6, axis_name="index_head_dim", param_dtype=cfg.param_dtype,
                        name="k_norm")(P.dense(self, "wk", x, wk.astype(jnp.float32)))
    il = cfg.indexer_rope_interleave
    q = jnp.concatenate([rope.apply_rope(q[..., :rd], cos, sin, interleave=il), q[..., rd:]], -1)
    k = jnp.concatenate([rope.apply_rope(k[..., :rd], cos, sin, interleave=il), k[..., rd:]], -1)
    w = P.dense(self, "weights_proj", x, w_proj.astype(jnp.float32)) * hi ** -0.5
    return q * di ** -0.5, k, w


def num_slots(index_topk: int, s: int) -> int:
  """Top-k slots over s keys: min(index_topk, s). Clamping drops only -1 slots."""
  return min(index_topk, s)


def select_topk(cfg, q, k, w, doc_start=None, limit=None, einsum=None, top_k=None):
  """int32 [b, t, num_slots(index_topk, s)] deterministic causal top-k (see pallas_kernels).

  doc_start [b, t]: first key of each query's document (packed rows); keys of
  other documents are never selected. limit [t]: last visible key of each query
  (default causal; context parallelism passes each query's natural position). einsum:
  what computes the scores' products, top_k what selects (the "xla" impl; defaults
  `jnp.einsum`, `lax.top_k`).
  """
  return dsa.topk_indices(
      q, k, w, num_slots(cfg.index_topk, k.shape[1]), impl=cfg.attention_impl,
      interpret=None, chunk_size=cfg.attention_chunk_size,
      start=doc_start, limit=limit, einsum=einsum, top_k=top_k)


def select_topk_paged(cfg, q, w, keys_pool, layer, read_bs, limit_bt, doc_start=None):
  """`select_topk` over each sequence's keys in a paged cache, for the CPU engine
  (`dsa.topk_indices_paged`: the scores straight from the pool, glm5_jax/cpu_dsa.py): the
  same indices as `select_topk` over `kv_cache.read`'s keys. None where that path does not
  apply (another impl, or see `dsa.topk_indices_paged`): the caller reads the keys."""
  if cfg.attention_impl != "xla":
    return None
  return dsa.topk_indices_paged(q, w, keys_pool, layer, read_bs, limit_bt,
                                num_slots(cfg.index_topk, read_bs.shape[1]), doc_start)
