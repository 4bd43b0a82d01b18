"""Multi-head Latent Attention (MLA) with DeepSeek Sparse Attention (DSA).

docs/design.md §2.2 (expanded form), §2.3 (absorbed form), §2.4 (indexer top-k).
Notation: b batch, t queries, s keys, h heads, r q_lora, c kv_lora,
n qk_nope, p qk_rope, v v_head, k top-k slots.

Weights are stored per head (docs/design.md decision 3):
  wq_b [r, h, n+p]   w_uk [c, h, n]   w_uv [c, h, v]   wo [h, v, d]
so that Muon Split orthogonalises each head's block on its own.

Two attention forms, equal in exact arithmetic:
  expanded  k_nope = c_kv W_UK, v = c_kv W_UV per head; MHA over them.
            Used for dense attention (DSA warm-up / pre-DSA training), blockwise
            (`mla_dense_attention`, nn/attention.py); `mla_expanded_attention`
            is its unblocked reference.
  absorbed  q~ = q_nope W_UK^T; MQA over the shared rows [c_kv | k_rope];
            out = (softmax . c_kv) W_UV. Used for DSA sparse attention, which
            gathers the top-k latent rows (pallas_kernels.sparse_attention), and
            for decode.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax import cpu_dsa
from glm5_jax import numerics
from glm5_jax import sharding as shd
from glm5_jax import stream_matmul
from glm5_jax.nn import attention
from glm5_jax.nn import context_parallel as cp
from glm5_jax.nn import dsa
from glm5_jax.nn import indexer as indexer_lib
from glm5_jax.nn import kv_cache
from glm5_jax.nn import layer_io
from glm5_jax.nn import norms
from glm5_jax.nn import params as P
from glm5_jax.nn import rope


def causal_mask(t: int, s: int):
  """[t, s] bool: query i (absolute position s - t + i) sees keys j <= s - t + i."""
  return jnp.arange(s)[None, :] <= (jnp.arange(t) + (s - t))[:, None]


def document_mask(doc_start_bt, s: int):
  """[b, t, s] bool: key j is in the query's document (j >= its document start)."""
  return jnp.arange(s)[None, None, :] >= doc_start_bt[..., None]


def topk_mask(indices_btk, s: int):
  """[b, t, s] bool: key j is among the selected indices (-1 slots ignored)."""
  onehot = jax.nn.one_hot(jnp.where(indices_btk >= 0, indices_btk, s), s + 1, dtype=jnp.bool_)
  return jnp.any(onehot, axis=-2)[..., :s]


def mla_expanded_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, mask_bts, scale):
  """Expanded (MHA) MLA attention. Returns o [b, t, h, v].

  q_nope [b,t,h,n], q_rope [b,t,h,p], c_kv [b,s,c], k_rope [b,s,p],
  w_uk [c,h,n], w_uv [c,h,v], mask_bts [b or 1, t, s] bool.
  """
  f32 = jnp.promote_types(q_nope.dtype, jnp.float32)   # float64 stays float64 in tests
  k_nope = jnp.einsum("bsc,chn->bshn", c_kv, w_uk)
  v = jnp.einsum("bsc,chv->bshv", c_kv, w_uv)
  logits = (jnp.einsum("bthn,bshn->bhts", q_nope, k_nope, preferred_element_type=f32)
            + jnp.einsum("bthp,bsp->bhts", q_rope, k_rope, preferred_element_type=f32)) * scale
  logits = jnp.where(mask_bts[:, None], logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhts,bshv->bthv", probs.astype(v.dtype), v)


def mla_dense_attention(cfg, q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, doc_start=None,
                        limit=None):
  """Causal (+ document) MLA attention, blockwise (nn/attention.py). o [b, t, h, v].

  Equals `mla_expanded_attention` with `causal_mask & document_mask`, with memory
  linear in t: the [t, s] logits are never materialised. Query i sees keys
  doc_start[b, i] <= j <= limit[b, i] (int32 [b, t]; defaults 0 and causal s - t + i).

  cfg.dense_attention_form picks what the keys are:
    "expanded"  per-head keys [k_nope | k_rope] and values for all s keys (s * h * (d + e)
                values, and their float32 gradients); the splash kernel
                (attention_impl="pallas" on TPU) runs it on the causal diagonal (t == s,
                limit None), anything else the XLA path.
    "absorbed"  queries [q_nope W_UK^T | q_rope] against the shared latent rows
                [c_kv | k_rope], values c_kv, then W_UV (`mla_absorbed_attention`'s form,
                blockwise, XLA path): keys and values stay s * (c + p) values, the dots
                are c + p and c wide instead of n + p and v. At GLM-5's shapes and 202,752
                keys the expanded keys and values are 13 GB in bfloat16 per sequence.
  """
  if cfg.dense_attention_form == "absorbed":
    kv = jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], axis=-1)
    u = attention.dense_attention(
        absorb_query(q_nope, q_rope, w_uk), kv, c_kv, scale=cfg.softmax_scale,
        start_bt=doc_start, limit_bt=limit, impl="xla", block_q=cfg.attention_chunk_size,
        block_k=cfg.attention_chunk_size)
    return jnp.einsum("bthc,chv->bthv", u, w_uv)
  b, s, h = c_kv.shape[0], c_kv.shape[1], q_nope.shape[2]
  k_nope = jnp.einsum("bsc,chn->bshn", c_kv, w_uk)
  v = jnp.einsum("bsc,chv->bshv", c_kv, w_uv)
  q = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)
  k_rope_h = jnp.broadcast_to(k_rope[:, :, None], (b, s, h, k_rope.shape[-1]))
  k = jnp.concatenate([k_nope, k_rope_h.astype(k_nope.dtype)], axis=-1)
  diagonal = limit is None and q.shape[1] == s
  return attention.dense_attention(
      q, k, v, scale=cfg.softmax_scale, start_bt=doc_start, limit_bt=limit,
      impl=cfg.attention_impl if diagonal else "xla", block_q=cfg.attention_chunk_size,
      block_k=cfg.attention_chunk_size, interpret=None)


def absorb_query(q_nope, q_rope, w_uk, einsum=jnp.einsum):
  """q~ = [q_nope W_UK^T | q_rope]: [b, t, h, c + p] (docs/design.md §2.3)."""
  q_lat = einsum("bthn,chn->bthc", q_nope, w_uk)
  return jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1)


def absorbed_latent(q_abs, kv, c: int, mask_bts, scale):
  """u [b, t, h, c]: MQA of absorbed queries over the latent rows kv = [c_kv | k_rope]
  [b, s, c + p] with a dense mask (the absorbed form before W_UV)."""
  acc = jnp.promote_types(q_abs.dtype, jnp.float32)
  logits = jnp.einsum("bthd,bsd->bhts", q_abs, kv, preferred_element_type=acc) * scale
  logits = jnp.where(mask_bts[:, None], logits, -jnp.inf)
  # A query that sees no key (a padding row of a cached chunk) gets 0, not NaN.
  probs = jnp.where(jnp.any(mask_bts, -1)[:, None, :, None], jax.nn.softmax(logits, axis=-1), 0.)
  return jnp.einsum("bhts,bsc->bthc", probs.astype(kv.dtype), kv[..., :c])


def mla_absorbed_attention(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, mask_bts, scale):
  """Absorbed (MQA) MLA attention with a dense mask; same result as the expanded form."""
  q_abs = absorb_query(q_nope, q_rope, w_uk)
  kv = jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], axis=-1)
  u = absorbed_latent(q_abs, kv, c_kv.shape[-1], mask_bts, scale)
  return jnp.einsum("bthc,chv->bthv", u, w_uv)


def mla_sparse_attention(cfg, q_nope, q_rope, kv, w_uk, w_uv, indices_btk):
  """DSA: absorbed MLA over the gathered top-k latent rows kv = [c_kv | k_rope] [b, s, c + p].

  Returns o [b, t, h, v].
  """
  q_abs = absorb_query(q_nope, q_rope, w_uk)
  u, _ = dsa.sparse_mla(
      q_abs, kv, indices_btk, v_dim=cfg.kv_lora_rank, scale=cfg.softmax_scale,
      impl=cfg.attention_impl, interpret=None,
      chunk_size=cfg.attention_chunk_size)
  return jnp.einsum("bthc,chv->bthv", u, w_uv)


def attend_cache(cfg, q_abs, q_i, w_i, doc_start, prev_indices, read_bs, limit_bt, kv_pool,
                 k_idx_pool, layer, cpu=False):
  """Absorbed queries over each sequence's view of the cache (nn/kv_cache.py), query i
  seeing positions 0 .. limit[b, i]: (u [b, t, h, c], before W_UV; the top-k indices
  [b, t, k] of sparse attention, or None). q_i, w_i: the indexer's queries and weights
  (None on a "shared" layer, which reuses prev_indices). cpu: the CPU engine's kernels (a
  streamed forward), the same numbers: the per-request products through
  `stream_matmul.einsum`; the indexer through `indexer.select_topk_paged` (its scores
  straight from the paged keys, glm5_jax/cpu_dsa.py) and sparse attention through
  `dsa.sparse_mla_paged` (the selected rows straight from the pool) where exact at these
  shapes, else over the gathered cache with the CPU top-k."""
  einsum = stream_matmul.einsum if cpu else jnp.einsum
  c = cfg.kv_lora_rank
  if cfg.attention_type == "dense":
    kv = kv_cache.read(kv_pool, read_bs, layer).astype(q_abs.dtype)
    # Few queries over a long cache: the absorbed (MQA) form reads the latent rows once.
    mask_bts = jnp.arange(kv.shape[1])[None, None, :] <= limit_bt[..., None]
    return absorbed_latent(q_abs, kv, c, mask_bts, cfg.softmax_scale), None
  indices = prev_indices
  if q_i is not None and cpu:
    indices = indexer_lib.select_topk_paged(cfg, q_i, w_i, k_idx_pool, layer, read_bs,
                                            limit_bt, doc_start)
  if q_i is not None and (not cpu or indices is None):
    k_i = kv_cache.read(k_idx_pool, read_bs, layer)
    indices = indexer_lib.select_topk(cfg, q_i, k_i, w_i, doc_start, limit_bt, einsum,
                                      cpu_dsa.top_k if cpu else None)
  if indices is None:
    raise ValueError("a 'shared' indexer layer needs the previous full layer's top-k")
  u = dsa.sparse_mla_paged(cfg, q_abs, kv_pool, layer, read_bs, indices) if cpu else None
  if u is not None:
    return u, indices
  kv = kv_cache.read(kv_pool, read_bs, layer).astype(q_abs.dtype)
  u, _ = dsa.sparse_mla(q_abs, kv, indices, v_dim=c, scale=cfg.softmax_scale,
                        impl=cfg.attention_impl, interpret=None,
                        chunk_size=cfg.attention_chunk_size, einsum=einsum)
  return u, indices


def _lanes_alike(*xs):
  """Whether every lane (row of axis 0) of each x equals lane 0, bit for bit."""
  def alike(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      x = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    return jnp.all(x == x[:1])
  return jnp.all(jnp.stack([alike(x) for x in xs]))


def mirrored_lanes(fn, lane_args):
  """fn(*lane_args), whose outputs are [b, ...] per lane (axis 0 of every lane arg, None
  allowed). In a call of at most `numerics.MIN_INVARIANT_ROWS` lanes (the lanes a lone
  request is padded to) whose lanes' arguments all equal lane 0's bit for bit (its idle
  lanes mirroring it: inference/steps.py `mirror_idle`), fn runs on lane 0 alone and its
  outputs are broadcast: a lane's result never depends on the other lanes, so the bits are
  the same, and a lone request's attention reads its cache once, not once per lane
  (`small`, one request at 1K context: 17 -> 10 ms a decode step, docs/benchmarks.md).
  Wider calls, and calls under a mesh (lanes sharded), run fn on every lane: the check's
  conditional cost a 16-lane step at 1K context ~3 ms."""
  present = [a for a in lane_args if a is not None]
  b = present[0].shape[0]
  if not 1 < b <= numerics.MIN_INVARIANT_ROWS or shd.active_mesh() is not None:
    return fn(*lane_args)

  def one():
    out = fn(*(None if a is None else a[:1] for a in lane_args))
    return jax.tree.map(lambda o: jnp.broadcast_to(o, (b,) + o.shape[1:]), out)

  return jax.lax.cond(_lanes_alike(*present), one, lambda: fn(*lane_args))


class MLA(nn.Module):
  """MLA + DSA for one layer.

  Returns (out [b,t,d], LayerAux with the top-k indices and the indexer KL (nn/layer_io.py),
  updated cache or None).

  Attributes:
    cfg: ModelConfig.
    has_indexer: False on IndexShare "shared" layers, which reuse `prev_indices`.
  """
  cfg: "ModelConfig"  # noqa: F821
  has_indexer: bool = True

  @nn.compact
  def __call__(self, x_btd, inputs: layer_io.LayerInputs, *, prev_indices=None, cache=None):
    """inputs.order: context parallelism's row layout (nn/context_parallel.py): the keys
    (latent rows, indexer keys) are gathered back to natural order and query i sees keys
    doc_start[i] <= j <= order[i].

    cache, inputs.cache_index: this layer's pool {'kv', 'k_idx'} (its stack's, [R, N, x],
    with `cache_index.layer` its entry) and where the new tokens go (nn/kv_cache.py). The
    new rows are written first; attention and the indexer then run over each sequence's
    view of the pool, query i seeing positions 0 .. limit[b, i] (`_over_cache`). The third
    output is the updated pool (None without a cache).
    """
    cos, sin, doc_start, order = inputs.cos, inputs.sin, inputs.doc_start, inputs.order
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    h, n, p, v = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                  cfg.v_head_dim)
    r, c, d = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.hidden_size
    init, pd = P.dense_init(cfg), cfg.param_dtype
    wq_a = P.param(self, "wq_a", init, (d, r), ("embed", "q_lora"), pd)
    wq_b = P.param(self, "wq_b", init, (r, h, n + p), ("q_lora", "heads", "qk_head_dim"), pd)
    wkv_a = P.param(self, "wkv_a", init, (d, c + p), ("embed", "kv_lora_rope"), pd)
    w_uk = P.param(self, "w_uk", init, (c, h, n), ("kv_lora", "heads", "qk_nope_head_dim"), pd)
    w_uv = P.param(self, "w_uv", init, (c, h, v), ("kv_lora", "heads", "v_head_dim"), pd)
    wo = P.param(self, "wo", init, (h, v, d), ("heads", "v_head_dim", "embed"), pd)
    w_uk, w_uv = P.laid_out(self, "w_uk", w_uk), P.laid_out(self, "w_uv", w_uv)
    wq_b, w_uk, w_uv = wq_b.astype(dt), w_uk.astype(dt), w_uv.astype(dt)

    x = x_btd.astype(dt)
    # docs/design.md §2 gotcha: q_a_layernorm / kv_a_layernorm use eps 1e-6, not rms_norm_eps.
    c_q = norms.RMSNorm(1e-6, "q_lora", pd, dt, name="q_norm")(
        P.dense(self, "wq_a", x, wq_a.astype(dt)))
    q = P.dense(self, "wq_b", c_q, wq_b)
    q_nope, q_rope = q[..., :n], rope.apply_rope(q[..., n:], cos, sin,
                                                 interleave=cfg.rope_interleave)
    ckv = P.dense(self, "wkv_a", x, wkv_a.astype(dt))
    c_kv = norms.RMSNorm(1e-6, "kv_lora", pd, dt, name="kv_norm")(ckv[..., :c])
    k_rope = rope.apply_rope(ckv[..., c:], cos, sin, interleave=cfg.rope_interleave)
    # Keys: the compressed rows (latent + rope key), all of them, in natural order.
    kv = jnp.concatenate([c_kv, k_rope.astype(c_kv.dtype)], axis=-1)
    if cache is not None:
      return self._over_cache(x_btd, c_q, q_nope, q_rope, kv, w_uk, w_uv, wo, inputs,
                              prev_indices, cache)
    kv = cp.gather_keys(kv, order)
    limit = None if order is None else jnp.broadcast_to(order, x.shape[:2])
    c_kv, k_rope = kv[..., :c], kv[..., c:]
    n_ctx = 1 if order is None else cp.size()
    if order is not None and doc_start is None:
      doc_start = jnp.zeros(x.shape[:2], jnp.int32)

    def local(fn, queries, keys):
      """fn over each context shard's own queries (per_shard), or over all of them."""
      return cp.per_shard(fn, n_ctx, queries, keys) if n_ctx > 1 else fn(*queries, *keys)

    indices = prev_indices
    q_i = k_i = w_i = None
    if self.has_indexer:
      q_i, k_i, w_i = indexer_lib.Indexer(cfg, name="indexer")(x_btd, c_q, cos, sin)
      k_i = cp.gather_keys(k_i, order)
      self.sow("intermediates", "indexer_qkw", (q_i, k_i, w_i))   # for tests / analysis
      if cfg.attention_type == "sparse":
        indices = local(lambda qi, wi, st, li, ki: indexer_lib.select_topk(
            cfg, qi, ki, wi, st, li), (q_i, w_i, doc_start, order), (k_i,))

    if cfg.attention_type == "dense":
      o = local(lambda qn, qr, st, li, *kw: mla_dense_attention(cfg, qn, qr, *kw, st, li),
                (q_nope, q_rope, doc_start, limit), (c_kv, k_rope, w_uk, w_uv))
    else:
      if indices is None:
        raise ValueError("a 'shared' indexer layer needs the previous full layer's top-k")
      o = local(lambda qn, qr, idx, *kw: mla_sparse_attention(cfg, qn, qr, *kw, idx),
                (q_nope, q_rope, indices), (kv, w_uk, w_uv))
    out = P.dense(self, "wo", o, wo.astype(dt))

    kl = None
    if inputs.with_indexer_loss and self.has_indexer:
      q_abs = absorb_query(q_nope, q_rope, w_uk)
      kl_fn = dsa.indexer_kl_dense if cfg.attention_type == "dense" else dsa.indexer_kl_sparse
      kl = local(lambda qa, qi, wi, st, li, idx, kv_, ki: kl_fn(
          qa, kv_, qi, ki, wi, scale=cfg.softmax_scale, indices=idx,
          chunk_size=cfg.attention_chunk_size, doc_start=st, limit=li),
                 (q_abs, q_i, w_i, doc_start, limit, indices), (kv, k_i))
    return out, layer_io.LayerAux(indexer_kl=kl, topk_indices=indices), None

  def _over_cache(self, x_btd, c_q, q_nope, q_rope, kv, w_uk, w_uv, wo, inputs, prev_indices,
                  cache):
    """The forward over a KV cache: the new rows written first, then `attend_cache` over
    each sequence's view (once for a lone request's mirrored lanes: `mirrored_lanes`)."""
    cfg, idx = self.cfg, inputs.cache_index
    at = idx.layer
    new_cache = {**cache, "kv": kv_cache.write(cache["kv"], kv, idx.write_bt, at)}
    q_i = w_i = None
    if self.has_indexer:
      q_i, k_i, w_i = indexer_lib.Indexer(cfg, name="indexer")(x_btd, c_q, inputs.cos,
                                                               inputs.sin)
      new_cache["k_idx"] = kv_cache.write(cache["k_idx"], k_i, idx.write_bt, at)
    # A streamed forward (the CPU engine) computes the per-head and per-request products
    # with the batched kernel, and the indexer with the CPU ones: the same numbers, without
    # XLA's GEMM call per product, its gathers of the keys or its slow TopK.
    streamed = self.has_variable(P.STREAM_W, "w_uk")
    einsum_uk = einsum_uv = jnp.einsum
    if streamed:   # W_UK and W_UV read in place from their served stacks
      einsum_uk, einsum_uv = (
          functools.partial(stream_matmul.einsum, b_stack=stack, layer=layer)
          for stack, layer in (P.served_stack(self, "w_uk", w_uk),
                               P.served_stack(self, "w_uv", w_uv)))
    q_abs = absorb_query(q_nope, q_rope, w_uk, einsum_uk)
    u, indices = mirrored_lanes(
        lambda *lanes: attend_cache(cfg, *lanes, new_cache["kv"], new_cache.get("k_idx"), at,
                                    streamed),
        (q_abs, q_i, w_i, inputs.doc_start, prev_indices, idx.read_bs, idx.limit_bt))
    o = einsum_uv("bthc,chv->bthv", u, w_uv)
    out = P.dense(self, "wo", o, wo.astype(jnp.dtype(cfg.dtype)))
    return out, layer_io.LayerAux(indexer_kl=None, topk_indices=indices), new_cache
