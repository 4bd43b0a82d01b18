"""The DSA ops that the kernel experiments time or compile, at named head/dim presets.

Shared by `bench_kernels.py` (timing on a device), `aot_tpu_kernels.py` and
`aot_gpu_kernels.py` (compiling for a TPU or GPU without one).
"""

import jax
import jax.numpy as jnp

from pallas_kernels import lightning_indexer
from pallas_kernels import sparse_attention
from pallas_kernels.lightning_indexer import kernel as indexer_kernel
from pallas_kernels.sparse_attention import kernel as sparse_kernel

SHAPES = {
    # h, d_qk, v_dim, h_i, d_i, topk (GLM-5 spec §1)
    "glm5": dict(h=64, d_qk=576, v_dim=512, h_i=32, d_i=128, topk=2048),
    "tiny": dict(h=4, d_qk=24, v_dim=16, h_i=4, d_i=16, topk=16),
}
OPS = ("indexer", "sparse_fwd", "sparse_fwd_bwd")


def check_ops(ops, flag="--ops"):
  """Raises a clear error for names outside OPS."""
  unknown = set(ops) - set(OPS)
  if unknown:
    raise ValueError(f"{flag}: {sorted(unknown)} unknown; expected a subset of {OPS}")


def op_fn(op, impl, shape, backend, chunk, interpret=None, tiles=None):
  """The jit-ed callable timed for (op, impl).

  interpret=None: on a CPU host. tiles: kernel tile sizes for impl="pallas",
  {"sparse_block_k", "indexer_block_q", "indexer_block_k"}; absent or None =
  the kernel's default.
  """
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  tiles = tiles or {}
  scale = shape["d_qk"] ** -0.5
  if op == "indexer":
    if impl == "pallas":
      return jax.jit(lambda q, k, w: indexer_kernel.topk_indices(
          q, k, w, shape["topk"], chunk_size=chunk, interpret=interpret, backend=backend,
          block_q=tiles.get("indexer_block_q"), block_k=tiles.get("indexer_block_k")))
    return jax.jit(lambda q, k, w: lightning_indexer.topk_indices(
        q, k, w, shape["topk"], chunk_size=chunk, impl=impl))
  if impl == "pallas":
    attn = lambda q, kv, idx: sparse_kernel.sparse_mla(
        q, kv, idx, v_dim=shape["v_dim"], scale=scale, interpret=interpret, backend=backend,
        block_k=tiles.get("sparse_block_k"))
  else:
    attn = lambda q, kv, idx: sparse_attention.sparse_mla(
        q, kv, idx, v_dim=shape["v_dim"], scale=scale, impl=impl, chunk_size=chunk)
  if op == "sparse_fwd":
    return jax.jit(attn)

  def fwd_bwd(q, kv, idx):
    loss = lambda q, kv: jnp.sum(attn(q, kv, idx)[0].astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1))(q, kv)
  return jax.jit(fwd_bwd)


def arg_shapes(op, shape, b, t, dtype=jnp.bfloat16, sharding=None):
  """ShapeDtypeStructs of `op`'s inputs at t = s (activations in `dtype`, w in float32)."""
  sds = lambda shp, dt: jax.ShapeDtypeStruct(shp, dt, sharding=sharding)
  if op == "indexer":
    return (sds((b, t, shape["h_i"], shape["d_i"]), dtype), sds((b, t, shape["d_i"]), dtype),
            sds((b, t, shape["h_i"]), jnp.float32))
  return (sds((b, t, shape["h"], shape["d_qk"]), dtype), sds((b, t, shape["d_qk"]), dtype),
          sds((b, t, shape["topk"]), jnp.int32))
