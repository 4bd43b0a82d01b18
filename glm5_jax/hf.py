"""Load and save Hugging Face GLM-5 (`glm_moe_dsa`) checkpoints, whole or sharded on a mesh.

Checkpoint layout (docs/design.md §1): torch Linear weights are [out, in]; routed experts
are stored per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`); the MTP
layer is `model.layers.{num_hidden_layers}.*` with `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm` next to a full decoder layer. transformers' in-memory fused
expert layout (`mlp.experts.gate_up_proj [E, 2I, d]`, `mlp.experts.down_proj
[E, d, I]`) is accepted on load too.

    cfg, params = load_pretrained("path/to/dir")                   # one host-side tree
    cfg, params = load_pretrained("path/to/dir", mesh=mesh)        # global arrays, sharded
    save_pretrained(cfg, params, "out_dir")      # transformers loads it
    save_pretrained(cfg, quant.quantize_tree(params, scheme), "int4_dir")   # INT4 (hf_int4.py)
    cfg, qparams = load_pretrained("int4_dir", quantized=True)     # QArray leaves, packed

Every parameter leaf is a table of *views* of HF tensors: leaf[lead] =
HF.reshape(split)[box].transpose(perm), `lead` the stacked `layers` axis (and the
expert axis for per-expert tensors). A requested block of a leaf reads only the rows
of the HF tensors it needs (`safetensors_io.read_rows`), so a process loading onto a
mesh holds its own shards plus one tensor (docs/checkpoints.md). Saving inverts the
views one HF tensor at a time.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, NamedTuple

import numpy as np
from absl import logging

from glm5_jax import safetensors_io as sio
from glm5_jax.config import ModelConfig

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# DeepSeek-V3 stores these in its MTP layer; GLM checkpoints reuse the main ones.
_MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


# --------------------------------------------------------------------------------------
# Views: one parameter block as a reshaped, sliced, transposed HF tensor
# --------------------------------------------------------------------------------------

class _View(NamedTuple):
  """ours = HF.reshape(split)[box].transpose(perm); split = the `groups` concatenated.

  groups[k]: how HF axis k splits, row-major; box: (begin, end) per split axis.
  """
  groups: tuple
  box: tuple
  perm: tuple

  @property
  def hf_shape(self) -> tuple:
    return tuple(math.prod(g) for g in self.groups)

  @property
  def shape(self) -> tuple:
    return tuple(self.box[p][1] - self.box[p][0] for p in self.perm)


def _view(groups, perm, box=None) -> _View:
  split = [s for g in groups for s in g]
  box = box or {}
  return _View(tuple(map(tuple, groups)), tuple(box.get(i, (0, s)) for i, s in enumerate(split)),
               tuple(perm))


def _same(*shape) -> _View:
  return _view([(s,) for s in shape], range(len(shape)))


def _t(out: int, inp: int) -> _View:
  """torch Linear [out, in] -> ours [in, out]."""
  return _view([(out,), (inp,)], (1, 0))


def _stored_view(v: _View, n_in: int) -> _View:
  """The view of a quantized weight's stored tensor [out, n_in] (packed words, scales;
  hf_int4.py) whose float weight has view `v`: ours [n_in, *out axes], the reduction axes
  flattened into one. `v` must map HF [out, in] to ours [*in split axes, *out split axes]
  with `in` whole (every quantization target's view does)."""
  k = len(v.groups[0])
  n_red = len(v.groups[1]) if len(v.groups) == 2 else 0
  if (len(v.groups) != 2 or tuple(v.perm) != tuple(range(k, k + n_red)) + tuple(range(k))
      or v.box[k:] != tuple((0, s) for s in v.groups[1])):
    raise AssertionError(f"view {v} is not a torch Linear [out, in] seen as [in, out]")
  return _View((v.groups[0], (n_in,)), v.box[:k] + ((0, n_in),), (k,) + tuple(range(k)))


class _Entry(NamedTuple):
  hf: str          # HF tensor name
  path: tuple      # our leaf path in the model's (stacked) tree
  lead: tuple      # index into the leaf's leading axes (layers, experts)
  view: _View


def _layer_entries(cfg: ModelConfig, hf: str, path, lead, moe: bool, indexer: bool,
                   fused: bool):
  """Entries of one decoder layer with HF prefix `hf`, leaves under `path`, at `lead`."""
  h, n, p, v = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                cfg.v_head_dim)
  r, c, d = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.hidden_size
  hi, di = cfg.index_n_heads, cfg.index_head_dim
  a = f"{hf}.self_attn"
  kv_b = [(h, n + v), (c,)]
  table = [
      (f"{hf}.input_layernorm.weight", ("input_norm", "scale"), _same(d)),
      (f"{hf}.post_attention_layernorm.weight", ("post_attention_norm", "scale"), _same(d)),
      (f"{a}.q_a_proj.weight", ("attn", "wq_a"), _t(r, d)),
      (f"{a}.q_a_layernorm.weight", ("attn", "q_norm", "scale"), _same(r)),
      (f"{a}.q_b_proj.weight", ("attn", "wq_b"), _view([(h, n + p), (r,)], (2, 0, 1))),
      (f"{a}.kv_a_proj_with_mqa.weight", ("attn", "wkv_a"), _t(c + p, d)),
      (f"{a}.kv_a_layernorm.weight", ("attn", "kv_norm", "scale"), _same(c)),
      (f"{a}.kv_b_proj.weight", ("attn", "w_uk"), _view(kv_b, (2, 0, 1), {1: (0, n)})),
      (f"{a}.kv_b_proj.weight", ("attn", "w_uv"), _view(kv_b, (2, 0, 1), {1: (n, n + v)})),
      (f"{a}.o_proj.weight", ("attn", "wo"), _view([(d,), (h, v)], (1, 2, 0))),
  ]
  if indexer:
    table += [
        (f"{a}.indexer.wq_b.weight", ("attn", "indexer", "wq_b"),
         _view([(hi, di), (r,)], (2, 0, 1))),
        (f"{a}.indexer.wk.weight", ("attn", "indexer", "wk"), _t(di, d)),
        (f"{a}.indexer.k_norm.weight", ("attn", "indexer", "k_norm", "scale"), _same(di)),
        (f"{a}.indexer.k_norm.bias", ("attn", "indexer", "k_norm", "bias"), _same(di)),
        (f"{a}.indexer.weights_proj.weight", ("attn", "indexer", "weights_proj"), _t(hi, d)),
    ]
  if not moe:
    f = cfg.intermediate_size
    table += [(f"{hf}.mlp.{q}_proj.weight", ("mlp", f"w_{q}"), w)
              for q, w in (("gate", _t(f, d)), ("up", _t(f, d)), ("down", _t(d, f)))]
  else:
    e, i, s = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.n_shared_experts
    m = f"{hf}.mlp"
    table += [(f"{m}.gate.weight", ("moe", "router", "kernel"), _t(e, d)),
              (f"{m}.gate.e_score_correction_bias", ("moe", "router", "e_score_correction_bias"),
               _same(e))]
    if s:
      table += [(f"{m}.shared_experts.{q}_proj.weight", ("moe", "shared", f"w_{q}"), w)
                for q, w in (("gate", _t(i * s, d)), ("up", _t(i * s, d)),
                             ("down", _t(d, i * s)))]
    if fused:                                         # [E, 2I, d] (gate rows first), [E, d, I]
      gu, dn = [(e,), (2 * i,), (d,)], [(e,), (d,), (i,)]
      table += [(f"{m}.experts.gate_up_proj", ("moe", "experts", "w_gate"),
                 _view(gu, (0, 2, 1), {1: (0, i)})),
                (f"{m}.experts.gate_up_proj", ("moe", "experts", "w_up"),
                 _view(gu, (0, 2, 1), {1: (i, 2 * i)})),
                (f"{m}.experts.down_proj", ("moe", "experts", "w_down"), _view(dn, (0, 2, 1)))]
    else:
      for x in range(e):
        yield from (_Entry(f"{m}.experts.{x}.{q}_proj.weight", path + ("moe", "experts", f"w_{q}"),
                           lead + (x,), w)
                    for q, w in (("gate", _t(i, d)), ("up", _t(i, d)), ("down", _t(d, i))))
  yield from (_Entry(name, path + rest, lead, w) for name, rest, w in table)


def _entries(cfg: ModelConfig, *, mtp: bool, fused=frozenset()) -> list[_Entry]:
  """All entries of the model; layers whose HF prefix is in `fused` use the fused experts."""
  from glm5_jax.nn import layer_stack  # pylint: disable=g-import-not-at-top
  d, vocab = cfg.hidden_size, cfg.vocab_size
  out = [_Entry("model.embed_tokens.weight", ("embed", "embedding"), (), _same(vocab, d)),
         _Entry("model.norm.weight", ("final_norm", "scale"), (), _same(d)),
         _Entry("lm_head.weight", ("lm_head", "kernel"), (), _t(vocab, d))]
  for i in range(cfg.num_hidden_layers):
    stack, rep, j = layer_stack.locate(cfg, i)
    hf = f"model.layers.{i}"
    out += _layer_entries(cfg, hf, (stack, f"layer_{j}"), (rep,), cfg.is_moe_layer(i),
                          cfg.indexer_type(i) == "full", hf in fused)
  if mtp:
    L = cfg.num_hidden_layers
    hf = f"model.layers.{L}"
    out += _layer_entries(cfg, hf, ("mtp", "layer"), (), cfg.is_moe_layer(L), True, hf in fused)
    out += [_Entry(f"{hf}.enorm.weight", ("mtp", "enorm", "scale"), (), _same(d)),
            _Entry(f"{hf}.hnorm.weight", ("mtp", "hnorm", "scale"), (), _same(d)),
            _Entry(f"{hf}.eh_proj.weight", ("mtp", "eh_proj"), (), _t(d, 2 * d)),
            _Entry(f"{hf}.shared_head.norm.weight", ("mtp", "head_norm", "scale"), (), _same(d))]
  return out


def _leaves(entries) -> dict[tuple, np.ndarray]:
  """{leaf path: object array [*lead] of (HF name, view)}."""
  by_path: dict[tuple, list] = {}
  for e in entries:
    by_path.setdefault(e.path, []).append(e)
  out = {}
  for path, es in by_path.items():
    lead = tuple(max(e.lead[k] for e in es) + 1 for k in range(len(es[0].lead)))
    table = np.empty(lead, object)
    for e in es:
      table[e.lead] = (e.hf, e.view)
    out[path] = table
  return out


def _leaf_shape(table: np.ndarray) -> tuple:
  return table.shape + table.flat[0][1].shape


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------

def _read_view(info: sio.TensorInfo, v: _View, box) -> np.ndarray:
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


def _box(index, shape):
  return [s.indices(n)[:2] if isinstance(s, slice) else (s, s + 1)
          for s, n in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape)]


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
  index = os.path.join(path, _INDEX)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
  elif os.path.exists(os.path.join(path, _SINGLE)):
    weight_map = None
  else:
    raise FileNotFoundError(f"{path}: neither {_INDEX} nor {_SINGLE} found")
  files = sorted(set(weight_map.values())) if weight_map else [_SINGLE]
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
                                 _stored_view(v, n_in // hf_int4.PER_WORD))
    out["weight_scale"][idx] = (hf_int4.stored_name(name, "weight_scale"),
                                _stored_view(v, n_in // group_size))
    out["weight_shape"][idx] = (hf_int4.stored_name(name, "weight_shape"), _same(2))
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
  leaves = _leaves(_entries(cfg, mtp=mtp, fused=fused))
  got = {p: _leaf_shape(t) for p, t in leaves.items()}
  qpaths = _quantized_leaves(leaves, infos, path) if group_size is not None else set()
  floats = {p: t for p, t in leaves.items() if p not in qpaths}
  stored = {p: _stored_tables(leaves[p], group_size, file) for p in sorted(qpaths)}
  want = _wanted(floats.values())
  for suffix, dtypes in (("weight_packed", ("I32",)), ("weight_scale", ("F32",)),
                         ("weight_shape", ("I32", "I64"))):
    want.update(_wanted([st[suffix] for st in stored.values()], dtypes))
  skip = {k for k in infos if k.startswith(mtp_prefix) and k.endswith(_MTP_SHARED_COPIES)}
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
    params = {p: _read_block(t, infos, _box((), got[p]), dtypes[p], p) for p, t in floats.items()}
    q = {p: qarray(p, *read_q(p, _box((), leaves[p].shape))) for p in stored}
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
      box = tuple(_box(index, got[p]))
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
      lead = tuple(_box(index[:batch], got[p][:batch]))
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


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------

def _flat(params) -> dict[tuple, Any]:
  """{leaf path: array or quant.QArray}."""
  import jax  # pylint: disable=g-import-not-at-top
  from glm5_jax import quant  # pylint: disable=g-import-not-at-top
  from glm5_jax.optim.param_groups import key_name  # pylint: disable=g-import-not-at-top
  return {tuple(key_name(k) for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=quant.is_qarray)[0]}


def _target_group(params, qpaths) -> str:
  """The target group (optim/param_groups.QUANT_TARGETS) that quantizes exactly `qpaths`."""
  from glm5_jax import quant  # pylint: disable=g-import-not-at-top
  from glm5_jax.optim.param_groups import QUANT_TARGETS  # pylint: disable=g-import-not-at-top
  want = {"/".join(p) for p in qpaths}
  return next((t for t in QUANT_TARGETS
               if set(quant.targeted(params, quant.Scheme("int4", 2, t))) == want), "custom")


def _save_entries(cfg, params):
  """(entries to write, {leaf path: array} they read, quantization_config or None).

  A QArray leaf's entries become its stored tensors (hf_int4.py): `X.weight_packed` and
  `X.weight_scale` read the leaf's words and scales through `_stored_view`s, `X.weight_shape`
  a constant leaf [*batch, 2]."""
  from glm5_jax import hf_int4  # pylint: disable=g-import-not-at-top
  from glm5_jax import quant  # pylint: disable=g-import-not-at-top
  leaves = _flat(params)
  flat, qarrays = {}, {}
  for p, x in leaves.items():
    if quant.is_qarray(x):
      qarrays[p] = x
      flat.update({p + (k,): y for k, y in hf_int4.stored(x, "/".join(p)).items()})
    else:
      flat[p] = x
  has_mtp = ("mtp",) in {p[:1] for p in leaves} and bool(cfg.num_nextn_predict_layers)
  by_name: dict[str, list[_Entry]] = {}
  for e in _entries(cfg, mtp=has_mtp):
    by_name.setdefault(e.hf, []).append(e)
  entries, quantized, ignored, blocks = [], [], [], set()
  for name, es in by_name.items():
    q = {e.path in qarrays for e in es}
    if q == {True, False}:
      raise ValueError(f"{name}: its views {['/'.join(e.path) for e in es]} are partly "
                       "quantized; an HF tensor is stored quantized whole")
    linear = name.endswith(".weight") and len(es[0].view.hf_shape) == 2 and "embed" not in name
    if q == {False}:
      entries += es
      ignored += [name[:-len(".weight")]] if linear else []
      continue
    quantized.append(name[:-len(".weight")])
    for e in es:
      qa, n_in = qarrays[e.path], e.view.hf_shape[1]
      blocks.add(qa.block)
      entries += [_Entry(hf_int4.stored_name(name, "weight_packed"), e.path + ("weight_packed",),
                         e.lead, _stored_view(e.view, n_in // hf_int4.PER_WORD)),
                  _Entry(hf_int4.stored_name(name, "weight_scale"), e.path + ("weight_scale",),
                         e.lead, _stored_view(e.view, n_in // qa.block))]
    e = es[0]
    shape_path = e.path + ("weight_shape",)
    flat.setdefault(shape_path, np.broadcast_to(np.asarray(e.view.hf_shape, np.int32),
                                                qarrays[e.path].batch_shape + (2,)))
    entries.append(_Entry(hf_int4.stored_name(name, "weight_shape"), shape_path, e.lead,
                          _same(2)))
  if not qarrays:
    return entries, flat, None
  if len(blocks) != 1:
    raise ValueError(f"INT4 weights with group sizes {sorted(blocks)}: an INT4 checkpoint "
                     "holds one group size")
  return entries, flat, hf_int4.quantization_config(
      blocks.pop(), _target_group(params, qarrays), quantized, ignored)


class _Holdings:
  """Which processes hold a block of a leaf entirely (from the sharding: no communication)."""

  def __init__(self, x):
    import jax  # pylint: disable=g-import-not-at-top
    self.x = x
    if isinstance(x, jax.Array):
      boxes = {}
      for dev, idx in x.sharding.devices_indices_map(x.shape).items():
        boxes.setdefault(dev.process_index, set()).add(tuple(map(tuple, _box(idx, x.shape))))
      self.boxes = boxes
    else:                                             # host array: every process has it
      self.boxes = {p: {tuple((0, n) for n in np.shape(x))} for p in range(jax.process_count())}

  def holders(self, box) -> set[int]:
    vol = math.prod(b - a for a, b in box)
    return {p for p, bs in self.boxes.items()
            if sum(math.prod(max(0, min(b, bb) - max(a, aa)) for (a, b), (aa, bb) in zip(box, sb))
                   for sb in bs) >= vol}


def _local_block(x, box) -> np.ndarray:
  """x[box] from this process's own shards."""
  import jax  # pylint: disable=g-import-not-at-top
  if not isinstance(x, jax.Array):
    return np.asarray(x[tuple(slice(a, b) for a, b in box)])
  out, seen = np.empty([b - a for a, b in box], x.dtype), set()
  for s in x.addressable_shards:
    sb = tuple(map(tuple, _box(s.index, x.shape)))
    inter = [(max(a, aa), min(b, bb)) for (a, b), (aa, bb) in zip(box, sb)]
    if sb in seen or any(a >= b for a, b in inter):
      continue
    seen.add(sb)
    src = tuple(slice(a - aa, b - aa) for (a, b), (aa, _) in zip(inter, sb))
    dst = tuple(slice(a - aa, b - aa) for (a, b), (aa, _) in zip(inter, box))
    out[dst] = _shard_part(s.data, src)
  return out


_SLICE = []


def _shard_part(data, src) -> np.ndarray:
  """data[src] copied to the host; one compiled slice per (shard shape, block shape)."""
  import jax  # pylint: disable=g-import-not-at-top
  sizes = tuple(sl.stop - sl.start for sl in src)
  if sizes == data.shape or next(iter(data.devices())).platform == "cpu":   # host memory
    return np.asarray(data)[src]
  if not _SLICE:
    _SLICE.append(jax.jit(jax.lax.dynamic_slice, static_argnums=2))
  return np.asarray(_SLICE[0](data, np.asarray([sl.start for sl in src], np.int32), sizes))


def _index(a, i):
  return a[tuple(i)]


def _gathered_block(x, lead: tuple) -> np.ndarray:
  """x[lead] replicated to every process (a collective: all processes call it in order)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  if isinstance(x.sharding, jax.sharding.NamedSharding):
    rep = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())
    y = jax.jit(_index, out_shardings=rep)(x, np.asarray(lead, np.int32))
    return np.asarray(y.addressable_data(0))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))[lead]


def _hf_tensor(parts, dtype) -> np.ndarray:
  """One HF tensor from its [(view, ours block)] parts: the inverse of `_read_view`."""
  v0 = parts[0][0]
  split = np.zeros([s for g in v0.groups for s in g], dtype)
  for v, block in parts:
    split[tuple(slice(*b) for b in v.box)] = block.transpose(np.argsort(v.perm))
  return split.reshape(v0.hf_shape)


def _save_plan(entries, flat, max_shard_bytes, n_proc):
  """[(HF name, entries, writer process, gathered?, bytes)] in writing order, and each
  process's files {process: [[HF names]]}; the same on every process (no communication)."""
  by_name: dict[str, list[_Entry]] = {}
  for e in entries:
    by_name.setdefault(e.hf, []).append(e)
  holdings = {p: _Holdings(x) for p, x in flat.items()}
  load, plan = [0] * n_proc, []
  for name, es in by_name.items():
    holders = set(range(n_proc))
    for e in es:
      box = [(i, i + 1) for i in e.lead] + [(0, n) for n in flat[e.path].shape[len(e.lead):]]
      holders &= holdings[e.path].holders(box)
    nbytes = math.prod(es[0].view.hf_shape) * np.dtype(flat[es[0].path].dtype).itemsize
    writer = min(holders or range(n_proc), key=lambda q: (load[q], q))
    load[writer] += nbytes
    plan.append((name, es, writer, not holders, nbytes))
  files: dict[int, list[list[str]]] = {q: [] for q in range(n_proc)}
  size = [max_shard_bytes + 1] * n_proc
  for name, _, writer, _, nbytes in plan:
    if size[writer] + nbytes > max_shard_bytes and size[writer]:
      files[writer].append([])
      size[writer] = 0
    files[writer][-1].append(name)
    size[writer] += nbytes
  return plan, files


def _barrier(name: str):
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices(name)


def save_pretrained(cfg: ModelConfig, params, path: str, *, max_shard_bytes: int = 5 * 2**30):
  """Writes config.json + safetensors shards (+ index) that transformers loads.

  INT4 weights (`quant.QArray` leaves of `quant.quantize_tree`) are written in
  compressed-tensors' pack-quantized layout with a `quantization_config` in config.json
  (glm5_jax/hf_int4.py); `load_pretrained(..., quantized=True)` reads that directory,
  transformers does not.

  `params` may be host arrays or global jax arrays sharded over many processes
  (call it on every process). Each HF tensor goes to one writer process that holds
  it whole in its own shards, or, where none does, is gathered to all processes
  one tensor at a time; each process streams its tensors into its own files;
  process 0 writes config.json and the index. The MTP layer is written as
  `model.layers.{num_hidden_layers}.*` (transformers ignores it; our loader reads it).
  """
  import jax  # pylint: disable=g-import-not-at-top
  me, n_proc = jax.process_index(), jax.process_count()
  entries, flat, quantization = _save_entries(cfg, params)
  plan, files = _save_plan(entries, flat, max_shard_bytes, n_proc)
  names = [(q, chunk) for q in range(n_proc) for chunk in files[q]]
  fname = ({0: _SINGLE} if len(names) == 1 else
           {k: f"model-{k + 1:05d}-of-{len(names):05d}.safetensors" for k in range(len(names))})
  if me == 0:
    os.makedirs(path, exist_ok=True)
    for old in os.listdir(path):
      if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors|" + re.escape(_INDEX), old):
        os.remove(os.path.join(path, old))
    hf_cfg = cfg.to_hf()
    if not any(p[0] == "mtp" for p in flat):
      hf_cfg["num_nextn_predict_layers"] = 0
    if quantization:
      hf_cfg["quantization_config"] = quantization
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(hf_cfg, f, indent=2)
  _barrier("save_pretrained:cleaned")

  info = {name: (es, nbytes) for name, es, _, _, nbytes in plan}
  file_of = {n: k for k, (_, chunk) in enumerate(names) for n in chunk}
  writers: dict[int, sio.Writer] = {}
  for name, es, writer, gather, _ in plan:
    if writer != me and not gather:
      continue
    if gather:
      parts = [(e.view, _gathered_block(flat[e.path], e.lead).reshape(e.view.shape))
               for e in es]
    else:
      parts = [(e.view, _local_block(flat[e.path], [(i, i + 1) for i in e.lead] + [
          (0, n) for n in flat[e.path].shape[len(e.lead):]]).reshape(e.view.shape)) for e in es]
    if writer != me:
      continue
    k = file_of[name]
    if k not in writers:
      writers[k] = sio.Writer(os.path.join(path, fname[k]), [
          (n, info[n][0][0].view.hf_shape, flat[info[n][0][0].path].dtype) for n in names[k][1]])
    writers[k].add(name, _hf_tensor(parts, flat[es[0].path].dtype))
    if name == names[k][1][-1]:
      writers.pop(k).close()
  if me == 0 and len(names) > 1:
    total = sum(nbytes for *_, nbytes in plan)
    with open(os.path.join(path, _INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total},
                 "weight_map": {n: fname[file_of[n]] for n, *_ in plan}}, f, indent=2)
  _barrier("save_pretrained:written")
