"""The top-k selection kernels (TPU and GPU lowerings, interpret mode) vs deterministic_topk.

The selection must be `xla.deterministic_topk`'s ordered list exactly: keys
start <= j <= limit, descending score in lax.top_k's total order (-0.0 below +0.0,
+inf on top), equal scores in ascending position, NaN and -inf hidden, -1 after the
last visible key. Each special case is one row of one kernel call per backend (a
call compiles in about a second in interpret mode, so the rows share it); the
oracle is a Python sort of each row, checked against deterministic_topk as well.
Row counts and key counts are not multiples of the kernels' tiles: the TPU kernel
runs over 3 lane blocks of its key scratch and 2 tiles of 8 rows, the GPU kernel over
2 blocks of 512 keys.
"""

import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lightning_indexer import kernel
from pallas_kernels.lightning_indexer import selection_gpu
from pallas_kernels.lightning_indexer import selection_tpu
from pallas_kernels.lightning_indexer import xla

BACKENDS = ("tpu", "gpu")
S, TOPK = 700, 40
F32_MAX = float(np.finfo(np.float32).max)


def _python_topk(scores, start, limit, topk):
  """Per row: visible keys sorted by (score desc with -0.0 below +0.0, position); -1 fill."""
  out = -np.ones(scores.shape[:-1] + (topk,), np.int64)
  for r in np.ndindex(scores.shape[:-1]):
    row = [float(x) for x in scores[r]]
    keys = [j for j in range(max(start[r], 0), min(limit[r], len(row) - 1) + 1)
            if not math.isnan(row[j]) and row[j] != -math.inf]
    keys.sort(key=lambda j: (-row[j], -math.copysign(1.0, row[j]), j))
    out[r][:len(keys[:topk])] = keys[:topk]
  return out


def _special_rows():
  """(name -> row, scores [1, c, S], start [1, c], limit [1, c]): one row per case."""
  rng = np.random.default_rng(zlib.crc32(b"special_rows"))
  rows, start, limit = {}, [], []

  def add(name, x, lo=0, hi=S - 1):
    rows[name] = len(start)
    start.append(lo)
    limit.append(hi)
    return np.asarray(x, np.float32)

  zeros = np.full(S, -0.0, np.float32)
  zeros[rng.choice(S, 10, replace=False)] = 0.0                 # 10 of +0.0 among -0.0
  special = rng.choice(np.array([np.nan, -np.inf, 1.0, -1.0, 0.0, -0.0], np.float32), S)
  special[rng.choice(S, 9, replace=False)] = [np.inf] * 3 + [F32_MAX] * 3 + [-F32_MAX] * 3
  x = [
      add("all_equal", np.full(S, 0.5)),
      add("signed_zeros", zeros),
      add("ties_at_threshold", rng.integers(0, 4, S)),           # ~175 keys per value
      add("nan_inf_and_largest_finite", special),
      add("nan_on_top", np.where(rng.random(S) < 0.5, np.nan, rng.standard_normal(S))),
      add("all_nan", np.full(S, np.nan)),
      add("all_minus_inf", np.full(S, -np.inf)),
      add("k_above_visible_keys", rng.standard_normal(S), 0, 17),   # 18 keys < k = 40
      add("first_query_of_a_document", rng.standard_normal(S), 333, 333),
      add("packed_row", rng.standard_normal(S), 512, 650),       # a document 512..650
      add("limit_below_start", rng.standard_normal(S), 400, 399),
      add("limit_past_last_key", rng.standard_normal(S), 0, S + 5),
      add("random", rng.standard_normal(S)),
  ]
  return (rows, np.stack(x)[None], np.asarray(start, np.int32)[None],
          np.asarray(limit, np.int32)[None])


ROWS, SCORES, START, LIMIT = _special_rows()


def _select(backend, scores, start, limit, topk, **kw):
  n_keys = scores.shape[-1]
  if kw:
    mod = selection_tpu if backend == "tpu" else selection_gpu
    fn = functools.partial(mod.select_topk, topk=topk, n_keys=n_keys, interpret=True, **kw)
    run = lambda x, s, l: fn(jnp.pad(x, ((0, 0), (0, (-x.shape[1]) % 8), (0, 1024 - S)),
                                     constant_values=np.nan),
                             jnp.pad(s, ((0, 0), (0, (-s.shape[1]) % 8))),
                             jnp.pad(l, ((0, 0), (0, (-l.shape[1]) % 8)), constant_values=-1)
                             )[:, :x.shape[1], :topk]
  else:
    run = lambda x, s, l: kernel.select(backend, x, s, l, topk, n_keys, True)
  return np.asarray(jax.jit(run)(jnp.asarray(scores), jnp.asarray(start), jnp.asarray(limit)))


@pytest.fixture(scope="module", params=BACKENDS)
def special(request):
  """(backend, the kernel's selection of every special row, the oracle's)."""
  got = _select(request.param, SCORES, START, LIMIT, TOPK)
  return request.param, got[0], _python_topk(SCORES, START, LIMIT, TOPK)[0]


def _check(special, name):
  backend, got, want = special
  r = ROWS[name]
  np.testing.assert_array_equal(got[r], want[r], err_msg=f"{backend}: row {name}")
  return got[r]


def test_deterministic_topk_is_the_python_sort_on_every_special_row():
  got = xla.deterministic_topk(jnp.asarray(SCORES), jnp.asarray(LIMIT), TOPK,
                               jnp.asarray(START))
  np.testing.assert_array_equal(np.asarray(got), _python_topk(SCORES, START, LIMIT, TOPK))


def test_deterministic_topk_puts_no_minus_one_before_a_key():
  # A NaN ranks above +inf in lax.top_k; hidden, it must not leave -1 in slot 0.
  scores = jnp.asarray([[[np.nan, 1.0, np.nan, 3.0, -np.inf, 2.0]]], jnp.float32)
  got = xla.deterministic_topk(scores, jnp.asarray([5]), 5)
  np.testing.assert_array_equal(np.asarray(got)[0, 0], [3, 5, 1, -1, -1])


def test_all_equal_scores_select_the_first_keys(special):
  np.testing.assert_array_equal(_check(special, "all_equal"), np.arange(TOPK))


def test_negative_zero_ranks_below_positive_zero(special):
  got = _check(special, "signed_zeros")
  signs = np.signbit(SCORES[0, ROWS["signed_zeros"], got])
  np.testing.assert_array_equal(signs, [False] * 10 + [True] * (TOPK - 10))


def test_many_ties_at_the_threshold_break_to_lower_positions(special):
  got = _check(special, "ties_at_threshold")
  vals = SCORES[0, ROWS["ties_at_threshold"], got]
  assert (vals == vals[-1]).sum() < (SCORES[0, ROWS["ties_at_threshold"]] == vals[-1]).sum()


def test_nan_and_minus_inf_are_hidden_largest_values_kept(special):
  got = _check(special, "nan_inf_and_largest_finite")
  assert np.all(got >= 0)
  vals = SCORES[0, ROWS["nan_inf_and_largest_finite"], got]
  np.testing.assert_array_equal(vals[:7], [np.inf] * 3 + [F32_MAX] * 3 + [1.0])
  _check(special, "nan_on_top")


def test_rows_without_visible_keys_are_all_minus_one(special):
  for name in ("all_nan", "all_minus_inf", "limit_below_start"):
    assert np.all(_check(special, name) == -1)


def test_k_above_the_visible_keys_fills_minus_one(special):
  got = _check(special, "k_above_visible_keys")
  assert sorted(got[:18]) == list(range(18)) and np.all(got[18:] == -1)


def test_the_first_query_of_a_document_sees_one_key(special):
  np.testing.assert_array_equal(_check(special, "first_query_of_a_document"),
                                [333] + [-1] * (TOPK - 1))


def test_packed_rows_see_only_their_document(special):
  got = _check(special, "packed_row")
  assert np.all((got >= 512) & (got <= 650))
  _check(special, "limit_past_last_key")
  _check(special, "random")


def test_a_wider_radix_selects_the_same():
  # 2 bits per pass (16 passes, 3 counts each) instead of the TPU kernel's 1; the GPU
  # kernel's 4 is its default, above.
  got = _select("tpu", SCORES, START, LIMIT, TOPK, radix_bits=2)
  np.testing.assert_array_equal(got, _python_topk(SCORES, START, LIMIT, TOPK))


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_scores_match_deterministic_topk(backend, rng):
  # Another (rows, s, k) than the special rows': 3 TPU lane blocks of 512, 3 GPU blocks of
  # 512, k_p = 256 on both; scores rounded to 1/64 so that some ties fall at the threshold.
  # (k above s: tests/pallas_kernels/test_indexer.py, through the whole indexer.)
  c, s, topk = 9, 1500, 130
  scores = np.round(rng.standard_normal((2, c, s)).astype(np.float32) * 64) / 64
  start = rng.integers(0, s // 4, (2, c)).astype(np.int32)
  limit = rng.integers(s // 2, s + 2, (2, c)).astype(np.int32)
  got = _select(backend, scores, start, limit, topk)
  want = xla.deterministic_topk(jnp.asarray(scores), jnp.asarray(limit), topk,
                                jnp.asarray(start))
  np.testing.assert_array_equal(got, np.asarray(want))


def test_top_k_of_every_key_is_lax_top_k():
  """k = the row length: `_top_k` takes k - 1 from top_k and the one index left, not XLA's
  sort; the same values (bit for bit) and indices on every special row."""
  x = jnp.asarray(SCORES.reshape(-1, SCORES.shape[-1]))
  x = jnp.where(jnp.isnan(x), -jnp.inf, x)                   # deterministic_topk hides NaN
  n = x.shape[-1]
  got, want = xla._top_k(x, n), jax.lax.top_k(x, n)
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_array_equal(np.asarray(got[0]).view(np.int32),
                                np.asarray(want[0]).view(np.int32))


def test_deterministic_topk_over_every_key_is_the_python_sort():
  s = SCORES.shape[-1]
  got = xla.deterministic_topk(jnp.asarray(SCORES), jnp.asarray(LIMIT), s, jnp.asarray(START))
  np.testing.assert_array_equal(np.asarray(got), _python_topk(SCORES, START, LIMIT, s))
