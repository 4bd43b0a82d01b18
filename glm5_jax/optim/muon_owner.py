"""Owner-computes Newton–Schulz: Muon without redundant orthogonalization under a mesh.

GLM-5's pre-training infrastructure (arXiv 2602.15763, §2, "Muon zero-redundant
communication"): each rank gathers and orthogonalizes only the matrices it owns, instead of
every rank working on every full matrix. Here a *block* is one matrix Newton–Schulz acts on:
one head's `[rank, head_dim]` of W^UQ/W^UK/W^UV (Muon Split), one expert, one layer of a
stack, or a whole matrix; heads, experts and stacked layers are batch axes (`pg.Rule.dims`).

Replicated (GSPMD on the sharded leaves, `muon_split.scale_by_muon`'s default): a block
whose fan-in or fan-out is sharded is orthogonalized by all of its devices at once, with the
m x m Gram products all-reduced at every Newton–Schulz step (6 all-reduces per block).

Owner (this module), per shape bucket: the blocks of one `[m, n]` shape and dtype whose
pieces lie over the same mesh axes (the `g` devices that shard fan-in and fan-out), across
all leaves, heads, experts and layers. Inside one `shard_map` over the mesh:

  1. Every device lists its pieces of the bucket's blocks, `[NB, m / g_m, n / g_n]` (each
     leaf transposed to batch, fan-in, fan-out axes, as optax's Newton–Schulz reshapes it),
     padded with zero blocks to `T x g x c`.
  2. Per round (`lax.map` over T, about one layer's blocks per round, so memory stays that
     of a per-layer loop): one `all_to_all` over the g devices sends the pieces of block
     chunk j to device j, which then holds c whole blocks.
  3. The owner runs Newton–Schulz on its c blocks (a zero block stays zero).
  4. One `all_to_all` returns the pieces; the list is cut back into the leaves, each in its
     own sharding.

Blocks are dealt out in equal counts per bucket (equal shapes: equal FLOPs; `plan` reports
the padding). A block whose fan-in and fan-out are unsharded (heads over `tensor`, experts
over `expert`, fan-in whole) is local: it is orthogonalized in place, nothing moves, as in
the replicated mode. Devices that hold copies of the same pieces (mesh axes that shard
neither the block nor its batch axes) repeat the same work. A leaf whose block is sharded on
a minor axis of a multi-axis fan-in or fan-out (its pieces are not contiguous rows) keeps
the replicated path.

The optimizer state is the same arrays in the same shardings in both modes: only the
update's computation differs, so checkpoints are interchangeable.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class Layout(NamedTuple):
  """One leaf seen as blocks: transpose `perm` to (batch, fan-in, fan-out), `nb` local blocks
  of `[m, n]` (whole), pieces over mesh axes `m_axes` (fan-in) and `n_axes` (fan-out)."""
  perm: tuple[int, ...]
  m: int
  n: int
  m_axes: tuple[str, ...]
  n_axes: tuple[str, ...]
  n_batch: int     # leading axes of the transposed leaf that are batch axes

  @property
  def axes(self) -> tuple[str, ...]:
    return self.m_axes + self.n_axes


class Bucket(NamedTuple):
  """Blocks of one shape, dtype and piece layout; `leaves` index the flat leaf list."""
  leaves: tuple[int, ...]
  m: int
  n: int
  dtype: Any
  m_axes: tuple[str, ...]
  n_axes: tuple[str, ...]
  g_m: int
  g_n: int
  nb: int          # blocks one device lists (its pieces), before padding
  rounds: int      # T
  per_owner: int   # c: blocks each owner orthogonalizes per round

  @property
  def g(self) -> int:
    return self.g_m * self.g_n

  @property
  def padded(self) -> int:
    return self.rounds * self.g * self.per_owner


def _axes(a) -> tuple[int, ...]:
  return (a,) if isinstance(a, int) else tuple(a)


def _entry_axes(entry, mesh) -> tuple[str, ...]:
  """Mesh axes (of size > 1) of one PartitionSpec entry."""
  names = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
  return tuple(a for a in names if mesh.shape[a] > 1)


def layout(shape: Sequence[int], dims, sharding) -> Layout | None:
  """The block layout of one leaf of `shape` with NS dims `dims` (stack axes counted as batch
  axes) in `sharding`; None when its blocks cannot be dealt out (not a NamedSharding, or a
  minor axis of a multi-axis fan-in / fan-out is sharded)."""
  if not isinstance(sharding, NamedSharding):
    return None
  nd, mesh = len(shape), sharding.mesh
  red = tuple(a % nd for a in _axes(dims.reduction_axis))
  out = tuple(a % nd for a in _axes(dims.output_axis))
  batch = tuple(a for a in range(nd) if a not in red + out)
  spec = tuple(sharding.spec) + (None,) * (nd - len(sharding.spec))
  per_dim = [_entry_axes(e, mesh) for e in spec]
  if any(per_dim[a] for a in red[1:] + out[1:]):
    return None
  return Layout(perm=batch + red + out, m=math.prod(shape[a] for a in red),
                n=math.prod(shape[a] for a in out), m_axes=per_dim[red[0]],
                n_axes=per_dim[out[0]], n_batch=len(batch))


def _size(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def plan(shapes: Sequence[Any], dims: Sequence[Any], shardings: Sequence[Any],
         depth: Sequence[int]) -> tuple[list[Bucket], list[int]]:
  """Buckets of the leaves whose blocks are sharded, and the indices of the other (local or
  not dealable) leaves. `shapes[i]` has `.shape` and `.dtype`; `depth[i]` is the leaf's
  stack depth (layers), which sets about one layer's blocks per round."""
  groups: dict[tuple, list[int]] = {}
  local = []
  for i, (x, d, s) in enumerate(zip(shapes, dims, shardings)):
    lay = layout(x.shape, d, s)
    if lay is None or not lay.axes:
      local.append(i)
      continue
    key = (lay.m, lay.n, jnp.dtype(x.dtype).name, lay.m_axes, lay.n_axes, id(s.mesh))
    groups.setdefault(key, []).append(i)
  buckets = []
  for (m, n, dtype, m_axes, n_axes, _), idx in groups.items():
    mesh = shardings[idx[0]].mesh
    nb = 0
    for i in idx:
      lay = layout(shapes[i].shape, dims[i], shardings[i])
      shard = shardings[i].shard_shape(tuple(shapes[i].shape))
      nb += math.prod(shard[a] for a in lay.perm[:lay.n_batch])
    g = _size(mesh, m_axes) * _size(mesh, n_axes)
    rounds0 = max([1] + [depth[i] for i in idx])
    c = max(1, -(-nb // (g * rounds0)))
    buckets.append(Bucket(tuple(idx), m, n, jnp.dtype(dtype), m_axes, n_axes,
                          _size(mesh, m_axes), _size(mesh, n_axes), nb,
                          -(-nb // (g * c)), c))
  return buckets, local


def ns_flops(m: int, n: int, steps: int = 5) -> int:
  """Multiply-add FLOPs of quintic Newton–Schulz on one [m, n] block (a = min, b = max):
  per step A = X Xᵀ (2a²b), A² (2a³), (bA + cA²) X (2a²b)."""
  a, b = min(m, n), max(m, n)
  return steps * (4 * a * a * b + 2 * a ** 3)


def orthogonalize(leaves: Sequence[jax.Array], dims: Sequence[Any], shardings: Sequence[Any],
                  depth: Sequence[int], ns_2d: Callable[[jax.Array], jax.Array],
                  local_fn: Callable[[int], jax.Array]) -> list[jax.Array]:
  """Newton–Schulz of every leaf, owner-computes where its blocks are sharded.

  leaves: the (bias-corrected) momenta; dims: each leaf's MuonDimensionNumbers with its stack
  axes as batch axes; shardings: each leaf's (parameter's) sharding; depth: stack depth per
  leaf; ns_2d: NS of one [m, n] block; local_fn(i): leaf i orthogonalized in place.
  """
  buckets, local = plan(leaves, dims, shardings, depth)
  out: list[Any] = [None] * len(leaves)
  for i in local:
    out[i] = local_fn(i)
  for b in buckets:
    for i, y in zip(b.leaves, _run_bucket(b, [leaves[i] for i in b.leaves],
                                          [dims[i] for i in b.leaves],
                                          [shardings[i] for i in b.leaves], ns_2d)):
      out[i] = y
  return out


def _run_bucket(b: Bucket, xs, dims, shardings, ns_2d):
  mesh = shardings[0].mesh
  lays = [layout(x.shape, d, s) for x, d, s in zip(xs, dims, shardings)]
  m_loc, n_loc = b.m // b.g_m, b.n // b.g_n
  axes = b.m_axes + b.n_axes

  def body(*local):
    flat, shapes_t = [], []
    for x, lay in zip(local, lays):
      xt = jnp.transpose(x, lay.perm)
      flat.append(xt.reshape(-1, m_loc, n_loc))
      shapes_t.append(xt.shape)
    blocks = jnp.concatenate(flat) if len(flat) > 1 else flat[0]
    blocks = jnp.pad(blocks, ((0, b.padded - blocks.shape[0]), (0, 0), (0, 0)))
    rounds = blocks.reshape(b.rounds, b.g, b.per_owner, m_loc, n_loc)

    def one_round(pieces):                      # [g, c, m_loc, n_loc] of my blocks
      got = jax.lax.all_to_all(pieces, axes, 0, 0, tiled=True)   # chunk of device j's
      whole = got.reshape(b.g_m, b.g_n, b.per_owner, m_loc, n_loc)
      whole = whole.transpose(2, 0, 3, 1, 4).reshape(b.per_owner, b.m, b.n)
      orth = jax.vmap(ns_2d)(whole)
      back = orth.reshape(b.per_owner, b.g_m, m_loc, b.g_n, n_loc).transpose(1, 3, 0, 2, 4)
      return jax.lax.all_to_all(back.reshape(b.g, b.per_owner, m_loc, n_loc), axes, 0, 0,
                                tiled=True)

    done = jax.lax.map(one_round, rounds).reshape(b.padded, m_loc, n_loc)
    res, start = [], 0
    for shape_t, lay in zip(shapes_t, lays):
      cnt = math.prod(shape_t) // (m_loc * n_loc)
      y = done[start:start + cnt].reshape(shape_t)
      res.append(jnp.transpose(y, _inverse(lay.perm)))
      start += cnt
    return tuple(res)

  specs = tuple(P(*s.spec) for s in shardings)
  fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False)
  return fn(*xs)


def _inverse(perm):
  return tuple(sorted(range(len(perm)), key=lambda i: perm[i]))
