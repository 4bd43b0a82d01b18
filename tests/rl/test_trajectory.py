"""Trajectory batches (TITO alignment) and the trainer's per-token log-probs."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import policy
from glm5_jax.rl.algorithm.trajectory import Trajectory
from glm5_jax.rl.algorithm.trajectory import make_batch


def _rng(name: str):
  return np.random.default_rng(zlib.crc32(name.encode()))


def test_make_batch_aligns_every_field_with_its_token():
  a = Trajectory.from_response([5, 6, 7], [8, 9], [-0.5, -0.25], 3, group_id=0, reward=1.0)
  b = Trajectory.from_response([5], [4, 3, 2], [-1.0, -2.0, -3.0], 4, group_id=1,
                               reward=0.0)
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
    Trajectory.from_response([1], [2, 3], [-1.0], 0, group_id=0)
  a = Trajectory.from_response([1], [2], [-1.0], 0, group_id=0)
  with pytest.raises(ValueError, match="advantages"):
    make_batch([a], [1.0, 2.0])
  with pytest.raises(ValueError, match="length=1"):
    make_batch([a], [1.0], length=1)


def test_multi_turn_segment_puts_loss_only_on_sampled_tokens():
  """prompt [1 2] | turn 1 [3 4] (version 5) | observation [6 7] | turn 2 [8] (version 6)."""
  tr = Trajectory(tokens=[1, 2, 3, 4, 6, 7, 8], loss_mask=[0, 0, 1, 1, 0, 0, 1],
                  rollout_logp=[0, 0, -0.5, -0.25, 0, 0, -2.0],
                  versions=[-1, -1, 5, 5, -1, -1, 6], rollout_id="g000003/1", group_id="g000003",
                  segment_id=2, reward=1.0)
  assert (tr.id, tr.length, tr.num_loss_tokens) == ("g000003/1#2", 7, 3)
  assert (tr.oldest_version, tr.newest_version, tr.valid) == (5, 6, True)
  other = Trajectory.from_response([9], [9], [-1.0], [7], rollout_id="g000004/0",
                                   group_id="g000004", status="timeout")
  batch = make_batch([tr, other, tr], [1.0, 0.0, 1.0], length=8)
  np.testing.assert_array_equal(batch.tokens[0], [1, 2, 3, 4, 6, 7, 8, 0])
  np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 1, 1, 0, 0, 1, 0])
  np.testing.assert_array_equal(batch.rollout_logp[0], [0, 0, -0.5, -0.25, 0, 0, -2.0, 0])
  np.testing.assert_array_equal(batch.versions[0], [-1, -1, 5, 5, -1, -1, 6, -1])
  np.testing.assert_array_equal(batch.group_ids, [0, 1, 0])     # string ids: first appearance
  assert not other.valid and other.oldest_version == 7


def test_trajectory_rejects_misaligned_or_unknown_fields():
  ok = dict(tokens=[1, 2], loss_mask=[0.0, 1.0], rollout_logp=[0.0, -1.0], versions=[-1, 0])
  Trajectory(**ok)
  for bad, match in [(dict(versions=[-1]), "1 versions entries"),
                     (dict(status="crashed"), "status='crashed'"),
                     (dict(loss_mask=[1.0, 1.0]), "token 0 is a loss token"),
                     (dict(loss_mask=[0.0, 0.5]), "0.0 or 1.0"),
                     (dict(versions=[-1, -1]), "version < 0"),
                     (dict(tokens=[], loss_mask=[], rollout_logp=[], versions=[]), "no tokens")]:
    with pytest.raises(ValueError, match=match):
      Trajectory(**{**ok, **bad})
  with pytest.raises(ValueError, match="2 versions for 1 response"):
    Trajectory.from_response([1], [2], [-1.0], [0, 1])
  assert Trajectory(**{**ok, "loss_mask": [0.0, 0.0]}).oldest_version is None


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
  same = Trajectory.from_response([1], [2, 3], [-1.0, -1.0], 0,
                                  topk={1: np.array([[2, 1], [2, 1], [0, 2]]),
                                        2: np.array([[0, 2], [0, 2], [1, 2]])})
  assert policy.topk_mismatches([same], trainer) == (0, 2)
  other = Trajectory.from_response([1], [2, 3], [-1.0, -1.0], 0,
                                   topk={1: np.array([[1, 2], [9, 9], [0, 1]])})
  assert policy.topk_mismatches([other], trainer) == (1, 1)


def test_topk_mismatches_ignore_empty_slots_of_different_slot_counts():
  """The engine's slot count is min(index_topk, s) of its cache view, the trainer's that of
  its sequence: -1 (empty) slots may differ in number, the selected keys may not."""
  trainer = [np.array([[[0, 1, -1, -1], [0, 1, 2, -1]]])]
  engine = Trajectory.from_response([1], [2, 3], [-1.0, -1.0], 0,
                                    topk={0: np.array([[1, 0, -1]]), 1: np.array([[2, 1, 0]])})
  assert policy.topk_mismatches([engine], trainer) == (0, 2)
  wrong = Trajectory.from_response([1], [2, 3], [-1.0, -1.0], 0,
                                   topk={1: np.array([[2, 1, -1]])})
  assert policy.topk_mismatches([wrong], trainer) == (1, 1)
