"""glm5_jax/cpu_dsa.py: the CPU top-k equals `lax.top_k` bit for bit (values and
positions), on ties, signed zeros, infinities and NaNs, at every row count and k; the
indexer's scores and sparse attention's products straight from a paged pool are the fused
multiply-add chains of their specification, and XLA's bits at the engine's shapes; the
indexer's top-k and sparse attention through them are unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import cpu_dsa
from glm5_jax.nn import dsa
from glm5_jax.nn import indexer as indexer_lib
from glm5_jax.nn import kv_cache
from pallas_kernels.lightning_indexer import xla as indexer_xla

pytestmark = pytest.mark.skipif(not cpu_dsa.available(),
                                reason="cpu_dsa: no C++ compiler or not a CPU backend")

SPECIALS = np.concatenate([
    np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.5, -1.5], np.float32),
    np.array([0xFFFFFFFF, 0x7FFFFFFF, 0x00000001, 0x80000001], np.uint32).view(np.float32)])
# (the last: the lowest and highest NaN, and the two smallest subnormals)


def _awkward(rng, shape):
  """Normal values with many exact ties and every special float, at random places."""
  x = rng.standard_normal(shape).astype(np.float32)
  x = np.where(rng.random(shape) < 0.3, np.round(x), x).astype(np.float32)   # ties
  special = rng.random(shape) < 0.2
  return np.where(special, SPECIALS[rng.integers(0, len(SPECIALS), shape)], x)


def _assert_same_bits(got, want):
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  assert np.asarray(got[0]).dtype == np.float32
  np.testing.assert_array_equal(np.asarray(got[0]).view(np.int32),
                                np.asarray(want[0]).view(np.int32))


@pytest.mark.parametrize("shape,k", [
    ((16, 1, 1024), 256),     # a decode step's indexer rows at 1K context, 16 requests
    ((1, 1, 1024), 256),      # a lone request
    ((3, 300), 300),          # k = N: the whole row sorted
    ((40, 2048), 256),        # enough elements for XLA's threads
    ((5, 64), 1),
    ((2, 3, 7), 0),
    ((4, 1), 1),
])
def test_top_k_equals_lax_top_k_bitwise(shape, k, rng):
  x = _awkward(rng, shape)
  got = jax.jit(lambda x: cpu_dsa.top_k(x, k))(x)
  want = jax.jit(lambda x: jax.lax.top_k(x, k))(x)
  _assert_same_bits(got, want)


@pytest.mark.parametrize("live", [0, 5, 9, 10, 11, 40])
def test_top_k_over_a_masked_tail_equals_lax_top_k(live, rng):
  """Rows whose positions past `live` are -inf (the indexer's mask): the kernel selects among
  the live ones when at least k of them rank above -inf; with -inf and -NaN among the live
  ones (fewer than k above -inf), the tail's -inf still come before any -NaN."""
  k, n = 10, 48
  x = _awkward(rng, (6, n))
  x[:, live:] = -np.inf
  x[1, :live] = np.where(np.arange(live) % 3 == 0, -np.nan, x[1, :live])   # -NaN before the tail
  x[2, :live] = np.where(np.arange(live) % 4 == 0, -np.inf, x[2, :live])   # -inf inside
  x[3, :live] = -np.nan
  got = jax.jit(lambda x: cpu_dsa.top_k(x, k))(x)
  _assert_same_bits(got, jax.jit(lambda x: jax.lax.top_k(x, k))(x))


def test_rows_of_one_value_keep_ascending_positions():
  x = np.full((2, 50), 3.0, np.float32)
  v, i = jax.jit(lambda x: cpu_dsa.top_k(x, 20))(x)
  np.testing.assert_array_equal(np.asarray(i), np.tile(np.arange(20), (2, 1)))
  np.testing.assert_array_equal(np.asarray(v), 3.0)


def test_top_k_under_vmap_and_in_a_loop(rng):
  x = _awkward(rng, (3, 4, 96))
  got = jax.jit(jax.vmap(lambda r: cpu_dsa.top_k(r, 17)))(x)
  _assert_same_bits(got, jax.lax.top_k(x, 17))
  got = jax.jit(lambda x: jax.lax.map(lambda r: cpu_dsa.top_k(r, 5), x))(x)
  _assert_same_bits(got, jax.lax.top_k(x, 5))


def test_other_dtypes_and_bad_k(rng):
  x = jnp.asarray(rng.standard_normal((2, 9)), jnp.bfloat16)
  _assert_same_bits(*(jax.tree.map(lambda a: a.astype(jnp.float32), r)
                      for r in (cpu_dsa.top_k(x, 3), jax.lax.top_k(x, 3))))
  with pytest.raises(ValueError, match=r"k must be in \[0, 9\]"):
    cpu_dsa.top_k(x, 10)


def test_the_indexers_topk_through_it_is_unchanged(rng):
  """`deterministic_topk` (windows, NaN / -inf hidden, -1 tail) with the kernel as its
  selection gives XLA's positions."""
  b, t, s, k = 4, 3, 200, 64
  scores = _awkward(rng, (b, t, s))
  limit = jnp.asarray(rng.integers(-1, s, (b, t)), jnp.int32)
  start = jnp.asarray(rng.integers(0, 50, (b, t)), jnp.int32)
  run = lambda top_k: jax.jit(lambda x: indexer_xla.deterministic_topk(
      x, limit, k, start, top_k=top_k))(scores)
  np.testing.assert_array_equal(np.asarray(run(cpu_dsa.top_k)), np.asarray(run(None)))


def _chains(q, w, keys, rows, limit):
  """float64-emulated scores: a fused multiply-add chain from zero over d, relu, then one
  over j (each step rounded once to float32); 0 past each query's limit."""
  b, t, j, d = q.shape
  k = keys[rows].astype(np.float64)                                  # [b, s, d]
  qk = np.zeros((b, t, j, k.shape[1]))
  for i in range(d):
    qk = np.float32(qk + q[..., i, None].astype(np.float64) * k[:, None, None, :, i])
  relu = np.maximum(qk.astype(np.float64), 0)
  score = np.zeros((b, t, k.shape[1]))
  for i in range(j):
    score = np.float32(score + relu[:, :, i] * w[:, :, i, None].astype(np.float64))
  visible = np.arange(k.shape[1])[None, None] <= limit[..., None]
  return np.where(visible, score, 0).astype(np.float32)


def _paged_inputs(rng, b, t, j, d, n, s):
  q = rng.standard_normal((b, t, j, d)).astype(np.float32)
  w = rng.standard_normal((b, t, j)).astype(np.float32)
  keys = rng.standard_normal((3, n, d)).astype(np.float32)
  rows = rng.integers(0, n, (b, s)).astype(np.int32)
  limit = rng.integers(-1, s + 3, (b, t)).astype(np.int32)
  return q, w, keys, rows, limit


@pytest.mark.parametrize("b,t,j,d,n,s", [
    (16, 1, 8, 32, 700, 100),    # `small`'s decode shapes
    (1, 1, 8, 32, 300, 64),      # a lone request
    (2, 2, 12, 20, 90, 37),      # speculative verify: 2 queries; heads past 8, odd d and s
    (3, 1, 5, 128, 64, 16),
])
def test_paged_scores_are_the_chains_of_the_specification(b, t, j, d, n, s, rng):
  q, w, keys, rows, limit = _paged_inputs(rng, b, t, j, d, n, s)
  got = jax.jit(cpu_dsa.paged_scores)(q, w, keys, 2, rows, limit)
  np.testing.assert_array_equal(np.asarray(got), _chains(q, w, keys[2], rows, limit))


def test_paged_scores_clip_rows_as_xlas_gather(rng):
  q, w, keys, rows, limit = _paged_inputs(rng, 2, 1, 8, 32, 50, 40)
  rows[:, ::3] = 77
  rows[:, 1::5] = -4
  limit[:] = 39
  got = cpu_dsa.paged_scores(q, w, keys, 0, rows, limit)
  np.testing.assert_array_equal(np.asarray(got), _chains(q, w, keys[0], np.clip(rows, 0, 49),
                                                         limit))


def test_paged_scores_equal_xlas_at_the_engines_shapes():
  """The probe finds XLA's bits at `small`'s batch-16 and lone-request decode shapes."""
  cfg = config_lib.get_preset("small")
  for lanes in (1, 16):
    assert dsa.paged_scores_exact((lanes, 1, cfg.index_n_heads, cfg.index_head_dim), 4096,
                                   2048)


@pytest.mark.parametrize("b,t,j,d,n,s,topk,dup,starts", [
    (16, 1, 8, 32, 700, 100, 32, False, False),   # `small`'s decode shapes
    (2, 2, 12, 20, 90, 37, 16, True, True),       # verify: 2 queries, heads past 8, ties
    (3, 1, 5, 16, 40, 10, 16, True, True),        # more slots than positions: -1 pads
    (1, 1, 8, 32, 300, 64, 64, False, False),     # every position selected
])
def test_paged_topk_is_deterministic_topk_of_the_paged_scores(b, t, j, d, n, s, topk, dup,
                                                                starts, rng):
  """One call equals the scores then XLA's masked top-k: windows from start to limit, NaN
  and infinite scores, exact ties (repeated key rows) kept in position order."""
  q, w, keys, rows, limit = _paged_inputs(rng, b, t, j, d, n, s)
  if dup:
    rows = rng.integers(0, 4, (b, s)).astype(np.int32)
  keys[2, 1] = np.nan                                  # its scores are NaN: never selected
  keys[2, 2, 0] = np.inf                               # +-inf or NaN scores
  start = rng.integers(0, s // 2 + 1, (b, t)).astype(np.int32) if starts else None
  got = jax.jit(cpu_dsa.paged_topk, static_argnums=6)(q, w, keys, 2, rows, limit, topk, start)
  scores = cpu_dsa.paged_scores(q, w, keys, 2, rows, limit)
  want = jax.jit(indexer_xla.deterministic_topk, static_argnums=2)(scores, limit, topk, start)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_paged_scores_name_bad_shapes(rng):
  q, w, keys, rows, limit = _paged_inputs(rng, 2, 1, 4, 8, 10, 6)
  with pytest.raises(ValueError, match="rows .b, s., limit .b, t."):
    cpu_dsa.paged_scores(q, w, keys, 0, rows, limit[:1])
  with pytest.raises(ValueError, match="limit and start .b, t."):
    cpu_dsa.paged_topk(q, w, keys, 0, rows, limit, 4, limit[:, :0])
  with pytest.raises(ValueError, match="topk must be >= 0"):
    cpu_dsa.paged_topk(q, w, keys, 0, rows, limit, -1)


def test_the_paged_indexer_selects_what_select_topk_selects(rng):
  """Windows (document starts, per-row limits, a row that sees nothing), a layer of a stacked
  pool and an unstacked one: the same indices as `select_topk` over the gathered keys."""
  cfg = config_lib.get_preset("small").replace(index_topk=24)
  b, t, n, s = 16, 1, 400, 96
  q, w, keys, rows, limit = _paged_inputs(rng, b, t, cfg.index_n_heads, cfg.index_head_dim,
                                          n, s)
  limit[3] = -1
  start = rng.integers(0, 40, (b, t)).astype(np.int32)
  for pool, layer in ((keys, 1), (keys[1], None)):
    got = jax.jit(lambda q, w, p, r, lim, st: indexer_lib.select_topk_paged(
        cfg, q, w, p, layer, r, lim, st))(q, w, pool, rows, limit, start)
    want = indexer_lib.select_topk(cfg, q, kv_cache.read(jnp.asarray(pool), rows, layer), w,
                                   start, limit)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _sparse_inputs(rng, b, c, h, d, k, n, s, w):
  q = rng.standard_normal((b, c, h, d)).astype(np.float32)
  p = rng.random((b, c, h, k)).astype(np.float32)
  keys = rng.standard_normal((2, n, w)).astype(np.float32)
  rows = rng.integers(-2, n + 2, (b, s)).astype(np.int32)       # some out of range: clipped
  idx = rng.integers(-1, s, (b, c, k)).astype(np.int32)
  gathered = keys[1][np.clip(rows, 0, n - 1)][np.arange(b)[:, None, None], np.maximum(idx, 0)]
  return q, p, keys, rows, idx, gathered.astype(np.float64)


def _blocked(terms, kc):
  """float64-emulated sum over the last axis of `terms` (exact products): a chain from zero
  per block of kc, the blocks' sums added in order, each step rounded once to float32."""
  y = np.zeros(terms.shape[:-1], np.float32)
  for e0 in range(0, terms.shape[-1], kc):
    acc = np.zeros(terms.shape[:-1])
    for i in range(e0, min(e0 + kc, terms.shape[-1])):
      acc = np.float32(acc + terms[..., i]).astype(np.float64)
    y = np.float32(y.astype(np.float64) + acc)
  return y


@pytest.mark.parametrize("b,c,h,d,k,v,kc", [
    (16, 1, 8, 144, 64, 128, 144),     # `small`'s decode shapes (context 64)
    (2, 2, 12, 40, 21, 24, 16),        # heads past 8, odd widths, several blocks
    (1, 3, 3, 20, 5, 20, 8),
])
def test_sparse_products_are_blocked_chains(b, c, h, d, k, v, kc, rng):
  n, s, w = 90, 70, d + 3
  q, p, keys, rows, idx, g = _sparse_inputs(rng, b, c, h, d, k, n, s, w)
  logits, slot_rows = jax.jit(cpu_dsa.sparse_logits, static_argnums=(5, 6))(
      q, keys, 1, rows, idx, v, kc)
  want = _blocked(q[:, :, :, None, :].astype(np.float64) * g[:, :, None, :, :d], kc)
  np.testing.assert_array_equal(np.asarray(logits), want)
  np.testing.assert_array_equal(np.asarray(slot_rows), g[..., :v])
  values = jax.jit(cpu_dsa.row_values, static_argnums=2)(p, slot_rows, kc)
  terms = p[..., None, :].astype(np.float64) * np.swapaxes(g[..., :v], -1, -2)[:, :, None]
  np.testing.assert_array_equal(np.asarray(values), _blocked(terms, kc))


def test_sparse_products_name_bad_shapes(rng):
  q, p, keys, rows, idx, _ = _sparse_inputs(rng, 2, 1, 4, 8, 5, 10, 6, 8)
  with pytest.raises(ValueError, match=r"idx \[b, c, k\]"):
    cpu_dsa.sparse_logits(q, keys, 0, rows, idx[:1], 8, 8)
  with pytest.raises(ValueError, match=r"v_dim must be in \[0, 8\]"):
    cpu_dsa.sparse_logits(q, keys, 0, rows, idx, 9, 8)
  with pytest.raises(ValueError, match=r"rows \[b, c, k, v\]"):
    cpu_dsa.row_values(p, np.zeros((2, 1, 4, 8), np.float32), 8)


def test_paged_sparse_attention_is_sparse_mla(rng):
  """Over a stacked pool's layer and an unstacked pool, with empty slots and a query with
  none: `sparse_mla` over the gathered cache, bit for bit, at `small`'s batch-16 shapes."""
  cfg = config_lib.get_preset("small").replace(index_topk=32)
  b, n, s, k = 16, 300, 64, 32
  d = cfg.kv_lora_rank + cfg.qk_rope_head_dim
  q = rng.standard_normal((b, 1, cfg.num_attention_heads, d)).astype(np.float32)
  pool = rng.standard_normal((3, n, d)).astype(np.float32)
  rows = rng.integers(0, n, (b, s)).astype(np.int32)
  idx = rng.integers(-1, s, (b, 1, k)).astype(np.int32)
  idx[5] = -1
  for p, layer in ((pool, 2), (pool[2], None)):
    got = jax.jit(lambda q, p, r, i: dsa.sparse_mla_paged(cfg, q, p, layer, r, i))(
        q, p, rows, idx)
    kv = kv_cache.read(jnp.asarray(p), rows, layer)
    want, _ = dsa.sparse_mla(q, kv, idx, v_dim=cfg.kv_lora_rank, scale=cfg.softmax_scale,
                             impl="xla", interpret=None, chunk_size=cfg.attention_chunk_size)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  n_q = dsa.PAGED_MAX_QUERIES + 1                               # a prefill chunk: XLA's path
  assert dsa.sparse_mla_paged(cfg, np.repeat(q, n_q, 1), pool, 2, rows,
                              np.repeat(idx, n_q, 1)) is None
