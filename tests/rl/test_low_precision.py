"""Low-precision rollout engines and rollout routing replay (inference/precision.py, nn/moe.py).

The engine can serve in FP8 or INT4 (a deliberate train/rollout gap that every RL metric
stream measures); it records each token's routed experts, and the trainer's forward can replay
them (R3), which makes the routing mismatch 0 by construction.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import rl as rl_config
from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax import policy
from glm5_jax import quant
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.nn import kv_cache
from glm5_jax.nn import layer_stack
from glm5_jax.nn import moe
from glm5_jax.rl.algorithm import consistency
from glm5_jax.rl.algorithm import trajectory as traj_lib
from glm5_jax.train import checks

# A group of two copies of the first prompt (as GRPO submits them): the second copy takes the
# first cache block (16 rows) from the first's prefill, and its records with it.
PROMPTS = ([1, 2, 3, 4, 5] * 4, [1, 2, 3, 4, 5] * 4, [7, 8, 9])
SP = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def tiny():
  cfg = config_lib.get_preset("tiny", attention_type="sparse")
  return cfg, gnn.init_params(cfg, 0), policy.jitted_forward(cfg, chunk_size=16)


def _rollouts(cfg, params, **engine_kw):
  engine = Engine(cfg, params, max_batch=4, max_len=64, record_routing=True, **engine_kw)
  ids = (engine.submit(PROMPTS[0], SP, n=2, record_topk=True, record_routing=True)
         + engine.submit(PROMPTS[2], SP, stream=2, record_topk=True, record_routing=True))
  outs = engine.wait(ids)
  trajs = [traj_lib.Trajectory.from_response(p, o.token_ids, o.logprobs, 0,
                                             topk=o.topk_indices, routing=o.routing)
           for p, o in zip(PROMPTS, outs)]
  return engine, outs, trajs, traj_lib.make_batch(trajs, np.zeros(len(trajs)))


def _dev(batch, replay: bool):
  dev = {k: jnp.asarray(getattr(batch, k)) for k in ("tokens", "positions", "segment_ids")}
  if replay:
    dev["routing"] = jnp.asarray(batch.routing)
  return dev


def _measure(fwd, params, batch, trajs, replay: bool):
  logp, _, topk, experts = fwd(params, _dev(batch, replay))
  return consistency.consistency_metrics(batch, logp, topk, trajs, experts)


def test_fp8_rollouts_open_a_measured_gap_and_routing_replay_closes_the_routing_one(tiny):
  cfg, params, fwd = tiny
  engine, outs, trajs, batch = _rollouts(cfg, params, weight_dtype="float8_e4m3fn",
                                         quant_block=32)
  for p, o in zip(PROMPTS, outs):       # every processed position, shared prefix rows too
    assert sorted(o.routing) == list(range(len(p) + len(o.token_ids) - 1))
    assert all(x.shape == (layer_stack.num_moe_layers(cfg), cfg.num_experts_per_tok)
               for x in o.routing.values())
  assert outs[1].num_cached_prompt_tokens == 16
  assert quant.tree_nbytes(engine.params) < 0.5 * quant.tree_nbytes(params)
  m = _measure(fwd, params, batch, trajs, replay=False)
  assert m["logp_abs_diff_max"] > 1e-3 and m["routing_pairs"] > 0
  assert m["routing_mismatches"] > 0, m              # FP8 changes some routing decisions
  assert 0 < m["routing_mismatch_rate"] < 1 and m["topk_positions"] > 0
  assert m["routing_bytes_per_token"] == 4 * layer_stack.num_moe_layers(cfg) * 2
  r = _measure(fwd, params, batch, trajs, replay=True)
  assert r["routing_mismatches"] == 0 and r["routing_pairs"] == m["routing_pairs"]
  assert r["routing_mismatch_rate"] == 0.0
  assert r["logp_abs_diff_max"] > 0          # what replay leaves: the FP8 weights themselves
  # The asynchronous loop's per-version measurement (positions whose next token version 0
  # sampled) sees the same: mismatches without replay, none with it.
  a = consistency.per_version_metrics(fwd, {0: params}, batch, trajs, _dev(batch, False))
  assert a["routing_mismatches"] > 0 and 0 < a["routing_pairs"] < m["routing_pairs"]
  a = consistency.per_version_metrics(fwd, {0: params}, batch, trajs, _dev(batch, True))
  assert a["routing_mismatches"] == 0 and a["routing_pairs"] > 0


@pytest.mark.slow        # the default suite checks it on an INT4 checkpoint (test_hf_quant.py)
def test_int4_engine_serves_what_the_qat_forward_computes(tiny):
  cfg, params, fwd = tiny
  engine, _, trajs, batch = _rollouts(cfg, params, weight_dtype="int4")
  scheme = quant.Scheme("int4", 32, "experts")
  m = _measure(fwd, quant.fake_quant_tree(params, scheme), batch, trajs, replay=False)
  assert m["logp_abs_diff_max"] <= 1e-6, m
  assert m["topk_mismatches"] == 0 and m["routing_mismatches"] == 0, m
  # Packed nibbles + float32 group scales: (4 + 32 / g) / 32 of the float32 bytes.
  targeted = quant.targeted(params, scheme)
  flat = {"/".join(str(k.key) for k in p): x for p, x in
          jax.tree_util.tree_flatten_with_path(engine.params, is_leaf=quant.is_qarray)[0]}
  assert set(targeted) <= {k for k, x in flat.items() if quant.is_qarray(x)}
  packed = sum(flat[k].nbytes for k in targeted)
  floats = sum(np.prod(flat[k].shape) * 4 for k in targeted)
  assert packed <= (4 + 32 / 32) / 32 * floats * 1.01


def test_routing_replay_uses_the_given_experts(tiny):
  cfg, params, _ = tiny
  tokens = jnp.asarray(np.arange(24).reshape(2, 12) % cfg.vocab_size, jnp.int32)
  model = gnn.GLM5(cfg)
  fwd = jax.jit(lambda p, t, r: model.apply({"params": p}, t, return_routing=True, mtp=False,
                                            routing_replay=r))
  own = fwd(params, tokens, None)
  assert own.routing.shape == (layer_stack.num_moe_layers(cfg), 2, 12, cfg.num_experts_per_tok)
  same = fwd(params, tokens, own.routing)
  np.testing.assert_array_equal(same.logits, own.logits)       # replaying its own choice
  none = fwd(params, tokens, jnp.full_like(own.routing, -1))   # -1: route as usual
  np.testing.assert_array_equal(none.logits, own.logits)
  other = (own.routing + 1) % cfg.n_routed_experts
  forced = fwd(params, tokens, other)
  np.testing.assert_array_equal(forced.routing, other)
  assert not np.allclose(forced.logits, own.logits)
  with pytest.raises(ValueError, match="routing_replay"):
    fwd(params, tokens, own.routing[:, :1])


def test_replayed_routing_weights_are_the_trainers(rng):
  cfg = config_lib.get_preset("tiny")
  n, d, e = 5, cfg.hidden_size, cfg.n_routed_experts
  x = rng.normal(size=(n, d)).astype(np.float32)
  w = rng.normal(size=(d, e)).astype(np.float32) * 0.3
  bias = rng.normal(size=(e,)).astype(np.float32)
  replay = np.stack([rng.permutation(e)[:cfg.num_experts_per_tok] for _ in range(n)])
  replay[2] = -1                                   # this token routes itself
  ids, weights = moe.route(cfg, jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias),
                           jnp.asarray(replay, jnp.int32))
  own_ids, _ = moe.route(cfg, jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias))
  want_ids = np.where(replay[:, :1] >= 0, replay, np.asarray(own_ids))
  np.testing.assert_array_equal(ids, want_ids)
  s = 1 / (1 + np.exp(-(x.astype(np.float64) @ w)))            # sigmoid scores, no bias
  g = np.take_along_axis(s, want_ids, axis=1)
  if cfg.norm_topk_prob:
    g = g / (g.sum(axis=1, keepdims=True) + 1e-20)
  np.testing.assert_allclose(weights, g * cfg.routed_scaling_factor, rtol=1e-5)


def test_fp8_kv_pool_clips_to_its_range_instead_of_nan():
  pool = jnp.zeros((4, 3), jnp.float8_e4m3fn)
  rows = jnp.asarray([[[1000.0, -1000.0, 0.1]]])
  out = kv_cache.write(pool, rows, jnp.asarray([[2]]))
  np.testing.assert_array_equal(np.asarray(out[2], np.float32),
                                np.asarray([448.0, -448.0, 0.1], jnp.float8_e4m3fn).astype(
                                    np.float32))


@pytest.mark.parametrize("kw,match", [
    (dict(weight_dtype="int8"), "weight_dtype='int8'"),
    (dict(kv_dtype="int8"), "kv_dtype='int8'"),
    (dict(quant_block=16), "quantizes nothing"),
    (dict(weight_dtype="int4", quant_block=48), "group_size=48.*experts"),
    (dict(weight_dtype="int4", quant_targets="heads"), "targets='heads'"),
])
def test_bad_precision_arguments_are_named(tiny, kw, match):
  cfg, params, _ = tiny
  with pytest.raises(ValueError, match=match):
    Engine(cfg, params, max_batch=2, max_len=32, **kw)


def test_routing_records_need_an_engine_that_records(tiny):
  cfg, params, _ = tiny
  engine = Engine(cfg, params, max_batch=2, max_len=32)
  with pytest.raises(ValueError, match="record_routing=True"):
    engine.submit([1, 2, 3], record_routing=True)


@pytest.mark.parametrize("field,value", [
    ("rollout_weight_dtype", "fp8"), ("rollout_kv_dtype", "int4"),
    ("rollout_quant_targets", "heads"), ("rollout_quant_block", -1),
    ("rollout_indexer_dtype", "bfloat16"),
])
def test_rollout_precision_fields_are_checked(field, value):
  c = rl_config.get_config("task=arith,runlocal=True")
  c.init_from = "/somewhere"
  c.rl[field] = value
  with pytest.raises(ValueError, match=f"config.rl.{field}="):
    checks.validate(c)
