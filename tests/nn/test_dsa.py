"""DSA's indexer KL loss (dense warm-up and sparse forms): numpy reference, chunking, memory."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.nn import dsa
from glm5_jax.nn import layer_io
from pallas_kernels.lightning_indexer import xla as ref

def _np_kl_dense(q_abs, kv, q_i, k_i, w_i, scale):
  b, t = q_abs.shape[:2]
  attn = np.einsum("bthd,bsd->bths", q_abs, kv) * scale
  iscore = np.einsum("btj,btjs->bts", w_i, np.maximum(np.einsum("btjd,bsd->btjs", q_i, k_i), 0))
  causal = np.tril(np.ones((t, t), bool))
  total = 0.0
  for bi in range(b):
    for i in range(t):
      a = attn[bi, i][:, causal[i]]
      pa = np.exp(a - a.max(-1, keepdims=True))
      p = (pa / pa.sum(-1, keepdims=True)).sum(0)
      p /= p.sum()
      s = iscore[bi, i][causal[i]]
      q = np.exp(s - s.max())
      q /= q.sum()
      total += np.sum(p * (np.log(p + 1e-10) - np.log(q + 1e-10)))
  return total / (b * t)


def _kl_inputs(rng, t=7):
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  return f(2, t, 3, 10), f(2, t, 10), f(2, t, 2, 4), f(2, t, 4), f(2, t, 2)


def test_dense_indexer_kl_matches_numpy(rng):
  args = _kl_inputs(rng)
  got = dsa.indexer_kl_dense(*args, scale=0.4, chunk_size=3)
  want = _np_kl_dense(*(np.asarray(a, np.float64) for a in args), 0.4)
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_sparse_kl_with_every_key_selected_equals_dense(rng):
  args = _kl_inputs(rng)
  q_i, k_i, w_i = args[2:]
  idx = ref.topk_indices_xla(q_i, k_i, w_i, 16)
  np.testing.assert_allclose(dsa.indexer_kl_sparse(*args, scale=0.4, indices=idx, chunk_size=2),
                             dsa.indexer_kl_dense(*args, scale=0.4), rtol=1e-5)


def test_kl_target_is_detached(rng):
  args = _kl_inputs(rng)
  g = jax.grad(lambda qa, kv: dsa.indexer_kl_dense(qa, kv, *args[2:], scale=0.4), (0, 1))(*args[:2])
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in g)


@pytest.mark.parametrize("chunk", [1, 5, 8, 64])
def test_blockwise_dense_kl_equals_query_chunked_with_packed_documents(request, chunk):
  rng = np.random.default_rng(zlib.crc32(request.node.name.encode()))
  q_abs, kv, *indexer_args = _kl_inputs(rng, t=21)
  seg = np.sort(rng.integers(0, 4, (2, 21)), axis=1)
  kw = dict(scale=0.4, chunk_size=chunk, doc_start=layer_io.document_starts(jnp.asarray(seg)),
            mask_bt=jnp.asarray(rng.random((2, 21)) < 0.7, jnp.float32))
  run = lambda kl_fn: jax.jit(jax.value_and_grad(
      lambda qi, ki, wi: kl_fn(q_abs, kv, qi, ki, wi, **kw), (0, 1, 2)))(*indexer_args)
  (got, got_g), (want, want_g) = (run(dsa.indexer_kl_dense),
                                  run(dsa.indexer_kl_dense_reference))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for name, a, b in zip(("q_i", "k_i", "w_i"), got_g, want_g):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=name)


def _dense_kl_memory(kl_fn, t, chunk=64, h=4, d=24, h_i=4, d_i=16):
  """XLA's temp bytes of the dense KL and its gradient wrt the indexer inputs (batch 1)."""
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  args = (shape(1, t, h, d), shape(1, t, d), shape(1, t, h_i, d_i), shape(1, t, d_i),
          shape(1, t, h_i), jax.ShapeDtypeStruct((1, t), jnp.int32))
  grad = jax.grad(lambda qa, kv, qi, ki, wi, ds: kl_fn(
      qa, kv, qi, ki, wi, scale=0.2, chunk_size=chunk, doc_start=ds), (2, 3, 4))
  return jax.jit(grad).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_dense_kl_memory_is_linear_and_never_a_chunk_by_all_keys_block():
  # Query-chunked: a float32 [1, chunk, h, s] block per chunk (175 MiB at 32K here);
  # blockwise: 0.5 MiB at 8K, 1.2 MiB at 32K.
  m8 = _dense_kl_memory(dsa.indexer_kl_dense, 8192)
  m32 = _dense_kl_memory(dsa.indexer_kl_dense, 32768)
  assert m32 <= 8 * m8, (m8, m32)
  assert m32 < 64 * 4 * 32768 * 4, m32
