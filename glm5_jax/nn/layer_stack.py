"""Scanned decoder layers: the layer stack runs under `nn.scan`, parameters stacked on `layers`.

A Python loop over 78 layers makes the program, and its compile time, grow with depth;
a scan compiles one layer (MaxText scans its layers for the same reason). Layers of a
different structure cannot share one scan, so the layers are split into stacks:

    dense_layers   layers 0 .. first_k_dense_replace-1 (dense SwiGLU FFN)
    moe_layers     the rest (MoE FFN)

and each stack scans over a repeating *block*: the shortest run of layer kinds
(FFN kind, own indexer or IndexShare "shared") that tiles the stack. Every GLM-5 layer
has its own indexer, so a block is one layer; an IndexShare pattern ("full", "shared",
"shared", "shared", ...) gives a block of four layers, scanned `repeats` times.

Parameter tree: `{stack}/layer_{j}/...` is block position j, each leaf with a leading
`layers` axis of size `repeats` (logical axis "layers"). Global layer i of a stack
starting at `first` is repeat `(i - first) // len(block)`, position `(i - first) % len(block)`.
`layer_params(cfg, params, i)` slices out one layer's tree (the inference engine and the
Hugging Face converter use it), `stack_layers` builds the stacked tree from per-layer trees.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.nn import decoder as decoder_lib
from glm5_jax.nn import indexer as indexer_lib
from glm5_jax.nn import kv_cache
from glm5_jax.nn import layer_io
from glm5_jax.nn import params as P

LAYERS_AXIS = "layers"              # logical name of the stacked axis
STACK_NAMES = ("dense_layers", "moe_layers")


class LayerKind(NamedTuple):
  moe: bool
  has_indexer: bool


class LayerStack(NamedTuple):
  """`repeats` copies of `block`, covering layers first .. first + repeats * len(block) - 1."""
  name: str
  first: int
  repeats: int
  block: tuple[LayerKind, ...]

  @property
  def num_layers(self) -> int:
    return self.repeats * len(self.block)


def layer_kind(cfg, i: int) -> LayerKind:
  return LayerKind(moe=cfg.is_moe_layer(i), has_indexer=cfg.indexer_type(i) == "full")


def _period(kinds: Sequence[LayerKind]) -> int:
  """Length of the shortest block that tiles `kinds` exactly."""
  n = len(kinds)
  return next(p for p in range(1, n + 1)
              if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))


def layer_stacks(cfg) -> tuple[LayerStack, ...]:
  """The stacks of `cfg`'s decoder layers (the MTP layer is not part of any stack)."""
  split = cfg.first_k_dense_replace
  stacks = []
  for name, lo, hi in ((STACK_NAMES[0], 0, split), (STACK_NAMES[1], split, cfg.num_hidden_layers)):
    if hi > lo:
      kinds = [layer_kind(cfg, i) for i in range(lo, hi)]
      p = _period(kinds)
      stacks.append(LayerStack(name, lo, (hi - lo) // p, tuple(kinds[:p])))
  return tuple(stacks)


def locate(cfg, i: int) -> tuple[str, int, int]:
  """(stack name, repeat, block position) of decoder layer i."""
  if not 0 <= i < cfg.num_hidden_layers:
    raise ValueError(f"layer {i} is outside [0, num_hidden_layers={cfg.num_hidden_layers})")
  for st in layer_stacks(cfg):
    if st.first <= i < st.first + st.num_layers:
      r, j = divmod(i - st.first, len(st.block))
      return st.name, r, j
  raise AssertionError(f"layer {i} in no stack")


def layer_params(cfg, params, i: int):
  """Decoder layer i's parameter tree (the layout of one `DecoderLayer`), sliced from the stack."""
  name, r, j = locate(cfg, i)
  return jax.tree_util.tree_map(lambda x: x[r], params[name][f"layer_{j}"])


def stack_layers(cfg, per_layer: Sequence[Any], stack=np.stack):
  """{stack name: {layer_j: stacked tree}} from the L per-layer trees (numpy by default)."""
  out = {}
  for st in layer_stacks(cfg):
    p = len(st.block)
    out[st.name] = {
        f"layer_{j}": jax.tree_util.tree_map(
            lambda *xs: stack(xs),
            *[per_layer[st.first + r * p + j] for r in range(st.repeats)])
        for j in range(p)}
  return out


class LayerBlock(nn.Module):
  """One repeat of a stack's block: the body of the scan.

  carry: (h [b,t,d], top-k indices [b,t,k] int32 or None, the stack's KV pools or None).
  Outputs per repeat: a LayerAux (nn/layer_io.py) stacked over the block's layers: the
  indexer KL of each layer `[p]` (0 where the layer has none), the expert load of each MoE
  layer `[p_moe, E]`, with `return_routing` the routed experts of each MoE layer
  `[p_moe, b, t, K]`, with `return_topk` the top-k of each layer `[p, b, t, k]`. The KV
  pools ([R, N, x] per block layer, nn/kv_cache.py) ride in the carry whole: `repeat`
  (int32 [], this repeat's index) is the entry each layer writes and reads in place
  (`CacheIndex.layer`). `replay`: [p_moe, b, t, K] experts each MoE layer of the block uses
  (routing replay), or None. `experts`: with a cache, {block layer name: (w_gate, w_up,
  w_down)} the stack's routed experts whole [R, E, ...]: each MoE layer reads its own
  experts out of them at `repeat` (`stack_experts`).
  """
  cfg: Any
  block: tuple[LayerKind, ...]
  return_topk: bool = False
  return_routing: bool = False

  @nn.compact
  def __call__(self, carry, inputs: layer_io.LayerInputs, repeat, replay, experts=None):
    h, indices, cache = carry
    layer_cls = decoder_lib.remat_layer(self.cfg)
    if cache is not None:
      inputs = inputs.replace(cache_index=inputs.cache_index._replace(layer=repeat))
    kls, loads, topk, routing, caches = [], [], [], [], {}
    for j, kind in enumerate(self.block):
      name = f"layer_{j}"
      rep = None if replay is None or not kind.moe else replay[len(loads)]
      stack = (experts[name], repeat) if experts and name in experts else None
      h, aux, caches[name] = layer_cls(
          self.cfg, moe=kind.moe, has_indexer=kind.has_indexer, name=name)(
              h, inputs, prev_indices=indices, cache=None if cache is None else cache[name],
              replay=rep, experts_stack=stack)
      indices = aux.topk_indices if aux.topk_indices is not None else indices
      kls.append(jnp.zeros((), jnp.float32) if aux.indexer_kl is None else aux.indexer_kl)
      if aux.expert_load is not None:
        loads.append(aux.expert_load)
        routing.append(aux.routing)
      topk.append(aux.topk_indices)
    return (h, indices, None if cache is None else caches), layer_io.LayerAux(
        indexer_kl=jnp.stack(kls),
        expert_load=jnp.stack(loads) if loads else None,
        routing=jnp.stack(routing) if self.return_routing and routing else None,
        topk_indices=jnp.stack(topk) if self.return_topk and topk[0] is not None else None)


def scanned(stack: LayerStack):
  """`LayerBlock` scanned `stack.repeats` times, parameters stacked on the `layers` axis (the
  engine's streamed weights: their stacks broadcast whole, their layer indices scanned,
  nn/params.py `dense`)."""
  return nn.scan(LayerBlock, variable_axes={"params": 0, "intermediates": 0, P.STREAM_LAYER: 0},
                 variable_broadcast=P.STREAM_W, split_rngs={"params": True},
                 in_axes=(nn.broadcast, 0, 0, nn.broadcast),
                 length=stack.repeats, metadata_params={nn.PARTITION_NAME: LAYERS_AXIS})


def stack_experts(module: nn.Module, st: LayerStack):
  """{block layer name: (w_gate, w_up, w_down)}: the routed experts of the stack `st` of
  `module` (bound, its parameters present), whole [R, E, ...]. The engine's forward passes
  them into the scan beside the sliced parameters: on XLA:CPU its expert loop
  (`ffn.looped_swiglu`) then copies the experts a step uses, not the layer's whole stack
  (48 MB per MoE layer of `small`, every step)."""
  params = module.variables.get("params", {}).get(st.name)
  if params is None:
    return None
  return {f"layer_{j}": tuple(params[f"layer_{j}"]["moe"]["experts"][w]
                              for w in ("w_gate", "w_up", "w_down"))
          for j, kind in enumerate(st.block) if kind.moe}


def num_moe_layers(cfg) -> int:
  """MoE decoder layers (the MTP layer not counted)."""
  return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def run_stacks(module: nn.Module, cfg, h, inputs: layer_io.LayerInputs, *, return_topk,
               cache=None, return_routing=False, replay=None):
  """All decoder layers of `cfg`, one scan per stack, as submodules of `module`.

  cache: {stack name: stacked per-layer pools} (nn/kv_cache.py), read and written in place.
  replay: int32 [L_moe, b, t, K] experts of every MoE layer in layer order (routing replay;
    rows of -1 route as usual), or None.

  Returns (h, LayerAux over all layers, updated cache or None). The LayerAux holds the
  indexer KL [L] (0 on layers without one), the expert load [L_moe, E], the top-k as a
  tuple of L entries [b, t, k] (None under dense attention) and, with `return_routing`,
  the routed experts [L_moe, b, t, K] int32.
  """
  b, t, _ = h.shape
  s = t if inputs.cache_index is None else inputs.cache_index.read_bs.shape[1]  # keys seen
  indices = (jnp.full((b, t, indexer_lib.num_slots(cfg.index_topk, s)), -1, jnp.int32)
             if cfg.attention_type == "sparse" else None)
  kls, loads, topk, routing, new_cache = [], [], [], [], {}
  row = 0
  for st in layer_stacks(cfg):
    n_moe = sum(kind.moe for kind in st.block)
    rep = None
    if replay is not None and n_moe:
      rep = replay[row:row + st.repeats * n_moe]
      rep = rep.reshape(st.repeats, n_moe, *rep.shape[1:])
    row += st.repeats * n_moe
    block = scanned(st)(cfg, st.block, return_topk, return_routing, name=st.name,
                        parent=module)
    pools = None if cache is None else cache[st.name]
    repeats = None if cache is None else jnp.arange(st.repeats, dtype=jnp.int32)
    experts = None if cache is None else stack_experts(module, st)
    (h, indices, pools), ys = block((h, indices, pools), inputs, repeats, rep, experts)
    if cache is not None:
      new_cache[st.name] = pools
    kls.append(ys.indexer_kl.reshape(-1))
    if ys.expert_load is not None:
      loads.append(ys.expert_load.reshape(-1, ys.expert_load.shape[-1]))
    if ys.routing is not None:
      routing.append(ys.routing.reshape(-1, *ys.routing.shape[2:]))
    if ys.topk_indices is not None:
      topk.extend(list(ys.topk_indices.reshape(-1, *ys.topk_indices.shape[2:])))
    else:
      topk.extend([None] * st.num_layers)
  load = (jnp.concatenate(loads) if loads
          else jnp.zeros((0, cfg.n_routed_experts), jnp.float32))
  aux = layer_io.LayerAux(indexer_kl=jnp.concatenate(kls), expert_load=load,
                          routing=jnp.concatenate(routing) if routing else None,
                          topk_indices=tuple(topk))
  return h, aux, (new_cache if cache is not None else None)


def init_cache(cfg, num_rows: int, with_mtp: bool = False, kv_dtype=None):
  """An empty pool of `num_rows` rows for every decoder layer (and the MTP layer); the latent
  rows in `kv_dtype` (default cfg.dtype)."""
  layers = {}
  for st in layer_stacks(cfg):
    layers[st.name] = {
        f"layer_{j}": kv_cache.layer_cache(cfg, num_rows, kind.has_indexer, (st.repeats,),
                                           kv_dtype)
        for j, kind in enumerate(st.block)}
  with_mtp = with_mtp and cfg.num_nextn_predict_layers
  mtp = kv_cache.layer_cache(cfg, num_rows, True, kv_dtype=kv_dtype) if with_mtp else None
  return {"layers": layers, "mtp": mtp}
