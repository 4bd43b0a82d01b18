"""Losses: chunked next-token cross entropy, MTP loss, routing-bias update.

The indexer's KL loss is part of DSA (glm5_jax/nn/dsa.py).

Notation: b batch, t positions, d hidden, V vocab, h heads, s keys, k top-k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax import logprobs


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


def chunked_cross_entropy(hidden_btd, head_dv, targets_bt, mask_bt=None, *, chunk_size=256):
  """Cross entropy of `hidden @ head` computed `chunk_size` positions at a time.

  The float32 [b, t, V] logits never exist at once: each chunk's logits are
  recomputed in the backward pass (`logprobs.chunked`), so peak memory is
  O(b * chunk * V) (GLM-5 paper §2: sequence-chunked output projection + CE). Chunk j
  holds positions j, j + n_chunks, ... (strided): a sequence sharded over devices (context
  parallelism) stays sharded within every chunk instead of being gathered.

  Returns:
    (mean loss over mask, number of tokens).
  """
  mask = (jnp.ones(targets_bt.shape, jnp.float32) if mask_bt is None
          else mask_bt.astype(jnp.float32))
  total = logprobs.chunked(_nll_sum, hidden_btd, head_dv, targets_bt, mask,
                           chunk_size=chunk_size, strided=True, total=True)
  n = jnp.sum(mask)
  return total / jnp.maximum(n, 1.0), n


def _nll_sum(logits_bcv, y_bc, m_bc):
  """sum_i m_i * -log p(y_i) over a chunk, as logsumexp - logit[y]: the arithmetic every run
  so far trained with (-`logprobs.of_logits` differs in the last bit)."""
  lse = jax.nn.logsumexp(logits_bcv, axis=-1)
  picked = jnp.take_along_axis(logits_bcv, y_bc[..., None], axis=-1)[..., 0]
  return jnp.sum((lse - picked) * m_bc)


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
  """L_MTP = (lambda / D) * sum_k CE_k (docs/design.md §2.7; DeepSeek-V3 §2.2 eq. 25)."""
  d = len(mtp_ce_per_step)
  if d == 0:
    return jnp.zeros((), jnp.float32)
  return weight / d * sum(mtp_ce_per_step)


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
