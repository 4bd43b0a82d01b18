"""Dispatch for the lightning-indexer top-k (design.md decision 4)."""

from __future__ import annotations


from pallas_kernels.lightning_indexer import reference

IMPLS = ("xla", "pallas")


def _check_shapes(q, k, w, topk):
  if q.ndim != 4 or k.ndim != 3 or w.ndim != 3:
    raise ValueError(f"topk_indices expects q [b,t,h_i,d_i], k [b,s,d_i], w [b,t,h_i]; got "
                     f"q{q.shape} k{k.shape} w{w.shape}")
  b, t, h, d = q.shape
  if k.shape[0] != b or k.shape[2] != d or w.shape != (b, t, h):
    raise ValueError(f"topk_indices shape mismatch: q{q.shape} k{k.shape} w{w.shape}")
  if k.shape[1] < t:
    raise ValueError(f"topk_indices: s={k.shape[1]} keys < t={t} queries; queries are the "
                     "last t positions of the key sequence")
  if not isinstance(topk, int) or topk < 1:
    raise ValueError(f"topk_indices: topk={topk!r}, expected a positive int")


def topk_indices(q, k, w, topk: int, *, impl: str = "xla", interpret: bool | None = False,
                 chunk_size: int = 512, start=None, backend: str | None = None, limit=None):
  """Top-k key positions per query by lightning-indexer score.

  Args:
    q: [b, t, h_i, d_i] indexer queries, RoPE applied, scale folded in.
    k: [b, s, d_i] indexer keys, RoPE applied.
    w: [b, t, h_i] per-head weights.
    topk: slots per query.
    impl: "xla" (chunked jnp) or "pallas" (TPU / GPU kernel).
    interpret: run the Pallas kernel in interpret mode (CPU tests); None: by
      lowering platform (the kernel on TPU / CUDA, the interpreter elsewhere).
    chunk_size: queries scored at once (both paths); peak memory O(b * chunk * s).
    start: optional int32 [b, t], the first key each query may see (packed
      documents: its document's start). Keys before it are never selected.
    backend: for "pallas", the kernel lowering: "tpu", "gpu", or None = the
      platform's (see `pallas_kernels._backend`).
    limit: optional int32 [t], the last key each query may see (default causal,
      `s - t + i`); "xla" only (context parallelism's permuted rows).

  Returns:
    int32 [b, t, topk]: for query i (absolute position s - t + i) the keys
    j <= s - t + i with the largest score, descending, ties -> lower j;
    -1 fills slots beyond the number of causal keys.
  """
  _check_shapes(q, k, w, topk)
  if start is not None and start.shape != q.shape[:2]:
    raise ValueError(f"topk_indices: start{start.shape}, expected [b, t] = {q.shape[:2]}")
  if limit is not None and limit.shape != q.shape[1:2]:
    raise ValueError(f"topk_indices: limit{limit.shape}, expected [t] = {q.shape[1:2]}")
  if impl == "xla":
    return reference.topk_indices_reference(q, k, w, topk, chunk_size=chunk_size, start=start,
                                            limit=limit)
  if limit is not None:
    raise ValueError("topk_indices: impl='pallas' takes causal limits only; context "
                     "parallelism (a per-query `limit`) needs attention_impl='xla'")
  if impl == "pallas":
    from pallas_kernels.lightning_indexer import kernel  # pylint: disable=g-import-not-at-top
    return kernel.topk_indices(q, k, w, topk, start=start, interpret=interpret,
                               chunk_size=chunk_size, backend=backend)
  raise ValueError(f"topk_indices: impl={impl!r}, expected one of {IMPLS}")




