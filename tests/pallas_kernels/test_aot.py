"""The TPU kernels compile with libtpu's compiler for a described TPU, on a CPU host.

`jax.experimental.topologies.get_topology_desc` describes a v5e slice (16 GiB of
HBM per chip) without owning one; `.compile()` then runs XLA:TPU and Mosaic as
a TPU VM would, so VMEM overflows, ops Mosaic cannot lay out, and operands that
XLA must pad in HBM show up without hardware. Needs libtpu, which lives in the
second venv of launch/local.sh (it makes every jax import probe for a TPU):

  bash launch/local.sh aot python -m pytest -q -m aot tests/pallas_kernels/test_aot.py

Shapes are GLM-5's at 32K context (h=64, d_qk=576, v_dim=512, topk=2048,
h_i=32, d_i=128), bfloat16 activations.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("libtpu", reason="needs libtpu: bash launch/local.sh aot ...")
pytestmark = pytest.mark.aot

from experiments import kernel_ops  # pylint: disable=g-import-not-at-top
from glm5_jax import config as config_lib  # pylint: disable=g-import-not-at-top
from glm5_jax import nn as gnn  # pylint: disable=g-import-not-at-top
from glm5_jax import sharding as shd  # pylint: disable=g-import-not-at-top
from glm5_jax.nn import dsa  # pylint: disable=g-import-not-at-top
from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
from pallas_kernels import roofline  # pylint: disable=g-import-not-at-top

SHAPE = kernel_ops.SHAPES["glm5"]
SEQ = 32768


@pytest.fixture(scope="module")
def v5e():
  device = topologies.get_topology_desc("v5e:2x2", "tpu").devices[0]
  return jax.sharding.SingleDeviceSharding(device)


def _compile(op, impl, t, sharding):
  fn = kernel_ops.op_fn(op, impl, SHAPE, backend="tpu", chunk=256, interpret=False)
  args = kernel_ops.arg_shapes(op, SHAPE, 1, t, sharding=sharding)
  return fn.trace(*args).lower(lowering_platforms=("tpu",)).compile()


def test_sparse_forward_and_backward_fit_a_v5e_at_32k(v5e):
  # Before the lse / index columns were laid out as rows, this needed 45.6 GiB of
  # temporaries and did not compile for a 16 GiB chip.
  mem = _compile("sparse_fwd_bwd", "pallas", SEQ, v5e).memory_analysis()
  n_valid = sum(min(i + 1, SHAPE["topk"]) for i in range(SEQ))
  need = roofline.cost("sparse_fwd_bwd", b=1, t=SEQ, s=SEQ, n_valid=n_valid,
                       dtype=jnp.bfloat16, **SHAPE).bytes
  assert mem.temp_size_in_bytes < need, (mem.temp_size_in_bytes, need)


@pytest.mark.parametrize("op", ["indexer", "sparse_fwd"])
@pytest.mark.parametrize("t", [SEQ, 1], ids=["prefill", "decode"])
def test_kernels_compile_for_v5e(op, t, v5e):
  if t == 1:  # decode: one query against a 32K cache
    fn = kernel_ops.op_fn(op, "pallas", SHAPE, backend="tpu", chunk=256, interpret=False)
    args = list(kernel_ops.arg_shapes(op, SHAPE, 1, 1, sharding=v5e))
    cache = kernel_ops.arg_shapes(op, SHAPE, 1, SEQ, sharding=v5e)[1]
    args[1] = cache
    fn.trace(*args).lower(lowering_platforms=("tpu",)).compile()
  else:
    _compile(op, "pallas", t, v5e)


def test_model_kernel_calls_compile_on_a_sharded_v5e_mesh():
  # Mosaic refuses a kernel with sharded operands ("cannot be automatically partitioned");
  # glm5_jax.nn.dsa runs each kernel in shard_map (batch over data, heads over tensor).
  devices = np.array(topologies.get_topology_desc("v5e:2x2", "tpu").devices)
  mesh = jax.sharding.Mesh(devices.reshape(2, 1, 1, 1, 2), shd.MESH_AXES)
  b, t = 4, 4096
  named = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  q = jax.ShapeDtypeStruct((b, t, SHAPE["h"], SHAPE["d_qk"]), jnp.bfloat16,
                           sharding=named("data", None, "tensor"))
  kv = jax.ShapeDtypeStruct((b, t, SHAPE["d_qk"]), jnp.bfloat16, sharding=named("data"))
  qi = jax.ShapeDtypeStruct((b, t, SHAPE["h_i"], SHAPE["d_i"]), jnp.bfloat16,
                            sharding=named("data", None, "tensor"))
  ki = jax.ShapeDtypeStruct((b, t, SHAPE["d_i"]), jnp.bfloat16, sharding=named("data"))
  wi = jax.ShapeDtypeStruct((b, t, SHAPE["h_i"]), jnp.float32, sharding=named("data"))

  def attention_loss(q, kv, qi, ki, wi):
    idx = dsa.topk_indices(qi, ki, wi, SHAPE["topk"], impl="pallas", interpret=False,
                                   chunk_size=256)
    out, _ = dsa.sparse_mla(q, kv, idx, v_dim=SHAPE["v_dim"], scale=0.04,
                                    impl="pallas", interpret=False, chunk_size=256)
    return jnp.sum(out.astype(jnp.float32))

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(attention_loss, argnums=(0, 1))).trace(
        q, kv, qi, ki, wi).lower(lowering_platforms=("tpu",)).compile()
  assert "all-reduce" in compiled.as_text()       # dkv summed over the tensor axis


def test_small_model_training_gradient_compiles_with_pallas_on_a_v5e_mesh():
  # The whole model (`small` preset, 2 layers, bfloat16) with attention_impl="pallas",
  # differentiated as in training, on a data 2 x tensor 2 mesh: every kernel call is
  # partitioned and has a gradient rule, and the model's kernels are chosen by the lowering
  # platform (interpret=None), not by this CPU host.
  cfg = config_lib.get_preset("small", attention_impl="pallas", dtype="bfloat16",
                              num_hidden_layers=2)
  devices = np.array(topologies.get_topology_desc("v5e:2x2", "tpu").devices)
  mesh = jax.sharding.Mesh(devices.reshape(2, 1, 1, 1, 2), shd.MESH_AXES)
  shapes, specs = gnn.abstract_params(cfg)
  params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, shd.param_shardings(specs, mesh))
  tokens = jax.ShapeDtypeStruct((4, 2048), jnp.int32, sharding=shd.batch_sharding(mesh))

  def loss(p, tokens):
    out = gnn.GLM5(cfg).apply({"params": p}, tokens, return_logits=False,
                              with_indexer_loss=True)
    return jnp.mean(out.hidden.astype(jnp.float32) ** 2) + jnp.sum(out.indexer_kl)

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss)).trace(params, tokens).lower(
        lowering_platforms=("tpu",)).compile()
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') > 0


@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1"])
def test_selection_compiles_for_v5e_and_v5p_at_the_longest_context(topology):
  # k = 2048 of s = 202,752 keys (GLM-5's max_position_embeddings), 256 query rows: the
  # ops the kernel is built from (rolls, compare-adds, lane reductions, 0/1 matmuls, a 3-D
  # VMEM scratch) all lay out in Mosaic, and its 13 MiB of scratch fits VMEM.
  from experiments import aot_tpu_kernels  # pylint: disable=g-import-not-at-top
  device = topologies.get_topology_desc(topology, "tpu").devices[0]
  row = aot_tpu_kernels.selection_row(202752, SHAPE["topk"],
                                      jax.sharding.SingleDeviceSharding(device))
  assert row["ok"], row.get("error")
  print(f"{device.device_kind}: selection VMEM declared {row['declared_vmem_bytes'] / 2 ** 20:.1f}"
        f" MiB, compiles under {row['least_vmem_limit_mib']} MiB")
  assert row["least_vmem_limit_mib"] * 2 ** 20 >= row["declared_vmem_bytes"]


def test_gpu_kernels_fit_an_h200():
  # Triton's own compiler and ptxas for sm_90a on the IR JAX emits (GLM-5 shapes, seq 4096):
  # every kernel compiles and fits the 227 KiB of shared memory a block may use. The
  # backward once needed 516,352 B and would not have launched.
  pytest.importorskip("triton")
  from experiments import aot_gpu_kernels  # pylint: disable=g-import-not-at-top
  kernels = {**aot_gpu_kernels.sparse_mla_modules(), **aot_gpu_kernels.indexer_modules()}
  assert sorted(kernels) == ["lightning_indexer_scores", "lightning_indexer_select",
                             "sparse_mla_bwd", "sparse_mla_fwd"]
  # The selection at GLM-5's longest context, and the forward with two queries per program.
  longest = aot_gpu_kernels.selection_modules()["lightning_indexer_select"]
  pair = aot_gpu_kernels.sparse_fwd_modules(2, 32, 1)["sparse_mla_fwd"]
  jobs = [(name, *v) for name, v in kernels.items()]
  jobs += [("lightning_indexer_select", *longest), ("sparse_mla_fwd", *pair)]
  for name, ttir, warps, stages in jobs:
    row = aot_gpu_kernels.compile_kernel(name, ttir, warps, stages)
    assert row["ok"], row["error"]
    print(f"{name}: {warps} warps, {stages} stages, {row['registers']} registers, "
          f"{row['shared']:,} B shared memory, spills {row['spill_stores']} B")
    assert row["shared"] <= aot_gpu_kernels.SMEM_LIMIT, row
    assert row["gpu_fences"] == 0, row      # dkv's atomics are relaxed (no MEMBAR.ALL.GPU)
