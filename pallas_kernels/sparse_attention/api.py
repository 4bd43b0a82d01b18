"""Dispatch for sparse MLA attention (docs/design.md decision 4)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import _backend
from pallas_kernels.sparse_attention import xla

IMPLS = ("xla", "pallas")


def _check_shapes(q, kv, indices, v_dim):
  d = _backend.check_axes("sparse_mla", q=(q, "b t h d_qk"), kv=(kv, "b s d_qk"),
                          indices=(indices, "b t k"))["d_qk"]
  if not 0 < v_dim <= d:
    raise ValueError(f"sparse_mla: v_dim={v_dim}, expected in (0, d_qk={d}]")


def sparse_mla(q, kv, indices, *, v_dim: int, scale: float, impl: str = "xla",
               interpret: bool | None = False, chunk_size: int = 256,
               backend: str | None = None, einsum=None):
  """Attention of absorbed MLA queries over their selected cache rows.

  Args:
    q: [b, t, h, d_qk] absorbed query [q_latent | q_rope].
    kv: [b, s, d_qk] cache rows [c_kv | k_rope], shared by all heads.
    indices: [b, t, topk] int32, -1 = empty slot.
    v_dim: the value is kv[..., :v_dim].
    scale: logit scale.
    impl: "xla" (chunked jnp gather) or "pallas" (TPU / GPU kernel).
    interpret: run the Pallas kernel in interpret mode (CPU tests); None: by
      lowering platform (the kernel on TPU / CUDA, the interpreter elsewhere).
    chunk_size: query chunk of the "xla" path.
    backend: for "pallas", the kernel lowering: "tpu", "gpu", or None = the
      platform's (see `pallas_kernels._backend`).
    einsum: for "xla", what computes its two products (default `jnp.einsum`; see
      `xla.sparse_mla_xla`).

  Returns:
    out [b, t, h, v_dim], lse [b, t, h] float32; rows with no valid index give
    zeros (lse = -inf). Differentiable in q and kv.
  """
  _check_shapes(q, kv, indices, v_dim)
  if impl == "xla":
    return xla.sparse_mla_xla(q, kv, indices, v_dim=v_dim, scale=scale,
                              chunk_size=chunk_size, einsum=einsum or jnp.einsum)
  if impl == "pallas":
    from pallas_kernels.sparse_attention import kernel  # pylint: disable=g-import-not-at-top
    return kernel.sparse_mla(q, kv, indices, v_dim=v_dim, scale=scale, interpret=interpret,
                             backend=backend)
  raise ValueError(f"sparse_mla: impl={impl!r}, expected one of {IMPLS}")
