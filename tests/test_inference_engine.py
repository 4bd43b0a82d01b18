"""Inference engine vs the trainer's full-sequence forward (tiny preset, float32).

For sequences the engine generated, the log-prob it returned for every token
must equal log_softmax of the trainer's logits at the previous position (1e-4
absolute: float32, different chunking of the same ops), and every layer's DSA
top-k chosen in prefill and decode must equal the trainer's set at the same
position exactly (both use `deterministic_topk`, ties -> lower position).

The reference runs on sequences right-padded to one length (one compile):
causal attention, a causal top-k and dropless MoE make positions before the
padding independent of it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.inference import forward

MAX_LEN = 96


@pytest.fixture(scope="module")
def cfg():
  return config_lib.get_preset("tiny")


@pytest.fixture(scope="module")
def params(cfg):
  return gnn.init_params(cfg, 0)


@pytest.fixture(scope="module")
def engine(cfg, params):
  return Engine(cfg, params, max_batch=3, max_len=MAX_LEN, prefill_chunk=32, steps_per_sync=8)


@pytest.fixture(scope="module")
def reference(cfg, params):
  """seqs -> (log-probs [n, MAX_LEN, V], top-k [L, n, MAX_LEN, K]) of the trainer's forward."""
  model = gnn.GLM5(cfg)
  fwd = jax.jit(lambda p, t: model.apply({"params": p}, t, mtp=False, return_topk=True))

  def run(seqs):
    tokens = np.zeros((len(seqs), MAX_LEN), np.int32)
    for i, s in enumerate(seqs):
      tokens[i, :len(s)] = s
    out = fwd(params, jnp.asarray(tokens))
    return (np.asarray(jax.nn.log_softmax(out.logits, -1)),
            np.stack([np.asarray(i) for i in out.topk_indices]))
  return run


def _check_against_reference(reference, seqs_and_gens, outs):
  """Log-probs (1e-4) and top-k sets (exact) of engine outputs vs the trainer."""
  logp, topk = reference([s + g for s, g in seqs_and_gens])
  for i, ((prefix, gen), out) in enumerate(zip(seqs_and_gens, outs)):
    positions = np.arange(len(prefix) - 1, len(prefix) - 1 + len(gen))
    want = logp[i, positions, gen]
    np.testing.assert_allclose(out.logprobs, want, atol=1e-4, rtol=0)
    assert out.topk_indices, "record_topk=True returned no top-k"
    for pos, idx_lk in out.topk_indices.items():
      for layer in range(idx_lk.shape[0]):
        assert sorted(idx_lk[layer]) == sorted(topk[layer, i, pos]), (i, pos, layer)


def test_cache_holds_only_latent_rope_and_indexer_keys(cfg, engine):
  c, p, di = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
  for layer in engine._cache["layers"]:
    assert layer["kv"].shape == (3, MAX_LEN, c + p)
    assert layer["k_idx"].shape == (3, MAX_LEN, di)
  per_token = forward.kv_bytes_per_token(cfg)["latent"]
  assert per_token == cfg.num_hidden_layers * ((c + p) * 4 + di * 4)


def test_sampled_batch_logprobs_and_topk_match_the_trainer(engine, reference, rng):
  # Lengths 5 and 45: one prompt spans two prefill chunks (32 + a padded 16-bucket).
  prompts = [rng.integers(0, 256, 5).tolist(), rng.integers(0, 256, 45).tolist()]
  sp = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=50, top_p=0.9, seed=1)
  outs = engine.generate(prompts, sp, record_topk=True)
  assert [len(o.token_ids) for o in outs] == [20, 20]
  assert all(len(o.logprobs) == len(o.token_ids) for o in outs)
  assert set(outs[1].topk_indices) == set(range(45 + 19))   # every fed position, once
  _check_against_reference(reference, [(p, o.token_ids) for p, o in zip(prompts, outs)], outs)


def test_greedy_tokens_are_the_trainers_argmax(engine, reference, rng):
  prompts = [rng.integers(0, 256, 7).tolist(), rng.integers(0, 256, 3).tolist()]
  outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0))
  logp, _ = reference([p + o.token_ids for p, o in zip(prompts, outs)])
  for i, (p, o) in enumerate(zip(prompts, outs)):
    positions = np.arange(len(p) - 1, len(p) - 1 + len(o.token_ids))
    assert o.token_ids == np.argmax(logp[i, positions], -1).tolist()


def test_multi_turn_session_appends_to_the_cached_prefix(engine, reference, rng):
  sid = engine.new_session()
  turn1 = rng.integers(0, 256, 10).tolist()
  out1 = engine.generate([turn1], SamplingParams(max_new_tokens=8, seed=2), session_id=sid,
                         record_topk=True)[0]
  tool = rng.integers(0, 256, 12).tolist()                  # e.g. a tool result, token ids
  out2 = engine.generate([tool], SamplingParams(max_new_tokens=8, seed=3), session_id=sid,
                         record_topk=True)[0]
  conv = turn1 + out1.token_ids + tool
  assert engine.session_tokens(sid) == conv + out2.token_ids
  # Turn 2 prefilled only the pending last token of turn 1 and the new tokens.
  assert engine.last_stats["prefill_tokens"] == 1 + len(tool)
  assert min(out2.topk_indices) == len(turn1) + len(out1.token_ids) - 1
  _check_against_reference(reference, [(turn1, out1.token_ids), (conv, out2.token_ids)],
                           [out1, out2])
  engine.end_session(sid)


def test_batch_composition_and_slot_do_not_change_a_request(engine, rng):
  a, b = rng.integers(0, 256, 9).tolist(), rng.integers(0, 256, 30).tolist()
  sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7)
  alone = engine.generate([a], sp)[0]
  sid = engine.new_session()                                # shifts `a` to another slot
  together = engine.generate([a, b], sp)[0]
  engine.end_session(sid)
  assert alone.token_ids == together.token_ids
  np.testing.assert_allclose(alone.logprobs, together.logprobs, atol=1e-5)


def test_seed_reproduces_and_changes_samples(engine, rng):
  p = rng.integers(0, 256, 6).tolist()
  run = lambda seed: engine.generate([p], SamplingParams(max_new_tokens=12, seed=seed))[0]
  assert run(5).token_ids == run(5).token_ids
  assert run(5).token_ids != run(6).token_ids


def test_stop_tokens_max_new_tokens_and_cache_end(engine, rng):
  p = rng.integers(0, 256, 8).tolist()
  greedy = engine.generate([p], SamplingParams(max_new_tokens=10, temperature=0.0))[0]
  assert greedy.finish_reason == "length" and len(greedy.token_ids) == 10
  stop = greedy.token_ids[3]
  first = greedy.token_ids.index(stop)
  stopped = engine.generate([p], SamplingParams(max_new_tokens=10, temperature=0.0,
                                                stop_token_ids=[stop]))[0]
  assert stopped.finish_reason == "stop" and stopped.token_ids == greedy.token_ids[:first + 1]
  long_prompt = rng.integers(0, 256, MAX_LEN - 2).tolist()
  full = engine.generate([long_prompt], SamplingParams(max_new_tokens=10))[0]
  assert full.finish_reason == "cache_full" and len(full.token_ids) == 3


def test_bad_input_raises_a_clear_error_and_the_engine_stays_usable(engine, rng):
  sp = SamplingParams(max_new_tokens=4, temperature=0.0)
  with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
    engine.generate([[1, 2], []], sp)
  with pytest.raises(ValueError, match="do not fit the cache"):
    engine.generate([list(range(MAX_LEN + 1))], sp)
  with pytest.raises(ValueError, match="unknown"):
    engine.generate([[1, 2]], sp, session_id="no-such-session")
  with pytest.raises(ValueError, match="needs 4 free cache slots; max_batch=3"):
    engine.generate([[1]] * 4, sp)
  with pytest.raises(ValueError, match=f"vocab_size={engine.cfg.vocab_size}"):
    engine.generate([[1, engine.cfg.vocab_size]], sp)
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)
  sid = engine.new_session()
  engine.new_session(), engine.new_session()
  with pytest.raises(ValueError, match="all max_batch=3 cache slots are in use"):
    engine.new_session()
  with pytest.raises(ValueError, match="needs 1 free cache slots"):
    engine.generate([[1, 2]], sp)
  for s in list(engine._sessions):
    engine.end_session(s)
  with pytest.raises(ValueError, match="unknown"):
    engine.end_session(sid)
  p = rng.integers(0, 256, 5).tolist()
  outs = engine.generate([p, p, p], sp)                      # all slots free again
  assert [o.token_ids for o in outs[1:]] == [outs[0].token_ids] * 2


def test_expanded_form_equals_absorbed_form(cfg, rng):
  b, t, s, h = 2, 3, 20, cfg.num_attention_heads
  c, p, n = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q_nope, q_rope, kv = f32(b, t, h, n), f32(b, t, h, p), f32(b, s, c + p)
  w_uk, w_uv = f32(c, h, n), f32(c, h, cfg.v_head_dim)
  idx = jnp.asarray(np.stack([rng.permutation(s)[:cfg.index_topk] for _ in range(b * t)])
                    .reshape(b, t, -1), jnp.int32).at[0, 0, 3:].set(-1)
  from glm5_jax.nn import mla
  from pallas_kernels import sparse_attention
  u, _ = sparse_attention.sparse_mla(mla.absorb_query(q_nope, q_rope, w_uk), kv, idx, v_dim=c,
                                     scale=cfg.softmax_scale)
  absorbed = jnp.einsum("bthc,chv->bthv", u, w_uv)
  expanded = forward.expanded_sparse_attention(cfg, q_nope, q_rope, kv, w_uk, w_uv, idx)
  np.testing.assert_allclose(expanded, absorbed, atol=1e-4, rtol=1e-4)


def test_new_prompt_lengths_reuse_the_bucketed_compilations(engine, rng):
  prefill, decode, _ = engine._fns("absorbed")
  sp = SamplingParams(max_new_tokens=3, temperature=0.0)
  engine.generate([rng.integers(0, 256, 4).tolist()], sp)
  sizes = prefill._cache_size(), decode._cache_size()
  for n in (3, 6, 11, 16):                                  # all in the 16-token bucket
    engine.generate([rng.integers(0, 256, n).tolist(), [1, 2]], sp)
  assert (prefill._cache_size(), decode._cache_size()) == sizes
