"""ModelConfig: the GLM-5 architecture as one frozen, validated dataclass.

Field names follow the Hugging Face `glm_moe_dsa` config (the released GLM-5 checkpoint's
`config.json`) so that `from_hf` / `to_hf` are near-identity maps; the fields after
`# --- ours` are glm5-jax settings that have no HF counterpart.

Presets (`get_preset(name)`):
  glm5   the real 744B-A40B configuration (its released `config.json`).
  mid    GLM-5's per-layer shapes (hidden 6144, 64 heads, MLA ranks, indexer, top-k 2048,
         expert width) with 4 layers (1 dense + 3 MoE), 16 routed experts (8 per token), a
         32K vocabulary and no MTP layer: 3.25B parameters, for one-accelerator benchmarks
         (experiments/bench_train_mfu.py, bench_decode_step.py).
  small  a ~100M-parameter config for CPU benchmarks.
  tiny   a few-hundred-K-parameter config for CPU tests and the main job; its vocabulary (384,
         a multiple of 128) holds the byte tokenizer's 256 bytes and GLM's special tokens.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

_DTYPES = ("float32", "bfloat16", "float16", "float64")
_ATTENTION_IMPLS = ("xla", "pallas")
_ATTENTION_TYPES = ("sparse", "dense")
_DENSE_ATTENTION_FORMS = ("expanded", "absorbed")
_REMAT = ("none", "full", "save_dots", "offload_inputs", "offload_inputs_attention")
_EXPERT_DISPATCH = ("all_to_all", "gspmd")
_INDEXER_TYPES = ("full", "shared")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """GLM-5 model hyper-parameters. Defaults are the real GLM-5 (744B) values."""

  # --- Hugging Face `glm_moe_dsa` fields.
  vocab_size: int = 154880
  hidden_size: int = 6144
  intermediate_size: int = 12288          # dense-layer SwiGLU width
  moe_intermediate_size: int = 2048       # routed and shared expert width
  num_hidden_layers: int = 78
  num_attention_heads: int = 64
  num_key_value_heads: int = 64           # MLA: always == num_attention_heads
  q_lora_rank: int = 2048
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 192
  qk_rope_head_dim: int = 64
  v_head_dim: int = 256
  index_n_heads: int = 32
  index_head_dim: int = 128
  index_topk: int = 2048
  indexer_types: tuple[str, ...] | None = None  # None -> every layer "full"
  indexer_rope_interleave: bool = True    # GLM-5: True; DeepSeek-V3.2: False
  rope_interleave: bool = True            # MLA RoPE pairing
  rope_theta: float = 1_000_000.0
  n_routed_experts: int = 256
  n_shared_experts: int = 1
  num_experts_per_tok: int = 8
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 2.5
  norm_topk_prob: bool = True
  scoring_func: str = "sigmoid"
  topk_method: str = "noaux_tc"
  first_k_dense_replace: int = 3
  hidden_act: str = "silu"
  rms_norm_eps: float = 1e-5
  max_position_embeddings: int = 202752
  num_nextn_predict_layers: int = 1
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  initializer_range: float = 0.02
  bos_token_id: int | None = 0
  eos_token_id: int | tuple[int, ...] | None = (154820, 154827, 154829)
  pad_token_id: int | None = None

  # --- ours
  mtp_num_steps: int = 3                  # shared-weight MTP steps (paper: 3)
  mtp_loss_weight: float = 0.3            # lambda (DeepSeek-V3: 0.3 then 0.1)
  indexer_loss_coeff: float = 1e-3        # Megatron-Bridge GLM-5 default
  attention_type: str = "sparse"          # "sparse" (DSA top-k) | "dense" (warm-up)
  attention_impl: str = "xla"             # "xla" | "pallas"
  attention_chunk_size: int = 512         # query chunk of the jnp indexer/sparse path; query
                                          # and key block of dense attention + its indexer KL
  dense_attention_form: str = "expanded"  # training's dense MLA attention: "expanded" (per-head
                                          # keys and values for all s keys) | "absorbed" (MQA
                                          # over the latent rows: keys / values about h x
                                          # smaller, wider dots;
                                          # long context, nn/mla.py mla_dense_attention)
  dtype: str = "float32"                  # activation / compute dtype
  param_dtype: str = "float32"            # master weights
  remat: str = "none"                     # "none" | "full" | "save_dots" | "offload_inputs"
                                          # | "offload_inputs_attention" (nn/decoder.py)
  expert_dispatch: str = "all_to_all"     # with a mesh whose `expert` axis > 1 (nn/moe_ep.py);
                                          # "gspmd" leaves the dispatch to the partitioner
  moe_capacity_factor: float = 0.0        # all_to_all: 0 = dropless; c > 0 = at most
                                          # ceil(c n K / ep) rows per shard pair, rest dropped

  def __post_init__(self):
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
    if self.indexer_types is not None:
      object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
    _validate(self)

  # ---- derived quantities
  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def softmax_scale(self) -> float:
    """MLA logit scale (qk_nope + qk_rope) ** -0.5; GLM-5 has no YaRN mscale."""
    return self.qk_head_dim ** -0.5

  @property
  def has_mtp(self) -> bool:
    return self.num_nextn_predict_layers > 0 and self.mtp_num_steps > 0

  def is_moe_layer(self, i: int) -> bool:
    """Layer i uses the MoE FFN (the MTP layer, index num_hidden_layers, is MoE too)."""
    return i >= self.first_k_dense_replace

  def indexer_type(self, i: int) -> str:
    if self.indexer_types is None or i >= len(self.indexer_types):
      return "full"
    return self.indexer_types[i]

  def replace(self, **kw) -> "ModelConfig":
    unknown = sorted(set(kw) - {f.name for f in dataclasses.fields(self)})
    if unknown:
      raise ValueError(f"ModelConfig has no field(s) {unknown}; known fields: "
                       f"{sorted(f.name for f in dataclasses.fields(self))}")
    return dataclasses.replace(self, **kw)

  # ---- Hugging Face conversion (Levanter style: the config owns it)
  @classmethod
  def from_hf(cls, hf: dict[str, Any], **overrides) -> "ModelConfig":
    """Builds a ModelConfig from a `config.json` dict of model_type glm_moe_dsa."""
    model_type = hf.get("model_type")
    if model_type not in ("glm_moe_dsa", "deepseek_v32"):
      raise ValueError(f"config.json model_type={model_type!r}: expected 'glm_moe_dsa' "
                       "(or 'deepseek_v32')")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
      raise ValueError(f"config.json rope_parameters.rope_type={rope_type!r}: only 'default' "
                       "RoPE (GLM-5) is implemented; YaRN is not")
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in hf.items() if k in names and k not in ("dtype",)}
    kw["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 1e6)))
    if model_type == "deepseek_v32":
      kw.setdefault("indexer_rope_interleave", False)
    if "num_local_experts" in hf and "n_routed_experts" not in hf:
      kw["n_routed_experts"] = hf["num_local_experts"]
    if kw.get("indexer_types") is not None:
      kw["indexer_types"] = tuple(kw["indexer_types"])
      if set(kw["indexer_types"]) == {"full"}:
        kw["indexer_types"] = None                    # every layer runs its own indexer
    if kw.get("num_nextn_predict_layers") is None:
      kw["num_nextn_predict_layers"] = 0
    if kw["num_nextn_predict_layers"] == 0:
      kw.setdefault("mtp_num_steps", 0)
    kw.update(overrides)
    cfg = cls(**kw)
    layer_types = hf.get("mlp_layer_types")
    expected = ["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.num_hidden_layers)]
    if layer_types is not None and list(layer_types) != expected:
      raise ValueError(f"config.json mlp_layer_types={layer_types}: only the pattern "
                       f"first_k_dense_replace={cfg.first_k_dense_replace} dense layers then MoE "
                       f"is supported ({expected})")
    return cfg

  def to_hf(self) -> dict[str, Any]:
    """A `config.json` dict that transformers' GlmMoeDsaConfig loads."""
    n = self.num_hidden_layers
    eos = self.eos_token_id
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "moe_intermediate_size": self.moe_intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads,
        "q_lora_rank": self.q_lora_rank,
        "kv_lora_rank": self.kv_lora_rank,
        "qk_nope_head_dim": self.qk_nope_head_dim,
        "qk_rope_head_dim": self.qk_rope_head_dim,
        "head_dim": self.qk_rope_head_dim,
        "v_head_dim": self.v_head_dim,
        "index_n_heads": self.index_n_heads,
        "index_head_dim": self.index_head_dim,
        "index_topk": self.index_topk,
        "indexer_types": list(self.indexer_types or ["full"] * n),
        "indexer_rope_interleave": self.indexer_rope_interleave,
        "rope_interleave": self.rope_interleave,
        "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
        "n_routed_experts": self.n_routed_experts,
        "n_shared_experts": self.n_shared_experts,
        "num_experts_per_tok": self.num_experts_per_tok,
        "n_group": self.n_group,
        "topk_group": self.topk_group,
        "routed_scaling_factor": self.routed_scaling_factor,
        "norm_topk_prob": self.norm_topk_prob,
        "scoring_func": self.scoring_func,
        "topk_method": self.topk_method,
        "first_k_dense_replace": self.first_k_dense_replace,
        "mlp_layer_types": ["dense" if not self.is_moe_layer(i) else "sparse" for i in range(n)],
        "hidden_act": self.hidden_act,
        "rms_norm_eps": self.rms_norm_eps,
        "max_position_embeddings": self.max_position_embeddings,
        "num_nextn_predict_layers": self.num_nextn_predict_layers,
        "tie_word_embeddings": self.tie_word_embeddings,
        "attention_bias": self.attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": self.initializer_range,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        "pad_token_id": self.pad_token_id,
        "dtype": self.param_dtype,
    }


def _err(field: str, value, expected: str):
  raise ValueError(f"ModelConfig.{field}={value!r}: {expected}")


def _validate(c: ModelConfig) -> None:
  positive = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
              "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
              "index_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group",
              "topk_group", "max_position_embeddings", "attention_chunk_size")
  for f in positive:
    v = getattr(c, f)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      _err(f, v, "expected a positive integer")
  if not isinstance(c.index_topk, int) or isinstance(c.index_topk, bool) or c.index_topk < 1:
    _err("index_topk", c.index_topk, "expected an integer >= 1 (a value above the number of "
         "keys is clamped to it, nn/indexer.py num_slots)")
  if c.qk_rope_head_dim % 2:
    _err("qk_rope_head_dim", c.qk_rope_head_dim, "RoPE rotates pairs: expected an even number")
  if c.index_head_dim < c.qk_rope_head_dim:
    _err("index_head_dim", c.index_head_dim,
         f"expected >= qk_rope_head_dim ({c.qk_rope_head_dim}): the indexer RoPEs its first "
         "qk_rope_head_dim dims")
  if c.num_key_value_heads != c.num_attention_heads:
    _err("num_key_value_heads", c.num_key_value_heads,
         f"MLA has no GQA: expected num_attention_heads ({c.num_attention_heads})")
  if c.num_experts_per_tok > c.n_routed_experts:
    _err("num_experts_per_tok", c.num_experts_per_tok,
         f"expected <= n_routed_experts ({c.n_routed_experts})")
  if c.n_routed_experts % c.n_group:
    _err("n_routed_experts", c.n_routed_experts, f"expected a multiple of n_group ({c.n_group})")
  if c.topk_group > c.n_group:
    _err("topk_group", c.topk_group, f"expected <= n_group ({c.n_group})")
  if c.n_group > 1:
    per_group = c.n_routed_experts // c.n_group
    if per_group < 2:
      _err("n_group", c.n_group, "group scores sum each group's top-2 experts: expected "
           ">= 2 experts per group")
    if c.num_experts_per_tok > c.topk_group * per_group:
      _err("num_experts_per_tok", c.num_experts_per_tok,
           f"expected <= topk_group * experts per group ({c.topk_group * per_group})")
  if not 0 <= c.first_k_dense_replace <= c.num_hidden_layers:
    _err("first_k_dense_replace", c.first_k_dense_replace,
         f"expected in [0, num_hidden_layers={c.num_hidden_layers}]")
  if c.n_shared_experts < 0:
    _err("n_shared_experts", c.n_shared_experts, "expected >= 0")
  if c.num_nextn_predict_layers not in (0, 1):
    _err("num_nextn_predict_layers", c.num_nextn_predict_layers,
         "expected 0 or 1 (GLM-5 stores one MTP layer and shares it over mtp_num_steps)")
  if c.mtp_num_steps < 0:
    _err("mtp_num_steps", c.mtp_num_steps, "expected >= 0")
  if not (isinstance(c.moe_capacity_factor, (int, float)) and c.moe_capacity_factor >= 0):
    _err("moe_capacity_factor", c.moe_capacity_factor,
         "expected a float >= 0 (0 = dropless; GShard / Switch use 1.0-1.25)")
  if c.scoring_func != "sigmoid":
    _err("scoring_func", c.scoring_func, "expected 'sigmoid'")
  if c.topk_method != "noaux_tc":
    _err("topk_method", c.topk_method, "expected 'noaux_tc'")
  if c.hidden_act != "silu":
    _err("hidden_act", c.hidden_act, "expected 'silu'")
  if c.attention_bias:
    _err("attention_bias", c.attention_bias, "GLM-5 has no attention biases: expected False")
  if c.tie_word_embeddings:
    _err("tie_word_embeddings", c.tie_word_embeddings, "GLM-5 unties lm_head: expected False")
  if c.rope_theta <= 0:
    _err("rope_theta", c.rope_theta, "expected > 0")
  if c.indexer_types is not None:
    if len(c.indexer_types) != c.num_hidden_layers:
      _err("indexer_types", c.indexer_types,
           f"expected one entry per layer ({c.num_hidden_layers})")
    bad = sorted(set(c.indexer_types) - set(_INDEXER_TYPES))
    if bad:
      _err("indexer_types", c.indexer_types, f"entries must be in {_INDEXER_TYPES}")
    if c.indexer_types[0] != "full":
      _err("indexer_types", c.indexer_types, "layer 0 must be 'full' (a 'shared' layer reuses "
           "the previous full layer's top-k)")
  for f, allowed in (("attention_type", _ATTENTION_TYPES), ("attention_impl", _ATTENTION_IMPLS),
                     ("dense_attention_form", _DENSE_ATTENTION_FORMS),
                     ("dtype", _DTYPES), ("param_dtype", _DTYPES), ("remat", _REMAT),
                     ("expert_dispatch", _EXPERT_DISPATCH)):
    if getattr(c, f) not in allowed:
      _err(f, getattr(c, f), f"expected one of {allowed}")


# --------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------

# The byte tokenizer's GLM special ids (glm5_jax.data.tokenizers.SPECIAL_TOKENS at 256+): every
# sequence starts with [gMASK] (258); eos is GLM-5's set of turn-ending ids, <|endoftext|> (256),
# <|user|> (263), <|observation|> (265), like the glm5 preset's (154820, 154827, 154829).
_BYTE_CHAT_TOKENS = dict(bos_token_id=258, eos_token_id=(256, 263, 265))

_PRESETS: dict[str, dict[str, Any]] = {
    "glm5": {},
    "mid": dict(vocab_size=32768, num_hidden_layers=4, first_k_dense_replace=1,
                n_routed_experts=16, num_experts_per_tok=8, num_nextn_predict_layers=0,
                mtp_num_steps=0),
    "small": dict(
        vocab_size=32768, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256,
        kv_lora_rank=128, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64,
        index_n_heads=8, index_head_dim=32, index_topk=256, n_routed_experts=32,
        num_experts_per_tok=4, first_k_dense_replace=1, max_position_embeddings=16384,
        **_BYTE_CHAT_TOKENS),
    "tiny": dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        index_n_heads=4, index_head_dim=16, index_topk=8, n_routed_experts=8,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=4096,
        rope_theta=10000.0, attention_chunk_size=64, **_BYTE_CHAT_TOKENS),
}


_HOW_NOT_WHAT = ("attention_type", "attention_impl", "attention_chunk_size", "remat", "dtype",
                 "expert_dispatch", "moe_capacity_factor")  # how a model runs, not which
                                                            # model it is


def model_fields(cfg) -> dict:
  """The ModelConfig fields that define the model (JSON-ready)."""
  return json.loads(json.dumps({k: v for k, v in dataclasses.asdict(cfg).items()
                                if k not in _HOW_NOT_WHAT}))


def model_diff(old: dict, now: dict) -> dict:
  """{field: (old, now)} where two `model_fields` differ."""
  return {k: (old.get(k), now.get(k)) for k in set(old) | set(now) if old.get(k) != now.get(k)}


def preset_names() -> Sequence[str]:
  return tuple(_PRESETS)


def get_preset(name: str, **overrides) -> ModelConfig:
  """Returns a preset ModelConfig (`glm5`, `small`, `tiny`), with field overrides."""
  if name not in _PRESETS:
    raise ValueError(f"model preset {name!r} is unknown; expected one of {preset_names()}")
  return ModelConfig().replace(**{**_PRESETS[name], **overrides})


def preset_config_dict(name: str):
  """An ml_collections ConfigDict of every ModelConfig field of preset `name` (plus `preset`).

  Config files put it under `config.model`, so any field is overridable from the
  command line: `--config.model.index_topk=64`.
  """
  import ml_collections  # pylint: disable=g-import-not-at-top
  fields = dataclasses.asdict(get_preset(name))
  fields = {k: (list(v) if isinstance(v, tuple) else v) for k, v in fields.items()
            if v is not None}
  return ml_collections.ConfigDict({"preset": name, **fields})


def from_config_dict(cd) -> ModelConfig:
  """Builds a ModelConfig from an ml_collections ConfigDict `model` section.

  The section holds `preset` plus any field overrides, e.g.
  `config.model = ConfigDict(dict(preset="tiny", index_topk=4))`.
  """
  d = dict(cd.to_dict() if hasattr(cd, "to_dict") else cd)
  name = d.pop("preset", "glm5")
  return get_preset(name, **d)
