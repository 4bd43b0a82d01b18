r"""Owner vs replicated Muon Split on a CPU mesh: equality, collectives, temporaries.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.muon_distribution \
      --mesh=fsdp=8 --mesh=fsdp=2,expert=2,tensor=2 --mesh=fsdp=4,tensor=2 \
      --out=docs/muon_distribution_cpu.json

For each mesh and `config.muon_distribution`, the `tiny` preset's train step (stage
pretrain, float32, as train.loop jits it: `aot_train_memory.part_fn`) and its optimizer
update alone (gradient clipping + Muon Split + AdamW + apply) are compiled for the host's
CPU devices. Per device: the collectives of the compiled HLO (`collectives.collective_stats`:
runs per step, loops' trip counts included, and their result bytes) and XLA's temporaries
(`memory_analysis`). The update also runs once on seeded random parameters and gradients from
a fresh state; `owner vs replicated` and `vs 1 device` are the largest relative differences
(max |a - b| / max |b| per leaf) of the updates.
"""

import json
import math

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from configs import pretrain as pretrain_config
from experiments import aot_train_memory as aot
from glm5_jax import collectives
from glm5_jax import config as config_lib
from glm5_jax import optim
from glm5_jax.optim import muon_owner
from glm5_jax.optim.param_groups import classify
from glm5_jax.optim.param_groups import path_str
from glm5_jax import sharding as shd
from glm5_jax.train import step as step_lib

# --mesh, --rules and --out are aot_train_memory's flags, with defaults for 8 CPU devices.
flags.FLAGS.set_default("mesh", ["fsdp=8", "fsdp=2,expert=2,tensor=2", "fsdp=4,tensor=2"])
flags.FLAGS.set_default("rules", "lora_over_fsdp")
_SEQ = flags.DEFINE_integer("seq_len", 64, "tokens per sequence of the step's batch")
_PLAN = flags.DEFINE_string("plan", "", "a preset (e.g. glm5): print the owner plan of its "
                            "Muon leaves over each --mesh (described, nothing compiled)")
GIB = 2 ** 30


def _rel(a, b) -> float:
  return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _random(tree, seed):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda s: np.asarray(rng.standard_normal(s.shape), s.dtype), tree)


def measure(sizes, rule_name, seq_len):
  """Rows (one per distribution x part) for one mesh."""
  devices = jax.devices()[:math.prod(sizes.values())]
  mesh = shd.make_mesh(sizes, devices)
  cfg = config_lib.get_preset("tiny", dtype="float32", remat="full", attention_impl="xla")
  cfg = step_lib.stage_model_config(cfg, "pretrain")
  c = pretrain_config.get_config("model=tiny,runlocal=True")
  c.seq_len, c.batch_size = seq_len, shd.batch_axis_size(mesh)
  c.warmup_steps = 0                  # a nonzero learning rate at the first update
  shapes, p_sh = aot.param_shardings(cfg, mesh, aot.rules(rule_name))
  params, grads = _random(shapes, 1), _random(shapes, 2)
  batch_sh = shd.batch_sharding(mesh)
  tok = jax.ShapeDtypeStruct((c.batch_size, seq_len), jnp.int32, sharding=batch_sh)
  batch = {"tokens": tok, "segment_ids": tok, "positions": tok}
  rows, updates = [], {}
  for dist in optim.DISTRIBUTIONS:
    c.muon_distribution = dist
    tx = step_lib.make_optimizer(c, p_sh)
    state = aot.abstract_state(cfg, tx, mesh, aot.rules(rule_name))
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    with jax.set_mesh(mesh):
      for part in ("step", "update"):
        fn = aot.part_fn(part, cfg, "pretrain", tx, c, state_sh, batch_sh)
        compiled = fn.trace(state, batch).lower().compile()
        mem = compiled.memory_analysis()
        rows.append(dict(mesh=sizes, rules=rule_name, distribution=dist, part=part,
                         temp_bytes=mem.temp_size_in_bytes,
                         argument_bytes=mem.argument_size_in_bytes,
                         collectives=collectives.collective_stats(compiled.as_text())))
      p = jax.device_put(params, p_sh)
      opt = jax.jit(tx.init, out_shardings=state_sh.opt_state)(p)
      update = jax.jit(tx.update, in_shardings=(p_sh, state_sh.opt_state, p_sh),
                       out_shardings=(p_sh, state_sh.opt_state))
      updates[dist] = jax.device_get(update(jax.device_put(grads, p_sh), opt, p)[0])
  c.muon_distribution = "replicated"
  tx1 = step_lib.make_optimizer(c)
  one = jax.device_get(jax.jit(tx1.update)(grads, tx1.init(params), params)[0])
  diff = dict(owner_vs_replicated=_rel(updates["owner"], updates["replicated"]),
              owner_vs_1_device=_rel(updates["owner"], one),
              replicated_vs_1_device=_rel(updates["replicated"], one))
  return [dict(r, **diff) for r in rows]


def table(rows) -> str:
  kinds = [k for k in collectives.KINDS if any(r["collectives"][k]["count"] for r in rows)]
  head = (f"{'mesh':<24}{'part':<8}{'distribution':<13}"
          + "".join(f"{k:>22}" for k in kinds) + f"{'temp MiB':>10}{'owner/rep diff':>16}"
          f"{'owner/1 dev':>13}")
  lines = [head, "-" * len(head)]
  for r in rows:
    mesh = ",".join(f"{a}={n}" for a, n in r["mesh"].items())
    cells = "".join(f"{r['collectives'][k]['count']:>8} x "
                    f"{r['collectives'][k]['bytes'] / 2**10:>8.1f} KiB" for k in kinds)
    lines.append(f"{mesh:<24}{r['part']:<8}{r['distribution']:<13}{cells}"
                 f"{r['temp_bytes'] / 2**20:>10.2f}{r['owner_vs_replicated']:>16.1e}"
                 f"{r['owner_vs_1_device']:>13.1e}")
  lines.append("collectives: runs per step x result bytes per device (while loops' trip "
               "counts included); temp: XLA's temporaries per device.")
  return "\n".join(lines)


def plan_table(preset: str, sizes: dict, rule_name: str) -> str:
  """The owner plan of `preset`'s Muon leaves over a described mesh (nothing compiled): per
  bucket the leaves, block shape, owners g, rounds, blocks per owner per round, padding, and
  the Newton–Schulz FLOPs per device (zero blocks included) against the same blocks spread
  evenly over the g owners."""
  mesh = jax.sharding.AbstractMesh(tuple(sizes.get(a, 1) for a in shd.MESH_AXES),
                                   shd.MESH_AXES)
  cfg = config_lib.get_preset(preset)
  shapes, specs = aot.gnn.abstract_params(cfg)
  p_sh = shd.param_shardings(specs, mesh, aot.rules(rule_name))
  flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
  sh = jax.tree.leaves(p_sh, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  rules = [classify(path_str(p), x.shape) for p, x in flat]
  keep = [i for i, r in enumerate(rules) if r.dims is not None]
  buckets, local = muon_owner.plan([flat[i][1] for i in keep], [rules[i].dims for i in keep],
                                   [sh[i] for i in keep], [rules[i].stacked for i in keep])
  lines = [f"{preset} over {sizes} (rules {rule_name}): {len(buckets)} buckets, "
           f"{len(local)} leaves local"]
  own_total = ideal_total = rep_total = 0
  for b in buckets:
    names = ",".join(sorted({path_str(flat[keep[i]][0]).split("/")[-1] for i in b.leaves}))
    f = muon_owner.ns_flops(b.m, b.n)
    own = b.rounds * b.per_owner * f
    ideal = b.depth * b.per_layer * f / b.g   # the blocks spread evenly, no padding
    lo, hi = min(b.m, b.n), max(b.m, b.n)
    rep = b.depth * b.per_layer * 5 * (4 * lo * lo * hi / b.g + 2 * lo ** 3)
    own_total, ideal_total, rep_total = own_total + own, ideal_total + ideal, rep_total + rep
    lines.append(f"  {names:<28} [{b.m}, {b.n}] L={b.depth:<3} g={b.g:<3} rounds={b.rounds:<3} "
                 f"c={b.per_owner:<3} padding={b.padding:5.1%}  NS TFLOP/device owner "
                 f"{own / 1e12:7.3f} (even {ideal / 1e12:7.3f})")
  lines.append(f"  NS TFLOP per device over the sharded blocks: owner {own_total / 1e12:.2f}, "
               f"evenly spread {ideal_total / 1e12:.2f}, replicated about "
               f"{rep_total / 1e12:.2f} (Gram products split over the g devices, the "
               f"min(m, n)^2 products whole on each)")
  return "\n".join(lines)


def main(argv):
  del argv
  if _PLAN.value:
    for spec in aot._MESHES.value:
      print(plan_table(_PLAN.value, aot.parse_mesh(spec), aot._RULES.value))
    return
  rows = []
  for spec in aot._MESHES.value:
    sizes = aot.parse_mesh(spec)
    if math.prod(sizes.values()) > jax.device_count():
      raise SystemExit(f"--mesh={spec!r} needs {math.prod(sizes.values())} devices; this "
                       f"process has {jax.device_count()} (set XLA_FLAGS="
                       "--xla_force_host_platform_device_count=8 before starting it)")
    rows += measure(sizes, aot._RULES.value, _SEQ.value)
    print(table(rows[-4:]), flush=True)
  print(table(rows))
  if aot._OUT.value:
    with open(aot._OUT.value, "w") as f:
      json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=rows),
                f, indent=1)
    print(f"wrote {aot._OUT.value}")


if __name__ == "__main__":
  app.run(main)
