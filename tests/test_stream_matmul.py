"""glm5_jax/stream_matmul.py: the streamed CPU matmul equals XLA:CPU's matmul bitwise (its
rows at 8+ rows), reading a stacked weight at a layer index; the engine's streamed decode
steps keep the engine's tokens and log-probs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax import numerics
from glm5_jax import stream_matmul
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.inference import placement

pytestmark = pytest.mark.skipif(not stream_matmul.available(),
                                reason="stream_matmul: no C++ compiler or not a CPU backend")


def _xla_rows(x, w):
  """XLA's matmul of x's rows, padded to the batch-invariant row count (the engine's and
  the trainer's bits)."""
  m = x.shape[0]
  pad = max(numerics.MIN_INVARIANT_ROWS - m, 0)
  return np.asarray(jax.jit(lambda x, w: x @ w)(jnp.pad(x, ((0, pad), (0, 0))), w))[:m]


@pytest.mark.parametrize("k,n", [(512, 256), (256, 512), (300, 72), (64, 40), (1536, 512)])
@pytest.mark.parametrize("rows", ["one_mirrored", "three", "sixteen", "forty_one", "eighty"])
def test_matmul_equals_xlas_matmul_bitwise(k, n, rows, rng):
  """Every path: a lone lane mirrored over 8 rows (one row computed), few distinct rows
  (rows streamed whole, k-blocks in parallel), 16 and 41 (streamed in groups of 4, the last
  one short), 80 (register tiles); tails of k (300, not a multiple of the 8 rows of w a
  pass reads) and of n (40, 72: not a multiple of the vector width); several k-blocks (512;
  1536, whose last block is shorter); layers of a stack."""
  kc = stream_matmul.kc(k, n)
  if kc is None:
    pytest.skip(f"no block size of Eigen's rule matched XLA's matmul at [{k}, {n}] here")
  w = jnp.asarray(rng.standard_normal((3, k, n), np.float32) / np.sqrt(k))
  if rows == "one_mirrored":
    x = np.repeat(rng.standard_normal((1, k), np.float32), 8, axis=0)
  elif rows == "three":
    x = rng.standard_normal((3, k), np.float32)
    x = np.concatenate([x, np.zeros((5, k), np.float32)])      # an expert block's padding
  else:
    x = rng.standard_normal(({"sixteen": 16, "forty_one": 41, "eighty": 80}[rows], k),
                            np.float32)
  x = jnp.asarray(x)
  run = jax.jit(stream_matmul.matmul, static_argnames="kc")
  for layer in (0, 2):
    np.testing.assert_array_equal(np.asarray(run(x, w, jnp.int32(layer), kc=kc)),
                                  _xla_rows(x, w[layer]))


@pytest.mark.parametrize("k,n,b,used", [(512, 256, 8, 5), (256, 512, 8, 1), (64, 40, 80, 2),
                                         (300, 72, 16, 0), (512, 256, 2, 6), (64, 40, 1, 5)])
def test_grouped_matmul_is_each_groups_matmul_bitwise(k, n, b, used, rng):
  """Each group in use equals `matmul` of its rows by its matrix (rows streamed, or register
  tiles at 80 rows; a group padded with zero rows, one with mirrored rows; groups 1-3 one
  matrix, a product of their rows together); groups past `count` are zero, whatever their
  (out-of-range) index."""
  kc = stream_matmul.kc(k, n)
  if kc is None:
    pytest.skip(f"no block size of Eigen's rule matched XLA's matmul at [{k}, {n}] here")
  g = 6
  w = jnp.asarray(rng.standard_normal((4, k, n), np.float32) / np.sqrt(k))
  x = rng.standard_normal((g, b, k), np.float32)
  x[0, 3:] = 0.0                                           # an expert block's padding
  x[1, 1:] = x[1, :1]                                      # a lone lane mirrored
  index = rng.integers(0, 4, g).astype(np.int32)
  index[2:4] = index[1]
  index[used:] = 99
  run = jax.jit(stream_matmul.grouped_matmul, static_argnames="kc")
  got = np.asarray(run(jnp.asarray(x), w, jnp.asarray(index), jnp.int32(used), kc=kc))
  one = jax.jit(stream_matmul.matmul, static_argnames="kc")
  for j in range(g):
    want = (np.asarray(one(jnp.asarray(x[j]), w, jnp.int32(index[j]), kc=kc)) if j < used
            else np.zeros((b, n), np.float32))
    np.testing.assert_array_equal(got[j], want)


def test_rows_below_the_invariant_count_get_the_big_matmuls_bits(rng):
  """3 rows alone: XLA's own matmul of 3 rows may sum in another order; the kernel gives each
  row its 8-row (the trainer's) bits whatever the row count."""
  k, n = 512, 256
  kc = stream_matmul.kc(k, n)
  w = jnp.asarray(rng.standard_normal((1, k, n), np.float32))
  x = jnp.asarray(rng.standard_normal((3, k), np.float32))
  got = np.asarray(jax.jit(stream_matmul.matmul, static_argnames="kc")(x, w, 0, kc=kc))
  np.testing.assert_array_equal(got, _xla_rows(x, w[0]))


def test_candidates_follow_eigens_blocking_rule():
  assert stream_matmul.candidates(64)[0] == (0, 64)
  assert (0, 256, 512) in stream_matmul.candidates(512)
  assert (0, 312, 624, 936, 1248, 1536) in stream_matmul.candidates(1536)


def test_kc_may_be_first_asked_inside_a_trace():
  """A module asks for a shape's block size while jit traces it (the probe runs eagerly)."""
  assert jax.jit(lambda x: x * stream_matmul.kc(40, 24))(1.0) == 40


def test_bad_operands_name_the_problem():
  x = jnp.zeros((8, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"needs w \[R, 64, N\]"):
    stream_matmul.matmul(x, jnp.zeros((64, 32), jnp.float32), 0, kc=64)
  with pytest.raises(ValueError, match="float32 only"):
    stream_matmul.matmul(x.astype(jnp.bfloat16), jnp.zeros((1, 64, 32), jnp.bfloat16), 0,
                         kc=64)
  with pytest.raises(ValueError, match=r"x must be \[G, B, K\] and index \[G\]"):
    stream_matmul.grouped_matmul(x[None], jnp.zeros((1, 64, 32), jnp.float32),
                                 jnp.zeros((2,), jnp.int32), 1, kc=64)


# A decode step's attention products (nn/mla.py `_over_cache`, pallas_kernels/sparse_attention
# xla.py): absorbed queries, sparse attention's logits and values, W_UV; then odd sizes (column
# tails, rows past one register tile, k past a block, a batch axis last in the output).
EINSUMS = [("bthn,chn->bthc", (16, 1, 8, 48), (8, 48, 128), (1, 2, 0)),
           ("bchd,bckd->bchk", (16, 1, 8, 144), (16, 1, 64, 144), None),
           ("bchk,bckv->bchv", (1, 1, 8, 256), (1, 1, 256, 128), None),
           ("bthc,chv->bthv", (8, 1, 8, 128), (8, 128, 64), (1, 0, 2)),
           ("gmk,gkn->gmn", (3, 13, 37), (3, 37, 21), None),
           ("mk,kn->mn", (40, 700), (700, 24), None),
           ("bmk,knb->nmb", (5, 3, 16), (16, 17, 5), None)]


@pytest.mark.parametrize("eq,a_shape,b_shape,laid", EINSUMS)
def test_einsum_equals_xlas_einsum_bitwise(eq, a_shape, b_shape, laid, rng):
  """The batched kernel's products are XLA's, bit for bit (b given in `laid`'s axes, as an
  engine serves MLA's W_UK / W_UV: nn/params.py SERVED_LAYOUTS)."""
  a = jnp.asarray(rng.standard_normal(a_shape, np.float32))
  b = jnp.asarray(rng.standard_normal(b_shape, np.float32))
  if laid is not None:
    b = jnp.transpose(b, np.argsort(laid))
  assert stream_matmul.einsum_kc(eq, a.shape, b.shape) is not None
  got = jax.jit(functools.partial(stream_matmul.einsum, eq))(a, b)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(
      functools.partial(jnp.einsum, eq))(a, b)))


@pytest.mark.parametrize("eq,a_shape,b_shape,laid", [e for e in EINSUMS if e[3] is not None])
def test_einsum_reads_a_served_stack_in_place(eq, a_shape, b_shape, laid, rng):
  """With b_stack and a (traced) layer, the kernel reads b from the stack's layer, in its
  served layout: XLA's einsum of that layer, bit for bit, and no slice of the stack."""
  a = jnp.asarray(rng.standard_normal(a_shape, np.float32))
  stack = jnp.asarray(rng.standard_normal((3, *b_shape), np.float32))      # [R, served]
  inv = np.argsort(laid)

  def fn(a, stack, layer):
    b = jnp.transpose(stack[layer], inv)
    return stream_matmul.einsum(eq, a, b, b_stack=stack, layer=layer)

  for layer in (0, 2):
    got = jax.jit(fn)(a, stack, jnp.int32(layer))
    want = jnp.einsum(eq, a, jnp.transpose(stack[layer], inv))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  hlo = jax.jit(fn).lower(a, stack, jnp.int32(1)).compile().as_text()
  assert "dynamic-slice" not in hlo and "dynamic_slice" not in hlo
  with pytest.raises(ValueError, match="is not a stack of b laid out"):
    stream_matmul.einsum(eq, a, jnp.transpose(stack[0], inv), b_stack=stack[:, :1], layer=0)


def test_einsum_leaves_other_equations_and_large_products_to_xla(rng):
  a = jnp.asarray(rng.standard_normal((4, 8), np.float32))
  assert stream_matmul._einsum_plan("ij,jk->i", a.shape, (8, 3)) is None    # k summed away
  assert stream_matmul._einsum_plan("ii,ij->j", (4, 4), a.shape) is None    # a repeated index
  assert stream_matmul._einsum_plan("ij,jk", a.shape, (8, 3)) is None       # implicit output
  assert stream_matmul._einsum_plan("ij,kl->ijkl", a.shape, (2, 3)) is None  # no contraction
  np.testing.assert_array_equal(stream_matmul.einsum("ij,jk->i", a, a.T),
                                jnp.einsum("ij,jk->i", a, a.T))
  jaxpr = lambda eq, a_shape, b_shape: str(jax.make_jaxpr(functools.partial(
      stream_matmul.einsum, eq))(jnp.zeros(a_shape), jnp.zeros(b_shape)))
  assert "ffi_call" in jaxpr("gmk,gkn->gmn", (2, 256, 8), (2, 8, 4))
  assert "ffi_call" not in jaxpr("gmk,gkn->gmn", (2, 257, 8), (2, 8, 4))   # > EINSUM_MAX_ROWS
  assert "ffi_call" not in jaxpr("mk,kn->mn", (256, 8), (8, 4))            # one product


def test_batched_matmul_names_bad_operands():
  a = jnp.zeros((2, 8, 16), jnp.float32)
  with pytest.raises(ValueError, match=r"a must be \[G, M, K\] and b \[G, K, N\]"):
    stream_matmul.batched_matmul(a, jnp.zeros((2, 8, 16), jnp.float32))
  with pytest.raises(ValueError, match="float32 only"):
    stream_matmul.batched_matmul(a.astype(jnp.bfloat16), jnp.zeros((2, 16, 4), jnp.bfloat16))


def test_laid_out_copies_are_the_planned_weights_in_their_served_layouts(rng):
  """Only the weights nn.params.SERVED_LAYOUTS lists, a stack's layer axis kept first."""
  w_uv = rng.standard_normal((2, 4, 3, 5), np.float32)       # [R, c, h, v]
  w_uk = rng.standard_normal((4, 3, 6), np.float32)          # the MTP layer's [c, h, n]
  params = {"moe_layers": {"layer_0": {"attn": {"w_uv": w_uv, "wo": w_uv}}},
            "mtp": {"layer": {"attn": {"w_uk": w_uk}}}}
  plan = {"moe_layers": {"layer_0": {"attn": {"w_uv": np.arange(2), "wo": np.arange(2)}}},
          "mtp": {"layer": {"attn": {"w_uk": np.zeros((), np.int32)}}}}
  out = placement.laid_out_copies(plan, params)
  assert set(out["moe_layers"]["layer_0"]["attn"]) == {"w_uv"}
  np.testing.assert_array_equal(out["moe_layers"]["layer_0"]["attn"]["w_uv"],
                                np.transpose(w_uv, (0, 2, 1, 3)))           # [R, h, c, v]
  np.testing.assert_array_equal(out["mtp"]["layer"]["attn"]["w_uk"],
                                np.transpose(w_uk, (1, 2, 0)))              # [h, n, c]


def test_the_tiny_preset_is_not_streamed(tiny_cfg, tiny_params):
  """Its weights (under placement.STREAM_MIN_BYTES and HEAD_STREAM_MIN_BYTES) stay with
  XLA's matmul: the main job's programs are unchanged."""
  assert Engine(tiny_cfg, tiny_params, max_batch=1, max_len=16).stream_plan is None


@pytest.fixture(scope="module")
def streamed_engines():
  """(speculative, streamed) -> a tiny engine, every matrix streamed when streamed (the size
  threshold at 0); made on first use."""
  cfg = config_lib.get_preset("tiny")
  params = gnn.init_params(cfg, 0)
  kw = dict(max_batch=2, max_len=48, block_size=8, steps_per_sync=4)

  @functools.cache
  def engine(speculative, streamed):
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(placement, "STREAM_MIN_BYTES", 0)
      mp.setattr(placement, "HEAD_STREAM_MIN_BYTES", 0)
      return Engine(cfg, params, speculative=speculative, num_draft=1,
                    stream_matmul=streamed, **kw)
  return engine


@pytest.mark.parametrize("speculative", [pytest.param(False, marks=pytest.mark.slow), True])
def test_streamed_engines_keep_the_engines_bits(streamed_engines, speculative, rng):
  """A lone request (mirrored lanes) and two requests: prefill and plain decode, or
  (speculative) prefill, the MTP drafts (one live lane), the verify (2 tokens per lane) and
  the MTP catch-up. Same sampled tokens and log-probs as XLA's matmuls (which equal the
  trainer's: tests/inference/test_engine.py). Plain decoding is a slow test (CI time): its
  steps run the forward the speculative verify runs, at 8 rows instead of 16."""
  plan = streamed_engines(speculative, True).stream_plan
  assert streamed_engines(speculative, False).stream_plan is None
  assert plan["moe_layers"]["layer_0"]["moe"]["experts"]["w_gate"].shape == (2,)
  assert plan["moe_layers"]["layer_0"]["moe"]["router"]["kernel"].shape == (2,)
  assert plan["mtp"]["layer"]["attn"]["wo"].shape == ()
  assert plan["lm_head"]["kernel"].shape == ()
  assert plan["moe_layers"]["layer_0"]["attn"]["w_uv"].shape == (2,)      # served laid out
  sp = SamplingParams(max_new_tokens=7, seed=4)
  for n in (1, 2):
    prompts = [rng.integers(0, 256, 9).tolist() for _ in range(n)]
    outs = {s: streamed_engines(speculative, s).generate(prompts, sp) for s in (False, True)}
    for a, b in zip(outs[False], outs[True]):
      assert a.token_ids == b.token_ids
      np.testing.assert_array_equal(a.logprobs, b.logprobs)


def test_a_weight_update_reaches_the_streamed_and_laid_out_weights(streamed_engines, rng):
  """update_params on the streamed engine and on the one without: the same tokens and
  log-probs again (the laid-out copies are made anew from the new weights), and different
  ones than before the update."""
  cfg = config_lib.get_preset("tiny")
  new = gnn.init_params(cfg, 1)
  prompt = [rng.integers(0, 256, 9).tolist()]
  sp = SamplingParams(max_new_tokens=5, seed=4)
  engines = {s: streamed_engines(True, s) for s in (False, True)}
  before = engines[True].generate(prompt, sp)[0]
  try:
    for s, e in engines.items():
      e.update_params(new, version=1)
    a, b = (engines[s].generate(prompt, sp)[0] for s in (False, True))
    assert a.token_ids == b.token_ids
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert not np.array_equal(b.logprobs, before.logprobs)
  finally:
    for e in engines.values():
      e.update_params(gnn.init_params(cfg, 0), version=2)

