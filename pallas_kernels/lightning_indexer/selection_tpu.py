"""Top-k selection of indexer scores on TPU (Pallas Mosaic): the steps of `selection.py`.

Notation: b batch, c query rows (blocks of 8, one sublane tile), s_p keys of a row
(blocks of lb lanes), k_p output slots (a power of two >= 128).

Grid (b, c / 8, s_p / lb); the last axis streams a row block's scores through
VMEM in [8, lb] tiles (read from HBM once) and stores each tile's ordered keys
in a VMEM scratch [s_p / lb, 8, lb]; at the last tile the program runs the
selection on the scratch, vectorised over its 8 rows (each row's values are an
[8, 1] column):
  threshold   32 / r passes, each a loop over the blocks counting key >= candidate
              (elementwise int32 accumulators, one lane reduction per pass);
  prefix      one pass: the mask of key == T and then of the selection, each
              prefix-counted in 128-lane groups by a matmul with the triangular
              0/1 matrix U[m, l] = m <= l (bf16 operands, float32 sums: exact),
              a running [8, 1] count carried between groups and blocks; the
              pass writes pos << PB | slot for each selected key, -1 elsewhere;
  network     ceil(log2 s_p) in-place passes over the blocks in ascending order:
              at step b every selected key whose displacement pos - slot has
              bit b set moves 2^b lanes left (a lane roll of the block and its
              successor, or a whole-block offset), carrying its key. A pass
              reads blocks at or after the one it writes, so in place is safe.
  sort        the first k_p lanes: `selection.bitonic_sort` with lane rolls as
              the partner exchange; written as positions, -1 in empty slots.
No scatter, sort, top_k or cumsum: rolls, selects, compare-adds, lane reductions
and matmuls, which Mosaic lowers (checked by compiling for v5e / v5p,
tests/pallas_kernels/test_aot.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _backend
from pallas_kernels.lightning_indexer import selection

ROWS = 8                      # query rows per program: one sublane tile
LANE_BLOCKS = (1024, 512, 256, 128)
RADIX_BITS = 1                # 32 threshold passes of one compare-add per key
GROUP = 128                   # lanes per prefix matmul


def lane_block(s_p: int) -> int:
  """The largest of LANE_BLOCKS dividing s_p (a multiple of 128)."""
  return next(lb for lb in LANE_BLOCKS if s_p % lb == 0)


def _column(smem, base):
  """[8, 1] int32 column of smem[base : base + 8] (one scalar read per row)."""
  row = jax.lax.broadcasted_iota(jnp.int32, (ROWS, 1), 0)
  col = jnp.zeros((ROWS, 1), jnp.int32)
  for r in range(ROWS):
    col = jnp.where(row == r, smem[base + r], col)
  return col


def _prefix_exclusive(mask_i32, carry):
  """(carry + #{set lanes before each lane} [8, lb], carry + row total [8, 1]), int32."""
  tri = (jax.lax.broadcasted_iota(jnp.int32, (GROUP, GROUP), 0)
         <= jax.lax.broadcasted_iota(jnp.int32, (GROUP, GROUP), 1)).astype(jnp.bfloat16)
  parts = []
  run = carry.astype(jnp.float32)
  for g in range(mask_i32.shape[1] // GROUP):
    m = mask_i32[:, g * GROUP:(g + 1) * GROUP]
    incl = jnp.dot(m.astype(jnp.bfloat16), tri, preferred_element_type=jnp.float32) + run
    parts.append(incl.astype(jnp.int32) - m)
    run = incl[:, GROUP - 1:]
  out = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
  return out, run.astype(jnp.int32)


def _select_kernel(start_smem, limit_smem, scores_ref, out_ref, key_scr, pk_scr, *,
                   topk: int, n_keys: int, c: int, radix_bits: int):
  bi, qi, blk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n_blk, _, lb = key_scr.shape
  s_p = n_blk * lb
  k_p = out_ref.shape[-1]
  slot_bits = k_p.bit_length() - 1            # pk = pos << slot_bits | slot
  lane = jax.lax.broadcasted_iota(jnp.int32, (ROWS, lb), 1)
  base = bi * c + qi * ROWS
  start, limit = _column(start_smem, base), _column(limit_smem, base)

  pos = blk * lb + lane
  visible = (pos >= start) & (pos <= limit) & (pos < n_keys)
  key_scr[blk] = selection.ordered_keys(scores_ref[...], visible)

  @pl.when(blk == n_blk - 1)
  def _select():
    def count_digits(t, shift):
      cands = selection.digit_candidates(t, shift, radix_bits)

      def body(j, accs):
        key = key_scr[j]
        return tuple(a + (key >= cand).astype(jnp.int32) for a, cand in zip(accs, cands))
      accs = jax.lax.fori_loop(0, n_blk, body,
                               tuple(jnp.zeros((ROWS, lb), jnp.int32) for _ in cands))
      return [jnp.sum(a, axis=1, keepdims=True) for a in accs]

    t, n_gt = selection.radix_threshold(count_digits, topk, radix_bits,
                                        jnp.full((ROWS, 1), s_p, jnp.int32))
    need = selection.ties_to_take(t, n_gt, topk)
    t_visible = t != selection.INT_MIN

    def mark(j, carry):                # selection mask, slots, packed (pos, slot)
      run_eq, run_sel = carry
      key = key_scr[j]
      eq = ((key == t) & t_visible).astype(jnp.int32)
      eq_before, run_eq = _prefix_exclusive(eq, run_eq)
      chosen = (key > t) | ((eq == 1) & (eq_before < need))
      slot, run_sel = _prefix_exclusive(chosen.astype(jnp.int32), run_sel)
      pk_scr[j] = jnp.where(chosen, ((j * lb + lane) << slot_bits) | slot, -1)
      return run_eq, run_sel
    zero = jnp.zeros((ROWS, 1), jnp.int32)
    jax.lax.fori_loop(0, n_blk, mark, (zero, zero))

    def moves(pk, bit):
      shift = (pk >> slot_bits) - (pk & (k_p - 1))
      return (pk >= 0) & ((shift & bit) != 0)

    def block_at(ref, j, fill):
      ok = j < n_blk
      return jnp.where(ok, ref[jnp.minimum(j, n_blk - 1)], fill)

    def network_step(b, carry):        # every selected key with bit b of its shift: 2^b left
      bit = jnp.int32(1) << b
      q, r = bit >> (lb.bit_length() - 1), bit & (lb - 1)     # whole blocks, then lanes

      def one_block(j, carry):
        head = lane < lb - r                   # lanes l + r of block j + q, the rest from j + q + 1
        src_pk, src_key = (
            jnp.where(head, pltpu.roll(block_at(ref, j + q, fill), (lb - r) & (lb - 1), 1),
                      pltpu.roll(block_at(ref, j + q + 1, fill), (lb - r) & (lb - 1), 1))
            for ref, fill in ((pk_scr, -1), (key_scr, 0)))
        cur_pk = pk_scr[j]
        arrive = moves(src_pk, bit)
        stay = (cur_pk >= 0) & jnp.logical_not(moves(cur_pk, bit))
        pk_scr[j] = jnp.where(arrive, src_pk, jnp.where(stay, cur_pk, -1))
        key_scr[j] = jnp.where(arrive, src_key, key_scr[j])
        return carry
      return jax.lax.fori_loop(0, n_blk, one_block, carry)
    jax.lax.fori_loop(0, (s_p - 1).bit_length(), network_step, 0)

    n_read = -(-k_p // lb)
    pk = jnp.concatenate([pk_scr[j] for j in range(n_read)], axis=1)[:, :k_p]
    key = jnp.concatenate([key_scr[j] for j in range(n_read)], axis=1)[:, :k_p]
    slot = jax.lax.broadcasted_iota(jnp.int32, (ROWS, k_p), 1)
    full = pk >= 0
    key = jnp.where(full, key, selection.INT_MIN)
    idx = jnp.where(full, pk >> slot_bits, s_p + slot)      # empties: distinct, last

    def partner(x, j):
      sh = jnp.int32(1) << j
      return jnp.where((slot & sh) != 0, pltpu.roll(x, sh, 1), pltpu.roll(x, k_p - sh, 1))

    key, idx = selection.bitonic_sort(key, idx, slot, partner, unrolled=False)
    out_ref[...] = jnp.where(key == selection.INT_MIN, -1, idx)


def vmem_bytes(s_p: int, k_p: int) -> int:
  """VMEM the kernel declares: two int32 [s_p] scratch rows and the double-buffered
  [8, lb] score and [8, k_p] output blocks, per 8 query rows."""
  return ROWS * 4 * (2 * s_p + 2 * lane_block(s_p) + 2 * k_p)


def select_topk(scores_bcs, start_bc, limit_bc, *, topk: int, n_keys: int,
                radix_bits: int = RADIX_BITS, interpret=False,
                vmem_limit_bytes: int | None = None):
  """Top-k per row of scores: the selection of `xla.deterministic_topk`.

  Args:
    scores_bcs: float32 [b, c, s_p], c % 8 == 0, s_p % 128 == 0, s_p >= k_p;
      keys at or past n_keys are padding.
    start_bc, limit_bc: int32 [b, c], each row's first and last visible key.
    topk: k.
    n_keys: s, the real key count.
    radix_bits: r, 32 / r threshold passes.
    interpret: False, True or a `pltpu.InterpretParams`.
    vmem_limit_bytes: Mosaic's VMEM limit; default `vmem_bytes` + 8 MiB for the
      kernel's own temporaries. At s = 202,752 it declares 12.6 MiB and compiles for
      v5e and v5p under a 13 MiB limit (experiments/aot_tpu_kernels.py bisects it).

  Returns:
    int32 [b, c, k_p], k_p = max(128, next power of two >= k); slots >= k are -1.
  """
  b, c, s_p = scores_bcs.shape
  k_p = padded_topk(topk)
  slot_bits = k_p.bit_length() - 1
  if c % ROWS or s_p % 128 or s_p < k_p:
    raise ValueError(f"select_topk (TPU): scores [b, c, s_p] = {scores_bcs.shape}, expected "
                     f"c % {ROWS} == 0, s_p % 128 == 0 and s_p >= k_p = {k_p}")
  if s_p > 2 ** (31 - slot_bits):
    raise ValueError(f"select_topk (TPU): s_p={s_p} keys with k_p={k_p} slots do not pack "
                     f"into int32 (s_p <= 2^{31 - slot_bits})")
  lb = lane_block(s_p)
  n_blk = s_p // lb
  kernel = functools.partial(_select_kernel, topk=topk, n_keys=n_keys, c=c,
                             radix_bits=radix_bits)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(b, c // ROWS, n_blk),
      in_specs=[pl.BlockSpec((None, ROWS, lb), lambda bi, qi, j, st, li: (bi, qi, j))],
      out_specs=pl.BlockSpec((None, ROWS, k_p), lambda bi, qi, j, st, li: (bi, qi, 0)),
      scratch_shapes=[pltpu.VMEM((n_blk, ROWS, lb), jnp.int32)] * 2,
  )
  if vmem_limit_bytes is None:
    vmem_limit_bytes = vmem_bytes(s_p, k_p) + 8 * 2 ** 20
  return pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((b, c, k_p), jnp.int32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=vmem_limit_bytes),
      interpret=_backend.tpu_interpret(interpret),
      name="lightning_indexer_select",
  )(start_bc.reshape(-1), limit_bc.reshape(-1), scores_bcs.astype(jnp.float32))


def padded_topk(topk: int) -> int:
  return max(128, _backend.next_pow2(topk))
