"""Where the engine's arrays live, and the checks of a parameter tree before it is served.

The served parameters (`Served`) take the model's shardings on the engine's mesh (its
logical-axis rules) or the first device; the cache pool and the per-slot rows split over the mesh's
batch axes. `place` commits a tree into its shardings without copying leaves already there
(a colocated trainer's arrays), freeing the engine's own copies of the previous version
leaf by leaf. `tree_diff` and `check_finite` name the first leaf of a tree that the engine
cannot serve.
"""

from __future__ import annotations

import collections
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from glm5_jax import nn as gnn
from glm5_jax import sharding as shd
from glm5_jax import stream_matmul
from glm5_jax.inference import matvec
from glm5_jax.inference import precision
from glm5_jax.inference import steps
from glm5_jax.nn import layer_stack
from glm5_jax.nn import params as params_lib

# A smaller weight (per layer) keeps XLA's matmul. XLA:CPU multiplied `small`'s 64 KB
# matrices (the router, the indexer's keys) at 16 rows in 9-40 us a layer.
STREAM_MIN_BYTES = 64 * 1024
HEAD_STREAM_MIN_BYTES = 128 * 1024   # the lm_head's (`tiny`'s, 96 KB, keeps XLA's)


def serving_shardings(cfg, mesh, rules=None):
  """The engine's parameter shardings on `mesh` (the model's logical-axis `rules`, default
  sharding.DEFAULT_RULES); a mesh of None: the first device."""
  shapes, specs = gnn.abstract_params(cfg)
  if mesh is None:
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: dev, shapes)
  param_sh = shd.param_shardings(specs, mesh, shd.rules_from_config(rules))
  shd.check_divisible(shapes, param_sh, mesh)
  return param_sh


def serving_template(cfg, mesh, rules=None):
  """Shapes, dtypes and serving shardings of the engine's parameters, as
  `jax.ShapeDtypeStruct`s: a weight store's `latest(template)` reads each process's slices
  straight into them (rl/orchestration/snapshots.py)."""
  shapes, _ = gnn.abstract_params(cfg)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shapes, serving_shardings(cfg, mesh, rules))


def mesh_scope(mesh):
  return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def shardings(cfg, mesh, rules, served):
  """{"params": shardings of the served tree (`served`: its shapes), "rows": of per-slot rows,
  "cache": pool -> its shardings}: one placement, so nothing recompiles."""
  if mesh is None:
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return {"params": jax.tree.map(lambda _: dev, served), "rows": dev,
            "cache": lambda c: jax.tree.map(lambda _: dev, c)}
  param_sh = precision.converted_shardings(served, serving_shardings(cfg, mesh, rules))
  axes = tuple(a for a in shd.BATCH_AXES if mesh.shape.get(a, 1) > 1) or None
  rows = NamedSharding(mesh, P(axes))
  pool = lambda x: NamedSharding(mesh, P(*([None] * (x.ndim - 2)), axes, None))
  return {"params": param_sh, "rows": rows, "cache": lambda c: jax.tree.map(pool, c)}


def head_blocks(cfg, served, mesh):
  """The k-blocks (inference/matvec.py) at which the engine serves a copy of its lm_head for
  one-row steps, or None: on one CPU device with a float32 head of at least
  `matvec.MIN_BYTES` and float32 activations, when `matvec.k_blocks` finds them for the
  head's shape. `served`: the served tree's shapes."""
  kernel = served["lm_head"]["kernel"]
  if (mesh is not None or jax.devices()[0].platform != "cpu" or kernel.dtype != jnp.float32
      or jnp.dtype(cfg.dtype) != jnp.float32 or kernel.size * 4 < matvec.MIN_BYTES):
    return None
  return matvec.k_blocks(*kernel.shape)


def stream_plan(cfg, served, mesh):
  """{path: layer indices} of the weights the engine streams (glm5_jax/stream_matmul.py), or
  None: on one CPU device with float32 activations and the kernel built, the float32
  matrices that the decoder stacks, the MTP layer and the lm_head multiply through
  `nn.params.dense` and the routed experts (`ffn.looped_swiglu`), of at least
  STREAM_MIN_BYTES per layer (per expert; the lm_head HEAD_STREAM_MIN_BYTES), whose block
  size `stream_matmul.kc` finds; and those of that size that `nn.params.SERVED_LAYOUTS`
  lists (served laid out for their products, `laid_out_copies`). The leaves are int32 [R]
  (a stack's layers) or int32 [] (the MTP layer, the lm_head): the served tree's
  `steps.STREAM_KEY` entry. `served`: the served tree's shapes."""
  if (mesh is not None or jax.devices()[0].platform != "cpu"
      or jnp.dtype(cfg.dtype) != jnp.float32 or not stream_matmul.available()):
    return None
  plan = {}                                  # flat: path (keys) -> layer indices
  roots = layer_stack.STACK_NAMES + ("mtp",)
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      {k: v for k, v in served.items() if k in roots}):
    keys = tuple(str(getattr(p, "key", p)) for p in path)
    n = params_lib.DENSE_WEIGHTS.get(keys[-1])
    laid = keys[-1] in params_lib.SERVED_LAYOUTS      # served laid out, not multiplied
    stacked = keys[0] != "mtp"
    shape = leaf.shape[1:] if stacked else leaf.shape
    if "experts" in keys:                  # [E, K, N]: each expert's matrix (nn/ffn.py)
      shape, n = shape[1:], 1
    if ((n is None and not laid) or leaf.dtype != jnp.float32
        or np.prod(shape) * 4 < STREAM_MIN_BYTES):
      continue
    if not laid:
      k = int(np.prod(shape[:n]))
      if stream_matmul.kc(k, int(np.prod(shape)) // k) is None:
        continue
    plan[keys] = (np.arange(leaf.shape[0], dtype=np.int32) if stacked
                  else np.zeros((), np.int32))
  head = served["lm_head"]["kernel"]
  if (head.dtype == jnp.float32 and head.size * 4 >= HEAD_STREAM_MIN_BYTES
      and stream_matmul.kc(*head.shape) is not None):
    plan["lm_head", "kernel"] = np.zeros((), np.int32)
  return traverse_util.unflatten_dict(plan) if plan else None


def laid_out_copies(plan, params):
  """The copies of the planned weights that nn.params.SERVED_LAYOUTS lists, in its layouts
  (a stack's layer axis first): the served tree's `steps.LAYOUT_KEY` entry."""
  weights = traverse_util.flatten_dict(params)
  def copy(keys, layers):
    axes = params_lib.SERVED_LAYOUTS[keys[-1]]
    return jnp.transpose(weights[keys], (0, *(a + 1 for a in axes)) if np.ndim(layers) else axes)
  return traverse_util.unflatten_dict({
      keys: copy(keys, layers) for keys, layers in traverse_util.flatten_dict(plan).items()
      if keys[-1] in params_lib.SERVED_LAYOUTS})


class Served:
  """The parameters an engine serves: converted (precision.py: `weight_dtype`, `scheme`) on
  the devices and committed to their shardings (`place`); `params` holds them. With
  `matvec_head` (and `head_blocks` found), they also hold the lm_head's kernel split at its
  k-blocks (`matvec.HEAD_KEY`): one more copy of the head, for one-row decode steps. With
  `stream` (and `stream_plan` found), they hold the streamed weights' layer indices
  (`steps.STREAM_KEY`), which make the steps multiply those weights with
  glm5_jax/stream_matmul.py, and copies of MLA's `w_uk` / `w_uv` in the layout their
  products read (`steps.LAYOUT_KEY`, `laid_out_copies`: +3.7 MB for `small`)."""

  def __init__(self, cfg, params, mesh, rules, weight_dtype: str = "float32", scheme=None,
               matvec_head: bool = False, stream: bool = False):
    self.template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    self.mesh = mesh
    self._identity = weight_dtype == "float32" and scheme is None
    convert = lambda p: precision.convert(p, weight_dtype, scheme)
    served = jax.eval_shape(convert, self.template)
    self.head_blocks = head_blocks(cfg, served, mesh) if matvec_head else None
    if self.head_blocks is not None:
      self._split = jax.jit(functools.partial(matvec.split, bounds=self.head_blocks))
      served = {**served, matvec.HEAD_KEY: jax.eval_shape(
          self._split, served["lm_head"]["kernel"])}
    self.stream_plan = stream_plan(cfg, served, mesh) if stream else None
    if self.stream_plan is not None:
      self._lay_out = jax.jit(functools.partial(laid_out_copies, self.stream_plan))
      served = {**served, steps.STREAM_KEY: jax.eval_shape(lambda: self.stream_plan),
                steps.LAYOUT_KEY: jax.eval_shape(self._lay_out, served)}
    self.shardings = shardings(cfg, mesh, rules, served)
    converted_sh = {k: v for k, v in self.shardings["params"].items()
                    if k not in (matvec.HEAD_KEY, steps.STREAM_KEY, steps.LAYOUT_KEY)}
    self._convert = jax.jit(convert, out_shardings=converted_sh)
    self.params, self._owned = place(self._converted(params), self.shardings["params"])

  def _converted(self, params):
    """The parameters as served, computed on the devices into their shardings (the given
    arrays when nothing is converted: float32), with the head's k-blocks when served."""
    if not self._identity:
      with mesh_scope(self.mesh):
        params = self._convert(params)
    if self.head_blocks is not None:
      params = {**params, matvec.HEAD_KEY: self._split(params["lm_head"]["kernel"])}
    if self.stream_plan is not None:
      params = {**params, steps.STREAM_KEY: self.stream_plan,
                steps.LAYOUT_KEY: self._lay_out(params)}
    return params

  def update(self, params) -> None:
    """Serves `params` instead (same tree, shapes and dtypes, every float finite); a
    ValueError names the first leaf that differs or holds a NaN or inf, before anything
    changes."""
    diff = tree_diff(params, self.template)
    if diff is not None:
      raise ValueError(f"update_params: the parameter tree differs from the engine's (a "
                       f"different config?): {diff}")
    check_finite(params, "update_params")
    self.params, self._owned = place(self._converted(params), self.shardings["params"],
                                     self.params, self._owned)


def place(params, param_shardings, old=None, owned=None):
  """Commits `params` to `param_shardings`, leaf by leaf. Returns (placed tree, owned: per
  leaf, whether it is a copy of the engine's own).

  A leaf already in its sharding is served as it is (a trainer's own arrays: colocated, no
  copy); any other is copied device to device (a replica on other devices). With the
  previous version (`old`, its `owned`), each copied leaf of it is freed once its new value
  is in place, so a swap needs at most one leaf of memory beyond the parameters.
  """
  new, now_owned = [], []
  old = jax.tree_util.tree_leaves(old) if owned is not None else None
  flat_sh = jax.tree_util.tree_leaves(param_shardings,
                                      is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  for i, (x, sh) in enumerate(zip(jax.tree_util.tree_leaves(params), flat_sh)):
    y = jax.device_put(x, sh)
    if owned is not None and owned[i] and old[i] is not y:
      old[i].delete()                             # a copy of the previous version
    new.append(y)
    # Already in place, device_put aliases x's buffers (a new Array object sharing them):
    # only a leaf whose sharding changed is a copy of the engine's own.
    now_owned.append(not (isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sh, x.ndim)))
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), new), now_owned


def tree_diff(got, want) -> str | None:
  """The first difference of tree `got` from `want`, naming its path (keystr): a missing or
  extra leaf, then a shape or dtype; None if they agree."""
  got_flat, got_def = jax.tree_util.tree_flatten_with_path(got)
  want_flat, want_def = jax.tree_util.tree_flatten_with_path(want)
  got_at = {jax.tree_util.keystr(k): x for k, x in got_flat}
  want_at = {jax.tree_util.keystr(k): x for k, x in want_flat}
  missing = [k for k in want_at if k not in got_at]
  extra = [k for k in got_at if k not in want_at]
  if missing or extra:
    return "; ".join(
        f"{what} {ks[0]}" + (f" (and {len(ks) - 1} more)" if len(ks) > 1 else "")
        for what, ks in (("missing", missing), ("unexpected", extra)) if ks)
  if got_def != want_def:                    # same paths, other node types (e.g. a tuple)
    return f"tree structure {got_def} differs from {want_def}"
  for k, x in got_at.items():
    a, b = _shape_dtype(x), _shape_dtype(want_at[k])
    if a != b:
      return f"{k} is {a[1]}{list(a[0])}, expected {b[1]}{list(b[0])}"
  return None


def _shape_dtype(x):
  return np.shape(x), (x.dtype if hasattr(x, "dtype") else np.result_type(x))


@functools.lru_cache(maxsize=16)
def _finite_fns(out_sharding):
  """jitted (leaves -> bool[n] all finite per leaf, leaf -> its non-finite count)."""
  def count(x):
    bad = ~jnp.isfinite(x)
    if x.size < 2**31:
      return jnp.sum(bad, dtype=jnp.int32)
    return jnp.sum(jnp.sum(bad, axis=-1, dtype=jnp.int32), dtype=jnp.float32)  # 2**31+ values
  kw = {} if out_sharding is None else {"out_shardings": out_sharding}
  return (jax.jit(lambda xs: jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]), **kw),
          jax.jit(count, **kw))


def _devices(x):
  """Host arrays: None; a jax.Array: the ordered devices one jitted call over it runs on."""
  return x.sharding._device_assignment if isinstance(x, jax.Array) else None  # pylint: disable=protected-access


def check_finite(params, what: str) -> None:
  """Raises ValueError naming the first leaf (keystr) of `params` holding a NaN or inf, and
  how many. Integer leaves pass. jax.Arrays (sharded global arrays too) are checked where they
  live, by one jitted reduction per device assignment (one for a tree on one mesh) and one
  host read; host arrays by NumPy (never copied to a device)."""
  leaves = [(k, x) for k, x in jax.tree_util.tree_leaves_with_path(params)
            if jnp.issubdtype(_shape_dtype(x)[1], jnp.inexact)]
  groups = collections.defaultdict(list)
  for i, (_, x) in enumerate(leaves):
    groups[_devices(x)].append(i)
  ok, fns = np.ones(len(leaves), bool), {}
  for devices, idx in groups.items():
    xs = [leaves[i][1] for i in idx]
    if devices is None:
      ok[idx] = [np.isfinite(np.asarray(x)).all() for x in xs]
      continue
    sh = xs[0].sharding
    rep = NamedSharding(sh.mesh, P()) if isinstance(sh, NamedSharding) else None
    fns[devices] = _finite_fns(rep)
    ok[idx] = np.asarray(fns[devices][0](xs))
  if ok.all():
    return
  path, x = leaves[int(np.argmin(ok))]
  devices = _devices(x)
  n = (int(np.count_nonzero(~np.isfinite(np.asarray(x)))) if devices is None
       else int(fns[devices][1](x)))
  raise ValueError(f"{what}: {jax.tree_util.keystr(path)} holds {n} non-finite values (NaN "
                   f"or inf) of {np.size(x)}; refusing to serve them (diverged or corrupt "
                   "weights?)")
