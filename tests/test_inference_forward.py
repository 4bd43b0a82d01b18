"""The cached chunk forward (inference/forward.py) vs the trainer, for config variants
the engine tests do not cover: dense attention (DSA warm-up stage) and IndexShare
"shared" layers. Tiny preset, two query chunks through one jitted step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax.inference import forward


@pytest.mark.parametrize("overrides", [
    dict(attention_type="dense"),
    dict(indexer_types=("full", "shared", "full"), index_topk=4),
], ids=["dense", "index_share"])
def test_chunked_cached_forward_equals_the_trainer(overrides, rng):
  cfg = config_lib.get_preset("tiny", num_nextn_predict_layers=0, mtp_num_steps=0, **overrides)
  params = gnn.init_params(cfg, 0)
  s = 16
  tokens = rng.integers(0, cfg.vocab_size, (2, 12))
  want = jax.jit(lambda p, t: gnn.GLM5(cfg).apply({"params": p}, t).logits)(
      params, jnp.asarray(tokens, jnp.int32))

  @jax.jit
  def step(caches, chunk_tokens, start, n):
    chunk = forward.make_chunk(start, n, chunk_tokens.shape[1], s)
    _, normed, _, caches = forward.model_forward(cfg, params, caches, chunk_tokens, chunk)
    return forward.head(params, normed), caches

  caches = [forward.init_layer_cache(cfg, 2, s, cfg.indexer_type(i) == "full")
            for i in range(cfg.num_hidden_layers)]
  # Row 0 in chunks of 7 + 5 tokens; row 1 in 4 + 8 (padding in the first chunk of row 0).
  got = np.zeros(want.shape, np.float32)
  for start, n in (([0, 0], [7, 4]), ([7, 4], [5, 8])):
    start, n = np.asarray(start), np.asarray(n)
    chunk_tokens = np.zeros((2, 8), np.int32)
    for b in range(2):
      chunk_tokens[b, :n[b]] = tokens[b, start[b]:start[b] + n[b]]
    logits, caches = step(caches, jnp.asarray(chunk_tokens), jnp.asarray(start), jnp.asarray(n))
    logits = np.asarray(logits)
    for b in range(2):
      got[b, start[b]:start[b] + n[b]] = logits[b, :n[b]]
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
