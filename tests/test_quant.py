"""INT4 and FP8 quantizers (glm5_jax/quant.py) against NumPy references.

The rule under test (quant.py's docstring): scales and w / s in float32, INT4 values rounded
half to even and clipped to [-7, 7], FP8 values cast to float8_e4m3fn (round to nearest,
ties to even, ml_dtypes). The float32 NumPy reference must match the quantizer's q, packed
bytes and scales exactly; the error bounds are checked in float64.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from glm5_jax import quant
from glm5_jax.optim.param_groups import path_str
from glm5_jax.quant import Layout
from glm5_jax.quant import Scheme

# Jitted as QAT runs it (one compile per case instead of one per op); the eager quantizer is
# checked equal to it in test_fake_quant_is_dequantize_of_quantize_bitwise_...
_quantize = jax.jit(quant.quantize, static_argnums=(1, 2))
_dequantize = jax.jit(quant.dequantize)


def _weights(rng, shape):
  """float32 weights over several magnitudes per column (groups of unequal scale)."""
  w = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 3, shape[-1:]))
  return w.astype(np.float32)


def _int4_reference(m, g):
  """(q int [..., R, O], packed uint8 [..., R/2, O], scales [..., R/g, O]) of m [..., R, O]."""
  r, o = m.shape[-2:]
  grouped = m.reshape(*m.shape[:-2], r // g, g, o)
  s = (np.max(np.abs(grouped), axis=-2) / np.float32(7)).astype(np.float32)
  with np.errstate(divide="ignore", invalid="ignore"):
    ratio = np.where(s[..., None, :] > 0, grouped / s[..., None, :], np.float32(0))
  q = np.clip(np.round(ratio.astype(np.float32)), -7, 7).astype(np.int64).reshape(m.shape)
  nib = q + 8
  packed = (nib[..., 0::2, :] | (nib[..., 1::2, :] << 4)).astype(np.uint8)
  return q, packed, s


# (shape, layout): experts [E, in, out], a plain matrix, wo [h, v, d] (two reduction axes).
CASES = [((3, 64, 24), Layout(1, 1)), ((48, 40), Layout(0, 1)), ((4, 8, 20), Layout(0, 2))]


@pytest.mark.parametrize("shape,layout", CASES)
@pytest.mark.parametrize("g", [2, 16])
def test_int4_matches_the_numpy_float32_rule_and_its_error_bound(rng, shape, layout, g):
  w = _weights(rng, shape)
  qa = _quantize(jnp.asarray(w), Scheme("int4", g), layout)
  m = np.asarray(quant.as_matrix(w, layout))
  q, packed, s = _int4_reference(m, g)
  np.testing.assert_array_equal(np.asarray(qa.scales), s)
  np.testing.assert_array_equal(np.asarray(qa.values), packed)
  np.testing.assert_array_equal(np.asarray(quant.int4_unpack(qa.values)), q)
  back = np.asarray(_dequantize(qa))
  assert back.shape == w.shape and back.dtype == np.float32
  s_rows = np.repeat(s, g, axis=-2)
  np.testing.assert_array_equal(back.reshape(m.shape), q.astype(np.float32) * s_rows)
  # float64: |w - w'| <= s/2, plus float32 rounding of w / s (|w / s| <= 7: 7 * 2^-24 of s)
  # and of the product q * s (7 * 2^-24 of s).
  err = np.abs(m.astype(np.float64) - back.reshape(m.shape).astype(np.float64))
  assert np.all(err <= s_rows.astype(np.float64) * (0.5 + 14 * 2.0**-24))
  assert np.max(err / s_rows) > 0.4                    # the bound is not vacuous


def test_int4_packs_even_rows_in_the_low_nibble():
  """One column, group of 4: max 7 -> s = 1; rows 7, -3, 0.5 (ties to even: 0), -7."""
  w = np.array([[7.0], [-3.0], [0.5], [-7.0], [1.5], [2.5], [-1.0], [0.0]], np.float32)
  packed, scales = quant.int4_quantize(jnp.asarray(w), 4)
  # Second group: max |w| = 2.5 -> s = 2.5 / 7; q = round(4.2) = 4, 7, round(-2.8) = -3, 0.
  assert np.asarray(scales).tolist() == [[1.0], [np.float32(2.5) / np.float32(7)]]
  nib = [7 + 8, -3 + 8, 0 + 8, -7 + 8, 4 + 8, 7 + 8, -3 + 8, 0 + 8]
  assert np.asarray(packed)[:, 0].tolist() == [nib[0] | nib[1] << 4, nib[2] | nib[3] << 4,
                                               nib[4] | nib[5] << 4, nib[6] | nib[7] << 4]


def _fp8_reference(m, b):
  """(q float8_e4m3fn [..., R, O], scales [..., ceil(R/b), ceil(O/b)]) of m [..., R, O]."""
  r, o = m.shape[-2:]
  nr, no = -(-r // b), -(-o // b)
  s = np.zeros(m.shape[:-2] + (nr, no), np.float32)
  q = np.zeros(m.shape, ml_dtypes.float8_e4m3fn)
  for i in range(nr):
    for j in range(no):
      blk = m[..., i * b:(i + 1) * b, j * b:(j + 1) * b]        # edge blocks: what is there
      sb = (np.max(np.abs(blk), axis=(-2, -1)) / np.float32(448)).astype(np.float32)
      s[..., i, j] = sb
      with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(sb[..., None, None] > 0, blk / sb[..., None, None], np.float32(0))
      q[..., i * b:(i + 1) * b, j * b:(j + 1) * b] = np.clip(
          x.astype(np.float32), -448, 448).astype(ml_dtypes.float8_e4m3fn)
  return q, s


@pytest.mark.parametrize("shape,b", [((2, 64, 48), 16), ((40, 24), 16), ((37, 5), 8)])
def test_fp8_matches_the_numpy_rule_with_partial_edge_blocks_and_its_error_bound(rng, shape, b):
  w = _weights(rng, shape)
  layout = Layout(len(shape) - 2, 1)
  qa = _quantize(jnp.asarray(w), Scheme("float8_e4m3fn", b), layout)
  q, s = _fp8_reference(w, b)
  assert qa.values.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(np.asarray(qa.scales), s)
  np.testing.assert_array_equal(np.asarray(qa.values).view(np.uint8), q.view(np.uint8))
  back = np.asarray(_dequantize(qa)).astype(np.float64)
  s_full = np.repeat(np.repeat(s, b, -2), b, -1)[..., :shape[-2], :shape[-1]].astype(np.float64)
  np.testing.assert_array_equal(back, (q.astype(np.float32) * s_full.astype(np.float32)))
  # e4m3: 3 mantissa bits, relative error <= 2^-4 for normals; below 2^-6 (subnormals,
  # spacing 2^-9) absolute <= 2^-10 in units of s; plus float32 rounding (2^-23 relative).
  w64 = w.astype(np.float64)
  bound = np.maximum(2.0**-4 * np.abs(w64), 2.0**-10 * s_full) + 2.0**-22 * np.abs(w64)
  assert np.all(np.abs(w64 - back) <= bound)


def test_all_zero_groups_and_blocks_give_zero_scales_and_zero_weights():
  w = np.zeros((8, 4), np.float32)
  w[4:, 1] = [1.0, -2.0, 3.0, 0.5]                       # one non-zero group of column 1
  qa = _quantize(jnp.asarray(w), Scheme("int4", 4), Layout(0, 1))
  assert np.asarray(qa.scales)[0].tolist() == [0.0] * 4
  assert np.asarray(qa.values)[:2].tolist() == [[0x88] * 4] * 2     # q = 0 -> nibble 8
  back = np.asarray(_dequantize(qa))
  assert np.isfinite(back).all() and np.all(back[:4] == 0) and np.all(back[:, [0, 2, 3]] == 0)
  f = _quantize(jnp.asarray(w), Scheme("float8_e4m3fn", 4), Layout(0, 1))
  np.testing.assert_array_equal(np.asarray(f.scales), [[0.0], [np.float32(3) / np.float32(448)]])
  back = np.asarray(_dequantize(f))
  assert np.isfinite(back).all() and np.all(back[:4] == 0)


@pytest.mark.parametrize("scheme,shape,layout", [
    (Scheme("int4", 8), (2, 16, 12), Layout(1, 1)),
    (Scheme("float8_e4m3fn", 8), (20, 12), Layout(0, 1))])
def test_fake_quant_is_dequantize_of_quantize_bitwise_with_a_straight_through_gradient(
    rng, scheme, shape, layout):
  w = jnp.asarray(_weights(rng, shape))
  c = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
  want = np.asarray(quant.dequantize(quant.quantize(w, scheme, layout)))
  np.testing.assert_array_equal(np.asarray(quant.fake_quant(w, scheme, layout)), want)
  fq = jax.jit(quant.fake_quant, static_argnums=(1, 2))
  np.testing.assert_array_equal(np.asarray(fq(w, scheme, layout)), want)
  g = jax.grad(lambda x: jnp.sum(quant.fake_quant(x, scheme, layout) * c))(w)
  np.testing.assert_array_equal(np.asarray(g), np.asarray(c))


@pytest.mark.parametrize("g", [3, 6, 32.0, True, "32", 0, 24])
def test_a_bad_group_size_is_named(g):
  w = jnp.zeros((16, 4))
  with pytest.raises(ValueError, match=rf"INT4 group_size={g!r}: expected an even int >= 2 that "
                     r"divides the quantized \(reduction\) dimension, 16"):
    quant.quantize(w, Scheme("int4", g), Layout(0, 1))


def test_an_unknown_format_or_target_group_is_named(tiny_params):
  with pytest.raises(ValueError, match=r"quantization format 'int8': expected one of "
                     r"\('int4', 'float8_e4m3fn'\)"):
    quant.quantize(jnp.zeros((16, 4)), Scheme("int8", 8), Layout(0, 1))
  with pytest.raises(ValueError, match=r"quantization targets='mlp': expected one of "
                     r"\('experts', 'attention', 'all_linear'\)"):
    quant.quantize_tree(tiny_params, Scheme("int4", 16, "mlp"))
  with pytest.raises(ValueError, match=r"group_size=32: .* dimension, 16 of "
                     r"dense_layers/layer_0/attn/w_uk \(shape \(1, 16, 4, 16\)\)"):
    quant.check_tree(tiny_params, Scheme("int4", 32, "attention"))


@pytest.mark.parametrize("targets,g", [("experts", 32), ("all_linear", 16), ("all_linear", 8)])
def test_packed_weights_and_scales_take_4_plus_32_over_g_of_32_of_float32(tiny_cfg, targets,
                                                                          g):
  """Per targeted leaf and in total (abstract shapes: jax.eval_shape)."""
  from glm5_jax import nn as gnn  # pylint: disable=g-import-not-at-top
  shapes = gnn.abstract_params(tiny_cfg)[0]
  scheme = Scheme("int4", g, targets)
  q = jax.eval_shape(lambda p: quant.quantize_tree(p, scheme), shapes)
  paths = set(quant.targeted(shapes, scheme))
  assert paths
  flat = {path_str(p): x for p, x in
          jax.tree_util.tree_flatten_with_path(q, is_leaf=quant.is_qarray)[0]}
  bound = (4 + 32 / g) / 32 + 0.01
  total = packed = 0
  for path in paths:
    qa = flat[path]
    assert quant.is_qarray(qa) and qa.values.dtype == jnp.uint8
    f32 = 4 * np.prod(qa.shape)
    assert quant.tree_nbytes(qa) <= bound * f32, path
    total, packed = total + f32, packed + quant.tree_nbytes(qa)
  assert packed / total <= bound
  assert all(not quant.is_qarray(x) for p, x in flat.items() if p not in paths)
