"""Parameter groups: which optimizer, and which Newton–Schulz axes, each GLM-5 leaf gets.

Every leaf is classified by its path (the '/'-joined key names, e.g.
`moe_layers/layer_0/attn/wq_b`) through one rule table, `_RULES`; the first matching rule wins and
its expected rank is checked. A leaf that no rule matches, or that has an unexpected rank,
raises a ValueError naming its path: a new parameter must be given a group on purpose.

Groups (GLM-5, arXiv 2602.15763, "Muon Split"; Moonlight, Liu et al. 2025, arXiv 2502.16982):

  muon_split  the MLA up-projections W^UQ `attn/wq_b [q_lora, h, nope+rope]`,
              W^UK `attn/w_uk [kv_lora, h, nope]`, W^UV `attn/w_uv [kv_lora, h, v]`.
              Newton–Schulz runs on each head's `[rank, head_dim]` block
              (`MuonDimensionNumbers(reduction_axis=0, output_axis=-1)`: heads are batch axes),
              or on the whole `[rank, h * head_dim]` matrix when `split_heads=False`.
  muon        every other hidden matrix: `wq_a`, `wkv_a`, `wo [h, v, d]` (one matrix,
              reduction axes (h, v)), the dense and shared-expert SwiGLU matrices, the router
              kernel, the MTP `eh_proj`, the indexer's `wk`, `weights_proj` and `wq_b`
              (whole matrix: the paper splits only MLA's W^UQ/W^UK/W^UV), and the routed-expert
              stacks `[E, in, out]`, orthogonalized per expert (experts are batch axes).
  adamw       the token embedding, the output head `lm_head/kernel`, norm scales and biases, and
              `moe/router/e_score_correction_bias`. The bias is not trained by gradient (the
              training loop sets it from the measured expert load: DeepSeek-V3 §2.1.2,
              auxiliary-loss-free balancing), so
              `muon_split()` gives it a zero update; it is labelled "adamw" only so that every
              leaf sits in exactly one of the three groups.

Params are plain (unboxed) pytrees of arrays or `jax.ShapeDtypeStruct`s
(docs/design.md decision 1); a top-level `params` key is allowed.
"""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple

import jax
from optax.contrib import MuonDimensionNumbers as MDN

GROUPS = ("muon_split", "muon", "adamw")


class Rule(NamedTuple):
  """How one family of leaves is optimized.

  pattern: regex searched in the '/'-joined path.
  group: one of GROUPS.
  ndim: the expected rank.
  dims: Newton–Schulz dimension numbers (None for adamw). For muon_split, the per-head split.
  full_dims: muon_split only: the whole-matrix dimension numbers (heads and head_dim flattened
    into one output axis), used when `split_heads=False` or for the "full" RMS scale.
  fixed: the leaf gets a zero update (not trained by gradient).
  stacked: leading `layers` axes of a scanned layer stack (counted in ndim, batch axes of dims).
  """
  pattern: str
  group: str
  ndim: int
  dims: MDN | None = None
  full_dims: MDN | None = None
  fixed: bool = False
  stacked: int = 0


_ANY = r"(^|/)"  # the match starts at a path segment boundary

_RULES = (
    Rule(_ANY + r"router/e_score_correction_bias$", "adamw", 1, fixed=True),
    # MLA up-projections [rank, h, head_dim]: the GLM-5 Muon Split.
    Rule(_ANY + r"attn/(wq_b|w_uk|w_uv)$", "muon_split", 3,
         dims=MDN(reduction_axis=0, output_axis=2),
         full_dims=MDN(reduction_axis=0, output_axis=(1, 2))),
    # Output projection [h, v, d]: one [h * v, d] matrix.
    Rule(_ANY + r"attn/wo$", "muon", 3, dims=MDN(reduction_axis=(0, 1), output_axis=2)),
    # Indexer query up-projection [q_lora, hi, di]: one [q_lora, hi * di] matrix.
    Rule(_ANY + r"indexer/wq_b$", "muon", 3, dims=MDN(reduction_axis=0, output_axis=(1, 2))),
    # Routed experts [E, in, out]: experts are batch axes.
    Rule(_ANY + r"experts/(w_gate|w_up|w_down)$", "muon", 3,
         dims=MDN(reduction_axis=1, output_axis=2)),
    Rule(_ANY + r"embed/embedding$", "adamw", 2),
    Rule(_ANY + r"lm_head/kernel$", "adamw", 2),
    Rule(_ANY + r"(attn/(wq_a|wkv_a)|indexer/(wk|weights_proj)|(mlp|shared)/(w_gate|w_up|w_down)"
         r"|router/kernel|eh_proj)$", "muon", 2, dims=MDN(reduction_axis=0, output_axis=1)),
    Rule(_ANY + r"[^/]*norm/(scale|bias)$", "adamw", 1),
)


def key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey / FlattenedIndexKey
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_str(path: tuple[Any, ...]) -> str:
  """'/'-joined key names of a `jax.tree_util` key path, e.g. 'moe_layers/layer_0/attn/wq_b'."""
  return "/".join(key_name(k) for k in path)


# Scanned decoder layers (glm5_jax/nn/layer_stack.py) carry a leading `layers` axis: one more
# batch axis for Newton–Schulz, so Muon stays per layer (and per expert, and per head).
_STACKED = _ANY + r"(dense|moe)_layers/"


def shift_dims(dims: MDN | None, k: int) -> MDN | None:
  """`dims` with every axis moved by `k` (k = -1: as seen on one slice of a layer stack)."""
  if dims is None or k == 0:
    return dims
  move = lambda a: tuple(x + k for x in a) if isinstance(a, tuple) else a + k
  return MDN(reduction_axis=move(dims.reduction_axis), output_axis=move(dims.output_axis))


def _stacked(rule: Rule) -> Rule:
  return rule._replace(ndim=rule.ndim + 1, dims=shift_dims(rule.dims, 1),
                       full_dims=shift_dims(rule.full_dims, 1), stacked=rule.stacked + 1)


def classify(path: str, shape: tuple[int, ...]) -> Rule:
  """The rule for one leaf; ValueError naming the path if none matches or the rank is off."""
  for rule in _RULES:
    if re.search(rule.pattern, path):
      if re.search(_STACKED, path):
        rule = _stacked(rule)
      if len(shape) != rule.ndim:
        raise ValueError(
            f"param {path!r} has shape {tuple(shape)} (rank {len(shape)}); the "
            f"{rule.group!r} rule {rule.pattern!r} expects rank {rule.ndim}. Update "
            "glm5_jax/optim/param_groups.py:_RULES if the layout changed.")
      return rule
  hint = " (Flax-boxed params: unbox them with flax.linen.meta.unbox first)" \
      if path.endswith("/value") else ""
  raise ValueError(
      f"param {path!r} with shape {tuple(shape)} matches no optimizer group rule{hint}; add "
      "a rule to glm5_jax/optim/param_groups.py:_RULES assigning it one of " f"{GROUPS}.")


def map_rules(fn: Callable[[Rule, Any], Any], params: Any) -> Any:
  """`fn(rule, leaf)` over every leaf of `params` (MaskedNode subtrees are left alone)."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x: fn(classify(path_str(p), tuple(x.shape)), x), params)


def param_groups(params: Any) -> Any:
  """Same tree as `params`, each leaf replaced by "muon_split" | "muon" | "adamw"."""
  return map_rules(lambda r, _: r.group, params)


def muon_dim_numbers(params: Any, *, split_heads: bool = True) -> Any:
  """Same tree as `params`: the Newton–Schulz `MuonDimensionNumbers` of each leaf, or None
  for AdamW leaves. `split_heads=False` gives whole-matrix dims on the muon_split leaves."""
  def dims(rule: Rule, _):
    return rule.full_dims if (rule.group == "muon_split" and not split_heads) else rule.dims
  return map_rules(dims, params)


def fixed_mask(params: Any) -> Any:
  """True on leaves that are not trained by gradient (`e_score_correction_bias`)."""
  return map_rules(lambda r, _: r.fixed, params)


def matrix_mask(params: Any) -> Any:
  """True on matrices (rank >= 2 once a layer stack's axis is set aside): the leaves that
  take decoupled weight decay; norm scales and biases do not."""
  return map_rules(lambda r, _: r.ndim - r.stacked >= 2, params)


# Quantization targets (glm5_jax/quant.py): which leaves a target group quantizes, by path.
# The router, the embedding, the output head, norms and biases are never quantized (the
# released INT4 / FP8 checkpoints keep them in higher precision: routing decisions and the
# log-probs are the most sensitive to it).
_ATTENTION = r"attn/(wq_a|wq_b|wkv_a|w_uk|w_uv|wo)"
QUANT_TARGETS = {
    "experts": _ANY + r"experts/(w_gate|w_up|w_down)$",
    "attention": _ANY + _ATTENTION + "$",
    "all_linear": _ANY + r"(" + _ATTENTION + r"|indexer/(wq_b|wk|weights_proj)"
                  r"|(mlp|shared|experts)/(w_gate|w_up|w_down)|eh_proj)$",
}


def _as_tuple(a):
  return a if isinstance(a, tuple) else (a,)


def quant_axes(path: str, shape: tuple[int, ...]) -> tuple[int, int]:
  """(batch axes, reduction axes) of a leaf for quantization (glm5_jax/quant.py `Layout`),
  from its Newton–Schulz dims: the batch axes lead, the reduction axes follow, then the
  output axes. Muon Split's per-head leaves are quantized as the whole matrix (`full_dims`:
  heads are output axes)."""
  rule = classify(path, shape)
  ndim = len(shape)
  dims = rule.full_dims or rule.dims
  red = sorted(a % ndim for a in _as_tuple(dims.reduction_axis))
  out = sorted(a % ndim for a in _as_tuple(dims.output_axis))
  batch = ndim - len(red) - len(out)
  if red + out != list(range(batch, ndim)):
    raise AssertionError(f"{path}: reduction axes {red} and output axes {out} are not the "
                         "trailing axes in that order; quantization needs [*batch, *red, *out]")
  return batch, len(red)


def check_targets(targets: str) -> str:
  if targets not in QUANT_TARGETS:
    raise ValueError(f"quantization targets={targets!r}: expected one of "
                     f"{tuple(QUANT_TARGETS)}")
  return targets


def is_quant_target(path: str, targets: str, keep=()) -> bool:
  """Whether `targets` quantizes the leaf at `path` (not if a key in `keep` is on it)."""
  return (re.search(QUANT_TARGETS[check_targets(targets)], path) is not None
          and not set(keep) & set(path.split("/")))


def path_mask(*names: str, invert: bool = False) -> Callable[[Any], Any]:
  """A mask function: True on leaves whose path contains one of the key `names`.

  Use it for the `frozen` option of `muon_split`:
    dsa_warmup (only the indexer trains): `frozen=path_mask("indexer", invert=True)`
    rl (the indexer is frozen, docs/design.md decision 16): `frozen=path_mask("indexer")`
  """
  if not names:
    raise ValueError("path_mask(*names): expected at least one key name, got none")
  wanted = frozenset(names)

  def mask(params):
    def hit(path, _):
      return bool(wanted & {key_name(k) for k in path}) != invert
    return jax.tree_util.tree_map_with_path(hit, params)
  return mask
