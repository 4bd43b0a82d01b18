"""Owner-computes Newton–Schulz: Muon without redundant orthogonalization under a mesh.

GLM-5's pre-training infrastructure (arXiv 2602.15763, §2, "Muon zero-redundant
communication"): each rank gathers and orthogonalizes only the matrices it owns, instead of
every rank working on every full matrix. Here a *block* is one matrix Newton–Schulz acts on:
one head's `[rank, head_dim]` of W^UQ/W^UK/W^UV (Muon Split), one expert, one layer of a
stack, or a whole matrix; heads, experts and stacked layers are batch axes (`pg.Rule.dims`).

Replicated (GSPMD on the sharded leaves, `muon_split.scale_by_muon`'s default): a block
whose fan-in or fan-out is sharded is orthogonalized by all of its devices at once, with the
m x m Gram products all-reduced at every Newton–Schulz step (6 all-reduces per block).

Owner (this module), per shape bucket: the leaves whose blocks have one `[m, n]` shape,
dtype and stack depth L, with pieces over the same mesh axes (the `g` devices that shard
fan-in and fan-out), e.g. all 75 MoE layers' `w_gate` and `w_up`. Inside one `shard_map`
over the mesh, a loop over rounds of k layers (k = 1 when a layer has >= g blocks, more when
it has fewer, so that every owner gets work; `_layers_per_round`):

  1. Every device lists its pieces of the round's blocks, `[k x blocks per layer, m / g_m,
     n / g_n]` (each leaf's k layers transposed to batch, fan-in, fan-out axes, as optax's
     Newton–Schulz reshapes it), padded with zero blocks to `g x c`.
  2. One `all_to_all` over the g devices sends the pieces of chunk j (c blocks) to device j,
     which then holds c whole blocks.
  3. The owner runs Newton–Schulz on its c blocks (a zero block stays zero).
  4. One `all_to_all` returns the pieces; they overwrite the round's layers of each leaf
     (in place, in the leaf's own sharding).

Memory: one round's pieces at a time in about four buffers (sent, received, orthogonalized,
returned), no copy of a whole bucket; NS runs on one block at a time. Blocks are dealt out
in equal counts per round (equal shapes: equal FLOPs); `plan` gives the zero-block padding
(and the layers a last, clamped round repeats). A block whose fan-in and fan-out are
unsharded (heads over `tensor`, experts over `expert`, fan-in whole) is local: it is
orthogonalized in place and nothing moves, as in the replicated mode. Devices that hold
copies of the same pieces (mesh axes that shard neither the block nor its batch axes)
repeat the same work. A leaf whose block is sharded on a minor axis of a multi-axis fan-in
or fan-out (its pieces are not contiguous rows) keeps the replicated path.

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
  """One leaf seen as blocks: transpose `perm` to (batch, fan-in, fan-out) axes, blocks of
  `[m, n]` (whole) with pieces over mesh axes `m_axes` (fan-in) and `n_axes` (fan-out)."""
  perm: tuple[int, ...]
  m: int
  n: int
  m_axes: tuple[str, ...]
  n_axes: tuple[str, ...]

  @property
  def axes(self) -> tuple[str, ...]:
    return self.m_axes + self.n_axes


class Bucket(NamedTuple):
  """Leaves (indices into the flat leaf list) whose blocks are dealt out together."""
  leaves: tuple[int, ...]
  m: int
  n: int
  m_axes: tuple[str, ...]
  n_axes: tuple[str, ...]
  g_m: int
  g_n: int
  depth: int             # L: layers of every leaf (1: not stacked)
  per_layer: int         # blocks a device holds pieces of, per layer, over the leaves
  layers_per_round: int  # k
  per_owner: int         # c: blocks each owner orthogonalizes per round

  @property
  def g(self) -> int:
    return self.g_m * self.g_n

  @property
  def rounds(self) -> int:
    return -(-self.depth // self.layers_per_round)

  @property
  def padding(self) -> float:
    """Share of the owners' Newton–Schulz work spent on zero blocks and repeated layers."""
    work = self.rounds * self.g * self.per_owner
    return 1.0 - self.depth * self.per_layer / work


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
                n_axes=per_dim[out[0]])


def _size(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def plan(shapes: Sequence[Any], dims: Sequence[Any], shardings: Sequence[Any],
         stacked: Sequence[int]) -> tuple[list[Bucket], list[int]]:
  """Buckets of the leaves whose blocks are sharded, and the indices of the other (local, or
  not dealable) leaves. `shapes[i]` has `.shape` and `.dtype`; `stacked[i]` is the number of
  the leaf's leading stack axes (`pg.Rule.stacked`)."""
  groups: dict[tuple, list[int]] = {}
  local = []
  for i, (x, d, s) in enumerate(zip(shapes, dims, shardings)):
    lay = layout(x.shape, d, s)
    if lay is None or not lay.axes:
      local.append(i)
      continue
    depth = math.prod(x.shape[:stacked[i]])
    key = (lay.m, lay.n, jnp.dtype(x.dtype).name, lay.m_axes, lay.n_axes, depth, id(s.mesh))
    groups.setdefault(key, []).append(i)
  buckets = []
  for (m, n, _, m_axes, n_axes, depth, _), idx in groups.items():
    mesh = shardings[idx[0]].mesh
    per_layer = sum(_blocks_per_layer(shapes[i].shape, dims[i], shardings[i], stacked[i])
                    for i in idx)
    g = _size(mesh, m_axes) * _size(mesh, n_axes)
    k = _layers_per_round(depth, per_layer, g)
    buckets.append(Bucket(tuple(idx), m, n, m_axes, n_axes, _size(mesh, m_axes),
                          _size(mesh, n_axes), depth, per_layer, k, -(-k * per_layer // g)))
  return buckets, local


def _layers_per_round(depth: int, per_layer: int, g: int) -> int:
  """k: the fewest layers that give every owner a block, or twice that many where fewer zero
  blocks pad the rounds (work = rounds x blocks per owner; 33 blocks per layer over 32
  owners, 75 layers: 150 block slots one layer per round, 114 two at a time). A round holds
  about 4 copies of its k layers' pieces, so k stays small."""
  k_min = min(depth, -(-g // per_layer))
  work = lambda k: -(-depth // k) * -(-k * per_layer // g)
  return min(range(k_min, min(depth, 2 * k_min) + 1), key=lambda k: (work(k), k))


def _blocks_per_layer(shape, dims, sharding, stacked: int) -> int:
  """Blocks of one layer (of a stack; of the leaf if not stacked) that a device holds."""
  nd = len(shape)
  mat = {a % nd for a in _axes(dims.reduction_axis) + _axes(dims.output_axis)}
  shard = sharding.shard_shape(tuple(shape))
  return math.prod(shard[a] for a in range(stacked, nd) if a not in mat)


def ns_flops(m: int, n: int, steps: int = 5) -> int:
  """Multiply-add FLOPs of quintic Newton–Schulz on one [m, n] block (a = min, b = max):
  per step A = X Xᵀ (2a²b), A² (2a³), (bA + cA²) X (2a²b)."""
  a, b = min(m, n), max(m, n)
  return steps * (4 * a * a * b + 2 * a ** 3)


def orthogonalize(leaves: Sequence[jax.Array], dims: Sequence[Any], shardings: Sequence[Any],
                  stacked: Sequence[int], ns_2d: Callable[[jax.Array], jax.Array],
                  local_fn: Callable[[int], jax.Array]) -> list[jax.Array]:
  """Newton–Schulz of every leaf, owner-computes where its blocks are sharded.

  leaves: the (bias-corrected) momenta; dims: each leaf's MuonDimensionNumbers with its stack
  axes as batch axes; shardings: each leaf's (parameter's) sharding; stacked: leading stack
  axes per leaf; ns_2d: NS of one [m, n] block; local_fn(i): leaf i orthogonalized in place.
  """
  buckets, local = plan(leaves, dims, shardings, stacked)
  out: list[Any] = [None] * len(leaves)
  for i in local:
    out[i] = local_fn(i)
  for b in buckets:
    pick = lambda seq: [seq[i] for i in b.leaves]
    for i, y in zip(b.leaves, _run_bucket(b, pick(leaves), pick(dims), pick(shardings),
                                          pick(stacked), ns_2d)):
      out[i] = y
  return out


def _run_bucket(b: Bucket, xs, dims, shardings, stacked, ns_2d):
  """One shard_map over the mesh: rounds of `b.layers_per_round` layers of every leaf."""
  mesh = shardings[0].mesh
  m_loc, n_loc = b.m // b.g_m, b.n // b.g_n
  axes, k, c = b.m_axes + b.n_axes, b.layers_per_round, b.per_owner
  # Each leaf as [L, rest...]: stack axes merged (or a new one of 1); perm over that view.
  perms = []
  for x, d, s, st in zip(xs, dims, shardings, stacked):
    perm = layout(x.shape, d, s).perm
    perms.append((0,) + tuple(a - st + 1 for a in perm[st:]))

  def as_stack(x, st):
    return x.reshape((b.depth,) + x.shape[st:]) if st else x[None]

  def body(*local):
    views = [as_stack(x, st) for x, st in zip(local, stacked)]

    def one_round(r, vs):
      # Rounds write their results over their own layers of the momenta (in place: no second
      # stack-sized buffer). The last round may start early (layers clamped to the stack);
      # the layers an earlier round wrote keep that result.
      start = jnp.minimum(r * k, b.depth - k)
      fresh = start + jnp.arange(k) >= r * k
      olds = [jax.lax.dynamic_slice_in_dim(v, start, k, axis=0) for v in vs]
      parts, shapes_t = [], []
      for old, perm in zip(olds, perms):
        sl = jnp.transpose(old, perm)
        shapes_t.append(sl.shape)
        parts.append(sl.reshape(-1, m_loc, n_loc))
      blocks = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
      blocks = jnp.pad(blocks, ((0, b.g * c - blocks.shape[0]), (0, 0), (0, 0)))
      got = _all_to_all(blocks, axes, b.g)
      whole = got.reshape(b.g_m, b.g_n, c, m_loc, n_loc).transpose(2, 0, 3, 1, 4)
      orth = jax.lax.map(ns_2d, whole.reshape(c, b.m, b.n))   # one block's NS temporaries
      back = orth.reshape(c, b.g_m, m_loc, b.g_n, n_loc).transpose(1, 3, 0, 2, 4)
      done = _all_to_all(back, axes, b.g).reshape(b.g * c, m_loc, n_loc)
      new, at = [], 0
      for v, old, shape_t, perm in zip(vs, olds, shapes_t, perms):
        cnt = math.prod(shape_t) // (m_loc * n_loc)
        y = jnp.transpose(done[at:at + cnt].reshape(shape_t), _inverse(perm))
        y = jnp.where(fresh.reshape((k,) + (1,) * (y.ndim - 1)), y, old)
        new.append(jax.lax.dynamic_update_slice_in_dim(v, y, start, axis=0))
        at += cnt
      return new

    outs = jax.lax.fori_loop(0, b.rounds, one_round, views)
    return tuple(o.reshape(x.shape) for o, x in zip(outs, local))

  specs = tuple(P(*s.spec) for s in shardings)
  fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False)
  return fn(*xs)


def _all_to_all(x, axes, g: int):
  """Chunk j of x (split in g along its leading axes) to device j of `axes`; what device j
  sent comes back at position j. Flattened to [g, -1] first: XLA:CPU's verifier refuses an
  all-to-all whose operand is a transpose (its split operands get different layouts)."""
  return jax.lax.all_to_all(x.reshape(g, -1), axes, 0, 0, tiled=True)


def _inverse(perm):
  return tuple(sorted(range(len(perm)), key=lambda i: perm[i]))
