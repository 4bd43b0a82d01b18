"""The Pallas kernels lower for TPU (Mosaic) and CUDA (Triton) at GLM-5 shapes, from a CPU host.

`jax.export(..., platforms=[...])` runs JAX's Pallas lowering for the target
without hardware: the TPU lowering checks block shapes ((8, 128)-aligned or
whole) and that every primitive has a Mosaic rule; the Triton lowering checks
power-of-two tensor sizes and primitive support. The device compilers behind
the custom calls (libtpu's Mosaic, Triton's PTX backend) run in
tests/pallas_kernels/test_aot.py, in the `aot` venv.

Shapes are GLM-5's (docs/design.md §1): h=64, d_qk=576, v_dim=512, h_i=32, d_i=128,
topk=2048, at a sequence length of 4096; the top-k selection also at GLM-5's longest
context, 202,752 keys. Nothing runs, so this is fast.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import lightning_indexer
from pallas_kernels import sparse_attention
from pallas_kernels import testing
from pallas_kernels.lightning_indexer import kernel as indexer_kernel
from pallas_kernels.sparse_attention import gpu as sparse_gpu

SEQ = 4096
H, D_QK, V_DIM = 64, 576, 512
H_I, D_I, TOPK = 32, 128, 2048
# The Triton custom call has no export compatibility guarantee; we only lower it.
TRITON_CALL = "__gpu$xla.gpu.triton"
CUSTOM_CALL = {"tpu": "tpu_custom_call", "cuda": TRITON_CALL}
NO_TRITON_CHECK = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
INDEXER_KERNELS = ["lightning_indexer_scores", "lightning_indexer_select"]
LONGEST = 202752                       # GLM-5's max_position_embeddings


def _export(fn, platforms, *args):
  with testing.cuda_target():            # jax >= 0.11: the GPU a CUDA lowering targets
    return jax.export.export(jax.jit(fn), platforms=platforms,
                             disabled_checks=NO_TRITON_CHECK)(*args).mlir_module()


def _kernel_calls(module: str, platform: str):
  """Names of the Pallas kernels behind `platform`'s custom calls in `module`."""
  names = []
  for line in module.splitlines():
    if f"custom_call @{CUSTOM_CALL[platform]}" in line:
      names += re.findall(r'name = "([a-z_]+)"', line)
  return names


def _mla_args(t):
  return (jax.ShapeDtypeStruct((1, t, H, D_QK), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, SEQ, D_QK), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, t, TOPK), jnp.int32))


def _mla_forward_and_backward(q, kv, idx):
  def f(q, kv):
    return sparse_attention.sparse_mla(q, kv, idx, v_dim=V_DIM, scale=D_QK ** -0.5,
                                       impl="pallas")
  (out, lse), vjp = jax.vjp(f, q, kv)
  return out, lse, vjp((out, lse))


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("t", [SEQ, 1], ids=["prefill", "decode"])
def test_sparse_mla_forward_and_backward_lower(platform, t):
  module = _export(_mla_forward_and_backward, [platform], *_mla_args(t))
  assert sorted(_kernel_calls(module, platform)) == ["sparse_mla_bwd", "sparse_mla_fwd"]


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("t", [SEQ, 1], ids=["prefill", "decode"])
def test_lightning_indexer_lowers(platform, t):
  args = (jax.ShapeDtypeStruct((1, t, H_I, D_I), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, SEQ, D_I), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, t, H_I), jnp.float32))
  f = lambda q, k, w: lightning_indexer.topk_indices(q, k, w, TOPK, impl="pallas")
  module = _export(f, [platform], *args)
  assert _kernel_calls(module, platform) == INDEXER_KERNELS


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_ragged_shapes_lower(platform):
  # Nothing a power of two or a multiple of a tile: s=4001 keys, t=3 queries, topk=2000.
  q = jax.ShapeDtypeStruct((2, 3, H, D_QK), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 4001, D_QK), jnp.bfloat16)
  idx = jax.ShapeDtypeStruct((2, 3, 2000), jnp.int32)
  module = _export(_mla_forward_and_backward, [platform], q, kv, idx)
  assert sorted(_kernel_calls(module, platform)) == ["sparse_mla_bwd", "sparse_mla_fwd"]
  args = (jax.ShapeDtypeStruct((1, 1000, H_I, D_I), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, 4001, D_I), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, 1000, H_I), jnp.float32))
  f = lambda q, k, w: lightning_indexer.topk_indices(q, k, w, TOPK, impl="pallas")
  assert _kernel_calls(_export(f, [platform], *args), platform) == INDEXER_KERNELS


def _tpu_call_types(module: str):
  """Shapes of every operand and result of the TPU kernels' custom calls in `module`."""
  shapes = []
  for line in module.splitlines():
    if "custom_call @tpu_custom_call" in line:
      shapes += [tuple(int(x) for x in m.split("x")[:-1])
                 for m in re.findall(r"tensor<([0-9x]+x[a-z]+[0-9]+)>", line)]
  return shapes


def test_tpu_kernel_operands_tile_without_padding():
  # XLA:TPU tiles the two minor dims of an HBM array by (8, 128): an operand shaped
  # [..., n, 1] (a per-head lse column, a per-slot index column) is stored 128 lanes
  # wide, 128x its bytes; at 32K context such columns made the backward need 45 GiB of
  # temporaries (experiments/aot_tpu_kernels.py). Every large operand must have a
  # minor dim > 1.
  module = _export(_mla_forward_and_backward, ["tpu"], *_mla_args(SEQ))
  shapes = _tpu_call_types(module)
  assert shapes
  for shape in shapes:
    size = 1
    for n in shape:
      size *= n
    assert shape[-1] > 1 or size <= 1024, shape


def test_platform_picks_the_kernel():
  # backend=None dispatches with lax.platform_dependent at lowering time: a TPU export
  # holds only Mosaic kernels and a CUDA export only Triton ones. (One export per
  # platform: a multi-platform export lowers every branch for every platform, and the
  # TPU branch's compiler params are refused by the GPU lowering in jax 0.10.2.)
  tpu_module = _export(_mla_forward_and_backward, ["tpu"], *_mla_args(128))
  cuda_module = _export(_mla_forward_and_backward, ["cuda"], *_mla_args(128))
  assert TRITON_CALL not in tpu_module and "tpu_custom_call" in tpu_module
  assert "tpu_custom_call" not in cuda_module and TRITON_CALL in cuda_module


def test_tpu_lowering_rejects_an_unaligned_tile():
  # The interpret-mode tests use 8-wide key tiles; on TPU a score tile's lane dim must be
  # a multiple of 128 (or the whole axis). The export check is what catches that on CPU.
  args = (jax.ShapeDtypeStruct((1, 256, H_I, D_I), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, 256, D_I), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, 256, H_I), jnp.float32))
  f = lambda q, k, w: indexer_kernel.topk_indices(q, k, w, 64, backend="tpu", block_k=8)
  with pytest.raises(ValueError, match="divisible by 8 and 128"):
    _export(f, ["tpu"], *args)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_selection_lowers_at_the_longest_context(platform):
  # The top-k selection alone: k = 2048 of s = 202,752 keys for a chunk of 256 queries,
  # without sort, top_k or cumsum on TPU and without sort on Triton.
  backend = {"tpu": "tpu", "cuda": "gpu"}[platform]
  args = (jax.ShapeDtypeStruct((1, 256, LONGEST), jnp.float32),
          jax.ShapeDtypeStruct((1, 256), jnp.int32), jax.ShapeDtypeStruct((1, 256), jnp.int32))
  f = lambda scores, start, limit: indexer_kernel.select(backend, scores, start, limit, TOPK,
                                                         LONGEST, False)
  module = _export(f, [platform], *args)
  assert _kernel_calls(module, platform) == ["lightning_indexer_select"]
  assert "tensor<1x256x2048xi32>" in module


def test_two_queries_per_program_forward_lowers_for_cuda():
  q, kv, idx = _mla_args(SEQ)
  kv_p = jax.ShapeDtypeStruct(kv.shape, kv.dtype)
  n_live = jax.ShapeDtypeStruct((1, SEQ, 1), jnp.int32)
  f = lambda q, kv, idx, n: sparse_gpu.sparse_mla_fwd(
      q, kv, idx, n, v_dim=V_DIM, scale=D_QK ** -0.5, block_k=32, queries_per_program=2,
      num_stages=1)
  module = _export(f, ["cuda"], q, kv_p, idx, n_live)
  assert _kernel_calls(module, "cuda") == ["sparse_mla_fwd"]
