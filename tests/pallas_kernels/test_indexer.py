"""Lightning-indexer Pallas kernels (TPU and GPU lowerings, interpret mode) vs the reference.

The selection must equal `topk_indices_xla` exactly: same keys, same
order (descending score, ties -> lower position), same -1 fill. Random float
inputs have no ties within float32 rounding at these sizes; the tied-score
tests use inputs whose scores are exact, so ties are real and only the
tie-break decides the order. Tiles are kept small (8 / 16) so that every test
spans several query and key tiles with ragged tails.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lightning_indexer
from pallas_kernels import testing
from pallas_kernels.lightning_indexer import kernel
from pallas_kernels.lightning_indexer import xla

# Smallest legal tiles per backend: TPU multiples of 8, GPU (Triton) powers of two >= 16.
TILES = {"tpu": dict(block_q=8, block_k=8), "gpu": dict(block_q=16, block_k=16)}
BACKENDS = sorted(TILES)


def _kernel_topk(q, k, w, topk, backend, chunk_size=16, start=None, limit=None):
  f = functools.partial(kernel.topk_indices, topk=topk, interpret=True, backend=backend,
                        chunk_size=chunk_size, **TILES[backend])
  return np.asarray(jax.jit(f)(q, k, w, start=start, limit=limit))


def _reference_topk(q, k, w, topk, start=None, limit=None):
  f = functools.partial(xla.topk_indices_xla, topk=topk, chunk_size=8)
  return np.asarray(jax.jit(f)(q, k, w, start=start, limit=limit))


@pytest.fixture
def seed(request):
  """Inputs seeded by the test's name: new per test, replayable."""
  return zlib.crc32(request.node.name.encode())


def _numpy_topk(q, k, w, topk, start=None, limit=None):
  """float64 numpy: keys start[b, i] <= j <= limit[(b,) i] sorted by (-score, j); -1 fill."""
  q, k, w = (np.asarray(x, np.float64) for x in (q, k, w))
  b, t = q.shape[:2]
  s = k.shape[1]
  scores = np.einsum("btj,btjs->bts", w, np.maximum(np.einsum("btjd,bsd->btjs", q, k), 0))
  start = np.zeros((b, t), np.int64) if start is None else np.asarray(start)
  limit = np.arange(t) + (s - t) if limit is None else np.asarray(limit)
  limit = np.broadcast_to(limit, (b, t))
  out = -np.ones((b, t, topk), np.int64)
  for bi in range(b):
    for i in range(t):
      keys = np.arange(s)
      keys = keys[(keys >= start[bi, i]) & (keys <= limit[bi, i])]
      order = keys[np.lexsort((keys, -scores[bi, i, keys]))][:topk]
      out[bi, i, :len(order)] = order
  return out


def _row_limits(seed, t, s):
  """([b=3, t] start, [3, t] limit): three rows of one KV-cache batch, each its own window.

  Row 0: the causal limits of a row 4 keys shorter (s - 4 - t + i; below 0 sees nothing).
  Row 1: a document starting at 5; one query's limit (3) is below its start (it sees
    nothing), another sees exactly one key.
  Row 2: random limits from -2 (sees nothing) past the last key (s + 3), so beyond the
    causal s - t + i as well as below it.
  """
  rng = np.random.default_rng(seed)
  start = np.zeros((3, t), np.int32)
  start[1] = 5
  limit = np.zeros((3, t), np.int32)
  limit[0] = np.arange(t) + (s - 4 - t)
  limit[1] = rng.integers(6, s, t)
  limit[1, 1], limit[1, 2] = 3, 5
  limit[2] = rng.integers(-2, s + 4, t)
  limit[2, :2] = (s + 3, -2)
  return jnp.asarray(start), jnp.asarray(limit)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_matches_reference(backend):
  # t = s = 37: not a multiple of any tile or chunk; topk 12 < causal keys for most queries.
  q, k, w = testing.indexer_inputs(11, b=2, t=37, s=37, h_i=3, d_i=16)
  np.testing.assert_array_equal(_kernel_topk(q, k, w, 12, backend),
                                _reference_topk(q, k, w, 12))


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_matches_reference(backend):
  # t < s: the 21 queries are the last 21 positions of 45 keys, over two chunks of 16.
  q, k, w = testing.indexer_inputs(12, b=2, t=21, s=45, h_i=2, d_i=16)
  np.testing.assert_array_equal(_kernel_topk(q, k, w, 10, backend),
                                _reference_topk(q, k, w, 10))


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_matches_reference(backend):
  q, k, w = testing.indexer_inputs(13, b=3, t=1, s=29, h_i=4, d_i=16)
  np.testing.assert_array_equal(_kernel_topk(q, k, w, 7, backend),
                                _reference_topk(q, k, w, 7))


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_beyond_causal_keys_fills_minus_one(backend):
  # topk 20 > s 13: query i sees i + 1 keys, the other slots hold -1.
  q, k, w = testing.indexer_inputs(14, b=1, t=13, s=13, h_i=2, d_i=16)
  got = _kernel_topk(q, k, w, 20, backend)
  np.testing.assert_array_equal(got, _reference_topk(q, k, w, 20))
  np.testing.assert_array_equal((got >= 0).sum(-1)[0], np.arange(1, 14))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_inputs_match_reference(backend):
  q, k, w = testing.indexer_inputs(15, b=2, t=19, s=19, h_i=2, d_i=16,
                                   dtype=jnp.bfloat16)
  np.testing.assert_array_equal(_kernel_topk(q, k, w, 6, backend),
                                _reference_topk(q, k, w, 6))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_scores_break_to_lower_position(backend):
  q, k, w = testing.tied_indexer_inputs(16, b=2, t=24, s=24, h_i=2, d_i=4)
  topk = 6
  scores = np.asarray(jax.jit(xla.index_scores)(q, k, w))
  # The inputs must really tie at the selection boundary, or this test proves nothing.
  tied_rows = 0
  for bi in range(2):
    for i in range(topk, 24):
      row = np.sort(scores[bi, i, :i + 1])[::-1]
      tied_rows += int(row[topk - 1] == row[topk])
  assert tied_rows >= 10, f"only {tied_rows} rows tie at the k-th place"
  got = _kernel_topk(q, k, w, topk, backend)
  np.testing.assert_array_equal(got, _reference_topk(q, k, w, topk))
  # Within equal scores the positions increase.
  sel = np.take_along_axis(scores, np.maximum(got, 0), axis=-1)
  same = (sel[..., 1:] == sel[..., :-1]) & (got[..., 1:] >= 0)
  assert np.all(got[..., 1:][same] > got[..., :-1][same])


@pytest.mark.parametrize("backend", BACKENDS)
def test_document_starts_match_reference(backend):
  # Packed rows: documents [0, 11), [11, 26), [26, 30); a query sees only its own document.
  q, k, w = testing.indexer_inputs(20, b=2, t=30, s=30, h_i=2, d_i=16)
  bounds = np.array([0] * 11 + [11] * 15 + [26] * 4, np.int32)
  start = jnp.asarray(np.stack([bounds, np.zeros(30, np.int32)]))
  got = _kernel_topk(q, k, w, 8, backend, start=start)
  np.testing.assert_array_equal(got, _reference_topk(q, k, w, 8, start=start))
  assert np.all((got[0] < 0) | (got[0] >= bounds[:, None]))


def test_api_pallas_impl_matches_xla_impl():
  # The lead's dispatcher with its defaults: impl="pallas", interpret on CPU -> TPU kernel.
  q, k, w = testing.indexer_inputs(17, b=1, t=9, s=20, h_i=2, d_i=16)
  got = lightning_indexer.topk_indices(q, k, w, 5, impl="pallas", interpret=True)
  want = lightning_indexer.topk_indices(q, k, w, 5, impl="xla")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("backend,tiles,name", [
    ("tpu", dict(block_q=12), "block_q"),
    ("gpu", dict(block_k=24), "block_k"),
    ("gpu", dict(block_q=8), "block_q"),
])
def test_illegal_tiles_are_rejected(backend, tiles, name):
  q, k, w = testing.indexer_inputs(18, b=1, t=4, s=4, h_i=1, d_i=16)
  with pytest.raises(ValueError, match=name):
    kernel.topk_indices(q, k, w, 2, interpret=True, backend=backend, **tiles)


def test_unknown_backend_is_rejected():
  q, k, w = testing.indexer_inputs(19, b=1, t=4, s=4, h_i=1, d_i=16)
  with pytest.raises(ValueError, match="backend='cuda'"):
    kernel.topk_indices(q, k, w, 2, interpret=True, backend="cuda")


@pytest.mark.parametrize("impl", ["xla"] + BACKENDS)
@pytest.mark.parametrize("t,s", [(11, 27), (24, 24)])
def test_row_limits_match_numpy(impl, t, s, seed):
  # Per-row [b, t] limits (a KV-cache batch) over several query chunks and key tiles; topk
  # 6 > visible keys for some queries (-1 fill). t == s: the causal path would skip key tiles
  # after each query tile (on both backends), which these limits reach.
  topk = 6
  q, k, w = testing.indexer_inputs(seed, b=3, t=t, s=s, h_i=2, d_i=16)
  start, limit = _row_limits(seed, t, s)
  if impl == "xla":
    got = _reference_topk(q, k, w, topk, start=start, limit=limit)
  else:
    got = _kernel_topk(q, k, w, topk, impl, chunk_size=8, start=start, limit=limit)
  np.testing.assert_array_equal(got, _numpy_topk(q, k, w, topk, start, limit))
  assert np.all(got[1, 1] == -1)                        # limit 3 < start 5: sees nothing
  np.testing.assert_array_equal(got[1, 2], [5] + [-1] * (topk - 1))
  assert np.all(got[2, 1] == -1)                        # limit -2
  assert np.all(got[2, 0] >= 0)                         # limit past the last key: all of them


@pytest.mark.parametrize("kind", ["t", "bt"])
def test_api_pallas_impl_matches_xla_impl_with_limit(kind, seed):
  # impl="pallas" (interpreted TPU kernel) == impl="xla" for explicit limits, [t] (every
  # row alike) or [b, t] (per row), both equal to the float64 numpy selection.
  b, t, s, topk = 2, 10, 19, 5
  q, k, w = testing.indexer_inputs(seed, b=b, t=t, s=s, h_i=2, d_i=16)
  rng = np.random.default_rng(seed)
  limit = jnp.asarray(rng.integers(-1, s + 2, (t,) if kind == "t" else (b, t)), jnp.int32)
  start = jnp.asarray(rng.integers(0, 4, (b, t)), jnp.int32)
  run = lambda impl: np.asarray(jax.jit(functools.partial(
      lightning_indexer.topk_indices, topk=topk, impl=impl, interpret=True, chunk_size=4))(
          q, k, w, start=start, limit=limit))
  got = run("pallas")
  np.testing.assert_array_equal(got, run("xla"))
  np.testing.assert_array_equal(got, _numpy_topk(q, k, w, topk, start, limit))


def test_causal_limit_passed_explicitly_equals_default(seed):
  # An explicit limit equal to the causal one (all tiles scored) selects what the causal
  # path (dead tiles skipped) selects, for [t] and its [b, t] broadcast.
  b, t, s = 2, 13, 21
  q, k, w = testing.indexer_inputs(seed, b=b, t=t, s=s, h_i=2, d_i=16)
  want = _kernel_topk(q, k, w, 7, "tpu", chunk_size=8)
  causal = xla.causal_limit(t, s)
  np.testing.assert_array_equal(_kernel_topk(q, k, w, 7, "tpu", chunk_size=8, limit=causal),
                                want)
  np.testing.assert_array_equal(
      _reference_topk(q, k, w, 7, limit=jnp.broadcast_to(causal, (b, t))), want)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("shape", [(5,), (1, 4), (4, 2), (2, 4, 1), ()])
def test_bad_limit_shape_is_rejected(impl, shape):
  q, k, w = testing.indexer_inputs(21, b=2, t=4, s=6, h_i=1, d_i=16)
  with pytest.raises(ValueError, match=r"limit has shape .*expected int32 \[t\] = \(4,\) or "
                     r"\[b, t\] = \(2, 4\)"):
    lightning_indexer.topk_indices(q, k, w, 2, impl=impl, interpret=True,
                                   limit=jnp.zeros(shape, jnp.int32))
