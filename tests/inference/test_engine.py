"""Inference engine vs the trainer's full-sequence forward (tiny preset, float32).

For sequences the engine generated, the log-prob it returned for every token must equal
log_softmax of the trainer's logits at the previous position to the bit (ATOL 0: the same
model code over a cache vs over the whole sequence, batch-invariant on XLA:CPU through
glm5_jax/numerics.py and the engine's `batch_invariant` padding), and every layer's DSA
top-k chosen in prefill and decode must equal the trainer's set at the same position exactly
(one selection rule, ties -> lower position). Blocks of 8 rows, so prompts and generations
cross page boundaries; requests join mid-batch, share prefixes, resume sessions and run
across a weight swap.

The reference runs on sequences right-padded to one length (one compile): causal
attention, a causal top-k and dropless MoE make positions before the padding independent
of it.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax import numerics
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.inference import engine as engine_lib
from glm5_jax.nn import kv_cache
from tests import fake_devices

MAX_LEN, BLOCK = 96, 8
ATOL = 0.0


@pytest.fixture(scope="module")
def cfg():
  return config_lib.get_preset("tiny")


@pytest.fixture(scope="module")
def params(cfg):
  return gnn.init_params(cfg, 0)


@pytest.fixture(scope="module")
def params_v1(cfg):
  return gnn.init_params(cfg, 1)


@pytest.fixture(scope="module")
def engine(cfg, params):
  return Engine(cfg, params, max_batch=3, max_len=MAX_LEN, block_size=BLOCK, prefill_chunk=32,
                steps_per_sync=4)


@pytest.fixture(scope="module")
def forward(cfg):
  model = gnn.GLM5(cfg)
  return jax.jit(lambda p, t: model.apply({"params": p}, t, mtp=False, return_topk=True))


@pytest.fixture(scope="module")
def reference(forward, params):
  """seqs -> (log-probs [n, MAX_LEN, V], top-k [L, n, MAX_LEN, K]) of the trainer's forward."""
  def run(seqs, p=params):
    tokens = np.zeros((len(seqs), MAX_LEN), np.int32)
    for i, s in enumerate(seqs):
      tokens[i, :len(s)] = s
    out = forward(p, jnp.asarray(tokens))
    return (np.asarray(jax.nn.log_softmax(out.logits, -1)),
            np.stack([np.asarray(i) for i in out.topk_indices]))
  return run


def _check(reference, seqs_and_gens, outs, topk=True, atol=ATOL, **kw):
  """Log-probs (atol) and top-k sets (exact) of engine outputs vs the trainer."""
  logp, ref_topk = reference([s + g for s, g in seqs_and_gens], **kw)
  for i, ((prefix, gen), out) in enumerate(zip(seqs_and_gens, outs)):
    positions = np.arange(len(prefix) - 1, len(prefix) - 1 + len(gen))
    np.testing.assert_allclose(out.logprobs, logp[i, positions, gen], atol=atol, rtol=0)
    if topk:
      assert out.topk_indices, "record_topk=True returned no top-k"
      for pos, idx_lk in out.topk_indices.items():
        for layer in range(idx_lk.shape[0]):
          assert sorted(idx_lk[layer]) == sorted(ref_topk[layer, i, pos]), (i, pos, layer)


def _drain(engine, ids):
  got = {}
  while set(ids) - set(got):
    got.update({o.request_id: o for o in engine.step()})
  return [got[i] for i in ids]


def test_cache_holds_only_latent_rope_and_indexer_keys(cfg, engine):
  c, p, di = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
  rows = engine.num_blocks * BLOCK
  for stack in engine._cache["layers"].values():
    for layer in stack.values():
      assert layer["kv"].shape[1:] == (rows, c + p)
      assert layer["k_idx"].shape[1:] == (rows, di)
  per_token = kv_cache.bytes_per_token(cfg)["latent"]
  assert per_token == cfg.num_hidden_layers * ((c + p) * 4 + di * 4)


@pytest.mark.slow  # CI time budget
def test_sampled_batch_logprobs_and_topk_match_the_trainer(engine, reference, rng):
  """Five requests on three slots: two join mid-batch when earlier ones finish."""
  prompts = [rng.integers(0, 256, n).tolist() for n in (5, 20, 9, 40, 3)]
  sps = [SamplingParams(max_new_tokens=m, seed=1) for m in (12, 4, 20, 6, 9)]
  outs = engine.generate(prompts, sps, record_topk=True)
  assert [len(o.token_ids) for o in outs] == [12, 4, 20, 6, 9]
  _check(reference, [(p, o.token_ids) for p, o in zip(prompts, outs)], outs)


def test_a_lone_request_equals_the_trainer_bitwise(cfg, engine, reference, rng):
  """Batch invariance: alone, a request still runs in calls of invariant_tokens tokens (8 on
  CPU, glm5_jax/numerics.py; E/K = 4 for tiny elsewhere, below which the MoE takes its
  gathered kernel), not in one lane, where XLA:CPU's small matmuls sum in another order. Its
  log-probs equal the trainer's to the bit."""
  assert engine_lib.invariant_tokens(cfg, "gpu") == engine_lib.invariant_tokens(cfg, "tpu") == 4
  assert engine_lib.invariant_tokens(cfg) == numerics.MIN_INVARIANT_ROWS == 8
  packer = engine._packer
  assert len(packer.lanes([1])) == 8
  assert len(packer.lanes([0, 2], t=16)) == 2
  packer.shape_buckets = False          # one decode shape: every slot, the whole view
  try:
    assert len(packer.lanes([0, 2], t=16)) == 3 and len(packer.lanes([1])) == 8
    assert packer.table(engine.scheduler.slots, [engine.max_batch] * 4, 5).shape == (4, 16)
  finally:                                                          # pow2 of 96 / 8 blocks
    packer.shape_buckets = True
  prompt = rng.integers(0, 256, 11).tolist()
  out = engine.generate([prompt], SamplingParams(max_new_tokens=13, seed=3), record_topk=True)[0]
  _check(reference, [(prompt, out.token_ids)], [out], atol=0.0)


def test_greedy_tokens_are_the_trainers_argmax(engine, reference, rng):
  prompts = [rng.integers(0, 256, n).tolist() for n in (7, 17)]
  outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
  logp, _ = reference([p + o.token_ids for p, o in zip(prompts, outs)])
  for i, (p, o) in enumerate(zip(prompts, outs)):
    positions = np.arange(len(p) - 1, len(p) - 1 + len(o.token_ids))
    assert o.token_ids == np.argmax(logp[i, positions], -1).tolist()


def test_multi_turn_session_appends_to_the_cached_prefix(engine, reference, rng):
  sid = engine.new_session()
  turn1 = rng.integers(0, 256, 10).tolist()
  out1 = engine.generate([turn1], SamplingParams(max_new_tokens=8, seed=2), session_id=sid,
                         record_topk=True)[0]
  engine.generate([rng.integers(0, 256, 12).tolist()] * 3, SamplingParams(max_new_tokens=5))
  tool = rng.integers(0, 256, 12).tolist()                  # e.g. a tool result, token ids
  out2 = engine.generate([tool], SamplingParams(max_new_tokens=8, seed=3), session_id=sid,
                         record_topk=True)[0]
  conv = turn1 + out1.token_ids + tool
  assert engine.session_tokens(sid) == conv + out2.token_ids
  # Turn 2 prefilled only the pending last token of turn 1 and the new tokens.
  assert engine.last_stats["prefill_tokens"] == 1 + len(tool)
  assert out2.num_cached_prompt_tokens == len(turn1) + len(out1.token_ids) - 1
  _check(reference, [(turn1, out1.token_ids), (conv, out2.token_ids)], [out1, out2])
  engine.end_session(sid)


def test_group_copies_share_the_prompt_blocks_and_prefill_once(engine, reference, rng):
  prompt = rng.integers(0, 256, 27).tolist()                # 3 full blocks + 3 rows
  before = engine.stats["prefill_tokens"]
  ids = engine.submit(prompt, SamplingParams(max_new_tokens=6, seed=4), n=4, record_topk=True)
  outs = _drain(engine, ids)
  # The first copy prefills 27 tokens; the others take its 3 full blocks, prefill 3 rows.
  assert engine.stats["prefill_tokens"] - before == 27 + 3 * 3
  assert [o.num_cached_prompt_tokens for o in outs] == [0, 24, 24, 24]
  assert len({tuple(o.token_ids) for o in outs}) > 1        # different sample streams
  _check(reference, [(prompt, o.token_ids) for o in outs], outs)
  # A later request with the same prompt prefix takes the cached blocks too.
  again = engine.generate([prompt[:20] + [1, 2, 3]], SamplingParams(max_new_tokens=3))[0]
  assert again.num_cached_prompt_tokens == 16


def test_short_request_returns_first_and_a_freed_slot_is_taken_next_step(engine, rng):
  sp = lambda n: SamplingParams(max_new_tokens=n, temperature=0.0)
  prompt = lambda: rng.integers(0, 256, 3).tolist()
  long_ids = [engine.submit(prompt(), sp(30))[0] for _ in range(2)]
  short_id, = engine.submit(prompt(), sp(3))
  wait_id, = engine.submit(prompt(), sp(8))             # 3 slots: this one waits
  assert engine.running == []
  finished = []
  while not finished:
    finished = engine.step()
    assert wait_id not in engine.running or short_id in [o.request_id for o in finished]
  assert [o.request_id for o in finished] == [short_id]
  assert all(i in engine.running for i in long_ids)     # the long ones are still running
  engine.step()
  assert wait_id in engine.running                      # took the freed slot
  outs = _drain(engine, long_ids + [wait_id])
  assert [len(o.token_ids) for o in outs] == [30, 30, 8]


def test_weight_swap_mid_request_reprefills_and_records_versions(
    engine, params, params_v1, reference, rng):
  sid = engine.new_session()
  turn1 = rng.integers(0, 256, 9).tolist()
  first = engine.generate([turn1], SamplingParams(max_new_tokens=4), session_id=sid)[0]
  prompts = [rng.integers(0, 256, n).tolist() for n in (11, 6)]
  ids = [engine.submit(p, SamplingParams(max_new_tokens=20, seed=5), record_topk=True)[0]
         for p in prompts]
  for _ in range(3):
    engine.step()
  engine.update_params(jax.device_put(params_v1), version=1)
  outs = _drain(engine, ids)
  for p, o in zip(prompts, outs):
    v = np.asarray(o.versions)
    assert 0 < (v == 0).sum() < len(v) and (np.diff(v) >= 0).all(), o.versions
    n0 = int((v == 0).sum())
    seq = p + o.token_ids
    for version, p_v, lo, hi in ((0, params, 0, n0), (1, params_v1, n0, len(v))):
      logp, ref_topk = reference([seq], p=p_v)
      pos = np.arange(len(p) - 1 + lo, len(p) - 1 + hi)
      np.testing.assert_allclose(np.asarray(o.logprobs)[lo:hi], logp[0, pos, seq[len(p) + lo:
                                 len(p) + hi]], atol=ATOL, rtol=0, err_msg=f"version {version}")
      # The top-k that sampled each token is that token's version's, although the re-prefill
      # after the swap recomputed the earlier positions under version 1.
      for q in pos:
        for layer in range(ref_topk.shape[0]):
          assert sorted(o.topk_indices[q][layer]) == sorted(ref_topk[layer, 0, q]), (
              version, q, layer)
  # The session's cached conversation was computed under version 0: its next turn is
  # prefilled again under version 1.
  turn = rng.integers(0, 256, 5).tolist()
  out = engine.generate([turn], SamplingParams(max_new_tokens=4), session_id=sid)[0]
  conv = turn1 + first.token_ids + turn
  assert engine.session_tokens(sid) == conv + out.token_ids
  assert out.num_cached_prompt_tokens == 0 and out.versions == [1] * 4
  _check(reference, [(conv, out.token_ids)], [out], topk=False, p=params_v1)
  engine.end_session(sid)
  engine.update_params(params, version=0)               # the other tests' weights


@pytest.mark.slow
def test_idle_sessions_are_evicted_under_memory_pressure_and_reprefilled(cfg, params,
                                                                         reference, rng):
  eng = Engine(cfg, params, max_batch=2, max_len=48, block_size=BLOCK, num_blocks=8)
  s0, s1 = eng.new_session(), eng.new_session()
  sp = SamplingParams(max_new_tokens=4, seed=1)
  turn = lambda n: rng.integers(0, 256, n).tolist()
  for sid in (s0, s1, s1):                                  # 3 + 5 blocks: the pool is full
    eng.generate([turn(20 if eng.session_tokens(sid) == [] else 6)], sp, session_id=sid)
  assert eng.stats["sessions_evicted"] == 0
  conv0 = eng.session_tokens(s0) + turn(6)
  out0 = eng.generate([conv0[-6:]], sp, session_id=s0)[0]  # needs 2 more blocks: evicts s1
  assert eng.stats["sessions_evicted"] == 1 and out0.num_cached_prompt_tokens == 23
  conv1 = eng.session_tokens(s1) + turn(6)
  out1 = eng.generate([conv1[-6:]], sp, session_id=s1)[0]
  # Evicted: its 29 cached rows are gone except 3 full blocks, which its prefill had
  # registered as a cached prefix and nobody has reused yet (fresh blocks go first).
  assert out1.num_cached_prompt_tokens == 24 and eng.stats["sessions_evicted"] == 2
  _check(reference, [(conv0, out0.token_ids), (conv1, out1.token_ids)], [out0, out1],
         topk=False)


def test_batch_composition_and_slot_do_not_change_a_request(engine, rng):
  a, b = rng.integers(0, 256, 9).tolist(), rng.integers(0, 256, 30).tolist()
  sp = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7)
  alone = engine.generate([a], sp)[0]
  blocker = engine.submit(b, SamplingParams(max_new_tokens=20))      # shifts `a` to another slot
  together = engine.generate([a, b], sp)[0]
  _drain(engine, blocker)
  assert alone.token_ids == together.token_ids
  assert alone.logprobs == together.logprobs     # batch invariance: to the bit


def test_seed_reproduces_and_changes_samples(engine, rng):
  p = rng.integers(0, 256, 6).tolist()
  run = lambda seed: engine.generate([p], SamplingParams(max_new_tokens=12, seed=seed))[0]
  assert run(5).token_ids == run(5).token_ids
  assert run(5).token_ids != run(6).token_ids


@pytest.mark.slow  # CI time budget
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


def test_cancel_frees_the_slot_and_blocks(engine, rng):
  free = engine.scheduler.pools[0].num_available
  rid, = engine.submit(rng.integers(0, 256, 12).tolist(), SamplingParams(max_new_tokens=50))
  engine.step()
  assert rid in engine.running
  engine.cancel(rid)
  assert rid not in engine.running and engine.scheduler.pools[0].num_available >= free
  with pytest.raises(ValueError, match="unknown or already finished"):
    engine.cancel(rid)


def test_bad_input_raises_a_clear_error_and_the_engine_stays_usable(engine, params, rng):
  sp = SamplingParams(max_new_tokens=4, temperature=0.0)
  with pytest.raises(ValueError, match=r"prompts\[1\]: prompt is empty"):
    engine.generate([[1, 2], []], sp)
  with pytest.raises(ValueError, match="do not fit the cache"):
    engine.generate([list(range(MAX_LEN + 1))], sp)
  with pytest.raises(ValueError, match="unknown"):
    engine.generate([[1, 2]], sp, session_id="no-such-session")
  with pytest.raises(ValueError, match=f"vocab_size={engine.cfg.vocab_size}"):
    engine.generate([[1, engine.cfg.vocab_size]], sp)
  with pytest.raises(ValueError, match="n=0"):
    engine.submit([1, 2], sp, n=0)
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)
  small = Engine(engine.cfg, params, max_batch=1, max_len=64, block_size=BLOCK, num_blocks=4)
  with pytest.raises(ValueError, match="the whole cache has num_blocks=4"):
    small.submit(list(range(30)), SamplingParams(max_new_tokens=8))
  bad = jax.tree.map(lambda x: x, params)
  bad["lm_head"]["kernel"] = bad["lm_head"]["kernel"][:, :-1]
  with pytest.raises(ValueError, match=r"\['lm_head'\]\['kernel'\] is float32\[64, 383\]"):
    engine.update_params(bad, version=9)
  first = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(params)[0][0][0])
  n_missing = len(jax.tree_util.tree_leaves(params)) - len(jax.tree_util.tree_leaves(
      params["lm_head"]))
  with pytest.raises(ValueError, match=rf"tree differs .*: missing {re.escape(first)} \(and "
                     rf"{n_missing - 1} more\)$"):
    engine.update_params({"lm_head": params["lm_head"]}, version=9)
  with pytest.raises(ValueError, match=r"unexpected \['extra'\]$"):
    engine.update_params({**params, "extra": jnp.zeros(2)}, version=9)
  sid = engine.new_session()
  engine.submit([1, 2], sp, session_id=sid)
  with pytest.raises(ValueError, match="has a turn in flight"):
    engine.submit([3], sp, session_id=sid)
  engine.step()
  p = rng.integers(0, 256, 5).tolist()
  outs = engine.generate([p, p, p], sp)                      # still serving
  assert [o.token_ids for o in outs[1:]] == [outs[0].token_ids] * 2
  assert engine.version == 0
  _drain(engine, list(engine.scheduler.requests))
  engine.end_session(sid)
  with pytest.raises(ValueError, match="unknown"):
    engine.end_session(sid)


def test_non_finite_weights_are_refused_naming_the_leaf_and_the_engine_keeps_serving(
    cfg, engine, params, rng):
  """NaN / inf in a float leaf: `Engine(...)` and `update_params` refuse, naming the leaf and
  the count, for host arrays, device arrays and arrays on a mesh; nothing changes."""
  leaves = [(k, x) for k, x in jax.tree_util.tree_leaves_with_path(params)
            if jnp.issubdtype(x.dtype, jnp.floating)]
  path, x = leaves[int(rng.integers(len(leaves)))]
  flat = np.asarray(x).copy().reshape(-1)
  at = rng.choice(flat.size, size=min(3, flat.size), replace=False)
  flat[at] = [np.nan, np.inf, -np.inf][:len(at)]
  bad = jax.tree_util.tree_map_with_path(
      lambda k, v: flat.reshape(x.shape) if k == path else v, params)
  msg = (rf"{re.escape(jax.tree_util.keystr(path))} holds {len(at)} non-finite values "
         rf"\(NaN or inf\) of {x.size}")
  with pytest.raises(ValueError, match="Engine params: " + msg):
    Engine(cfg, bad, max_batch=1, max_len=16, block_size=BLOCK)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  on_mesh = jax.device_put(bad, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  version = engine.version
  for tree in (bad, jax.device_put(bad), on_mesh):
    with pytest.raises(ValueError, match="update_params: " + msg):
      engine.update_params(tree, version=version + 1)
  assert engine.version == version
  engine_lib.check_finite(params, "ok")                       # the good tree passes
  engine_lib.check_finite({"ids": np.array([1, 2]), "w": jnp.ones(3)}, "ints pass")
  p = rng.integers(0, 256, 4).tolist()
  assert len(engine.generate([p], SamplingParams(max_new_tokens=2))[0].token_ids) == 2


def test_no_recompilation_after_warmup_with_device_put_params(cfg, params, params_v1, rng):
  """Params placed by jax.device_put, as a checkpoint load places them; new prompts of
  bucketed lengths and a weight swap reuse the warm-up's compilations."""
  eng = Engine(cfg, jax.device_put(params), max_batch=2, max_len=64, block_size=BLOCK,
               steps_per_sync=4)
  sp = SamplingParams(max_new_tokens=3, temperature=0.0)
  fns = (eng._prefill, eng._decode)
  for n in (4, 7):              # decode tables of 1 and 2 blocks (rows up to pos + 4 steps)
    eng.generate([rng.integers(0, 256, n).tolist(), [1, 2]], sp)
  sizes = [f._cache_size() for f in fns]
  for i, n in enumerate((3, 6, 5, 7)):                       # all in the 16-token bucket
    if i == 1:
      eng.update_params(jax.device_put(params_v1), version=1)
    eng.generate([rng.integers(0, 256, n).tolist(), [1, 2]], sp)
  assert [f._cache_size() for f in fns] == sizes


@pytest.mark.slow
def test_pallas_scorer_engine_matches_the_trainer(rng):
  """attention_impl="pallas" (interpret mode here): the engine's top-k comes from the same
  Pallas indexer scorer as the trainer's, over the cached keys with per-row limits."""
  cfg = config_lib.get_preset("tiny", attention_impl="pallas", num_nextn_predict_layers=0,
                              mtp_num_steps=0)
  params = gnn.init_params(cfg, 0)
  eng = Engine(cfg, params, max_batch=2, max_len=32, block_size=BLOCK, steps_per_sync=3)
  prompts = [rng.integers(0, 256, n).tolist() for n in (6, 11)]
  outs = eng.generate(prompts, SamplingParams(max_new_tokens=4, seed=3), record_topk=True)
  model = gnn.GLM5(cfg)
  seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
  tokens = np.zeros((2, 16), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  out = jax.jit(lambda p, t: model.apply({"params": p}, t, return_topk=True))(params, tokens)
  logp = np.asarray(jax.nn.log_softmax(out.logits, -1))
  for i, (p, o) in enumerate(zip(prompts, outs)):
    pos = np.arange(len(p) - 1, len(p) - 1 + len(o.token_ids))
    np.testing.assert_allclose(o.logprobs, logp[i, pos, o.token_ids], atol=ATOL, rtol=0)
    for q, idx_lk in o.topk_indices.items():
      for layer in range(idx_lk.shape[0]):
        assert sorted(idx_lk[layer]) == sorted(np.asarray(out.topk_indices[layer])[i, q])


_SHARDED_SCRIPT = """
import jax, numpy as np
from glm5_jax import config as config_lib, nn as gnn, sharding as shd
from glm5_jax.inference import Engine, SamplingParams
cfg = config_lib.get_preset("tiny")
params = gnn.init_params(cfg, 0)
mesh = shd.make_mesh({"data": 2, "expert": 2, "tensor": 2})
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 256, n).tolist() for n in (5, 20, 9, 13, 3)]
sp = SamplingParams(max_new_tokens=6, seed=1)
kw = dict(max_batch=4, max_len=48, block_size=8)
single = Engine(cfg, params, **kw).generate(prompts, sp, record_topk=True)
eng = Engine(cfg, params, mesh=mesh, **kw)
wq_b = eng.params["moe_layers"]["layer_0"]["attn"]["wq_b"]
assert wq_b.sharding.spec[2] == "tensor", wq_b.sharding           # heads over tensor
assert eng.params["moe_layers"]["layer_0"]["moe"]["experts"]["w_up"].sharding.spec[1] == "expert"
pool = eng._cache["layers"]["moe_layers"]["layer_0"]["kv"]
assert pool.sharding.spec[1] == ("data", "expert"), pool.sharding  # rows split over requests
sharded = eng.generate(prompts, sp, record_topk=True)
for a, b in zip(single, sharded):
  assert a.token_ids == b.token_ids, (a.token_ids, b.token_ids)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6, rtol=0)
  for pos in a.topk_indices:
    assert (np.sort(a.topk_indices[pos], -1) == np.sort(b.topk_indices[pos], -1)).all()
bad = jax.tree.map(lambda x: x, params)
bad["lm_head"]["kernel"] = bad["lm_head"]["kernel"].at[3, 5].set(np.nan)
bad = jax.tree.map(lambda x, e: jax.device_put(x, e.sharding), bad, eng.params)  # on the mesh
try:
  eng.update_params(bad, version=1)
  raise AssertionError("NaN weights were served")
except ValueError as e:
  assert "['lm_head']['kernel'] holds 1 non-finite values" in str(e), e
for wd in ("int4", "float8_e4m3fn"):        # quantized weights: experts stay on their shards
  qkw = dict(kw, weight_dtype=wd, quant_block=32, record_routing=True)
  one = Engine(cfg, params, **qkw).generate(prompts, sp, record_routing=True)
  many = Engine(cfg, params, mesh=mesh, **qkw)
  w_up = many.params["moe_layers"]["layer_0"]["moe"]["experts"]["w_up"]
  assert w_up.values.sharding.spec[1] == "expert", w_up.values.sharding
  for a, b in zip(one, many.generate(prompts, sp, record_routing=True)):
    assert a.token_ids == b.token_ids, (wd, a.token_ids, b.token_ids)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6, rtol=0)
    assert all((np.sort(a.routing[q], -1) == np.sort(b.routing[q], -1)).all() for q in a.routing)
print("OK")
"""


@pytest.mark.slow
def test_sharded_engine_on_8_devices_equals_the_single_device_engine():
  fake_devices.run_script(_SHARDED_SCRIPT, devices=8, timeout=600)


def test_malformed_prompts_and_stop_ids_are_named_and_the_engine_keeps_serving(engine, rng):
  v = engine.cfg.vocab_size
  sp = SamplingParams(max_new_tokens=4, temperature=0.0)   # the shapes of the test above
  with pytest.raises(ValueError, match=r"prompts\[0\]=1: .*takes a list of prompts"):
    engine.generate([1, 2, 3], sp)                          # one flat prompt, not a list
  with pytest.raises(ValueError, match=r"prompts: expected a list of prompts"):
    engine.generate(5, sp)
  with pytest.raises(ValueError, match=r"prompts\[1\]: prompt\[1\]=True: .*not bools"):
    engine.generate([[1, 2], [3, True]], sp)
  with pytest.raises(ValueError, match=r"prompt\[0\]=np.True_|prompt\[0\]=True"):
    engine.submit(np.asarray([True, False]), sp)
  with pytest.raises(ValueError, match=rf"\[{v}\] outside the vocabulary.*vocab_size={v}"):
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=2, stop_token_ids=[3, v]))
  with pytest.raises(ValueError, match=rf"stop_token_ids=\[{v + 5}\]"):
    engine.submit([1, 2], SamplingParams(stop_token_ids=[v + 5]))
  assert engine.num_unfinished == 0                         # nothing half-queued
  p = rng.integers(0, 256, 5).tolist()
  outs = engine.generate([p, np.asarray(p), p], sp)         # still serving
  assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
  assert len(outs[0].token_ids) == 4
