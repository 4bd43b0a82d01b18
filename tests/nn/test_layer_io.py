"""LayerInputs / LayerAux (glm5_jax/nn/layer_io.py): what every decoder layer reads and reports."""

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.nn import context_parallel as cp
from glm5_jax.nn import layer_io
from glm5_jax.nn import mtp as mtp_lib
from glm5_jax.nn import rope


def _documents(rng, b=2, t=16, n_docs=4):
  return np.sort(rng.integers(0, n_docs, (b, t)), axis=1).astype(np.int32)


def test_document_starts_equal_a_python_loop(rng):
  seg = _documents(rng)
  want = np.zeros_like(seg)
  for r in range(seg.shape[0]):
    for i in range(1, seg.shape[1]):
      want[r, i] = want[r, i - 1] if seg[r, i] == seg[r, i - 1] else i
  np.testing.assert_array_equal(layer_io.document_starts(jnp.asarray(seg)), want)


def test_create_computes_rope_tables_and_document_starts(rng, tiny_cfg):
  seg = _documents(rng)
  pos = np.broadcast_to(np.arange(16, dtype=np.int32), seg.shape)
  inputs = layer_io.LayerInputs.create(tiny_cfg, jnp.asarray(pos), jnp.asarray(seg))
  cos, sin = rope.rope_angles(pos, tiny_cfg.qk_rope_head_dim, tiny_cfg.rope_theta)
  np.testing.assert_array_equal(inputs.cos, cos)
  np.testing.assert_array_equal(inputs.sin, sin)
  np.testing.assert_array_equal(inputs.doc_start, layer_io.document_starts(jnp.asarray(seg)))
  assert inputs.order is None and inputs.cache_index is None and not inputs.with_indexer_loss


def test_create_in_a_context_parallel_layout_permutes_the_natural_inputs(rng, tiny_cfg):
  seg = jnp.asarray(_documents(rng))
  order = jnp.asarray(cp.zigzag_order(16, 2))
  natural = layer_io.LayerInputs.create(tiny_cfg, jnp.broadcast_to(jnp.arange(16), (2, 16)), seg)
  laid_out = layer_io.LayerInputs.create(tiny_cfg, jnp.broadcast_to(order, (2, 16)),
                                         cp.permute(seg, order), order)
  np.testing.assert_array_equal(laid_out.doc_start, cp.permute(natural.doc_start, order))
  np.testing.assert_array_equal(laid_out.cos, cp.permute(natural.cos, order))


def test_shift_tokens_in_a_context_parallel_layout_shifts_in_natural_order(rng):
  tokens = jnp.asarray(rng.integers(1, 100, (2, 16)), jnp.int32)
  order = jnp.asarray(cp.zigzag_order(16, 2))
  got = mtp_lib.shift_tokens(cp.permute(tokens, order), 3, order)
  want = np.concatenate([np.asarray(tokens)[:, 3:], np.zeros((2, 3), np.int32)], axis=1)
  np.testing.assert_array_equal(cp.natural(got, order), want)


def test_with_indexer_loss_is_static_and_the_arrays_are_leaves(tiny_cfg):
  inputs = layer_io.LayerInputs.create(tiny_cfg, jnp.zeros((1, 4), jnp.int32),
                                       with_indexer_loss=True)
  assert len(jax.tree.leaves(inputs)) == 2                  # cos, sin
  seen = []

  @jax.checkpoint                                           # no static_argnums needed
  def f(x, inputs):
    seen.append(inputs.with_indexer_loss)
    return x * inputs.cos.sum()

  jax.grad(f)(1.0, inputs)
  assert seen and all(s is True for s in seen)
