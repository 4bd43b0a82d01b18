"""Lightning-indexer top-k with Pallas kernels (`impl="pallas"`): scores, then selection.

Steps, per chunk of c queries (`lax.map`, so peak memory is O(b * c * s)
float32 and the full [t, s] score matrix never exists):
  1. the score kernel (`tpu.py` Mosaic, `gpu.py` Triton) computes the chunk's
     scores tile by tile on chip and writes them, float32 [b, c, s], to HBM.
     Causal (no `limit`): query i sits at absolute position s - t + i, the
     chunk's first position `q0` goes to the kernel and tiles wholly after the
     chunk's last query are skipped (-inf). Explicit `limit` ([t] or [b, t]):
     q0 is set past the last key, so no tile is skipped and every key is scored;
  2. the selection kernel (`selection_tpu.py`, `selection_gpu.py`; the steps in
     `selection.py`) reads them back and writes each query's top-k: the keys
     start <= j <= limit with the largest scores, descending, ties -> lower j,
     -1 fill, NaN and -inf hidden: `xla.deterministic_topk`'s list, made
     without a sort (a radix threshold, a compaction and a bitonic network). The
     causal limit, an explicit limit and the document `start` are applied here.
The selection equals `topk_indices_xla`'s whenever the scores are equal;
they are computed by the same products summed in a different order, so they
agree to float32 rounding (exactly, for inputs whose sums are exact, such as the
tied-score tests), and the kernels are bit-reproducible run to run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.lightning_indexer import gpu
from pallas_kernels.lightning_indexer import selection_gpu
from pallas_kernels.lightning_indexer import selection_tpu
from pallas_kernels.lightning_indexer import tpu
from pallas_kernels.lightning_indexer import xla

DEFAULT_CHUNK = 256


def _tiles(backend: str, t: int, s: int, block_q: int | None, block_k: int | None):
  """(tq, bk) for this backend and shape; small problems use one whole-dimension tile."""
  if backend == "tpu":
    tq = block_q or tpu.DEFAULT_BLOCK_Q
    bk = block_k or tpu.DEFAULT_BLOCK_K
    if tq % 8 or bk % 8:
      raise ValueError(f"topk_indices: block_q={tq}, block_k={bk}, expected multiples of 8 "
                       "for the TPU kernel (block_k: of 128 on hardware)")
    # A tile larger than the problem becomes one whole-dimension tile (always a legal block).
    return (t if t < tq else tq), (-(-s // 8) * 8 if s < bk else bk)
  tq = block_q or gpu.DEFAULT_BLOCK_Q
  bk = block_k or gpu.DEFAULT_BLOCK_K
  for name, val in (("block_q", tq), ("block_k", bk)):
    if val < gpu.MIN_DIM or val & (val - 1):
      raise ValueError(f"topk_indices: {name}={val}, expected a power of two >= {gpu.MIN_DIM} "
                       "for the GPU kernel")
  return (min(tq, _backend.next_pow2(t, gpu.MIN_DIM)),
          min(bk, _backend.next_pow2(s, gpu.MIN_DIM)))


def _scores_fn(backend: str, block_q: int, block_k: int, interpret):
  mod = tpu if backend == "tpu" else gpu
  return functools.partial(mod.index_scores_chunk, block_q=block_q, block_k=block_k,
                           interpret=interpret)


def select(backend: str, scores_bcs, start_bc, limit, topk: int, n_keys: int, interpret):
  """int32 [b, c, topk]: the selection kernel of `backend` over scores [b, c, >= n_keys].

  `limit` is int32 [c] (every row alike) or [b, c]; scores past n_keys are
  padding. Pads rows and keys to the kernel's multiples (nothing, at GLM-5 shapes
  with the default score tiles).
  """
  b, c, s_k = scores_bcs.shape
  limit_bc = jnp.broadcast_to(limit, (b, c)).astype(jnp.int32)
  if backend == "tpu":
    rows = selection_tpu.ROWS
    s_p = max(selection_tpu.padded_topk(topk), -(-s_k // 128) * 128)
    select_fn = functools.partial(selection_tpu.select_topk, interpret=interpret)
  else:
    rows = 1
    block = min(selection_gpu.BLOCK, _backend.next_pow2(s_k, selection_gpu.MIN_DIM))
    s_p = -(-s_k // block) * block
    select_fn = functools.partial(selection_gpu.select_topk, block=block,
                                  interpret=_backend.gpu_interpret(interpret))
  # s_p >= s_k: padding to a multiple of s_p pads to s_p.
  scores = _backend.pad_to(_backend.pad_to(scores_bcs, 2, s_p, -jnp.inf), 1, rows, -jnp.inf)
  start = _backend.pad_to(start_bc.astype(jnp.int32), 1, rows)
  limit_bc = _backend.pad_to(limit_bc, 1, rows, -1)
  idx = select_fn(scores, start, limit_bc, topk=topk, n_keys=n_keys)
  return idx[:, :c, :topk]


SELECTIONS = ("kernel", "top_k")


def _topk_one_backend(backend, topk, chunk_size, block_q, block_k, interpret, causal, selection,
                      q, k, w, start, limit):
  """One backend's top-k; `limit` is int32 [t] or [b, t] (`causal`: it is `causal_limit`)."""
  b, t, h_i, d = q.shape
  s = k.shape[1]
  tq, bk = _tiles(backend, t, s, block_q, block_k)
  c = min(-(-chunk_size // tq) * tq, -(-t // tq) * tq)
  n_chunks = -(-t // c)
  if backend == "gpu":                       # Triton: d a power of two >= 16
    d_p = _backend.next_pow2(d, gpu.MIN_DIM)
    q, k = _backend.pad_to(q, 3, d_p), _backend.pad_to(k, 2, d_p)
  k_p = _backend.pad_to(k, 1, bk)
  # [n, b, h_i, c, d] query chunks, heads leading; [n, b, c, h_i] weights.
  q_c = _backend.pad_to(q, 1, c).reshape(b, n_chunks, c, h_i, -1).transpose(1, 0, 3, 2, 4)
  w_c = _backend.pad_to(w, 1, c).reshape(b, n_chunks, c, h_i).swapaxes(0, 1)
  if limit.ndim == 1:
    limit_c = _backend.pad_to(limit, 0, c).reshape(n_chunks, c)
  else:                                                        # [b, t] -> [n, b, c]
    limit_c = _backend.pad_to(limit, 1, c).reshape(b, n_chunks, c).swapaxes(0, 1)
  if causal:    # the chunk's first absolute query position: causal-dead tiles are skipped
    q0_c = (jnp.arange(n_chunks, dtype=jnp.int32) * c + (s - t)).reshape(n_chunks, 1)
  else:         # past the last (padded) key: every tile is live, the limit masks in step 2
    q0_c = jnp.full((n_chunks, 1), k_p.shape[1] - 1, jnp.int32)
  start_c = _backend.pad_to(start, 1, c).reshape(b, n_chunks, c).swapaxes(0, 1)
  scores_fn = _scores_fn(backend, tq, bk, interpret)

  def one_chunk(args):
    q_bjcd, w_bcj, limit, q0, start_bc = args
    scores_bcs = scores_fn(q0, q_bjcd, k_p, w_bcj)                  # [b, c, s + pad]
    if selection == "top_k":                                         # XLA's (the baseline)
      return xla.deterministic_topk(scores_bcs[:, :, :s], limit, topk, start_bc)
    return select(backend, scores_bcs, start_bc, limit, topk, s, interpret)

  idx = jax.lax.map(one_chunk, (q_c, w_c, limit_c, q0_c, start_c))   # [n, b, c, topk]
  return idx.swapaxes(0, 1).reshape(b, n_chunks * c, topk)[:, :t]


def topk_indices(q, k, w, topk: int, *, start=None, interpret=False,
                 backend: str | None = None, chunk_size: int = DEFAULT_CHUNK,
                 block_q: int | None = None, block_k: int | None = None, limit=None,
                 selection: str = "kernel"):
  """Top-k key positions per query by lightning-indexer score (Pallas scores).

  Args:
    q: [b, t, h_i, d_i] indexer queries, RoPE applied, d_i**-0.5 folded in.
    k: [b, s, d_i] indexer keys, RoPE applied; s >= t.
    w: [b, t, h_i] per-head weights, h_i**-0.5 folded in.
    topk: slots per query.
    start: optional int32 [b, t], first key each query may see (packed
      documents); applied in the selection, as in the reference.
    interpret: run the score kernel in the Pallas interpreter (CPU): True, or a
      `pltpu.InterpretParams` for the TPU kernel; None: by lowering platform
      (see `pallas_kernels._backend`).
    backend: "tpu", "gpu", or None (see `pallas_kernels._backend`).
    chunk_size: queries per chunk; peak memory O(b * chunk_size * s) float32.
    block_q, block_k: score tile (tq, bk). TPU: multiples of 8 (bk of 128 on
      hardware; defaults 128, 512). GPU: powers of two >= 16 (defaults 64, 128).
    limit: optional int32 [t] or [b, t], last key each query may see (default
      causal, s - t + i). Given, every score tile is computed (no causal
      skipping) and the limit is applied in the selection, as in the reference.
    selection: "kernel" (the selection kernel) or "top_k" (XLA's top_k on the
      kernel's scores, `xla.deterministic_topk`: the baseline it replaced).

  Returns:
    int32 [b, t, topk], as `xla.topk_indices_xla`. The selection
    has no gradient; q, k and w are cut from autodiff here (a pallas_call has
    no JVP rule, and the model differentiates through the layer that calls this).
  """
  _backend.check_backend(backend, "topk_indices")
  if selection not in SELECTIONS:
    raise ValueError(f"topk_indices: selection={selection!r}, expected one of {SELECTIONS}")
  q, k, w = jax.lax.stop_gradient((q, k, w))
  if chunk_size < 1:
    raise ValueError(f"topk_indices: chunk_size={chunk_size}, expected a positive int")
  b, t = q.shape[:2]
  start = jnp.zeros((b, t), jnp.int32) if start is None else start.astype(jnp.int32)
  causal = limit is None
  limit = (xla.causal_limit(t, k.shape[1]) if causal
           else jnp.asarray(limit).astype(jnp.int32))
  make = lambda name, interp: functools.partial(_topk_one_backend, name, topk, chunk_size,
                                                block_q, block_k, interp, causal, selection)
  return _backend.dispatch(make, backend, interpret, q, k, w, start, limit)
