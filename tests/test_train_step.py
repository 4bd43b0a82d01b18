"""One train step per stage: which parameters move (optax masks) and the routing-bias update."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

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
