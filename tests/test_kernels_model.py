"""The tiny GLM-5 with `attention_impl="pallas"` (kernels in interpret mode) equals "xla".

Design.md decision 4: one attention function, several implementations; the
model must not notice which one runs. The tiny preset selects index_topk=8 of
24 positions, so the indexer kernel's selection and the sparse-attention
kernels both decide the result; the top-k indices must be identical and the
logits equal to float32 rounding (1e-5 of their magnitude).
"""

import jax
import jax.numpy as jnp
import numpy as np

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


def test_pallas_logits_equal_xla_logits_on_packed_rows(tiny_cfg, tiny_params, tiny_tokens):
  # Two documents per row: the indexer kernel path must respect document starts.
  segment_ids = jnp.asarray(np.repeat([[0] * 10 + [1] * 14], tiny_tokens.shape[0], 0), jnp.int32)
  _assert_same_model_output(tiny_cfg, tiny_params, tiny_tokens, segment_ids)
