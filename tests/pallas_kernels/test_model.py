"""The tiny GLM-5 with `attention_impl="pallas"` (kernels in interpret mode) equals "xla".

docs/design.md decision 4: one attention function, several implementations; the
model must not notice which one runs. The tiny preset selects index_topk=8 of
24 positions, so the indexer kernel's selection and the sparse-attention
kernels both decide the result; the top-k indices must be identical, the
logits equal to float32 rounding (1e-5 of their magnitude) and the gradients
to 1e-4. On a CPU host the model (`interpret=None`) runs the Triton kernels in
the Pallas interpreter; the TPU kernels are tested op by op in interpret mode
and compiled inside the model by tests/pallas_kernels/test_aot.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import nn as gnn
from pallas_kernels import testing


def _forward(cfg, params, tokens, segment_ids=None):
  model = gnn.GLM5(cfg)
  fn = jax.jit(lambda p, t, s: model.apply({"params": p}, t, segment_ids=s, return_topk=True,
                                           mtp=False))
  return fn(params, tokens, segment_ids)


def _assert_same_model_output(cfg, params, tokens, segment_ids=None):
  want = _forward(cfg.replace(attention_impl="xla"), params, tokens, segment_ids)
  got = _forward(cfg.replace(attention_impl="pallas"), params, tokens, segment_ids)
  for layer, (g, w) in enumerate(zip(got.topk_indices, want.topk_indices)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"layer {layer}")
  testing.assert_rel_close(got.logits, want.logits, 1e-5, "logits")


def test_pallas_logits_equal_xla_logits(tiny_cfg, tiny_params, tiny_tokens):
  assert tiny_cfg.attention_type == "sparse" and tiny_cfg.index_topk < tiny_tokens.shape[1]
  _assert_same_model_output(tiny_cfg, tiny_params, tiny_tokens)


@pytest.mark.slow  # CI time budget
def test_pallas_logits_equal_xla_logits_on_packed_rows(tiny_cfg, tiny_params, tiny_tokens):
  # Two documents per row: the indexer kernel path must respect document starts.
  segment_ids = jnp.asarray(np.repeat([[0] * 10 + [1] * 14], tiny_tokens.shape[0], 0), jnp.int32)
  _assert_same_model_output(tiny_cfg, tiny_params, tiny_tokens, segment_ids)


def _loss_fn(cfg, tokens):
  """A loss touching every output the trainer uses: LM and MTP logits, indexer KL."""
  model = gnn.GLM5(cfg)

  def loss(p):
    out = model.apply({"params": p}, tokens, with_indexer_loss=True)
    lm = jnp.mean(jax.nn.log_softmax(out.logits)[..., 0])
    return lm + jnp.mean(out.mtp_logits) * 1e-2 + jnp.sum(out.indexer_kl)
  return loss


@pytest.mark.slow
def test_pallas_gradients_equal_xla_gradients(tiny_cfg, tiny_params, tiny_tokens):
  # The training path: the loss (LM + MTP + indexer KL) differentiated through both kernels
  # (the indexer's pallas_call has no JVP rule: its inputs must be cut from autodiff).
  def loss_and_grads(cfg):
    return jax.jit(jax.value_and_grad(_loss_fn(cfg, tiny_tokens)))(tiny_params)

  want_loss, want = loss_and_grads(tiny_cfg.replace(attention_impl="xla"))
  got_loss, got = loss_and_grads(tiny_cfg.replace(attention_impl="pallas"))
  testing.assert_rel_close(got_loss, want_loss, 1e-5, "loss")
  flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
  for path, g in jax.tree_util.tree_leaves_with_path(got):
    testing.assert_rel_close(g, flat_want[path], 1e-4, jax.tree_util.keystr(path))
