"""Context parallelism for MLA + DSA: sequences split along the mesh's `context` axis.

With `mesh.context = n > 1`, each row's positions are cut into 2n chunks and laid out
zig-zag (chunks k and 2n-1-k on device k), so that under causal attention every device holds
the same amount of work: early chunks see few keys, late chunks many. The layout is a fixed
permutation `order` [t] of the row: entry i holds the token at natural position `order[i]`.

  * Queries, hidden states, MoE and the losses stay in this layout, sharded over `context`
    (the MoE is per token and the losses are sums over tokens: the layout does not matter).
  * Keys are gathered: MLA's compressed rows [c_kv | k_rope] (576 values per token at GLM-5
    shapes) and the indexer keys (128) are all-gathered along `context` and put back in
    natural order (`gather_keys`); per-head keys and values are then computed locally
    (dense attention) or never exist (sparse attention over gathered latent rows).
  * Visibility is per query: keys `doc_start <= j <= order[i]` (nn/attention.py), so top-k,
    ties to the lower natural position, and every mask equal the unpermuted computation.
  * Next-token and MTP targets cross chunk boundaries, so they are computed in natural order
    before the permutation (train/step.py), and the MTP step's shifted tokens likewise
    (`natural` / `permute`).

The layout is pinned with sharding constraints on the mesh set by `jax.set_mesh`
(batch over the batch axes, sequence over `context`); XLA propagates it through the layers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from glm5_jax import sharding as shd

AXIS = "context"


def size() -> int:
  """`context` size of the mesh set with `jax.set_mesh` (1 without one)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or AXIS not in mesh.shape:
    return 1
  return int(mesh.shape[AXIS])


def zigzag_order(t: int, n: int) -> np.ndarray:
  """int32 [t]: natural position held by each entry of the zig-zag layout over n devices."""
  if n < 1 or t % (2 * n):
    raise ValueError(f"sequence length {t} must be divisible by 2 * mesh.context = {2 * n} "
                     "(context parallelism splits each row into 2 * context chunks)")
  chunks = np.arange(t, dtype=np.int32).reshape(2 * n, t // (2 * n))
  return np.concatenate([np.concatenate([chunks[k], chunks[2 * n - 1 - k]])
                         for k in range(n)]).astype(np.int32)


def _constrain(x, seq_axis):
  """x [b, t, ...] sharded: batch over the batch axes that divide it, sequence over `seq_axis`."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  bat = tuple(a for a in shd.BATCH_AXES if mesh.shape.get(a, 1) > 1)
  if not bat or x.shape[0] % math.prod(mesh.shape[a] for a in bat):
    bat = None
  spec = P(bat, seq_axis, *([None] * (x.ndim - 2)))
  return jax.lax.with_sharding_constraint(x, spec)


def permute(x_bt, order):
  """x [b, t, ...] in natural order -> the layout `order`, sharded along `context`."""
  return _constrain(jnp.take(x_bt, order, axis=1), AXIS)


def natural(x_bt, order):
  """x [b, t, ...] in the layout `order` -> natural order (all-gathered along `context`)."""
  return jnp.take(_constrain(x_bt, None), jnp.argsort(order), axis=1)


def gather_keys(x_bs, order):
  """Key rows [b, s, ...] computed in the layout `order` -> all of them, natural order.

  The all-gather along `context` moves only what is passed here: MLA's latent rows and the
  indexer keys, never per-head keys or values.
  """
  if order is None:
    return x_bs
  return natural(x_bs, order)


def per_shard(fn, n: int, queries, keys=()):
  """`fn(*queries, *keys)` run on each `context` shard's own queries, vmapped over shards.

  A computation that walks the query axis in blocks (flash attention, the indexer's query
  chunks, the KL's) would slice a sharded axis and gather it; split instead into n shards
  `[n, b, t / n, ...]` (the shard axis on `context`), each device walks its own queries
  against all keys. queries: arrays [b, t, ...] (or [t] for per-position ones like limits);
  keys: arrays every shard sees whole. Outputs [b, t, ...] are merged back; scalars are
  averaged over shards (equal shard sizes: the mean over all queries).
  """
  def split(x):
    if x is None:
      return None
    lead = x.ndim == 1                      # [t]: one row shared by the batch
    y = x[None] if lead else x
    b, t = y.shape[:2]
    y = jnp.moveaxis(y.reshape(b, n, t // n, *y.shape[2:]), 1, 0)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
      y = jax.lax.with_sharding_constraint(y, P(AXIS, *([None] * (y.ndim - 1))))
    return y[:, 0] if lead else y

  def merge(y):
    if y.ndim == 1:                         # a scalar per shard
      return jnp.mean(y)
    return jnp.moveaxis(y, 0, 1).reshape(y.shape[1], -1, *y.shape[3:])

  out = jax.vmap(fn, in_axes=(0,) * len(queries) + (None,) * len(keys))(
      *map(split, queries), *keys)
  return jax.tree.map(merge, out)
