"""Muon Split: the GLM-5 optimizer, as one optax GradientTransformation.

GLM-5 (arXiv 2602.15763, "Muon Split") trains with Muon, but
orthogonalizes MLA's up-projections W^UQ, W^UK, W^UV per attention head: plain whole-matrix
Muon on them underperformed GQA-8, the per-head split matched it. Here that is a choice of
`MuonDimensionNumbers(reduction_axis=0, output_axis=-1)` on the head-major weights
`[rank, h, head_dim]` (MLA weights stored per head, glm5_jax/nn/mla.py): heads are batch
axes of optax's Newton–Schulz, orthogonalized independently.

What goes where (`param_groups.py` has the rule table):
  muon_split  W^UQ `wq_b`, W^UK `w_uk`, W^UV `w_uv`: per-head Newton–Schulz.
  muon        every other hidden matrix, routed experts per expert.
  adamw       token embedding, output head, norm scales and biases. This is the Muon recipe of
              Keller Jordan (modded-nanogpt) and Moonlight (Liu et al. 2025, arXiv 2502.16982,
              and its released code): Muon is steepest descent for matrices that map hidden
              states to hidden states; the embedding is a lookup table (one row per token, no
              matrix geometry), the output head's rows are per-token logits, and vectors are not
              matrices. GLM-4.5 (arXiv 2508.06471, which GLM-5 continues) reports Muon for all
              parameters except the word embedding, biases and RMSNorm weights; we also keep
              the untied output head on AdamW as Moonlight does.
  (fixed)     `e_score_correction_bias` is set by the training loop from expert load, never
              by gradient: it gets a zero update (labelled "adamw" in `param_groups`).

Update per Muon leaf (`scale_by_muon` below: optax.contrib.scale_by_muon's momentum and
Newton–Schulz, with layer stacks walked one layer at a time; then ours):
  m_t = β m_{t-1} + (1-β) g_t (bias-corrected; Nesterov: β m̂_t + (1-β) ĝ_t)
  O_t = NS5(m_t) per block      (quintic Newton–Schulz, coefficients 3.4445, -4.7750, 2.0315)
  W  ← W - lr_t (s · O_t + wd · W),  s = c · sqrt(max(fan_in, fan_out))   (Moonlight's
                                     "consistent RMS": update RMS ≈ c = 0.2, like AdamW's)
`rms_shape` picks the (fan_in, fan_out) used for s on the muon_split leaves: "per_head"
(`[rank, head_dim]`, so every block's update RMS is ≈ c, as Moonlight intends) or "full"
(`[rank, h * head_dim]`, the scale whole-matrix Muon would use: sqrt(h) times larger when
h * head_dim > rank). The paper does not say which; the default is "per_head".
With `consistent_rms=None` the scale is Keller Jordan's `sqrt(max(1, fan_out / fan_in))`.
AdamW leaves: decoupled weight decay only on matrices (embedding, output head), not on norm
scales or biases. Frozen leaves (`frozen` mask) and fixed leaves get exactly zero updates and
hold no optimizer state.

Layer stacks: a scanned stack's leading `layers` axis is a batch axis of Newton–Schulz, but
optax flattens all batch axes into one before it vmaps, which merges the unsharded `layers`
axis with an `expert`- or head-sharded one: XLA then gathers the whole stack (at GLM-5's
shapes, 577 GiB of temporaries for one `[75, 256, 6144, 2048]` expert weight, against 1 GiB
one layer at a time; docs/long_context.md). `scale_by_muon` therefore runs Newton–Schulz
under `lax.map` over the stack axes, one layer's blocks at a time; the result is the same.

Sharding: the state mirrors the params (`state_shardings`). With heads sharded over a mesh
axis, per-head Newton–Schulz is shard-local: the compiled update of a head-sharded `wq_b` holds
no collective (checked in tests/optim/test_muon_split.py), and neither does per-expert NS on
expert-sharded experts. Whole-matrix NS on the same weights all-reduces X·Xᵀ over the head axis
at every NS step (6 all-reduces: 5 steps + the Frobenius norm), as does any NS whose fan-in is
sharded (e.g. FSDP on `q_lora`): that is `distribution="replicated"`. With
`distribution="owner"` and the parameters' shardings, such blocks are instead dealt to owner
devices by one all-to-all per shape bucket, orthogonalized whole there and sent back
(`muon_owner.py`; docs/muon_distributed.md); shard-local blocks stay where they are. Use GSPMD
("Auto") mesh axes: under Explicit axes, optax's reshape of a sharded `wo [h, v, d]` into one
matrix needs an out_sharding it does not give.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers as MDN
from optax.contrib import MuonState
# The Newton–Schulz iteration itself is optax's (not re-exported from optax.contrib).
from optax.contrib._muon import orthogonalize_via_newton_schulz

from glm5_jax.optim import muon_owner
from glm5_jax.optim import param_groups as pg

_RMS_SHAPES = ("per_head", "full")
DISTRIBUTIONS = ("replicated", "owner")
_NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic; optax's default

Mask = Any  # a pytree of bools (or a prefix of params), or a callable params -> such a tree


def _scale(shape: tuple[int, ...], dims: MDN, consistent_rms: float | None) -> float:
  """Moonlight's c·sqrt(max(fan_in, fan_out)), or Keller Jordan's sqrt(max(1, out/in)).

  fan_in / fan_out are the products of the reduction / output axes of one block (batch axes,
  i.e. heads or experts, excluded), as in optax.contrib._muon._get_shape_products.
  """
  axes = lambda a: (a,) if isinstance(a, int) else tuple(a)
  fan_in = math.prod(shape[a] for a in axes(dims.reduction_axis))
  fan_out = math.prod(shape[a] for a in axes(dims.output_axis))
  if consistent_rms is None:
    return math.sqrt(max(1.0, fan_out / fan_in))
  return consistent_rms * math.sqrt(max(fan_in, fan_out))


def scale_by_muon(*, ns_coeffs, ns_steps: int, beta: float, eps: float, mu_dtype: Any,
                  nesterov: bool, dims_fn: Callable[[Any], Any],
                  shardings: dict[str, Any] | None = None) -> optax.GradientTransformation:
  """optax.contrib.scale_by_muon (same state, same update) with per-layer Newton–Schulz.

  `dims_fn(updates)` gives each leaf's `pg.Rule`; its `dims` (with the stack axes) are what
  optax would get, its `stacked` leading axes are walked with `lax.map`. `shardings`
  ('/'-joined leaf path -> the parameter's sharding): owner-computes Newton–Schulz
  (`muon_owner.py`) on the leaves whose blocks are sharded; None: replicated (GSPMD).
  """
  coeffs = jnp.asarray(ns_coeffs)

  def init_fn(params):
    return MuonState(count=jnp.zeros([], jnp.int32),
                     mu=optax.tree.zeros_like(params, dtype=mu_dtype), ns_coeffs=coeffs)

  def orthogonalize(x, dims: MDN, stacked: int):
    if stacked == 0:
      return orthogonalize_via_newton_schulz(x, coeffs.astype(x.dtype), ns_steps,
                                             "frobenius", eps, dims)
    inner = pg.shift_dims(dims, -1)
    return jax.lax.map(lambda x_l: orthogonalize(x_l, inner, stacked - 1), x)

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    if nesterov:
      mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                            optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                            optax.tree.bias_correction(updates, beta, count))
    else:
      mu_hat = optax.tree.bias_correction(mu, beta, count)
    is_rule = lambda r: isinstance(r, pg.Rule)
    rules = jax.tree.leaves(dims_fn(mu_hat), is_leaf=is_rule)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(mu_hat)
    leaves = [x for _, x in with_path]
    local = lambda i: orthogonalize(leaves[i], rules[i].dims, rules[i].stacked)
    if shardings is None:
      out = [local(i) for i in range(len(leaves))]
    else:
      ns_2d = lambda x: orthogonalize_via_newton_schulz(x, coeffs.astype(x.dtype), ns_steps,
                                                        "frobenius", eps)
      out = muon_owner.orthogonalize(
          leaves, [r.dims for r in rules], [shardings.get(pg.path_str(p)) for p, _ in with_path],
          [r.stacked for r in rules], ns_2d, local)
    return (jax.tree.unflatten(treedef, out),
            MuonState(count=count, mu=optax.tree.cast(mu, mu_dtype), ns_coeffs=state.ns_coeffs))
  return optax.GradientTransformation(init_fn, update_fn)


def _rules_fn(which: str) -> Callable[[Any], Any]:
  """Each leaf's `pg.Rule`, with `dims` replaced by the whole-matrix dims when `which` is
  'full' (muon_split leaves); MaskedNode subtrees (other groups) are kept as they are."""
  return lambda tree: pg.map_rules(
      lambda r, _: r._replace(dims=r.full_dims) if (which == "full" and r.full_dims) else r,
      tree)


def _dims_fn(which: str) -> Callable[[Any], Any]:
  """Dimension numbers of a (masked) update tree; `which` in {'split', 'full'} picks the
  muon_split leaves' dims. MaskedNode subtrees (other groups) are kept as they are."""
  return lambda tree: pg.map_rules(
      lambda r, _: r.full_dims if (which == "full" and r.full_dims) else r.dims, tree)


def scale_by_shape(dims_fn: Callable[[Any], Any],
                   consistent_rms: float | None) -> optax.GradientTransformation:
  """Multiplies each leaf by `_scale(shape, dims)`; `dims_fn(updates)` gives the dims tree."""
  def update_fn(updates, state, params=None):
    del params
    scaled = jax.tree.map(lambda u, d: u * _scale(u.shape, d, consistent_rms),
                          updates, dims_fn(updates))
    return scaled, state
  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _broadcast_mask(mask: Mask | None, tree: Any) -> Any:
  """A bool tree shaped like `tree` from a mask tree, a prefix of it, a callable, or None."""
  if mask is None:
    return jax.tree.map(lambda _: False, tree)
  if callable(mask):
    mask = mask(tree)
  return jax.tree.map(lambda m, sub: jax.tree.map(lambda _: bool(m), sub), mask, tree)


def _check(name: str, value: Any, ok: bool, expected: str) -> None:
  if not ok:
    raise ValueError(f"muon_split({name}={value!r}): expected {expected}")


def muon_split(
    *,
    learning_rate: optax.ScalarOrSchedule = 2e-3,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    weight_decay: float = 0.1,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coeffs: tuple[float, float, float] = _NS_COEFFS,
    consistent_rms: float | None = 0.2,
    rms_shape: str = "per_head",
    split_heads: bool = True,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    eps: float = 1e-8,
    frozen: Mask | None = None,
    mu_dtype: Any = None,
    distribution: str = "replicated",
    param_shardings: Any = None,
) -> optax.GradientTransformation:
  """The GLM-5 optimizer: Muon Split + Muon + AdamW over one GLM-5 parameter tree.

  Args:
    learning_rate: float or optax schedule, shared by all groups (with consistent RMS, Muon
      and AdamW updates have the same RMS, so one learning rate serves both, as in Moonlight).
    adam_learning_rate: a separate float or schedule for the AdamW group; None = learning_rate.
    weight_decay: decoupled weight decay λ (W ← W - lr·λ·W) on Muon leaves and AdamW matrices.
    beta: Muon momentum.
    nesterov: Nesterov momentum for Muon.
    ns_steps, ns_coeffs: Newton–Schulz iterations and quintic coefficients.
    consistent_rms: c in the update scale c·sqrt(max(fan_in, fan_out)); None = Keller Jordan's
      sqrt(max(1, fan_out/fan_in)).
    rms_shape: "per_head" | "full": the shape the scale is computed on for muon_split leaves.
    split_heads: True = Muon Split (per-head Newton–Schulz on W^UQ/W^UK/W^UV); False =
      whole-matrix Muon on the same weights (the ablation baseline).
    adam_b1, adam_b2, eps: AdamW moments and epsilon (eps is also Muon's NS epsilon).
    frozen: True on leaves that must not change (no update, no weight decay, no state): a bool
      tree, a prefix of params, or a callable params -> bool tree (see `path_mask`).
    mu_dtype: dtype of the momentum buffers (None = the params' dtype).
    distribution: where Newton–Schulz runs under a mesh. "replicated": on the sharded leaves
      as they are (GSPMD: every device of a block works on it, all-reducing Gram products);
      "owner": each block is orthogonalized whole by one owner device, reached and left by
      one all-to-all per shape bucket (`muon_owner.py`). Same state, same update up to float
      rounding; a run may switch between them at a resume.
    param_shardings: the parameters' shardings (a tree like params), which "owner" needs;
      without them (or on one device) every block is local and "owner" is "replicated".

  Returns:
    An optax GradientTransformation; `update` needs `params` (weight decay).
  """
  _check("rms_shape", rms_shape, rms_shape in _RMS_SHAPES, f"one of {_RMS_SHAPES}")
  _check("consistent_rms", consistent_rms, consistent_rms is None or consistent_rms > 0,
         "None or a positive float (Moonlight: 0.2)")
  _check("weight_decay", weight_decay, weight_decay >= 0, "a float >= 0")
  _check("beta", beta, 0 <= beta < 1, "a float in [0, 1)")
  _check("ns_steps", ns_steps, isinstance(ns_steps, int) and ns_steps >= 1, "an int >= 1")
  _check("adam_b1", adam_b1, 0 <= adam_b1 < 1, "a float in [0, 1)")
  _check("adam_b2", adam_b2, 0 <= adam_b2 < 1, "a float in [0, 1)")
  _check("distribution", distribution, distribution in DISTRIBUTIONS,
         f"one of {DISTRIBUTIONS}")
  if adam_learning_rate is None:
    adam_learning_rate = learning_rate
  shardings = None
  if distribution == "owner" and param_shardings is not None:
    is_sh = lambda x: isinstance(x, jax.sharding.Sharding)
    shardings = {pg.path_str(p): sh for p, sh in
                 jax.tree_util.tree_flatten_with_path(param_shardings, is_leaf=is_sh)[0]}

  def muon_chain(ns_dims: str, scale_dims: str) -> optax.GradientTransformation:
    return optax.chain(
        scale_by_muon(ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=beta, eps=eps,
                      mu_dtype=mu_dtype, nesterov=nesterov, dims_fn=_rules_fn(ns_dims),
                      shardings=shardings),
        scale_by_shape(_dims_fn(scale_dims), consistent_rms),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )

  adamw = optax.chain(
      optax.scale_by_adam(b1=adam_b1, b2=adam_b2, eps=eps, mu_dtype=mu_dtype),
      optax.add_decayed_weights(weight_decay, mask=pg.matrix_mask),
      optax.scale_by_learning_rate(adam_learning_rate),
  )
  transforms = {
      "muon_split": muon_chain("split" if split_heads else "full",
                               "split" if rms_shape == "per_head" else "full"),
      "muon": muon_chain("split", "split"),
      "adamw": adamw,
      "frozen": optax.set_to_zero(),
  }

  def labels(tree):
    groups = pg.param_groups(tree)
    still = jax.tree.map(lambda a, b: a or b, pg.fixed_mask(tree), _broadcast_mask(frozen, tree))
    return jax.tree.map(lambda g, s: "frozen" if s else g, groups, still)

  return optax.partition(transforms, labels)


def reset(tx: optax.GradientTransformation, opt_state: Any, params: Any, *,
          keep_schedule: bool = False) -> Any:
  """A fresh `tx.init(params)`, checked against and placed like `opt_state`.

  For the asynchronous RL loop, which resets the optimizer state after each weight push
  (GLM-5 paper §3, "Agentic RL"; slime's `--reset-optimizer-states`). Moments
  and step counts (hence Adam's and Muon's bias corrections) restart. The learning-rate
  schedule's position restarts too unless `keep_schedule=True`, which carries every
  `ScaleByScheduleState` count over. Concrete leaves keep `opt_state`'s shardings, so a jitted
  step does not recompile; under `jax.jit` the caller's out_shardings apply.
  """
  fresh = tx.init(params)
  want, got = jax.tree.structure(fresh), jax.tree.structure(opt_state)
  if want != got:
    raise ValueError(f"reset(opt_state=...): the state's tree structure {got} is not that of "
                     f"tx.init(params) {want}: was it made by another optimizer?")
  if keep_schedule:
    is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
    fresh = jax.tree.map(lambda new, old: old if is_sched(new) else new, fresh, opt_state,
                         is_leaf=is_sched)

  def place(new, old):
    if isinstance(old, jax.Array) and not isinstance(old, jax.core.Tracer):
      return jax.device_put(new, old.sharding)
    return new
  return jax.tree.map(place, fresh, opt_state)


def group_norms(tree: Any, params: Any, prefix: str = "update") -> dict[str, jax.Array]:
  """`{prefix}_norm/{group}` and `{prefix}_rms/{group}` of `tree` (same structure as params)
  for each of GROUPS that has leaves, plus the totals `{prefix}_norm` and `{prefix}_rms`."""
  groups = jax.tree.leaves(pg.param_groups(params))
  leaves = jax.tree.leaves(tree)
  if len(groups) != len(leaves):
    raise ValueError(f"group_norms: tree has {len(leaves)} leaves, params {len(groups)}")
  out = {}
  for name in pg.GROUPS + (None,):
    sel = [x for x, g in zip(leaves, groups) if name is None or g == name]
    if not sel:
      continue
    sumsq = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in sel)
    size = sum(x.size for x in sel)
    key = "" if name is None else f"/{name}"
    out[f"{prefix}_norm{key}"] = jnp.sqrt(sumsq)
    out[f"{prefix}_rms{key}"] = jnp.sqrt(sumsq / size)
  return out


def update_metrics(updates: Any, params: Any) -> dict[str, jax.Array]:
  """Scalars a training loop can log: update RMS and norm, parameter norm, and their ratio,
  per group and in total. Jit-able; frozen leaves count with their zero update."""
  m = {**group_norms(updates, params, "update"), **group_norms(params, params, "param")}
  for key in [k for k in m if k.startswith("update_norm")]:
    suffix = key[len("update_norm"):]
    m[f"update_to_param{suffix}"] = m[key] / (m[f"param_norm{suffix}"] + 1e-12)
  return m


def state_shardings(opt_state: Any, params: Any, param_shardings: Any, default: Any) -> Any:
  """Shardings for an optimizer state, mirroring the parameters' shardings.

  A state leaf whose key path ends with a parameter's key path and has its shape (Muon and
  Adam moments) gets that parameter's sharding; every other leaf (step counts, NS
  coefficients) gets `default` (e.g. a replicated NamedSharding). `opt_state` may be
  `jax.eval_shape(tx.init, params)`, so the state is never built unsharded:
    `jax.jit(tx.init, out_shardings=state_shardings(...))(params)`.
  """
  by_path = {}
  for (path, p), s in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                          jax.tree.leaves(param_shardings)):
    by_path[tuple(map(pg.key_name, path))] = (tuple(p.shape), s)

  def pick(path, leaf):
    names = tuple(map(pg.key_name, path))
    for start in range(len(names)):
      hit = by_path.get(names[start:])
      if hit is not None and hit[0] == tuple(leaf.shape):
        return hit[1]
    return default
  return jax.tree_util.tree_map_with_path(pick, opt_state)
