"""A CPU matmul that reads each weight once, in the order XLA:CPU's matmul sums.

On XLA:CPU a decode step's matmuls have 8-16 rows (a lone request mirrored over 8 lanes,
`numerics.MIN_INVARIANT_ROWS`; or 16 requests), and XLA sends them to Eigen's GEMM: inside
the engine's layer scan each weight is first copied out of its layer stack, then packed into
panels, then multiplied, three passes over bytes a decode step should read once. On this
project's 2-core VM that runs at 10-14 GB/s of a 24-27 GB/s stream (docs/benchmarks.md).

`stream_matmul.cc` is an XLA FFI custom call (C++, AVX-512 / AVX2 / scalar FMAs) that
multiplies x [M, K] by layer `layer` of a stack w [R, K, N] straight from the stack, with
each output a fused multiply-add chain in Eigen's order: within each block of `kc` values of
k (Eigen's blocking), k ascending from zero, the blocks' sums added to the result one after
another (`inference/matvec.py` measured that order). Equal rows of x are computed once, so
a lone request's mirrored lanes cost one row. XLA's intra-op threads share its columns.
`grouped_matmul` runs many such products in one call, each group of rows by its own layer
of the stack (a step's expert blocks): the threads go from one matrix to the next without
a call, and a wake-up of the pool, per matrix. `batched_matmul` multiplies batches of small
matrices in the same order (`einsum`: a decode step's per-head and per-request attention
products, which XLA:CPU runs as one GEMM call each), where a probe finds it equal to XLA's.

Eigen picks `kc` from the CPU's caches and the shape, so nothing here assumes it: `kc(k, n)`
tries the candidates of Eigen's rule (`candidates`) on seeded data against XLA's own matmul
at 8 and at 256 rows (the engine's and the trainer's row counts) and returns the one that
matches bitwise, or None; the engine streams only the weights whose `kc` is found
(`inference/placement.py` `stream_plan`). The library is compiled on first use
(`cpu_ffi.py`: the system's C++ compiler, cached in `GLM5_JAX_CACHE`); without a compiler,
`available()` is False (logged once) and every matmul stays XLA's: the same numbers, slower.
"""

from __future__ import annotations

import functools
import hashlib
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import cpu_ffi

SOURCE = pathlib.Path(__file__).with_name("stream_matmul.cc")
TARGET = "glm5_stream_matmul"
GROUPED_TARGET = "glm5_stream_grouped_matmul"
BATCHED_TARGET = "glm5_batched_matmul"
KMAX_CANDIDATES = (320, 384, 256, 512, 192, 128)   # Eigen's largest kc, most likely first
PROBE_ROWS = (8, 256)     # XLA matmuls the kernel must equal: the engine's, the trainer's


def candidates(k: int) -> list[tuple[int, ...]]:
  """Block bounds (0, kc, 2 kc, .., k) Eigen's blocking rule can give for k: n = ceil(k / kmax)
  blocks of kc = ceil(k / n) rounded up to a multiple of 8, for each kmax of
  KMAX_CANDIDATES; the single block (0, k) first."""
  out = [(0, k)]
  for kmax in KMAX_CANDIDATES:
    n = -(-k // kmax)
    kc_ = 8 * math.ceil(math.ceil(k / n) / 8)
    bounds = tuple(range(0, k, kc_)) + (k,)
    if bounds not in out:
      out.append(bounds)
  return out


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether the kernel is registered with XLA:CPU (built and loaded on first call,
  `cpu_ffi.load`)."""
  return cpu_ffi.load(SOURCE, ((TARGET, "Glm5StreamMatmul"),
                               (GROUPED_TARGET, "Glm5StreamGroupedMatmul"),
                               (BATCHED_TARGET, "Glm5BatchedMatmul")))


def _checked_kc(x, w_rkn, kc: int | None) -> int:
  """`kc` for x [..., K] times w [R, K, N] (None: `kc(K, N)`, which must find one)."""
  k = x.shape[-1]
  if w_rkn.ndim != 3 or w_rkn.shape[1] != k:
    raise ValueError(f"stream_matmul: x {x.shape} needs w [R, {k}, N], got {w_rkn.shape}")
  if x.dtype != jnp.float32 or w_rkn.dtype != jnp.float32:
    raise ValueError(f"stream_matmul: float32 only, got x {x.dtype}, w {w_rkn.dtype}")
  if kc is None:
    kc = _block_size(k, w_rkn.shape[2])
    if kc is None:
      raise ValueError(f"stream_matmul: no block size matches XLA's matmul at [{k}, "
                       f"{w_rkn.shape[2]}] here (inference/placement.py stream_plan checks it)")
  return kc


def matmul(x_mk, w_rkn, layer, kc: int | None = None):
  """float32 x [M, K] @ w[layer] [K, N] (w: [R, K, N], layer: int32 []) in Eigen's order
  with blocks of `kc` (module docstring; None: `kc(K, N)`, which must find one). Needs
  `available()`."""
  if x_mk.ndim != 2:
    raise ValueError(f"stream_matmul: x must be [M, K], got {x_mk.shape}")
  kc = _checked_kc(x_mk, w_rkn, kc)
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x_mk.shape[0], w_rkn.shape[2]),
                                                       jnp.float32))
  return call(x_mk, w_rkn, jnp.asarray(layer, jnp.int32), kc=np.int64(kc))


def grouped_matmul(x_gbk, w_rkn, index_g, count, kc: int | None = None):
  """y [G, B, N]: y[g] = `matmul(x[g], w_rkn, index_g[g])` (the same bits) for g < count,
  zero past it (count: int32 [], in [0, G]; index_g: int32 [G]). One call for a step's
  expert blocks (`nn/ffn.py` `looped_swiglu`): the threads stream one matrix after another,
  with no call, and no wake-up of the pool, per matrix; consecutive groups with the same
  index read their matrix once. Needs `available()`."""
  if x_gbk.ndim != 3 or index_g.shape != x_gbk.shape[:1]:
    raise ValueError(f"stream_grouped_matmul: x must be [G, B, K] and index [G], got x "
                     f"{x_gbk.shape}, index {index_g.shape}")
  kc = _checked_kc(x_gbk, w_rkn, kc)
  call = jax.ffi.ffi_call(GROUPED_TARGET,
                          jax.ShapeDtypeStruct((*x_gbk.shape[:2], w_rkn.shape[2]), jnp.float32))
  return call(x_gbk, w_rkn, index_g.astype(jnp.int32), jnp.asarray(count, jnp.int32),
              kc=np.int64(kc))


@functools.lru_cache(maxsize=None)
def kc(k: int, n: int) -> int | None:
  """The block size at which `matmul` over a float32 [k, n] weight equals XLA's matmul at
  every row count of PROBE_ROWS, bitwise, on seeded random data; None if no candidate does
  or the kernel is not available."""
  if not available():
    return None
  rng = np.random.default_rng(k * 1_000_003 + n)
  x = rng.standard_normal((max(PROBE_ROWS), k), np.float32)
  w = rng.standard_normal((1, k, n), np.float32) / np.float32(math.sqrt(k))
  with jax.ensure_compile_time_eval():     # also when first asked inside a trace
    xla = jax.jit(lambda x, w: x @ w)
    want = {m: np.asarray(xla(x[:m], w[0])) for m in PROBE_ROWS}
    for bounds in candidates(k):
      got = np.asarray(jax.jit(functools.partial(matmul, kc=bounds[1]))(x, w, 0))
      if all(np.array_equal(got[:m], want[m]) for m in PROBE_ROWS):
        return bounds[1]
  return None


_block_size = kc   # for `matmul`, whose argument of that name hides it


def probe_rng(*key):
  """A numpy Generator seeded from `key`'s repr: a probe's data, the same on every run."""
  return np.random.default_rng(int.from_bytes(
      hashlib.sha256(repr(key).encode()).digest()[:8], "little"))


def batched_matmul(a_gmk, b_gkn, kc: int | None = None, layer=None):
  """y [G, M, N]: y[g] = a[g] @ b[g] for float32 a [G, M, K] and b [G, K, N], each output
  `matmul`'s fused multiply-add chain in k (blocks of `kc`; None: one block). For batches of
  small products, which XLA:CPU runs as one GEMM call each (`einsum`). With `layer` (int32
  []), b is a stack [R, G, K, N] and b[layer] is read in place (no slice copied out of it).
  Needs `available()`."""
  b4 = b_gkn if layer is not None else b_gkn[None]
  if a_gmk.ndim != 3 or b4.ndim != 4 or b4.shape[1:3] != (a_gmk.shape[0], a_gmk.shape[2]):
    raise ValueError(f"batched_matmul: a must be [G, M, K] and b [G, K, N] ([R, G, K, N] with "
                     f"a layer), got a {a_gmk.shape}, b {b_gkn.shape}")
  if a_gmk.dtype != jnp.float32 or b4.dtype != jnp.float32:
    raise ValueError(f"batched_matmul: float32 only, got a {a_gmk.dtype}, b {b4.dtype}")
  g, m, k = a_gmk.shape
  call = jax.ffi.ffi_call(BATCHED_TARGET, jax.ShapeDtypeStruct((g, m, b4.shape[3]), jnp.float32))
  return call(a_gmk, b4, jnp.asarray(0 if layer is None else layer, jnp.int32),
              kc=np.int64(kc or max(k, 1)))


def _einsum_plan(eq: str, a_shape, b_shape):
  """How `einsum` computes a two-operand einsum (a contraction, no repeated or summed-away
  index) as products [G, M, K] @ [G, K, N]: (a's axes in the first order, b's in the second,
  the output's axes from [G.., M.., N..], that shape, (G, M, K, N)); None for any other."""
  if "..." in eq or "->" not in eq:
    return None
  ins, out = eq.replace(" ", "").split("->")
  if ins.count(",") != 1:
    return None
  lhs, rhs = ins.split(",")
  if any(len(set(s)) != len(s) for s in (lhs, rhs, out)) or not set(out) <= set(lhs + rhs) or (
      len(lhs) != len(a_shape) or len(rhs) != len(b_shape)):
    return None
  size = {**dict(zip(lhs, a_shape)), **dict(zip(rhs, b_shape))}
  if any(size[c] != s for c, s in [*zip(lhs, a_shape), *zip(rhs, b_shape)]):
    return None
  batch = [c for c in lhs if c in rhs and c in out]
  contract = [c for c in lhs if c in rhs and c not in out]
  m = [c for c in lhs if c not in rhs]
  n = [c for c in rhs if c not in lhs]
  if set(m + n) - set(out) or not contract:
    return None
  prod = lambda cs: int(np.prod([size[c] for c in cs], dtype=np.int64))
  mid = batch + m + n
  return ([lhs.index(c) for c in batch + m + contract],
          [rhs.index(c) for c in batch + contract + n], [mid.index(c) for c in out],
          [size[c] for c in mid], (prod(batch), prod(m), prod(contract), prod(n)))


def _planned_einsum(plan, a, b, kc: int, at=None):
  """`plan`'s einsum: the operands laid out [G, M, K] and [G, K, N] by XLA (in the kernel, a
  transposing copy per product measured 3x slower than XLA's), `batched_matmul`, y laid out
  back. at: (stack, layer), b's [G, K, N] layout at stack[layer], read in place."""
  a_order, b_order, out_order, mid_shape, (g, m, k, n) = plan
  a3 = jnp.transpose(a, a_order).reshape(g, m, k)
  if at is None:
    y = batched_matmul(a3, jnp.transpose(b, b_order).reshape(g, k, n), kc)
  else:
    y = batched_matmul(a3, at[0].reshape(at[0].shape[0], g, k, n), kc, at[1])
  return jnp.transpose(y.reshape(mid_shape), out_order)


@functools.lru_cache(maxsize=None)
def einsum_kc(eq: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> int | None:
  """The block size at which `einsum(eq)` through `batched_matmul` equals XLA's einsum at
  these float32 shapes bitwise, on seeded random data (as `kc` probes); None if none does, the
  equation is not a batch of products, or the kernel is not available."""
  plan = _einsum_plan(eq, a_shape, b_shape)
  if plan is None or not available() or 0 in a_shape or 0 in b_shape:
    return None
  rng = probe_rng(eq, a_shape, b_shape)
  a = rng.standard_normal(a_shape, np.float32)
  b = rng.standard_normal(b_shape, np.float32)
  with jax.ensure_compile_time_eval():     # also when first asked inside a trace
    want = np.asarray(jax.jit(functools.partial(jnp.einsum, eq))(a, b))
    for bounds in candidates(plan[-1][2]):
      got = np.asarray(jax.jit(functools.partial(_planned_einsum, plan, kc=bounds[1]))(a, b))
      if np.array_equal(got, want):
        return bounds[1]
  return None


EINSUM_MAX_ROWS = 256           # rows of each product `einsum` sends to the kernel, at most
EINSUM_MAX_FMAS = 1 << 24       # and multiply-adds in all (a prefill chunk's stay XLA's)


def einsum(eq: str, a, b, preferred_element_type=None, *, b_stack=None, layer=None):
  """`jnp.einsum(eq, a, b)` for float32 operands, through `batched_matmul` where it is a batch
  (two or more) of small products (EINSUM_MAX_ROWS, EINSUM_MAX_FMAS) and `einsum_kc` finds it
  equal to XLA's at these shapes: the same numbers (a decode step's per-request and per-head
  attention products, which XLA:CPU runs as one GEMM call each). Else XLA's own: a single
  product is one call there too, and its operands' layout copies here measured slower (a lone
  request's indexer scores at 1K context).

  b_stack, layer: a layer stack [R, ...] whose b_stack[layer] holds b laid out as the kernel's
  [G, K, N] operand (b's batch axes, then contracted, then the others, each in b's order; an
  engine's SERVED_LAYOUTS copy, nn/params.py): the kernel reads it there in place, where XLA
  would copy the layer's slice out of the stack every step. b (that slice, any layout) still
  gives the shapes and XLA's path."""
  kc_ = None
  plan = _einsum_plan(eq, tuple(a.shape), tuple(b.shape))
  if (plan is not None and a.dtype == jnp.float32 and b.dtype == jnp.float32
      and preferred_element_type in (None, jnp.float32) and plan[-1][0] > 1
      and plan[-1][1] <= EINSUM_MAX_ROWS
      and math.prod(plan[-1]) <= EINSUM_MAX_FMAS):
    kc_ = einsum_kc(eq, tuple(a.shape), tuple(b.shape))
  if kc_ is None:
    return jnp.einsum(eq, a, b, preferred_element_type=preferred_element_type)
  at = None
  if b_stack is not None and b_stack.dtype == jnp.float32:
    laid = tuple(b.shape[i] for i in plan[1])
    if tuple(b_stack.shape[1:]) != laid:
      raise ValueError(f"einsum {eq!r}: b_stack {b_stack.shape} is not a stack of b laid out "
                       f"{laid}")
    at = (b_stack, layer)
  return _planned_einsum(plan, a, b, kc_, at)
