"""Lightning-indexer scores on GPU (Pallas Triton), one query chunk at a time.

The maths of `xla.index_scores` (DeepSeek-V3.2 paper §2.1 eq. (1),
docs/design.md §2.4) and the tiling of `tpu.py`: grid (b, c / tq, s / bk), one [tq, bk]
tile per program, h_i matmuls q_j [tq, d] . k^T [d, bk] through ReLU, scaled by
w[:, j] and summed in float32. Causal-dead tiles write -inf without loading
q, k or w (Triton refs are pointers: nothing is read that the kernel does not
load). Triton tensor sizes must be powers of two: tq, bk >= 16 and d is
zero-padded by the caller (`kernel.py`) to a power of two >= 16.

Why Triton and not Mosaic GPU: see `pallas_kernels/sparse_attention/gpu.py`;
this kernel has no gather, but it shares the driver and the test matrix.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import _backend

DEFAULT_BLOCK_Q = 64     # tiles and warps: the H200 sweep, docs/benchmarks.md
DEFAULT_BLOCK_K = 128
MIN_DIM = 16
NUM_WARPS = 8
NUM_STAGES = 2


def _scores_kernel(q0_ref, q_ref, k_ref, w_ref, o_ref, *, precision):
  qi, ki = pl.program_id(1), pl.program_id(2)
  live = ki * k_ref.shape[0] <= q0_ref[0] + (qi + 1) * q_ref.shape[1] - 1
  w_column = lambda j: w_ref[:, j].astype(jnp.float32)[:, None]            # [tq, 1]
  _backend.index_scores_tile(live, q_ref, k_ref, w_column, o_ref, precision=precision)


def index_scores_chunk(q0, q_bjcd, k_bsd, w_bcj, *, block_q: int, block_k: int,
                       interpret=False, num_warps=NUM_WARPS, num_stages=NUM_STAGES):
  """Scores of one query chunk against all keys (see `tpu.index_scores_chunk`).

  Args:
    q0: int32 [1], absolute position of the chunk's first query.
    q_bjcd: [b, h_i, c, d] with d a power of two >= 16 and c % block_q == 0.
    k_bsd: [b, s, d], s % block_k == 0.
    w_bcj: [b, c, h_i].
    block_q, block_k: powers of two >= 16.
    num_warps, num_stages: Triton compile options.

  Returns:
    float32 [b, c, s].
  """
  b, h_i, c, d = q_bjcd.shape
  s = k_bsd.shape[1]
  kernel = functools.partial(_scores_kernel, precision=_backend.dot_precision(q_bjcd.dtype))
  return pl.pallas_call(
      kernel,
      grid=(b, c // block_q, s // block_k),
      in_specs=[
          pl.BlockSpec((1,), lambda bi, qi, ki: (0,)),
          pl.BlockSpec((None, h_i, block_q, d), lambda bi, qi, ki: (bi, 0, qi, 0)),
          pl.BlockSpec((None, block_k, d), lambda bi, qi, ki: (bi, ki, 0)),
          pl.BlockSpec((None, block_q, h_i), lambda bi, qi, ki: (bi, qi, 0)),
      ],
      out_specs=pl.BlockSpec((None, block_q, block_k), lambda bi, qi, ki: (bi, qi, ki)),
      out_shape=jax.ShapeDtypeStruct((b, c, s), jnp.float32),
      compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=_backend.gpu_interpret(interpret),
      name="lightning_indexer_scores",
  )(q0, q_bjcd, k_bsd, w_bcj)
