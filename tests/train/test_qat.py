"""INT4 quantization-aware training (config.qat, train/step.py): the forward is the quantized
model's, the gradient reaches the float32 master weights straight through."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import pretrain as pretrain_config
from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax import quant
from glm5_jax.train import checks
from glm5_jax.train import step as step_lib


def _sft_config(**qat):
  c = pretrain_config.get_config("model=tiny,stage=sft,runlocal=True")
  c.qat.update(bits=4, **qat)
  return c


def test_qat_loss_is_the_quantized_models_and_its_gradient_passes_straight_through(rng):
  cfg = config_lib.get_preset("tiny", attention_type="sparse", num_hidden_layers=2,
                              num_nextn_predict_layers=0, mtp_num_steps=0)
  params = gnn.init_params(cfg, 0)
  scheme = step_lib.qat_scheme(_sft_config())
  assert scheme == quant.Scheme("int4", 32, "experts")
  t = 16
  batch = {"tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (2, t)), jnp.int32),
           "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t)),
           "segment_ids": jnp.ones((2, t), jnp.int32),
           "loss_mask": jnp.asarray(rng.integers(0, 2, (2, t)), jnp.float32)}
  loss = lambda p, q=None: step_lib.loss_fn(p, batch, cfg=cfg, stage="sft", loss_chunk=8,
                                            qat=q)[0]

  @jax.jit
  def both(p):
    quantized = quant.fake_quant_tree(p, scheme)
    return (jax.value_and_grad(lambda w: loss(w, scheme))(p),
            jax.value_and_grad(loss)(quantized), loss(p))
  (l_qat, g_qat), (l_q, g_q), l_float = both(params)
  # The forward used the quantized weights; the gradient at them reaches the float32 master
  # weights unchanged (straight through).
  assert float(l_qat) == float(l_q) and float(l_qat) != float(l_float)
  for a, b in zip(jax.tree.leaves(g_qat), jax.tree.leaves(g_q)):
    np.testing.assert_array_equal(a, b)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g_qat))


@pytest.mark.parametrize("stage,qat,match", [
    ("dsa_warmup", {}, r"stage='dsa_warmup'.*trains none of the targeted"),
    ("sft", {"targets": "attention"}, r"config.qat.group_size=32.*w_uk"),
])
def test_qat_that_cannot_apply_is_refused_naming_the_fields(stage, qat, match):
  cfg = config_lib.get_preset("tiny")
  shapes, _ = gnn.abstract_params(cfg)
  c = _sft_config(**qat)
  c.stage = stage
  with pytest.raises(ValueError, match=match):
    step_lib.check_qat(c, shapes)


@pytest.mark.parametrize("field,value", [("bits", 8), ("group_size", 3), ("targets", "heads")])
def test_qat_fields_are_checked(field, value):
  c = _sft_config()
  c.qat[field] = value
  with pytest.raises(ValueError, match=f"config.qat.{field}="):
    checks.validate(c)
