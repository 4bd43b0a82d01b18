"""One train step per stage: which parameters move (optax masks) and the routing-bias update."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax import optim
from glm5_jax.train import step as step_lib


def _changed(a, b):
  """{path: changed?} over two parameter trees."""
  fa = jax.tree_util.tree_flatten_with_path(a)[0]
  fb = jax.tree_util.tree_leaves(b)
  return {jax.tree_util.keystr(p): bool(jnp.any(x != y)) for (p, x), y in zip(fa, fb)}


# dsa_warmup (dense attention + indexer KL, the indexer alone trains) runs by default;
# pretrain and dsa_sparse are in the slow suite (`bash launch/local.sh slow`), ~35 s each.
@pytest.mark.parametrize("stage", [pytest.param("pretrain", marks=pytest.mark.slow), "dsa_warmup",
                                   pytest.param("dsa_sparse", marks=pytest.mark.slow)])
def test_stage_trains_the_right_parameters(tiny_cfg, tiny_params, rng, stage):
  c = ml_collections.ConfigDict(dict(
      stage=stage, optimizer="muon_split", learning_rate=1e-2, adam_learning_rate=0.0,
      warmup_steps=0, total_steps=10, final_lr_fraction=0.1, weight_decay=0.1, grad_clip=1.0))
  cfg = tiny_cfg.replace(mtp_num_steps=1)
  tx = step_lib.make_optimizer(c)
  state = step_lib.TrainState(jnp.zeros((), jnp.int32), tiny_params, tx.init(tiny_params),
                              jnp.zeros((2,), jnp.uint32))
  t = 32
  seg = np.array([[1] * 20 + [2] * 12, [1] * 32])
  batch = {"tokens": jnp.asarray(rng.integers(0, 256, (2, t)), jnp.int32),
           "segment_ids": jnp.asarray(seg, jnp.int32),
           "positions": jnp.asarray([list(range(20)) + list(range(12)), list(range(32))])}
  fn = jax.jit(functools.partial(step_lib.train_step, cfg=cfg, stage=stage, tx=tx,
                                 loss_chunk=8, bias_rate=1e-3))
  new, m = fn(state, batch)
  assert np.isfinite(float(m["loss"])) and int(new.step) == 1
  changed = _changed(tiny_params, new.params)
  indexer = {k: v for k, v in changed.items() if "indexer" in k}
  bias = {k: v for k, v in changed.items() if "e_score_correction_bias" in k}
  rest = {k: v for k, v in changed.items() if k not in indexer and k not in bias}
  if stage == "dsa_warmup":
    assert all(indexer.values()) and not any(rest.values()) and not any(bias.values())
    assert float(m["indexer_kl"]) > 0
  elif stage == "pretrain":
    assert not any(indexer.values()) and all(bias.values())
    assert sum(rest.values()) > 0.9 * len(rest)
  else:
    assert all(indexer.values()) and all(bias.values())


def _packed_batch(rng, t=16):
  """4 rows; the two microbatches (rows 0, 2 and 1, 3) hold different numbers of targets
  (padding, segment 0, and document boundaries), so a mean of means would be wrong."""
  seg = np.array([[1] * 6 + [0] * 10, [1] * 16, [1] * 3 + [2] * 5 + [0] * 8, [1] * 9 + [2] * 7])
  pos = np.concatenate([np.arange(t)[None]] * 4)
  pos[2, 3:] -= 3
  pos[3, 9:] -= 9
  return {"tokens": jnp.asarray(rng.integers(0, 256, (4, t)), jnp.int32),
          "segment_ids": jnp.asarray(seg, jnp.int32), "positions": jnp.asarray(pos, jnp.int32)}


def _assert_trees_close(a, b, atol):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  leaves_b = jax.tree_util.tree_leaves(b)
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], leaves_b):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=atol,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_microbatch_losses_add_up_to_the_whole_batch_loss(tiny_cfg, rng):
  """loss_fn's `norm`: each part's loss is its token sums over the whole batch's counts (and
  its row mean of the indexer KL over the number of parts), so the parts add up."""
  cfg = tiny_cfg.replace(num_hidden_layers=2, first_k_dense_replace=1, mtp_num_steps=1)
  params = gnn.init_params(cfg, 0)
  batch = _packed_batch(rng)
  loss = jax.jit(functools.partial(step_lib.loss_fn, cfg=cfg, stage="dsa_sparse",
                                   loss_chunk=8))
  _, (whole, _) = loss(params, batch)
  norm = {"tokens": {o: jnp.sum(step_lib.targets(batch, o)[1])
                     for o in step_lib.target_offsets(cfg, "dsa_sparse")}, "parts": 2}
  parts = [loss(params, jax.tree.map(lambda x, r=r: x[r::2], batch), norm=norm)[1][0]
           for r in (0, 1)]
  assert float(whole["tokens"]) == 5 + 15 + 6 + 14
  assert float(parts[0]["tokens"]) == 5 + 6           # rows 0 and 2: a mean of means is off
  for k in ("loss", "ce", "mtp", "indexer_kl", "tokens"):
    np.testing.assert_allclose(float(parts[0][k] + parts[1][k]), float(whole[k]), rtol=1e-5,
                               err_msg=k)


def test_microbatches_must_divide_the_batch(tiny_cfg, rng):
  with pytest.raises(ValueError, match="config.microbatches=3 does not divide"):
    step_lib.grads_and_parts(None, _packed_batch(rng), cfg=tiny_cfg, stage="pretrain",
                             loss_chunk=8, microbatches=3)


@pytest.mark.slow
def test_microbatches_give_the_whole_batch_gradient(tiny_cfg, rng):
  """Gradient accumulation over 2 microbatches == one pass over the batch (float32)."""
  cfg = tiny_cfg.replace(num_hidden_layers=2, first_k_dense_replace=1, mtp_num_steps=1)
  params = gnn.init_params(cfg, 0)
  batch = _packed_batch(rng)
  run = lambda m: jax.jit(functools.partial(
      step_lib.grads_and_parts, cfg=cfg, stage="pretrain", loss_chunk=8,
      microbatches=m))(params, batch)
  g1, p1, l1 = run(1)
  g2, p2, l2 = run(2)
  _assert_trees_close(p2, p1, atol=1e-6)
  _assert_trees_close(l2, l1, atol=1e-7)
  _assert_trees_close(g2, g1, atol=1e-7)


@pytest.mark.slow
def test_microbatched_train_step_equals_the_whole_batch_step(tiny_cfg, tiny_params, rng):
  """Params (incl. the routing biases) and metrics after one Muon Split step of dsa_sparse
  (LM + MTP + indexer KL, all parameters train): microbatches=2 equals microbatches=1 to
  1e-5. ~3.5 min here under load (two compiles of the full step)."""
  stage = "dsa_sparse"
  c = ml_collections.ConfigDict(dict(
      stage=stage, optimizer="muon_split", learning_rate=1e-2, adam_learning_rate=0.0,
      warmup_steps=0, total_steps=10, final_lr_fraction=0.1, weight_decay=0.1, grad_clip=1.0))
  tx = step_lib.make_optimizer(c)
  state = step_lib.TrainState(jnp.zeros((), jnp.int32), tiny_params, tx.init(tiny_params),
                              jnp.zeros((2,), jnp.uint32))
  batch = _packed_batch(rng)
  run = lambda m: jax.jit(functools.partial(step_lib.train_step, cfg=tiny_cfg, stage=stage,
                                            tx=tx, loss_chunk=8, bias_rate=1e-3,
                                            microbatches=m))(state, batch)
  s1, m1 = run(1)
  s2, m2 = run(2)
  assert any(bool(jnp.any(a != b)) for a, b in zip(jax.tree_util.tree_leaves(s1.params),
                                                   jax.tree_util.tree_leaves(tiny_params)))
  _assert_trees_close(s2.params, s1.params, atol=1e-5)
  _assert_trees_close(m2, m1, atol=1e-5)


def _opt_config(optimizer, stage="pretrain"):
  return ml_collections.ConfigDict(dict(
      stage=stage, optimizer=optimizer, learning_rate=1e-2, adam_learning_rate=0.0,
      warmup_steps=0, total_steps=10, final_lr_fraction=0.1, weight_decay=0.1, grad_clip=1.0))


def _one_layer_params(rng):
  """The tiny preset's tree cut to one dense layer without MTP (short compiles), random."""
  shapes = gnn.abstract_params(config_lib.get_preset("tiny", num_hidden_layers=1,
                                                     num_nextn_predict_layers=0))[0]
  return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), shapes)


@pytest.mark.slow  # CI time budget
def test_muon_differs_from_muon_split_only_on_the_up_projections(rng):
  """config.optimizer="muon": whole-matrix Newton–Schulz on W^UQ/W^UK/W^UV (wq_b, w_uk, w_uv);
  every other leaf gets Muon Split's update."""
  params = _one_layer_params(rng)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
  ups = {}
  for name in ("muon", "muon_split"):
    tx = step_lib.make_optimizer(_opt_config(name))
    ups[name], _ = jax.jit(tx.update)(grads, tx.init(params), params)
  diff = _changed(ups["muon"], ups["muon_split"])
  groups = jax.tree_util.tree_flatten_with_path(optim.param_groups(params))[0]
  up_proj = {jax.tree_util.keystr(p) for p, g in groups if g == "muon_split"}
  assert {k.split("'")[-2] for k in up_proj} == {"wq_b", "w_uk", "w_uv"}
  assert all(diff[k] for k in up_proj)
  assert not any(v for k, v in diff.items() if k not in up_proj)
  assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(ups["muon"]))


def test_adamw_decays_matrices_but_not_norm_scales(rng):
  """With zero gradients AdamW's update is the decoupled weight decay alone: -lr * wd * W on
  matrices, 0 on norm scales and biases (as Muon Split's AdamW group)."""
  params = _one_layer_params(rng)
  tx = step_lib.make_optimizer(_opt_config("adamw"))
  zeros = jax.tree.map(jnp.zeros_like, params)
  up, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  np.testing.assert_allclose(up["embed"]["embedding"], -1e-2 * 0.1 * params["embed"]["embedding"],
                             rtol=1e-6)
  norms = [u for (p, u) in jax.tree_util.tree_flatten_with_path(up)[0]
           if "norm" in jax.tree_util.keystr(p)]
  assert norms and all(not np.any(np.asarray(u)) for u in norms)


def test_an_unknown_optimizer_is_refused_with_the_allowed_values():
  with pytest.raises(ValueError, match=r"config.optimizer='sgd': expected one of "
                                       r"\('muon_split', 'muon', 'adamw'\)"):
    step_lib.make_optimizer(_opt_config("sgd"))
