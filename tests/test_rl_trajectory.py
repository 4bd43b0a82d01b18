"""Trajectory batches (TITO alignment) and the trainer's per-token log-probs."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.rl import policy
from glm5_jax.rl.trajectory import Trajectory
from glm5_jax.rl.trajectory import make_batch


def _rng(name: str):
  return np.random.default_rng(zlib.crc32(name.encode()))


def test_make_batch_aligns_every_field_with_its_token():
  a = Trajectory([5, 6, 7], [8, 9], [-0.5, -0.25], version=3, group_id=0, reward=1.0)
  b = Trajectory([5], [4, 3, 2], [-1.0, -2.0, -3.0], version=4, group_id=1, reward=0.0)
  batch = make_batch([a, b], [0.5, -0.5])
  assert batch.tokens.shape == (2, 16)
  np.testing.assert_array_equal(batch.tokens[0, :6], [5, 6, 7, 8, 9, 0])
  np.testing.assert_array_equal(batch.loss_mask[0, :6], [0, 0, 0, 1, 1, 0])
  np.testing.assert_array_equal(batch.rollout_logp[0, :6], [0, 0, 0, -0.5, -0.25, 0])
  np.testing.assert_array_equal(batch.versions[1, :5], [-1, 4, 4, 4, -1])
  np.testing.assert_array_equal(batch.segment_ids[1, :5], [1, 1, 1, 1, 0])
  np.testing.assert_array_equal(batch.advantages, [0.5, -0.5])
  np.testing.assert_array_equal(batch.rows([1]).tokens, batch.tokens[1:])


def test_make_batch_rejects_mismatched_inputs():
  with pytest.raises(ValueError, match="rollout log-probs"):
    Trajectory([1], [2, 3], [-1.0], version=0, group_id=0)
  a = Trajectory([1], [2], [-1.0], version=0, group_id=0)
  with pytest.raises(ValueError, match="advantages"):
    make_batch([a], [1.0, 2.0])
  with pytest.raises(ValueError, match="length=1"):
    make_batch([a], [1.0], length=1)


def test_token_logprobs_equal_the_full_log_softmax():
  rng = _rng("test_token_logprobs_equal_the_full_log_softmax")
  b, t, d, v = 2, 11, 8, 13
  h = rng.standard_normal((b, t, d)).astype(np.float32)
  w = rng.standard_normal((d, v)).astype(np.float32)
  y = rng.integers(0, v, (b, t)).astype(np.int32)
  logp, ent = jax.jit(lambda h, w, y: policy.token_logprobs(h, w, y, chunk_size=4))(h, w, y)
  logits = h.astype(np.float64) @ w.astype(np.float64)
  ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  want = np.zeros((b, t))
  want_ent = np.zeros((b, t))
  for i in range(b):
    for j in range(1, t):
      want[i, j] = ref[i, j - 1, y[i, j]]
      want_ent[i, j] = -(np.exp(ref[i, j - 1]) * ref[i, j - 1]).sum()
  np.testing.assert_allclose(logp, want, atol=1e-5)
  np.testing.assert_allclose(ent, want_ent, atol=1e-5)
  g = jax.grad(lambda h: jnp.sum(policy.token_logprobs(h, w, y, chunk_size=4)[0]))(h)
  g_full = jax.grad(lambda h: jnp.sum(policy.token_logprobs(h, w, y, chunk_size=64)[0]))(h)
  np.testing.assert_allclose(g, g_full, atol=1e-5)


def test_topk_mismatches_counts_positions_where_a_layer_differs():
  trainer = [np.array([[[0, 1], [1, 2], [2, 0]]]), None, np.array([[[0, 1], [0, 2], [1, 2]]])]
  same = Trajectory([1], [2, 3], [-1.0, -1.0], 0, 0,
                    topk={1: np.array([[2, 1], [2, 1], [0, 2]]),
                          2: np.array([[0, 2], [0, 2], [1, 2]])})
  assert policy.topk_mismatches([same], trainer) == (0, 2)
  other = Trajectory([1], [2, 3], [-1.0, -1.0], 0, 0,
                     topk={1: np.array([[1, 2], [9, 9], [0, 1]])})
  assert policy.topk_mismatches([other], trainer) == (1, 1)


def test_topk_mismatches_ignore_empty_slots_of_different_slot_counts():
  """The engine's slot count is min(index_topk, s) of its cache view, the trainer's that of
  its sequence: -1 (empty) slots may differ in number, the selected keys may not."""
  trainer = [np.array([[[0, 1, -1, -1], [0, 1, 2, -1]]])]
  engine = Trajectory([1], [2, 3], [-1.0, -1.0], 0, 0,
                      topk={0: np.array([[1, 0, -1]]), 1: np.array([[2, 1, 0]])})
  assert policy.topk_mismatches([engine], trainer) == (0, 2)
  wrong = Trajectory([1], [2, 3], [-1.0, -1.0], 0, 0, topk={1: np.array([[2, 1, -1]])})
  assert policy.topk_mismatches([wrong], trainer) == (1, 1)
