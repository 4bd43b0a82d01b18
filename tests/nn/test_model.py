"""The GLM5 forward pass: outputs, MTP weight sharing, chunked CE, logical axes, errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import losses
from glm5_jax import nn as gnn
from glm5_jax.nn import layer_io
from glm5_jax.nn import mtp as mtp_lib
from glm5_jax.nn import rope


def test_output_shapes_and_dtypes(tiny_cfg, tiny_params, tiny_tokens, tiny_forward):
  out = tiny_forward(tiny_params, tiny_tokens)
  b, t = tiny_tokens.shape
  assert out.logits.shape == (b, t, tiny_cfg.vocab_size) and out.logits.dtype == jnp.float32
  assert out.mtp_logits.shape == (3, b, t, tiny_cfg.vocab_size)
  assert out.indexer_kl.shape == (tiny_cfg.num_hidden_layers,)
  assert out.expert_load.shape == (2, tiny_cfg.n_routed_experts)
  np.testing.assert_allclose(out.expert_load.sum(-1), 1.0, rtol=1e-6)
  assert out.topk_indices[0].shape == (b, t, tiny_cfg.index_topk)
  assert np.all(np.isfinite(out.logits)) and np.all(np.asarray(out.indexer_kl) >= 0)


@pytest.mark.slow   # ~15 s; CI time budget
def test_mtp_has_one_module_applied_three_times(tiny_cfg, tiny_params, tiny_tokens, tiny_forward):
  assert set(tiny_params["mtp"]) == {"enorm", "hnorm", "eh_proj", "layer", "head_norm"}
  out = tiny_forward(tiny_params, tiny_tokens)
  # Plain loop over ONE MTPStep module with the stored weights.
  model = gnn.GLM5(tiny_cfg)
  h_final = model.apply({"params": tiny_params}, tiny_tokens, mtp=False,
                        capture_intermediates=lambda m, _: m.name == "moe_layers",  # per repeat
                        mutable=["intermediates"])[1]["intermediates"]["moe_layers"]["__call__"][0][0][0][-1]
  b, t = tiny_tokens.shape
  cos, sin = rope.rope_angles(jnp.broadcast_to(jnp.arange(t), (b, t)), tiny_cfg.qk_rope_head_dim,
                              tiny_cfg.rope_theta)
  step = mtp_lib.MTPStep(tiny_cfg)
  emb = tiny_params["embed"]["embedding"]
  h = h_final
  for k in range(1, 4):
    e = jnp.take(emb, mtp_lib.shift_tokens(tiny_tokens, k), axis=0)
    h, normed, *_ = step.apply({"params": tiny_params["mtp"]}, e, h, layer_io.LayerInputs(cos, sin))
    np.testing.assert_allclose(normed @ tiny_params["lm_head"]["kernel"], out.mtp_logits[k - 1],
                               rtol=2e-4, atol=2e-4)


@pytest.mark.slow  # CI time budget
def test_hidden_with_chunked_ce_equals_logits_ce(tiny_cfg, tiny_params, tiny_tokens):
  out = gnn.GLM5(tiny_cfg).apply({"params": tiny_params}, tiny_tokens, return_logits=False, mtp=False)
  assert out.logits is None and out.mtp_logits is None
  y, m = losses.next_token_targets(tiny_tokens)
  chunked, _ = losses.chunked_cross_entropy(out.hidden, tiny_params["lm_head"]["kernel"], y, m,
                                            chunk_size=5)
  full, _ = losses.cross_entropy(out.hidden @ tiny_params["lm_head"]["kernel"], y, m)
  np.testing.assert_allclose(chunked, full, rtol=1e-5)


@pytest.mark.slow  # CI time budget (test_hf's topk_above_seq case checks it against HF)
def test_dense_attention_equals_sparse_when_topk_covers_the_sequence(tiny_cfg, tiny_params, tiny_tokens):
  cfg = tiny_cfg.replace(index_topk=64)
  sparse = gnn.GLM5(cfg).apply({"params": tiny_params}, tiny_tokens, mtp=False).logits
  dense = gnn.GLM5(cfg.replace(attention_type="dense")).apply(
      {"params": tiny_params}, tiny_tokens, mtp=False).logits
  np.testing.assert_allclose(sparse, dense, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny", "glm5"])
def test_every_param_has_logical_axis_names(preset):
  cfg = config_lib.get_preset(preset)
  shapes, specs = gnn.abstract_params(cfg)
  flat_shapes = jax.tree_util.tree_leaves(shapes)
  flat_specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  assert len(flat_shapes) == len(flat_specs)
  for s, p in zip(flat_shapes, flat_specs):
    assert len(p) == len(s.shape) and all(isinstance(a, str) for a in p)


def test_too_long_sequence_names_the_limit(tiny_cfg, tiny_params):
  cfg = tiny_cfg.replace(max_position_embeddings=16)
  with pytest.raises(ValueError, match="max_position_embeddings=16"):
    gnn.GLM5(cfg).apply({"params": tiny_params}, jnp.zeros((1, 17), jnp.int32))
  with pytest.raises(ValueError, match="tokens: expected an integer dtype"):
    gnn.GLM5(cfg).apply({"params": tiny_params}, jnp.zeros((1, 4)))


@pytest.mark.slow
def test_remat_gives_the_same_gradients(tiny_cfg, tiny_params, tiny_tokens):
  def loss(cfg):
    def f(p):
      out = gnn.GLM5(cfg).apply({"params": p}, tiny_tokens, mtp=False)
      y, m = losses.next_token_targets(tiny_tokens)
      return losses.cross_entropy(out.logits, y, m)[0]
    return jax.jit(jax.grad(f))(tiny_params)
  a, b = loss(tiny_cfg), loss(tiny_cfg.replace(remat="full"))
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_host_init_follows_the_flax_initializers(tiny_cfg):
  cfg = tiny_cfg.replace(num_hidden_layers=2, num_nextn_predict_layers=0, mtp_num_steps=0)
  flax_p = gnn.init_params(cfg, 1, on_host=False)
  host_p = gnn.init_params(cfg, 1)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(flax_p)[0], jax.tree_util.tree_leaves(host_p)):
    assert a.shape == b.shape and a.dtype == b.dtype, path
    if float(jnp.std(a)) == 0.0:
      np.testing.assert_array_equal(a, b)             # ones / zeros exactly
    else:
      assert float(jnp.std(b)) == pytest.approx(float(jnp.std(a)), rel=0.5), path
