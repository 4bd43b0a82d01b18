"""The model over a paged KV cache (`GLM5.apply(..., cache=)`) vs the same model over the
whole sequence, for config variants the engine tests do not cover: dense attention (DSA
warm-up stage) and IndexShare "shared" layers. Tiny preset, two chunks per row through one
jitted step; each row's blocks are scattered over the pool (a permuted block table).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax.nn import kv_cache
from glm5_jax.nn import layer_stack


@pytest.mark.parametrize("overrides", [
    dict(),
    pytest.param(dict(attention_type="dense"), marks=pytest.mark.slow),   # CI time budget
    pytest.param(dict(indexer_types=("full", "shared", "full"), index_topk=4),
                 marks=pytest.mark.slow),
], ids=["sparse", "dense", "index_share"])
def test_chunked_cached_forward_equals_the_full_forward(overrides, rng):
  cfg = config_lib.get_preset("tiny", num_nextn_predict_layers=0, mtp_num_steps=0, **overrides)
  params = gnn.init_params(cfg, 0)
  model = gnn.GLM5(cfg)
  tokens = rng.integers(0, cfg.vocab_size, (2, 12))
  want = jax.jit(lambda p, t: model.apply({"params": p}, t, return_topk=True))(
      params, jnp.asarray(tokens, jnp.int32))
  bs, nb = 4, 8
  table = jnp.asarray(rng.permutation(nb).reshape(2, 4), jnp.int32)

  @jax.jit
  def step(cache, chunk_tokens, start, n):
    idx = kv_cache.chunk_index(table, bs, start, n, chunk_tokens.shape[1], nb * bs)
    out, cache = model.apply({"params": params}, chunk_tokens, idx.limit_bt, cache=cache,
                             cache_index=idx, return_topk=True)
    return out.logits, out.topk_indices, cache

  cache = layer_stack.init_cache(cfg, nb * bs)
  # Row 0 in chunks of 7 + 5 tokens; row 1 in 4 + 8 (padding in the first chunk of row 0).
  got = np.zeros(want.logits.shape, np.float32)
  for start, n in (([0, 0], [7, 4]), ([7, 4], [5, 8])):
    start, n = np.asarray(start), np.asarray(n)
    chunk_tokens = np.zeros((2, 8), np.int32)
    for b in range(2):
      chunk_tokens[b, :n[b]] = tokens[b, start[b]:start[b] + n[b]]
    logits, topk, cache = step(cache, jnp.asarray(chunk_tokens), jnp.asarray(start),
                               jnp.asarray(n))
    for b in range(2):
      got[b, start[b]:start[b] + n[b]] = np.asarray(logits)[b, :n[b]]
      for layer, (idx, ref) in enumerate(zip(topk, want.topk_indices)):
        if idx is None:
          continue
        for i in range(n[b]):
          assert sorted(np.asarray(idx)[b, i]) == sorted(np.asarray(ref)[b, start[b] + i]), (
              layer, b, i)
  np.testing.assert_allclose(got, want.logits, atol=1e-5, rtol=0)


def test_cache_and_cache_index_go_together(tiny_cfg, tiny_params, tiny_tokens):
  with pytest.raises(ValueError, match="cache and cache_index together"):
    gnn.GLM5(tiny_cfg).apply({"params": tiny_params}, tiny_tokens,
                             cache=layer_stack.init_cache(tiny_cfg, 32))
