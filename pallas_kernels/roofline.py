"""Roofline floors of the DSA ops: FLOPs that must run and bytes that must move.

Notation: b batch, t queries, s keys, h heads, d = d_qk, v = v_dim, h_i / d_i
indexer heads / dim, n = number of valid (b, t, slot) entries of the top-k
selection, e = bytes per activation element.

  indexer         FLOPs 2 P h_i (d_i + 1), P = b * sum_i (s - t + i + 1) causal pairs
                  (q.k per head, then ReLU-weighted head sum); bytes: q, k, w read once,
                  the int32 selection written once.
  sparse_fwd      FLOPs 2 h n (d + v) (q.k^T and p.v over the selected rows); bytes: q,
                  the cache read once, the indices, out and lse.
  sparse_fwd_bwd  adds the backward, 2 h n (3 d + 2 v) (recomputed q.k^T, do.v^T, p^T.do,
                  ds.k, ds^T.q); bytes add do, dq and dkv.

The bytes are a lower bound: the cache is counted once although a gather kernel
reads each selected row once per query (rows shared by many queries are then
served from cache, or not); the floor is max(FLOPs / peak FLOP/s, bytes / peak
bandwidth), the time no implementation can beat.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Cost:
  flops: float
  bytes: float


def causal_pairs(t: int, s: int) -> int:
  """Number of (query, key) pairs with key <= query position, queries the last t of s."""
  return t * (s - t) + t * (t + 1) // 2


def indexer_cost(*, b, t, s, h_i, d_i, topk, e, **_):
  pairs = b * causal_pairs(t, s)
  flops = 2 * pairs * h_i * (d_i + 1)
  nbytes = b * (t * h_i * d_i * e + s * d_i * e + t * h_i * e + t * topk * 4)
  return Cost(flops, nbytes)


def sparse_fwd_cost(*, b, t, s, h, d_qk, v_dim, topk, n_valid, e, **_):
  flops = 2 * h * n_valid * (d_qk + v_dim)
  nbytes = b * (t * h * d_qk * e + s * d_qk * e + t * topk * 4 + t * h * v_dim * e + t * h * 4)
  return Cost(flops, nbytes)


def sparse_fwd_bwd_cost(*, b, t, s, h, d_qk, v_dim, n_valid, e, **kw):
  fwd = sparse_fwd_cost(b=b, t=t, s=s, h=h, d_qk=d_qk, v_dim=v_dim, n_valid=n_valid, e=e, **kw)
  flops = fwd.flops + 2 * h * n_valid * (3 * d_qk + 2 * v_dim)
  nbytes = fwd.bytes + b * (t * h * v_dim * e + t * h * d_qk * e + s * d_qk * e)
  return Cost(flops, nbytes)


_COSTS = {"indexer": indexer_cost, "sparse_fwd": sparse_fwd_cost,
          "sparse_fwd_bwd": sparse_fwd_bwd_cost}


def cost(op: str, *, dtype, **dims) -> Cost:
  """Cost of `op` in {"indexer", "sparse_fwd", "sparse_fwd_bwd"} at the given dims."""
  if op not in _COSTS:
    raise ValueError(f"roofline.cost: op={op!r}, expected one of {tuple(_COSTS)}")
  return _COSTS[op](e=jnp.dtype(dtype).itemsize, **dims)


def floor_seconds(c: Cost, peak_tflops: float, peak_gbs: float) -> float:
  return max(c.flops / (peak_tflops * 1e12), c.bytes / (peak_gbs * 1e9))


def bound(c: Cost, peak_tflops: float, peak_gbs: float) -> str:
  """"compute" or "memory": which side of the roofline sets the floor."""
  compute = c.flops / (peak_tflops * 1e12) >= c.bytes / (peak_gbs * 1e9)
  return "compute" if compute else "memory"
