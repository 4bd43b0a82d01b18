"""Sparse MLA attention on GPU (Pallas Triton): forward and backward kernels.

Same maths as `tpu.py` and `xla.sparse_mla_xla` (docs/design.md
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
and runs the online softmax (m, l, acc [hp, v]) in registers; q is loaded once,
before the loop, and stays in shared memory (GLM-5 shapes: 221,440 B, 204 B of
spill stores at 2 stages of gathered rows). Timed on an H200 (docs/benchmarks.md): 3 stages
of bk = 64 rows on 8 warps, the default, 38.9 ms at 32K tokens (36.9% of the roofline floor);
bk = 128 at 1 stage 38.3 ms; 2 stages 40.4 ms; 4 or 16 warps 2-6x slower.
Option `queries_per_program=2` (grid (b, t / 2)): two queries per program, each with
its own softmax state, one loop over both queries' blocks, so that the gathers of
one overlap the other's math (FlashMLA's sparse prefill splits the 576 columns over
two warpgroups instead, which Pallas Triton cannot express). It keeps two resident
q and two blocks of rows, and two [hp, vp] float32 accumulators in registers. For sm_90a
(`experiments/aot_gpu_kernels.py --variants`, 8 warps): bk = 32 at 1 stage 184,320 B of
shared memory, bk = 16 at 2 stages 221,312 B, bk = 64 at 1 stage 221,184 B (bk = 32 at 2
stages does not fit), each spilling 2.5-4 KB of registers (the default: 204 B).
`experiments/tune_gpu_kernels.py` times these against the default, which stays one query
per program until a device has.

Backward, grid (b, t), one program per query, no recomputation beyond p:
  [q_v; do]                [2hp, v]   stacked by the caller (`stack_q_do`), loaded once
  [s_v; dp] = [q_v; do] . rows_v^T     [2hp, bk]  one M = 2hp matmul chain
  s = s_v + q_tail . rows_tail^T;  p = exp(s * scale - lse);  ds = p (dp - delta) scale
  dq += ds . rows                      [hp, d]    float32, in registers
  dkv^T[cols] += [q_v; do]^T[cols] . [ds; p]     [128, bk] tiles; tail q_tail^T . ds
Each dkv^T tile goes to a float32 [b, s + 1, d] buffer with one relaxed atomic add (row s
takes the empty slots, so no mask is needed and no real row is touched by them).

Resources at GLM-5 shapes (h = 64, d = 576, v = 512, bk = 64, bf16; Triton 3.9 + ptxas
for sm_90a, `experiments/aot_gpu_kernels.py`): 221,184 B of shared memory (limit
232,448), 255 registers, 304 B of spill stores. Shared memory holds [q_v; do] (128 KiB),
q_tail (8 KiB) and one block of gathered rows (72 KiB); the dkv tiles' layout-conversion
scratch reuses the rows' space, because the dq matmuls (the rows' last use) come first.
The dq accumulator takes 144 of the 255 registers per thread (8 warps).
- num_stages = 1: a second stage of gathered rows (+72 KiB) does not fit next to the
  resident [q_v; do], so each block's gather is not overlapped with the previous block's
  math. bk = 32 at 2 stages needs 241,792 B; bk = 16 at 2 stages fits (190,528 B, 36 B
  spills) but makes N = 16 the width of the s / dp / dkv matmuls (HGMMA 64x16x16), whose
  shared-memory operand reads then cost about 2x the bk = 64 matmul time (estimate).
- Stacking q_v over do makes s_v and dp one matmul (its shared A operand read once, not
  twice) and dkv's value part one matmul per 128 columns; with separate q_v and do tiles
  the same loop spilled 0.7-2.8 KB. No [bk, v] float32 dkv tile exists (the previous
  kernel converted one through 128 KiB of shared memory: 516,352 B in all, 5.4 KB spills).
- Cost: the same FLOPs, gathers and atomics as the fused maths needs; the extra traffic is
  the caller's concatenation, 2 hp v (2 + 2) B per query read + written (256 KiB at GLM-5,
  ~1 GiB per 4096-query sequence), against 2.4 MB gathered and 4.7 MB atomically added per
  query. Not chosen: separate dq and dkv kernels (1.4x FLOPs, 2x gathers; still spilled
  1.4-2.8 KB and needed 1 stage); two head groups per query (2x gathers and atomics,
  M = 32 matmuls without wgmma; not built).
The numbers above are compiler output. Timed on an H200 at 32K tokens: the backward alone
takes 112.5 ms (32.3% of its floor), bk = 32 128 ms, bk = 16 at 2 stages 155 ms, 4 or 16
warps 2.5-3x slower; forward + backward is 33.3% of the roofline at 32K (docs/benchmarks.md).

`pltr.atomic_add` lowers to an acquire-release atomic, i.e. a `MEMBAR.ALL.GPU` fence before
every 16-byte atomic (36 per block of 64 slots here); dkv needs atomicity only, so the
kernel uses `atomic_add_relaxed` (`_relaxed_atomic.py`: `REDG`, no fence), the same op with
relaxed ordering.
Float atomics make dkv's rounding order, and so its last bits, vary run to run; dq and the
forward are deterministic.

Interpret mode caveat (jax 0.10.2): the interpreter's atomic add (`atomic_add_relaxed`
uses jax's own discharge rule) applies an index that occurs twice in one call once, so
duplicate indices inside one block lose an update in interpret mode only; on a GPU the
atomics add both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import _backend
from pallas_kernels._backend import nn_dot, nt_dot, tn_dot

try:  # built on private jax modules (written against jax 0.10.2)
  from pallas_kernels.sparse_attention._relaxed_atomic import atomic_add_relaxed
except (ImportError, AttributeError) as _e:  # jax internals moved: correct, but fenced
  from absl import logging
  logging.warning("sparse_attention.gpu: relaxed atomic add unavailable (%s); the backward "
                  "uses pltr.atomic_add, which fences every atomic", _e)
  atomic_add_relaxed = pltr.atomic_add

DEFAULT_BLOCK_K = 64      # slots per loop step
MIN_DIM = 16              # tl.dot needs M, N, K >= 16
NUM_WARPS = 8
FWD_STAGES = 3            # software pipelining of the forward's gathers (H200 sweep)
FWD_QUERIES = 1           # queries per forward program (2: not yet timed on a device)
BWD_STAGES = 1            # the backward's resident [q_v; do] leaves no room for a 2nd stage
BWD_CHUNK = 128           # value columns per backward dkv tile (and dq accumulator)


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


def _scores(q_v, q_t, kv_ref, safe_k, vp, tp, scale, precision):
  """Gathers rows safe_k [bk]: logits [hp, bk], value rows [bk, vp].

  q_v [hp, vp] and q_t [hp, tp] | None are loaded once, before the slot loop: a
  q read from its ref inside the loop is hoisted into registers by Triton and
  stored to shared memory again on every iteration (64 KiB per block at GLM-5).
  """
  rows_v = kv_ref[safe_k, pl.ds(0, vp)]
  s = nt_dot(q_v, rows_v, precision)
  if tp:
    s = s + nt_dot(q_t, kv_ref[safe_k, pl.ds(vp, tp)], precision)
  return s * scale, rows_v


def _per_query(*shape):
  """BlockSpec of one query's [*shape] block of a [b, t, *shape] operand, grid (b, t)."""
  return pl.BlockSpec((None, None) + shape, lambda i, j: (i, j) + (0,) * len(shape))


def _per_batch(*shape):
  """BlockSpec of a batch element's whole [*shape] block of a [b, *shape] operand."""
  return pl.BlockSpec((None,) + shape, lambda i, j: (i,) + (0,) * len(shape))


# --------------------------------------------------------------------------- forward


def _fwd_kernel(nlive_ref, idx_ref, q_ref, kv_ref, out_ref, lse_ref, *, scale, vp, tp,
                block_k, precision, queries):
  """`queries` queries per program, each with its own softmax state (m, l, acc).

  queries = 1: the refs are one query's blocks. queries = 2: they lead with a
  [2] query axis; one loop runs to the longer query's last live block (the
  shorter one's extra blocks are all -1, masked out) and gathers both queries'
  rows per step, so that one query's gather can overlap the other's math.
  """
  at = [()] if queries == 1 else [(i,) for i in range(queries)]
  hp = q_ref.shape[-2]
  q_v = [q_ref[i + (slice(None), pl.ds(0, vp))] for i in at]            # [hp, vp] each
  q_t = [q_ref[i + (slice(None), pl.ds(vp, tp))] if tp else None for i in at]

  def update(i, kb, carry):
    m_prev, l_prev, acc = carry
    idx_k = idx_ref[at[i] + (pl.ds(kb * block_k, block_k),)]
    valid = idx_k >= 0
    s, rows_v = _scores(q_v[i], q_t[i], kv_ref, jnp.where(valid, idx_k, 0), vp, tp, scale,
                        precision)
    s = jnp.where(valid[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    l_new = alpha * l_prev + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + nn_dot(p.astype(rows_v.dtype), rows_v, precision)
    return m_new, l_new, acc

  def body(kb, carries):
    return tuple(update(i, kb, c) for i, c in enumerate(carries))

  init = (jnp.full((hp,), -jnp.inf, jnp.float32), jnp.zeros((hp,), jnp.float32),
          jnp.zeros((hp, vp), jnp.float32))
  n_live = nlive_ref[at[0] + (0,)]
  for i in at[1:]:
    n_live = jnp.maximum(n_live, nlive_ref[i + (0,)])
  carries = jax.lax.fori_loop(0, n_live, body, (init,) * queries)
  for i, (m, l, acc) in zip(at, carries):
    has = l > 0.0
    l_safe = jnp.where(has, l, 1.0)
    out_ref[i] = (acc * jnp.where(has, 1.0 / l_safe, 0.0)[:, None]).astype(out_ref.dtype)
    lse_ref[i] = jnp.where(has, m + jnp.log(l_safe), -jnp.inf)


def _per_program(queries: int, *shape):
  """BlockSpec of `queries` queries' [*shape] blocks of a [b, t, *shape] operand, grid (b, t / queries)."""
  if queries == 1:
    return _per_query(*shape)
  return pl.BlockSpec((None, queries) + shape, lambda i, j: (i, j) + (0,) * len(shape))


def sparse_mla_fwd(q, kv, idx_btk, nlive_bt1, *, v_dim, scale, block_k, interpret=False,
                   num_warps=NUM_WARPS, num_stages=FWD_STAGES, queries_per_program=FWD_QUERIES):
  """Forward kernel on padded operands (see `pad_operands`).

  Args:
    q: [b, t, hp, vp + tp]; kv: [b, s, vp + tp].
    idx_btk: [b, t, n_kb * bk] int32, -1 = empty.
    nlive_bt1: [b, t, 1] int32 live blocks per query.
    v_dim: unpadded value width (vp and tp follow from it).
    block_k: bk, a power of two >= 16.
    num_warps, num_stages: Triton compile options (`experiments/tune_gpu_kernels.py`).
    queries_per_program: 1 or 2 queries per program, each with its own softmax
      state (2: t is padded to even with empty queries, sliced off again).

  Returns:
    out [b, t, hp, vp] (q.dtype), lse [b, t, hp] float32.
  """
  if queries_per_program not in (1, 2):
    raise ValueError(f"sparse_mla_fwd: queries_per_program={queries_per_program}, expected "
                     "1 or 2")
  b, t, hp, dp = q.shape
  vp = _backend.next_pow2(v_dim, MIN_DIM)
  tp = dp - vp
  qp = queries_per_program
  if t % qp:      # an empty query: no live block, out 0, lse -inf
    q, idx_btk = _backend.pad_to(q, 1, qp), _backend.pad_to(idx_btk, 1, qp, -1)
    nlive_bt1 = _backend.pad_to(nlive_bt1, 1, qp)
  kernel = functools.partial(_fwd_kernel, scale=scale, vp=vp, tp=tp, block_k=block_k,
                             precision=_backend.dot_precision(q.dtype), queries=qp)
  t_p = q.shape[1]
  out, lse = pl.pallas_call(
      kernel,
      grid=(b, t_p // qp),
      in_specs=[_per_program(qp, 1), _per_program(qp, idx_btk.shape[-1]),
                _per_program(qp, hp, dp), _per_batch(kv.shape[1], dp)],
      out_specs=[_per_program(qp, hp, vp), _per_program(qp, hp)],
      out_shape=[jax.ShapeDtypeStruct((b, t_p, hp, vp), q.dtype),
                 jax.ShapeDtypeStruct((b, t_p, hp), jnp.float32)],
      compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=_backend.gpu_interpret(interpret),
      name="sparse_mla_fwd",
  )(nlive_bt1, idx_btk, q, kv)
  return (out, lse) if t_p == t else (out[:, :t], lse[:, :t])


# -------------------------------------------------------------------------- backward


def stack_q_do(q, do, vp: int):
  """[q_v; do]: the value columns of q over the output cotangent, [b, t, 2 hp, vp]."""
  return jnp.concatenate([q[..., :vp], do.astype(q.dtype)], axis=2)


def _stack_rows(a, b):
  """[n, m], [n, m] -> [a; b] [2n, m] (Triton has no general concatenate)."""
  n, m = a.shape
  return jnp.transpose(jnp.stack([a, b], axis=-1), (2, 0, 1)).reshape(2 * n, m)


def _dot_sum(dots):
  acc = dots[0]
  for d in dots[1:]:
    acc = acc + d                  # Triton folds the add into the next dot's accumulator
  return acc


def _bwd_scores(qdo, q_t, kv_v, kv_t, precision):
  """s (value + tail part, unscaled) and dp, [hp, bk] each, from one M = 2hp matmul chain."""
  s, dp_ = jnp.split(_dot_sum([nt_dot(a, r, precision) for a, r in zip(qdo, kv_v)]), 2,
                     axis=0)                       # [q_v; do] . rows_v^T = [s_v; dp]
  if q_t is not None:
    s = s + nt_dot(q_t, kv_t, precision)
  return s, dp_


def _bwd_dkv(dkv_ref, qdo, q_t, ds, p, dest, *, vp, precision):
  """Adds dkv[dest] += [ds^T . q | 0] + [p^T . do | 0], as transposed [chunk, bk] tiles.

  qdo: [2hp, chunk] tiles of [q_v; do]; ds, p: [hp, bk] (scale in ds); dest: [1, bk].
  """
  chunk, bk = qdo[0].shape[1], ds.shape[1]
  col = jax.lax.broadcasted_iota(jnp.int32, (chunk, bk), 0)
  dsp = _stack_rows(ds, p.astype(ds.dtype))                         # [2hp, bk]
  for i, a in enumerate(qdo):                                        # [chunk, bk] = a^T . dsp
    atomic_add_relaxed(dkv_ref, (jnp.broadcast_to(dest, (chunk, bk)), col + i * chunk),
                       tn_dot(a, dsp, precision))
  if q_t is not None:
    tp = q_t.shape[1]
    col_t = jax.lax.broadcasted_iota(jnp.int32, (tp, bk), 0) + vp
    atomic_add_relaxed(dkv_ref, (jnp.broadcast_to(dest, (tp, bk)), col_t),
                       tn_dot(q_t, ds, precision))                  # [tp, bk]


def _bwd_kernel(nlive_ref, idx_ref, qdo_ref, q_ref, kv_ref, lse_ref, delta_ref, dkv_in_ref,
                dq_ref, dkv_ref, *, scale, vp, tp, chunk, block_k, trash_row, precision):
  del dkv_in_ref  # aliased with dkv_ref
  hp = q_ref.shape[0]
  cols = [pl.ds(c, chunk) for c in range(0, vp, chunk)] + ([pl.ds(vp, tp)] if tp else [])
  qdo = [qdo_ref[:, c] for c in cols[:vp // chunk]]  # [2hp, chunk] each, loaded once
  q_t = q_ref[:, cols[-1]] if tp else None           # [hp, tp]
  lse = lse_ref[...]                                 # [hp]
  delta = delta_ref[...]                             # [hp]

  def body(kb, dq):
    idx_k = idx_ref[pl.ds(kb * block_k, block_k)]
    valid = idx_k >= 0
    safe_k = jnp.where(valid, idx_k, 0)
    rows = [kv_ref[safe_k, c] for c in cols]                         # [bk, chunk | tp]
    s, dp_ = _bwd_scores(qdo, q_t, rows[:len(qdo)], rows[-1] if tp else None, precision)
    p = jnp.where(valid[None, :], jnp.exp(s * scale - lse[:, None]), 0.0)   # [hp, bk]
    ds = (p * (dp_ - delta[:, None]) * scale).astype(qdo_ref.dtype)         # scale folded in
    # dq first: after the rows' last use, the dkv tiles reuse their shared memory (the
    # other order needs 32 KiB more, 253,952 B at GLM-5 shapes).
    dq = tuple(acc + nn_dot(ds, r, precision) for acc, r in zip(dq, rows))
    dest = jnp.where(valid, idx_k, trash_row)[None, :]                      # [1, bk]
    _bwd_dkv(dkv_ref, qdo, q_t, ds, p, dest, vp=vp, precision=precision)
    return dq

  init = tuple(jnp.zeros((hp, c.size), jnp.float32) for c in cols)
  dq = jax.lax.fori_loop(0, nlive_ref[0], body, init)               # [hp, chunk | tp] each
  for c, acc in zip(cols, dq):
    dq_ref[:, c] = acc.astype(dq_ref.dtype)


def sparse_mla_bwd(q, kv, idx_btk, nlive_bt1, do, lse_bth, delta_bth, *, v_dim, scale,
                   block_k, interpret=False, num_warps=NUM_WARPS, num_stages=BWD_STAGES):
  """Backward kernel on padded operands.

  Args:
    q, kv, idx_btk, nlive_bt1: as in `sparse_mla_fwd`.
    do: [b, t, hp, vp] output cotangent (zero-padded).
    lse_bth, delta_bth: [b, t, hp] float32; delta = sum(do * out) - dlse.
    block_k: bk, a power of two >= 16 (GLM-5 shapes fit the shared memory up to 64).
    num_warps, num_stages: Triton compile options.

  Returns:
    dq [b, t, hp, vp + tp] (q.dtype), dkv [b, s, vp + tp] float32.
  """
  b, t, hp, dp = q.shape
  s = kv.shape[1]
  vp = _backend.next_pow2(v_dim, MIN_DIM)
  tp = dp - vp
  qdo = stack_q_do(q, do, vp)
  kernel = functools.partial(_bwd_kernel, scale=scale, vp=vp, tp=tp,
                             chunk=min(BWD_CHUNK, vp), block_k=block_k, trash_row=s,
                             precision=_backend.dot_precision(q.dtype))
  dkv0 = jnp.zeros((b, s + 1, dp), jnp.float32)
  dq, dkv = pl.pallas_call(
      kernel,
      grid=(b, t),
      in_specs=[_per_query(1), _per_query(idx_btk.shape[-1]), _per_query(2 * hp, vp),
                _per_query(hp, dp), _per_batch(s, dp), _per_query(hp), _per_query(hp),
                _per_batch(s + 1, dp)],
      out_specs=[_per_query(hp, dp), _per_batch(s + 1, dp)],
      out_shape=[jax.ShapeDtypeStruct((b, t, hp, dp), q.dtype),
                 jax.ShapeDtypeStruct((b, s + 1, dp), jnp.float32)],
      input_output_aliases={7: 1},
      compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=_backend.gpu_interpret(interpret),
      name="sparse_mla_bwd",
  )(nlive_bt1, idx_btk, qdo, q, kv, lse_bth, delta_bth, dkv0)
  return dq, dkv[:, :s]
