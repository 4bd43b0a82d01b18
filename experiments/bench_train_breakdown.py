r"""Where the tiny train step's time goes: ablations timed round-robin in one process.

  python -m experiments.bench_train_breakdown --preset=tiny --batch=4 --seq=512 --rounds=5

Each row of `VARIANTS` changes one thing of the full step (Muon Split, MTP x3, chunked CE,
routing-bias update; `train.step.train_step`) or times a part of it (forward + backward
alone). Each variant is timed in turns with the full step (`--rounds` pairs), so machine
load that comes and goes hits both alike; "x full" is the median of the per-pair ratios.
Rows print as they finish. Batch-invariant dots
(glm5_jax/numerics.py) are a process flag: run once with and once without
XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= and compare the two tables.
"""

import functools
import json
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax import numerics
from glm5_jax.nn import ffn
from glm5_jax.nn import moe
from glm5_jax.train import flops as flops_lib
from glm5_jax.train import step as step_lib

_PRESET = flags.DEFINE_string("preset", "tiny", "model preset")
_BATCH = flags.DEFINE_integer("batch", 4, "sequences per step")
_SEQ = flags.DEFINE_integer("seq", 512, "sequence length")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "timed rounds (median)")
_ONLY = flags.DEFINE_list("only", [], "variant names to run (default: all)")
_OUT = flags.DEFINE_string("out", "bench_train_breakdown.json", "JSON output")

# name: (what runs, overrides). "step": train_step; "grad": value_and_grad of loss_fn only.
FULL = dict(optimizer="muon_split", mtp_steps=3, loss_chunk=256, bias_rate=1e-3, remat="none",
            dispatch="auto")
VARIANTS = {   # name: (what runs, overrides of FULL, what it shows)
    "full": ("step", {}, "the full step"),
    "adamw": ("step", {"optimizer": "adamw"}, "AdamW instead of Muon Split"),
    "no_mtp": ("step", {"mtp_steps": 0}, "no MTP (mtp_num_steps=0)"),
    "chunk512": ("step", {"loss_chunk": 512}, "loss_chunk=512 (one CE chunk)"),
    "no_bias": ("step", {"bias_rate": 0.0}, "no routing-bias update"),
    "remat": ("step", {"remat": "full"}, "remat=full"),
    "gathered": ("step", {"dispatch": "gathered"}, "MoE by gathered_swiglu, no ragged_dot"),
    "grad": ("grad", {}, "value_and_grad of the loss only"),
    "grad_no_mtp": ("grad", {"mtp_steps": 0}, "value_and_grad only, no MTP"),
    "plain": ("step", {"optimizer": "adamw", "mtp_steps": 0, "bias_rate": 0.0},
              "AdamW, no MTP, no bias update"),
}


def _build(kind, o, batch):
  cfg = config_lib.get_preset(_PRESET.value, max_position_embeddings=max(_SEQ.value, 4096),
                              remat=o["remat"], mtp_num_steps=o["mtp_steps"])
  c = ml_collections.ConfigDict(dict(
      stage="pretrain", optimizer=o["optimizer"], learning_rate=1e-3, adam_learning_rate=0.0,
      warmup_steps=10, total_steps=100, final_lr_fraction=0.1, weight_decay=0.1, grad_clip=1.0))
  tx = step_lib.make_optimizer(c)
  params = gnn.init_params(cfg, 0)
  state = step_lib.TrainState(jnp.zeros((), jnp.int32), params, jax.jit(tx.init)(params),
                              jnp.zeros((2,), jnp.uint32))
  if kind == "step":
    fn = jax.jit(functools.partial(step_lib.train_step, cfg=cfg, stage="pretrain", tx=tx,
                                   loss_chunk=o["loss_chunk"], bias_rate=o["bias_rate"]))
    run = lambda: fn(state, batch)[1]["loss"]
  else:
    fn = jax.jit(jax.value_and_grad(lambda p, b: step_lib.loss_fn(
        p, b, cfg=cfg, stage="pretrain", loss_chunk=o["loss_chunk"])[0]))
    run = lambda: fn(params, batch)[0]
  dispatch = moe.select_dispatch
  if o["dispatch"] == "gathered":          # trace with the gathered experts, then restore
    moe.select_dispatch = lambda cfg, n, cached=False: ffn.gathered_swiglu
  try:
    t0 = time.perf_counter()
    jax.block_until_ready(run())                                   # compile + first run
    compile_s = time.perf_counter() - t0
  finally:
    moe.select_dispatch = dispatch
  return run, compile_s, flops_lib.flops_per_token(cfg, _SEQ.value, "pretrain")


def main(argv):
  del argv
  b, t = _BATCH.value, _SEQ.value
  rng = np.random.default_rng(0)
  vocab = config_lib.get_preset(_PRESET.value).vocab_size
  batch = {"tokens": jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32),
           "segment_ids": jnp.ones((b, t), jnp.int32),
           "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))}
  names = _ONLY.value or list(VARIANTS)
  if names[0] != "full":
    names = ["full"] + [n for n in names if n != "full"]
  built = {}
  times = {name: [] for name in names}
  print(f"batch-invariant dots: {numerics.is_set()}; {b} x {t} tokens; {_ROUNDS.value} "
        "rounds of (full, variant), median", flush=True)
  print(f"{'variant':<13}{'what':<40}{'compile s':>10}{'step s':>9}{'tok/s':>9}{'x full':>8}"
        f"{'GFLOP/s':>9}", flush=True)
  rows = []
  for name in names:                 # each variant timed in turns with the full step
    kind, over, what = VARIANTS[name]
    built[name] = _build(kind, {**FULL, **over}, batch)
    pair = [] if name == "full" else [name]
    ratios = []
    for _ in range(_ROUNDS.value):
      for n in ["full"] + pair:
        t0 = time.perf_counter()
        jax.block_until_ready(built[n][0]())
        times[n].append(time.perf_counter() - t0)
      if pair:
        ratios.append(times[name][-1] / times["full"][-1])
    med = float(np.median(times[name][-_ROUNDS.value:]))
    ratio = float(np.median(ratios)) if ratios else 1.0
    rows.append({"variant": name, "what": what, "compile_s": built[name][1], "median_s": med,
                 "tokens_per_s": b * t / med, "ratio_to_full": ratio,
                 "flops_per_token": built[name][2], "batch_invariant": numerics.is_set()})
    print(f"{name:<13}{what:<40}{built[name][1]:>10.1f}{med:>9.3f}{b * t / med:>9.0f}"
          f"{ratio:>8.2f}{b * t * built[name][2] / med / 1e9:>9.2f}", flush=True)
    with open(_OUT.value, "w") as f:                # rewritten after every row
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  app.run(main)
