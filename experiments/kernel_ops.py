"""The DSA ops that the kernel experiments time or compile, at named head/dim presets.

Shared by `bench_kernels.py` (timing on a device), `aot_tpu_kernels.py` and
`aot_gpu_kernels.py` (compiling for a TPU or GPU without one).
"""

import jax
import jax.numpy as jnp

from glm5_jax import timing
from pallas_kernels import lightning_indexer
from pallas_kernels import sparse_attention
from pallas_kernels.lightning_indexer import kernel as indexer_kernel
from pallas_kernels.sparse_attention import kernel as sparse_kernel

SHAPES = {
    # h, d_qk, v_dim, h_i, d_i, topk (the released GLM-5 config)
    "glm5": dict(h=64, d_qk=576, v_dim=512, h_i=32, d_i=128, topk=2048),
    "tiny": dict(h=4, d_qk=24, v_dim=16, h_i=4, d_i=16, topk=16),
}
OPS = ("indexer", "sparse_fwd", "sparse_fwd_bwd")
IMPLS = ("pallas", "xla", "pallas_topk")     # pallas_topk: indexer only


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
    if impl in ("pallas", "pallas_topk"):     # pallas_topk: the score kernel + XLA's top_k
      return jax.jit(lambda q, k, w: indexer_kernel.topk_indices(
          q, k, w, shape["topk"], chunk_size=chunk, interpret=interpret, backend=backend,
          block_q=tiles.get("indexer_block_q"), block_k=tiles.get("indexer_block_k"),
          selection="kernel" if impl == "pallas" else "top_k"))
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


def measure_peaks(dtype):
  """(TFLOP/s of a square matmul, GB/s of an elementwise copy) on the default device."""
  on_cpu = jax.default_backend() == "cpu"
  n = 1024 if on_cpu else 8192
  a = jnp.ones((n, n), dtype)
  t_mm = timing.median_time(jax.jit(lambda x: x @ x), a, repeats=3)
  m = (16 if on_cpu else 1024) * 2 ** 20 // 4
  x = jnp.ones((m,), jnp.float32)
  t_cp = timing.median_time(jax.jit(lambda v: v * 2.0), x, repeats=3)
  return 2 * n ** 3 / t_mm / 1e12, 2 * m * 4 / t_cp / 1e9


def random_inputs(seed, shape, b, t, dtype):
  """Random indexer inputs (scales folded in, as the model does) and MLA q, kv, on device."""
  ks = jax.random.split(jax.random.key(seed), 5)
  h, d, h_i, d_i = shape["h"], shape["d_qk"], shape["h_i"], shape["d_i"]

  def draw():
    n = lambda k, shp, sc=1.0: (jax.random.normal(k, shp, jnp.float32) * sc).astype(dtype)
    return (n(ks[0], (b, t, h_i, d_i), d_i ** -0.5), n(ks[1], (b, t, d_i)),
            n(ks[2], (b, t, h_i), h_i ** -0.5), n(ks[3], (b, t, h, d)), n(ks[4], (b, t, d)))
  return jax.jit(draw)()
