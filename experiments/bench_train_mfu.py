r"""Forward + backward of a mid-sized GLM-5-shaped model, dense and DSA: step time and MFU.

  # accelerator (bfloat16; one H200 holds it):
  python -m experiments.bench_train_mfu --peak_tflops=630.92 --out=train_mfu.json
  # CPU, tiny shapes (checks that the script runs; the kernels run in the interpreter):
  python -m experiments.bench_train_mfu --smoke --out=/tmp/train_mfu.json

`jax.value_and_grad` of the training loss, no optimizer: next-token cross-entropy
(sequence-chunked, `losses.chunked_cross_entropy`), plus for DSA the indexer's KL loss,
as in the `dense` warm-up-free pretraining stage and the `dsa_sparse` stage. Nothing
here needs optax, orbax or grain (the device image has only jax, flax and absl).

The model is the `mid` preset (glm5_jax/config.py): GLM-5's per-layer shapes (hidden
6144, 64 heads, q_lora 2048, kv_lora 512, indexer 32 x 128, top-k 2048, expert width
2048) with 1 dense + 3 MoE layers, 16 routed experts (8 per token), a 32K vocabulary and
no MTP, so that one GPU holds it with its gradients: 3.25B parameters, about 2.3B active
per token (float32 master weights, bfloat16 compute). Model FLOPs per token
come from `glm5_jax/train/flops.py` (attention included; stage `pretrain` for dense,
`dsa_sparse` for DSA); MFU = model FLOP/s / --peak_tflops. The DSA run uses the Pallas
kernels (`attention_impl="pallas"`). Each row is written to the JSON when it is done, so
a run cut short keeps what it measured.
"""

import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import rows as rows_lib
from glm5_jax import config as config_lib
from glm5_jax import losses
from glm5_jax import nn as gnn
from glm5_jax import timing
from glm5_jax.train import flops as flops_lib

RUNS = {"dense": ("dense", "pretrain"), "dsa": ("sparse", "dsa_sparse")}

_RUNS = flags.DEFINE_list("runs", list(RUNS), f"subset of {tuple(RUNS)}")
_SEQ = flags.DEFINE_integer("seq", 8192, "sequence length (--smoke: 128)")
_BATCH = flags.DEFINE_integer("batch", 1, "sequences per step")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed steps (median)")
_PEAK = flags.DEFINE_float("peak_tflops", 0.0, "one chip's peak TFLOP/s (0: measure a matmul)")
_LOSS_CHUNK = flags.DEFINE_integer("loss_chunk", 1024, "cross-entropy sequence chunk")
_SMOKE = flags.DEFINE_bool("smoke", False, "tiny model, float32, seq 128 (a CPU check)")
_OUT = flags.DEFINE_string("out", "", "JSON output path (optional)")


def model_config(run: str, seq: int, smoke: bool):
  """The `mid` preset in bfloat16 (--smoke: `tiny` in float32), without MTP."""
  attention, _ = RUNS[run]
  return config_lib.get_preset("tiny" if smoke else "mid", attention_type=attention,
                               attention_impl="pallas", dtype="float32" if smoke else "bfloat16",
                               max_position_embeddings=max(seq, 4096), mtp_num_steps=0,
                               num_nextn_predict_layers=0)


def loss_fn(cfg, loss_chunk):
  """params, tokens -> CE (+ indexer KL for sparse attention, its coefficient applied)."""
  with_kl = cfg.attention_type == "sparse"

  def loss(params, tokens):
    out = gnn.GLM5(cfg).apply({"params": params}, tokens, with_indexer_loss=with_kl,
                              return_logits=False, mtp=False)
    y, m = losses.next_token_targets(tokens)
    ce, _ = losses.chunked_cross_entropy(out.hidden, params["lm_head"]["kernel"], y, m,
                                         chunk_size=loss_chunk)
    kl = jnp.sum(out.indexer_kl) * cfg.indexer_loss_coeff if with_kl else 0.0
    return ce + kl
  return loss


def bench_run(run, seq, batch, repeats, peak, loss_chunk, smoke):
  cfg = model_config(run, seq, smoke)
  _, stage = RUNS[run]
  params = gnn.init_params(cfg, 0, on_host=smoke)   # on device: no 13 GB numpy draw
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (batch, seq)),
                       jnp.int32)
  step = jax.jit(jax.value_and_grad(loss_fn(cfg, loss_chunk)))
  t0 = time.perf_counter()
  loss, grads = step(params, tokens)
  jax.block_until_ready(grads)
  compile_s = time.perf_counter() - t0
  del grads
  secs = timing.median_time(lambda p, t: step(p, t)[0], params, tokens, repeats=repeats)
  per_token = flops_lib.flops_per_token(cfg, seq, stage)
  tflops = per_token * batch * seq / secs / 1e12
  return dict(run=run, stage=stage, attention=cfg.attention_type, impl=cfg.attention_impl,
              dtype=cfg.dtype, seq=seq, batch=batch, params=n_params, loss=float(loss),
              compile_first_step_s=compile_s, step_s=secs, tokens_per_s=batch * seq / secs,
              model_gflop_per_token=per_token / 1e9, tflops=tflops,
              mfu=tflops / peak if peak else None)


def main(argv):
  del argv
  bad = set(_RUNS.value) - set(RUNS)
  if bad:
    raise ValueError(f"--runs: {sorted(bad)} unknown; expected a subset of {tuple(RUNS)}")
  smoke = _SMOKE.value
  seq = 128 if smoke else _SEQ.value
  peak = _PEAK.value
  if not peak:
    from experiments import kernel_ops  # pylint: disable=g-import-not-at-top
    peak = kernel_ops.measure_peaks(jnp.bfloat16)[0]
  device = jax.devices()[0].device_kind
  print(f"device: {device}; peak {peak:.1f} TFLOP/s; seq {seq} x batch {_BATCH.value}",
        flush=True)
  describe = lambda r: (f"  {r['run']:<6} {r['step_s'] * 1e3:9.1f} ms  {r['tokens_per_s']:9.0f} "
                        f"tok/s  {r['model_gflop_per_token']:7.2f} GFLOP/tok  "
                        f"{r['tflops']:7.1f} TFLOP/s  MFU {r['mfu']:.1%}  (first step "
                        f"{r['compile_first_step_s']:.0f} s, {r['params'] / 1e9:.2f}B params)")
  rows_lib.measure_rows(
      "run", _RUNS.value,
      lambda run: bench_run(run, seq, _BATCH.value, _REPEATS.value, peak, _LOSS_CHUNK.value,
                            smoke),
      describe, _OUT.value, dict(device=device, peak_tflops=peak))

if __name__ == "__main__":
  app.run(main)
