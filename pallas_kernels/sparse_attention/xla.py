"""Sparse MLA attention in XLA (absorbed / MQA form), plain jnp.

docs/design.md §2.3 with the DSA top-k of §2.4; the contract of DeepSeek's
FlashMLA sparse kernels. Per query t and head h, over the selected rows
S_t = indices[t] (-1 = empty slot) of the shared cache `kv = [c_kv | k_rope]`:

    logits[h, j] = q[t, h] . kv[S_t[j]] * scale
    out[t, h]    = sum_j softmax_j(logits[h]) * kv[S_t[j], :v_dim]
    lse[t, h]    = logsumexp_j logits[h, j]          (float32)

A row with no valid slot gives out = 0 and lse = -inf.

Notation: b batch, t queries, s cache rows, h heads, k top-k slots, d = d_qk.

`sparse_mla_xla` gathers the k selected rows for a chunk of queries at a
time (`lax.map` + `jax.checkpoint`), so peak memory is O(chunk * k * d) in the
forward and the backward; it is the `impl="xla"` path and the oracle for the
kernels. `sparse_mla_dense_oracle` builds the full [t, s] masked softmax, for
tests only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _backend


def _gather_rows(kv_bsd, idx_bck):
  """kv rows at idx (clipped to 0 for empty slots): [b, c, k, d]."""
  safe = jnp.maximum(idx_bck, 0)
  return jax.vmap(lambda kv_sd, i_ck: kv_sd[i_ck])(kv_bsd, safe)


def _attend_chunk(q_bchd, kv_bsd, idx_bck, v_dim: int, scale: float, dtype=None,
                  einsum=jnp.einsum):
  rows_bckd = _gather_rows(kv_bsd, idx_bck).astype(dtype or kv_bsd.dtype)
  logits = einsum("bchd,bckd->bchk", q_bchd, rows_bckd,
                  preferred_element_type=jnp.float32) * scale
  values = lambda p: einsum("bchk,bckv->bchv", p, rows_bckd[..., :v_dim],
                            preferred_element_type=jnp.float32)
  return attend_logits(logits, idx_bck, values, q_bchd.dtype)


def logsumexp(x, row_max):
  """`jax.nn.logsumexp(x, axis=-1)`'s arithmetic, op for op, for real x, with its maximum over
  the last axis from `row_max` (one that gives `jnp.max`'s bits), its input's gradient
  stopped, as jax stops the maximum's."""
  amax = row_max(jax.lax.stop_gradient(x))
  amax = jax.lax.select(jnp.isfinite(amax), amax, jnp.zeros_like(amax))
  sumexp = jnp.abs(jnp.sum(jnp.exp(x - amax[..., None]), axis=-1))
  return jnp.log(sumexp) + amax


def attend_logits(logits_bchk, idx_bck, values, dtype, row_max=None):
  """(out [b, c, h, v] dtype, lse [b, c, h] float32) from the scaled logits of the selected
  slots: their masked softmax (an empty slot, -1, masked; a query with none gives out 0 and
  lse -inf), then `values(p)`: the float32 products of p [b, c, h, k] (dtype) with the slots'
  value rows. The part of `_attend_chunk` after the logits, shared with the CPU engine's
  paged products (glm5_jax/cpu_dsa.py). row_max: None (`jax.nn.logsumexp`), or the maximum
  `logsumexp` takes (the CPU engine's exact kernel, glm5_jax/row_reduce.py)."""
  logits = logits_bchk
  valid_bck = idx_bck >= 0
  any_valid = jnp.any(valid_bck, axis=-1)[:, :, None]
  # Empty rows: logits left finite (0) so that neither lse nor its gradient is NaN.
  keep = valid_bck[:, :, None, :] | ~any_valid[..., None]
  logits = jnp.where(keep, jnp.where(valid_bck[:, :, None, :], logits, 0.0), -jnp.inf)
  lse_bch = (jax.nn.logsumexp(logits, axis=-1) if row_max is None
             else logsumexp(logits, row_max))
  p = jnp.where(any_valid[..., None], jnp.exp(logits - lse_bch[..., None]), 0.0)
  out = values(p.astype(dtype))
  lse_bch = jnp.where(any_valid, lse_bch, -jnp.inf)
  return out.astype(dtype), lse_bch


def sparse_mla_xla(q, kv, indices, *, v_dim: int, scale: float, chunk_size: int = 256,
                   einsum=jnp.einsum):
  """Chunked jnp sparse MLA attention (the `impl="xla"` path).

  Args:
    q: [b, t, h, d_qk] absorbed queries [q_latent | q_rope].
    kv: [b, s, d_qk] cache rows [c_kv | k_rope], shared by all heads.
    indices: [b, t, k] int32 row ids, -1 = empty slot.
    v_dim: value width (the first v_dim columns of kv, i.e. c_kv).
    scale: logit scale.
    chunk_size: queries processed at once.
    einsum: computes the two products (`jnp.einsum`'s signature; a forward-only caller may
      pass one with the same numbers, e.g. the CPU inference engine's kernel).

  Returns:
    out [b, t, h, v_dim] (q.dtype), lse [b, t, h] float32.
  """
  b, t, h, d = q.shape
  c = max(1, min(chunk_size, t))
  n = -(-t // c)
  q_c = _backend.pad_to(q, 1, c).reshape(b, n, c, h, d).swapaxes(0, 1)
  i_c = _backend.pad_to(indices, 1, c, value=-1).reshape(b, n, c, -1).swapaxes(0, 1)

  # The chunks gather from a float32 view of kv, so kv's gradient (a scatter-add over every
  # query that selected a row, summed across chunks) accumulates in float32; in bfloat16 it
  # was 0.4-0.6 off a float32 reference at 8K-128K tokens on an H200 (docs/benchmarks.md).
  kv32 = kv.astype(jnp.float32)

  @jax.checkpoint
  def one_chunk(args):
    q_bchd, idx_bck = args
    return _attend_chunk(q_bchd, kv32, idx_bck, v_dim, scale, kv.dtype, einsum)

  out, lse = jax.lax.map(one_chunk, (q_c, i_c))
  out = out.swapaxes(0, 1).reshape(b, n * c, h, v_dim)[:, :t]
  lse = lse.swapaxes(0, 1).reshape(b, n * c, h)[:, :t]
  return out, lse


def sparse_mla_dense_oracle(q, kv, indices, *, v_dim: int, scale: float):
  """Test oracle: full [t, s] logits with the top-k set as an additive mask.

  Duplicate indices count once here (a set); kernels and the chunked path
  count each slot, so tests draw duplicate-free indices.
  """
  s = kv.shape[1]
  logits = jnp.einsum("bthd,bsd->bths", q, kv, preferred_element_type=jnp.float32) * scale
  onehot = jax.nn.one_hot(jnp.where(indices >= 0, indices, s), s + 1, dtype=jnp.bool_)
  allowed_bts = jnp.any(onehot, axis=-2)[..., :s]
  logits = jnp.where(allowed_bts[:, :, None, :], logits, -jnp.inf)
  lse = jax.nn.logsumexp(logits, axis=-1)
  any_valid = jnp.any(allowed_bts, axis=-1)[:, :, None]
  p = jnp.where(any_valid[..., None], jnp.exp(logits - lse[..., None]), 0.0)
  out = jnp.einsum("bths,bsv->bthv", p, kv[..., :v_dim].astype(jnp.float32))
  return out.astype(q.dtype), jnp.where(any_valid, lse, -jnp.inf)
