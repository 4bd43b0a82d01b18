"""Expert parallelism: dropless all-to-all token dispatch inside `shard_map` (docs/design.md decision 7).

Tokens are split over the batch axes (`data, fsdp, expert`), routed experts over
`expert` (E / ep per device). On each device:

  1. group its (token, expert) pairs by destination shard (expert id // E_local);
  2. `all_to_all` over `expert`: every destination gets a [capacity, d] block from
     every source. By default capacity = n_local * K, the worst case, so nothing is ever
     dropped (dropless, like the single-device path; memory ep x the routed rows: at
     GLM-5's ep 8, K 8, d 6144, 768 KiB per local token per buffer, 83 GiB per MoE layer's
     forward + backward at 25K tokens per device; docs/long_context.md). With
     `capacity_factor` c > 0, capacity = ceil(c * n_local * K / ep) (GShard / Switch
     Transformer): a source sends at most that many pairs to each destination, in token
     order, and the rest are dropped (they add nothing to the output; the router's
     load-balancing keeps c ~ 1.25 nearly dropless). `kept_pairs` says which pairs stay;
  3. run the local experts with `ffn.ragged_swiglu` (sort + `ragged_dot`) on every
     platform, padding rows last (ragged_dot leaves rows past sum(group_sizes) at zero);
  4. `all_to_all` the results back and combine them with the routing weights.

Weights enter replicated over the non-expert axes (GSPMD gathers fsdp/tensor
shards before the shard_map). Gradients flow through `all_to_all` (its own
transpose), the gathers and `ragged_dot`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glm5_jax import sharding as shd
from glm5_jax.nn import ffn

EXPERT_AXIS = "expert"


def expert_parallel_size() -> int:
  """The `expert` axis size of the mesh set with `jax.set_mesh` (1 without one)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  return dict(mesh.shape).get(EXPERT_AXIS, 1)


def capacity(n_local: int, k: int, ep: int, capacity_factor: float) -> int:
  """Rows each source sends each destination: n_local * K (dropless) when capacity_factor
  <= 0, else ceil(capacity_factor * n_local * K / ep), at most n_local * K."""
  pairs = n_local * k
  if capacity_factor <= 0:
    return pairs
  return min(pairs, math.ceil(capacity_factor * pairs / ep))


def dispatch_slots(ids_nk, e_loc: int, ep: int):
  """(order, dest_s, slot): pairs sorted by destination shard (stable: token order), each
  pair's destination and its row in that destination's block."""
  flat = ids_nk.reshape(-1)
  dest = flat // e_loc
  order = jnp.argsort(dest, stable=True)
  dest_s = dest[order]
  counts = jnp.bincount(dest, length=ep)
  slot = jnp.arange(flat.shape[0]) - (jnp.cumsum(counts) - counts)[dest_s]
  return order, dest_s, slot


def kept_pairs(ids_nk, n_experts: int, ep: int, n_shards: int, capacity_factor: float):
  """bool [n, K]: the (token, expert) pairs a capacity keeps, tokens split over `n_shards`
  equal contiguous blocks (the dispatch's token sharding)."""
  n, k = ids_nk.shape
  blocks = ids_nk.reshape(n_shards, n // n_shards, k)
  cap = capacity(n // n_shards, k, ep, capacity_factor)

  def one(ids):
    order, _, slot = dispatch_slots(ids, n_experts // ep, ep)
    return jnp.zeros(ids.size, bool).at[order].set(slot < cap).reshape(ids.shape)
  return jax.vmap(one)(blocks).reshape(n, k)


def _local_dispatch(x_nd, ids_nk, wts_nk, wg, wu, wd, *, capacity_factor: float):
  """Per-device body (inside shard_map): returns (y [n, d], global tokens per expert [E])."""
  ep = jax.lax.axis_size(EXPERT_AXIS)
  e_loc = wg.shape[0]
  n, k = ids_nk.shape
  d = x_nd.shape[-1]
  cap = capacity(n, k, ep, capacity_factor)
  flat = ids_nk.reshape(-1)
  order, dest_s, slot = dispatch_slots(ids_nk, e_loc, ep)
  kept = slot < cap                                           # rows past capacity drop
  token_of = order // k
  send_x = jnp.zeros((ep, cap, d), x_nd.dtype).at[dest_s, slot].set(x_nd[token_of],
                                                                    mode="drop")
  send_e = jnp.full((ep, cap), e_loc, jnp.int32).at[dest_s, slot].set(flat[order] % e_loc,
                                                                      mode="drop")

  recv_x = jax.lax.all_to_all(send_x, EXPERT_AXIS, 0, 0).reshape(ep * cap, d)
  recv_e = jax.lax.all_to_all(send_e, EXPERT_AXIS, 0, 0).reshape(ep * cap)
  # The local experts on the received rows: one expert per row, weight 1; padding rows
  # (id e_loc) sort last, fall outside every group and come back as zeros.
  ys, _ = ffn.ragged_swiglu(recv_x, recv_e[:, None], jnp.ones((ep * cap, 1), recv_x.dtype),
                            wg, wu, wd)
  ys = ys.reshape(ep, cap, d)

  back = jax.lax.all_to_all(ys, EXPERT_AXIS, 0, 0)            # back[j] = my rows sent to j
  wts = jnp.where(kept, wts_nk.reshape(-1)[order], 0)
  rows = back[dest_s, jnp.minimum(slot, cap - 1)] * wts[:, None].astype(ys.dtype)
  y = jnp.zeros_like(x_nd).at[token_of].add(rows)
  per_expert = jax.lax.psum(jnp.bincount(flat, length=e_loc * ep), shd.TOKEN_AXES)
  return y, per_expert


def ep_grouped_swiglu(x_nd, ids_nk, weights_nk, w_gate_edi, w_up_edi, w_down_eid, *,
                      capacity_factor: float = 0.0):
  """Same contract as `ffn.ragged_swiglu`, with experts sharded over `expert`.

  Needs a mesh set with `jax.set_mesh` that has the axes of `sharding.MESH_AXES`.
  `capacity_factor` <= 0: dropless; > 0: per-destination capacity (module docstring).
  Returns (y [n, d], tokens per expert int32 [E]) (routed, before any drop).
  """
  tok = P(shd.TOKEN_AXES, None)
  exp = P(EXPERT_AXIS, None, None)
  fn = jax.shard_map(functools.partial(_local_dispatch, capacity_factor=capacity_factor),
                     in_specs=(tok, tok, tok, exp, exp, exp),
                     out_specs=(tok, P()), check_vma=False)
  return fn(x_nd, ids_nk, weights_nk, w_gate_edi, w_up_edi, w_down_eid)
