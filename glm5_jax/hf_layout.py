"""The Hugging Face checkpoint layout of GLM-5 (`glm_moe_dsa`) as a table of views.

Every parameter leaf is a table of *views* of HF tensors: leaf[lead] =
HF.reshape(split)[box].transpose(perm), `lead` the stacked `layers` axis (and the
expert axis for per-expert tensors). A requested block of a leaf reads only the rows
of the HF tensors it needs (`safetensors_io.read_rows`), so a process loading onto a
mesh holds its own shards plus one tensor (docs/checkpoints.md). Saving inverts the
views one HF tensor at a time.

`entries(cfg, mtp=...)` lists every HF tensor with its parameter path and view; `leaves`
groups them into one table per parameter leaf. hf_load.py reads through the table, hf_save.py
writes through it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from glm5_jax.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# DeepSeek-V3 stores these in its MTP layer; GLM checkpoints reuse the main ones.
MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


# --------------------------------------------------------------------------------------
# Views: one parameter block as a reshaped, sliced, transposed HF tensor
# --------------------------------------------------------------------------------------

class View(NamedTuple):
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


def _view(groups, perm, box=None) -> View:
  split = [s for g in groups for s in g]
  box = box or {}
  return View(tuple(map(tuple, groups)), tuple(box.get(i, (0, s)) for i, s in enumerate(split)),
               tuple(perm))


def same(*shape) -> View:
  return _view([(s,) for s in shape], range(len(shape)))


def _t(out: int, inp: int) -> View:
  """torch Linear [out, in] -> ours [in, out]."""
  return _view([(out,), (inp,)], (1, 0))


def stored_view(v: View, n_in: int) -> View:
  """The view of a quantized weight's stored tensor [out, n_in] (packed words, scales;
  hf_int4.py) whose float weight has view `v`: ours [n_in, *out axes], the reduction axes
  flattened into one. `v` must map HF [out, in] to ours [*in split axes, *out split axes]
  with `in` whole (every quantization target's view does)."""
  k = len(v.groups[0])
  n_red = len(v.groups[1]) if len(v.groups) == 2 else 0
  if (len(v.groups) != 2 or tuple(v.perm) != tuple(range(k, k + n_red)) + tuple(range(k))
      or v.box[k:] != tuple((0, s) for s in v.groups[1])):
    raise AssertionError(f"view {v} is not a torch Linear [out, in] seen as [in, out]")
  return View((v.groups[0], (n_in,)), v.box[:k] + ((0, n_in),), (k,) + tuple(range(k)))


class Entry(NamedTuple):
  hf: str          # HF tensor name
  path: tuple      # our leaf path in the model's (stacked) tree
  lead: tuple      # index into the leaf's leading axes (layers, experts)
  view: View


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
      (f"{hf}.input_layernorm.weight", ("input_norm", "scale"), same(d)),
      (f"{hf}.post_attention_layernorm.weight", ("post_attention_norm", "scale"), same(d)),
      (f"{a}.q_a_proj.weight", ("attn", "wq_a"), _t(r, d)),
      (f"{a}.q_a_layernorm.weight", ("attn", "q_norm", "scale"), same(r)),
      (f"{a}.q_b_proj.weight", ("attn", "wq_b"), _view([(h, n + p), (r,)], (2, 0, 1))),
      (f"{a}.kv_a_proj_with_mqa.weight", ("attn", "wkv_a"), _t(c + p, d)),
      (f"{a}.kv_a_layernorm.weight", ("attn", "kv_norm", "scale"), same(c)),
      (f"{a}.kv_b_proj.weight", ("attn", "w_uk"), _view(kv_b, (2, 0, 1), {1: (0, n)})),
      (f"{a}.kv_b_proj.weight", ("attn", "w_uv"), _view(kv_b, (2, 0, 1), {1: (n, n + v)})),
      (f"{a}.o_proj.weight", ("attn", "wo"), _view([(d,), (h, v)], (1, 2, 0))),
  ]
  if indexer:
    table += [
        (f"{a}.indexer.wq_b.weight", ("attn", "indexer", "wq_b"),
         _view([(hi, di), (r,)], (2, 0, 1))),
        (f"{a}.indexer.wk.weight", ("attn", "indexer", "wk"), _t(di, d)),
        (f"{a}.indexer.k_norm.weight", ("attn", "indexer", "k_norm", "scale"), same(di)),
        (f"{a}.indexer.k_norm.bias", ("attn", "indexer", "k_norm", "bias"), same(di)),
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
               same(e))]
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
        yield from (Entry(f"{m}.experts.{x}.{q}_proj.weight", path + ("moe", "experts", f"w_{q}"),
                           lead + (x,), w)
                    for q, w in (("gate", _t(i, d)), ("up", _t(i, d)), ("down", _t(d, i))))
  yield from (Entry(name, path + rest, lead, w) for name, rest, w in table)


def entries(cfg: ModelConfig, *, mtp: bool, fused=frozenset()) -> list[Entry]:
  """All entries of the model; layers whose HF prefix is in `fused` use the fused experts."""
  from glm5_jax.nn import layer_stack  # pylint: disable=g-import-not-at-top
  d, vocab = cfg.hidden_size, cfg.vocab_size
  out = [Entry("model.embed_tokens.weight", ("embed", "embedding"), (), same(vocab, d)),
         Entry("model.norm.weight", ("final_norm", "scale"), (), same(d)),
         Entry("lm_head.weight", ("lm_head", "kernel"), (), _t(vocab, d))]
  for i in range(cfg.num_hidden_layers):
    stack, rep, j = layer_stack.locate(cfg, i)
    hf = f"model.layers.{i}"
    out += _layer_entries(cfg, hf, (stack, f"layer_{j}"), (rep,), cfg.is_moe_layer(i),
                          cfg.indexer_type(i) == "full", hf in fused)
  if mtp:
    L = cfg.num_hidden_layers
    hf = f"model.layers.{L}"
    out += _layer_entries(cfg, hf, ("mtp", "layer"), (), cfg.is_moe_layer(L), True, hf in fused)
    out += [Entry(f"{hf}.enorm.weight", ("mtp", "enorm", "scale"), (), same(d)),
            Entry(f"{hf}.hnorm.weight", ("mtp", "hnorm", "scale"), (), same(d)),
            Entry(f"{hf}.eh_proj.weight", ("mtp", "eh_proj"), (), _t(d, 2 * d)),
            Entry(f"{hf}.shared_head.norm.weight", ("mtp", "head_norm", "scale"), (), same(d))]
  return out


def leaves(entries) -> dict[tuple, np.ndarray]:
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


def leaf_shape(table: np.ndarray) -> tuple:
  return table.shape + table.flat[0][1].shape

def index_box(index, shape):
  """[(start, stop)] per axis of `shape` that `index` (ints and slices, leading axes) selects."""
  return [s.indices(n)[:2] if isinstance(s, slice) else (s, s + 1)
          for s, n in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape)]
