"""DeepSeek Sparse Attention's decode on XLA:CPU, straight from the paged cache, with the
numbers of the XLA path: the indexer's scores, its top-k, sparse attention's two products.

The CPU engine's DSA, per cached layer and step (`small`, 16 requests at 1K context), went
through XLA as: a gather of each request's indexer keys out of the paged pool, transposed
for the product (~0.35 ms a layer), the per-request products over the whole block-table
view (a power of two of positions: 2048 there, half of them past the context), the ReLU,
the sum over heads, a mask, and `lax.top_k`, which XLA:CPU runs as a partial sort whose
comparator converts both floats at every comparison (~1.8 ms for 16 rows of 1024); then
a gather of the 256 selected cache rows per request, a transposed copy of them for the
logits and a sliced one for the values. The C++ custom calls of `cpu_dsa.cc` replace them
with:

  1. `paged_scores`: for each query, I[s] = sum_j w[j] relu(q[j] . k[s]) (DeepSeek-V3.2 §2.1
     eq. (1), `pallas_kernels/lightning_indexer/xla.py` `index_scores`) for the visible
     positions only (s <= limit), reading each key row from the pool through the block
     table. Each sum is one fused multiply-add chain from zero, over d and then over j in
     order: XLA:CPU's order for these dots, so the scores are the same bits (`nn/dsa.py`
     `paged_scores_exact` checks that at each shape on seeded data before the engine uses
     it).
  2. `top_k`: `lax.top_k`'s values and positions, bit for bit: each element keyed once by
     the float's total order, the k-th largest found by a radix selection (then among the
     few that share its top bits), the k selected in position order and sorted by their top
     bits, then within each bin (keys and positions are unique pairs: the order is stable).
     A pure selection: descending in float32's total order (-NaN < -inf < -0.0 < +0.0 <
     +inf < +NaN), equal values in ascending position. Trailing -inf (the indexer's masked
     positions) are skipped when k elements before them rank above -inf.
     `paged_topk` runs 1 and 2 in one call, as the engine uses them: each query's scores
     masked (`deterministic_topk`: its window, NaN hidden) and selected by the thread that
     computed them, -1 past the visible ones.
  3. `sparse_logits` and `row_values`: q . row and sum_k p[k] row[:v] over the selected rows
     (`pallas_kernels/sparse_attention/xla.py`), each output XLA's chain (from zero in
     blocks of kc, the blocks' sums added in order: glm5_jax/stream_matmul.py; `nn/dsa.py`
     `sparse_kc` finds the blocks at each shape on seeded data, or None). The logits read
     each row from the pool through the block table and write its first v columns out in
     slot order; the values read them there, contiguous. The masked softmax between them
     stays XLA's (`nn/dsa.py` `sparse_mla_paged`).

Forward only (no derivative rules: the engine's decode step). Compiled on first use
(`cpu_ffi.py`); where it is not available (no compiler, not on CPU) `top_k` is `lax.top_k`
and the engine keeps XLA's path.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import cpu_ffi

SOURCE = pathlib.Path(__file__).with_name("cpu_dsa.cc")
TOPK_TARGET = "glm5_cpu_topk"
PAGED_TARGET = "glm5_paged_index_scores"
PAGED_TOPK_TARGET = "glm5_paged_index_topk"
LOGITS_TARGET = "glm5_paged_sparse_logits"
VALUES_TARGET = "glm5_row_values"


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether the kernels are registered with XLA:CPU (built and loaded on first call)."""
  return cpu_ffi.load(SOURCE, ((TOPK_TARGET, "Glm5TopK"),
                               (PAGED_TARGET, "Glm5PagedIndexScores"),
                               (PAGED_TOPK_TARGET, "Glm5PagedIndexTopK"),
                               (LOGITS_TARGET, "Glm5PagedSparseLogits"),
                               (VALUES_TARGET, "Glm5RowValues")))


def top_k(x, k: int):
  """(values [..., k], int32 positions [..., k]) of the k largest of each row of x [..., N]:
  `jax.lax.top_k(x, k)` exactly (module docstring). float32 through the kernel where it is
  available; any other dtype, or no kernel, `lax.top_k`. Not differentiable."""
  if not 0 <= k <= x.shape[-1]:
    raise ValueError(f"top_k: k must be in [0, {x.shape[-1]}] for x {x.shape}, got {k}")
  if x.dtype != jnp.float32 or x.ndim == 0 or not available():
    return jax.lax.top_k(x, k)
  out = jax.ShapeDtypeStruct(x.shape[:-1] + (k,), jnp.float32)
  call = jax.ffi.ffi_call(TOPK_TARGET, (out, out.update(dtype=jnp.int32)),
                          vmap_method="broadcast_all")
  return call(x)


def paged_scores(q_btjd, w_btj, keys_lnd, layer, rows_bs, limit_bt):
  """float32 [b, t, s]: the indexer's scores `index_scores(q, keys[layer][rows], w)` at the
  positions s <= limit[b, t], 0 past it (hidden there: never selected). q [b, t, j, d] (scale
  folded in), w [b, t, j], keys [L, N, d] the paged pool (float32), layer int32 [], rows
  int32 [b, s] each position's pool row (out of range: clipped, as XLA's gather), limit
  int32 [b, t]. Needs `available()`."""
  args = _paged_args("paged_scores", q_btjd, w_btj, keys_lnd, layer, rows_bs, limit_bt)
  out = jax.ShapeDtypeStruct(q_btjd.shape[:2] + rows_bs.shape[1:], jnp.float32)
  return jax.ffi.ffi_call(PAGED_TARGET, out)(*args)


def paged_topk(q_btjd, w_btj, keys_lnd, layer, rows_bs, limit_bt, topk: int, start_bt=None):
  """int32 [b, t, topk]: `deterministic_topk(paged_scores(...), limit, topk, start, top_k)`
  (pallas_kernels/lightning_indexer/xla.py) in one call, each query's scores kept in the
  thread that selects from them: the positions start[b, t] <= s <= limit[b, t] whose score is
  not NaN, in lax.top_k's order (descending, ties -> lower position), -1 past the number of
  them. Arguments as `paged_scores`'; start_bt int32 [b, t] (default 0). Needs
  `available()`."""
  if topk < 0:
    raise ValueError(f"paged_topk: topk must be >= 0, got {topk}")
  b, t = q_btjd.shape[:2]
  start_bt = jnp.zeros((b, t), jnp.int32) if start_bt is None else start_bt
  args = _paged_args("paged_topk", q_btjd, w_btj, keys_lnd, layer, rows_bs, limit_bt, start_bt)
  call = jax.ffi.ffi_call(PAGED_TOPK_TARGET, jax.ShapeDtypeStruct((b, t, topk), jnp.int32))
  return call(*args, start_bt.astype(jnp.int32))


def _paged_args(name, q_btjd, w_btj, keys_lnd, layer, rows_bs, limit_bt, start_bt=None):
  """The paged indexer's arguments checked (start_bt only for its shape) and cast for the
  call: q, w, keys float32; layer, rows, limit int32."""
  b, t, j, d = q_btjd.shape
  windows = "limit [b, t]" if start_bt is None else "limit and start [b, t]"
  if (w_btj.shape != (b, t, j) or keys_lnd.ndim != 3 or keys_lnd.shape[2] != d
      or rows_bs.ndim != 2 or rows_bs.shape[0] != b or limit_bt.shape != (b, t)
      or (start_bt is not None and start_bt.shape != (b, t))):
    raise ValueError(f"{name}: q [b, t, j, d], w [b, t, j], keys [L, N, d], rows [b, s], "
                     f"{windows}; got q {q_btjd.shape}, w {w_btj.shape}, keys "
                     f"{keys_lnd.shape}, rows {rows_bs.shape}, limit {limit_bt.shape}"
                     + ("" if start_bt is None else f", start {start_bt.shape}"))
  if keys_lnd.shape[1] * d >= 2 ** 31:
    raise ValueError(f"{name}: a layer of keys {keys_lnd.shape[1:]} is over 2^31 floats")
  f32, i32 = jnp.float32, jnp.int32
  return (q_btjd.astype(f32), w_btj.astype(f32), keys_lnd.astype(f32),
          jnp.asarray(layer, i32), rows_bs.astype(i32), limit_bt.astype(i32))


def _check_sparse(name, x, keys, rows, idx):
  if (x.ndim != 4 or keys.ndim != 3 or rows.ndim != 2 or idx.ndim != 3
      or rows.shape[0] != x.shape[0] or idx.shape[:2] != x.shape[:2]):
    raise ValueError(f"{name}: x [b, c, h, _], keys [L, N, w], rows [b, s], idx [b, c, k]; "
                     f"got x {x.shape}, keys {keys.shape}, rows {rows.shape}, idx {idx.shape}")


def sparse_logits(q_bchd, keys_lnw, layer, rows_bs, idx_bck, v_dim: int, kc: int):
  """(logits float32 [b, c, h, k], rows float32 [b, c, k, v_dim]): q[b, c, h] .
  row(b, idx[b, c, k])[:d], row(b, i) the pool row of position max(i, 0)
  (`pallas_kernels/sparse_attention/xla.py` `_attend_chunk`'s logits, unscaled), each a chain
  in blocks of kc (module docstring); and the slots' rows[:v_dim] (v_dim <= d) in slot order,
  for `row_values`: read once from the scattered pool, contiguous after. Needs
  `available()`."""
  _check_sparse("sparse_logits", q_bchd, keys_lnw, rows_bs, idx_bck)
  if not 0 <= v_dim <= q_bchd.shape[3]:
    raise ValueError(f"sparse_logits: v_dim must be in [0, {q_bchd.shape[3]}] (q's d), got "
                     f"{v_dim}")
  f32 = jnp.float32
  out = (jax.ShapeDtypeStruct((*q_bchd.shape[:3], idx_bck.shape[2]), f32),
         jax.ShapeDtypeStruct((*idx_bck.shape, v_dim), f32))
  return jax.ffi.ffi_call(LOGITS_TARGET, out)(
      q_bchd.astype(f32), keys_lnw.astype(f32), jnp.asarray(layer, jnp.int32),
      rows_bs.astype(jnp.int32), idx_bck.astype(jnp.int32), v_dim=np.int64(v_dim),
      kc=np.int64(kc))


def row_values(p_bchk, rows_bckv, kc: int):
  """float32 [b, c, h, v]: sum_k p[b, c, h, k] rows[b, c, k] (`sparse_logits`' rows), each a
  chain over k in blocks of kc. Needs `available()`."""
  if p_bchk.ndim != 4 or rows_bckv.ndim != 4 or rows_bckv.shape[:3] != (
      *p_bchk.shape[:2], p_bchk.shape[3]):
    raise ValueError(f"row_values: p [b, c, h, k], rows [b, c, k, v]; got p {p_bchk.shape}, "
                     f"rows {rows_bckv.shape}")
  f32 = jnp.float32
  out = jax.ShapeDtypeStruct((*p_bchk.shape[:3], rows_bckv.shape[3]), f32)
  return jax.ffi.ffi_call(VALUES_TARGET, out)(p_bchk.astype(f32), rows_bckv.astype(f32),
                                              kc=np.int64(kc))
