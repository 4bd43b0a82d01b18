"""Sparse MLA attention on TPU (Pallas Mosaic): forward and backward kernels.

Absorbed-MLA (MQA) attention over gathered top-k rows, docs/design.md §2.3-2.4;
the maths of `xla.sparse_mla_xla`. Notation: b batch, t queries,
s cache rows, h heads, k top-k slots (padded to n_kb blocks of bk), d = d_qk,
v = v_dim.

Gather (the pattern of jax's `paged_attention` / `ragged_paged_attention`
kernels and sglang-jax `sparse_mla_prefill.py`): the cache stays in HBM
(`memory_space=pl.ANY`); the slot indices of the current query sit in SMEM
(a per-query SMEM block, not a scalar prefetch of the whole [b, t, k] table,
which would not fit SMEM at 32K x 2048), and each selected row is copied into
VMEM by its own DMA (`pltpu.make_async_copy`). The rows of block kb+1 are
fetched while block kb is computed (two VMEM slots, one DMA semaphore each).
Empty slots (-1) fetch row 0 and are masked; blocks past the last valid slot
of a query (`n_live`) are neither fetched nor computed.

Row layout (`prepare_kv`): a one-row DMA lands at any sublane offset of a
32-bit VMEM buffer, but not inside a packed bfloat16 tile (16 rows per tile).
The cache is therefore gathered as float32 rows and cast back to the query
dtype in VMEM before the matmuls, which is exact; this costs 2x the bytes of a
bfloat16 row (packing bfloat16 pairs into uint32 lanes would remove that and is
the next step once a TPU can measure it). q, do and dq keep their own dtype and
width (d = 576 is a whole-dimension block; no padded copies in HBM).

HBM layout: every per-query operand is shaped so that its two minor dimensions
tile without padding. lse and delta travel as [b, t, 1, h] rows, not [b, t, h, 1]
columns (a trailing 1 is padded to 128 lanes: 128x the bytes, 1 GiB per layer at
32K); the kernels turn the row into the [h, 1] column they need with an on-chip
transpose. The number of live slot blocks is computed in the kernel from the
query's index block, and the duplicate-row matrix of the backward from the
index row and its transpose. `experiments/aot_tpu_kernels.py` checks these HBM
sizes with libtpu's compiler.

Forward, grid (b, t, n_kb), one query per (b, t) with its h heads as the
matmul M dimension (one gathered 576-wide row serves all heads):
  s = q_hd . rows_kd^T * scale           [h, bk]
  online softmax over blocks (m, l, acc) -> out [h, v], lse [h]
(the flash-attention recurrence of jax `pallas/ops/tpu/flash_attention.py`).

Backward, grid (b, t, n_kb), flash-attention backward with the saved lse
(tilelang `examples/deepseek_v32/sparse_mla_bwd.py` for the sparse form):
  p  = exp(s - lse)            dp = do . rows[:, :v]^T
  ds = p * (dp - delta)        delta = sum(do * out) - dlse
  dq   += ds . rows * scale                        (VMEM accumulator)
  dkv[idx] += ds^T . q * scale, dkv[idx, :v] += p^T . do   (accumulate by DMA)
dkv is a float32 [b, s, d] buffer in HBM, aliased input -> output. Per block
the kernel DMAs the selected dkv rows into VMEM, adds, and DMAs them back,
waiting for the writes before the next read; the t and kb grid axes are
"arbitrary" (sequential on one core) so that no two read-modify-writes of the
same row overlap, and only the batch axis is "parallel" (different batch
elements own different dkv rows). A row selected twice inside one block would
lose one update to the read-modify-write; when a block holds a duplicate index
(never the case for `topk_indices` output) its contributions are first summed
per distinct row with an equality-matrix matmul, so every copy writes the same
total.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _backend
from pallas_kernels._backend import nn_dot, nt_dot, tn_dot

DEFAULT_BLOCK_K = 128      # gathered rows per grid step (a 128-wide MXU tile)
_LANES = 128               # m and l scratch are [h, 128], replicated across lanes


def _row_copy(src_hbm, bi, row, dst_vmem, r, sem):
  """DMA descriptor for one cache row: src[bi, row] -> dst[r]."""
  return pltpu.make_async_copy(src_hbm.at[bi, pl.ds(row, 1)], dst_vmem.at[pl.ds(r, 1)], sem)


def prepare_kv(kv):
  """kv [b, s, d] as float32 rows (see the module docstring)."""
  return kv.astype(jnp.float32)


def _live_blocks(idx_vmem):
  """Blocks up to the query's last valid slot, from its [n_kb, bk] index block."""
  idx = idx_vmem[...]
  block = jax.lax.broadcasted_iota(jnp.int32, idx.shape, 0) + 1
  return jnp.max(jnp.where(idx >= 0, block, 0))


def _row_to_column(x_1h):
  """[1, h] -> [h, 1] through an on-chip transpose (Mosaic transposes 2-D tiles)."""
  return jnp.broadcast_to(x_1h, (_LANES, x_1h.shape[1])).T[:, :1]


def _gather_rows(idx_smem, kb, kv_hbm, bi, buf, slot, sem, *, start: bool):
  """Starts (start=True) or waits for the bk row DMAs of block kb into buf[slot]."""
  block_k = buf.shape[1]

  def one(r, carry):
    row = jnp.maximum(idx_smem[kb, r], 0)
    copy = _row_copy(kv_hbm, bi, row, buf.at[slot], r, sem.at[slot])
    if start:
      copy.start()
    else:
      copy.wait()
    return carry

  jax.lax.fori_loop(0, block_k, one, 0)


def _start_fetches(idx_smem, idx_vmem, kv_hbm, rows_buf, sem):
  """Prologue of both kernels -> (bi, kb, n_live, slot).

  Starts the row DMAs of block 0 at kb == 0, and of block kb + 1 into the other
  slot while block kb is computed (blocks past n_live are not fetched).
  """
  bi, kb = pl.program_id(0), pl.program_id(2)
  n_live = _live_blocks(idx_vmem)
  slot = jax.lax.rem(kb, 2)

  @pl.when((kb == 0) & (n_live > 0))
  def _first_fetch():
    _gather_rows(idx_smem, 0, kv_hbm, bi, rows_buf, 0, sem, start=True)

  @pl.when(kb + 1 < n_live)
  def _prefetch_next():
    _gather_rows(idx_smem, kb + 1, kv_hbm, bi, rows_buf, 1 - slot, sem, start=True)

  return bi, kb, n_live, slot


def _per_query(*shape):
  """BlockSpec of one query's [*shape] block of a [b, t, *shape] operand, grid (b, t, n_kb)."""
  return pl.BlockSpec((None, None) + shape, lambda i, j, k: (i, j) + (0,) * len(shape))


def _gather_operands(q, kv, idx_bgnk):
  """(in_specs, scratch_shapes) that both kernels start with.

  in_specs: the query's index block in SMEM and in VMEM, q [h, d], kv left in HBM;
  scratch: two VMEM slots of bk gathered rows [2, bk, d] and their DMA semaphores.
  """
  _, _, h, d = q.shape
  _, _, n_kb, block_k = idx_bgnk.shape
  in_specs = [pl.BlockSpec((None, None, n_kb, block_k), lambda i, j, k: (i, j, 0, 0),
                           memory_space=pltpu.SMEM),
              _per_query(n_kb, block_k), _per_query(h, d), pl.BlockSpec(memory_space=pl.ANY)]
  return in_specs, [pltpu.VMEM((2, block_k, d), kv.dtype), pltpu.SemaphoreType.DMA((2,))]


# --------------------------------------------------------------------------- forward


def _fwd_kernel(idx_smem, idx_vmem, q_ref, kv_hbm, out_ref, lse_ref,
                rows_buf, sem, m_ref, l_ref, acc_ref, *, scale, v_dim, precision):
  @pl.when(pl.program_id(2) == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  bi, kb, n_live, slot = _start_fetches(idx_smem, idx_vmem, kv_hbm, rows_buf, sem)

  @pl.when(kb < n_live)
  def _compute():
    _gather_rows(idx_smem, kb, kv_hbm, bi, rows_buf, slot, sem, start=False)
    rows = rows_buf[slot].astype(q_ref.dtype)                  # [bk, d]
    valid = idx_vmem[pl.ds(kb, 1), :] >= 0                     # [1, bk]
    s = nt_dot(q_ref[...], rows, precision) * scale            # [h, bk]
    s = jnp.where(valid, s, -jnp.inf)
    m_prev = m_ref[...]                                        # [h, 128]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)          # a block with no valid slot
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe[:, :1])                             # [h, bk], 0 on empty slots
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_new
    pv = nn_dot(p.astype(rows.dtype), rows[:, :v_dim], precision)
    acc_ref[...] = alpha[:, :1] * acc_ref[...] + pv

  @pl.when(kb == pl.num_programs(2) - 1)
  def _finish():
    l = l_ref[...]                                             # [h, 128], lanes equal
    has = l > 0.0
    l_safe = jnp.where(has, l, 1.0)
    out_ref[...] = (acc_ref[...] * jnp.where(has, 1.0 / l_safe, 0.0)[:, :1]).astype(out_ref.dtype)
    lse = jnp.where(has, m_ref[...] + jnp.log(l_safe), -jnp.inf)
    lse_ref[...] = lse.T[:1, :]                                # [1, h]


def sparse_mla_fwd(q, kv, idx_bgnk, *, v_dim, scale, interpret=False):
  """Forward kernel.

  Args:
    q: [b, t, h, d] queries.
    kv: [b, s, d] float32 cache rows (`prepare_kv`; left in HBM).
    idx_bgnk: [b, t, n_kb, bk] int32 slot indices, -1 = empty.
    v_dim, scale: as in `xla.sparse_mla_xla`.
    interpret: False, True or a `pltpu.InterpretParams`.

  Returns:
    out [b, t, h, v] (q.dtype), lse [b, t, 1, h] float32.
  """
  b, t, h, _ = q.shape
  kernel = functools.partial(_fwd_kernel, scale=scale, v_dim=v_dim,
                             precision=_backend.dot_precision(q.dtype))
  in_specs, scratch = _gather_operands(q, kv, idx_bgnk)
  return pl.pallas_call(
      kernel,
      grid=(b, t, idx_bgnk.shape[2]),
      in_specs=in_specs,
      out_specs=[_per_query(h, v_dim), _per_query(1, h)],
      out_shape=[jax.ShapeDtypeStruct((b, t, h, v_dim), q.dtype),
                 jax.ShapeDtypeStruct((b, t, 1, h), jnp.float32)],
      scratch_shapes=scratch + [
          pltpu.VMEM((h, _LANES), jnp.float32),
          pltpu.VMEM((h, _LANES), jnp.float32),
          pltpu.VMEM((h, v_dim), jnp.float32),
      ],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=_backend.tpu_interpret(interpret),
      name="sparse_mla_fwd",
  )(idx_bgnk, idx_bgnk, q, kv)


# -------------------------------------------------------------------------- backward


def _bwd_kernel(idx_smem, idx_vmem, q_ref, kv_hbm, do_ref, lse_ref, delta_ref, dkv_in_hbm,
                dq_ref, dkv_hbm, rows_buf, sem, dkv_buf, dsem, dq_acc, *, scale, v_dim,
                precision):
  del dkv_in_hbm  # aliased with dkv_hbm
  block_k = rows_buf.shape[1]

  @pl.when(pl.program_id(2) == 0)
  def _init():
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

  bi, kb, n_live, slot = _start_fetches(idx_smem, idx_vmem, kv_hbm, rows_buf, sem)

  def dkv_rows(op):
    """Start ("read" / "write") or wait for the dkv row DMAs of the valid slots of block kb."""
    def one(r, carry):
      row = idx_smem[kb, r]

      @pl.when(row >= 0)
      def _():
        if op in ("read", "wait_read"):
          copy = _row_copy(dkv_hbm, bi, row, dkv_buf, r, dsem)
        else:
          copy = pltpu.make_async_copy(dkv_buf.at[pl.ds(r, 1)],
                                       dkv_hbm.at[bi, pl.ds(row, 1)], dsem)
        if op.startswith("wait"):
          copy.wait()
        else:
          copy.start()
      return carry
    jax.lax.fori_loop(0, block_k, one, 0)

  @pl.when(kb < n_live)
  def _compute():
    dkv_rows("read")
    _gather_rows(idx_smem, kb, kv_hbm, bi, rows_buf, slot, sem, start=False)
    rows = rows_buf[slot].astype(q_ref.dtype)                  # [bk, d]
    q = q_ref[...]                                             # [h, d]
    do = do_ref[...]                                           # [h, v]
    row = idx_vmem[pl.ds(kb, 1), :]                            # [1, bk]
    valid = row >= 0
    s = nt_dot(q, rows, precision) * scale                     # [h, bk]
    p = jnp.where(valid, jnp.exp(s - _row_to_column(lse_ref[...])), 0.0)
    dp = nt_dot(do, rows[:, :v_dim], precision)                # [h, bk]
    ds = p * (dp - _row_to_column(delta_ref[...]))             # [h, bk]
    ds_c = ds.astype(rows.dtype)
    dq_acc[...] += nn_dot(ds_c, rows, precision) * scale
    d_rows = tn_dot(ds_c, q, precision) * scale                # [bk, d]
    d_rows_v = tn_dot(p.astype(do.dtype), do, precision)       # [bk, v]
    # Sum the contributions of slots that name the same row (duplicates) so that
    # each of their read-modify-writes stores the same total.
    rows_bk = jnp.broadcast_to(row, (block_k, block_k))        # [bk, bk]: [i, j] = row[j]
    same = ((rows_bk.T == rows_bk) & valid).astype(jnp.float32)
    has_dup = jnp.sum(same) > jnp.sum(valid.astype(jnp.float32))
    sum_dups = lambda x: jax.lax.cond(
        has_dup, lambda y: nn_dot(same, y, jax.lax.Precision.HIGHEST), lambda y: y, x)
    d_rows, d_rows_v = sum_dups(d_rows), sum_dups(d_rows_v)
    dkv_rows("wait_read")
    dkv_buf[...] = dkv_buf[...] + d_rows
    dkv_buf[:, :v_dim] = dkv_buf[:, :v_dim] + d_rows_v
    dkv_rows("write")
    dkv_rows("wait_write")

  @pl.when(kb == pl.num_programs(2) - 1)
  def _finish():
    dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)


def sparse_mla_bwd(q, kv, idx_bgnk, do, lse_bt1h, delta_bt1h, *, v_dim, scale,
                   interpret=False):
  """Backward kernel.

  Args:
    q, kv, idx_bgnk: as in `sparse_mla_fwd`.
    do: [b, t, h, v] output cotangent.
    lse_bt1h: [b, t, 1, h] float32 saved log-sum-exp.
    delta_bt1h: [b, t, 1, h] float32, sum(do * out, -1) - dlse.

  Returns:
    dq [b, t, h, d] (q.dtype), dkv [b, s, d] float32.
  """
  b, t, h, d = q.shape
  s = kv.shape[1]
  _, _, n_kb, block_k = idx_bgnk.shape
  kernel = functools.partial(_bwd_kernel, scale=scale, v_dim=v_dim,
                             precision=_backend.dot_precision(q.dtype))
  in_specs, scratch = _gather_operands(q, kv, idx_bgnk)
  dkv0 = jnp.zeros((b, s, d), jnp.float32)
  return pl.pallas_call(
      kernel,
      grid=(b, t, n_kb),
      in_specs=in_specs + [_per_query(h, v_dim), _per_query(1, h), _per_query(1, h),
                           pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=[_per_query(h, d), pl.BlockSpec(memory_space=pl.ANY)],
      out_shape=[jax.ShapeDtypeStruct((b, t, h, d), q.dtype),
                 jax.ShapeDtypeStruct((b, s, d), jnp.float32)],
      scratch_shapes=scratch + [
          pltpu.VMEM((block_k, d), jnp.float32),
          pltpu.SemaphoreType.DMA(()),
          pltpu.VMEM((h, d), jnp.float32),
      ],
      input_output_aliases={7: 1},
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary")),
      interpret=_backend.tpu_interpret(interpret),
      name="sparse_mla_bwd",
  )(idx_bgnk, idx_bgnk, q, kv, do, lse_bt1h, delta_bt1h, dkv0)
