"""Scanned layer stacks (glm5_jax/nn/layer_stack.py) against an unrolled oracle.

The oracle applies one `DecoderLayer` per decoder layer in a Python loop, each with its own
slice of the stacked parameters, and the shared MTP module after it: what the model computed
before its layers were scanned. Outputs, gradients and one Muon Split step must agree.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax import optim
from glm5_jax.nn import decoder as decoder_lib
from glm5_jax.nn import layer_io
from glm5_jax.nn import layer_stack
from glm5_jax.nn import mtp as mtp_lib
from glm5_jax.nn import norms
from glm5_jax.nn import rope
from glm5_jax.train import step as step_lib

jax.config.update("jax_default_matmul_precision", "highest")

SHARED = ("full", "full", "shared", "full", "shared")     # MoE stack: 2 x [full, shared]
CASES = {
    "tiny_sparse": ("tiny", dict()),
    "tiny_dense": ("tiny", dict(attention_type="dense")),
    "tiny_indexshare": ("tiny", dict(num_hidden_layers=5, indexer_types=SHARED)),
    "small": ("small", dict(index_topk=16)),
}
_SLOW_CASES = ("small", "tiny_dense")     # tiny_dense: the same scans as tiny_sparse (CI budget)


def _rng(request):
  return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def _kinds(types, first_dense):
  return [layer_stack.LayerKind(i >= first_dense, t == "full") for i, t in enumerate(types)]


@pytest.mark.parametrize("types, first_dense, want", [
    (["full"] * 78, 3, [("dense_layers", 0, 3, 1), ("moe_layers", 3, 75, 1)]),
    (["full", "full"] + ["full", "shared", "shared", "shared"] * 2, 2,
     [("dense_layers", 0, 2, 1), ("moe_layers", 2, 2, 4)]),
    (["full", "shared", "full", "shared", "shared"], 1,          # no shorter tiling block
     [("dense_layers", 0, 1, 1), ("moe_layers", 1, 1, 4)]),
    (["full", "full"], 0, [("moe_layers", 0, 2, 1)]),
])
def test_layer_stacks_follow_ffn_kind_and_the_indexshare_period(types, first_dense, want):
  cfg = config_lib.get_preset("tiny", num_hidden_layers=len(types), indexer_types=tuple(types),
                              first_k_dense_replace=first_dense)
  stacks = layer_stack.layer_stacks(cfg)
  assert [(s.name, s.first, s.repeats, len(s.block)) for s in stacks] == want
  kinds = _kinds(types, first_dense)
  covered = []
  for s in stacks:
    for r in range(s.repeats):
      for j, kind in enumerate(s.block):
        i = s.first + r * len(s.block) + j
        assert kind == kinds[i] and layer_stack.locate(cfg, i) == (s.name, r, j)
        covered.append(i)
  assert covered == list(range(len(types)))


def test_glm5_parameters_are_stacked_on_a_layers_axis():
  cfg = config_lib.get_preset("glm5")
  shapes, specs = gnn.abstract_params(cfg)
  assert set(shapes) == {"embed", "dense_layers", "moe_layers", "final_norm", "lm_head", "mtp"}
  wq_b = shapes["moe_layers"]["layer_0"]["attn"]["wq_b"]
  assert wq_b.shape == (75, cfg.q_lora_rank, cfg.num_attention_heads, cfg.qk_head_dim)
  assert specs["moe_layers"]["layer_0"]["attn"]["wq_b"][0] == "layers"
  experts = shapes["moe_layers"]["layer_0"]["moe"]["experts"]["w_up"]
  assert experts.shape[:2] == (75, cfg.n_routed_experts)
  assert shapes["dense_layers"]["layer_0"]["mlp"]["w_up"].shape[0] == 3


def test_locate_rejects_a_layer_outside_the_model(tiny_cfg):
  with pytest.raises(ValueError, match="layer 3 is outside"):
    layer_stack.locate(tiny_cfg, 3)


def _unrolled(cfg, params, per_layer, tokens, segment_ids):
  """The oracle: a Python loop of DecoderLayers (params `per_layer[i]`), then MTP."""
  b, t = tokens.shape
  cos, sin = rope.rope_angles(jnp.broadcast_to(jnp.arange(t), (b, t)), cfg.qk_rope_head_dim,
                              cfg.rope_theta)
  inputs = layer_io.LayerInputs(cos, sin, layer_io.document_starts(segment_ids),
                                with_indexer_loss=True)
  emb = lambda x: jnp.take(params["embed"]["embedding"], x, axis=0)
  h, idx, kls, loads, topk = emb(tokens), None, [], [], []
  for i in range(cfg.num_hidden_layers):
    kind = layer_stack.layer_kind(cfg, i)
    layer = decoder_lib.DecoderLayer(cfg, moe=kind.moe, has_indexer=kind.has_indexer)
    h, aux, _ = layer.apply({"params": per_layer[i]}, h, inputs, prev_indices=idx)
    idx = aux.topk_indices if aux.topk_indices is not None else idx
    kls.append(jnp.zeros(()) if aux.indexer_kl is None else aux.indexer_kl)
    loads += [] if aux.expert_load is None else [aux.expert_load]
    topk.append(aux.topk_indices)
  head = lambda x: x @ params["lm_head"]["kernel"]
  final = norms.RMSNorm(cfg.rms_norm_eps)
  out = {"logits": head(final.apply({"params": params["final_norm"]}, h)),
         "indexer_kl": jnp.stack(kls), "expert_load": jnp.stack(loads), "topk": topk}
  step, hs, mtp = mtp_lib.MTPStep(cfg), h, []
  for k in range(1, cfg.mtp_num_steps + 1):
    hs, normed, _, _ = step.apply({"params": params["mtp"]}, emb(mtp_lib.shift_tokens(
        tokens, k)), hs, inputs)
    mtp.append(head(normed))
  out["mtp_logits"] = jnp.stack(mtp)
  return out


def _scanned(cfg, params, tokens, segment_ids):
  o = gnn.GLM5(cfg).apply({"params": params}, tokens, segment_ids=segment_ids,
                          with_indexer_loss=True, return_topk=True)
  return {"logits": o.logits, "indexer_kl": o.indexer_kl, "expert_load": o.expert_load,
          "topk": list(o.topk_indices), "mtp_logits": o.mtp_logits}


def _loss(out):
  """A loss that touches every output: CE of main and MTP logits, the indexer KL, the load."""
  logp = jax.nn.log_softmax(out["logits"])
  mtp = jax.nn.log_softmax(out["mtp_logits"])
  return (-jnp.mean(logp[..., 7]) - jnp.mean(mtp[..., 11]) + jnp.sum(out["indexer_kl"])
          + jnp.sum(out["expert_load"] ** 2))


def _split(cfg, params):
  """(params without the stacks, [per-layer trees])."""
  rest = {k: v for k, v in params.items() if k not in layer_stack.STACK_NAMES}
  return rest, [layer_stack.layer_params(cfg, params, i) for i in range(cfg.num_hidden_layers)]


@pytest.fixture(scope="module", params=[
    pytest.param(name, marks=pytest.mark.slow) if name in _SLOW_CASES else name
    for name in sorted(CASES)])
def case(request):
  preset, overrides = CASES[request.param]
  cfg = config_lib.get_preset(preset, **overrides)
  params = gnn.init_params(cfg, zlib.crc32(request.param.encode()))
  rng = np.random.default_rng(zlib.crc32(request.param.encode()))
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
  segment_ids = jnp.asarray(np.repeat([[1, 2, 3], [1, 1, 2]], 8, axis=1), jnp.int32)
  return cfg, params, tokens, segment_ids


def test_scanned_outputs_equal_the_unrolled_oracle(case):
  cfg, params, tokens, seg = case
  rest, per_layer = _split(cfg, params)
  want = jax.jit(lambda p, l: _unrolled(cfg, p, l, tokens, seg))(rest, per_layer)
  got = jax.jit(lambda p: _scanned(cfg, p, tokens, seg))(params)
  for key in ("logits", "indexer_kl", "expert_load", "mtp_logits"):
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=key)
  for i, (a, b) in enumerate(zip(got["topk"], want["topk"])):
    assert (a is None) == (b is None), i
    if a is not None:
      np.testing.assert_array_equal(a, b, err_msg=f"top-k of layer {i}")


def _unrolled_tree(cfg, params):
  rest, per_layer = _split(cfg, params)
  return rest, {**rest, **{f"layers_{i}": p for i, p in enumerate(per_layer)}}


def _restack(cfg, rest, u):
  return {**{k: u[k] for k in rest}, **layer_stack.stack_layers(
      cfg, [u[f"layers_{i}"] for i in range(cfg.num_hidden_layers)], stack=jnp.stack)}


@pytest.mark.slow
def test_gradients_equal_the_unrolled_oracle(case):
  cfg, params, tokens, seg = case
  rest, unrolled = _unrolled_tree(cfg, params)

  def oracle_loss(u):
    layers = [u[f"layers_{i}"] for i in range(cfg.num_hidden_layers)]
    return _loss(_unrolled(cfg, {k: u[k] for k in rest}, layers, tokens, seg))

  g_scan = jax.jit(jax.grad(lambda p: _loss(_scanned(cfg, p, tokens, seg))))(params)
  g_unrolled = jax.jit(jax.grad(oracle_loss))(unrolled)
  flat = jax.tree_util.tree_flatten_with_path(g_scan)[0]
  for (path, a), b in zip(flat, jax.tree.leaves(_restack(cfg, rest, g_unrolled))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_a_muon_split_step_on_stacked_layers_equals_per_layer_steps(request):
  """Stacked leaves get Muon per layer (and per head, per expert): the `layers` axis is a
  batch axis of Newton–Schulz, never flattened into a matrix."""
  cfg = config_lib.get_preset("tiny", num_hidden_layers=5, indexer_types=SHARED)
  params = {"moe_layers": gnn.init_params(cfg, 1)["moe_layers"]}
  rng = _rng(request)
  grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
  per_layer = lambda tree: {f"layers_{i}": layer_stack.layer_params(cfg, tree, i)
                            for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers)}
  tx = optim.muon_split(learning_rate=0.02, weight_decay=0.1)
  u_scan, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  u_unrolled, _ = jax.jit(tx.update)(per_layer(grads), tx.init(per_layer(params)),
                                     per_layer(params))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               per_layer(u_scan), u_unrolled)


def test_routing_bias_update_reaches_each_moe_layer(request):
  cfg = config_lib.get_preset("tiny", num_hidden_layers=5, indexer_types=SHARED)
  params = gnn.init_params(cfg, 0)
  n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
  load = jnp.asarray(_rng(request).random((n_moe, cfg.n_routed_experts)), jnp.float32)
  new = step_lib.update_routing_biases(cfg, params, (load, None), 0.5)
  for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
    bias = layer_stack.layer_params(cfg, new, i)["moe"]["router"]["e_score_correction_bias"]
    row = load[i - cfg.first_k_dense_replace]
    np.testing.assert_allclose(bias, -0.5 * np.sign(row - np.mean(row)), err_msg=f"layer {i}")


def _lowered_ops(n_layers):
  cfg = config_lib.get_preset("small", num_hidden_layers=n_layers, remat="full")
  shapes, _ = gnn.abstract_params(cfg)
  tokens = jax.ShapeDtypeStruct((1, 64), jnp.int32)
  loss = lambda p, t: jnp.mean(gnn.GLM5(cfg).apply({"params": p}, t).logits)
  text = jax.jit(jax.value_and_grad(loss)).lower(shapes, tokens).as_text()
  return sum(1 for line in text.splitlines() if " = " in line)


def test_program_size_does_not_grow_with_depth():
  """32 layers lower to (nearly) the same program as 4: one scanned layer per stack."""
  ops4, ops32 = _lowered_ops(4), _lowered_ops(32)
  assert ops32 < 1.05 * ops4, (ops4, ops32)
