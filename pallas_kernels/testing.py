"""Input builders and comparisons shared by the kernel tests and the benchmark.

Notation as in the references: b batch, t queries, s keys / cache rows,
h heads, k top-k slots, d head dim.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np


def cuda_target(device_kind: str = "NVIDIA H200"):
  """Context naming the GPU that a CUDA lowering targets from a host without one.

  jax >= 0.11 reads the GPU's compute capability while lowering a Triton kernel
  and, without a GPU, takes it from the abstract mesh's device (the device
  tool's H200 image runs jax 0.11.2); jax 0.10 needs nothing.
  """
  if not hasattr(jax.sharding, "AbstractDevice"):
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None,
                                       platform="cuda")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def _rng(seed: int):
  return np.random.default_rng(seed)


def indexer_inputs(seed: int, b: int, t: int, s: int, h_i: int, d_i: int, dtype=jnp.float32):
  """Random (q [b,t,h_i,d_i], k [b,s,d_i], w [b,t,h_i]), scales folded in (docs/design.md §2.4).

  Built with numpy (no XLA compile per input, which dominates tiny CPU tests).
  """
  rng = _rng(seed)
  q = rng.standard_normal((b, t, h_i, d_i), np.float32) * d_i ** -0.5
  k = rng.standard_normal((b, s, d_i), np.float32)
  w = rng.standard_normal((b, t, h_i), np.float32) * h_i ** -0.5
  return tuple(jnp.asarray(x, dtype) for x in (q, k, w))


def tied_indexer_inputs(seed: int, b: int, t: int, s: int, h_i: int, d_i: int,
                        dtype=jnp.float32):
  """Indexer inputs whose scores are exact small multiples of 1/4, so many are tied.

  q and k hold values in {-1, 0, 1} and w in {0.25, 0.5, 1}: every product and
  every partial sum is exactly representable (in bfloat16 inputs too), so any
  summation order gives the same float32 score and ties are real ties.
  """
  rng = _rng(seed)
  q = rng.integers(-1, 2, (b, t, h_i, d_i))
  k = rng.integers(-1, 2, (b, s, d_i))
  w = 2.0 ** -rng.integers(0, 3, (b, t, h_i))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, w))


def mla_inputs(seed: int, b: int, t: int, s: int, h: int, d: int, dtype=jnp.float32):
  """Random absorbed queries q [b,t,h,d] and cache rows kv [b,s,d]."""
  rng = _rng(seed)
  q = rng.standard_normal((b, t, h, d), np.float32)
  kv = rng.standard_normal((b, s, d), np.float32)
  return jnp.asarray(q, dtype), jnp.asarray(kv, dtype)


def unique_indices(seed: int, b: int, t: int, s: int, topk: int, p_empty: float = 0.0):
  """int32 [b, t, topk]: distinct random rows per query, -1 beyond s and with prob p_empty."""
  rng = _rng(seed)
  idx = np.argsort(rng.random((b, t, s)), axis=-1)[..., :topk]
  if topk > s:
    idx = np.concatenate([idx, np.full((b, t, topk - s), -1)], axis=-1)
  idx = np.where(rng.random((b, t, topk)) < p_empty, -1, idx)
  return jnp.asarray(idx, jnp.int32)


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
