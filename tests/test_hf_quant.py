"""INT4 Hugging Face checkpoints (glm5_jax/hf_int4.py) of a model trained with INT4 QAT.

One module run trains a 2-layer tiny model (one dense, one MoE layer, the MTP layer; a stack
of one layer compiles in about half the time of tiny's two) 3 SFT steps with `config.qat`
(INT4, all_linear, group 16: 32 does not divide tiny's kv_lora_rank 16) through
`train/step.py`, saves the float weights as an HF directory and converts it with the
converter's library function. Checked:
  - the stored tensors are compressed-tensors' pack-quantized layout of every targeted HF
    tensor, against a NumPy float32 reference of the rule and of `pack_to_int32`;
  - the loaded packed weights, dequantized, are bitwise the QAT forward's (`fake_quant_tree`,
    eager and jitted as the train step runs it), for targets experts (g 32) and all_linear;
  - the engine serving the packed checkpoint gives the QAT trainer's log-probs (<= 1e-6; ATOL
    0 on XLA:CPU) and the same DSA top-k;
  - packed weights + scales take <= (4 + 32 / g) / 32 + 1% of float32, on disk and in the
    engine;
  - the errors: an INT4 checkpoint loaded as float, bad converter input.
"""

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from glm5_jax import convert
from glm5_jax import hf
from glm5_jax import nn as gnn
from glm5_jax import policy
from glm5_jax import quant
from glm5_jax import safetensors_io as sio
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.optim.param_groups import path_str
from glm5_jax.rl.algorithm import trajectory as traj_lib
from glm5_jax.train import step as step_lib
from tests import fake_devices
from tests import seeding

TARGETS = {"experts": 32, "all_linear": 16}           # target group -> group size on tiny
# Engine vs trainer log-probs. The acceptance bound is 1e-6; on XLA:CPU the batch-invariant
# engine dequantizes the same packed weights with the same function: 0, as in
# tests/inference/test_engine.py.
ATOL = 0.0


def _sft_batch(rng, b=2, t=32):
  """Two packed conversations per row; the loss on the second half of each (the answers)."""
  seg = np.array([[1] * 20 + [2] * 12, [1] * 32])
  pos = np.array([list(range(20)) + list(range(12)), list(range(32))])
  mask = (pos >= 6).astype(np.float32)
  return {"tokens": jnp.asarray(rng.integers(0, 256, (b, t)), jnp.int32),
          "segment_ids": jnp.asarray(seg, jnp.int32), "positions": jnp.asarray(pos, jnp.int32),
          "loss_mask": jnp.asarray(mask)}


@pytest.fixture(scope="module")
def qat_run(tiny_cfg, tmp_path_factory):
  """(config, initial params, trained float params, float HF dir): 3 SFT steps, INT4 QAT
  (AdamW and one MTP step: the step compiles faster than with Muon Split and three)."""
  cfg = tiny_cfg.replace(num_hidden_layers=2, mtp_num_steps=1)
  c = ml_collections.ConfigDict(dict(
      stage="sft", optimizer="adamw", learning_rate=1e-2, adam_learning_rate=1e-2,
      warmup_steps=0, total_steps=10, final_lr_fraction=0.1, weight_decay=0.1, grad_clip=1.0,
      loss_chunk=8, qat=dict(bits=4, group_size=TARGETS["all_linear"], targets="all_linear")))
  params = gnn.init_params(cfg, 0)
  step_lib.check_qat(c, params)
  tx = step_lib.make_optimizer(c)
  state = step_lib.TrainState(jnp.zeros((), jnp.int32), params, tx.init(params),
                              jnp.zeros((2,), jnp.uint32))
  fn = jax.jit(functools.partial(step_lib.train_step, cfg=cfg, stage=c.stage, tx=tx,
                                 bias_rate=1e-3, hp=step_lib.loss_hparams(c)))
  rng = np.random.default_rng(seeding.seed_of("tests/test_hf_quant.py::qat_run"))
  for _ in range(3):
    state, m = fn(state, _sft_batch(rng))
    assert np.isfinite(float(m["loss"]))
  trained = jax.device_get(state.params)
  path = str(tmp_path_factory.mktemp("qat") / "float")
  hf.save_pretrained(cfg, trained, path)
  return c, params, trained, path


@pytest.fixture(scope="module")
def int4_dirs(qat_run, tmp_path_factory):
  """{target group: INT4 HF dir} written by the converter's library function."""
  root = tmp_path_factory.mktemp("int4")
  return {t: convert.quantize_to_hf(qat_run[3], str(root / t), quantize="int4", targets=t,
                                    group_size=g) for t, g in TARGETS.items()}


@pytest.fixture(scope="module")
def qat_weights(qat_run):
  """{target group: the QAT forward's weights}: `fake_quant_tree` of the trained params,
  jitted as the train step runs it."""
  fq = jax.jit(quant.fake_quant_tree, static_argnums=1)
  return {t: fq(qat_run[2], quant.Scheme("int4", g, t)) for t, g in TARGETS.items()}


def _leaves(tree):
  return {path_str(p): x for p, x in
          jax.tree_util.tree_flatten_with_path(tree, is_leaf=quant.is_qarray)[0]}


def _tensors(path):
  infos = {}
  for f in os.listdir(path):
    if f.endswith(".safetensors"):
      infos.update(sio.read_header(os.path.join(path, f)))
  return infos


def _read(info):
  return sio.read_rows(info, 0, info.shape[0])


def _pack_to_int32(q_oi):
  """compressed-tensors' `pack_to_int32` (num_bits 4): value 8j + i of a row, plus 8, in
  bits 4i of word j."""
  u = (q_oi + 8).astype(np.uint32)
  packed = np.zeros((u.shape[0], u.shape[1] // 8), np.uint32)
  for i in range(8):
    packed |= u[:, i::8] << (4 * i)
  return packed.view(np.int32)


def test_the_files_are_compressed_tensors_pack_quantized_of_every_targeted_tensor(
    qat_run, int4_dirs):
  """Against NumPy on the float checkpoint's torch [out, in] tensors: scale = max |w| / 7 per
  group of 16 `in` entries in float32, q = round-half-even(w / s), packed by pack_to_int32."""
  _, _, _, float_dir = qat_run
  path = int4_dirs["all_linear"]
  hf_cfg = json.load(open(os.path.join(path, "config.json")))
  qc = hf_cfg["quantization_config"]
  assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "pack-quantized")
  w = qc["config_groups"]["group_0"]["weights"]
  assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (
      4, "int", True, "group", 16)
  assert qc["glm5_jax"]["targets"] == "all_linear" and qc["glm5_jax"]["scale_dtype"] == "float32"
  got, floats = _tensors(path), _tensors(float_dir)
  packed = sorted(n[:-len(".weight_packed")] for n in got if n.endswith(".weight_packed"))
  kinds = {n.split(".")[-1] for n in packed}
  assert kinds == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wq_b",
                   "wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "eh_proj"}
  assert any(".experts." in n for n in packed) and any(".shared_experts." in n for n in packed)
  for x in packed:
    assert f"{x}.weight" not in got
    w_oi = _read(floats[f"{x}.weight"])
    out, inp = w_oi.shape
    grouped = w_oi.reshape(out, inp // 16, 16)
    s = (np.abs(grouped).max(-1) / np.float32(7)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
      q = np.clip(np.round(np.where(s[..., None] > 0, grouped / s[..., None], 0)), -7, 7)
    np.testing.assert_array_equal(_read(got[f"{x}.weight_scale"]), s, err_msg=x)
    np.testing.assert_array_equal(_read(got[f"{x}.weight_packed"]),
                                  _pack_to_int32(q.reshape(out, inp).astype(np.int64)),
                                  err_msg=x)
    assert _read(got[f"{x}.weight_shape"]).tolist() == [out, inp]
  # quantization_config's `re:` patterns: the quantized modules are its targets, the float
  # Linears (router and lm_head here) its ignored modules.
  targets, ignore = qc["config_groups"]["group_0"]["targets"], qc["ignore"]
  hit = lambda patterns, n: any(re.match(p[len("re:"):], n) for p in patterns)
  linear = [n[:-len(".weight")] for n in got if n.endswith(".weight") and
            len(got[n].shape) == 2 and "embed" not in n]
  assert "lm_head" in linear and any(n.endswith(".mlp.gate") for n in linear)
  assert all(hit(targets, n) and not hit(ignore, n) for n in packed)
  assert all(hit(ignore, n) and not hit(targets, n) for n in linear)


@pytest.mark.parametrize("targets", list(TARGETS))
def test_offline_int4_is_bitwise_the_qat_forwards_quantized_weights(qat_run, int4_dirs,
                                                                   qat_weights, targets):
  c, initial, trained, _ = qat_run
  scheme = quant.Scheme("int4", TARGETS[targets], targets)
  if targets == c.qat.targets:
    assert scheme == step_lib.loss_hparams(c)["qat"]          # what the QAT loss ran
  _, loaded = hf.load_pretrained(int4_dirs[targets], quantized=True)
  # The QAT forward: fake_quant_tree jitted, as the train step runs it (test_quant.py checks
  # eager == jitted per weight).
  want = _leaves(qat_weights[targets])
  got, before, after = _leaves(loaded), _leaves(initial), _leaves(trained)
  paths = set(quant.targeted(trained, scheme))
  assert {p for p, x in got.items() if quant.is_qarray(x)} == paths and paths
  deq = _leaves(jax.jit(quant.dequantize_tree)(loaded))
  for p, x in got.items():
    if p in paths:
      assert x.values.dtype == jnp.uint8 and x.shape == after[p].shape, p
      assert np.any(np.asarray(after[p]) != np.asarray(before[p])), f"{p} did not train"
      np.testing.assert_array_equal(np.asarray(deq[p]), np.asarray(want[p]), err_msg=p)
    else:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(after[p]), err_msg=p)
  _, floats = hf.load_pretrained(int4_dirs[targets], dequantize=True, to_device=False)
  for p, x in _leaves(floats).items():
    np.testing.assert_array_equal(x, np.asarray(want[p]), err_msg=p)


def test_int4_engine_serves_the_qat_trainers_forward(qat_run, int4_dirs, qat_weights, rng):
  """log-probs of the engine on the packed checkpoint vs `policy_forward` on the QAT forward's
  weights, and every layer's DSA top-k (`policy.topk_mismatches`, as RL reports it)."""
  c, _, trained, _ = qat_run
  cfg, qparams = hf.load_pretrained(int4_dirs[c.qat.targets], quantized=True)
  engine = Engine(cfg, qparams, max_batch=2, max_len=64, block_size=8, prefill_chunk=32,
                  steps_per_sync=4, shape_buckets=False)
  held = _leaves(engine.params)
  scheme = step_lib.qat_scheme(c)
  for p in quant.targeted(trained, scheme):          # packed in the engine's memory
    assert quant.is_qarray(held[p]) and held[p].values.dtype == jnp.uint8, p
  prompts = [rng.integers(0, 256, n).tolist() for n in (9, 21)]
  outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, seed=1), record_topk=True)
  trajs = [traj_lib.Trajectory.from_response(p, o.token_ids, o.logprobs, 0,
                                             topk=o.topk_indices) for p, o in zip(prompts, outs)]
  b = traj_lib.make_batch(trajs, np.zeros(len(trajs)), length=64)
  fwd = jax.jit(functools.partial(policy.policy_forward, cfg=cfg, return_topk=True))
  logp, _, topk, _ = fwd(qat_weights[c.qat.targets], b.tokens, b.positions, b.segment_ids)
  mask = b.loss_mask > 0
  assert mask.sum() == 20
  diff = np.abs(np.asarray(logp)[mask] - b.rollout_logp[mask])
  assert diff.max() <= ATOL, diff.max()
  bad, total = policy.topk_mismatches(trajs, topk)
  assert bad == 0 and total >= 20, (bad, total)


@pytest.mark.parametrize("targets", list(TARGETS))
def test_packed_int4_takes_4_plus_32_over_g_of_32_of_float32_on_disk_and_in_the_engine(
    qat_run, int4_dirs, targets):
  g = TARGETS[targets]
  bound = (4 + 32 / g) / 32 + 0.01
  infos = _tensors(int4_dirs[targets])
  total = packed = 0
  for name, info in infos.items():
    if name.endswith(".weight_packed"):
      x = name[:-len(".weight_packed")]
      out, inp = _read(infos[f"{x}.weight_shape"]).tolist()
      n = sum(infos[f"{x}.{k}"].end - infos[f"{x}.{k}"].begin
              for k in ("weight_packed", "weight_scale", "weight_shape"))
      assert n <= bound * 4 * out * inp, (x, n / (4 * out * inp))
      total, packed = total + 4 * out * inp, packed + n
  assert total and packed / total <= bound
  trained = qat_run[2]
  _, qparams = hf.load_pretrained(int4_dirs[targets], quantized=True)
  scheme = quant.Scheme("int4", g, targets)
  held = _leaves(qparams)
  for p in quant.targeted(trained, scheme):
    qa = held[p]
    assert quant.tree_nbytes(qa) <= bound * 4 * np.prod(qa.shape), p


def test_a_saved_int4_tree_loads_back_bitwise_on_every_layer_of_a_stack(tiny_cfg, tiny_params,
                                                                        tmp_path):
  """tiny's three layers (stacks of one dense and two MoE layers): every packed byte and scale
  of `quantize_tree` back from the files, in every layer and expert."""
  scheme = quant.Scheme("int4", 16, "all_linear")
  q = jax.jit(quant.quantize_tree, static_argnums=1)(tiny_params, scheme)
  hf.save_pretrained(tiny_cfg, q, str(tmp_path / "int4"))
  _, back = hf.load_pretrained(str(tmp_path / "int4"), quantized=True, to_device=False)
  want, got = _leaves(q), _leaves(back)
  assert want.keys() == got.keys()
  assert got["moe_layers/layer_0/attn/w_uk"].values.shape == (2, 8, 4 * 16)
  for p, x in want.items():
    assert quant.is_qarray(x) == quant.is_qarray(got[p]), p
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(got[p])):
      np.testing.assert_array_equal(np.asarray(a), b, err_msg=p)
    if quant.is_qarray(x):
      assert (x.inner_shape, x.reduction, x.block, x.dtype) == (
          got[p].inner_shape, got[p].reduction, got[p].block, got[p].dtype), p


# ---- errors --------------------------------------------------------------------------------

def test_an_int4_checkpoint_loaded_as_float_is_refused_by_name(int4_dirs, qat_run, tiny_cfg):
  path = int4_dirs["experts"]
  with pytest.raises(ValueError, match=r"config\.json has a quantization_config \(quant_method="
                     r"'compressed-tensors', format='pack-quantized', num_bits=4, group_size=32, "
                     r"targets='experts'\): an INT4 checkpoint, not float weights\. Load it with "
                     r"quantized=True .* or dequantize=True"):
    hf.load_pretrained(path)
  with pytest.raises(ValueError, match=rf"checkpoint='{path}' is an INT4 checkpoint \(config\.json "
                     r"quantization_config: .*\), not float weights"):
    convert.load_model(path)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shardings = jax.tree.map(lambda _: device, gnn.abstract_params(tiny_cfg)[0])
  with pytest.raises(ValueError, match=rf"config\.init_from='{path}' is an INT4 checkpoint"):
    convert.load_params(path, tiny_cfg, shardings)            # a training stage's init_from
  with pytest.raises(ValueError, match=r"quantized=True, but .*config\.json has no "
                     r"quantization_config \(a float checkpoint\)"):
    hf.load_pretrained(qat_run[3], quantized=True)
  with pytest.raises(ValueError, match=r"quantized=True .* and dequantize=True .* exclude"):
    hf.load_pretrained(path, quantized=True, dequantize=True)


def test_the_converter_names_bad_input_before_reading_weights(qat_run, int4_dirs, tmp_path):
  src = qat_run[3]
  with pytest.raises(ValueError, match=r"--quantize_group_size=32 \(--quantize_targets="
                     r"all_linear\): INT4 group_size=32: .* dimension, 16 of dense_layers/"
                     r"layer_0/attn/w_uk"):
    convert.quantize_to_hf(src, str(tmp_path / "a"), targets="all_linear", group_size=32)
  with pytest.raises(ValueError, match=r"--quantize_group_size=12 .*: INT4 group_size=12: "
                     r"expected an even int >= 2 that divides"):
    convert.quantize_to_hf(src, str(tmp_path / "a"), group_size=12)
  with pytest.raises(ValueError, match=r"--quantize_targets='mlp': expected one of "
                     r"\('experts', 'attention', 'all_linear'\)"):
    convert.quantize_to_hf(src, str(tmp_path / "a"), targets="mlp")
  with pytest.raises(ValueError, match=r"--quantize='fp8': expected one of \('int4',\)"):
    convert.quantize_to_hf(src, str(tmp_path / "a"), quantize="fp8")
  with pytest.raises(ValueError, match=r"--src='.*' is already quantized \(config\.json "
                     r"quantization_config: .*group_size=32.*\); quantize the float checkpoint"):
    convert.quantize_to_hf(int4_dirs["experts"], str(tmp_path / "a"))
  with pytest.raises(ValueError, match=r"--src='.*' is an INT4 checkpoint .*a workdir holds "
                     r"float weights"):
    convert.hf_to_workdir(int4_dirs["experts"], str(tmp_path / "a"))
  assert not os.path.exists(tmp_path / "a")


def test_only_int4_weights_are_written_to_hugging_face(tiny_cfg, tmp_path):
  scheme = quant.Scheme("float8_e4m3fn", 32, "experts")
  fp8 = jax.eval_shape(lambda p: quant.quantize_tree(p, scheme), gnn.abstract_params(tiny_cfg)[0])
  with pytest.raises(ValueError, match=r"moe_layers/layer_0/moe/experts/w_down: a float8_e4m3fn "
                     r"QArray; Hugging Face checkpoints hold INT4 weights only"):
    hf.save_pretrained(tiny_cfg, fp8, str(tmp_path / "fp8"))
  assert not os.path.exists(tmp_path / "fp8")


# ---- on a mesh (slow) ----------------------------------------------------------------------

_SHARDED = r"""
import filecmp, numpy as np, jax
from glm5_jax import hf, quant, sharding
src, tmp = {src!r}, {tmp!r}
_, ref = hf.load_pretrained(src, quantized=True, to_device=False)
_, ref_f = hf.load_pretrained(src, dequantize=True, to_device=False)
mesh = sharding.make_mesh({{"fsdp": 2, "expert": 2, "tensor": 2}})
_, p = hf.load_pretrained(src, quantized=True, mesh=mesh)
is_q = quant.is_qarray
for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref)):
  np.testing.assert_array_equal(np.asarray(a), b)
w = p["moe_layers"]["layer_0"]["moe"]["experts"]["w_up"]
assert is_q(w) and tuple(w.values.sharding.spec) == (None, "expert")
assert w.values.addressable_shards[0].data.shape == (1, 4, 32, 32)     # [L, E/2, d/2, I]
_, f = hf.load_pretrained(src, dequantize=True, mesh=mesh)
for a, b in zip(jax.tree.leaves(f), jax.tree.leaves(ref_f)):
  np.testing.assert_array_equal(np.asarray(a), b)
cfg = hf.read_config(src)
hf.save_pretrained(cfg, p, tmp + "/resaved")                      # from the sharded QArrays
assert filecmp.cmp(src + "/model.safetensors", tmp + "/resaved/model.safetensors", shallow=False)
print("OK")
"""


@pytest.mark.slow
def test_int4_checkpoint_loads_and_saves_sharded_on_8_devices(int4_dirs, tmp_path):
  """Packed leaves sharded over their batch axes (fsdp x expert x tensor = 2x2x2), equal to
  the single-process load; dequantize=True on the mesh; saving them rewrites the same bytes."""
  fake_devices.run_script(_SHARDED.format(src=int4_dirs["all_linear"], tmp=str(tmp_path)),
                          devices=8, timeout=300)
