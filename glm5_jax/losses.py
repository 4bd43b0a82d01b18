"""Losses: chunked next-token cross entropy, MTP loss, indexer KL, routing-bias update.

Notation: b batch, t positions, d hidden, V vocab, h heads, s keys, k top-k.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.lightning_indexer import reference as indexer_ref

_KL_EPS = 1e-10  # Megatron `compute_dsa_indexer_loss`


# --------------------------------------------------------------------------------------
# Cross entropy
# --------------------------------------------------------------------------------------

def cross_entropy(logits_btv, targets_bt, mask_bt=None):
  """Mean token cross entropy from float logits; returns (loss, n_tokens)."""
  logp = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, targets_bt[..., None], axis=-1)[..., 0]
  mask = jnp.ones_like(nll) if mask_bt is None else mask_bt.astype(jnp.float32)
  n = jnp.sum(mask)
  return jnp.sum(nll * mask) / jnp.maximum(n, 1.0), n


def _pad_seq(x, multiple, value=0):
  pad = (-x.shape[1]) % multiple
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[1] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def chunked_cross_entropy(hidden_btd, head_dv, targets_bt, mask_bt=None, *, chunk_size=256):
  """Cross entropy of `hidden @ head` computed `chunk_size` positions at a time.

  The float32 [b, t, V] logits never exist at once: each chunk's logits are
  recomputed in the backward pass (`jax.checkpoint`), so peak memory is
  O(b * chunk * V) (GLM-5 paper §2: sequence-chunked output projection + CE).

  Returns:
    (mean loss over mask, number of tokens).
  """
  b, t, _ = hidden_btd.shape
  c = max(1, min(chunk_size, t))
  n_chunks = -(-t // c)
  mask = jnp.ones((b, t), jnp.float32) if mask_bt is None else mask_bt.astype(jnp.float32)
  # Chunk j holds positions j, j + n_chunks, ... (strided): a sequence sharded over devices
  # (context parallelism) stays sharded within every chunk instead of being gathered.
  strided = lambda x: jnp.moveaxis(_pad_seq(x, c).reshape(b, c, n_chunks, *x.shape[2:]), 2, 0)
  h_c, y_c, m_c = strided(hidden_btd), strided(targets_bt), strided(mask)

  @jax.checkpoint
  def chunk_nll(h_bcd, y_bc, m_bc):
    logits = jnp.einsum("bcd,dv->bcv", h_bcd, head_dv.astype(h_bcd.dtype),
                        preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, y_bc[..., None], axis=-1)[..., 0]
    return jnp.sum((lse - picked) * m_bc)

  def body(total, xs):
    return total + chunk_nll(*xs), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (h_c, y_c, m_c))
  n = jnp.sum(mask)
  return total / jnp.maximum(n, 1.0), n


def next_token_targets(tokens_bt, mask_bt=None, offset: int = 1, segment_ids=None):
  """Targets tokens[i + offset] and a [b, t] float mask of the valid ones.

  A target is valid when i + offset < t, `mask_bt` (if given) is 1 at i + offset,
  and, for packed rows, token i + offset is in the same non-padding document
  (`segment_ids`, 0 = padding).
  """
  b, t = tokens_bt.shape
  pad = lambda x: jnp.pad(x, ((0, 0), (0, offset)))
  targets = pad(tokens_bt[:, offset:])
  valid = jnp.broadcast_to((jnp.arange(t) < t - offset)[None].astype(jnp.float32), (b, t))
  if mask_bt is not None:
    valid = valid * pad(mask_bt[:, offset:].astype(jnp.float32))
  if segment_ids is not None:
    seg = segment_ids
    same = (seg[:, offset:] == seg[:, :-offset]) & (seg[:, :-offset] != 0)
    valid = valid * pad(same.astype(jnp.float32))
  return targets, valid


def mtp_loss(mtp_ce_per_step, weight: float):
  """L_MTP = (lambda / D) * sum_k CE_k (spec §2.7; DeepSeek-V3 §2.2 eq. 25)."""
  d = len(mtp_ce_per_step)
  if d == 0:
    return jnp.zeros((), jnp.float32)
  return weight / d * sum(mtp_ce_per_step)


# --------------------------------------------------------------------------------------
# Indexer KL (DeepSeek-V3.2 §2.1 eqs. 3-4; spec §2.5)
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


def _query_chunks(c, t, *arrays):
  n = -(-t // c)
  return [_pad_seq(a, c).reshape(a.shape[0], n, c, *a.shape[2:]).swapaxes(0, 1)
          for a in arrays]


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
  limit = jnp.broadcast_to(indexer_ref.causal_limit(t, s) if limit is None
                           else limit.astype(jnp.int32), (b, t))
  c, bk = max(1, min(chunk_size, t)), max(1, min(chunk_size, s))
  kl = _dense_kl_rows(q_i, k_i, w_i, q_abs, kv, start, limit, float(scale), c, bk)
  return _masked_mean(kl, mask_bt)


def _rows(x, i, size: int):
  """x[:, i * size : (i + 1) * size] for a traced block index i."""
  return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=1)


def _set_rows(x, i, size: int, block):
  return jax.lax.dynamic_update_slice_in_dim(x, block.astype(x.dtype), i * size, axis=1)


def _dense_kl_setup(q_i, k_i, w_i, q_abs, kv, start, limit, c, bk):
  """Operands padded to whole chunks / blocks (no copy when already whole), and for query
  chunk i its key blocks [first(i), end(i)): those between its smallest start and its
  largest limit (rows that see nothing, incl. padding rows with limit -1, do not count)."""
  x = dict(qa=_pad_seq(q_abs, c), qi=_pad_seq(q_i, c), wi=_pad_seq(w_i, c),
           st=_pad_seq(start, c), li=_pad_seq(limit, c, value=-1),
           kv=_pad_seq(kv, bk), ki=_pad_seq(k_i, bk))

  def key_range(i):
    st, li = _rows(x["st"], i, c), _rows(x["li"], i, c)
    seen = st <= li
    lo = jnp.min(jnp.where(seen, st, jnp.iinfo(jnp.int32).max))
    hi = jnp.max(jnp.where(seen, li, -1))
    return jnp.where(hi >= 0, lo // bk, 0), jnp.where(hi >= 0, hi // bk + 1, 0)

  chunk = lambda i: {k: _rows(x[k], i, c) for k in ("qa", "qi", "wi", "st", "li")}
  return x, chunk, key_range


def _kl_tile(x, ch, j, bk, scale):
  """Key block j of one query chunk: (valid [b,c,bk], attention logits [b,c,h,bk], key rows)."""
  pos = j * bk + jnp.arange(bk, dtype=jnp.int32)
  valid = (pos >= ch["st"][..., None]) & (pos <= ch["li"][..., None])
  attn = jnp.einsum("bchd,bkd->bchk", ch["qa"], _rows(x["kv"], j, bk),
                    preferred_element_type=jnp.float32) * scale
  return valid, attn, _rows(x["ki"], j, bk)


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
      scores = indexer_ref.index_scores(ch["qi"], ki, ch["wi"])
      return (_online_lse(m_a, l_a, attn, valid[:, :, None]),
              _online_lse(m_i, l_i, scores, valid))

    neg, zero = (lambda *sh: jnp.full(sh, -jnp.inf)), (lambda *sh: jnp.zeros(sh))
    (m_a, l_a), (m_i, l_i) = jax.lax.fori_loop(
        *key_range(i), stats, ((neg(b, c, h), zero(b, c, h)), (neg(b, c), zero(b, c))))
    lse_a, lse_i = _lse_value(m_a, l_a), _lse_value(m_i, l_i)

    def terms(j, carry):                               # pass 2
      kl, w_sum = carry
      valid, attn, ki = _kl_tile(x, ch, j, bk, scale)
      p, q = _kl_p_q(valid, attn, indexer_ref.index_scores(ch["qi"], ki, ch["wi"]), lse_a,
                     lse_i)
      kl = kl + jnp.sum(p * (jnp.log(p + _KL_EPS) - jnp.log(q + _KL_EPS)), axis=-1)
      return kl, w_sum + jnp.sum(p * q / (q + _KL_EPS), axis=-1)

    kl, w_sum = jax.lax.fori_loop(*key_range(i), terms, (zero(b, c), zero(b, c)))
    return tuple(_set_rows(buf, i, c, v) for buf, v in zip(bufs, (kl, lse_a, lse_i, w_sum)))

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
  g = _pad_seq(g_bt.astype(jnp.float32), c)

  def query_chunk(i, bufs):
    ch = chunk(i)
    la, lq, ws, gc = (_rows(a, i, c) for a in (lse_a, lse_i, w_sum, g))

    def key_block(j, carry):
      dq, dw, dk = carry
      valid, attn, ki = _kl_tile(x, ch, j, bk, scale)
      scores, pull = jax.vjp(indexer_ref.index_scores, ch["qi"], ki, ch["wi"])
      p, q = _kl_p_q(valid, attn, scores, la, lq)
      dq_j, dk_j, dw_j = pull(gc[..., None] * (q * ws[..., None] - p * q / (q + _KL_EPS)))
      dk = _set_rows(dk, j, bk, _rows(dk, j, bk) + dk_j.astype(dk.dtype))
      return dq + dq_j.astype(dq.dtype), dw + dw_j.astype(dw.dtype), dk

    f32 = lambda a: jnp.zeros(a.shape, jnp.float32)
    dq, dw, dk = jax.lax.fori_loop(*key_range(i), key_block, (f32(ch["qi"]), f32(ch["wi"]),
                                                               bufs[2]))
    return _set_rows(bufs[0], i, c, dq), _set_rows(bufs[1], i, c, dw), dk

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
  limit = _pad_seq(indexer_ref.causal_limit(t, s)[None], c).reshape(-1, c)
  start = jnp.zeros((b, t), jnp.int32) if doc_start is None else doc_start
  qa_c, qi_c, wi_c, st_c = _query_chunks(c, t, q_abs, q_i, w_i, start)

  @jax.checkpoint
  def chunk_kl(args):
    qa, qi, wi, lim, st = args
    pos = jnp.arange(s)
    valid = (pos[None, :] <= lim[:, None])[None] & (pos[None, None, :] >= st[..., None])
    attn = jnp.einsum("bchd,bsd->bchs", qa, kv, preferred_element_type=jnp.float32) * scale
    p = _target(attn, valid)
    return _kl(p, indexer_ref.index_scores(qi, k_i, wi), valid)       # [b, c]

  kl = jax.lax.map(chunk_kl, (qa_c, qi_c, wi_c, limit, st_c))
  kl = kl.swapaxes(0, 1).reshape(b, -1)[:, :t]
  return _masked_mean(kl, mask_bt)


def indexer_kl_sparse(q_abs, kv, q_i, k_i, w_i, *, scale, indices, chunk_size=256,
                      mask_bt=None, doc_start=None, limit=None):
  """Sparse-stage indexer loss: the KL restricted to the selected set S_t (eq. 4).

  Same arguments as `indexer_kl_dense`, plus `indices` [b, t, k] (-1 = empty),
  which already respect document boundaries and causality (so `doc_start` and
  `limit` are unused); memory O(b * chunk * k * (d + h)).
  """
  del doc_start, limit
  b, t = q_abs.shape[:2]
  q_abs, kv = jax.lax.stop_gradient(q_abs), jax.lax.stop_gradient(kv)
  c = max(1, min(chunk_size, t))
  qa_c, qi_c, wi_c = _query_chunks(c, t, q_abs, q_i, w_i)
  idx_c = _pad_seq(indices, c, value=-1).reshape(b, -1, c, indices.shape[-1]).swapaxes(0, 1)
  take = jax.vmap(lambda rows, i: rows[jnp.maximum(i, 0)])

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

  kl = jax.lax.map(chunk_kl, (qa_c, qi_c, wi_c, idx_c))
  kl = kl.swapaxes(0, 1).reshape(b, -1)[:, :t]
  return _masked_mean(kl, mask_bt)


def _masked_mean(x_bt, mask_bt):
  if mask_bt is None:
    return jnp.mean(x_bt)
  m = mask_bt.astype(jnp.float32)
  return jnp.sum(x_bt * m) / jnp.maximum(jnp.sum(m), 1.0)


# --------------------------------------------------------------------------------------
# Aux-loss-free load balancing (DeepSeek-V3 §2.1.2)
# --------------------------------------------------------------------------------------

def update_routing_bias(bias_e, load_e, rate: float):
  """b_e <- b_e - rate * sign(load_e - mean(load)): overloaded experts get picked less.

  Args:
    bias_e: [..., E] e_score_correction_bias (used for expert selection only).
    load_e: [..., E] measured load (token counts or fractions) of the same experts.
    rate: the bias update speed gamma.
  """
  load = load_e.astype(jnp.float32)
  err = load - jnp.mean(load, axis=-1, keepdims=True)
  return (bias_e - rate * jnp.sign(err)).astype(bias_e.dtype)
