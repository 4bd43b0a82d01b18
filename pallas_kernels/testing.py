"""Input builders and comparisons shared by the kernel tests and the benchmark.

Notation as in the references: b batch, t queries, s keys / cache rows,
h heads, k top-k slots, d head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def indexer_inputs(key, b: int, t: int, s: int, h_i: int, d_i: int, dtype=jnp.float32):
  """Random (q [b,t,h_i,d_i], k [b,s,d_i], w [b,t,h_i]) with the scales folded in (spec §2.4)."""
  kq, kk, kw = jax.random.split(key, 3)
  q = jax.random.normal(kq, (b, t, h_i, d_i), jnp.float32) * d_i ** -0.5
  k = jax.random.normal(kk, (b, s, d_i), jnp.float32)
  w = jax.random.normal(kw, (b, t, h_i), jnp.float32) * h_i ** -0.5
  return q.astype(dtype), k.astype(dtype), w.astype(dtype)


def tied_indexer_inputs(key, b: int, t: int, s: int, h_i: int, d_i: int, dtype=jnp.float32):
  """Indexer inputs whose scores are exact small multiples of 1/4, so most are tied.

  q and k hold values in {-1, 0, 1} and w in {0.25, 0.5, 1}: every product and
  every partial sum is exactly representable (in bfloat16 inputs too), so any
  summation order gives the same float32 score and ties are real ties.
  """
  kq, kk, kw = jax.random.split(key, 3)
  q = jax.random.randint(kq, (b, t, h_i, d_i), -1, 2).astype(dtype)
  k = jax.random.randint(kk, (b, s, d_i), -1, 2).astype(dtype)
  w = (2.0 ** -jax.random.randint(kw, (b, t, h_i), 0, 3)).astype(dtype)
  return q, k, w


def mla_inputs(key, b: int, t: int, s: int, h: int, d: int, dtype=jnp.float32):
  """Random absorbed queries q [b,t,h,d] and cache rows kv [b,s,d]."""
  kq, kk = jax.random.split(key)
  q = jax.random.normal(kq, (b, t, h, d), jnp.float32)
  kv = jax.random.normal(kk, (b, s, d), jnp.float32)
  return q.astype(dtype), kv.astype(dtype)


def unique_indices(key, b: int, t: int, s: int, topk: int, p_empty: float = 0.0):
  """int32 [b, t, topk]: distinct random rows per query, -1 beyond s and with prob p_empty."""
  k_perm, k_empty = jax.random.split(key)
  order = jnp.argsort(jax.random.uniform(k_perm, (b, t, s)), axis=-1).astype(jnp.int32)
  idx = order[..., :topk]
  if topk > s:
    idx = jnp.concatenate([idx, jnp.full((b, t, topk - s), -1, jnp.int32)], axis=-1)
  empty = jax.random.uniform(k_empty, (b, t, topk)) < p_empty
  return jnp.where(empty, -1, idx)


def max_rel_error(actual, expected) -> float:
  """max |actual - expected| / max |expected| over finite entries (normwise relative)."""
  a = np.asarray(jnp.asarray(actual, jnp.float32))
  e = np.asarray(jnp.asarray(expected, jnp.float32))
  finite = np.isfinite(e)
  if not np.array_equal(finite, np.isfinite(a)) or not np.array_equal(a[~finite], e[~finite]):
    return float("inf")
  if not finite.any():
    return 0.0
  scale = max(float(np.max(np.abs(e[finite]))), 1e-30)
  return float(np.max(np.abs(a[finite] - e[finite]))) / scale


def assert_rel_close(actual, expected, rel: float, what: str = ""):
  """Asserts `max_rel_error(actual, expected) <= rel`, with the same non-finite entries."""
  err = max_rel_error(actual, expected)
  assert err <= rel, f"{what}: max relative error {err:.3g} > {rel:.1g}"
