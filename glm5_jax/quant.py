"""Weight quantization: INT4 with per-group scales and FP8 e4m3 with per-block scales.

GLM-5 trains INT4 quantization-aware in SFT with a training quantizer that is bitwise the
offline one, so the deployed INT4 model computes what SFT trained, and runs its RL rollouts
in FP8 (paper §2 "pre-training infrastructure", §3). Both quantizers here are pure functions,
used by all three: the QAT forward (`fake_quant`), the offline conversion of a checkpoint
(glm5_jax/hf.py, `experiments/convert_checkpoint.py --quantize=int4`) and the inference
engine's low-precision weights (`Engine(weight_dtype=...)`).

Layout. A weight is seen as [*batch, R, O]: its leading batch axes (a layer stack's `layers`,
the experts), then its reduction (input) axes flattened to R, then its output axes flattened
to O (`Layout`: how many of each; from the Newton–Schulz dimension numbers of its parameter
group, `optim/param_groups.py`). Quantization groups and blocks run along R, the axis a
matmul sums over, as in compressed-tensors and DeepSeek-V3's FP8 (whose torch [out, in]
weights hold R as their last axis).

INT4, symmetric, one float32 scale per group of g consecutive R rows of each output column
(g = `group_size`, must divide R and be even):
    s = max |w| over the group / 7               (an all-zero group: s = 0, every q = 0)
    q = clip(round_half_to_even(w / s), -7, 7)   an int in [-7, 7]
    stored as the nibble q + 8 in [1, 15], two per uint8 along R: byte j of a column holds
    rows 2j (low nibble) and 2j + 1 (high nibble)
    dequantize: w' = (nibble - 8) * s            (one float32 product, correctly rounded)
  Packed values and scales take (4 + 32 / g) / 32 of the float32 bytes (0.156 at g = 32).
  XLA:CPU stores `jnp.int4` in a byte per element, hence the explicit packing.

FP8 e4m3 (`float8_e4m3fn`: max 448, no inf), one float32 scale per block of b x b (R, O)
entries (partial blocks at the edges take the same rule over the entries they have):
    s = max |w| over the block / 448             (an all-zero block: s = 0, every q = 0)
    q = float8_e4m3fn(clip(w / s, -448, 448))    round to nearest, ties to even
    dequantize: w' = float32(q) * s

Both divide in IEEE float32 (`_divide`: a true division, not XLA's multiplication by the
reciprocal), so the same weights give the same bits wherever division is correctly rounded;
tests/test_quant.py checks both against NumPy on XLA:CPU.

`QArray` holds a quantized weight in a parameter tree. The model's `nn.params.param` returns
it dequantized where the module uses the weight (one layer at a time inside the layer scan),
and the MoE gathers the experts a token needs from the packed values before dequantizing
them; the packed form is what stays in memory.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np

INT4_MAX = 7                         # symmetric: q in [-7, 7]
FP8_MAX = 448.0                      # float8_e4m3fn's largest finite value
FORMATS = ("int4", "float8_e4m3fn")
# What `Engine(weight_dtype=...)` and `config.rl.rollout_weight_dtype` accept: plain float
# dtypes are a cast of the float weights, the formats above quantize the targets.
WEIGHT_DTYPES = ("float32", "bfloat16") + FORMATS


class Layout(NamedTuple):
  """How a weight's axes split: `batch` leading batch axes, then `reduction` axes (flattened
  to R), then the rest (flattened to O)."""
  batch: int
  reduction: int


class Scheme(NamedTuple):
  """What to quantize and how.

  fmt: "int4" or "float8_e4m3fn".
  block: INT4 group size along R, or the FP8 block edge.
  targets: a target group of `optim/param_groups.QUANT_TARGETS` ("experts", "attention",
    "all_linear").
  keep: path substrings exempt from quantization (e.g. ("indexer",): the indexer stays at the
    trainer's precision).
  """
  fmt: str
  block: int
  targets: str = "experts"
  keep: tuple = ()


@flax.struct.dataclass
class QArray:
  """A quantized weight: packed values and float32 scales (module docstring).

  values: int4: uint8 [*batch, R // 2, O]; float8_e4m3fn: [*batch, R, O].
  scales: float32; int4: [*batch, R // g, O]; float8_e4m3fn: [*batch, ceil(R / b), ceil(O / b)].
  inner_shape: the weight's own axes (reduction then output), without the batch axes:
    slicing a stacked layer axis (the layer scan) keeps it right.
  reduction: how many of `shape`'s axes are reduction axes.
  fmt, block: the format and its group size or block edge.
  dtype: the dtype `dequantize` returns (the float weight's).
  """
  values: Any
  scales: Any
  inner_shape: tuple = flax.struct.field(pytree_node=False)
  reduction: int = flax.struct.field(pytree_node=False)
  fmt: str = flax.struct.field(pytree_node=False)
  block: int = flax.struct.field(pytree_node=False)
  dtype: str = flax.struct.field(pytree_node=False, default="float32")

  @property
  def batch_shape(self) -> tuple:
    return tuple(self.values.shape[:-2])

  @property
  def shape(self) -> tuple:
    """The float weight's shape."""
    return self.batch_shape + tuple(self.inner_shape)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    return int(self.values.nbytes) + int(self.scales.nbytes)


def is_qarray(x) -> bool:
  return isinstance(x, QArray)


# --------------------------------------------------------------------------------------
# The quantizers, on [..., R, O] arrays
# --------------------------------------------------------------------------------------

def _divide(a, b):
  """a / b in IEEE float32, b broadcast to a's shape.

  XLA's algebraic simplifier rewrites a division by a broadcast or a constant into a
  multiplication by the reciprocal, which rounds differently (on XLA:CPU, x / 7 differs in
  the last bit for about half of all float32 x). The optimization barrier keeps the division
  one, so the quantizer is the rule the module docstring states, bitwise NumPy's float32
  division (tests/test_quant.py).
  """
  return a / jax.lax.optimization_barrier(jnp.broadcast_to(b, jnp.shape(a)).astype(a.dtype))


def _safe_divide(w, s):
  """w / s, and 0 where s is 0 (an all-zero group or block)."""
  s = jnp.broadcast_to(s, w.shape)
  return jnp.where(s > 0, _divide(w, jnp.where(s > 0, s, 1.0)), 0.0)


def check_group_size(group_size: int, r: int, what: str = "") -> None:
  """A ValueError unless group_size is an even int >= 2 dividing r (`what`: whose r)."""
  if (not isinstance(group_size, (int, np.integer)) or isinstance(group_size, bool)
      or group_size < 2 or group_size % 2 or r % group_size):
    raise ValueError(f"INT4 group_size={group_size!r}: expected an even int >= 2 that divides "
                     f"the quantized (reduction) dimension, {r}{' of ' + what if what else ''}")


def int4_quantize(w_ro, group_size: int = 32):
  """(packed uint8 [..., R // 2, O], scales float32 [..., R // g, O]) of w [..., R, O]."""
  r, o = w_ro.shape[-2:]
  check_group_size(group_size, r)
  lead = w_ro.shape[:-2]
  w = w_ro.astype(jnp.float32).reshape(*lead, r // group_size, group_size, o)
  scales = _divide(jnp.max(jnp.abs(w), axis=-2), INT4_MAX)              # [..., R // g, O]
  q = jnp.clip(jnp.round(_safe_divide(w, scales[..., None, :])), -INT4_MAX, INT4_MAX)
  nib = (q.astype(jnp.int32) + 8).reshape(*lead, r // 2, 2, o)
  packed = (nib[..., 0, :] | (nib[..., 1, :] << 4)).astype(jnp.uint8)
  return packed, scales


def int4_unpack(packed):
  """The signed values q in [-7, 7] (int8 [..., R, O]) of packed nibbles [..., R // 2, O]."""
  p = packed.astype(jnp.int32)
  q = jnp.stack([p & 0xF, p >> 4], axis=-2) - 8                          # [..., R // 2, 2, O]
  return q.reshape(*packed.shape[:-2], 2 * packed.shape[-2], packed.shape[-1]).astype(jnp.int8)


def int4_dequantize(packed, scales, dtype=jnp.float32):
  """w' [..., R, O] = q * s (module docstring)."""
  q = int4_unpack(packed)
  r, o = q.shape[-2:]
  ng = scales.shape[-2]
  w = q.astype(jnp.float32).reshape(*q.shape[:-2], ng, r // ng, o) * scales[..., :, None, :]
  return w.reshape(q.shape).astype(dtype)


def _blocks(x, b: int):
  """[..., R, O] zero-padded to whole b x b blocks: [..., R', O'] (R', O' multiples of b)."""
  r, o = x.shape[-2:]
  pad = [(0, 0)] * (x.ndim - 2) + [(0, -r % b), (0, -o % b)]
  return jnp.pad(x, pad)


def _per_block(s, b: int, r: int, o: int):
  """Block scales [..., ceil(R/b), ceil(O/b)] broadcast to every entry [..., R, O]."""
  return jnp.repeat(jnp.repeat(s, b, axis=-2), b, axis=-1)[..., :r, :o]


def fp8_quantize(w_ro, block: int = 128):
  """(q float8_e4m3fn [..., R, O], scales float32 [..., ceil(R/b), ceil(O/b)])."""
  if not isinstance(block, (int, np.integer)) or isinstance(block, bool) or block < 1:
    raise ValueError(f"FP8 block={block!r}: expected a positive int")
  r, o = w_ro.shape[-2:]
  w = w_ro.astype(jnp.float32)
  x = _blocks(jnp.abs(w), block)
  nr, no = x.shape[-2] // block, x.shape[-1] // block
  absmax = jnp.max(x.reshape(*x.shape[:-2], nr, block, no, block), axis=(-3, -1))
  scales = _divide(absmax, FP8_MAX)
  q = jnp.clip(_safe_divide(w, _per_block(scales, block, r, o)), -FP8_MAX, FP8_MAX)
  return q.astype(jnp.float8_e4m3fn), scales


def fp8_dequantize(q, scales, block: int = 128, dtype=jnp.float32):
  """w' [..., R, O] = float32(q) * s, s the scale of each entry's b x b block."""
  r, o = q.shape[-2:]
  return (q.astype(jnp.float32) * _per_block(scales, block, r, o)).astype(dtype)


# --------------------------------------------------------------------------------------
# Whole weights: QArray, dequantize, the straight-through QAT forward
# --------------------------------------------------------------------------------------

def as_matrix(w, layout: Layout):
  """w [*batch, *red, *out] -> [*batch, R, O]."""
  b, k = layout.batch, layout.reduction
  shape = w.shape
  r = int(np.prod(shape[b:b + k]))
  return w.reshape(*shape[:b], r, int(np.prod(shape[b + k:])))


def check_scheme(scheme: Scheme, shape, layout: Layout, path: str = "weight") -> None:
  """A clear error for a scheme the weight cannot take (names the leaf and the field)."""
  if scheme.fmt not in FORMATS:
    raise ValueError(f"quantization format {scheme.fmt!r}: expected one of {FORMATS}")
  r = int(np.prod(shape[layout.batch:layout.batch + layout.reduction]))
  if scheme.fmt == "int4":
    check_group_size(scheme.block, r, f"{path} (shape {tuple(shape)})")
  elif not isinstance(scheme.block, (int, np.integer)) or scheme.block < 1:
    raise ValueError(f"FP8 block={scheme.block!r}: expected a positive int")


def quantize(w, scheme: Scheme, layout: Layout) -> QArray:
  """The QArray of float weight w."""
  check_scheme(scheme, w.shape, layout)
  m = as_matrix(w, layout)
  fn = int4_quantize if scheme.fmt == "int4" else fp8_quantize
  values, scales = fn(m, scheme.block)
  return QArray(values, scales, tuple(w.shape[layout.batch:]), layout.reduction, scheme.fmt,
                int(scheme.block), jnp.dtype(w.dtype).name)


def dequantize(qa: QArray, dtype=None):
  """The float weight a QArray stands for, in its own shape (`dtype`: default its own)."""
  dtype = qa.dtype if dtype is None else dtype
  if qa.fmt == "int4":
    w = int4_dequantize(qa.values, qa.scales)
  else:
    w = fp8_dequantize(qa.values, qa.scales, qa.block)
  return w.reshape(qa.shape).astype(dtype)


def materialize(w, dtype=None):
  """A float array for w: a QArray dequantized, an array (cast to `dtype`) as it is."""
  if is_qarray(w):
    return dequantize(w, dtype)
  return w if dtype is None else w.astype(dtype)


def take(w, idx, axis: int = 0):
  """`jnp.take(w, idx, axis)` along a batch axis; a QArray stays packed (the gathered
  experts' values and scales only)."""
  if not is_qarray(w):
    return jnp.take(w, idx, axis=axis)
  if axis < 0 or axis >= len(w.batch_shape):
    raise ValueError(f"quant.take: axis {axis} is not a batch axis of a QArray with batch "
                     f"shape {w.batch_shape}")
  return w.replace(values=jnp.take(w.values, idx, axis=axis),
                   scales=jnp.take(w.scales, idx, axis=axis))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def fake_quant(w, scheme: Scheme, layout: Layout):
  """dequantize(quantize(w)) with a straight-through gradient: the QAT forward.

  The value is bitwise the offline quantizer's dequantized weight (the same functions); the
  gradient passes to the float32 master weight unchanged (Bengio et al. 2013).
  """
  return dequantize(quantize(w, scheme, layout), w.dtype)


def _fake_quant_fwd(w, scheme, layout):
  return fake_quant(w, scheme, layout), None


def _fake_quant_bwd(scheme, layout, _, g):
  del scheme, layout
  return (g,)


fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


# --------------------------------------------------------------------------------------
# Parameter trees
# --------------------------------------------------------------------------------------

def _targets(params, scheme: Scheme):
  """[(path, leaf, Layout or None)] over params' leaves (a QArray is one leaf): the Layout
  where `scheme` quantizes the leaf (the path rules of optim/param_groups.py), else None."""
  # pylint: disable-next=g-import-not-at-top
  from glm5_jax.optim.param_groups import is_quant_target, path_str, quant_axes
  out = []
  for path, w in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_qarray)[0]:
    p = path_str(path)
    lay = (Layout(*quant_axes(p, tuple(w.shape)))
           if is_quant_target(p, scheme.targets, scheme.keep) else None)
    out.append((path, w, lay))
  return out


def _map_targets(fn, params, scheme: Scheme):
  treedef = jax.tree_util.tree_structure(params, is_leaf=is_qarray)
  return jax.tree_util.tree_unflatten(treedef, [
      w if lay is None else fn(w, lay) for _, w, lay in _targets(params, scheme)])


def check_tree(params, scheme: Scheme) -> None:
  """Every targeted leaf takes the scheme (the group size divides its reduction dimension);
  a ValueError names the first that does not."""
  from glm5_jax.optim.param_groups import path_str  # pylint: disable=g-import-not-at-top
  for path, w, lay in _targets(params, scheme):
    if lay is not None and not is_qarray(w):
      check_scheme(scheme, w.shape, lay, path_str(path))


def targeted(params, scheme: Scheme) -> list[str]:
  """The paths of the leaves `scheme` quantizes."""
  from glm5_jax.optim.param_groups import path_str  # pylint: disable=g-import-not-at-top
  return [path_str(p) for p, _, lay in _targets(params, scheme) if lay is not None]


def quantize_tree(params, scheme: Scheme):
  """params with every targeted float leaf a QArray (leaves already quantized stay)."""
  check_tree(params, scheme)
  return _map_targets(lambda w, lay: w if is_qarray(w) else quantize(w, scheme, lay),
                      params, scheme)


def fake_quant_tree(params, scheme: Scheme):
  """params with every targeted leaf replaced by its straight-through `fake_quant`."""
  return _map_targets(lambda w, lay: fake_quant(w, scheme, lay), params, scheme)


def dequantize_tree(params):
  """params with every QArray dequantized (float arrays everywhere)."""
  return jax.tree.map(materialize, params, is_leaf=is_qarray)


def has_qarrays(params) -> bool:
  return any(is_qarray(x) for x in jax.tree_util.tree_leaves(params, is_leaf=is_qarray))


def tree_nbytes(params) -> int:
  """Bytes of every leaf (a QArray's packed values and scales)."""
  return int(sum(np.prod(np.shape(x)) * np.dtype(x.dtype).itemsize
                 for x in jax.tree_util.tree_leaves(params)))


def cast_floats(params, dtype, keep=("router",)):
  """Every floating leaf cast to `dtype`, except leaves whose path contains a name in `keep`
  (the router and its bias stay float32, as in the released checkpoints)."""
  def cast(path, x):
    names = {str(getattr(k, "key", k)) for k in path}
    if names & set(keep) or not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    return x.astype(dtype)
  return jax.tree_util.tree_map_with_path(cast, params)
