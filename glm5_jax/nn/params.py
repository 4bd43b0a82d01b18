"""Parameter creation with logical axis names (docs/design.md decision 1)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import numerics
from glm5_jax import quant
from glm5_jax import stream_matmul


def param(module: nn.Module, name: str, init, shape, axes, dtype, *, packed: bool = False):
  """Creates `module.<name>` with logical axis names `axes` (one per dim).

  A quantized weight (`quant.QArray`, the inference engine's INT4 / FP8 weights) is returned
  dequantized here, where the module uses it, or as it is with `packed=True` (the MoE gathers
  the experts it needs before dequantizing them).
  """
  if len(axes) != len(shape):
    raise ValueError(f"{name}: {len(axes)} axis names {axes} for shape {shape}")
  if module.has_variable("params", name):
    value = module.get_variable("params", name)
    if quant.is_qarray(value):
      if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name}: a quantized weight of shape {value.shape}, the module "
                         f"expects {tuple(shape)}")
      return value if packed else quant.dequantize(value, dtype)
  return module.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape),
                      jnp.dtype(dtype))


def dense_init(cfg):
  """HF `_init_weights`: normal(0, initializer_range) for every matrix."""
  return nn.initializers.normal(stddev=cfg.initializer_range)


def host_initializer(path, cfg):
  """numpy initializer following the modules' rule: `scale` -> 1, biases -> 0, else N(0, std).

  `path` is a jax key path; the rule looks at the leaf name only. Kept next to
  `dense_init` so that both stay one rule (tests/nn/test_model.py checks them).
  """
  name = str(getattr(path[-1], "key", path[-1]))
  if name == "scale":
    return lambda gen, shape: np.ones(shape, np.float32)
  if name in ("bias", "e_score_correction_bias"):
    return lambda gen, shape: np.zeros(shape, np.float32)
  return lambda gen, shape: gen.normal(0.0, cfg.initializer_range, shape).astype(np.float32)


# The inference engine's streamed matmuls (glm5_jax/stream_matmul.py): a forward given these
# two collections multiplies each weight they name straight from its layer stack. STREAM_W
# holds the whole stacks ([R, ...], broadcast into the layer scan; unstacked for the MTP
# layer), STREAM_LAYER the matching layer indices (int32 [R], scanned with the parameters,
# so each repeat sees its own; int32 [] for the MTP layer). Absent: `dense` is the plain
# tensordot (the trainer, every other backend).
STREAM_W, STREAM_LAYER = "stream_w", "stream_layer"
STREAM_MAX_ROWS = 64     # rows beyond which the matmul stays XLA's (prefill chunks)
# The weights a module multiplies through `dense`, and how many leading axes each contracts
# ("kernel": the routers' weights, nn/moe.py, and the lm_head's, nn/embed.py; a name not
# listed contracts one axis).
DENSE_WEIGHTS = {"wq_a": 1, "wq_b": 1, "wkv_a": 1, "wo": 2, "wk": 1, "weights_proj": 1,
                 "w_gate": 1, "w_up": 1, "w_down": 1, "eh_proj": 1, "kernel": 1}


def dense(module: nn.Module, name: str, x, w, preferred_element_type=None,
          max_rows: int = STREAM_MAX_ROWS):
  """x contracted with w's first `DENSE_WEIGHTS[name]` axes (`jnp.tensordot`): [..., *w.shape
  [:n]] -> [..., *w.shape[n:]]. Where the forward streams `module.<name>` (STREAM_W) and x
  has MIN_INVARIANT_ROWS to `max_rows` rows (fewer: XLA may sum in another order,
  glm5_jax/numerics.py), the same numbers from the streamed CPU kernel."""
  n = DENSE_WEIGHTS.get(name, 1)
  k = int(np.prod(w.shape[:n]))
  rows = x.size // k
  if (module.has_variable(STREAM_W, name)
      and numerics.MIN_INVARIANT_ROWS <= rows <= max_rows):
    stack = module.get_variable(STREAM_W, name)
    layer = module.get_variable(STREAM_LAYER, name)
    stack = stack if stack.ndim == w.ndim + 1 else stack[None]
    stack = stack.reshape(stack.shape[0], k, -1)
    y = stream_matmul.matmul(x.reshape(rows, k).astype(stack.dtype), stack, layer)
    return y.reshape(x.shape[:x.ndim - n] + w.shape[n:]).astype(
        preferred_element_type or x.dtype)
  return jnp.tensordot(x, w, n, preferred_element_type=preferred_element_type)


# Weights whose products read them in another layout, which would transpose them out of their
# layer stack every step (MLA's absorbed per-head products, nn/mla.py, through the batched
# kernel's [heads, k, n] operand: glm5_jax/stream_matmul.py `einsum`), and that layout (axes
# of the weight): an engine serves a copy so laid out (`laid_out`).
SERVED_LAYOUTS = {"w_uk": (1, 2, 0), "w_uv": (1, 0, 2)}


def laid_out(module: nn.Module, name: str, w):
  """w; where the forward streams `module.<name>` (STREAM_W then holds its copy in
  SERVED_LAYOUTS[name]'s layout), that copy at the layer, transposed back: the same numbers,
  and XLA cancels the transpose against its own (a kernel that reads the copy in place, with
  no slice of the stack, takes `served_stack`)."""
  at = served_stack(module, name, w)
  if at is None:
    return w
  stack, layer = at
  return jnp.transpose(stack[layer], np.argsort(SERVED_LAYOUTS[name]))


def served_stack(module: nn.Module, name: str, w):
  """(stack [R, ...], layer int32 []) of the copy `laid_out` reads for w (its layer stack, or
  the unstacked copy as a stack of one), for a kernel that reads it in place; None where the
  forward does not stream `module.<name>`."""
  if not module.has_variable(STREAM_W, name):
    return None
  stack = module.get_variable(STREAM_W, name)
  if stack.ndim == w.ndim + 1:
    return stack, module.get_variable(STREAM_LAYER, name)
  return stack[None], jnp.int32(0)


def stream_collections(params, layers, laid=None):
  """The two collections of a streamed forward (`dense`, `laid_out`): `layers` is a subtree
  of `params`' paths whose leaves are the streamed weights' layer indices (int32 [R], or []
  for an unstacked weight); STREAM_W gets the weights at those paths: `laid`'s (the copies
  in SERVED_LAYOUTS' layouts) where it has one, else `params`' (the same arrays)."""
  def weight(path, _):
    for tree in (laid or {}, params):
      node = tree
      for p in path:
        node = node.get(p.key) if isinstance(node, dict) else None
      if node is not None:
        return node
    raise KeyError(f"stream_collections: no weight at {jax.tree_util.keystr(path)}")
  return {STREAM_W: jax.tree_util.tree_map_with_path(weight, layers), STREAM_LAYER: layers}
