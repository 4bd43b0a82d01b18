"""Lightning-indexer scores on TPU (Pallas Mosaic), one query chunk at a time.

DeepSeek-V3.2 paper §2.1 eq. (1), docs/design.md §2.4; the maths of
`xla.index_scores`:

    I[t, s] = sum_j w[t, j] * relu(q[t, j] . k[s])

Notation: b batch, c queries of the chunk (blocks of tq), s keys (blocks of
bk), j indexer heads (h_i), d indexer head dim (d_i).

Grid (b, c / tq, s / bk). Each step computes one [tq, bk] tile of I on chip:
h_i matmuls q_j [tq, d] . k^T [d, bk], each through ReLU and scaled by the
column w[:, j], summed over j in float32. The [t, h_i, s] tensor that the jnp
path builds never exists. Tiles whose keys all lie after the chunk's last
query are causal-dead: they are not computed (-inf is written) and their key
block is not fetched again (the key index_map clamps to the last live block, so
Pallas skips the copy). The chunk's first absolute query position `q0` is a
scalar prefetch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _backend

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 512


def _last_live_key_block(q0, qi, block_q: int, block_k: int):
  """Index of the last key block that some query of query block qi may see.

  `lax.div` (truncation) rather than `//`: the operand is >= 0, and jnp's floor
  division lowers through `sign`, which Mosaic cannot lower without a TPU attached.
  """
  return jax.lax.div(q0 + (qi + 1) * block_q - 1, block_k)


def _scores_kernel(q0_smem, q_ref, k_ref, w_ref, o_ref, *, precision):
  qi, ki = pl.program_id(1), pl.program_id(2)
  live = ki <= _last_live_key_block(q0_smem[0], qi, q_ref.shape[1], k_ref.shape[0])
  w_column = lambda j: w_ref[:, pl.ds(j, 1)].astype(jnp.float32)           # [tq, 1]
  _backend.index_scores_tile(live, q_ref, k_ref, w_column, o_ref, precision=precision)


def index_scores_chunk(q0, q_bjcd, k_bsd, w_bcj, *, block_q: int, block_k: int,
                       interpret=False):
  """Scores of one query chunk against all keys.

  Args:
    q0: int32 [1], absolute position of the chunk's first query.
    q_bjcd: [b, h_i, c, d] queries of the chunk, heads leading; c % block_q == 0.
    k_bsd: [b, s, d] keys; s % block_k == 0.
    w_bcj: [b, c, h_i] head weights.
    block_q, block_k: tile sizes (tq, bk).
    interpret: False, True or a `pltpu.InterpretParams`.

  Returns:
    float32 [b, c, s]: I on live tiles, -inf on causal-dead tiles (the
    remaining non-causal entries are masked by the selection).
  """
  b, h_i, c, d = q_bjcd.shape
  s = k_bsd.shape[1]

  def k_map(bi, qi, ki, q0_ref):
    return bi, jnp.minimum(ki, _last_live_key_block(q0_ref[0], qi, block_q, block_k)), 0

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(b, c // block_q, s // block_k),
      in_specs=[
          pl.BlockSpec((None, h_i, block_q, d), lambda bi, qi, ki, q0_ref: (bi, 0, qi, 0)),
          pl.BlockSpec((None, block_k, d), k_map),
          pl.BlockSpec((None, block_q, h_i), lambda bi, qi, ki, q0_ref: (bi, qi, 0)),
      ],
      out_specs=pl.BlockSpec((None, block_q, block_k), lambda bi, qi, ki, q0_ref: (bi, qi, ki)),
  )
  kernel = functools.partial(_scores_kernel, precision=_backend.dot_precision(q_bjcd.dtype))
  return pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((b, c, s), jnp.float32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel")),
      interpret=_backend.tpu_interpret(interpret),
      name="lightning_indexer_scores",
  )(q0, q_bjcd, k_bsd, w_bcj)
