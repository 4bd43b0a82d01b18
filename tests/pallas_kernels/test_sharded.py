"""The DSA kernels under a device mesh: `glm5_jax.nn.dsa` == one device.

XLA cannot partition a Pallas kernel (on TPU, Mosaic refuses a sharded one), so
with a mesh set the model calls each kernel inside `shard_map`: batch over the
batch axes, sparse-attention heads over `tensor` (dkv summed over `tensor` by
the transpose). Runs in a subprocess with 8 fake CPU devices, kernels in
interpret mode. The Triton lowering's interpreter is used: the TPU one simulates
every DMA and takes minutes on 8 devices; the partitioning is the same for
both, and tests/pallas_kernels/test_aot.py compiles the TPU kernels under a mesh.
"""

import textwrap

from tests import fake_devices
from tests import seeding

_SCRIPT = textwrap.dedent("""
  import jax, jax.numpy as jnp, numpy as np
  from glm5_jax import sharding as shd
  from glm5_jax.nn import dsa
  from pallas_kernels import lightning_indexer, sparse_attention
  rng = np.random.default_rng(SEED)
  b, t, h, d, v, topk = 4, 40, 4, 24, 16, 12
  h_i, d_i = 2, 8
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  qi, ki, wi = normal(b, t, h_i, d_i), normal(b, t, d_i), normal(b, t, h_i)
  start = jnp.asarray(np.repeat([[0] * 15 + [15] * 25], b, 0), jnp.int32)  # 2 packed docs
  q, kv = normal(b, t, h, d), normal(b, t, d)
  d_out, d_lse = normal(b, t, h, v), normal(b, t, h)
  kw = dict(v_dim=v, scale=d ** -0.5, chunk_size=16)

  def run(impl, interpret, backend=None):
    idx = jax.jit(lambda *a: dsa.topk_indices(
        *a, topk, impl=impl, interpret=interpret, chunk_size=16, start=start,
        backend=backend))(qi, ki, wi)
    f = lambda q, kv: dsa.sparse_mla(q, kv, idx, impl=impl, interpret=interpret,
                                             backend=backend, **kw)
    outs, grads = jax.jit(lambda q, kv: (lambda o, vjp: (o, vjp((d_out, d_lse))))(
        *jax.vjp(f, q, kv)))(q, kv)
    return idx, outs, grads

  ref = run("xla", False)                                  # no mesh: one device
  for sizes in ({"data": 2, "fsdp": 2, "expert": 1, "tensor": 2},
                {"data": 1, "fsdp": 2, "expert": 1, "tensor": 4},
                {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}):   # 8 does not divide b=4
    with jax.set_mesh(shd.make_mesh(sizes)):
      got = run("pallas", True, "gpu")
      if sizes["data"] == 2:   # the kernels really run per shard: no all-gather of q
        hlo = jax.jit(lambda q, kv, idx: dsa.sparse_mla(
            q, kv, idx, impl="pallas", interpret=True, backend="gpu", **kw)).lower(
                q, kv, ref[0]).as_text()
        assert "shard_map" in hlo or "sdy.manual_computation" in hlo, hlo[:2000]
    np.testing.assert_array_equal(got[0], ref[0])
    for name, a, r in zip(("out", "lse", "dq", "dkv"), (*got[1], *got[2]), (*ref[1], *ref[2])):
      r = np.asarray(r)
      err = np.max(np.abs(np.where(np.isfinite(r), np.asarray(a) - r, 0)))
      assert err <= 1e-5 * np.max(np.abs(np.where(np.isfinite(r), r, 0))), (sizes, name, err)
  print("OK")
""")


def test_kernels_under_a_mesh_equal_one_device():
  fake_devices.run_script(_SCRIPT.replace("SEED", str(seeding.seed())), devices=8)
