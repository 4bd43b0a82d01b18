r"""Training-step benchmark: tokens/s, MFU per chip, forward / backward / optimizer split, memory.

  python -m experiments.bench_train --presets=tiny,small --batch=4 --seq=512 --out=/tmp/bench_train.json

Times (median of --repeats) three jitted functions on the same batch: the loss
forward, forward + backward, and the optimizer update; backward = (fwd+bwd) -
fwd (--split=false times the train step alone). Memory: XLA's compiled memory
analysis of the full train step (arguments + outputs + temporaries) and the
process's peak RSS. Model FLOPs per token (attention included, train/flops.py)
give TFLOP/s per chip and, with --peak_tflops (one chip's peak), MFU. The
ablation flags (--optimizer, --mtp_steps, --loss_chunk, --remat, --bias_rate,
--microbatches) feed docs/benchmarks.md's train step time breakdown. Prints a
table, writes JSON.
"""

import functools
import json
import resource

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from glm5_jax import config as config_lib
from glm5_jax import timing
from glm5_jax import nn as gnn
from glm5_jax.train import flops as flops_lib
from glm5_jax.train import step as step_lib

_PRESETS = flags.DEFINE_list("presets", ["tiny", "small"], "model presets")
_BATCH = flags.DEFINE_integer("batch", 4, "sequences per step")
_SEQ = flags.DEFINE_integer("seq", 512, "sequence length")
_STAGE = flags.DEFINE_string("stage", "pretrain", "stage (selects attention and losses)")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed runs (median)")
_OUT = flags.DEFINE_string("out", "bench_train.json", "JSON output")
_PEAK = flags.DEFINE_float("peak_tflops", 0.0, "one chip's peak TFLOP/s for MFU (0: no MFU)")
_SPLIT = flags.DEFINE_bool("split", True, "also time forward, forward + backward, optimizer")
_OPTIMIZER = flags.DEFINE_enum("optimizer", "muon_split", list(step_lib.OPTIMIZERS), "optimizer")
_MTP = flags.DEFINE_integer("mtp_steps", -1, "MTP steps (-1: the preset's)")
_LOSS_CHUNK = flags.DEFINE_integer("loss_chunk", 256, "cross-entropy sequence chunk")
_REMAT = flags.DEFINE_enum("remat", "none", ["none", "full", "save_dots"], "layer remat")
_BIAS_RATE = flags.DEFINE_float("bias_rate", 1e-3, "routing-bias update rate (0: no update)")
_MICRO = flags.DEFINE_integer("microbatches", 1, "gradient-accumulation microbatches")


def bench_preset(preset, batch, seq, stage, repeats):
  over = {} if _MTP.value < 0 else {"mtp_num_steps": _MTP.value}
  cfg = config_lib.get_preset(preset, max_position_embeddings=max(seq, 4096),
                              remat=_REMAT.value, **over)
  c = ml_collections.ConfigDict(dict(
      stage=stage, optimizer=_OPTIMIZER.value, learning_rate=1e-3, adam_learning_rate=0.0,
      warmup_steps=10, total_steps=100, final_lr_fraction=0.1, weight_decay=0.1, grad_clip=1.0))
  tx = step_lib.make_optimizer(c)
  params = gnn.init_params(cfg, 0)
  opt_state = jax.jit(tx.init)(params)
  rng = np.random.default_rng(0)
  batch_d = {"tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, seq)), jnp.int32),
             "segment_ids": jnp.ones((batch, seq), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))}
  loss = functools.partial(step_lib.loss_fn, cfg=cfg, stage=stage, loss_chunk=_LOSS_CHUNK.value)
  state = step_lib.TrainState(jnp.zeros((), jnp.int32), params, opt_state,
                              jnp.zeros((2,), jnp.uint32))
  train = jax.jit(functools.partial(step_lib.train_step, cfg=cfg, stage=stage, tx=tx,
                                    loss_chunk=_LOSS_CHUNK.value, bias_rate=_BIAS_RATE.value,
                                    microbatches=_MICRO.value))
  mem = train.lower(state, batch_d).compile().memory_analysis()
  t_fwd = t_fb = t_opt = float("nan")
  if _SPLIT.value:
    fwd = jax.jit(lambda p, b: loss(p, b)[0])
    fwd_bwd = jax.jit(jax.grad(lambda p, b: loss(p, b)[0]))
    grads = fwd_bwd(params, batch_d)
    opt = jax.jit(lambda g, s, p: tx.update(g, s, p))
    t_fwd = timing.median_time(fwd, params, batch_d, repeats=repeats)
    t_fb = timing.median_time(fwd_bwd, params, batch_d, repeats=repeats)
    t_opt = timing.median_time(opt, grads, opt_state, params, repeats=repeats)
  t_step = timing.median_time(lambda s, b: train(s, b)[1]["loss"], state, batch_d, repeats=repeats)
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  flops_tok = flops_lib.flops_per_token(cfg, seq, stage)
  n_chips = jax.device_count()
  tokens_per_s = batch * seq / t_step
  return {
      "preset": preset, "params": int(n_params), "batch": batch, "seq": seq,
      "tokens_per_s": tokens_per_s, "step_s": t_step, "forward_s": t_fwd,
      "backward_s": t_fb - t_fwd, "optimizer_s": t_opt,
      "flops_per_token": flops_tok, "n_chips": n_chips,
      "tflops_per_chip": tokens_per_s * flops_tok / n_chips / 1e12,
      "mfu": (flops_lib.mfu(tokens_per_s, flops_tok, n_chips, _PEAK.value)
              if _PEAK.value > 0 else None),
      "compiled_step_bytes": int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                 + mem.temp_size_in_bytes) if mem else None,
      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
  }


def main(argv):
  del argv
  print(f"backend={jax.default_backend()} devices={len(jax.devices())}")
  rows = []
  for p in _PRESETS.value:
    rows.append(bench_preset(p, _BATCH.value, _SEQ.value, _STAGE.value, _REPEATS.value))
    print(rows[-1], flush=True)
  head = (f"{'preset':<7}{'params':>12}{'tok/s':>9}{'step s':>9}{'fwd s':>8}{'bwd s':>8}"
          f"{'opt s':>8}{'GFLOP/tok':>10}{'TFLOP/s/chip':>13}{'MFU':>7}"
          f"{'XLA step MiB':>14}{'peak RSS MiB':>14}")
  print(head)
  for r in rows:
    mfu = f"{r['mfu']:>7.2%}" if r["mfu"] is not None else f"{'-':>7}"
    print(f"{r['preset']:<7}{r['params']:>12,}{r['tokens_per_s']:>9.0f}{r['step_s']:>9.3f}"
          f"{r['forward_s']:>8.3f}{r['backward_s']:>8.3f}{r['optimizer_s']:>8.3f}"
          f"{r['flops_per_token'] / 1e9:>10.4f}{r['tflops_per_chip']:>13.5f}{mfu}"
          f"{(r['compiled_step_bytes'] or 0) / 2**20:>14.1f}{r['peak_rss_bytes'] / 2**20:>14.1f}")
  with open(_OUT.value, "w") as f:
    json.dump(rows, f, indent=2)


if __name__ == "__main__":
  app.run(main)
