"""ModelConfig: presets, HF round trip, validation errors that name the field."""

import dataclasses

import pytest

from glm5_jax import config as config_lib
from glm5_jax.config import ModelConfig


def test_glm5_preset_has_the_real_values():
  c = config_lib.get_preset("glm5")
  assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (154880, 6144, 78)
  assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (64, 2048, 512)
  assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.qk_head_dim) == (192, 64, 256, 256)
  assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (32, 128, 2048)
  assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts) == (256, 8, 1)
  assert (c.n_group, c.topk_group, c.routed_scaling_factor) == (1, 1, 2.5)
  assert c.first_k_dense_replace == 3 and c.max_position_embeddings == 202752
  assert c.indexer_rope_interleave and c.rope_theta == 1e6 and c.mtp_num_steps == 3
  assert c.softmax_scale == 1 / 16


@pytest.mark.parametrize("name", config_lib.preset_names())
def test_hf_round_trip(name):
  c = config_lib.get_preset(name)
  back = ModelConfig.from_hf(c.to_hf())
  assert back.to_hf() == c.to_hf()
  assert back.replace(attention_chunk_size=c.attention_chunk_size) == c


def test_deepseek_v32_variant_is_expressible():
  c = config_lib.get_preset("tiny", indexer_rope_interleave=False, n_routed_experts=8, n_group=4,
                            topk_group=2)
  assert not c.indexer_rope_interleave and c.n_group == 4
  hf = dict(c.to_hf(), model_type="deepseek_v32")
  del hf["indexer_rope_interleave"]
  assert ModelConfig.from_hf(hf).indexer_rope_interleave is False


@pytest.mark.parametrize("field,value,match", [
    ("qk_rope_head_dim", 7, "qk_rope_head_dim=7"),
    ("num_experts_per_tok", 9, "num_experts_per_tok=9"),
    ("n_group", 3, "n_routed_experts=8"),
    ("topk_group", 2, "topk_group=2"),
    ("index_topk", 0, "index_topk=0"),
    ("attention_impl", "cuda", "attention_impl='cuda'.*'xla', 'pallas'"),
    ("dtype", "int8", "dtype='int8'"),
    ("num_key_value_heads", 2, "num_key_value_heads=2"),
    ("index_head_dim", 4, "index_head_dim=4"),
])
def test_invalid_values_name_the_field(field, value, match):
  with pytest.raises(ValueError, match=match):
    config_lib.get_preset("tiny", **{field: value})


def test_unknown_field_and_preset_fail_clearly():
  with pytest.raises(ValueError, match="no field.*'not_a_field'"):
    config_lib.get_preset("tiny", not_a_field=1)
  with pytest.raises(ValueError, match="preset 'huge' is unknown"):
    config_lib.get_preset("huge")


def test_from_hf_rejects_other_models_and_yarn():
  hf = config_lib.get_preset("tiny").to_hf()
  with pytest.raises(ValueError, match="model_type='llama'"):
    ModelConfig.from_hf(dict(hf, model_type="llama"))
  with pytest.raises(ValueError, match="rope_type='yarn'"):
    ModelConfig.from_hf(dict(hf, rope_parameters={"rope_type": "yarn", "factor": 40}))


def test_config_is_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    config_lib.get_preset("tiny").hidden_size = 3
