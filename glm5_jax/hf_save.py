"""Writing Hugging Face GLM-5 checkpoints, one HF tensor at a time, from any process layout
(glm5_jax/hf.py).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import numpy as np

from glm5_jax import hf_layout as layout
from glm5_jax import safetensors_io as sio
from glm5_jax.config import ModelConfig


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
  `X.weight_scale` read the leaf's words and scales through `layout.stored_view`s, `X.weight_shape`
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
  by_name: dict[str, list[layout.Entry]] = {}
  for e in layout.entries(cfg, mtp=has_mtp):
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
      entries += [layout.Entry(hf_int4.stored_name(name, "weight_packed"),
                               e.path + ("weight_packed",), e.lead,
                               layout.stored_view(e.view, n_in // hf_int4.PER_WORD)),
                  layout.Entry(hf_int4.stored_name(name, "weight_scale"),
                               e.path + ("weight_scale",), e.lead,
                               layout.stored_view(e.view, n_in // qa.block))]
    e = es[0]
    shape_path = e.path + ("weight_shape",)
    flat.setdefault(shape_path, np.broadcast_to(np.asarray(e.view.hf_shape, np.int32),
                                                qarrays[e.path].batch_shape + (2,)))
    entries.append(layout.Entry(hf_int4.stored_name(name, "weight_shape"), shape_path, e.lead,
                                layout.same(2)))
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
        box = tuple(map(tuple, layout.index_box(idx, x.shape)))
        boxes.setdefault(dev.process_index, set()).add(box)
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
    sb = tuple(map(tuple, layout.index_box(s.index, x.shape)))
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
  by_name: dict[str, list[layout.Entry]] = {}
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
  fname = ({0: layout.SINGLE_FILE} if len(names) == 1 else
           {k: f"model-{k + 1:05d}-of-{len(names):05d}.safetensors" for k in range(len(names))})
  if me == 0:
    os.makedirs(path, exist_ok=True)
    for old in os.listdir(path):
      if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors|" + re.escape(layout.INDEX_FILE), old):
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
    with open(os.path.join(path, layout.INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": total},
                 "weight_map": {n: fname[file_of[n]] for n, *_ in plan}}, f, indent=2)
  _barrier("save_pretrained:written")
