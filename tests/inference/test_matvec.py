"""inference/matvec.py: one row through XLA:CPU's matrix-vector kernel, split at the k-blocks
of its matmul, equals the matmul's row bitwise; so does the engine's one-row head."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.inference import matvec


def test_candidates_follow_eigens_blocking_rule():
  """n = ceil(K / kmax) blocks of ceil(K / n) rounded up to 8 rows, the last one shorter;
  the single block first (worked out by hand for kmax = 320)."""
  assert matvec.candidates(64)[0] == (0, 64)
  assert (0, 256, 512) in matvec.candidates(512)
  assert (0, 312, 624, 936, 1248, 1536) in matvec.candidates(1536)
  assert (0, 296, 592, 888, 1184, 1480, 1776, 2048) in matvec.candidates(2048)
  for k in (64, 512, 1536, 2048):
    for bounds in matvec.candidates(k):
      assert bounds[0] == 0 and bounds[-1] == k and all(np.diff(bounds) > 0)


@pytest.mark.parametrize("k,n", [(64, 48), (512, 256), (1536, 512)])
def test_matvec_equals_the_matmuls_row_bitwise(k, n, rng):
  bounds = matvec.k_blocks(k, n)
  assert bounds is not None, f"no k-blocks found for [8, {k}] @ [{k}, {n}]"
  x = rng.standard_normal((8, k)).astype(np.float32)
  w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
  want = np.asarray(jax.jit(lambda x, w: x @ w)(x, w))
  blocks = matvec.split(jnp.asarray(w), bounds)
  one_row = jax.jit(matvec.matvec)
  for r in (0, 5):
    got = np.asarray(one_row(jnp.asarray(x[r]), blocks))
    np.testing.assert_array_equal(got, want[r])
    np.testing.assert_allclose(got, x[r].astype(np.float64) @ w.astype(np.float64),
                               rtol=1e-5, atol=1e-5)
  if k > 320:                                  # Eigen blocks k here: one block would differ
    whole = np.asarray(one_row(jnp.asarray(x[0]), (jnp.asarray(w),)))
    assert not np.array_equal(whole, want[0])


def test_no_split_is_served_when_no_candidate_matches(monkeypatch):
  monkeypatch.setattr(matvec, "candidates", lambda k: [(0, 100, k), (0, k // 2 + 8, k)])
  assert matvec.k_blocks.__wrapped__(512, 64) is None


def test_matvec_checks_that_its_blocks_cover_x():
  with pytest.raises(ValueError, match="blocks hold 4 rows"):
    matvec.matvec(jnp.ones((6,)), (jnp.ones((4, 3)),))


@pytest.fixture(scope="module")
def wide():
  """tiny with a 512-wide hidden state: a 786 KB head (over matvec.MIN_BYTES) in two k-blocks
  here; (speculative, matvec_head) -> a lone-request engine, made on first use."""
  cfg = config_lib.get_preset("tiny", hidden_size=512)
  params = gnn.init_params(cfg, 0)
  kw = dict(max_batch=1, max_len=48, block_size=8, steps_per_sync=4)

  @functools.cache
  def engine(spec, mv):
    return Engine(cfg, params, speculative=spec, num_draft=1, matvec_head=mv, **kw)
  return engine


def test_the_tiny_preset_keeps_the_matmul_head(tiny_cfg, tiny_params):
  assert Engine(tiny_cfg, tiny_params, max_batch=1, max_len=16).head_blocks is None


@pytest.mark.parametrize("speculative", [pytest.param(False, marks=pytest.mark.slow), True])
def test_one_row_head_engines_keep_the_matmul_heads_bits(wide, speculative, rng):
  """A lone request's decode steps (plain) or its MTP drafts, verify and first MTP call of
  each round (speculative, one draft: 2 tokens per lane) through the split head: the same
  sampled tokens and log-probs as the 8-lane matmul head (which equals the trainer:
  tests/inference/test_engine.py). Plain decoding is a slow test (CI time): its one-token
  calls are the MTP drafts' shape."""
  assert wide(speculative, False).head_blocks is None
  if wide(speculative, True).head_blocks is None:
    pytest.skip("matvec.k_blocks found no split of the head on this CPU")
  assert len(wide(speculative, True).head_blocks) > 2
  prompt = rng.integers(0, 256, 9).tolist()
  sp = SamplingParams(max_new_tokens=10, seed=4)
  outs = {mv: wide(speculative, mv).generate([prompt], sp)[0] for mv in (False, True)}
  assert outs[True].token_ids == outs[False].token_ids
  np.testing.assert_array_equal(outs[True].logprobs, outs[False].logprobs)


@pytest.mark.slow   # CI time: a plain engine of its own (tests/inference/test_speculative.py)
def test_greedy_speculative_with_the_one_row_head_emits_the_plain_tokens(wide, rng):
  prompt = rng.integers(0, 256, 7).tolist()
  sp = SamplingParams(max_new_tokens=9, temperature=0.0)
  assert (wide(True, True).generate([prompt], sp)[0].token_ids
          == wide(False, False).generate([prompt], sp)[0].token_ids)
