"""Top-k selection of indexer scores on GPU (Pallas Triton): the steps of `selection.py`.

Notation: b batch, c query rows, s_p keys of a row (blocks of bs), k_p output slots
(a power of two), r radix bits per threshold pass.

Grid (b, c): one program per query row. A row of 32K float32 scores (128 KB) does
not fit a block's registers and shared memory, so each pass streams it from HBM /
L2 in [bs] blocks:
  threshold   32 / r passes (r = 4: 8), each accumulating the [bs, 2^r] compare
              matrix key >= t ^ (d << shift) elementwise in int32 and reducing it
              once at the end of the pass;
  compaction  one pass in key order: `jnp.cumsum` (Triton's scan) gives each
              selected key its slot, first among the keys equal to T, then among
              the selection; a masked scatter store writes (position, key) to two
              [k_p] scratch rows in HBM;
  sort        a barrier (the scratch rows were written by other threads of the
              block), a gather load of the k_p slots, `selection.bitonic_sort`
              with a reshape + reduction as the partner exchange (Triton's own
              `tl.sort` exchanges the same way), a store of the positions.
The interpreter (CPU tests) runs the program's statements in order, so it needs
no barrier (and has none: `debug_barrier` has no CPU rule in jax 0.10.2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels import _backend
from pallas_kernels.lightning_indexer import selection

BLOCK = 512          # keys per loop step
RADIX_BITS = 4       # 8 threshold passes, 16 compare-adds per key each (8 bits: [bs, 256] counters,
                     # which Triton did not compile for sm_90a in 6 minutes)
NUM_WARPS = 4
NUM_STAGES = 2
MIN_DIM = 16


def _partner(x, j: int):
  """x at position i ^ 2^j of a 1-D power-of-two array (reshape, masked sums, broadcast)."""
  n = x.shape[0]
  y = x.reshape(n >> (j + 1), 2, 1 << j)
  second = jax.lax.broadcasted_iota(jnp.int32, (1, 2, 1), 1)
  left = jnp.sum(y * (1 - second), axis=1, keepdims=True)
  right = jnp.sum(y * second, axis=1, keepdims=True)
  return jnp.where(second == 0, right, left).reshape(n)


def _select_kernel(start_ref, limit_ref, scores_ref, out_ref, slot_pos_ref, slot_key_ref, *,
                   topk: int, n_keys: int, block: int, radix_bits: int, interpret: bool):
  bi, ci = pl.program_id(0), pl.program_id(1)
  start, limit = start_ref[bi, ci], limit_ref[bi, ci]
  n_blk = scores_ref.shape[-1] // block
  k_p = out_ref.shape[-1]
  lanes = jnp.arange(block, dtype=jnp.int32)
  digits = jnp.arange(1 << radix_bits, dtype=jnp.int32)

  def keys_at(j):
    pos = j * block + lanes
    scores = scores_ref[pl.ds(j * block, block)]
    return selection.ordered_keys(scores, (pos >= start) & (pos <= limit) & (pos < n_keys)), pos

  def count_digits(t, shift):
    cands = t ^ (digits << shift)                                   # [2^r]; d = 0 unused

    def body(j, acc):
      key, _ = keys_at(j)
      return acc + (key[:, None] >= cands[None, :]).astype(jnp.int32)
    acc = jax.lax.fori_loop(0, n_blk, body,
                            jnp.zeros((block, 1 << radix_bits), jnp.int32))
    counts = jnp.sum(acc, axis=0)
    return [jnp.sum(jnp.where(digits == d, counts, 0)) for d in range(1, 1 << radix_bits)]

  t, n_gt = selection.radix_threshold(count_digits, topk, radix_bits,
                                      jnp.int32(n_blk * block))
  need = selection.ties_to_take(t, n_gt, topk)
  t_visible = t != selection.INT_MIN

  def compact(j, carry):
    run_eq, run_sel = carry
    key, pos = keys_at(j)
    eq = ((key == t) & t_visible).astype(jnp.int32)
    chosen = (key > t) | ((eq == 1) & (run_eq + jnp.cumsum(eq) - eq < need))
    chosen_i = chosen.astype(jnp.int32)
    slot = run_sel + jnp.cumsum(chosen_i) - chosen_i
    pltr.store(slot_pos_ref.at[slot], pos, mask=chosen)
    pltr.store(slot_key_ref.at[slot], key, mask=chosen)
    return run_eq + jnp.sum(eq), run_sel + jnp.sum(chosen_i)
  _, n_sel = jax.lax.fori_loop(0, n_blk, compact, (jnp.int32(0), jnp.int32(0)))

  if not interpret:
    pltr.debug_barrier()          # the scatter's writes, visible to every thread of the block
  slots = jnp.arange(k_p, dtype=jnp.int32)
  full = slots < n_sel
  idx = pltr.load(slot_pos_ref.at[slots], mask=full, other=0)
  key = pltr.load(slot_key_ref.at[slots], mask=full, other=0)
  key = jnp.where(full, key, selection.INT_MIN)
  idx = jnp.where(full, idx, n_blk * block + slots)        # empties: distinct, last
  key, idx = selection.bitonic_sort(key, idx, slots, _partner, unrolled=True)
  out_ref[...] = jnp.where(key == selection.INT_MIN, -1, idx)


def select_topk(scores_bcs, start_bc, limit_bc, *, topk: int, n_keys: int,
                block: int = BLOCK, radix_bits: int = RADIX_BITS, interpret=False,
                num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES):
  """Top-k per row of scores: the selection of `xla.deterministic_topk`.

  Args:
    scores_bcs: float32 [b, c, s_p], s_p % block == 0; keys at or past n_keys are
      padding.
    start_bc, limit_bc: int32 [b, c], each row's first and last visible key.
    topk: k.
    n_keys: s, the real key count.
    block: keys per loop step, a power of two >= 16.
    radix_bits: r, 32 / r threshold passes.
    interpret: run in the Pallas interpreter.
    num_warps, num_stages: Triton compile options.

  Returns:
    int32 [b, c, k_p], k_p = next power of two >= max(k, 16); slots >= k are -1.
  """
  b, c, s_p = scores_bcs.shape
  k_p = padded_topk(topk)
  if block < MIN_DIM or block & (block - 1) or s_p % block:
    raise ValueError(f"select_topk (GPU): block={block} with s_p={s_p}, expected a power of "
                     f"two >= {MIN_DIM} dividing s_p")
  kernel = functools.partial(_select_kernel, topk=topk, n_keys=n_keys, block=block,
                             radix_bits=radix_bits, interpret=bool(interpret))
  row = pl.BlockSpec((None, None, k_p), lambda bi, ci: (bi, ci, 0))
  out, _, _ = pl.pallas_call(
      kernel,
      grid=(b, c),
      in_specs=[pl.no_block_spec, pl.no_block_spec,
                pl.BlockSpec((None, None, s_p), lambda bi, ci: (bi, ci, 0))],
      out_specs=[row, row, row],
      out_shape=[jax.ShapeDtypeStruct((b, c, k_p), jnp.int32)] * 3,
      compiler_params=pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=_backend.gpu_interpret(interpret),
      name="lightning_indexer_select",
  )(start_bc, limit_bc, scores_bcs.astype(jnp.float32))
  return out


def padded_topk(topk: int) -> int:
  return _backend.next_pow2(topk, MIN_DIM)
