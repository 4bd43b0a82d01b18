"""The engine's serving precision: weights in bfloat16, FP8 or INT4, and the KV cache's dtype.

GLM-5 runs its RL rollouts in FP8 while the trainer stays in higher precision (paper §3); the
gap this opens between the rollout's and the trainer's log-probs is what IcePop and the
double-sided importance weights absorb, and every RL metric stream measures it. The engine
takes float parameters (a trainer's, a checkpoint's) and serves them as:

  weight_dtype     what is served                                     default targets, block
  float32          the parameters as they are (the trainer's own arrays, bitwise)
  bfloat16         every float leaf cast (the router and its bias stay float32)
  float8_e4m3fn    the targeted matrices FP8 with b x b block scales  all_linear, 128 (GLM-5
                                                                       shapes; 32 on tiny)
  int4             the targeted matrices INT4 with per-group scales   experts, 32

(glm5_jax/quant.py; targets by path rules in optim/param_groups.py). `keep_indexer` leaves
the lightning indexer's weights at the trainer's precision, so that the DSA top-k of the
rollout sees the trainer's indexer (the indexer's inputs still carry the rest's gap).
Parameters that already hold quantized weights (an INT4 checkpoint loaded packed) are
served as they are.

The KV cache (nn/kv_cache.py) holds the latent rows in `kv_dtype`: float32 (default),
bfloat16 or float8_e4m3fn. FP8 is a plain cast of the RMS-normalized latent and the RoPE key
(clipped to +-448), without scales, as vLLM's fp8 KV cache does by default; the indexer keys
stay float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_jax import quant

WEIGHT_DTYPES = quant.WEIGHT_DTYPES
KV_DTYPES = ("float32", "bfloat16", "float8_e4m3fn")
DEFAULT_TARGETS = {"float8_e4m3fn": "all_linear", "int4": "experts"}
DEFAULT_BLOCK = {"float8_e4m3fn": 128, "int4": 32}


def scheme_for(weight_dtype: str, targets: str | None = None, block: int | None = None,
               keep_indexer: bool = False) -> quant.Scheme | None:
  """The `quant.Scheme` a quantized `weight_dtype` serves with (None for float dtypes)."""
  if weight_dtype not in WEIGHT_DTYPES:
    raise ValueError(f"Engine weight_dtype={weight_dtype!r}: expected one of {WEIGHT_DTYPES}")
  if weight_dtype not in quant.FORMATS:
    if targets is not None or block is not None or keep_indexer:
      raise ValueError(f"Engine weight_dtype={weight_dtype!r} quantizes nothing; "
                       "quant_targets, quant_block and keep_indexer are for "
                       f"{quant.FORMATS}")
    return None
  return quant.Scheme(weight_dtype, DEFAULT_BLOCK[weight_dtype] if block is None else block,
                      DEFAULT_TARGETS[weight_dtype] if targets is None else targets,
                      ("indexer",) if keep_indexer else ())


INDEXER_DTYPES = ("same", "float32")


def engine_kwargs(r) -> dict:
  """The Engine's precision arguments from an RL config section's rollout fields
  (`rollout_weight_dtype`, `rollout_kv_dtype`, `rollout_quant_targets` ("" = the format's
  default), `rollout_quant_block` (0 = the default), `rollout_indexer_dtype` ("same" or
  "float32": the indexer's weights at the trainer's precision)); `r`: a ConfigDict or dict."""
  kw = {"weight_dtype": r["rollout_weight_dtype"], "kv_dtype": r["rollout_kv_dtype"]}
  if kw["weight_dtype"] in quant.FORMATS:
    kw.update(quant_targets=r["rollout_quant_targets"] or None,
              quant_block=r["rollout_quant_block"] or None,
              keep_indexer=r["rollout_indexer_dtype"] == "float32")
  return kw


def check_kv_dtype(kv_dtype: str) -> str:
  if kv_dtype not in KV_DTYPES:
    raise ValueError(f"Engine kv_dtype={kv_dtype!r}: expected one of {KV_DTYPES}")
  return kv_dtype


def convert(params, weight_dtype: str, scheme: quant.Scheme | None):
  """The parameters as the engine serves them (module docstring's table)."""
  if weight_dtype == "bfloat16":
    return quant.cast_floats(params, jnp.bfloat16)
  if scheme is not None:
    return quant.quantize_tree(params, scheme)
  return params


def converted_shardings(shapes, float_shardings):
  """Shardings of a converted tree from the float tree's: a QArray's values and scales keep
  its batch axes' sharding (layers, experts); its flattened matrix axes are replicated."""
  def one(x, sh):
    if not quant.is_qarray(x):
      return sh
    if not isinstance(sh, NamedSharding):
      return x.replace(values=sh, scales=sh)
    spec = tuple(sh.spec) + (None,) * (len(x.shape) - len(sh.spec))
    nb = len(x.batch_shape)
    qs = NamedSharding(sh.mesh, P(*spec[:nb], None, None))
    return x.replace(values=qs, scales=qs)
  return jax.tree.map(one, shapes, float_shardings, is_leaf=quant.is_qarray)
