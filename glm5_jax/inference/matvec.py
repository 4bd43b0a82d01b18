"""One row times a weight at matrix-vector speed, bitwise equal to XLA:CPU's matmul of 8+ rows.

A decode step of one request multiplies one row by each weight. The engine pads the step to
8 lanes (`numerics.MIN_INVARIANT_ROWS`) so that XLA:CPU's matmul (Eigen's GEMM) sums that
row in the trainer's order, and at 8 rows Eigen packs the weight into panels before using
it: `small`'s 67 MB output head streams at 11-15 GB/s on this project's 2-core VM, which
reads 24 GB/s. XLA:CPU's one-row dot (its matrix-vector kernel) reads the same weight at
30-40 GB/s, but sums in another order.

The two orders, measured on XLA:CPU in float32 (`tests/inference/test_matvec.py` checks
them on every run):
  * the one-row dot: one fused multiply-add per k, k = 0 .. K-1, from zero;
  * Eigen's GEMM: the same within blocks of k, each block summed from zero and added to the
    result block after block. The blocks are Eigen's `kc`, at most ~320 on this VM, the
    same size but the last: K = 512 -> 2 x 256, 1536 -> 4 x 312 + 288, 2048 -> 6 x 296 + 272.
So the GEMM's row equals the sum, block after block, of one-row dots over the weight's
blocks (`matvec`). Eigen chooses `kc` from the CPU's cache sizes, so the blocks are not
assumed: `k_blocks` finds them on the running backend by comparing candidates with the
8-row matmul, and returns None when none matches (the caller then keeps the matmul). A
static slice of a weight is copied before a dot reads it (a second pass over the weight),
so the blocks are stored as separate arrays (`split`), made once per weight version.

The bits of a dot also depend on what XLA makes of its consumers: on the 8-lane path XLA
folds the shared expert's output into the routed experts' scatter-add as its initial value,
which it does not do for a broadcast row, so the same split at the shared expert's down
projection changed log-probs by 9.5e-7 (docs/benchmarks.md, decode floor). `matvec` is
therefore used where its consumers are per-row (the head: softmax, sampling), not as a
general replacement for the model's matmuls.

The engine serves its output head this way when a call has one live lane and at most
`MAX_ROWS` tokens in it (`inference/steps.py` `lane_head`): a lone request's plain decode
steps, its MTP drafts, and at one draft per round its verify and first MTP call.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import numerics
from glm5_jax.stream_matmul import candidates

HEAD_KEY = "lm_head_matvec"     # served parameters: the head's kernel split at its k-blocks
# Rows up to which that many matrix-vector products of `small`'s head (1.7-2.1 ms each at
# 30-40 GB/s on this project's VM) beat one 8-row matmul (4.5-6.4 ms): 2.
MAX_ROWS = 2
MIN_BYTES = 256 * 1024     # a smaller head keeps the matmul (in cache, nothing to gain)


def _matmul(x_rk, w_kn):
  """The matmul `matvec` must equal: the engine's head (`nn/embed.py` Head) at 8+ rows."""
  return jnp.einsum("...d,dv->...v", x_rk, w_kn, preferred_element_type=jnp.float32)


def matvec(x_k, blocks):
  """x [K] @ w [K, N] as float32 [N]: the sum, block after block, of one-row dots of x's
  pieces with `blocks` (the weight's rows split at Eigen's k-blocks, `split`)."""
  out, start = None, 0
  for w in blocks:
    stop = start + w.shape[0]
    y = _matmul(x_k[None, start:stop], w)[0]
    out = y if out is None else out + y
    start = stop
  if start != x_k.shape[-1]:
    raise ValueError(f"matvec: the blocks hold {start} rows of the weight, x has "
                     f"{x_k.shape[-1]}")
  return out


def split(w_kn, bounds):
  """The weight's rows at `bounds` as separate arrays (each a copy; made on w's device)."""
  return tuple(w_kn[a:b] for a, b in zip(bounds[:-1], bounds[1:]))


@functools.lru_cache(maxsize=None)
def k_blocks(k: int, n: int, rows: int = numerics.MIN_INVARIANT_ROWS):
  """The block bounds at which `matvec` over a float32 [k, n] weight equals row 0 of the
  [rows, k] @ [k, n] matmul bitwise on the default backend, or None (no candidate of
  `candidates(k)` matches, or the backend is not a CPU). Found once per shape, on seeded
  random data (a wrong split differs in most of the n outputs)."""
  if jax.default_backend() != "cpu":
    return None
  rng = np.random.default_rng(k * 1_000_003 + n)
  x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
  w = jnp.asarray(rng.standard_normal((k, n), np.float32) / math.sqrt(k))
  want = np.asarray(jax.jit(_matmul)(x, w))[0]
  one_row = jax.jit(matvec)
  for bounds in candidates(k):
    if np.array_equal(np.asarray(one_row(x[0], split(w, bounds))), want):
      return bounds
  return None
