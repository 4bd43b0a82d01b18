"""Sparse MLA attention kernels: custom_vjp and backend choice (`impl="pallas"`).

`sparse_mla` equals `xla.sparse_mla_xla` (same arguments, same
outputs: out [b, t, h, v] in q.dtype, lse [b, t, h] float32, zeros / -inf for a
query with no valid slot) and is differentiable in q and kv through a
custom_vjp whose forward and backward are both Pallas kernels on both backends:

  backend   forward                          backward
  "tpu"     tpu.sparse_mla_fwd (Mosaic)      tpu.sparse_mla_bwd (dkv by DMA read-add-write)
  "gpu"     gpu.sparse_mla_fwd (Triton)      gpu.sparse_mla_bwd (dkv by atomic adds)

The backend comes from `backend=` or the lowering platform (see `_backend`).
Slots are padded with -1 to a multiple of `block_k`; each query's blocks after
its last valid slot are skipped (`n_live`), so the -1 tail that
`topk_indices` leaves for early queries costs nothing. The cotangent of lse is
honoured: ds = p * (dp - (sum(do * out) - dlse)).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.sparse_attention import gpu
from pallas_kernels.sparse_attention import tpu


def _block_k(backend: str, k: int, block_k: int | None) -> int:
  if backend == "tpu":
    if block_k is None:
      return min(tpu.DEFAULT_BLOCK_K, -(-k // 8) * 8)
    if block_k < 8 or block_k % 8:
      raise ValueError(f"sparse_mla: block_k={block_k}, expected a multiple of 8 for the "
                       "TPU kernel")
    return block_k
  if block_k is None:
    return min(gpu.DEFAULT_BLOCK_K, _backend.next_pow2(k, gpu.MIN_DIM))
  if block_k < gpu.MIN_DIM or block_k & (block_k - 1):
    raise ValueError(f"sparse_mla: block_k={block_k}, expected a power of two >= "
                     f"{gpu.MIN_DIM} for the GPU kernel")
  return block_k


def _blocked_indices(indices, block_k: int):
  """Indices padded with -1 to n_kb * bk slots."""
  return _backend.pad_to(indices.astype(jnp.int32), 2, block_k, value=-1)


def _live_blocks(idx, block_k: int):
  """n_live [b, t]: blocks up to the last valid slot (the TPU kernels count them on chip)."""
  pos = jnp.arange(idx.shape[-1], dtype=jnp.int32)
  last = jnp.max(jnp.where(idx >= 0, pos, -1), axis=-1)
  return (last + block_k) // block_k


# ----------------------------------------------------------------- per-backend wrappers


def _tpu_fwd(v_dim, scale, interpret, block_k, q, kv, indices):
  b, t, k = indices.shape
  bk = _block_k("tpu", k, block_k)
  idx = _blocked_indices(indices, bk)
  out, lse = tpu.sparse_mla_fwd(q, tpu.prepare_kv(kv), idx.reshape(b, t, -1, bk),
                                v_dim=v_dim, scale=scale, interpret=interpret)
  return out, lse[:, :, 0]


def _tpu_bwd(v_dim, scale, interpret, block_k, q, kv, indices, do, lse, delta):
  b, t, k = indices.shape
  bk = _block_k("tpu", k, block_k)
  idx = _blocked_indices(indices, bk)
  return tpu.sparse_mla_bwd(q, tpu.prepare_kv(kv), idx.reshape(b, t, -1, bk), do,
                            lse[:, :, None], delta[:, :, None], v_dim=v_dim, scale=scale,
                            interpret=interpret)


def _gpu_fwd(v_dim, scale, interpret, block_k, q, kv, indices):
  h = q.shape[2]
  bk = _block_k("gpu", indices.shape[-1], block_k)
  idx = _blocked_indices(indices, bk)
  n_live = _live_blocks(idx, bk)
  q_p, kv_p = gpu.pad_operands(q, kv, v_dim)
  out, lse = gpu.sparse_mla_fwd(q_p, kv_p, idx, n_live[..., None], v_dim=v_dim, scale=scale,
                                block_k=bk, interpret=interpret)
  return out[:, :, :h, :v_dim], lse[:, :, :h]


def _gpu_bwd(v_dim, scale, interpret, block_k, q, kv, indices, do, lse, delta):
  b, t, h, d = q.shape
  bk = _block_k("gpu", indices.shape[-1], block_k)
  idx = _blocked_indices(indices, bk)
  n_live = _live_blocks(idx, bk)
  q_p, kv_p = gpu.pad_operands(q, kv, v_dim)
  hp, vp, tp = gpu.padded_dims(h, d, v_dim)
  do_p = _backend.pad_to(_backend.pad_to(do, 3, vp), 2, hp)
  # Padded heads have q = 0 and do = 0, so their ds and p^T do vanish for any finite lse.
  lse_p = _backend.pad_to(jnp.where(jnp.isfinite(lse), lse, 0.0), 2, hp)
  delta_p = _backend.pad_to(delta, 2, hp)
  dq_p, dkv_p = gpu.sparse_mla_bwd(q_p, kv_p, idx, n_live[..., None], do_p, lse_p, delta_p,
                                   v_dim=v_dim, scale=scale, block_k=bk, interpret=interpret)
  if (hp, vp, tp) != (h, v_dim, d - v_dim):
    dq_p = jnp.concatenate([dq_p[..., :v_dim], dq_p[..., vp:vp + d - v_dim]], axis=-1)
    dkv_p = jnp.concatenate([dkv_p[..., :v_dim], dkv_p[..., vp:vp + d - v_dim]], axis=-1)
  return dq_p[:, :, :h], dkv_p


_FWD = {"tpu": _tpu_fwd, "gpu": _gpu_fwd}
_BWD = {"tpu": _tpu_bwd, "gpu": _gpu_bwd}


# ------------------------------------------------------------------------ custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _sparse_mla(q, kv, indices, v_dim, scale, interpret, backend, block_k):
  make = lambda name, interp: functools.partial(_FWD[name], v_dim, scale, interp, block_k)
  return _backend.dispatch(make, backend, interpret, q, kv, indices)


def _sparse_mla_fwd(q, kv, indices, v_dim, scale, interpret, backend, block_k):
  out, lse = _sparse_mla(q, kv, indices, v_dim, scale, interpret, backend, block_k)
  return (out, lse), (q, kv, indices, out, lse)


def _sparse_mla_bwd(v_dim, scale, interpret, backend, block_k, res, cts):
  q, kv, indices, out, lse = res
  do, dlse = cts
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta = delta - dlse.astype(jnp.float32)
  make = lambda name, interp: functools.partial(_BWD[name], v_dim, scale, interp, block_k)
  dq, dkv = _backend.dispatch(make, backend, interpret, q, kv, indices, do, lse, delta)
  return dq.astype(q.dtype), dkv.astype(kv.dtype), None


_sparse_mla.defvjp(_sparse_mla_fwd, _sparse_mla_bwd)


def sparse_mla(q, kv, indices, *, v_dim: int, scale: float, interpret=False,
               backend: str | None = None, block_k: int | None = None):
  """Sparse MLA attention with Pallas kernels (forward and backward).

  Args:
    q: [b, t, h, d_qk] absorbed queries [q_latent | q_rope].
    kv: [b, s, d_qk] cache rows [c_kv | k_rope], shared by all heads.
    indices: [b, t, topk] int32 row ids, -1 = empty slot.
    v_dim: value width (kv[..., :v_dim]).
    scale: logit scale.
    interpret: run the kernels in the Pallas interpreter (CPU): True, or a
      `pltpu.InterpretParams` for the TPU kernels; None: by lowering platform
      (see `pallas_kernels._backend`).
    backend: "tpu", "gpu", or None (see `pallas_kernels._backend`).
    block_k: slots per kernel step; TPU: a multiple of 8 (default 128), GPU: a
      power of two >= 16 (default 64).

  Returns:
    out [b, t, h, v_dim] (q.dtype), lse [b, t, h] float32.
  """
  _backend.check_backend(backend, "sparse_mla")
  return _sparse_mla(q, kv, indices, v_dim, float(scale), interpret, backend, block_k)
