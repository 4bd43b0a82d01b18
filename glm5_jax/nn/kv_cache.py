"""The paged latent KV cache, as the model reads and writes it.

Per layer the cache holds, per token, only what MLA + DSA need again (paper §2.1): the
latent row `kv = [c_kv | k_rope]` (kv_lora + qk_rope values, shared by all heads) and, on
layers with their own indexer, the lightning-indexer key `k_idx` (float32, as the indexer
computes it). Nothing per head.

Rows live in a *pool* of `num_rows = num_blocks * block_size` rows shared by every
request; a request's logical position j lives at physical row `rows[b, j]`, which the
inference engine derives from its block table (`block_rows`). The model sees:

    cache   {"layers": {stack: {layer_j: {"kv": [R, N, c+p], "k_idx": [R, N, d_i]}}},
             "mtp": {"kv": [N, c+p], "k_idx": [N, d_i]} or None}
            (R: the stack's scan length, N: pool rows; the layout of the parameters)
    CacheIndex(write_bt, read_bs, limit_bt, layer)
            write_bt  int32 [b, t]  pool row of each new token (>= N: not written, padding)
            read_bs   int32 [b, s]  pool row of logical positions 0 .. s-1 of each sequence
            limit_bt  int32 [b, t]  last logical position each new token may see (its own)
            layer     int32 []      the entry of a stacked pool [R, N, x] a layer uses (the
                                    layer scan's repeat; set by the scan), or None for an
                                    unstacked pool [N, x] (the MTP layer)

A forward over the cache first writes the new tokens' rows, then gathers each
sequence's view `pool[layer, read_bs]` and attends within it, query i seeing view positions
0 .. limit[b, i]: new tokens see the cached prefix, each other causally, and nothing
beyond (stale or foreign rows past the limit are never selected). A stacked pool travels
whole through the layer scan (in its carry) and each layer scatters its rows into its own
entry: on XLA:CPU a pool sliced per layer (scan inputs and outputs) is copied twice per
layer and step, which at long contexts cost more than the weights (docs/benchmarks.md).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from glm5_jax import sharding as shd


class CacheIndex(NamedTuple):
  """Where a chunk of new tokens goes and what each sequence sees (module docstring)."""
  write_bt: Any
  read_bs: Any
  limit_bt: Any
  layer: Any = None


def layer_cache(cfg, num_rows: int, has_indexer: bool, lead=(), kv_dtype=None):
  """Zeros {'kv': [*lead, N, c + p] kv_dtype (default cfg.dtype), 'k_idx': [*lead, N, d_i]
  float32 (if indexed)}. An FP8 `kv_dtype` stores the latent rows as a plain cast, clipped to
  the format's range (`write`)."""
  out = {"kv": jnp.zeros((*lead, num_rows, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                         cfg.dtype if kv_dtype is None else kv_dtype)}
  if has_indexer:
    out["k_idx"] = jnp.zeros((*lead, num_rows, cfg.index_head_dim), jnp.float32)
  return out


def _fit(rows, dtype):
  """rows as the pool's dtype; into an 8-bit float's finite range first (a cast past it
  is NaN for float8_e4m3fn)."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
    m = float(jnp.finfo(dtype).max)
    rows = jnp.clip(rows, -m, m)
  return rows.astype(dtype)


def _at(pool, rows, layer):
  """pool.at[rows] of an unstacked pool [N, x], pool.at[layer, rows] of a stacked one."""
  return pool.at[rows] if layer is None else pool.at[layer, rows]


def _write_local(pool, rows_btx, write_bt, layer=None):
  return _at(pool, write_bt, layer).set(_fit(rows_btx, pool.dtype), mode="drop")


def _read_local(pool, read_bs, layer=None):
  return _at(pool, read_bs, layer).get(mode="clip")


def request_axes(num_rows: int, batch: int):
  """The mesh's batch axes that split the pool over requests, or None (no mesh / one device).

  Under a mesh (the engine's sharded serving) the pool's rows and the batch are split
  over the same axes: shard i holds pool rows [i N/n, (i+1) N/n) and the requests of
  batch rows [i b/n, (i+1) b/n), whose blocks the engine allocates from that shard only.
  Reads and writes then stay on their shard (`shard_map`).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  axes = tuple(a for a in shd.BATCH_AXES if a in mesh.shape and mesh.shape[a] > 1)
  n = math.prod(mesh.shape[a] for a in axes)
  if not axes or num_rows % n or batch % n:
    return None
  return axes


def _on_shards(fn, pool, rows_b, rows_idx, layer, axes, out_is_pool: bool):
  """fn(local pool, rows, local row indices, layer) on each shard; indices of other shards
  are moved out of range (writes dropped; reads of them never happen). Its output is split
  like the pool (a write) or like the batch (a read)."""
  stacked = layer is not None
  def local(pool, x, idx, layer):
    n_local = pool.shape[-2]
    idx = idx - jax.lax.axis_index(axes) * n_local
    idx = jnp.where((idx >= 0) & (idx < n_local), idx, n_local)
    return fn(pool, x, idx, layer if stacked else None)
  spec = P(axes)
  pool_spec = P(None, axes) if stacked else spec
  return jax.shard_map(local, in_specs=(pool_spec, spec, spec, P()),
                       out_specs=pool_spec if out_is_pool else spec, check_vma=False)(
                           pool, rows_b, rows_idx, jnp.int32(0) if layer is None else layer)


def write(pool, rows_btx, write_bt, layer=None):
  """pool[layer, write[b, i]] = rows[b, i] (pool[write[b, i]] with layer None); rows whose
  target is out of range are dropped."""
  axes = request_axes(pool.shape[-2], write_bt.shape[0])
  if axes is None:
    return _write_local(pool, rows_btx, write_bt, layer)
  return _on_shards(_write_local, pool, rows_btx, write_bt, layer, axes, True)


def read(pool, read_bs, layer=None):
  """Each sequence's view [b, s, x] of the pool (of its entry `layer` when stacked)."""
  axes = request_axes(pool.shape[-2], read_bs.shape[0])
  if axes is None:
    return _read_local(pool, read_bs, layer)
  return _on_shards(lambda pool, _, idx, layer: _read_local(pool, idx, layer), pool, read_bs,
                    read_bs, layer, axes, False)


def block_rows(table_bm, block_size: int):
  """int32 [b, m * block_size]: pool row of every logical position of each block table.
  A broadcast, not a gather of the table's entries (XLA:CPU ran that gather, fused with the
  engine's lane mirroring, at ~13 ns an element: 0.4 ms of a decode step at 16 x 2048)."""
  b, m = table_bm.shape
  rows = table_bm[:, :, None] * block_size + jnp.arange(block_size, dtype=table_bm.dtype)
  return rows.reshape(b, m * block_size)


def chunk_index(table_bm, block_size: int, start_b, n_valid_b, t: int, num_rows: int,
                first_valid_b=None) -> CacheIndex:
  """CacheIndex for tokens at logical positions start[b] .. start[b] + t - 1, n_valid[b] real.

  first_valid_b: optional int32 [b]; tokens before it are not written either (a row that
  is already in the cache, or position -1).
  """
  read_bs = block_rows(table_bm, block_size)
  s = read_bs.shape[1]
  i_t = jnp.arange(t, dtype=jnp.int32)
  pos = start_b[:, None].astype(jnp.int32) + i_t[None, :]
  ok = (i_t[None, :] < n_valid_b[:, None]) & (pos >= 0) & (pos < s)
  if first_valid_b is not None:
    ok &= i_t[None, :] >= first_valid_b[:, None]
  rows = jnp.take_along_axis(read_bs, jnp.clip(pos, 0, s - 1), axis=1)
  return CacheIndex(jnp.where(ok, rows, num_rows), read_bs, pos)


def bytes_per_token(cfg, with_mtp: bool = False) -> dict[str, int]:
  """Cache bytes per token: this latent cache vs a per-head expanded K/V cache."""
  layers = cfg.num_hidden_layers + (1 if with_mtp and cfg.num_nextn_predict_layers else 0)
  dsize = jnp.dtype(cfg.dtype).itemsize
  n_idx = sum(cfg.indexer_type(i) == "full" for i in range(cfg.num_hidden_layers))
  n_idx += layers - cfg.num_hidden_layers
  idx_bytes = n_idx * cfg.index_head_dim * 4                        # float32 indexer keys
  latent = layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dsize + idx_bytes
  per_head = layers * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * dsize
  return {"latent": int(latent), "expanded_per_head": int(per_head + idx_bytes)}
