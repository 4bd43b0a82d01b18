"""Sparse MLA attention on GPU (Pallas Triton): forward and backward kernels.

Same maths as `tpu.py` and `reference.sparse_mla_reference` (GLM-5 spec
§2.3-2.4). Notation: b batch, t queries, s cache rows, h heads (padded to hp),
k top-k slots (n_kb blocks of bk), d = d_qk, v = v_dim.

Why Triton and not Mosaic GPU: with jax 0.10.2, Mosaic GPU gathers rows only
through TMA gather4, which needs sm100 (Blackwell); on the H200 (sm90) the only
gather is a per-row TMA copy. Pallas Triton lowers an integer-array index
`kv_ref[idx_k, cols]` to a vector gather load, which is what the sparse kernels
in tilelang `examples/deepseek_v32/sparse_mla_{fwd,bwd}.py` (and FlashMLA's
sparse decode) do, and lowers `atomic_add` with array indices to `tt.atomic_rmw`.

Triton tensors must have power-of-two sizes, so the d_qk columns are split into
the value part [0, v) and the tail [v, d) (GLM-5: 512 + 64, both powers of two)
and, for other shapes, each part and the head count are zero-padded by the
caller (`pad_operands`).

Forward, grid (b, t): one program per query; its hp heads are the matmul M
dimension; a `fori_loop` over the n_live blocks of bk slots gathers the rows,
  s = q_v . rows_v^T + q_tail . rows_tail^T          [hp, bk]
and runs the online softmax (m, l, acc [hp, v]) in registers.

Backward, grid (b, t): recomputes p from the saved lse; dq accumulates in
registers; the dkv contribution of each slot,
  ds^T . q * scale + [p^T . do | 0]                   [bk, d]
is added into a float32 [b, s + 1, d] buffer with atomic adds (row s takes the
empty slots, so no mask is needed and no real row is touched by them).
Atomic float adds make dkv's rounding order, and so its last bits, vary run to
run; dq and the forward are deterministic.

Interpret mode caveat (jax 0.10.2): the interpreter's `atomic_add` applies an
index that occurs twice in one call once, so duplicate indices inside one block
lose an update in interpret mode only; on a GPU the atomics add both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import _backend

DEFAULT_BLOCK_K = 64      # slots per loop step
MIN_DIM = 16              # tl.dot needs M, N, K >= 16
NUM_WARPS = 8


def _nt_dot(a, b, precision):
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def _nn_dot(a, b, precision):
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def _tn_dot(a, b, precision):
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def padded_dims(h: int, d: int, v_dim: int):
  """(hp, vp, tp): heads, value width and tail width rounded up to powers of two >= 16."""
  tail = d - v_dim
  tp = _backend.next_pow2(tail, MIN_DIM) if tail else 0
  return _backend.next_pow2(h, MIN_DIM), _backend.next_pow2(v_dim, MIN_DIM), tp


def pad_operands(q, kv, v_dim: int):
  """Zero-pads heads and the value / tail column groups to Triton sizes.

  Zero columns add exactly 0 to every dot product, and padded heads are sliced
  off, so results are unchanged. No copy is made when the shapes already fit
  (GLM-5: h=64, v=512, tail=64).

  Returns:
    q [b, t, hp, vp + tp], kv [b, s, vp + tp].
  """
  h, d = q.shape[2], q.shape[3]
  hp, vp, tp = padded_dims(h, d, v_dim)

  def split_pad(x):
    parts = [_backend.pad_to(x[..., :v_dim], x.ndim - 1, vp)]
    if tp:
      parts.append(_backend.pad_to(x[..., v_dim:], x.ndim - 1, tp))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)

  if (hp, vp, tp) != (h, v_dim, d - v_dim):
    q = _backend.pad_to(split_pad(q), 2, hp)
    kv = split_pad(kv)
  return q, kv


def _scores(q_ref, kv_ref, safe_k, vp, tp, scale, precision):
  """Gathers rows safe_k [bk]: logits [hp, bk], value rows [bk, vp], tail rows [bk, tp] | None."""
  rows_v = kv_ref[safe_k, pl.ds(0, vp)]
  s = _nt_dot(q_ref[:, pl.ds(0, vp)], rows_v, precision)
  rows_t = None
  if tp:
    rows_t = kv_ref[safe_k, pl.ds(vp, tp)]
    s = s + _nt_dot(q_ref[:, pl.ds(vp, tp)], rows_t, precision)
  return s * scale, rows_v, rows_t


# --------------------------------------------------------------------------- forward


def _fwd_kernel(nlive_ref, idx_ref, q_ref, kv_ref, out_ref, lse_ref, *, scale, vp, tp,
                block_k, precision):
  hp = q_ref.shape[0]

  def body(kb, carry):
    m_prev, l_prev, acc = carry
    idx_k = idx_ref[pl.ds(kb * block_k, block_k)]
    valid = idx_k >= 0
    s, rows_v, _ = _scores(q_ref, kv_ref, jnp.where(valid, idx_k, 0), vp, tp, scale,
                           precision)
    s = jnp.where(valid[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    l_new = alpha * l_prev + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + _nn_dot(p.astype(rows_v.dtype), rows_v, precision)
    return m_new, l_new, acc

  init = (jnp.full((hp,), -jnp.inf, jnp.float32), jnp.zeros((hp,), jnp.float32),
          jnp.zeros((hp, vp), jnp.float32))
  m, l, acc = jax.lax.fori_loop(0, nlive_ref[0], body, init)
  has = l > 0.0
  l_safe = jnp.where(has, l, 1.0)
  out_ref[...] = (acc * jnp.where(has, 1.0 / l_safe, 0.0)[:, None]).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(has, m + jnp.log(l_safe), -jnp.inf)


def sparse_mla_fwd(q, kv, idx_btk, nlive_bt1, *, v_dim, scale, block_k, interpret=False):
  """Forward kernel on padded operands (see `pad_operands`).

  Args:
    q: [b, t, hp, vp + tp]; kv: [b, s, vp + tp].
    idx_btk: [b, t, n_kb * bk] int32, -1 = empty.
    nlive_bt1: [b, t, 1] int32 live blocks per query.
    v_dim: unpadded value width (vp and tp follow from it).
    block_k: bk, a power of two >= 16.

  Returns:
    out [b, t, hp, vp] (q.dtype), lse [b, t, hp] float32.
  """
  b, t, hp, dp = q.shape
  s = kv.shape[1]
  k_pad = idx_btk.shape[-1]
  vp = _backend.next_pow2(v_dim, MIN_DIM)
  tp = dp - vp
  kernel = functools.partial(_fwd_kernel, scale=scale, vp=vp, tp=tp, block_k=block_k,
                             precision=_backend.dot_precision(q.dtype))
  return pl.pallas_call(
      kernel,
      grid=(b, t),
      in_specs=[
          pl.BlockSpec((None, None, 1), lambda i, j: (i, j, 0)),
          pl.BlockSpec((None, None, k_pad), lambda i, j: (i, j, 0)),
          pl.BlockSpec((None, None, hp, dp), lambda i, j: (i, j, 0, 0)),
          pl.BlockSpec((None, s, dp), lambda i, j: (i, 0, 0)),
      ],
      out_specs=[pl.BlockSpec((None, None, hp, vp), lambda i, j: (i, j, 0, 0)),
                 pl.BlockSpec((None, None, hp), lambda i, j: (i, j, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, t, hp, vp), q.dtype),
                 jax.ShapeDtypeStruct((b, t, hp), jnp.float32)],
      compiler_params=pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
      interpret=_backend.gpu_interpret(interpret),
      name="sparse_mla_fwd",
  )(nlive_bt1, idx_btk, q, kv)


# -------------------------------------------------------------------------- backward


def _bwd_kernel(nlive_ref, idx_ref, q_ref, kv_ref, do_ref, lse_ref, delta_ref, dkv_in_ref,
                dq_ref, dkv_ref, *, scale, vp, tp, block_k, trash_row, precision):
  del dkv_in_ref  # aliased with dkv_ref
  hp = q_ref.shape[0]
  do = do_ref[...]                                   # [hp, vp]
  lse = lse_ref[...]                                 # [hp]
  delta = delta_ref[...]                             # [hp]
  cols_v = jax.lax.broadcasted_iota(jnp.int32, (block_k, vp), 1)
  cols_t = jax.lax.broadcasted_iota(jnp.int32, (block_k, tp), 1) + vp if tp else None

  def body(kb, carry):
    dq_v_acc, dq_t_acc = carry
    idx_k = idx_ref[pl.ds(kb * block_k, block_k)]
    valid = idx_k >= 0
    safe_k = jnp.where(valid, idx_k, 0)
    s, rows_v, rows_t = _scores(q_ref, kv_ref, safe_k, vp, tp, scale, precision)
    p = jnp.where(valid[None, :], jnp.exp(s - lse[:, None]), 0.0)     # [hp, bk]
    dp_ = _nt_dot(do, rows_v, precision)                               # [hp, bk]
    ds = (p * (dp_ - delta[:, None])).astype(q_ref.dtype)
    dq_v_acc += _nn_dot(ds, rows_v, precision) * scale
    dkv_v = (_tn_dot(ds, q_ref[:, pl.ds(0, vp)], precision) * scale
             + _tn_dot(p.astype(do.dtype), do, precision))            # [bk, vp]
    dest = jnp.where(valid, idx_k, trash_row)[:, None]
    pltr.atomic_add(dkv_ref, (jnp.broadcast_to(dest, (block_k, vp)), cols_v), dkv_v)
    if tp:
      dq_t_acc += _nn_dot(ds, rows_t, precision) * scale
      dkv_t = _tn_dot(ds, q_ref[:, pl.ds(vp, tp)], precision) * scale
      pltr.atomic_add(dkv_ref, (jnp.broadcast_to(dest, (block_k, tp)), cols_t), dkv_t)
    return dq_v_acc, dq_t_acc

  init = (jnp.zeros((hp, vp), jnp.float32), jnp.zeros((hp, max(tp, 1)), jnp.float32))
  dq_v, dq_t = jax.lax.fori_loop(0, nlive_ref[0], body, init)
  dq_ref[:, pl.ds(0, vp)] = dq_v.astype(dq_ref.dtype)
  if tp:
    dq_ref[:, pl.ds(vp, tp)] = dq_t.astype(dq_ref.dtype)


def sparse_mla_bwd(q, kv, idx_btk, nlive_bt1, do, lse_bth, delta_bth, *, v_dim, scale,
                   block_k, interpret=False):
  """Backward kernel on padded operands.

  Args:
    q, kv, idx_btk, nlive_bt1: as in `sparse_mla_fwd`.
    do: [b, t, hp, vp] output cotangent (zero-padded).
    lse_bth, delta_bth: [b, t, hp] float32; delta = sum(do * out) - dlse.

  Returns:
    dq [b, t, hp, vp + tp] (q.dtype), dkv [b, s, vp + tp] float32.
  """
  b, t, hp, dp = q.shape
  s = kv.shape[1]
  k_pad = idx_btk.shape[-1]
  vp = _backend.next_pow2(v_dim, MIN_DIM)
  tp = dp - vp
  kernel = functools.partial(_bwd_kernel, scale=scale, vp=vp, tp=tp, block_k=block_k,
                             trash_row=s, precision=_backend.dot_precision(q.dtype))
  dkv0 = jnp.zeros((b, s + 1, dp), jnp.float32)
  dq, dkv = pl.pallas_call(
      kernel,
      grid=(b, t),
      in_specs=[
          pl.BlockSpec((None, None, 1), lambda i, j: (i, j, 0)),
          pl.BlockSpec((None, None, k_pad), lambda i, j: (i, j, 0)),
          pl.BlockSpec((None, None, hp, dp), lambda i, j: (i, j, 0, 0)),
          pl.BlockSpec((None, s, dp), lambda i, j: (i, 0, 0)),
          pl.BlockSpec((None, None, hp, vp), lambda i, j: (i, j, 0, 0)),
          pl.BlockSpec((None, None, hp), lambda i, j: (i, j, 0)),
          pl.BlockSpec((None, None, hp), lambda i, j: (i, j, 0)),
          pl.BlockSpec((None, s + 1, dp), lambda i, j: (i, 0, 0)),
      ],
      out_specs=[pl.BlockSpec((None, None, hp, dp), lambda i, j: (i, j, 0, 0)),
                 pl.BlockSpec((None, s + 1, dp), lambda i, j: (i, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, t, hp, dp), q.dtype),
                 jax.ShapeDtypeStruct((b, s + 1, dp), jnp.float32)],
      input_output_aliases={7: 1},
      compiler_params=pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=2),
      interpret=_backend.gpu_interpret(interpret),
      name="sparse_mla_bwd",
  )(nlive_bt1, idx_btk, q, kv, do, lse_bth, delta_bth, dkv0)
  return dq, dkv[:, :s]
