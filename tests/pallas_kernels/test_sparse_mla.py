"""Sparse MLA Pallas kernels (TPU and GPU lowerings, interpret mode) vs the reference.

Forward outputs and lse, and the gradients of q and kv (custom_vjp with Pallas
backward kernels) against `jax.vjp` of `sparse_mla_xla`. Tolerances are
normwise relative (max error / max magnitude): 1e-5 for float32, where the
kernels differ from the reference only in summation order; 1e-2 for bfloat16,
where they also round p and ds to bfloat16 at different points. Small slot
blocks (8 on TPU, 16 on GPU) make every test span several blocks, with a
ragged last block (topk not a multiple of the block).
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import sparse_attention
from pallas_kernels import testing
from pallas_kernels.lightning_indexer import xla as indexer_xla
from pallas_kernels.sparse_attention import gpu
from pallas_kernels.sparse_attention import kernel
from pallas_kernels.sparse_attention import xla

BLOCK_K = {"tpu": 8, "gpu": 16}
BACKENDS = sorted(BLOCK_K)
REL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _kernel_fn(backend, v_dim, scale):
  return functools.partial(kernel.sparse_mla, v_dim=v_dim, scale=scale, interpret=True,
                           backend=backend, block_k=BLOCK_K[backend])


def _reference_fn(v_dim, scale):
  return jax.jit(functools.partial(xla.sparse_mla_xla, v_dim=v_dim, scale=scale,
                                   chunk_size=4))


def _indexer_topk(q, k, w, topk):
  return jax.jit(indexer_xla.topk_indices_xla, static_argnums=3)(q, k, w, topk)


def _check_forward(backend, q, kv, idx, v_dim, rel):
  scale = q.shape[-1] ** -0.5
  out, lse = jax.jit(_kernel_fn(backend, v_dim, scale))(q, kv, idx)
  ref_out, ref_lse = _reference_fn(v_dim, scale)(q, kv, idx)
  assert out.dtype == q.dtype and lse.dtype == jnp.float32
  testing.assert_rel_close(out, ref_out, rel, "out")
  testing.assert_rel_close(lse, ref_lse, rel, "lse")
  return out, lse


def _check_forward_and_gradients(backend, q, kv, idx, v_dim, rel):
  scale = q.shape[-1] ** -0.5
  b, t, h, _ = q.shape
  rng = np.random.default_rng(99)
  # Cotangents for both outputs; lse's matters wherever a caller uses it (e.g. a KL loss).
  d_out = jnp.asarray(rng.standard_normal((b, t, h, v_dim)), q.dtype)
  d_lse = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)

  def outputs_and_grads(fn, a, b):
    outs, vjp = jax.vjp(lambda a, b: fn(a, b, idx), a, b)
    return outs, vjp((d_out, d_lse))

  (ref_out, ref_lse), (ref_dq, ref_dkv) = jax.jit(
      functools.partial(outputs_and_grads, _reference_fn(v_dim, scale)))(q, kv)
  (out, lse), (dq, dkv) = jax.jit(
      functools.partial(outputs_and_grads, _kernel_fn(backend, v_dim, scale)))(q, kv)
  assert dq.dtype == q.dtype and dkv.dtype == kv.dtype
  testing.assert_rel_close(out, ref_out, rel, "out")
  testing.assert_rel_close(lse, ref_lse, rel, "lse")
  testing.assert_rel_close(dq, ref_dq, rel, "dq")
  testing.assert_rel_close(dkv, ref_dkv, rel, "dkv")
  return out, lse


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_matches_dense_oracle(backend):
  # An independent oracle: full [t, s] logits with the selection as a mask.
  q, kv = testing.mla_inputs(3, b=1, t=4, s=30, h=2, d=24)
  idx = testing.unique_indices(4, 1, 4, 30, 11, p_empty=0.3)
  scale = 24 ** -0.5
  out, lse = jax.jit(_kernel_fn(backend, 16, scale))(q, kv, idx)
  want_out, want_lse = xla.sparse_mla_dense_oracle(q, kv, idx, v_dim=16, scale=scale)
  testing.assert_rel_close(out, want_out, 1e-5, "out")
  testing.assert_rel_close(lse, want_lse, 1e-5, "lse")


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_with_indexer_selection_and_value_equal_to_d(backend):
  # Prefill over indexer output: early queries have fewer causal keys than topk (-1 tails).
  # v_dim == d_qk: no rope tail at all.
  qi, ki, wi = testing.indexer_inputs(7, b=2, t=17, s=17, h_i=2, d_i=16)
  idx = _indexer_topk(qi, ki, wi, 9)
  q, kv = testing.mla_inputs(8, b=2, t=17, s=17, h=2, d=16)
  _check_forward(backend, q, kv, idx, v_dim=16, rel=REL[jnp.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_gradients_float32(backend):
  # Chunked prefill shape (t < s), batch 2, topk 19 (not a multiple of the block),
  # 25% empty slots, and one query with no valid slot at all (out 0, lse -inf, no gradient).
  q, kv = testing.mla_inputs(9, b=2, t=4, s=33, h=3, d=24)
  idx = testing.unique_indices(10, 2, 4, 33, 19, p_empty=0.25)
  idx = idx.at[0, 2].set(-1)
  out, lse = _check_forward_and_gradients(backend, q, kv, idx, v_dim=16, rel=REL[jnp.float32])
  assert np.all(np.asarray(out[0, 2]) == 0) and np.all(np.isneginf(np.asarray(lse[0, 2])))


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_gradients_bfloat16(backend):
  q, kv = testing.mla_inputs(11, b=1, t=2, s=30, h=4, d=24, dtype=jnp.bfloat16)
  idx = testing.unique_indices(12, 1, 2, 30, 17, p_empty=0.1)
  _check_forward_and_gradients(backend, q, kv, idx, v_dim=16, rel=REL[jnp.bfloat16])


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_gradients_decode_with_indexer_selection(backend):
  # Decode: one query at the last of 26 positions, topk 32 > 26 keys (a -1 tail).
  qi, ki, wi = testing.indexer_inputs(13, b=2, t=1, s=26, h_i=2, d_i=16)
  idx = _indexer_topk(qi, ki, wi, 32)
  q, kv = testing.mla_inputs(14, b=2, t=1, s=26, h=2, d=24)
  _check_forward_and_gradients(backend, q, kv, idx, v_dim=16, rel=REL[jnp.float32])


def test_gpu_forward_with_two_queries_per_program_matches_reference():
  # queries_per_program=2: t = 7 is odd (an empty query pads the last pair), the two queries
  # of a pair have different live block counts (query 0 has 5 slots, one block) and one
  # query has no valid slot (out 0, lse -inf).
  q, kv = testing.mla_inputs(20, b=2, t=7, s=40, h=3, d=24)
  idx = testing.unique_indices(21, 2, 7, 40, 37, p_empty=0.2)
  idx = idx.at[:, 0, 5:].set(-1).at[1, 3].set(-1)
  bk, scale = BLOCK_K["gpu"], 24 ** -0.5
  idx_b = kernel._blocked_indices(idx, bk)  # pylint: disable=protected-access
  n_live = kernel._live_blocks(idx_b, bk)[..., None]  # pylint: disable=protected-access
  q_p, kv_p = gpu.pad_operands(q, kv, 16)
  out, lse = jax.jit(functools.partial(gpu.sparse_mla_fwd, v_dim=16, scale=scale, block_k=bk,
                                       interpret=True, queries_per_program=2))(
                                           q_p, kv_p, idx_b, n_live)
  want_out, want_lse = _reference_fn(16, scale)(q, kv, idx)
  testing.assert_rel_close(out[:, :, :3, :16], want_out, REL[jnp.float32], "out")
  testing.assert_rel_close(lse[:, :, :3], want_lse, REL[jnp.float32], "lse")
  assert np.all(np.asarray(out[1, 3]) == 0) and np.all(np.isneginf(np.asarray(lse[1, 3, :3])))


def test_tpu_forward_and_gradients_with_duplicate_slots():
  # A row named twice by one query counts twice (as in the reference); the TPU
  # backward's read-modify-write of dkv must not lose either contribution.
  q, kv = testing.mla_inputs(15, b=1, t=3, s=10, h=2, d=24)
  idx = jnp.asarray(np.random.default_rng(16).integers(-1, 10, (1, 3, 12)), jnp.int32)
  assert any(len(set(r[r >= 0])) < len(r[r >= 0]) for r in np.asarray(idx)[0])
  _check_forward_and_gradients("tpu", q, kv, idx, v_dim=16, rel=REL[jnp.float32])


def test_api_pallas_impl_matches_xla_impl():
  # The lead's dispatcher with its defaults: impl="pallas", interpret on CPU -> TPU kernels.
  q, kv = testing.mla_inputs(17, b=1, t=2, s=20, h=2, d=24)
  idx = testing.unique_indices(18, 1, 2, 20, 8, p_empty=0.2)
  got = sparse_attention.sparse_mla(q, kv, idx, v_dim=16, scale=0.2, impl="pallas",
                                    interpret=True)
  want = sparse_attention.sparse_mla(q, kv, idx, v_dim=16, scale=0.2, impl="xla")
  for g, w_, name in zip(got, want, ("out", "lse")):
    testing.assert_rel_close(g, w_, 1e-5, name)


@pytest.mark.parametrize("backend,block_k", [("tpu", 12), ("gpu", 24), ("gpu", 8)])
def test_illegal_block_is_rejected(backend, block_k):
  q, kv = testing.mla_inputs(19, b=1, t=1, s=8, h=1, d=24)
  idx = jnp.zeros((1, 1, 4), jnp.int32)
  with pytest.raises(ValueError, match="block_k"):
    kernel.sparse_mla(q, kv, idx, v_dim=16, scale=1.0, interpret=True, backend=backend,
                      block_k=block_k)


def test_reference_kv_gradient_accumulates_in_float32():
  # Many queries (in several chunks) select the same few rows, so dkv is a long sum. Summed in
  # bfloat16 it was 0.4-0.6 off a float32 reference at GLM-5 shapes on an H200; the reference
  # now sums it in float32 and only rounds the result.
  seed = zlib.crc32(b"test_reference_kv_gradient_accumulates_in_float32")
  q32, kv32 = testing.mla_inputs(seed, b=1, t=512, s=16, h=4, d=24)
  idx = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (1, 512, 16))

  def dkv(q, kv):
    loss = lambda kv: jnp.sum(xla.sparse_mla_xla(
        q, kv, idx, v_dim=16, scale=0.2, chunk_size=32)[0].astype(jnp.float32))
    return jax.jit(jax.grad(loss))(kv)

  want = dkv(q32, kv32)
  got = dkv(q32.astype(jnp.bfloat16), kv32.astype(jnp.bfloat16))
  assert got.dtype == jnp.bfloat16
  testing.assert_rel_close(got, want, REL[jnp.bfloat16], "dkv")
