"""Dense attention (glm5_jax/nn/attention.py): blockwise and splash == unblocked; memory linear.

The unblocked references are `mla.mla_expanded_attention` (MLA with a [b, t, s] mask) and
`attention.reference_attention` (any visible interval [start, limit] per query). float32
results and gradients agree to 1e-5 (a few ulps of summation-order difference over tens of
keys); float64 to 1e-12.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax.nn import attention
from glm5_jax.nn import layer_io
from glm5_jax.nn import mla
from glm5_jax.nn import rope

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def rng(request):
  """Inputs seeded by the test's name: new per test, replayable."""
  return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def _qkv(rng, b=2, t=37, s=37, h=3, d=5, e=4, dtype=jnp.float32):
  a = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  return a(b, t, h, d), a(b, s, h, d), a(b, s, h, e)


def _doc_starts(rng, b, t, n_docs=4):
  """[b, t] document starts of rows packed with up to n_docs contiguous documents."""
  seg = np.sort(rng.integers(0, n_docs, (b, t)), axis=1)
  return layer_io.document_starts(jnp.asarray(seg, jnp.int32))


def _assert_same(fn, ref, args, rng, **tol):
  """fn(*args) == ref(*args), and so are the gradients of <out, w> (w random) wrt every arg."""
  w = jnp.asarray(rng.normal(size=jax.eval_shape(ref, *args).shape), args[0].dtype)
  run = jax.jit(lambda f, *a: (lambda out, pull: (out, pull(w)))(*jax.vjp(f, *a)),
                static_argnums=0)
  (got, got_g), (want, want_g) = run(fn, *args), run(ref, *args)
  np.testing.assert_allclose(got, want, **(tol or TOL))
  for i, (a, b) in enumerate(zip(got_g, want_g)):
    np.testing.assert_allclose(a, b, **(tol or TOL), err_msg=f"gradient wrt argument {i}")


@pytest.mark.parametrize("block_q,block_k", [(1, 3), (5, 16), (8, 8), (64, 64)])
def test_blockwise_equals_unblocked_with_packed_documents(rng, block_q, block_k):
  q, k, v = _qkv(rng)
  kw = dict(scale=0.3, start_bt=_doc_starts(rng, 2, 37))
  _assert_same(lambda *x: attention.flash_attention(*x, block_q=block_q, block_k=block_k, **kw),
               lambda *x: attention.reference_attention(*x, **kw), (q, k, v), rng)


def test_queries_anywhere_in_the_keys(rng):
  # 9 queries at key positions 10..18 of 23 (a context-parallel shard), a document from
  # key 4, and one query that sees nothing (start > limit): zero output, zero gradient.
  q, k, v = _qkv(rng, t=9, s=23)
  limit = jnp.broadcast_to(jnp.arange(10, 19, dtype=jnp.int32), (2, 9))
  start = jnp.full((2, 9), 4, jnp.int32).at[1, 3].set(30)
  kw = dict(scale=0.3, start_bt=start, limit_bt=limit)
  flash = lambda *x: attention.flash_attention(*x, block_q=4, block_k=5, **kw)
  _assert_same(flash, lambda *x: attention.reference_attention(*x, **kw), (q, k, v), rng)
  out, dq = jax.jit(jax.value_and_grad(lambda q: jnp.sum(flash(q, k, v)[1, 3]) ** 2))(q)
  assert float(out) == 0.0 and float(jnp.max(jnp.abs(dq))) == 0.0


@pytest.mark.parametrize("block_q,block_k", [(1, 3), (8, 8)])
def test_shared_key_head_equals_unblocked(rng, block_q, block_k):
  # MQA: keys [b, s, d] and values [b, s, e] shared by the 3 query heads, queries anywhere
  # in the keys, packed documents; gradients of the shared keys sum over the heads.
  q, k, v = _qkv(rng, t=9, s=23)
  k, v = k[:, :, 0], v[:, :, 0]
  limit = jnp.broadcast_to(jnp.arange(10, 19, dtype=jnp.int32), (2, 9))
  kw = dict(scale=0.3, start_bt=_doc_starts(rng, 2, 9) + 4, limit_bt=limit)
  ref = lambda q, k, v: attention.reference_attention(
      q, jnp.broadcast_to(k[:, :, None], (2, 23, 3, 5)),
      jnp.broadcast_to(v[:, :, None], (2, 23, 3, 4)), **kw)
  _assert_same(lambda *x: attention.flash_attention(*x, block_q=block_q, block_k=block_k, **kw),
               ref, (q, k, v), rng)


def test_splash_refuses_shared_keys_by_name(rng):
  q, k, v = _qkv(rng)
  with pytest.raises(ValueError, match=r"impl='pallas'.*keys \[b, s, h, d\]"):
    attention.dense_attention(q, k[:, :, 0], v[:, :, 0], scale=0.3, impl="pallas")


def _mla_inputs(rng, b=2, t=21, s=21, h=3, n=5, p=4, c=6, v=5, dtype=jnp.float32):
  a = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  return (a(b, t, h, n), a(b, t, h, p), a(b, s, c), a(b, s, p), a(c, h, n), a(c, h, v))


def _mla_cfg(**kw):
  return config_lib.get_preset("tiny", attention_type="dense", kv_lora_rank=6,
                               qk_nope_head_dim=5, qk_rope_head_dim=4, v_head_dim=5,
                               num_attention_heads=3, num_key_value_heads=3,
                               attention_chunk_size=4, **kw)


def _mla_pair(cfg, doc_start):
  t = doc_start.shape[1]
  mask = mla.causal_mask(t, t)[None] & mla.document_mask(doc_start, t)
  blockwise = lambda *x: mla.mla_dense_attention(cfg, *x, doc_start=doc_start)
  unblocked = lambda *x: mla.mla_expanded_attention(*x, mask_bts=mask, scale=cfg.softmax_scale)
  return blockwise, unblocked


def test_mla_dense_equals_expanded_reference_with_packed_documents(rng):
  cfg, x = _mla_cfg(), _mla_inputs(rng)
  _assert_same(*_mla_pair(cfg, _doc_starts(rng, 2, 21)), x, rng)


def test_mla_dense_with_explicit_limits_equals_expanded_reference(rng):
  # The last 7 of 21 positions (chunked prefill), limits given explicitly: the "pallas"
  # config runs the XLA path, as the splash kernel takes only the causal diagonal.
  cfg, x = _mla_cfg(attention_impl="pallas"), _mla_inputs(rng, t=7, s=21)
  doc_start = jnp.asarray([[0] * 7, [9] * 7], jnp.int32)
  limit = attention.causal_limit(2, 7, 21)
  mask = mla.causal_mask(7, 21)[None] & mla.document_mask(doc_start, 21)
  _assert_same(lambda *x: mla.mla_dense_attention(cfg, *x, doc_start=doc_start, limit=limit),
               lambda *x: mla.mla_expanded_attention(*x, mask_bts=mask, scale=cfg.softmax_scale),
               x, rng)


@pytest.mark.parametrize("explicit_limits", [False, True])
def test_mla_dense_absorbed_form_equals_expanded_reference(rng, explicit_limits):
  # dense_attention_form="absorbed": MQA over the latent rows, the same attention.
  cfg = _mla_cfg(dense_attention_form="absorbed")
  if not explicit_limits:
    _assert_same(*_mla_pair(cfg, _doc_starts(rng, 2, 21)), _mla_inputs(rng), rng)
    return
  doc_start = jnp.asarray([[0] * 7, [9] * 7], jnp.int32)
  limit = attention.causal_limit(2, 7, 21)
  mask = mla.causal_mask(7, 21)[None] & mla.document_mask(doc_start, 21)
  _assert_same(lambda *x: mla.mla_dense_attention(cfg, *x, doc_start=doc_start, limit=limit),
               lambda *x: mla.mla_expanded_attention(*x, mask_bts=mask, scale=cfg.softmax_scale),
               _mla_inputs(rng, t=7, s=21), rng)


def test_dense_attention_form_is_checked_by_name():
  with pytest.raises(ValueError, match="dense_attention_form.*'expanded', 'absorbed'"):
    _mla_cfg(dense_attention_form="mqa")


def test_mla_dense_float64_equals_expanded_reference(rng):
  with jax.enable_x64(True):
    cfg, x = _mla_cfg(), _mla_inputs(rng, dtype=jnp.float64)
    blockwise, unblocked = _mla_pair(cfg, _doc_starts(rng, 2, 21))
    got, want = blockwise(*x), unblocked(*x)
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_splash_in_interpret_mode_equals_unblocked(rng):
  q, k, v = _qkv(rng, b=2, t=40, s=40, h=2, d=24, e=16)   # MLA-like: e != d
  kw = dict(scale=0.3, start_bt=_doc_starts(rng, 2, 40))
  splash = lambda *x: attention.dense_attention(*x, impl="pallas", interpret=True, **kw)
  _assert_same(splash, lambda *x: attention.reference_attention(*x, **kw), (q, k, v), rng)


def test_pallas_impl_off_tpu_lowers_to_the_blockwise_path(rng):
  q, k, v = _qkv(rng)
  start = _doc_starts(rng, 2, 37)
  fn = jax.jit(lambda q, k, v: attention.dense_attention(
      q, k, v, scale=0.3, start_bt=start, impl="pallas", block_q=8, block_k=8))
  assert "tpu_custom_call" not in fn.lower(q, k, v).as_text()
  np.testing.assert_allclose(fn(q, k, v), attention.reference_attention(
      q, k, v, scale=0.3, start_bt=start), **TOL)


def test_pallas_impl_is_causal_self_attention_only(rng):
  q, k, v = _qkv(rng, t=9, s=23)
  with pytest.raises(ValueError, match="t == s"):
    attention.dense_attention(q, k, v, scale=0.3, impl="pallas")
  q, k, v = _qkv(rng)
  with pytest.raises(ValueError, match="limit_bt"):
    attention.dense_attention(q, k, v, scale=0.3, impl="pallas",
                              limit_bt=attention.causal_limit(2, 37, 37))
  with pytest.raises(ValueError, match="impl='cudnn'"):
    attention.dense_attention(q, k, v, scale=0.3, impl="cudnn")


def _dense_layer_memory(cfg, t):
  """XLA's temp bytes of one MLA layer's forward + backward (batch 1, packed documents)."""
  layer = mla.MLA(cfg)
  cos, sin = rope.rope_angles(jnp.arange(8)[None], cfg.qk_rope_head_dim, cfg.rope_theta)
  params = jax.eval_shape(lambda: layer.init(jax.random.PRNGKey(0),
                                             jnp.zeros((1, 8, cfg.hidden_size)),
                                             layer_io.LayerInputs(cos, sin)))

  def loss(p, x, doc_start):
    cos, sin = rope.rope_angles(jnp.arange(t)[None], cfg.qk_rope_head_dim, cfg.rope_theta)
    return jnp.sum(layer.apply(p, x, layer_io.LayerInputs(cos, sin, doc_start))[0] ** 2)

  x = jax.ShapeDtypeStruct((1, t, cfg.hidden_size), jnp.float32)
  doc_start = jax.ShapeDtypeStruct((1, t), jnp.int32)
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x, doc_start).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_dense_layer_memory_grows_linearly_with_sequence_length(tiny_cfg):
  # The unblocked path needed 5.0 GiB at 8K and 80 GiB at 32K (16x); blockwise 27 / 108 MiB.
  cfg = tiny_cfg.replace(attention_type="dense")
  m8, m32 = _dense_layer_memory(cfg, 8192), _dense_layer_memory(cfg, 32768)
  assert m32 <= 8 * m8, (m8, m32)
  logits_32k = cfg.num_attention_heads * 32768 ** 2 * 4      # one float32 [1, h, t, s]
  assert m32 < logits_32k / 16, (m32, logits_32k)


# --------------------------------------------------------------------------------------
# TPU compiles on this CPU host (libtpu's compiler for a described v5e; the `aot` venv:
#   bash launch/local.sh aot python -m pytest -q -m aot tests/nn/test_attention.py)
# --------------------------------------------------------------------------------------

def _v5e_devices():
  pytest.importorskip("libtpu", reason="needs libtpu: bash launch/local.sh aot ...")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return np.array(topologies.get_topology_desc("v5e:2x2", "tpu").devices)


@pytest.mark.aot
def test_splash_compiles_for_v5e_at_glm5_head_dims_and_32k():
  # GLM-5's MLA head dims (d = n + p = 192, e = 256) need no padding; 16 heads = 64 / tensor 4.
  device = jax.sharding.SingleDeviceSharding(_v5e_devices()[0])
  b, t, h, d, e = 1, 32768, 16, 192, 256
  shape = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=device)

  def loss(q, k, v, doc_start):
    o = attention.dense_attention(q, k, v, scale=d ** -0.5, start_bt=doc_start, impl="pallas")
    return jnp.sum(o.astype(jnp.float32) ** 2)

  compiled = jax.jit(jax.grad(loss, (0, 1, 2))).trace(
      shape(b, t, h, d), shape(b, t, h, d), shape(b, t, h, e), shape(b, t, dt=jnp.int32)
  ).lower(lowering_platforms=("tpu",)).compile()
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') >= 3  # fwd, dq, dkv
  mem = compiled.memory_analysis()
  used = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
  assert used < 16 * 2 ** 30, used                               # one v5e chip's HBM


@pytest.mark.aot
def test_dense_layer_with_splash_compiles_on_a_sharded_v5e_mesh():
  # Mosaic refuses a sharded operand; the splash call runs in shard_map (batch over data,
  # heads over tensor), chosen by the lowering platform from this CPU host.
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from glm5_jax import sharding as shd  # pylint: disable=g-import-not-at-top
  sizes = [{"data": 2, "tensor": 2}.get(axis, 1) for axis in shd.MESH_AXES]
  mesh = jax.sharding.Mesh(_v5e_devices().reshape(sizes), shd.MESH_AXES)
  cfg = config_lib.get_preset("small", attention_type="dense", attention_impl="pallas",
                              dtype="bfloat16")
  b, t = 4, 2048
  cos, sin = rope.rope_angles(jnp.arange(t)[None], cfg.qk_rope_head_dim, cfg.rope_theta)
  layer = mla.MLA(cfg)
  boxed = jax.eval_shape(lambda: layer.init(jax.random.PRNGKey(0),
                                            jnp.zeros((1, t, cfg.hidden_size)),
                                            layer_io.LayerInputs(cos, sin)))
  params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        nn.unbox(boxed), shd.param_shardings(nn.get_partition_spec(boxed), mesh))
  rows = shd.batch_sharding(mesh)
  x = jax.ShapeDtypeStruct((b, t, cfg.hidden_size), jnp.bfloat16, sharding=rows)
  doc_start = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=rows)

  def loss(p, x, doc_start):
    out, _, _ = layer.apply(p, x, layer_io.LayerInputs(cos, sin, doc_start))
    return jnp.mean(out.astype(jnp.float32) ** 2)

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss)).trace(params, x, doc_start).lower(
        lowering_platforms=("tpu",)).compile()
  assert compiled.as_text().count('custom_call_target="tpu_custom_call"') > 0
