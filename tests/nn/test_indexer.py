"""Lightning indexer: deterministic causal top-k and gradient isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import losses
from pallas_kernels import lightning_indexer as li
from pallas_kernels.lightning_indexer import xla as ref


def _np_topk(q, k, w, topk):
  """float64 numpy: sort causal keys by (-score, position); -1 padding."""
  b, t = q.shape[:2]
  s = k.shape[1]
  scores = np.einsum("btj,btjs->bts", w, np.maximum(np.einsum("btjd,bsd->btjs", q, k), 0))
  out = -np.ones((b, t, topk), np.int64)
  for bi in range(b):
    for i in range(t):
      keys = np.arange(s - t + i + 1)
      order = sorted(keys, key=lambda j: (-scores[bi, i, j], j))[:topk]
      out[bi, i, :len(order)] = order
  return out


@pytest.mark.parametrize("t,s,topk,chunk", [(9, 9, 4, 4), (3, 11, 5, 2), (6, 6, 10, 64)])
def test_topk_matches_float64_reference(rng, t, s, topk, chunk):
  q, k, w = rng.normal(size=(2, t, 3, 8)), rng.normal(size=(2, s, 8)), rng.normal(size=(2, t, 3))
  got = li.topk_indices(*(jnp.asarray(a, jnp.float32) for a in (q, k, w)), topk, chunk_size=chunk)
  np.testing.assert_array_equal(got, _np_topk(q, k, w, topk))


def test_ties_go_to_the_lower_position():
  scores = jnp.array([[[1.0, 3.0, 3.0, 0.0, 3.0, 3.0]]])
  got = ref.deterministic_topk(scores, jnp.array([5], jnp.int32), 3)
  np.testing.assert_array_equal(got[0, 0], [1, 2, 4])


def test_all_zero_scores_select_the_first_keys(rng):
  # ReLU of negative q.k is 0 for every key: a full tie, resolved by position.
  q = -np.abs(rng.normal(size=(1, 5, 2, 4)))
  k = np.abs(rng.normal(size=(1, 5, 4)))
  got = li.topk_indices(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                        jnp.ones((1, 5, 2)), 3)
  np.testing.assert_array_equal(got[0], [[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 1, 2], [0, 1, 2]])


def test_selection_is_independent_of_the_chunk_size(rng):
  q, k, w = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((2, 13, 2, 4), (2, 13, 4), (2, 13, 2)))
  a = li.topk_indices(q, k, w, 5, chunk_size=1)
  for c in (3, 13, 100):
    np.testing.assert_array_equal(li.topk_indices(q, k, w, 5, chunk_size=c), a)


def test_bad_inputs_raise_clear_errors():
  q, k, w = jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 8)), jnp.zeros((1, 4, 2))
  with pytest.raises(ValueError, match="impl='cuda'"):
    li.topk_indices(q, k, w, 2, impl="cuda")
  with pytest.raises(ValueError, match="s=2 keys < t=4"):
    li.topk_indices(q, k[:, :2], w, 2)
  with pytest.raises(ValueError, match="topk=0"):
    li.topk_indices(q, k, w, 0)


def _split_grads(grads):
  """(max |g| over indexer params, max |g| over all other params)."""
  flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  idx = [float(jnp.max(jnp.abs(g))) for p, g in flat if "indexer" in jax.tree_util.keystr(p)]
  rest = [float(jnp.max(jnp.abs(g))) for p, g in flat if "indexer" not in jax.tree_util.keystr(p)]
  return max(idx), max(rest)


def test_indexer_gets_gradient_only_from_the_indexer_loss(tiny_cfg, tiny_params, tiny_tokens):
  from glm5_jax import nn as gnn
  model = gnn.GLM5(tiny_cfg)

  def lm_loss(p):
    out = model.apply({"params": p}, tiny_tokens)
    y, m = losses.next_token_targets(tiny_tokens)
    return losses.cross_entropy(out.logits, y, m)[0]

  def kl_loss(p):
    return jnp.sum(model.apply({"params": p}, tiny_tokens, with_indexer_loss=True).indexer_kl)

  idx_lm, rest_lm = _split_grads(jax.jit(jax.grad(lm_loss))(tiny_params))
  idx_kl, rest_kl = _split_grads(jax.jit(jax.grad(kl_loss))(tiny_params))
  assert idx_lm == 0.0 and rest_lm > 0.0
  assert idx_kl > 0.0 and rest_kl == 0.0


@pytest.mark.parametrize("t,s", [(9, 9), (3, 11)])
def test_select_topk_clamps_to_the_keys_and_drops_only_empty_slots(tiny_cfg, rng, t, s):
  from glm5_jax.nn import indexer
  q, k, w = (jnp.asarray(rng.normal(size=z), jnp.float32)
             for z in ((2, t, 3, 8), (2, s, 8), (2, t, 3)))
  got = indexer.select_topk(tiny_cfg.replace(index_topk=100_000, attention_impl="xla"), q, k, w)
  unclamped = li.topk_indices(q, k, w, s + 4)
  assert got.shape == (2, t, s)
  np.testing.assert_array_equal(got, unclamped[..., :s])
  assert np.all(np.asarray(unclamped[..., s:]) == -1)


@pytest.mark.slow
def test_huge_index_topk_equals_topk_of_the_context_and_memory_stays_bounded(
    tiny_cfg, tiny_params, tiny_tokens):
  from glm5_jax import nn as gnn
  s = tiny_tokens.shape[1]
  runs = {}
  for k in (s, 100_000):
    model = gnn.GLM5(tiny_cfg.replace(index_topk=k))
    fn = jax.jit(lambda p, x, m=model: m.apply({"params": p}, x, mtp=False, return_topk=True))
    compiled = fn.lower(tiny_params, tiny_tokens).compile()
    runs[k] = compiled(tiny_params, tiny_tokens), compiled.memory_analysis().temp_size_in_bytes
  (ref, ref_bytes), (big, big_bytes) = runs[s], runs[100_000]
  np.testing.assert_array_equal(big.logits, ref.logits)
  for a, b in zip(big.topk_indices, ref.topk_indices):
    np.testing.assert_array_equal(a, b)
  # Unclamped, 100k slots of [b, t] queries gather 100k latent rows each (> 100 MB).
  assert big_bytes <= ref_bytes < 4 * 2**20, (big_bytes, ref_bytes)
