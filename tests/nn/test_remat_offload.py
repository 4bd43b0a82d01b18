"""Remat policies that offload activations to host memory (glm5_jax/nn/decoder.py).

`offload_inputs` / `offload_inputs_attention` save the decoder layer's marked values
("decoder_layer_input", "attention_out") in host memory and recompute the rest: the same
function as `full` remat, so the gradients agree to float32 rounding (1e-6 relative; the
values are recomputed by the same ops, only where they are stored differs). On the CPU
backend host and device memory are the same RAM: the residuals are placed in host memory in
the program (`f32<host>` in the jaxpr) and the lowering has nothing to move.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import losses
from glm5_jax import nn as gnn
from glm5_jax.nn import decoder


def _loss(cfg, tokens):
  def f(params):
    out = gnn.GLM5(cfg).apply({"params": params}, tokens, mtp=False)
    y, m = losses.next_token_targets(tokens)
    return losses.cross_entropy(out.logits, y, m)[0]
  return f


@pytest.fixture(scope="module")
def cfg(tiny_cfg):
  """Two MoE layers in one scanned stack, no MTP: one layer body to compile."""
  return tiny_cfg.replace(num_hidden_layers=2, first_k_dense_replace=0,
                          num_nextn_predict_layers=0, mtp_num_steps=0)


@pytest.fixture(scope="module")
def params(cfg):
  return gnn.init_params(cfg, 0)


@pytest.fixture(scope="module")
def full_grads(cfg, params, tiny_tokens):
  return jax.jit(jax.grad(_loss(cfg.replace(remat="full"), tiny_tokens)))(params)


def test_every_remat_name_has_a_policy():
  from glm5_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  assert set(config_lib._REMAT) == set(decoder.REMAT_POLICIES) | {"none"}


@pytest.mark.parametrize("policy", [pytest.param("offload_inputs", marks=pytest.mark.slow),
                                    "offload_inputs_attention"])
def test_offload_policy_gradients_equal_full_remat(cfg, params, tiny_tokens, full_grads,
                                                   policy):
  f = _loss(cfg.replace(remat=policy), tiny_tokens)
  assert "<host>" in str(jax.make_jaxpr(jax.grad(f))(params))   # residuals on the host
  got = jax.jit(jax.grad(f))(params)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                          jax.tree.leaves(full_grads)):
    scale = float(jnp.max(jnp.abs(b))) + 1e-30
    np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, rtol=0, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


def test_full_remat_keeps_no_residual_on_the_host(cfg, params, tiny_tokens):
  f = _loss(cfg.replace(remat="full"), tiny_tokens)
  assert "<host>" not in str(jax.make_jaxpr(jax.grad(f))(params))
