"""The decode step's memory floor (glm5_jax/inference/roofline.py) against counts made by
hand from the config's shapes."""

import jax
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax import quant
from glm5_jax.inference import roofline


@pytest.fixture(scope="module")
def tiny():
  cfg = config_lib.get_preset("tiny")
  return cfg, jax.eval_shape(lambda: gnn.init_params(cfg, 0))


def _by_hand(cfg, batch, used, context, expert_bytes):
  d, v, e = cfg.hidden_size, cfg.vocab_size, cfg.n_routed_experts
  n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
  total = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: gnn.init_params(cfg, 0))))
  mtp_cfg = cfg.replace(num_nextn_predict_layers=0)
  no_mtp = sum(x.size for x in jax.tree.leaves(
      jax.eval_shape(lambda: gnn.init_params(mtp_cfg, 0))))
  del total
  experts = n_moe * e * 3 * d * cfg.moe_intermediate_size
  weights = (no_mtp - experts - v * d) * 4 + batch * d * 4
  rows = min(context, cfg.index_topk)
  kv = batch * cfg.num_hidden_layers * (context * cfg.index_head_dim * 4 + rows * (
      cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4)
  return weights, used * expert_bytes, kv


@pytest.mark.parametrize("batch,used,context", [(1, 2, 5), (4, 7, 300)])
def test_decode_bytes_float32_by_hand(tiny, batch, used, context):
  cfg, params = tiny
  got = roofline.decode_bytes(cfg, params, used, [context] * batch)
  d, i = cfg.hidden_size, cfg.moe_intermediate_size
  want = _by_hand(cfg, batch, used, context, 3 * d * i * 4)
  assert (got["weights"], got["experts"], got["kv"]) == want
  assert got["total"] == sum(want)


def test_decode_bytes_of_int4_experts_count_packed_values_and_scales(tiny):
  cfg, params = tiny
  g = 16
  q = quant.quantize_tree(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), params),
                          quant.Scheme("int4", g, "experts"))
  got = roofline.decode_bytes(cfg, q, 3, [10])
  d, i = cfg.hidden_size, cfg.moe_intermediate_size
  one = 2 * (d // 2 * i + d // g * i * 4) + (i // 2 * d + i // g * d * 4)   # gate, up; down
  assert got["experts"] == 3 * one
  assert got["weights"] == roofline.decode_bytes(cfg, params, 3, [10])["weights"]


def test_dense_attention_reads_every_row_and_bad_counts_are_refused(tiny):
  cfg, params = tiny
  dense = cfg.replace(attention_type="dense")
  row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
  assert roofline.kv_bytes(dense, 1000, 4) == cfg.num_hidden_layers * 1000 * row
  n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
  with pytest.raises(ValueError, match="experts_used"):
    roofline.decode_bytes(cfg, params, n_moe * cfg.n_routed_experts + 1, [1])


def test_distinct_experts_is_the_union_per_layer():
  a = np.array([[0, 1], [2, 3]])                      # [L_moe=2, K=2]
  b = np.array([[1, 4], [2, 3]])
  assert roofline.distinct_experts([a, b]) == 3 + 2
  assert roofline.distinct_experts([a]) == 4
