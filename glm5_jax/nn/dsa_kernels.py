"""The model's calls of the DSA ops, partitioned over the mesh when they run as Pallas kernels.

XLA cannot partition a Pallas kernel: it is an opaque custom call, and on TPU
Mosaic refuses to lower one whose operands are sharded ("Mosaic kernels cannot
be automatically partitioned. Please wrap the call in a shard_map"). With a
mesh set by `jax.set_mesh` and `attention_impl="pallas"`, the model therefore
calls each kernel inside `jax.shard_map`, and every device runs it on its own
slice:

  op                   batch b                  heads          keys / cache s
  indexer top-k        over the batch axes      whole (the score sums all indexer heads)   whole
                       (start, and a [b, t] limit, with it; a [t] limit is replicated)
  sparse MLA           over the batch axes      over `tensor`  whole (shared by all heads)

A batch axis group is used only when it divides b (an inference batch of 1
stays whole); heads go over `tensor` only when it divides them. kv enters
unsharded over `tensor`, so shard_map's transpose sums its per-head-shard
gradients over `tensor`. The `xla` path needs none of this: GSPMD partitions
jnp code by itself, so it is called directly.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from glm5_jax import sharding as shd
from pallas_kernels import lightning_indexer
from pallas_kernels import sparse_attention

TENSOR_AXIS = "tensor"


def _mesh():
  """The mesh set with `jax.set_mesh`, or None (no mesh, or a single device)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or math.prod(mesh.shape.values()) == 1:
    return None
  return mesh


def _axes_dividing(mesh, axes, n: int):
  """The axes of `axes` present in `mesh` if their product divides n, else None."""
  axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)
  if not axes or n % math.prod(mesh.shape[a] for a in axes):
    return None
  return axes


def topk_indices(q, k, w, topk, *, impl, interpret, chunk_size, start=None, backend=None,
                 limit=None):
  """`lightning_indexer.topk_indices`, sharded over the batch axes for `impl="pallas"`.

  start: optional int32 [b, t]; limit: optional int32 [t] (every row alike) or
  [b, t] (per row: a KV-cache forward), see `lightning_indexer.topk_indices`.
  """
  call = lambda q, k, w, start, limit: lightning_indexer.topk_indices(
      q, k, w, topk, impl=impl, interpret=interpret, chunk_size=chunk_size, start=start,
      backend=backend, limit=limit)
  mesh = _mesh()
  if impl != "pallas" or mesh is None:
    return call(q, k, w, start, limit)
  bat = _axes_dividing(mesh, shd.BATCH_AXES, q.shape[0])
  spec = P(bat)
  limit_spec = spec if limit is not None and limit.ndim == 2 else P()
  return jax.shard_map(call, in_specs=(spec, spec, spec, spec, limit_spec), out_specs=spec,
                       check_vma=False)(q, k, w, start, limit)


def sparse_mla(q, kv, indices, *, v_dim, scale, impl, interpret, chunk_size, backend=None):
  """`sparse_attention.sparse_mla`, sharded over batch and heads for `impl="pallas"`."""
  call = lambda q, kv, indices: sparse_attention.sparse_mla(
      q, kv, indices, v_dim=v_dim, scale=scale, impl=impl, interpret=interpret,
      chunk_size=chunk_size, backend=backend)
  mesh = _mesh()
  if impl != "pallas" or mesh is None:
    return call(q, kv, indices)
  bat = _axes_dividing(mesh, shd.BATCH_AXES, q.shape[0])
  heads = _axes_dividing(mesh, (TENSOR_AXIS,), q.shape[2])
  rows = P(bat)
  fn = jax.shard_map(call, in_specs=(P(bat, None, heads), rows, rows),
                     out_specs=(P(bat, None, heads), P(bat, None, heads)), check_vma=False)
  return fn(q, kv, indices)
