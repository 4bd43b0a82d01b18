r"""The routed experts' kernels on this machine: ragged_dot vs blocked vs gathered, by token count.

  python -m experiments.bench_moe --presets=tiny,small --tokens=8,64,512,2048 \
      --out=docs/bench_moe_cpu.json

For each preset's expert shapes (d, I, E, K) and token count n: `ffn.ragged_swiglu`
(sort + `jax.lax.ragged_dot`), `ffn.blocked_swiglu` (dense matmuls over blocks of one
expert's rows; what `ffn.routed_swiglu` runs on XLA:CPU) and `ffn.gathered_swiglu` (each
token's K expert matrices; skipped above `--gathered_max` pairs), forward and forward +
backward, jitted, float32, uniform random routing. Variants are timed in interleaved rounds
(A B C A B C ...; this machine's timings drift) and the median is reported; the blocked
kernel's output is checked against ragged_dot's. Prints a table and writes JSON.
"""

import json
import platform

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import config as config_lib
from glm5_jax import timing
from glm5_jax.nn import ffn

_PRESETS = flags.DEFINE_list("presets", ["tiny", "small"], "model presets (expert shapes)")
_TOKENS = flags.DEFINE_list("tokens", ["8", "64", "512", "2048"], "token counts n")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "interleaved timing rounds (median)")
_GATHERED_MAX = flags.DEFINE_integer("gathered_max", 4096, "largest n*K for gathered_swiglu")
_OUT = flags.DEFINE_string("out", "bench_moe.json", "JSON output path")

KERNELS = {"ragged": ffn.ragged_swiglu, "blocked": ffn.blocked_swiglu,
           "gathered": ffn.gathered_swiglu}


def _inputs(cfg, n, seed=0):
  rng = np.random.default_rng(seed)
  d, i, e, k = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts,
                cfg.num_experts_per_tok)
  f32 = lambda *s: jnp.asarray(rng.normal(size=s) * s[-2] ** -0.5, jnp.float32)  # 1/sqrt(fan in)
  ids = jnp.asarray(np.argsort(rng.random((n, e)), axis=1)[:, :k], jnp.int32)
  return (jnp.asarray(rng.normal(size=(n, d)), jnp.float32), ids, jnp.asarray(
      rng.random((n, k)), jnp.float32), f32(e, d, i), f32(e, d, i), f32(e, i, d))


def _fns(kernel, ids):
  fwd = jax.jit(lambda x, w, *ws: kernel(x, ids, w, *ws)[0])
  loss = lambda x, w, *ws: jnp.sum(kernel(x, ids, w, *ws)[0] ** 2)
  bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  return {"fwd": fwd, "fwd_bwd": bwd}


def bench(cfg, name, n):
  x, ids, w, *ws = _inputs(cfg, n)
  kernels = {k: f for k, f in KERNELS.items()
             if k != "gathered" or n * cfg.num_experts_per_tok <= _GATHERED_MAX.value}
  fns = {(k, part): f for k, kernel in kernels.items() for part, f in _fns(kernel, ids).items()}
  times = {key: [] for key in fns}
  for _ in range(_ROUNDS.value):
    for key, f in fns.items():
      times[key].append(timing.median_time(f, x, w, *ws, repeats=1))
  err = float(jnp.max(jnp.abs(fns["blocked", "fwd"](x, w, *ws) - fns["ragged", "fwd"](x, w, *ws))))
  row = {"preset": name, "tokens": n, "pairs_per_expert": n * cfg.num_experts_per_tok
         / cfg.n_routed_experts, "block_rows": ffn.block_rows(n * cfg.num_experts_per_tok,
                                                               cfg.n_routed_experts),
         "blocked_vs_ragged_max_abs": err,
         "ms": {f"{k}_{part}": 1e3 * float(np.median(v)) for (k, part), v in times.items()}}
  for part in ("fwd", "fwd_bwd"):
    row[f"blocked_speed_up_{part}"] = row["ms"][f"ragged_{part}"] / row["ms"][f"blocked_{part}"]
  return row


def main(argv):
  del argv
  rows = []
  print(f"{'preset':6} {'n':>5} {'B':>4} | {'ragged fwd':>10} {'blocked':>8} {'gathered':>8} | "
        f"{'ragged f+b':>10} {'blocked':>8} | {'x fwd':>6} {'x f+b':>6}")
  for name in _PRESETS.value:
    cfg = config_lib.get_preset(name)
    for n in (int(t) for t in _TOKENS.value):
      r = bench(cfg, name, n)
      rows.append(r)
      ms = r["ms"]
      g = f"{ms['gathered_fwd']:8.2f}" if "gathered_fwd" in ms else f"{'-':>8}"
      print(f"{name:6} {n:5d} {r['block_rows']:4d} | {ms['ragged_fwd']:10.2f} "
            f"{ms['blocked_fwd']:8.2f} {g} | {ms['ragged_fwd_bwd']:10.2f} "
            f"{ms['blocked_fwd_bwd']:8.2f} | {r['blocked_speed_up_fwd']:6.2f} "
            f"{r['blocked_speed_up_fwd_bwd']:6.2f}", flush=True)
  out = {"machine": f"{platform.node()} ({platform.processor() or platform.machine()}, "
                    f"{jax.devices()[0].platform}, {jax.device_count()} device(s))",
         "unit": "ms, median of interleaved rounds", "rows": rows}
  with open(_OUT.value, "w") as f:
    json.dump(out, f, indent=2)


if __name__ == "__main__":
  app.run(main)
