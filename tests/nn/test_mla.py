"""MLA: absorbed form == expanded form (float64); sparse DSA path == masked oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax.nn import mla


def _mla_inputs(rng, b=2, t=7, s=7, h=3, n=5, p=4, c=6, v=5):
  a = lambda *shape: rng.normal(size=shape)
  return dict(q_nope=a(b, t, h, n), q_rope=a(b, t, h, p), c_kv=a(b, s, c), k_rope=a(b, s, p),
              w_uk=a(c, h, n), w_uv=a(c, h, v))


def test_absorbed_equals_expanded_float64(rng):
  with jax.enable_x64(True):
    x = {k: jnp.asarray(v, jnp.float64) for k, v in _mla_inputs(rng).items()}
    mask = mla.causal_mask(7, 7)[None] & jnp.asarray(rng.random((2, 7, 7)) < 0.7)
    mask = mask | jnp.eye(7, dtype=bool)[None]
    e = mla.mla_expanded_attention(**x, mask_bts=mask, scale=0.3)
    a = mla.mla_absorbed_attention(**x, mask_bts=mask, scale=0.3)
    assert e.dtype == jnp.float64
    np.testing.assert_allclose(a, e, rtol=1e-12, atol=1e-12)


def test_causal_mask_for_decode_offsets():
  m = np.asarray(mla.causal_mask(2, 5))
  np.testing.assert_array_equal(m, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])


@pytest.mark.parametrize("topk", [3, 16])
def test_sparse_attention_equals_masked_expanded(rng, topk):
  cfg = config_lib.get_preset("tiny", kv_lora_rank=6, qk_nope_head_dim=5, qk_rope_head_dim=4,
                              v_head_dim=5, num_attention_heads=3, num_key_value_heads=3,
                              index_topk=topk, attention_chunk_size=3)
  x = {k: jnp.asarray(v, jnp.float32) for k, v in _mla_inputs(rng, t=9, s=9).items()}
  scores = jnp.asarray(rng.normal(size=(2, 9, 9)), jnp.float32)
  from pallas_kernels.lightning_indexer import xla as ref
  idx = ref.deterministic_topk(scores, ref.causal_limit(9, 9), topk)
  kv = jnp.concatenate([x["c_kv"], x["k_rope"]], -1)
  got = mla.mla_sparse_attention(cfg, x["q_nope"], x["q_rope"], kv, x["w_uk"], x["w_uv"], idx)
  mask = mla.topk_mask(idx, 9) & mla.causal_mask(9, 9)[None]
  want = mla.mla_expanded_attention(**x, mask_bts=mask, scale=cfg.softmax_scale)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_mirrored_lanes_runs_one_lane_when_every_lane_is_alike(rng):
  """fn sees one lane when all 8 lanes are equal bit for bit (a lone request's mirrors), all
  of them otherwise (a lane differs; a signed zero counts), and the outputs are the same."""
  def fn(x, none, y):
    assert none is None
    return x * 2.0 + y[:, :1], jnp.full(x.shape[:1], x.shape[0])   # (out, lanes seen)
  x = jnp.asarray(np.repeat(rng.normal(size=(1, 5)), 8, 0), jnp.float32).at[:, 0].set(0.0)
  y = jnp.asarray(np.repeat(rng.normal(size=(1, 3)), 8, 0), jnp.float32)
  run = jax.jit(lambda x, y: mla.mirrored_lanes(fn, (x, None, y)))
  out, seen = run(x, y)
  np.testing.assert_array_equal(out, fn(x, None, y)[0])
  np.testing.assert_array_equal(seen, np.ones(8))
  for other in (x.at[5, 2].add(1.0), x.at[3, 0].set(-0.0)):
    out, seen = run(other, y)
    np.testing.assert_array_equal(out, fn(other, None, y)[0])
    np.testing.assert_array_equal(seen, np.full(8, 8))


def test_mirrored_lanes_leaves_wide_calls_whole(rng):
  """More lanes than a lone request is padded to: every lane runs, even when all alike."""
  x = jnp.asarray(np.repeat(rng.normal(size=(1, 4)), 16, 0), jnp.float32)
  seen = jax.jit(lambda x: mla.mirrored_lanes(lambda x: jnp.full(x.shape[:1], x.shape[0]),
                                              (x,)))(x)
  np.testing.assert_array_equal(seen, np.full(16, 16))
