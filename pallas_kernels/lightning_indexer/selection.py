"""Exact top-k of indexer scores on chip: a radix threshold, a compaction, a bitonic sort.

The selection of `xla.deterministic_topk`, without a sort or top_k primitive
(jax 0.10.2's Mosaic TPU has no sort, top_k or cumsum; Triton has no sort): for each
query row the keys start <= j <= limit whose score is neither NaN nor -inf, the
`topk` largest in descending score (lax.top_k's total order: -0.0 below +0.0),
equal scores in ascending position, then -1. Notation: s keys of a row (padded to
s_p), k = topk slots (padded to a power of two k_p), r radix bits per pass.

Steps, per query row:
  1. Keys. Each float32 score becomes an int32 whose signed order is the float's
     total order (`ordered_keys`: the bits, with the 31 low bits flipped when the
     sign is set; -0.0 -> -1 < +0.0 -> 0). A hidden key (outside the window, NaN,
     -inf, padding) becomes INT_MIN, below every visible one.
  2. Threshold (`radix_threshold`), MSB first, r bits per pass: the largest T with
     #{key >= T} >= k, built digit by digit from counts #{key >= T ^ (d << shift)}
     for the 2^r - 1 digits d (compare-and-count, a histogram by reductions). It
     also yields n_gt = #{key > T}. Fewer than k visible keys leave T = INT_MIN.
  3. Selection mask: key > T, or key == T among the first k - n_gt such keys by
     position (a prefix count of key == T), never a hidden key: exactly
     min(k, #visible) keys, the same set as deterministic_topk's.
  4. Compaction: each selected key goes to slot p = #{selected before it} (a
     prefix count), carrying its position and key. GPU: a scatter store (Triton
     lowers an integer-array store). TPU (no scatter): a shift network, each
     selected key moving left by its displacement j - p, bit b of it at step b
     (log2 s_p steps; displacements never decrease along the row, so no two keys
     ever meet); prefix counts are matmuls with a triangular 0/1 matrix on the MXU
     (bf16 0/1 operands, float32 sums: exact).
  5. Sort the k_p slots by (key desc, position asc) with a bitonic network
     (`bitonic_sort`; log2(k_p) (log2(k_p) + 1) / 2 compare-exchange steps; the
     partner exchange is a lane roll on TPU and a reshape + reduction on GPU) and
     write positions, -1 where the slot is empty.

Passes and bytes, per query row (s = 202,752, k = 2048, float32 scores):
  TPU (`selection_tpu.py`, 8 rows per program, r = 1): HBM reads the scores once
    (4 s B = 811 KB; the block pipeline streams them into VMEM) and writes 4 k_p B;
    everything else runs on the VMEM copy: 1 key pass (4 s B written), 32 / r = 32
    threshold passes (4 s B read each), 1 mask + prefix pass (4 s read, 4 s
    written), ceil(log2 s_p) = 18 network passes (about 6 * 4 s read, 2 * 4 s
    written each), then the sort on 2 * 4 k_p B in vregs. VMEM: 2 int32 [s_p]
    arrays per row, 8 * 2 * 4 s_p B = 13 MB per program at s = 202,752.
  GPU (`selection_gpu.py`, 1 row per program, r = 4): reads the scores from
    HBM / L2 once per pass: 32 / r = 8 threshold passes + 1 compaction pass = 9 * 4 s
    B (7.3 MB at s = 202,752; 1.2 MB at 32K, which stays in the 50 MB L2 while
    about 100 rows are in flight); scatters 8 B per selected key, reads back 8 k_p B
    and writes 4 k_p B.
Compute per key: TPU 2^r - 1 compare-adds per threshold pass (1 at r = 1) and about a
dozen vector ops per network pass; GPU 2^r compare-adds per threshold pass (16 at r = 4).
Nothing here has been timed on hardware yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

INT_MIN = np.int32(-2 ** 31)
RADIX_BITS = (1, 2, 4, 8)


def wrap_int32(v: int) -> np.int32:
  """Python int -> the int32 with the same low 32 bits (1 << 31 -> INT_MIN)."""
  return np.int32(((v + 2 ** 31) % 2 ** 32) - 2 ** 31)


def ordered_keys(scores, visible):
  """int32 keys whose signed order is float32's total order; INT_MIN where hidden.

  Hidden: `visible` is False, or the score is NaN or -inf.
  """
  scores = scores.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(scores, jnp.int32)
  key = bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))
  hidden = jnp.logical_not(visible) | (scores != scores) | (scores == -jnp.inf)
  return jnp.where(hidden, INT_MIN, key)


def radix_threshold(count_digits, topk: int, radix_bits: int, n_total):
  """(T, n_gt): the largest T with #{key >= T} >= topk, and #{key > T}.

  Args:
    count_digits: count_digits(t, shift) -> [#{key >= t ^ (d << shift)} for d in
      1 .. 2^r - 1], arrays shaped like `n_total` (t's low shift + r bits are 0;
      shift is a traced int32: the passes are a loop).
    topk: k.
    radix_bits: r, bits per pass; 32 / r passes.
    n_total: #{key >= INT_MIN}, every key of the row (padding included).

  When fewer than k keys are visible, T = INT_MIN and n_gt = #visible.
  """
  if radix_bits not in RADIX_BITS:
    raise ValueError(f"radix_bits={radix_bits}, expected one of {RADIX_BITS}")

  def one_pass(i, carry):
    t, above, at_least = carry    # above: #{key >= t + 2^(shift + r)}; at_least: #{key >= t}
    shift = 32 - radix_bits * (i + 1)
    counts = [at_least] + list(count_digits(t, shift))
    digit = sum((c >= topk).astype(jnp.int32) for c in counts[1:])
    new_at_least, new_above = at_least, above
    for d, c in enumerate(counts):
      new_at_least = jnp.where(digit == d, c, new_at_least)
      if d + 1 < len(counts):
        new_above = jnp.where(digit == d, counts[d + 1], new_above)
    return t ^ (digit << shift), new_above, new_at_least

  init = (jnp.full_like(n_total, INT_MIN), jnp.zeros_like(n_total), n_total)
  t, above, _ = jax.lax.fori_loop(0, 32 // radix_bits, one_pass, init)
  return t, above


def digit_candidates(t, shift, radix_bits: int):
  """[t ^ (d << shift) for d in 1 .. 2^r - 1] (int32, wrapping: 1 << 31 is INT_MIN)."""
  return [t ^ (jnp.int32(d) << shift) for d in range(1, 1 << radix_bits)]


def ties_to_take(t, n_gt, topk: int):
  """How many keys equal to T join the selection (lowest positions first); 0 if T hidden."""
  return jnp.where(t == INT_MIN, 0, topk - n_gt)


def _exchange(key, idx, pos, partner, stage, j):
  """One compare-exchange step of the bitonic network (stage, distance 2^j)."""
  pk, pi = partner(key, j), partner(idx, j)
  better = (key > pk) | ((key == pk) & (idx < pi))
  lower = ((pos >> j) & 1) == 0
  descending = ((pos >> stage) & 1) == 0      # always at the last stage (pos < 2^stage)
  keep = better == (lower == descending)
  return jnp.where(keep, key, pk), jnp.where(keep, idx, pi)


def bitonic_sort(key, idx, pos, partner, *, unrolled: bool):
  """Sorts (key, idx) along the last axis by key descending, then idx ascending.

  Args:
    key, idx: int32 [..., n], n a power of two; the (key, idx) pairs distinct.
    pos: int32 [..., n], the position along the last axis (an iota).
    partner: partner(x, j) -> x at position pos ^ 2^j (the backend's exchange).
    unrolled: Python loops (j a Python int: the GPU's reshape exchange needs
      static shapes) or fori_loops (j traced: the TPU's roll takes a dynamic shift).
  """
  levels = key.shape[-1].bit_length() - 1
  if unrolled:
    for stage in range(1, levels + 1):
      for j in range(stage - 1, -1, -1):
        key, idx = _exchange(key, idx, pos, partner, stage, j)
    return key, idx

  def one_stage(stage, carry):
    def one_step(i, carry):
      return _exchange(*carry[:2], pos, partner, stage, stage - 1 - i)
    return jax.lax.fori_loop(0, stage, one_step, carry)
  return jax.lax.fori_loop(1, levels + 1, one_stage, (key, idx))
