"""Dispatch for the lightning-indexer top-k: `impl="xla"` (chunked jnp reference, selecting
with `xla.deterministic_topk`, i.e. XLA's top_k) or `impl="pallas"` (the Pallas
score kernel, then the Pallas selection kernel, which makes the same ordered list).
"""

from __future__ import annotations


import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.lightning_indexer import xla

IMPLS = ("xla", "pallas")


def _check_shapes(q, k, w, topk):
  sizes = _backend.check_axes("topk_indices", q=(q, "b t h_i d_i"), k=(k, "b s d_i"),
                              w=(w, "b t h_i"))
  if sizes["s"] < sizes["t"]:
    raise ValueError(f"topk_indices: s={sizes['s']} keys < t={sizes['t']} queries; queries are "
                     "the last t positions of the key sequence")
  if not isinstance(topk, int) or topk < 1:
    raise ValueError(f"topk_indices: topk={topk!r}, expected a positive int")


def _check_limit(limit, b: int, t: int):
  if limit is None:
    return
  shape = getattr(limit, "shape", None)
  if shape is None or tuple(shape) not in ((t,), (b, t)):
    raise ValueError(f"topk_indices: limit has shape {shape}, expected int32 [t] = ({t},) or "
                     f"[b, t] = ({b}, {t})")
  if not jnp.issubdtype(limit.dtype, jnp.integer):
    raise ValueError(f"topk_indices: limit has dtype {limit.dtype}, expected an integer "
                     "(int32) array")


def topk_indices(q, k, w, topk: int, *, impl: str = "xla", interpret: bool | None = False,
                 chunk_size: int = 512, start=None, backend: str | None = None, limit=None,
                 einsum=None, top_k=None):
  """Top-k key positions per query by lightning-indexer score.

  Args:
    q: [b, t, h_i, d_i] indexer queries, RoPE applied, scale folded in.
    k: [b, s, d_i] indexer keys, RoPE applied.
    w: [b, t, h_i] per-head weights.
    topk: slots per query.
    impl: "xla" (chunked jnp) or "pallas" (TPU / GPU kernels: scores, selection).
    interpret: run the Pallas kernel in interpret mode (CPU tests); None: by
      lowering platform (the kernel on TPU / CUDA, the interpreter elsewhere).
    chunk_size: queries scored at once (both paths); peak memory O(b * chunk * s).
    start: optional int32 [b, t], the first key each query may see (packed
      documents: its document's start). Keys before it are never selected.
    backend: for "pallas", the kernel lowering: "tpu", "gpu", or None = the
      platform's (see `pallas_kernels._backend`).
    limit: optional int32, the last key each query may see: [t] (every row
      alike; context parallelism's permuted rows) or [b, t] (per row; b
      sequences over a KV cache, each with t new queries at its own
      positions). Default: causal, `s - t + i`. Both impls take it.
    einsum: for "xla", what computes the queries' products with the keys (default
      `jnp.einsum`; see `xla.topk_indices_xla`).
    top_k: for "xla", what selects the top-k (default XLA's `lax.top_k`; see
      `xla.deterministic_topk`).

  Returns:
    int32 [b, t, topk]: for query i of row b the keys
    start[b, i] <= j <= limit[(b,) i] (defaults 0 and s - t + i) with the
    largest score, descending, ties -> lower j; -1 fills slots beyond the
    number of visible keys (all of them when start > limit).
  """
  _check_shapes(q, k, w, topk)
  if start is not None and start.shape != q.shape[:2]:
    raise ValueError(f"topk_indices: start{start.shape}, expected [b, t] = {q.shape[:2]}")
  _check_limit(limit, *q.shape[:2])
  if impl == "xla":
    return xla.topk_indices_xla(q, k, w, topk, chunk_size=chunk_size, start=start,
                                limit=limit, einsum=einsum or jnp.einsum,
                                top_k=top_k)
  if impl == "pallas":
    from pallas_kernels.lightning_indexer import kernel  # pylint: disable=g-import-not-at-top
    return kernel.topk_indices(q, k, w, topk, start=start, interpret=interpret,
                               chunk_size=chunk_size, backend=backend, limit=limit)
  raise ValueError(f"topk_indices: impl={impl!r}, expected one of {IMPLS}")
