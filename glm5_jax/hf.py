"""Load and save Hugging Face GLM-5 (`glm_moe_dsa`) checkpoints.

Checkpoint layout (spec §1): torch Linear weights are [out, in]; routed experts
are stored per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`); the MTP
layer is `model.layers.{num_hidden_layers}.*` with `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm` next to a full decoder layer. transformers' in-memory fused
expert layout (`mlp.experts.gate_up_proj [E, 2I, d]`, `mlp.experts.down_proj
[E, d, I]`) is accepted on load too.

    cfg, params = load_pretrained("path/to/dir")
    save_pretrained(cfg, params, "out_dir")      # transformers loads it

Loading reads one tensor at a time (safetensors `safe_open`), converts it and
drops it, so host memory holds the converted parameters plus one tensor.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterator

import numpy as np
from absl import logging

from glm5_jax.config import ModelConfig

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# DeepSeek-V3 stores these in its MTP layer; GLM checkpoints reuse the main ones.
_MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


# --------------------------------------------------------------------------------------
# Name map: HF tensor name -> (our param path, converter to our layout)
# --------------------------------------------------------------------------------------

def _t(w):
  return np.ascontiguousarray(w.T)


class _Reshaped:
  """ours = W^T.reshape(shape); W^T is 2-D `[rows, cols]`; invertible for saving."""

  def __init__(self, rows: int, cols: int, shape: tuple):
    self.rows, self.cols, self.shape = rows, cols, shape

  def __call__(self, w):
    return _t(w).reshape(self.shape)

  def inverse(self, x):
    return _t(np.asarray(x).reshape(self.rows, self.cols))


def _layer_map(cfg: ModelConfig, hf: str, ours: tuple, moe: bool, indexer: bool):
  """{hf_name: (path, convert)} for one decoder layer (prefix `hf`, path prefix `ours`)."""
  h, n, p, v = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                cfg.v_head_dim)
  r, c, d = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.hidden_size
  hi, di = cfg.index_n_heads, cfg.index_head_dim
  a = f"{hf}.self_attn"
  m = {
      f"{hf}.input_layernorm.weight": (ours + ("input_norm", "scale"), None),
      f"{hf}.post_attention_layernorm.weight": (ours + ("post_attention_norm", "scale"), None),
      f"{a}.q_a_proj.weight": (ours + ("attn", "wq_a"), _t),
      f"{a}.q_a_layernorm.weight": (ours + ("attn", "q_norm", "scale"), None),
      f"{a}.q_b_proj.weight": (ours + ("attn", "wq_b"), _Reshaped(r, h * (n + p), (r, h, n + p))),
      f"{a}.kv_a_proj_with_mqa.weight": (ours + ("attn", "wkv_a"), _t),
      f"{a}.kv_a_layernorm.weight": (ours + ("attn", "kv_norm", "scale"), None),
      f"{a}.kv_b_proj.weight": (ours + ("attn",), "kv_b"),
      f"{a}.o_proj.weight": (ours + ("attn", "wo"), _Reshaped(h * v, d, (h, v, d))),
  }
  if indexer:
    ix = ours + ("attn", "indexer")
    m.update({
        f"{a}.indexer.wq_b.weight": (ix + ("wq_b",), _Reshaped(r, hi * di, (r, hi, di))),
        f"{a}.indexer.wk.weight": (ix + ("wk",), _t),
        f"{a}.indexer.k_norm.weight": (ix + ("k_norm", "scale"), None),
        f"{a}.indexer.k_norm.bias": (ix + ("k_norm", "bias"), None),
        f"{a}.indexer.weights_proj.weight": (ix + ("weights_proj",), _t),
    })
  if not moe:
    for proj in ("gate", "up", "down"):
      m[f"{hf}.mlp.{proj}_proj.weight"] = (ours + ("mlp", f"w_{proj}"), _t)
    return m
  mo = ours + ("moe",)
  m[f"{hf}.mlp.gate.weight"] = (mo + ("router", "kernel"), _t)
  m[f"{hf}.mlp.gate.e_score_correction_bias"] = (mo + ("router", "e_score_correction_bias"), None)
  for proj in ("gate", "up", "down"):
    m[f"{hf}.mlp.shared_experts.{proj}_proj.weight"] = (mo + ("shared", f"w_{proj}"), _t)
    for e in range(cfg.n_routed_experts):
      m[f"{hf}.mlp.experts.{e}.{proj}_proj.weight"] = (mo + ("experts", f"w_{proj}"), ("expert", e))
  return m


def _name_map(cfg: ModelConfig) -> dict[str, tuple]:
  m = {
      "model.embed_tokens.weight": (("embed", "embedding"), None),
      "model.norm.weight": (("final_norm", "scale"), None),
      "lm_head.weight": (("lm_head", "kernel"), _t),
  }
  for i in range(cfg.num_hidden_layers):
    m.update(_layer_map(cfg, f"model.layers.{i}", (f"layers_{i}",), cfg.is_moe_layer(i),
                        cfg.indexer_type(i) == "full"))
  if cfg.num_nextn_predict_layers:
    L = cfg.num_hidden_layers
    hf = f"model.layers.{L}"
    m.update(_layer_map(cfg, hf, ("mtp", "layer"), cfg.is_moe_layer(L), True))
    m.update({
        f"{hf}.enorm.weight": (("mtp", "enorm", "scale"), None),
        f"{hf}.hnorm.weight": (("mtp", "hnorm", "scale"), None),
        f"{hf}.eh_proj.weight": (("mtp", "eh_proj"), _t),
        f"{hf}.shared_head.norm.weight": (("mtp", "head_norm", "scale"), None),
    })
  return m


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------

def _shard_files(path: str) -> dict[str, str]:
  """{tensor name: file} from the index, or from the single safetensors file."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  index = os.path.join(path, _INDEX)
  if os.path.exists(index):
    with open(index) as f:
      return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
  single = os.path.join(path, _SINGLE)
  if os.path.exists(single):
    with safe_open(single, "numpy") as f:
      return {k: single for k in f.keys()}
  raise FileNotFoundError(f"{path}: neither {_INDEX} nor {_SINGLE} found")


def _iter_tensors(files: dict[str, str]) -> Iterator[tuple[str, np.ndarray]]:
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  by_file: dict[str, list[str]] = {}
  for name, f in files.items():
    by_file.setdefault(f, []).append(name)
  for f, names in sorted(by_file.items()):
    with safe_open(f, "numpy") as reader:
      for name in sorted(names):
        yield name, reader.get_tensor(name)


def _set(tree: dict, path: tuple, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple):
  for k in path:
    tree = tree[k]
  return tree


def _fused_expert_names(cfg: ModelConfig, names) -> dict[str, tuple]:
  """transformers' in-memory fused layout: {name: (moe path, kind)}."""
  out = {}
  layers = [(f"model.layers.{i}", (f"layers_{i}", "moe")) for i in range(cfg.num_hidden_layers)
            if cfg.is_moe_layer(i)]
  if cfg.num_nextn_predict_layers:
    layers.append((f"model.layers.{cfg.num_hidden_layers}", ("mtp", "layer", "moe")))
  for hf, ours in layers:
    for kind in ("gate_up_proj", "down_proj"):
      name = f"{hf}.mlp.experts.{kind}"
      if name in names:
        out[name] = (ours, kind)
  return out


def load_pretrained(path: str, *, param_dtype: str | None = None, to_device: bool = True,
                    **config_overrides) -> tuple[ModelConfig, dict]:
  """Reads `config.json` + safetensors from `path` into (ModelConfig, params).

  Args:
    path: a directory with config.json and model.safetensors or a sharded
      model.safetensors.index.json.
    param_dtype: dtype of the loaded parameters (default: ModelConfig's,
      float32). Router weights and the routing bias stay float32.
    to_device: return jax arrays (True) or numpy arrays.
    **config_overrides: ModelConfig fields to override (e.g. mtp_num_steps).

  Raises:
    ValueError: wrong model_type, missing or unexpected tensors, wrong shapes.
  """
  import jax  # pylint: disable=g-import-not-at-top
  with open(os.path.join(path, "config.json")) as f:
    hf_cfg = json.load(f)
  if param_dtype is not None:
    config_overrides["param_dtype"] = param_dtype
  cfg = ModelConfig.from_hf(hf_cfg, **config_overrides)
  files = _shard_files(path)
  mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
  if cfg.num_nextn_predict_layers and not any(k.startswith(mtp_prefix) for k in files):
    logging.warning("%s: config has num_nextn_predict_layers=1 but no %s* tensors (a "
                    "transformers-saved checkpoint drops them); loading without MTP.",
                    path, mtp_prefix)
    cfg = cfg.replace(num_nextn_predict_layers=0, mtp_num_steps=0)

  name_map = _name_map(cfg)
  fused = _fused_expert_names(cfg, files)
  skip = {k for k in files if k.startswith(mtp_prefix) and k.endswith(_MTP_SHARED_COPIES)}
  unexpected = sorted(set(files) - set(name_map) - set(fused) - skip)
  if unexpected:
    raise ValueError(f"{path}: {len(unexpected)} unexpected tensors for this config: "
                     f"{unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}")
  fused_layers = {v[0] for v in fused.values()}
  needed = {k for k, (p, _) in name_map.items()
            if not (".mlp.experts." in k and p[:-2] in fused_layers)}
  missing = sorted(needed - set(files))
  if missing:
    raise ValueError(f"{path}: {len(missing)} tensors missing: "
                     f"{missing[:20]}{' ...' if len(missing) > 20 else ''}")

  expected = _expected_shapes(cfg)
  dtype = np.dtype(_np_dtype(cfg.param_dtype))
  params: dict[str, Any] = {}
  for name, w in _iter_tensors({k: v for k, v in files.items() if k not in skip}):
    if name in fused:
      _load_fused(cfg, params, fused[name], w, dtype)
      continue
    ours, conv = name_map[name]
    if conv == "kv_b":
      _load_kv_b(cfg, params, ours, w, dtype)
    elif isinstance(conv, tuple):                      # ("expert", e): one slice of a stack
      _, e = conv
      buf = _expert_buffer(cfg, params, ours, dtype)
      buf[e] = _t(w).astype(dtype)
    else:
      x = w if conv is None else conv(w)
      _set(params, ours, x.astype(np.float32 if "router" in ours else dtype))
  params = _stacked(cfg, params)
  _check_shapes(params, expected)
  if to_device:
    params = jax.tree_util.tree_map(jax.numpy.asarray, params)
  return cfg, params


def _stacked(cfg, params):
  """Per-layer trees `layers_{i}` (the checkpoint's layout) -> the model's scanned stacks."""
  from glm5_jax.nn import layer_stack  # pylint: disable=g-import-not-at-top
  per_layer = [params.pop(f"layers_{i}", {}) for i in range(cfg.num_hidden_layers)]
  try:
    stacks = layer_stack.stack_layers(cfg, per_layer)
  except ValueError as e:              # layers of one stack disagree in structure or shape
    raise ValueError(f"checkpoint does not fit the config: decoder layers differ within a "
                     f"stack ({e})") from e
  return {**params, **stacks}


def _per_layer(cfg, params):
  """The model's scanned stacks -> per-layer trees `layers_{i}` (the checkpoint's layout)."""
  from glm5_jax.nn import layer_stack  # pylint: disable=g-import-not-at-top
  out = {k: v for k, v in params.items() if k not in layer_stack.STACK_NAMES}
  out.update({f"layers_{i}": layer_stack.layer_params(cfg, params, i)
              for i in range(cfg.num_hidden_layers)})
  return out


def _np_dtype(name: str):
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def _expert_buffer(cfg, params, path, dtype):
  try:
    return _get(params, path)
  except KeyError:
    e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shape = (e, i, d) if path[-1] == "w_down" else (e, d, i)
    buf = np.zeros(shape, dtype)
    _set(params, path, buf)
    return buf


def _load_kv_b(cfg, params, attn_path, w, dtype):
  """kv_b_proj [h*(n+v), c] -> w_uk [c, h, n], w_uv [c, h, v]."""
  h, n = cfg.num_attention_heads, cfg.qk_nope_head_dim
  w = w.reshape(h, n + cfg.v_head_dim, cfg.kv_lora_rank)
  _set(params, attn_path + ("w_uk",), np.ascontiguousarray(w[:, :n].transpose(2, 0, 1)).astype(dtype))
  _set(params, attn_path + ("w_uv",), np.ascontiguousarray(w[:, n:].transpose(2, 0, 1)).astype(dtype))


def _load_fused(cfg, params, target, w, dtype):
  moe_path, kind = target
  i = cfg.moe_intermediate_size
  if kind == "gate_up_proj":                          # [E, 2I, d], gate rows first
    _set(params, moe_path + ("experts", "w_gate"), np.ascontiguousarray(
        w[:, :i].transpose(0, 2, 1)).astype(dtype))
    _set(params, moe_path + ("experts", "w_up"), np.ascontiguousarray(
        w[:, i:].transpose(0, 2, 1)).astype(dtype))
  else:                                               # [E, d, I]
    _set(params, moe_path + ("experts", "w_down"), np.ascontiguousarray(
        w.transpose(0, 2, 1)).astype(dtype))


def _expected_shapes(cfg: ModelConfig):
  from glm5_jax import nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  shapes, _ = nn.abstract_params(cfg)
  return jax.tree_util.tree_map(lambda s: tuple(s.shape), shapes)


def _check_shapes(params, expected):
  import jax  # pylint: disable=g-import-not-at-top
  got = jax.tree_util.tree_map(lambda x: tuple(x.shape), params)
  flat_e = dict(jax.tree_util.tree_flatten_with_path(expected, is_leaf=lambda x: isinstance(x, tuple))[0])
  flat_g = dict(jax.tree_util.tree_flatten_with_path(got, is_leaf=lambda x: isinstance(x, tuple))[0])
  fmt = jax.tree_util.keystr
  missing = sorted(fmt(k) for k in set(flat_e) - set(flat_g))
  extra = sorted(fmt(k) for k in set(flat_g) - set(flat_e))
  wrong = sorted(f"{fmt(k)}: {flat_g[k]} != {flat_e[k]}"
                 for k in set(flat_e) & set(flat_g) if flat_e[k] != flat_g[k])
  if missing or extra or wrong:
    raise ValueError(f"checkpoint does not fit the config: missing params {missing}, "
                     f"extra params {extra}, wrong shapes {wrong}")


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------

def _hf_tensors(cfg: ModelConfig, params) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (HF name, [out, in] array) in checkpoint (per-expert) layout."""
  has_mtp = "mtp" in params and cfg.num_nextn_predict_layers
  params = _per_layer(cfg, params)
  for name, (ours, conv) in _name_map(cfg).items():
    if ours[0] == "mtp" and not has_mtp:
      continue
    if conv == "kv_b":
      uk, uv = np.asarray(_get(params, ours + ("w_uk",))), np.asarray(_get(params, ours + ("w_uv",)))
      yield name, np.concatenate([uk.transpose(1, 2, 0), uv.transpose(1, 2, 0)], axis=1).reshape(
          -1, cfg.kv_lora_rank)
    elif isinstance(conv, tuple):
      yield name, _t(np.asarray(_get(params, ours)[conv[1]]))
    elif conv is None:
      yield name, np.asarray(_get(params, ours))
    elif isinstance(conv, _Reshaped):
      yield name, conv.inverse(_get(params, ours))
    else:                                             # _t
      yield name, _t(np.asarray(_get(params, ours)))


def save_pretrained(cfg: ModelConfig, params, path: str, *, max_shard_bytes: int = 5 * 2**30):
  """Writes config.json + safetensors shards (+ index) that transformers loads.

  The MTP layer is written as `model.layers.{num_hidden_layers}.*` (transformers
  ignores it; our loader reads it back).
  """
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  os.makedirs(path, exist_ok=True)
  hf_cfg = cfg.to_hf()
  if "mtp" not in params:
    hf_cfg["num_nextn_predict_layers"] = 0
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=2)

  shards, current, size = [], {}, 0

  def flush():
    nonlocal current, size
    if current:
      tmp = os.path.join(path, f"shard-{len(shards):05d}.tmp")
      save_file(current, tmp, metadata={"format": "pt"})
      shards.append((tmp, sorted(current)))
      current, size = {}, 0

  for name, w in _hf_tensors(cfg, params):
    if size + w.nbytes > max_shard_bytes:
      flush()
    current[name] = np.ascontiguousarray(w)
    size += w.nbytes
  flush()

  for old in os.listdir(path):
    if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors|" + re.escape(_INDEX), old):
      os.remove(os.path.join(path, old))
  if len(shards) == 1:
    os.replace(shards[0][0], os.path.join(path, _SINGLE))
    return
  weight_map, total = {}, 0
  for i, (tmp, names) in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    os.replace(tmp, os.path.join(path, fname))
    weight_map.update({n: fname for n in names})
    total += os.path.getsize(os.path.join(path, fname))
  with open(os.path.join(path, _INDEX), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
