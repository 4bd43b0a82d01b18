"""MoE: sigmoid routing (with groups) and dropless grouped matmuls vs loop references."""

import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax.nn import moe


def _np_route(cfg, x, w, bias):
  scores = 1 / (1 + np.exp(-(x @ w)))
  choice = scores + bias
  n, e = choice.shape
  if cfg.n_group > 1:
    g = choice.reshape(n, cfg.n_group, -1)
    gs = np.sort(g, -1)[..., -2:].sum(-1)
    keep = np.argsort(-gs, -1, kind="stable")[:, :cfg.topk_group]
    mask = np.zeros((n, cfg.n_group), bool)
    np.put_along_axis(mask, keep, True, -1)
    choice = np.where(np.repeat(mask, e // cfg.n_group, 1), choice, -np.inf)
  ids = np.argsort(-choice, -1, kind="stable")[:, :cfg.num_experts_per_tok]
  wts = np.take_along_axis(scores, ids, -1)
  wts = wts / (wts.sum(-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
  return ids, wts


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_routing_matches_numpy(rng, n_group, topk_group):
  cfg = config_lib.get_preset("tiny", n_group=n_group, topk_group=topk_group)
  x, w, b = rng.normal(size=(16, 64)), rng.normal(size=(64, 8)), rng.normal(size=8) * 0.3
  ids, wts = moe.route(cfg, *(jnp.asarray(a, jnp.float32) for a in (x, w, b)))
  rid, rwt = _np_route(cfg, x, w, b)
  np.testing.assert_array_equal(np.sort(ids, -1), np.sort(rid, -1))
  order = np.argsort(ids, -1), np.argsort(rid, -1)
  np.testing.assert_allclose(np.take_along_axis(np.asarray(wts), order[0], -1),
                             np.take_along_axis(rwt, order[1], -1), rtol=1e-5)


def test_bias_changes_selection_but_not_weights(rng):
  cfg = config_lib.get_preset("tiny")
  x, w = jnp.asarray(rng.normal(size=(4, 64)), jnp.float32), jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)
  bias = jnp.zeros(8).at[5].set(100.0)           # expert 5 always chosen
  ids, wts = moe.route(cfg, x, w, bias)
  assert np.all(np.any(np.asarray(ids) == 5, -1))
  scores = 1 / (1 + np.exp(-np.asarray(x @ w)))
  picked = np.take_along_axis(scores, np.asarray(ids), -1)
  np.testing.assert_allclose(wts, picked / picked.sum(-1, keepdims=True) * 2.5, rtol=1e-5)


def test_grouped_swiglu_equals_token_loop(rng):
  n, d, i, e, k = 11, 6, 5, 4, 2
  x = rng.normal(size=(n, d))
  ids = np.stack([rng.permutation(e)[:k] for _ in range(n)])
  wts = rng.random(size=(n, k))
  wg, wu, wd = rng.normal(size=(e, d, i)), rng.normal(size=(e, d, i)), rng.normal(size=(e, i, d))
  silu = lambda z: z / (1 + np.exp(-z))
  want = np.zeros((n, d))
  for t in range(n):
    for j in range(k):
      ex = ids[t, j]
      want[t] += wts[t, j] * ((silu(x[t] @ wg[ex]) * (x[t] @ wu[ex])) @ wd[ex])
  got, counts = moe.grouped_swiglu(*(jnp.asarray(a, jnp.float32) for a in (x,)), jnp.asarray(ids),
                                   *(jnp.asarray(a, jnp.float32) for a in (wts, wg, wu, wd)))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(counts, np.bincount(ids.ravel(), minlength=e))
