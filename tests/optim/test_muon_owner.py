"""Owner-computes Muon Split (glm5_jax/optim/muon_owner.py) against the replicated and the
one-device update, on 8 fake CPU devices (subprocesses: the device count is fixed when jax
starts, tests/fake_devices.py).

Reference: the one-device update (optax's Newton–Schulz on whole leaves, itself checked
against float64 NumPy in tests/optim/test_muon_split.py). Float32 throughout; the owner sums
each Gram product in one place where the replicated update sums shard partials, so the two
differ by float32 rounding: 1e-5 relative to each leaf's largest update.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from glm5_jax import collectives
from glm5_jax import nn as gnn
from glm5_jax import optim
from glm5_jax import sharding as shd
from glm5_jax.config import get_preset
from glm5_jax.optim import muon_owner
from optax.contrib import MuonDimensionNumbers as MDN
from tests import fake_devices
from tests import seeding

RTOL = 1e-5


# ------------------------------------------------------------------------------ the plan


def _layouts(mesh, leaves):
  """{name: (shape, spec, dims)} -> muon_owner.plan of those leaves."""
  names = list(leaves)
  shapes = [jax.ShapeDtypeStruct(leaves[k][0], jnp.float32) for k in names]
  dims = [leaves[k][2] for k in names]
  sh = [NamedSharding(mesh, leaves[k][1]) for k in names]
  stacked = [int(k.startswith("stacked")) for k in names]
  buckets, local = muon_owner.plan(shapes, dims, sh, stacked)
  return names, buckets, local


def test_plan_deals_sharded_blocks_to_owners_and_leaves_local_blocks_in_place():
  mesh = AbstractMesh((2, 2, 2), ("fsdp", "expert", "tensor"))
  head = MDN(reduction_axis=1, output_axis=3)         # [L, r, h, k] per head
  names, buckets, local = _layouts(mesh, {
      # fan-in over fsdp, heads over tensor: 3 layers x 2 local heads, pieces over fsdp
      "stacked_wq_b": ((3, 16, 4, 8), P(None, "fsdp", "tensor"), head),
      # heads over tensor, fan-in whole: local
      "stacked_w_uk": ((3, 16, 4, 8), P(None, None, "tensor"), head),
      # experts over expert, fan-in over fsdp: [E, in, out] per expert
      "experts": ((4, 16, 12), P("expert", "fsdp"), MDN(1, 2)),
      # wo [h, v, d]: fan-in (h, v) over tensor on h, fan-out over fsdp
      "wo": ((4, 8, 16), P("tensor", None, "fsdp"), MDN((0, 1), 2)),
      # fan-in (h, v) sharded on v, the minor axis: its pieces are not rows, kept in place
      "wo_minor": ((4, 8, 16), P(None, "tensor"), MDN((0, 1), 2)),
  })
  assert sorted(names[i] for i in local) == ["stacked_w_uk", "wo_minor"]
  by_leaf = {names[b.leaves[0]]: b for b in buckets}
  wq = by_leaf["stacked_wq_b"]
  assert (wq.m, wq.n, wq.m_axes, wq.n_axes, wq.g) == (16, 8, ("fsdp",), (), 2)
  # 2 local heads per layer, one to each of the 2 owners, one layer per round.
  assert (wq.depth, wq.per_layer, wq.layers_per_round, wq.per_owner, wq.rounds) == (
      3, 2, 1, 1, 3)
  assert wq.padding == 0
  ex = by_leaf["experts"]
  assert (ex.m, ex.n, ex.g, ex.depth, ex.per_layer) == (16, 12, 2, 1, 2)  # 2 local experts
  wo = by_leaf["wo"]
  assert (wo.m, wo.n, wo.m_axes, wo.n_axes, wo.g_m, wo.g_n) == (32, 16, ("tensor",),
                                                                 ("fsdp",), 2, 2)


def test_plan_puts_leaves_of_one_block_shape_layout_and_depth_in_one_bucket():
  mesh = AbstractMesh((4, 2), ("fsdp", "tensor"))
  dims = MDN(1, 2)
  names, buckets, local = _layouts(mesh, {
      "stacked_a": ((5, 16, 8), P(None, "fsdp"), dims),
      "stacked_b": ((5, 16, 8), P(None, "fsdp"), dims),
      "c": ((1, 16, 8), P(None, "fsdp"), dims),
      "d": ((1, 16, 8), P(None, None, "fsdp"), dims),       # pieces over fan-out instead
  })
  assert not local
  assert sorted(sorted(names[i] for i in b.leaves) for b in buckets) == [
      ["c"], ["d"], ["stacked_a", "stacked_b"]]
  ab = next(b for b in buckets if len(b.leaves) == 2)
  # 2 blocks per layer for 4 owners: rounds of 2 layers (3 rounds for 5 layers, the last one
  # clamped to layers 3-4: layer 3 twice), one block per owner.
  assert (ab.per_layer, ab.layers_per_round, ab.rounds, ab.per_owner) == (2, 2, 3, 1)
  np.testing.assert_allclose(ab.padding, 1 - 10 / 12)


def test_ns_flops_counts_the_quintic_iteration():
  # m <= n: per step X Xᵀ (2 m² n), A² (2 m³), (bA + cA²) X (2 m² n).
  assert muon_owner.ns_flops(4, 6) == 5 * (2 * 16 * 6 + 2 * 64 + 2 * 16 * 6)
  assert muon_owner.ns_flops(6, 4) == muon_owner.ns_flops(4, 6)


# ------------------------------------------------------------------------------ 8 devices


def _random(tree, rng):
  return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), tree)


def _rel(a, b) -> float:
  return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _setup(sizes, rules, seed, layers, mtp):
  from experiments import aot_train_memory as aot  # pylint: disable=g-import-not-at-top
  cfg = get_preset("tiny", num_hidden_layers=layers, num_nextn_predict_layers=mtp)
  mesh = shd.make_mesh(sizes, jax.devices()[:math.prod(sizes.values())])
  shapes, specs = gnn.abstract_params(cfg)
  p_sh = shd.param_shardings(specs, mesh, aot.rules(rules))
  rng = np.random.default_rng(seed)
  params = _random(shapes, rng)
  grads = [_random(shapes, rng) for _ in range(2)]
  return mesh, p_sh, params, grads


def _steps(tx, params, grads, p_sh=None, state=None):
  """Updates of `tx` over `grads` (sharded like `p_sh` when given), the final params, state
  and the compiled update's collectives."""
  mesh = None if p_sh is None else jax.tree.leaves(p_sh)[0].mesh
  rep = None if mesh is None else shd.replicated(mesh)
  st_sh = None if p_sh is None else optim.state_shardings(
      jax.eval_shape(tx.init, params), params, p_sh, rep)
  if p_sh is not None:
    params = jax.device_put(params, p_sh)
    state = jax.jit(tx.init, out_shardings=st_sh)(params) if state is None else state
    step = jax.jit(tx.update, in_shardings=(p_sh, st_sh, p_sh), out_shardings=(p_sh, st_sh))
  else:
    state = tx.init(params) if state is None else state
    step = jax.jit(tx.update)
  out = []
  for g in grads:
    g = g if p_sh is None else jax.device_put(g, p_sh)
    u, state = step(g, state, params)
    params = optax.apply_updates(params, u)
    out.append(u)
  stats = collectives.collective_stats(step.lower(g, state, params).compile().as_text())
  return out, params, state, stats


def check_mesh(sizes, rules, seed, *, replicated=True, layers=2, mtp=0):
  """Owner == 1 device (and == replicated) over two updates; the owner's update moves data
  by all-to-alls only."""
  mesh, p_sh, params, grads = _setup(sizes, rules, seed, layers, mtp)
  lr = 0.1
  one, _, _, _ = _steps(optim.muon_split(learning_rate=lr), params, grads)
  own, _, _, stats = _steps(optim.muon_split(learning_rate=lr, distribution="owner",
                                             param_shardings=p_sh), params, grads, p_sh)
  assert _rel(own, one) < RTOL, _rel(own, one)
  assert stats["all-to-all"]["count"] > 0, stats
  assert sum(v["count"] for k, v in stats.items() if k != "all-to-all") == 0, stats
  if replicated:
    rep, _, _, rstats = _steps(optim.muon_split(learning_rate=lr, param_shardings=p_sh),
                               params, grads, p_sh)
    assert _rel(own, rep) < RTOL, _rel(own, rep)
    assert rstats["all-reduce"]["count"] > 0 and rstats["all-to-all"]["count"] == 0, rstats
  del mesh


def check_resume(seed, workdir):
  """Two owner updates, checkpoint, restore into the replicated optimizer's state layout,
  one more update: equal to a third owner update; the restored state is bitwise the saved."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  mesh, p_sh, params, grads = _setup({"fsdp": 2, "expert": 2, "tensor": 2}, "lora_over_fsdp",
                                     seed, 2, 0)
  grads3 = grads + [jax.tree.map(lambda g: -0.5 * g, grads[0])]
  make = lambda d: optim.muon_split(learning_rate=0.1, distribution=d, param_shardings=p_sh)
  abstract = {d: jax.eval_shape(make(d).init, params) for d in optim.DISTRIBUTIONS}
  assert jax.tree.structure(abstract["owner"]) == jax.tree.structure(abstract["replicated"])
  rep = shd.replicated(mesh)
  st_sh = optim.state_shardings(abstract["replicated"], params, p_sh, rep)
  _, p2, s2, _ = _steps(make("owner"), params, grads3[:2], p_sh)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(f"{workdir}/ckpt", {"params": p2, "opt": s2})
  ckptr.wait_until_finished()
  target = {"params": jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                     sharding=s), params, p_sh),
            "opt": jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                abstract["replicated"], st_sh)}
  back = ckptr.restore(f"{workdir}/ckpt", target)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves({"params": p2, "opt": s2})):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
  (u_rep,), _, _, _ = _steps(make("replicated"), back["params"], grads3[2:], p_sh,
                             back["opt"])
  (u_own,), _, _, _ = _steps(make("owner"), back["params"], grads3[2:], p_sh, back["opt"])
  u_all, _, _, _ = _steps(make("owner"), params, grads3, p_sh)
  for a, b in zip(jax.tree.leaves(u_own), jax.tree.leaves(u_all[2])):   # resumed == straight
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert _rel(u_rep, u_own) < RTOL, _rel(u_rep, u_own)


def _run(call: str):
  fake_devices.run_script(f"from tests.optim.test_muon_owner import *\n{call}\nprint('OK')",
                          timeout=600)


def test_owner_update_equals_one_device_on_8_devices():
  """fsdp 2 x expert 2 x tensor 2, MLA ranks over fsdp (per-head blocks with sharded fan-in,
  experts sharded twice): the representative of the slow meshes below."""
  _run(f"check_mesh({{'fsdp': 2, 'expert': 2, 'tensor': 2}}, 'lora_over_fsdp', "
       f"{seeding.seed()}, replicated=False)")


@pytest.mark.slow
@pytest.mark.parametrize("sizes, rules", [
    ({"fsdp": 8}, "lora_over_fsdp"),
    ({"fsdp": 2, "expert": 2, "tensor": 2}, "lora_over_fsdp"),
    ({"fsdp": 4, "tensor": 2}, "default"),
    ({"fsdp": 2, "expert": 4}, "lora_over_fsdp"),
])
def test_owner_equals_replicated_equals_one_device(sizes, rules):
  _run(f"check_mesh({sizes!r}, {rules!r}, {seeding.seed()}, layers=3, mtp=1)")


@pytest.mark.slow
def test_a_run_resumes_across_muon_distributions(tmp_path):
  _run(f"check_resume({seeding.seed()}, {str(tmp_path)!r})")
