"""Exact reductions over the vocabulary on XLA:CPU: each row's maximum and argmax.

A decode step ends with two reductions over its logits [b, V]: the greedy token (the argmax)
and the maximum that `log_softmax` subtracts before its sum of exponentials. XLA:CPU runs a
reduction over the last axis element by element: for `small` at 16 rows x 32,768 tokens,
~270 us for the maximum and ~570 us for `sampling.greedy`'s maximum plus lowest-index
search, out of a ~25 ms step (docs/benchmarks.md). The C++ custom calls of `row_reduce.cc`
read each row once, vectorized:

  row_max(x)     XLA's `jnp.max(x, -1)`, the same bits: a maximum is exact in any order,
                 and +0 ranks above -0 (XLA keeps +0 when a row holds both). Which NaN
                 XLA returns for a row holding several, and its sign, depend on XLA's
                 order: when a row holds a NaN, the result is XLA's own reduction (a
                 `lax.cond` on the kernel's output, whose branch runs only then).
  row_argmax(x)  `jnp.argmax(x, -1)`: the first NaN if the row has one, else the lowest
                 position holding the maximum (+0 and -0 equal).

Both take float32 [..., V]. Where the kernels are not available (no compiler, not on CPU)
they are `jnp.max` and `argmax_xla` (two XLA reductions). No derivative: `row_max`'s
callers stop the gradient of its input (`log_softmax`, whose maximum carries none).
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp

from glm5_jax import cpu_ffi

SOURCE = pathlib.Path(__file__).with_name("row_reduce.cc")
MAX_TARGET = "glm5_row_max"
ARGMAX_TARGET = "glm5_row_argmax"


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether the kernels are registered with XLA:CPU (built and loaded on first call)."""
  return cpu_ffi.load(SOURCE, ((MAX_TARGET, "Glm5RowMax"), (ARGMAX_TARGET, "Glm5RowArgmax")))


def _rows(name, x):
  if x.ndim == 0:
    raise ValueError(f"row_reduce.{name}: x must have a last axis to reduce, got a scalar")
  return x.reshape(-1, x.shape[-1])


def _kernel(x) -> bool:
  return x.dtype == jnp.float32 and x.size > 0 and available()


def row_max(x):
  """max(x, axis=-1): XLA's bits (module docstring), float32 [...] from float32 [..., V]."""
  if not _kernel(x):
    return jnp.max(x, axis=-1)
  call = jax.ffi.ffi_call(MAX_TARGET, jax.ShapeDtypeStruct((x.size // x.shape[-1],), x.dtype),
                          vmap_method="broadcast_all")
  m = call(_rows("row_max", x)).reshape(x.shape[:-1])
  # Which NaN XLA's reduction returns, and with which sign, depends on its order: a row
  # holding one takes XLA's (the kernel's result for it is a NaN).
  return jax.lax.cond(jnp.any(jnp.isnan(m)), lambda: jnp.max(x, axis=-1), lambda: m)


def argmax_xla(x):
  """`row_argmax` by two XLA reductions: the maximum, then the lowest index holding it."""
  x = x.astype(jnp.float32)
  top = jnp.max(x, axis=-1, keepdims=True)                    # NaN if the row has one
  hit = (x == top) | (jnp.isnan(x) & jnp.isnan(top))
  v = x.shape[-1]
  return jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.int32), v), axis=-1)


def row_argmax(x):
  """argmax(x, axis=-1) as `jnp.argmax` (ties -> lower index, the first NaN ranks highest):
  int32 [...] from float [..., V]."""
  if x.ndim == 0:
    raise ValueError("row_reduce.row_argmax: x must have a last axis to reduce, got a scalar")
  x = x.astype(jnp.float32)
  if not _kernel(x):
    return argmax_xla(x)
  call = jax.ffi.ffi_call(ARGMAX_TARGET,
                          jax.ShapeDtypeStruct((x.size // x.shape[-1],), jnp.int32),
                          vmap_method="broadcast_all")
  return call(_rows("row_argmax", x)).reshape(x.shape[:-1])
