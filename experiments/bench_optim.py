r"""Optimizer step time: Muon Split vs whole-matrix Muon vs AdamW on GLM-5 preset trees.

The parameter trees are the model's (`nn.abstract_params`, i.e. jax.eval_shape of GLM5.init),
filled with random arrays; gradients are random too. One step = `tx.update` + `apply_updates`,
jitted with donated params and state; the time is the median of `--repeats` runs after a
compile-and-warm-up run, the optimizers' runs interleaved (A B C A B C ...) so that load from
other processes affects them alike.

  python -m experiments.bench_optim --presets=tiny,small --out=/tmp/bench_optim.json
"""

import json
import math
import statistics
import time

from absl import app
from absl import flags
import jax
import optax
from optax.contrib import MuonDimensionNumbers

from glm5_jax import get_preset
from glm5_jax import nn
from glm5_jax import optim

_PRESETS = flags.DEFINE_list("presets", ["tiny", "small"], "Model presets to benchmark.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed steps per optimizer (median reported).")
_OUT = flags.DEFINE_string("out", None, "Write the results as JSON here.")


def _optimizers(lr=1e-3, wd=0.1):
  return {
      "adamw": optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=wd),
      "muon (whole matrix)": optim.muon_split(learning_rate=lr, weight_decay=wd,
                                              split_heads=False, rms_shape="full"),
      "muon_split": optim.muon_split(learning_rate=lr, weight_decay=wd),
  }


def ns_gflops(shapes, split_heads, ns_steps=5):
  """Newton–Schulz GFLOP per step: each [m, n] block (m <= n) costs ns_steps * (4m²n + 2m³)
  (X Xᵀ, A², B X in optax's quintic iteration)."""
  dims = optim.muon_dim_numbers(shapes, split_heads=split_heads)
  total = 0.0
  is_leaf = lambda v: v is None or isinstance(v, MuonDimensionNumbers)
  for x, d in zip(jax.tree.leaves(shapes), jax.tree.leaves(dims, is_leaf=is_leaf)):
    if d is None:
      continue
    axes = lambda a: (a,) if isinstance(a, int) else tuple(a)
    fan_in = math.prod(x.shape[a] for a in axes(d.reduction_axis))
    fan_out = math.prod(x.shape[a] for a in axes(d.output_axis))
    m, n = sorted((fan_in, fan_out))
    total += x.size // (fan_in * fan_out) * ns_steps * (4 * m * m * n + 2 * m ** 3)
  return total / 1e9


def _random_like(shapes, key, scale):
  keys = jax.random.split(key, len(jax.tree.leaves(shapes)))
  keys = jax.tree.unflatten(jax.tree.structure(shapes), list(keys))
  return jax.tree.map(lambda s, k: scale * jax.random.normal(k, s.shape, s.dtype), shapes, keys)


def make_step(tx, shapes):
  """A jitted optimizer step on random params/grads; returns (run, compile+first seconds)."""
  params = _random_like(shapes, jax.random.key(0), 0.02)
  grads = _random_like(shapes, jax.random.key(1), 1e-3)
  carry = [params, tx.init(params)]

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))

  def run():
    t0 = time.perf_counter()
    carry[:] = jax.block_until_ready(step(*carry, grads))
    return time.perf_counter() - t0
  return run, run()


def bench_preset(shapes, repeats):
  """{optimizer: (median, min step seconds, compile + first step seconds)}. The timed steps of the
  optimizers are interleaved, so load from other processes hits them alike."""
  runs = {name: make_step(tx, shapes) for name, tx in _optimizers().items()}
  times = {name: [] for name in runs}
  for _ in range(repeats):
    for name, (run, _) in runs.items():
      times[name].append(run())
  return {name: (statistics.median(times[name]), min(times[name]), runs[name][1])
          for name in runs}


def main(argv):
  del argv
  rows = []
  for preset in _PRESETS.value:
    shapes = nn.abstract_params(get_preset(preset))[0]
    n_params = sum(x.size for x in jax.tree.leaves(shapes))
    results = bench_preset(shapes, _REPEATS.value)
    base = results["adamw"][0]  # median
    for name, (step_s, min_s, first_s) in results.items():
      gflop = 0.0 if name == "adamw" else ns_gflops(shapes, split_heads=name == "muon_split")
      rows.append(dict(preset=preset, params_m=n_params / 1e6, optimizer=name,
                       step_ms=1e3 * step_s, min_ms=1e3 * min_s, vs_adamw=step_s / base,
                       compile_s=first_s,
                       ns_gflop=gflop))
      print(f"{preset:6s} {name:20s} {1e3 * step_s:10.2f} ms  x{step_s / base:6.2f}  "
            f"NS {gflop:7.1f} GFLOP  (compile+first {first_s:.1f} s)", flush=True)
  header = ("| preset | params | optimizer | step (ms, median) | min (ms) | median vs AdamW | "
            "NS GFLOP/step | compile + 1st step (s) |")
  lines = [header, "|---|---|---|---|---|---|---|---|"]
  lines += [f"| {r['preset']} | {r['params_m']:.1f}M | {r['optimizer']} | {r['step_ms']:.2f} | "
            f"{r['min_ms']:.2f} | {r['vs_adamw']:.2f} | {r['ns_gflop']:.1f} | "
            f"{r['compile_s']:.1f} |" for r in rows]
  print("\n".join(lines))
  if _OUT.value:
    info = dict(backend=jax.default_backend(), devices=jax.device_count(),
                repeats=_REPEATS.value, jax=jax.__version__, optax=optax.__version__)
    with open(_OUT.value, "w") as f:
      json.dump(dict(info=info, rows=rows), f, indent=1)


if __name__ == "__main__":
  app.run(main)
