"""Losses: chunked next-token cross entropy, MTP loss, indexer KL, routing-bias update.

Notation: b batch, t positions, d hidden, V vocab, h heads, s keys, k top-k.
"""

from __future__ import annotations

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
  h_c = _pad_seq(hidden_btd, c).reshape(b, n_chunks, c, -1).swapaxes(0, 1)
  y_c = _pad_seq(targets_bt, c).reshape(b, n_chunks, c).swapaxes(0, 1)
  m_c = _pad_seq(mask, c).reshape(b, n_chunks, c).swapaxes(0, 1)

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
                     mask_bt=None, doc_start=None):
  """Dense-warm-up indexer loss: mean_{b,t} KL(p_t || softmax_s I_t) over causal s.

  Args:
    q_abs: [b, t, h, c+p] absorbed MLA queries (detached here).
    kv: [b, s, c+p] latent rows [c_kv | k_rope] (detached here).
    q_i, k_i, w_i: indexer queries [b,t,h_i,d_i], keys [b,s,d_i], weights [b,t,h_i]
      (scales folded in); these carry the gradient to the indexer parameters.
    scale: MLA logit scale.
    indices: unused (same signature as the sparse form).
    chunk_size: queries per chunk; memory O(b * chunk * h * s).
    mask_bt: optional [b, t] weights of the queries in the mean.
    doc_start: optional [b, t] first key of each query's document (packed rows).
  """
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
                      mask_bt=None, doc_start=None):
  """Sparse-stage indexer loss: the KL restricted to the selected set S_t (eq. 4).

  Same arguments as `indexer_kl_dense`, plus `indices` [b, t, k] (-1 = empty),
  which already respect document boundaries (so `doc_start` is unused);
  memory O(b * chunk * k * (d + h)).
  """
  del doc_start
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
