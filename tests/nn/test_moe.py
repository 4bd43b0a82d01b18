"""MoE: sigmoid routing (with groups) and dropless grouped matmuls vs loop references."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import quant
from glm5_jax.nn import ffn
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


def test_ragged_swiglu_equals_token_loop(rng):
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
  got, counts = ffn.ragged_swiglu(*(jnp.asarray(a, jnp.float32) for a in (x,)), jnp.asarray(ids),
                                   *(jnp.asarray(a, jnp.float32) for a in (wts, wg, wu, wd)))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(counts, np.bincount(ids.ravel(), minlength=e))


def _np_swiglu_loop(x, ids, wts, wg, wu, wd):
  """float64 loop over tokens and their K experts."""
  silu = lambda z: z / (1 + np.exp(-z))
  want = np.zeros((x.shape[0], wd.shape[-1]))
  for t in range(ids.shape[0]):
    for j in range(ids.shape[1]):
      ex = ids[t, j]
      want[t] += wts[t, j] * ((silu(x[t] @ wg[ex]) * (x[t] @ wu[ex])) @ wd[ex])
  return want


def test_gathered_swiglu_equals_ragged_and_token_loop(rng):
  n, d, i, e, k = 3, 6, 5, 8, 2                    # n*K < E: the decode regime
  x = rng.normal(size=(n, d))
  shared = int(rng.integers(e))                    # one expert repeated across all tokens
  rest = [x for x in range(e) if x != shared]
  ids = np.stack([rng.permutation([shared, *rng.permutation(rest)[:k - 1]]) for _ in range(n)])
  wts = rng.random(size=(n, k))
  wg, wu, wd = rng.normal(size=(e, d, i)), rng.normal(size=(e, d, i)), rng.normal(size=(e, i, d))
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  args = (f32(x), jnp.asarray(ids, jnp.int32), f32(wts), f32(wg), f32(wu), f32(wd))
  got, counts = ffn.gathered_swiglu(*args)
  ref, ref_counts = ffn.ragged_swiglu(*args)
  want = _np_swiglu_loop(x, ids, wts, wg, wu, wd)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  assert counts.dtype == jnp.int32 and counts.shape == (e,)
  np.testing.assert_array_equal(counts, ref_counts)
  np.testing.assert_array_equal(counts, np.bincount(ids.ravel(), minlength=e))
  assert counts[shared] == n


def _pairs(rng, n, d, i, e, k, skew=False):
  """float64 MoE inputs. skew: expert 1 takes about half the pairs, the last expert none."""
  p = np.full(e, 1.0)
  if skew:
    p[1], p[-1] = e, 0.0
  ids = np.stack([rng.choice(e, k, replace=False, p=p / p.sum()) for _ in range(n)])
  x, wts = rng.normal(size=(n, d)), rng.random(size=(n, k))
  w = (rng.normal(size=(e, d, i)), rng.normal(size=(e, d, i)), rng.normal(size=(e, i, d)))
  return x, ids, wts, w


@pytest.mark.parametrize("n,e,k,skew", [(11, 4, 2, False), (40, 8, 2, True), (300, 8, 2, False),
                                        (70, 32, 4, True)])
def test_blocked_swiglu_equals_ragged_dot_and_token_loop(rng, n, e, k, skew):
  x, ids, wts, (wg, wu, wd) = _pairs(rng, n, 6, 5, e, k, skew)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  args = (f32(x), jnp.asarray(ids, jnp.int32), f32(wts), f32(wg), f32(wu), f32(wd))
  got, counts = jax.jit(ffn.blocked_swiglu)(*args)
  ref, ref_counts = jax.jit(ffn.ragged_swiglu)(*args)
  np.testing.assert_allclose(got, _np_swiglu_loop(x, ids, wts, wg, wu, wd), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(counts, ref_counts)
  np.testing.assert_array_equal(counts, np.bincount(ids.ravel(), minlength=e))
  # On this (CPU) backend routed_swiglu is the blocked kernel, bit for bit, in both regimes.
  for kernel in (ffn.ragged_swiglu, ffn.gathered_swiglu):
    routed = jax.jit(lambda *a, kernel=kernel: ffn.routed_swiglu(kernel, *a))(*args)
    np.testing.assert_array_equal(routed[0], got)
    np.testing.assert_array_equal(routed[1], counts)


@pytest.mark.parametrize("n,e,k,skew", [(1, 8, 2, False), (8, 32, 4, True), (40, 8, 2, True)])
def test_looped_swiglu_is_blocked_swiglu_bitwise_on_a_layer_or_a_stack(rng, n, e, k, skew):
  """The engine's loop over the blocks in use: the batched kernel's bits, with the weights of
  one layer [E, ...] or a stack [R, E, ...] and the layer's index, float32 or INT4."""
  x, ids, wts, (wg, wu, wd) = _pairs(rng, n, 16, 8, e, k, skew)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  args = (f32(x), jnp.asarray(ids, jnp.int32), f32(wts))
  w = (f32(wg), f32(wu), f32(wd))
  want = jax.jit(ffn.blocked_swiglu)(*args, *w)
  got = jax.jit(ffn.looped_swiglu)(*args, *w)
  stacks = [jnp.stack([v * 0.5, v, v * 2.0]) for v in w]                  # [R=3, E, ...]
  from_stack = jax.jit(ffn.looped_swiglu)(*args, *stacks, layer=jnp.int32(1))
  for y in (got, from_stack):
    np.testing.assert_array_equal(y[0], want[0])
    np.testing.assert_array_equal(y[1], want[1])
  np.testing.assert_allclose(got[0], _np_swiglu_loop(x, ids, wts, wg, wu, wd), rtol=1e-4,
                             atol=1e-4)
  scheme = quant.Scheme("int4", 8, "experts")
  q = [quant.quantize(v, scheme, quant.Layout(batch=1, reduction=1)) for v in w]
  q_stacks = [quant.quantize(v, scheme, quant.Layout(batch=2, reduction=1)) for v in stacks]
  np.testing.assert_array_equal(jax.jit(ffn.looped_swiglu)(*args, *q_stacks,
                                                           layer=jnp.int32(1))[0],
                                jax.jit(ffn.blocked_swiglu)(*args, *q)[0])


def test_blocked_swiglu_rows_do_not_depend_on_the_other_rows(rng):
  """The engine pads a few rows; the trainer runs thousands: each row's result must be the
  same bits in both (glm5_jax/numerics.py). 8, 64 and 512 rows take block sizes 16/32/128."""
  x, ids, wts, (wg, wu, wd) = _pairs(rng, 512, 64, 32, 8, 2)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  w = (f32(wg), f32(wu), f32(wd))
  full = jax.jit(ffn.blocked_swiglu)(f32(x), jnp.asarray(ids), f32(wts), *w)[0]
  for n in (8, 64):
    assert ffn.block_rows(n * 2, 8) != ffn.block_rows(512 * 2, 8)
    part = jax.jit(ffn.blocked_swiglu)(f32(x[-n:]), jnp.asarray(ids[-n:]), f32(wts[-n:]), *w)[0]
    np.testing.assert_array_equal(part, full[-n:])


def test_blocked_swiglu_gradients_equal_ragged_dot(rng):
  x, ids, wts, w = _pairs(rng, 40, 6, 5, 8, 2, skew=True)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  cot = f32(rng.normal(size=x.shape))
  grads = [jax.grad(lambda x, wts, *w, f=f: jnp.sum(f(x, jnp.asarray(ids), wts, *w)[0] * cot),
                    argnums=range(5))(f32(x), f32(wts), *map(f32, w))
           for f in (ffn.blocked_swiglu, ffn.ragged_swiglu)]
  for g, r in zip(*grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_block_rows_is_a_power_of_two_near_the_mean_rows_per_expert():
  assert [ffn.block_rows(p, 32) for p in (1, 32, 256, 1024, 2048, 8192, 10 ** 6)] == [
      16, 16, 16, 32, 64, 128, 128]


def test_select_dispatch_by_token_count():
  cfg = config_lib.get_preset("tiny")             # E = 8, K = 2; no mesh: no expert parallelism
  kernel = lambda n: (moe.select_dispatch(cfg, n).func, *moe.select_dispatch(cfg, n).args)
  assert kernel(1) == kernel(3) == (ffn.routed_swiglu, ffn.gathered_swiglu)
  assert kernel(4) == kernel(64) == (ffn.routed_swiglu, ffn.ragged_swiglu)


def _moe_and_params(rng, cfg):
  """An MoE module and float32 parameters drawn from rng (init's shapes), activations O(1)."""
  module = moe.MoE(cfg)
  shapes = nn.unbox(module.init(jax.random.PRNGKey(0), jnp.zeros((1, 1, cfg.hidden_size))))
  std = lambda a: a.shape[-2] ** -0.5 if a.ndim >= 2 else 0.3     # 1/sqrt(fan in)
  params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * std(a), jnp.float32),
                        shapes)
  return module, params


@pytest.mark.slow
def test_moe_gather_path_equals_grouped_path_on_padded_batch(rng, monkeypatch):
  cfg = config_lib.get_preset("tiny")
  module, params = _moe_and_params(rng, cfg)
  used = []                                       # the accelerator kernel each call selects
  select = moe.select_dispatch

  def spy(*a):
    dispatch = select(*a)
    used.append(dispatch.args[0].__name__)
    return dispatch

  monkeypatch.setattr(moe, "select_dispatch", spy)
  x_few = jnp.asarray(rng.normal(size=(1, 3, cfg.hidden_size)), jnp.float32)   # n*K = 6 < 8
  y_few, load_few, _ = module.apply(params, x_few)
  assert used == ["gathered_swiglu"]
  # Real rows first in a larger batch of random rows: grouped path, same real rows.
  x_pad = jnp.asarray(rng.normal(size=(2, 8, cfg.hidden_size)), jnp.float32).at[0, :3].set(x_few[0])
  y_pad, _, _ = module.apply(params, x_pad)
  assert used[1:] == ["ragged_swiglu"]
  np.testing.assert_allclose(y_pad[0, :3], y_few[0], rtol=1e-5, atol=1e-5)
  # The real rows repeated 4x: the same expert load fractions, through the grouped path.
  y_rep, load_rep, _ = module.apply(params, jnp.tile(x_few, (4, 1, 1)))
  assert used[2:] == ["ragged_swiglu"]
  np.testing.assert_allclose(y_rep, jnp.tile(y_few, (4, 1, 1)), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(load_few, load_rep)
  ids, _ = moe.route(cfg, x_few[0], params["params"]["router"]["kernel"],
                     params["params"]["router"]["e_score_correction_bias"])
  counts = np.bincount(np.asarray(ids).ravel(), minlength=cfg.n_routed_experts)
  np.testing.assert_array_equal(
      load_few, counts.astype(np.float32) / np.float32(3 * cfg.num_experts_per_tok))


@pytest.mark.slow
def test_moe_gather_path_gradients_equal_grouped_path(rng):
  cfg = config_lib.get_preset("tiny")
  module, params = _moe_and_params(rng, cfg)
  x_few = jnp.asarray(rng.normal(size=(1, 3, cfg.hidden_size)), jnp.float32)
  x_pad = jnp.asarray(rng.normal(size=(2, 8, cfg.hidden_size)), jnp.float32).at[0, :3].set(x_few[0])
  cot = jnp.asarray(rng.normal(size=x_few.shape), jnp.float32)
  cot_pad = jnp.zeros(x_pad.shape).at[0, :3].set(cot[0])     # pad rows carry no gradient
  loss = lambda p, x, c: jnp.sum(module.apply(p, x)[0] * c)
  g_few = jax.grad(loss, argnums=(0, 1))(params, x_few, cot)
  g_pad = jax.grad(loss, argnums=(0, 1))(params, x_pad, cot_pad)
  np.testing.assert_allclose(g_few[1][0], g_pad[1][0, :3], rtol=1e-5, atol=1e-5)
  for name in ("w_gate", "w_up", "w_down"):
    np.testing.assert_allclose(g_few[0]["params"]["experts"][name],
                               g_pad[0]["params"]["experts"][name], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(g_few[0]["params"]["router"]["kernel"],
                             g_pad[0]["params"]["router"]["kernel"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k,e", [(16, 4, 32), (1, 4, 8), (64, 4, 4), (7, 2, 3)])
def test_pairs_ordered_by_rank_are_the_stable_argsort(rng, n, k, e):
  """The engine's all-pairs ranking gives the stable sort's order (ties in pair order)."""
  ids = jnp.asarray(rng.integers(0, e, (n, k)), jnp.int32)
  for got, want in zip(ffn._sort_by_expert(ids, by_rank=True), ffn._sort_by_expert(ids)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
