"""DeepSeek Sparse Attention (DSA): the indexer's top-k, sparse MLA, and the indexer's KL loss.

GLM-5 (arXiv 2602.15763 §2) adopts DSA from DeepSeek-V3.2 (§2.1); equations in docs/design.md
§2.4-2.5. The lightning indexer scores every visible key, I[t, s] = sum_j w[t, j] relu(q_j[t] .
k[s]) (eq. 1); each query attends to its top-k keys (ties -> lower position, docs/design.md
decision 5); the indexer learns from a KL to the main attention's distribution summed over heads
(eq. 3 dense warm-up, eq. 4 on the selected set in the sparse stage), with its inputs detached.
Notation: b batch, t queries, s keys, h heads, h_i indexer heads, k top-k.

The model's calls of the two DSA ops are partitioned over the mesh when they run as Pallas
kernels. XLA cannot partition a Pallas kernel: it is an opaque custom call, and on TPU Mosaic
refuses to lower one whose operands are sharded. With a mesh set by `jax.set_mesh` and
`attention_impl="pallas"`, each kernel runs inside `jax.shard_map` on every device's slice:

  op                   batch b                  heads          keys / cache s
  indexer top-k        over the batch axes      whole (the score sums all indexer heads)   whole
                       (start, and a [b, t] limit, with it; a [t] limit is replicated)
  sparse MLA           over the batch axes      over `tensor`  whole (shared by all heads)

A batch axis group is used only when it divides b (an inference batch of 1 stays whole); heads
go over `tensor` only when it divides them. kv enters unsharded over `tensor`, so shard_map's
transpose sums its per-head-shard gradients over `tensor`. The `xla` path needs none of this:
GSPMD partitions jnp code by itself, so it is called directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from glm5_jax import cpu_dsa
from glm5_jax import row_reduce
from glm5_jax import sharding as shd
from glm5_jax import stream_matmul
from glm5_jax.nn import kv_cache
from glm5_jax.padding import add_rows, chunks, pad_to_multiple, rows, set_rows, unchunk
from pallas_kernels import lightning_indexer
from pallas_kernels import sparse_attention

_KL_EPS = 1e-10  # Megatron `compute_dsa_indexer_loss`

# --------------------------------------------------------------------------------------
# The two ops (per shard under a mesh for the Pallas kernels)
# --------------------------------------------------------------------------------------

def topk_indices(q, k, w, topk, *, impl, interpret, chunk_size, start=None, backend=None,
                 limit=None, einsum=None, top_k=None):
  """`lightning_indexer.topk_indices`, sharded over the batch axes for `impl="pallas"`.

  start: optional int32 [b, t]; limit: optional int32 [t] (every row alike) or
  [b, t] (per row: a KV-cache forward), see `lightning_indexer.topk_indices`.
  """
  call = lambda q, k, w, start, limit: lightning_indexer.topk_indices(
      q, k, w, topk, impl=impl, interpret=interpret, chunk_size=chunk_size, start=start,
      backend=backend, limit=limit, einsum=einsum, top_k=top_k)
  mesh = shd.active_mesh()
  if impl != "pallas" or mesh is None:
    return call(q, k, w, start, limit)
  bat = shd.axes_dividing(mesh, shd.BATCH_AXES, q.shape[0])
  spec = P(bat)
  limit_spec = spec if limit is not None and limit.ndim == 2 else P()
  return jax.shard_map(call, in_specs=(spec, spec, spec, spec, limit_spec), out_specs=spec,
                       check_vma=False)(q, k, w, start, limit)


def sparse_mla(q, kv, indices, *, v_dim, scale, impl, interpret, chunk_size, backend=None,
               einsum=None):
  """`sparse_attention.sparse_mla`, sharded over batch and heads for `impl="pallas"`."""
  call = lambda q, kv, indices: sparse_attention.sparse_mla(
      q, kv, indices, v_dim=v_dim, scale=scale, impl=impl, interpret=interpret,
      chunk_size=chunk_size, backend=backend, einsum=einsum)
  mesh = shd.active_mesh()
  if impl != "pallas" or mesh is None:
    return call(q, kv, indices)
  bat = shd.axes_dividing(mesh, shd.BATCH_AXES, q.shape[0])
  heads = shd.axes_dividing(mesh, (shd.TENSOR_AXIS,), q.shape[2])
  by_batch = P(bat)
  fn = jax.shard_map(call, in_specs=(P(bat, None, heads), by_batch, by_batch),
                     out_specs=(P(bat, None, heads), P(bat, None, heads)), check_vma=False)
  return fn(q, kv, indices)


# --------------------------------------------------------------------------------------
# The indexer's KL loss (DeepSeek-V3.2 §2.1 eqs. 3-4; docs/design.md §2.5)
# --------------------------------------------------------------------------------------

def _masked_logits(logits, valid):
  """-inf outside `valid`; rows with nothing valid get zeros (no NaN, no NaN grads)."""
  row_ok = jnp.any(valid, axis=-1, keepdims=True)
  return jnp.where(valid, logits, jnp.where(row_ok, -jnp.inf, 0.0))


def _kl(p, logits, valid):
  """sum_s p * (log(p + eps) - log(q + eps)) with q = softmax(logits) over `valid`."""
  q = jax.nn.softmax(_masked_logits(logits, valid), axis=-1)
  q = jnp.where(valid, q, 0.0)
  return jnp.sum(p * (jnp.log(p + _KL_EPS) - jnp.log(q + _KL_EPS)), axis=-1)


def _target(attn_logits_bchs, valid_bcs):
  """L1-normalised sum over heads of the attention softmax (detached)."""
  logits = _masked_logits(attn_logits_bchs, valid_bcs[:, :, None])
  p = jnp.sum(jax.nn.softmax(logits, axis=-1), axis=2)
  p = jnp.where(valid_bcs, p, 0.0)
  return p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), _KL_EPS)


def indexer_kl_dense(q_abs, kv, q_i, k_i, w_i, *, scale, indices=None, chunk_size=256,
                     mask_bt=None, doc_start=None, limit=None):
  """Dense-warm-up indexer loss: mean_{b,t} KL(p_t || softmax_s I_t) over causal s.

  Blockwise over queries and keys (`chunk_size` each), so memory is
  O(b * chunk^2 * (h + h_i)) besides inputs and gradients, linear in t and s:
    pass 1  per query, the logsumexp over its visible keys of each head's attention
            logits and of the index scores (online, key block by key block);
    pass 2  per key block, p = mean_h exp(logit - lse_h) and q = exp(I - lse_I),
            summing the KL terms and W = sum_s p q / (q + eps);
    grad    dKL/dI_s = q_s W - p_s q_s / (q_s + eps), recomputed block by block and
            pulled back through the index scores (a `jax.custom_vjp`).
  Equal to `indexer_kl_dense_reference` (the query-chunked form).

  Args:
    q_abs: [b, t, h, c+p] absorbed MLA queries (detached here).
    kv: [b, s, c+p] latent rows [c_kv | k_rope] (detached here).
    q_i, k_i, w_i: indexer queries [b,t,h_i,d_i], keys [b,s,d_i], weights [b,t,h_i]
      (scales folded in); these carry the gradient to the indexer parameters.
    scale: MLA logit scale.
    indices: unused (same signature as the sparse form).
    chunk_size: queries per chunk and keys per block.
    mask_bt: optional [b, t] weights of the queries in the mean.
    doc_start: optional [b, t] first key of each query's document (packed rows).
    limit: optional [b, t] last visible key of each query (default causal s - t + i;
      context parallelism passes each query's natural position).
  """
  del indices
  b, t = q_abs.shape[:2]
  s = kv.shape[1]
  q_abs, kv = jax.lax.stop_gradient(q_abs), jax.lax.stop_gradient(kv)
  start = jnp.zeros((b, t), jnp.int32) if doc_start is None else doc_start.astype(jnp.int32)
  limit = jnp.broadcast_to(lightning_indexer.causal_limit(t, s) if limit is None
                           else limit.astype(jnp.int32), (b, t))
  c, bk = max(1, min(chunk_size, t)), max(1, min(chunk_size, s))
  kl = _dense_kl_rows(q_i, k_i, w_i, q_abs, kv, start, limit, float(scale), c, bk)
  return _masked_mean(kl, mask_bt)


def _dense_kl_setup(q_i, k_i, w_i, q_abs, kv, start, limit, c, bk):
  """Operands padded to whole chunks / blocks (no copy when already whole), and for query
  chunk i its key blocks [first(i), end(i)): those between its smallest start and its
  largest limit (rows that see nothing, incl. padding rows with limit -1, do not count)."""
  pad = pad_to_multiple
  x = dict(qa=pad(q_abs, c), qi=pad(q_i, c), wi=pad(w_i, c), st=pad(start, c),
           li=pad(limit, c, value=-1), kv=pad(kv, bk), ki=pad(k_i, bk))

  def key_range(i):
    st, li = rows(x["st"], i, c), rows(x["li"], i, c)
    seen = st <= li
    lo = jnp.min(jnp.where(seen, st, jnp.iinfo(jnp.int32).max))
    hi = jnp.max(jnp.where(seen, li, -1))
    return jnp.where(hi >= 0, lo // bk, 0), jnp.where(hi >= 0, hi // bk + 1, 0)

  chunk = lambda i: {k: rows(x[k], i, c) for k in ("qa", "qi", "wi", "st", "li")}
  return x, chunk, key_range


def _kl_tile(x, ch, j, bk, scale):
  """Key block j of one query chunk: (valid [b,c,bk], attention logits [b,c,h,bk], key rows)."""
  pos = j * bk + jnp.arange(bk, dtype=jnp.int32)
  valid = (pos >= ch["st"][..., None]) & (pos <= ch["li"][..., None])
  attn = jnp.einsum("bchd,bkd->bchk", ch["qa"], rows(x["kv"], j, bk),
                    preferred_element_type=jnp.float32) * scale
  return valid, attn, rows(x["ki"], j, bk)


def _kl_p_q(valid, attn, scores, lse_a, lse_i):
  """p = mean_h softmax_h(attn) (the L1-normalised head sum), q = softmax(scores); 0 off valid."""
  p = jnp.mean(jnp.where(valid[:, :, None], jnp.exp(attn - lse_a[..., None]), 0.0), axis=2)
  q = jnp.where(valid, jnp.exp(jnp.where(valid, scores, lse_i[..., None]) - lse_i[..., None]),
                0.0)
  return p, q


def _online_lse(m, l, logits, valid):
  """One step of a running logsumexp (max m, sum l) over the valid entries of the last axis."""
  m_new = jnp.maximum(m, jnp.max(jnp.where(valid, logits, -jnp.inf), axis=-1))
  m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
  e = jnp.where(valid, jnp.exp(jnp.where(valid, logits, 0.0) - m_use[..., None]), 0.0)
  return m_new, l * jnp.exp(m - m_use) + jnp.sum(e, axis=-1)


def _lse_value(m, l):
  """m + log l; 0 for rows with no valid entry (their p and q are 0 anyway)."""
  return jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), 0.0)


def _dense_kl_forward(q_i, k_i, w_i, q_abs, kv, start, limit, scale, c, bk):
  """(KL [b, t], residuals lse_a [b, T, h], lse_I [b, T], W [b, T]; T = t padded)."""
  b, t, h = q_abs.shape[:3]
  x, chunk, key_range = _dense_kl_setup(q_i, k_i, w_i, q_abs, kv, start, limit, c, bk)
  n = x["qa"].shape[1]

  def query_chunk(i, bufs):
    ch = chunk(i)

    def stats(j, carry):                               # pass 1
      (m_a, l_a), (m_i, l_i) = carry
      valid, attn, ki = _kl_tile(x, ch, j, bk, scale)
      scores = lightning_indexer.index_scores(ch["qi"], ki, ch["wi"])
      return (_online_lse(m_a, l_a, attn, valid[:, :, None]),
              _online_lse(m_i, l_i, scores, valid))

    neg, zero = (lambda *sh: jnp.full(sh, -jnp.inf)), (lambda *sh: jnp.zeros(sh))
    (m_a, l_a), (m_i, l_i) = jax.lax.fori_loop(
        *key_range(i), stats, ((neg(b, c, h), zero(b, c, h)), (neg(b, c), zero(b, c))))
    lse_a, lse_i = _lse_value(m_a, l_a), _lse_value(m_i, l_i)

    def terms(j, carry):                               # pass 2
      kl, w_sum = carry
      valid, attn, ki = _kl_tile(x, ch, j, bk, scale)
      p, q = _kl_p_q(valid, attn, lightning_indexer.index_scores(ch["qi"], ki, ch["wi"]), lse_a,
                     lse_i)
      kl = kl + jnp.sum(p * (jnp.log(p + _KL_EPS) - jnp.log(q + _KL_EPS)), axis=-1)
      return kl, w_sum + jnp.sum(p * q / (q + _KL_EPS), axis=-1)

    kl, w_sum = jax.lax.fori_loop(*key_range(i), terms, (zero(b, c), zero(b, c)))
    return tuple(set_rows(buf, i, c, v) for buf, v in zip(bufs, (kl, lse_a, lse_i, w_sum)))

  zeros = lambda *sh: jnp.zeros(sh, jnp.float32)
  kl, *res = jax.lax.fori_loop(0, n // c, query_chunk,
                               (zeros(b, n), zeros(b, n, h), zeros(b, n), zeros(b, n)))
  return kl[:, :t], tuple(res)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _dense_kl_rows(q_i, k_i, w_i, q_abs, kv, start, limit, scale, c, bk):
  return _dense_kl_forward(q_i, k_i, w_i, q_abs, kv, start, limit, scale, c, bk)[0]


def _dense_kl_rows_fwd(q_i, k_i, w_i, q_abs, kv, start, limit, scale, c, bk):
  kl, res = _dense_kl_forward(q_i, k_i, w_i, q_abs, kv, start, limit, scale, c, bk)
  return kl, (q_i, k_i, w_i, q_abs, kv, start, limit, res)


def _dense_kl_rows_bwd(scale, c, bk, saved, g_bt):
  """Gradients to q_i, k_i, w_i; none to the detached target or the int ranges."""
  q_i, k_i, w_i, q_abs, kv, start, limit, (lse_a, lse_i, w_sum) = saved
  t, s = q_abs.shape[1], kv.shape[1]
  x, chunk, key_range = _dense_kl_setup(q_i, k_i, w_i, q_abs, kv, start, limit, c, bk)
  g = pad_to_multiple(g_bt.astype(jnp.float32), c)

  def query_chunk(i, bufs):
    ch = chunk(i)
    la, lq, ws, gc = (rows(a, i, c) for a in (lse_a, lse_i, w_sum, g))

    def key_block(j, carry):
      dq, dw, dk = carry
      valid, attn, ki = _kl_tile(x, ch, j, bk, scale)
      scores, pull = jax.vjp(lightning_indexer.index_scores, ch["qi"], ki, ch["wi"])
      p, q = _kl_p_q(valid, attn, scores, la, lq)
      dq_j, dk_j, dw_j = pull(gc[..., None] * (q * ws[..., None] - p * q / (q + _KL_EPS)))
      dk = add_rows(dk, j, bk, dk_j)
      return dq + dq_j.astype(dq.dtype), dw + dw_j.astype(dw.dtype), dk

    f32 = lambda a: jnp.zeros(a.shape, jnp.float32)
    dq, dw, dk = jax.lax.fori_loop(*key_range(i), key_block, (f32(ch["qi"]), f32(ch["wi"]),
                                                               bufs[2]))
    return set_rows(bufs[0], i, c, dq), set_rows(bufs[1], i, c, dw), dk

  zeros = lambda a, dt: jnp.zeros(a.shape, dt)
  dq, dw, dk = jax.lax.fori_loop(0, x["qa"].shape[1] // c, query_chunk,
                                 (zeros(x["qi"], q_i.dtype), zeros(x["wi"], w_i.dtype),
                                  zeros(x["ki"], jnp.float32)))
  return (dq[:, :t], dk[:, :s].astype(k_i.dtype), dw[:, :t], None, None, None, None)


_dense_kl_rows.defvjp(_dense_kl_rows_fwd, _dense_kl_rows_bwd)


def indexer_kl_dense_reference(q_abs, kv, q_i, k_i, w_i, *, scale, indices=None,
                               chunk_size=256, mask_bt=None, doc_start=None):
  """`indexer_kl_dense` chunked over queries only: memory O(b * chunk * h * s) (tests)."""
  del indices
  b, t = q_abs.shape[:2]
  s = kv.shape[1]
  q_abs, kv = jax.lax.stop_gradient(q_abs), jax.lax.stop_gradient(kv)
  c = max(1, min(chunk_size, t))
  limit = pad_to_multiple(lightning_indexer.causal_limit(t, s)[None], c).reshape(-1, c)
  start = jnp.zeros((b, t), jnp.int32) if doc_start is None else doc_start
  qa_c, qi_c, wi_c, st_c = (chunks(a, c) for a in (q_abs, q_i, w_i, start))

  @jax.checkpoint
  def chunk_kl(args):
    qa, qi, wi, lim, st = args
    pos = jnp.arange(s)
    valid = (pos[None, :] <= lim[:, None])[None] & (pos[None, None, :] >= st[..., None])
    attn = jnp.einsum("bchd,bsd->bchs", qa, kv, preferred_element_type=jnp.float32) * scale
    p = _target(attn, valid)
    return _kl(p, lightning_indexer.index_scores(qi, k_i, wi), valid)       # [b, c]

  kl = unchunk(jax.lax.map(chunk_kl, (qa_c, qi_c, wi_c, limit, st_c)), t)
  return _masked_mean(kl, mask_bt)


def indexer_kl_sparse(q_abs, kv, q_i, k_i, w_i, *, scale, indices, chunk_size=256,
                      mask_bt=None, doc_start=None, limit=None):
  """Sparse-stage indexer loss: the KL restricted to the selected set S_t (eq. 4).

  Same arguments as `indexer_kl_dense`, plus `indices` [b, t, k] (-1 = empty),
  which already respect document boundaries and causality (so `doc_start` and
  `limit` are unused); memory O(b * chunk * k * (d + h)).
  """
  del doc_start, limit
  t = q_abs.shape[1]
  q_abs, kv = jax.lax.stop_gradient(q_abs), jax.lax.stop_gradient(kv)
  c = max(1, min(chunk_size, t))
  qa_c, qi_c, wi_c = (chunks(a, c) for a in (q_abs, q_i, w_i))
  idx_c = chunks(indices, c, value=-1)
  take = jax.vmap(lambda x, i: x[jnp.maximum(i, 0)])

  @jax.checkpoint
  def chunk_kl(args):
    qa, qi, wi, idx = args
    valid = idx >= 0                                                   # [b, c, k]
    attn = jnp.einsum("bchd,bckd->bchk", qa, take(kv, idx),
                      preferred_element_type=jnp.float32) * scale
    p = _target(attn, valid)
    qk = jnp.einsum("bcjd,bckd->bcjk", qi, take(k_i, idx), preferred_element_type=jnp.float32)
    scores = jnp.einsum("bcjk,bcj->bck", jax.nn.relu(qk), wi.astype(jnp.float32))
    return _kl(p, scores, valid)

  kl = unchunk(jax.lax.map(chunk_kl, (qa_c, qi_c, wi_c, idx_c)), t)
  return _masked_mean(kl, mask_bt)


def _masked_mean(x_bt, mask_bt):
  if mask_bt is None:
    return jnp.mean(x_bt)
  m = mask_bt.astype(jnp.float32)
  return jnp.sum(x_bt * m) / jnp.maximum(jnp.sum(m), 1.0)


# --------------------------------------------------------------------------------------
# The CPU engine's decode over a paged cache (glm5_jax/cpu_dsa.py's kernels, XLA's bits)
# --------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def paged_scores_exact(q_shape: tuple[int, ...], n_rows: int, s: int) -> bool:
  """Whether `cpu_dsa.paged_scores` equals the XLA path (the pool's rows gathered,
  `index_scores`) bit for bit at these shapes (q [b, t, j, d], a pool of n_rows rows, s
  positions), on seeded random data with every position visible; False without the kernel.
  (At batch 3 XLA:CPU sums these dots in another order: False there.)"""
  if not cpu_dsa.available() or 0 in q_shape or n_rows == 0 or s == 0:
    return False
  b, t, j, d = q_shape
  rng = stream_matmul.probe_rng("paged", q_shape, n_rows, s)
  q = rng.standard_normal(q_shape, np.float32)
  w = rng.standard_normal((b, t, j), np.float32)
  keys = rng.standard_normal((2, n_rows, d), np.float32)
  rows = rng.integers(0, n_rows, (b, s), dtype=np.int32)
  limit = np.full((b, t), s - 1, np.int32)
  with jax.ensure_compile_time_eval():     # also when first asked inside a trace
    want = jax.jit(lambda q, w, k, r: lightning_indexer.index_scores(q, k[1][r], w))(
        q, w, keys, rows)
    got = jax.jit(cpu_dsa.paged_scores)(q, w, keys, 1, rows, limit)
    return bool(np.array_equal(np.asarray(got), np.asarray(want)))


def topk_indices_paged(q, w, keys_pool, layer, read_bs, limit_bt, topk: int, start=None):
  """`topk_indices` (impl "xla") over each sequence's keys in a paged cache (nn/kv_cache.py:
  pool [L, N, d_i] at `layer`, or [N, d_i] with layer None; read_bs [b, s] the pool row of
  each position; limit_bt [b, t]), for the CPU engine: the scores straight from the pool at
  the visible positions (no gather of the keys) and their top-k, in one call
  (`cpu_dsa.paged_topk`); the same indices. None where that does not apply (a non-float32 or
  sharded pool, or `paged_scores_exact` False): the caller reads the keys."""
  s = read_bs.shape[1]
  if (keys_pool.dtype != jnp.float32
      or kv_cache.request_axes(keys_pool.shape[-2], read_bs.shape[0]) is not None
      or not paged_scores_exact(tuple(q.shape), keys_pool.shape[-2], s)):
    return None
  if layer is None:
    keys_pool, layer = keys_pool[None], 0
  return cpu_dsa.paged_topk(q, w, keys_pool, layer, read_bs, limit_bt, topk, start)


@functools.lru_cache(maxsize=None)
def sparse_kc(q_shape: tuple[int, ...], k: int, n_rows: int, width: int, s: int,
              v_dim: int) -> tuple[int, int] | None:
  """(kc of `cpu_dsa.sparse_logits`, kc of `cpu_dsa.row_values`) at which they equal
  XLA's einsums of the gathered rows bit for bit at these shapes (q [b, c, h, d], k slots,
  a pool of n_rows rows of `width`, s positions per sequence), on seeded data with some
  slots empty (-1); None if no block size does, or without the kernels."""
  if not cpu_dsa.available() or 0 in q_shape or 0 in (k, n_rows, s, v_dim) or v_dim > width:
    return None
  b, c, h, d = q_shape
  rng = stream_matmul.probe_rng("sparse", q_shape, k, n_rows, width, s, v_dim)
  q = rng.standard_normal(q_shape, np.float32)
  p = rng.random((b, c, h, k), np.float32)
  keys = rng.standard_normal((2, n_rows, width), np.float32)
  rows = rng.integers(0, n_rows, (b, s), dtype=np.int32)
  idx = rng.integers(-1, s, (b, c, k), dtype=np.int32)
  gathered = keys[1][rows][np.arange(b)[:, None, None], np.maximum(idx, 0)]   # [b, c, k, w]
  f32 = jnp.float32
  with jax.ensure_compile_time_eval():     # also when first asked inside a trace
    want_l = np.asarray(jax.jit(lambda q, r: jnp.einsum(
        "bchd,bckd->bchk", q, r[..., :d], preferred_element_type=f32))(q, gathered))
    want_v = np.asarray(jax.jit(lambda p, r: jnp.einsum(
        "bchk,bckv->bchv", p, r[..., :v_dim], preferred_element_type=f32))(p, gathered))
    found = []
    for n, fn, want in (
        (d, lambda kc: cpu_dsa.sparse_logits(q, keys, 1, rows, idx, v_dim, kc)[0], want_l),
        (k, lambda kc: cpu_dsa.row_values(p, gathered[..., :v_dim], kc), want_v)):
      kc = next((bounds[1] for bounds in stream_matmul.candidates(n)
                 if np.array_equal(np.asarray(jax.jit(lambda: fn(bounds[1]))()), want)), None)
      if kc is None:
        return None
      found.append(kc)
  return tuple(found)


PAGED_MAX_QUERIES = 8     # `sparse_mla_paged`'s queries per sequence: decode and verify steps


def sparse_mla_paged(cfg, q_abs, kv_pool, layer, read_bs, indices):
  """`sparse_mla`'s out [b, t, h, c] over a paged cache (nn/kv_cache.py: pool [L, N, c+p] at
  `layer`, or [N, c+p] with layer None; read_bs [b, s] each position's pool row), for the CPU
  engine's decode steps: the selected rows read straight from the pool by
  glm5_jax/cpu_dsa.py's products at `sparse_kc`'s blocks, the masked softmax between them
  XLA's (`attend_logits`, its maximum by glm5_jax/row_reduce.py): the same numbers. None
  where that path does not apply (another impl, a sharded or non-float32 pool, more than
  PAGED_MAX_QUERIES queries per sequence, or no `sparse_kc`): the caller reads the cache and
  calls `sparse_mla`. A prefill chunk keeps XLA's path: with `small`'s 32-token chunks
  through the kernels, their outputs equalled XLA's in the same program, yet the engine's
  log-probs moved by ~1e-6 (which op of the program moved was not found)."""
  b, t = q_abs.shape[:2]
  c, s = cfg.kv_lora_rank, read_bs.shape[1]
  if (cfg.attention_impl != "xla" or kv_pool.dtype != jnp.float32
      or q_abs.dtype != jnp.float32 or t > PAGED_MAX_QUERIES
      or kv_cache.request_axes(kv_pool.shape[-2], b) is not None):
    return None
  kcs = sparse_kc(tuple(q_abs.shape), indices.shape[-1], kv_pool.shape[-2], kv_pool.shape[-1],
                  s, c)
  if kcs is None:
    return None
  if layer is None:
    kv_pool, layer = kv_pool[None], 0
  logits, rows = cpu_dsa.sparse_logits(q_abs, kv_pool, layer, read_bs, indices, c, kcs[0])
  values = lambda p: cpu_dsa.row_values(p, rows, kcs[1])
  out, _ = sparse_attention.attend_logits(logits * cfg.softmax_scale, indices, values,
                                          q_abs.dtype, row_reduce.row_max)
  return out
