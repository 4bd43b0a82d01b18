"""Reading Hugging Face GLM-5 checkpoints: whole, sharded onto a mesh, or INT4 (glm5_jax/hf.py).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from absl import logging
import numpy as np

from glm5_jax import hf_layout as layout
from glm5_jax import safetensors_io as sio
from glm5_jax.config import ModelConfig


def _read_view(info: sio.TensorInfo, v: layout.View, box) -> np.ndarray:
  """ours[box] for ours = view of the HF tensor `info`; reads only the rows it needs."""
  split_box = list(v.box)
  for k, p in enumerate(v.perm):
    split_box[p] = (v.box[p][0] + box[k][0], v.box[p][0] + box[k][1])
  inner = math.prod(v.groups[0][1:])
  x = sio.read_rows(info, split_box[0][0] * inner, split_box[0][1] * inner)
  shape = [split_box[0][1] - split_box[0][0]] + [s for g in v.groups for s in g][1:]
  index = (slice(None),) + tuple(slice(*b) for b in split_box[1:])
  return x.reshape(shape)[index].transpose(v.perm)


def _read_block(table: np.ndarray, infos, box, dtype, path) -> np.ndarray:
  """leaf[box] (box: (begin, end) per axis) from the HF tensors of `table`, as `dtype`."""
  nl = table.ndim
  out = np.empty([b - a for a, b in box], dtype)
  for lead in np.ndindex(*[b - a for a, b in box[:nl]]):
    name, v = table[tuple(a + i for (a, _), i in zip(box, lead))]
    x = _read_view(infos[name], v, box[nl:])
    if not np.isfinite(x).all():
      raise ValueError(f"{infos[name].file}: tensor {name!r} holds non-finite values (NaN or "
                       f"inf) in the block read for {'/'.join(path)}")
    out[lead] = x
  return out


def _read_config(path: str, overrides: dict) -> tuple[dict, ModelConfig]:
  file = os.path.join(path, "config.json")
  try:
    with open(file) as f:
      hf_cfg = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{file} is not valid JSON: {e}") from e
  if not isinstance(hf_cfg, dict):
    raise ValueError(f"{file}: expected a JSON object, got {type(hf_cfg).__name__}")
  return hf_cfg, ModelConfig.from_hf(hf_cfg, **overrides)


def _tensor_infos(path: str) -> dict[str, sio.TensorInfo]:
  """{tensor name: TensorInfo} from the index, or from the single safetensors file."""
  index = os.path.join(path, layout.INDEX_FILE)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
  elif os.path.exists(os.path.join(path, layout.SINGLE_FILE)):
    weight_map = None
  else:
    raise FileNotFoundError(f"{path}: neither {layout.INDEX_FILE} nor {layout.SINGLE_FILE} found")
  files = sorted(set(weight_map.values())) if weight_map else [layout.SINGLE_FILE]
  infos = {}
  for f in files:
    infos.update(sio.read_header(os.path.join(path, f)))
  if weight_map:
    lost = sorted(k for k in weight_map if k not in infos)
    if lost:
      raise ValueError(f"{index} lists tensors that its files do not hold: {lost[:20]}")
    infos = {k: infos[k] for k in weight_map}
  return infos


def _wanted(tables, dtypes=sio.FLOAT_DTYPES) -> dict:
  """{HF name: (shape, allowed safetensors dtypes)} of the tensors of leaf `tables`."""
  return {name: (v.hf_shape, dtypes) for t in tables for name, v in t.flat}


def _check_tensors(hf_cfg: dict, want: dict, infos) -> None:
  """Every tensor of `want` ({name: (shape, dtypes)}) of that shape and one of those dtypes;
  errors name file, tensor, field."""
  problems = []
  for name in sorted(want):
    info, (shape, dtypes) = infos[name], want[name]
    if info.dtype not in dtypes:
      problems.append(f"{info.file}: tensor {name!r} has dtype {info.dtype}; expected one of "
                      f"{dtypes}")
    elif info.shape != shape:
      hint = "".join(
          f"; dim {k} is {g}, config.json gives {w}"
          f" ({', '.join(f for f, x in hf_cfg.items() if x == w) or 'a product of fields'})"
          for k, (g, w) in enumerate(zip(info.shape, shape)) if g != w)
      problems.append(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, config.json "
                      f"implies {list(shape)}{hint}")
  if problems:
    raise ValueError("checkpoint does not fit its config: " + " | ".join(problems[:10]))


def _check_names(path, infos, needed, skip):
  unexpected = sorted(set(infos) - needed - skip)
  if unexpected:
    raise ValueError(f"{path}: {len(unexpected)} unexpected tensors for this config: "
                     f"{unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}")
  missing = sorted(needed - set(infos))
  if missing:
    raise ValueError(f"{path}: {len(missing)} tensors missing: "
                     f"{missing[:20]}{' ...' if len(missing) > 20 else ''}")


def _nest(flat: dict[tuple, Any]) -> dict:
  tree: dict = {}
  for path, x in flat.items():
    t = tree
    for k in path[:-1]:
      t = t.setdefault(k, {})
    t[path[-1]] = x
  return tree


def _np_dtype(name: str):
  return sio.DTYPES["BF16"] if name == "bfloat16" else np.dtype(name)


def _config_and_tensors(path: str, overrides: dict):
  """(HF config dict, ModelConfig, tensor infos); without the MTP layer's tensors the config
  drops MTP (a transformers-saved checkpoint has none)."""
  hf_cfg, cfg = _read_config(path, overrides)
  infos = _tensor_infos(path)
  mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
  if cfg.num_nextn_predict_layers and not any(k.startswith(mtp_prefix) for k in infos):
    logging.warning("%s: config has num_nextn_predict_layers=1 but no %s* tensors (a "
                    "transformers-saved checkpoint drops them); loading without MTP.",
                    path, mtp_prefix)
    cfg = cfg.replace(num_nextn_predict_layers=0, mtp_num_steps=0)
  return hf_cfg, cfg, infos


def quantization(path: str) -> str | None:
  """What INT4 quantization `path`'s config.json states (one line, hf_int4.py), or None for
  a float checkpoint; from config.json alone."""
  from glm5_jax import hf_int4  # pylint: disable=g-import-not-at-top
  file = os.path.join(path, "config.json")
  hf_cfg, _ = _read_config(path, {})
  return None if hf_int4.read_group_size(hf_cfg, file) is None else hf_int4.describe(hf_cfg)


def read_config(path: str, **config_overrides) -> ModelConfig:
  """The ModelConfig `load_pretrained(path)` returns, from config.json and the safetensors
  headers alone (no tensor is read)."""
  return _config_and_tensors(path, config_overrides)[1]


def _quantized_leaves(leaves, infos, path: str) -> set:
  """Paths of the leaves whose HF tensors are stored INT4 (`X.weight_packed`); a ValueError
  for a leaf stored partly quantized (an HF tensor is quantized whole, a leaf's tensors alike)."""
  from glm5_jax import hf_int4  # pylint: disable=g-import-not-at-top
  out = set()
  for p, t in leaves.items():
    names = [n for n, _ in t.flat]
    packed = [n.endswith(".weight") and hf_int4.stored_name(n, "weight_packed") in infos
              for n in names]
    if any(packed) and not all(packed):
      raise ValueError(f"{path}: {'/'.join(p)} is stored partly INT4: "
                       f"{[n for n, q in zip(names, packed) if q][:3]} quantized, "
                       f"{[n for n, q in zip(names, packed) if not q][:3]} not")
    if all(packed):
      out.add(p)
  return out


def _stored_tables(table: np.ndarray, group_size: int, file: str) -> dict:
  """{suffix: table of (HF name, view)} of a quantized leaf's stored tensors (hf_int4.py)."""
  from glm5_jax import hf_int4  # pylint: disable=g-import-not-at-top
  out = {s: np.empty(table.shape, object) for s in hf_int4.SUFFIXES}
  for idx in np.ndindex(*table.shape):
    name, v = table[idx]
    n_in = v.hf_shape[1]
    if n_in % group_size or n_in % hf_int4.PER_WORD:
      raise ValueError(f"{file}: quantization_config group_size={group_size} and "
                       f"{hf_int4.PER_WORD} values per int32 word must divide the `in` "
                       f"dimension of {name!r}, {n_in}")
    out["weight_packed"][idx] = (hf_int4.stored_name(name, "weight_packed"),
                                 layout.stored_view(v, n_in // hf_int4.PER_WORD))
    out["weight_scale"][idx] = (hf_int4.stored_name(name, "weight_scale"),
                                layout.stored_view(v, n_in // group_size))
    out["weight_shape"][idx] = (hf_int4.stored_name(name, "weight_shape"), layout.same(2))
  return out


def _check_weight_shapes(float_table, stored, infos) -> None:
  """Every `X.weight_shape` holds the [out, in] that config.json implies."""
  for (_, v), (name, _) in zip(float_table.flat, stored["weight_shape"].flat):
    got = sio.read_rows(infos[name], 0, 2).tolist()
    if got != list(v.hf_shape):
      raise ValueError(f"{infos[name].file}: tensor {name!r} holds {got}, config.json "
                       f"implies [out, in] = {list(v.hf_shape)}")


def _read_stored(table, infos, lead_box, dtype, path) -> np.ndarray:
  """A quantized leaf's stored tensor (words or scales) for the leading axes `lead_box`:
  [*lead, n_in, O] (the output axes flattened)."""
  v = table.flat[0][1]
  x = _read_block(table, infos, list(lead_box) + [(0, n) for n in v.shape], dtype, path)
  return x.reshape(x.shape[:table.ndim + 1] + (-1,))


def load_pretrained(path: str, *, param_dtype: str | None = None, to_device: bool = True,
                    mesh=None, rules=None, quantized: bool = False, dequantize: bool = False,
                    **config_overrides) -> tuple[ModelConfig, dict]:
  """Reads `config.json` + safetensors from `path` into (ModelConfig, params).

  Args:
    path: a directory with config.json and model.safetensors or a sharded
      model.safetensors.index.json.
    param_dtype: dtype of the loaded parameters (default: ModelConfig's,
      float32). Router weights and the routing bias stay float32.
    to_device: without `mesh`, return jax arrays (True) or numpy arrays.
    mesh: a `jax.sharding.Mesh` (glm5_jax/sharding.py): return global arrays in the
      model's shardings; each process reads only the blocks its devices hold. INT4
      weights (`quantized`) are sharded over their batch axes (layers, experts) only.
    rules: logical-axis rules for `mesh` (default `sharding.DEFAULT_RULES`).
    quantized: an INT4 checkpoint (config.json `quantization_config`, glm5_jax/hf_int4.py):
      its quantized weights as `quant.QArray` leaves, packed (what the engine serves).
    dequantize: an INT4 checkpoint's quantized weights as float (`quant.dequantize` of the
      packed ones, bitwise); a float checkpoint loads as it is.
    **config_overrides: ModelConfig fields to override (e.g. mtp_num_steps).

  Raises:
    ValueError: wrong model_type, a broken config.json or safetensors file, missing
      or unexpected tensors, wrong shapes or dtypes, non-finite values; each names
      the file and the tensor or field. An INT4 checkpoint without `quantized` or
      `dequantize` (it holds no float weights), `quantized` on a float checkpoint.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from glm5_jax import hf_int4  # pylint: disable=g-import-not-at-top
  from glm5_jax import nn as gnn  # pylint: disable=g-import-not-at-top
  from glm5_jax import quant  # pylint: disable=g-import-not-at-top
  from glm5_jax.optim.param_groups import quant_axes  # pylint: disable=g-import-not-at-top
  if param_dtype is not None:
    config_overrides["param_dtype"] = param_dtype
  hf_cfg, cfg, infos = _config_and_tensors(path, config_overrides)
  file = os.path.join(path, "config.json")
  group_size = hf_int4.read_group_size(hf_cfg, file)
  if quantized and dequantize:
    raise ValueError("load_pretrained: quantized=True (packed INT4 leaves) and dequantize=True "
                     "(float leaves) exclude each other")
  if group_size is not None and not (quantized or dequantize):
    raise ValueError(f"{file} has a quantization_config ({hf_int4.describe(hf_cfg)}): an INT4 "
                     "checkpoint, not float weights. Load it with quantized=True (weights stay "
                     "packed: quant.QArray leaves, for the inference engine) or dequantize=True "
                     "(float weights)")
  if group_size is None and quantized:
    raise ValueError(f"{path}: quantized=True, but {file} has no quantization_config (a float "
                     "checkpoint); quantize it first (python -m experiments.convert_checkpoint "
                     "--quantize=int4, or quant.quantize_tree)")
  mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
  mtp = bool(cfg.num_nextn_predict_layers)
  fused = frozenset(k[:-len(".mlp.experts.down_proj")] for k in infos
                    if k.endswith(".mlp.experts.down_proj"))
  leaves = layout.leaves(layout.entries(cfg, mtp=mtp, fused=fused))
  got = {p: layout.leaf_shape(t) for p, t in leaves.items()}
  qpaths = _quantized_leaves(leaves, infos, path) if group_size is not None else set()
  floats = {p: t for p, t in leaves.items() if p not in qpaths}
  stored = {p: _stored_tables(leaves[p], group_size, file) for p in sorted(qpaths)}
  want = _wanted(floats.values())
  for suffix, dtypes in (("weight_packed", ("I32",)), ("weight_scale", ("F32",)),
                         ("weight_shape", ("I32", "I64"))):
    want.update(_wanted([st[suffix] for st in stored.values()], dtypes))
  skip = {k for k in infos if k.startswith(mtp_prefix) and k.endswith(layout.MTP_SHARED_COPIES)}
  _check_names(path, infos, set(want), skip)
  _check_tensors(hf_cfg, want, infos)
  for p, st in stored.items():
    _check_weight_shapes(leaves[p], st, infos)

  shapes, specs = gnn.abstract_params(cfg)
  flat_shapes = {tuple(k.key for k in p): s for p, s in
                 jax.tree_util.tree_flatten_with_path(shapes)[0]}
  model = {p: s.shape for p, s in flat_shapes.items()}
  if got != model:                                  # a bug in the views, not in the file
    raise AssertionError(f"hf views != model params: {set(got.items()) ^ set(model.items())}")
  dtype = _np_dtype(cfg.param_dtype)
  dtypes = {p: np.dtype(np.float32) if "router" in p else dtype for p in leaves}
  layouts = {p: quant_axes("/".join(p), got[p]) for p in stored}
  for p, (batch, red) in layouts.items():           # the views' [in, out] split is the rule's
    if (batch, red) != (leaves[p].ndim, len(leaves[p].flat[0][1].groups[1])):
      raise AssertionError(f"{p}: quant_axes {(batch, red)} != the HF view's")

  def qarray(p, values, scales):
    batch, red = layouts[p]
    return quant.QArray(values, scales, tuple(got[p][batch:]), red, "int4", group_size,
                        np.dtype(dtype).name)

  def read_q(p, lead):
    st = stored[p]
    return (hf_int4.nibble_bytes(_read_stored(st["weight_packed"], infos, lead, np.int32, p)),
            _read_stored(st["weight_scale"], infos, lead, np.float32, p))

  if mesh is None:
    params = {p: _read_block(t, infos, layout.index_box((), got[p]), dtypes[p], p)
              for p, t in floats.items()}
    q = {p: qarray(p, *read_q(p, layout.index_box((), leaves[p].shape))) for p in stored}
    if dequantize:                                  # one program for all of them
      q = jax.jit(quant.dequantize_tree)(q)
    params.update(q if to_device else jax.tree.map(np.asarray, q))
    if to_device:
      params = {p: jax.tree.map(jax.numpy.asarray, x) for p, x in params.items()}
    return cfg, _nest(params)

  from glm5_jax import sharding  # pylint: disable=g-import-not-at-top
  rules = sharding.DEFAULT_RULES if rules is None else rules
  shardings = sharding.param_shardings(specs, mesh, rules)
  sharding.check_divisible(shapes, shardings, mesh)
  flat_sh = {tuple(k.key for k in p): s for p, s in jax.tree_util.tree_flatten_with_path(
      shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]}
  params = {}
  for p, t in floats.items():
    blocks = {}                         # devices holding the same block share one read

    def read(index, t=t, p=p, blocks=blocks):
      box = tuple(layout.index_box(index, got[p]))
      if box not in blocks:
        blocks[box] = _read_block(t, infos, box, dtypes[p], p)
      return blocks[box]
    params[p] = jax.make_array_from_callback(got[p], flat_sh[p], read)
    blocks.clear()
  q = {}
  for p in stored:                      # packed, sharded over the batch axes only
    batch, red = layouts[p]
    spec = tuple(flat_sh[p].spec) + (None,) * len(got[p])
    qsh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec[:batch]))
    r, o = math.prod(got[p][batch:batch + red]), math.prod(got[p][batch + red:])
    blocks = {}

    def read(index, k, p=p, batch=batch, blocks=blocks):
      lead = tuple(layout.index_box(index[:batch], got[p][:batch]))
      if lead not in blocks:
        blocks[lead] = read_q(p, lead)
      return blocks[lead][k]
    parts = [jax.make_array_from_callback(got[p][:batch] + (n, o), qsh,
                                          lambda i, k=k, read=read: read(i, k))
             for k, n in ((0, r // 2), (1, r // group_size))]
    blocks.clear()
    q[p] = qarray(p, *parts)
  if dequantize:
    q = jax.jit(quant.dequantize_tree, out_shardings={p: flat_sh[p] for p in q})(q)
  params.update(q)
  return cfg, _nest(params)
