r"""The engine's decode step at batch 1 / 16 / 64 as a fraction of the HBM floor.

  # accelerator (the `mid` preset: GLM-5's layer shapes, 4 layers; bfloat16 weights):
  python -m experiments.bench_decode_step --peak_gbs=2453.5 --out=decode_step.json
  # CPU, tiny shapes (checks that the script runs):
  python -m experiments.bench_decode_step --smoke --out=/tmp/decode_step.json

For each batch size B, an `Engine` (glm5_jax/inference) with B slots generates
--new_tokens greedy tokens after B prompts of --prompt_len random tokens, once to
compile and once timed; the step time is the engine's decode time over its decode
steps (`last_stats`: device calls of --steps_per_sync steps, host work between them
included). DSA runs through the Pallas kernels (`attention_impl="pallas"`); the prompt
is longer than the top-k, so each step selects 2048 of about 3,000 cached rows.

The floor is the bytes a decode step must read over the memory bandwidth (--peak_gbs,
measured with a large copy when 0):
  weights   every parameter of the decoder once (bfloat16; the MTP layer not counted),
            the embedding table's B rows, and of the routed experts min(E, B K) per MoE
            layer (B tokens choosing K of E experts each: at least that many distinct ones
            when they disagree);
  cache     per layer and request, the indexer's float32 keys of every cached row and
            the top-k latent rows [c_kv | k_rope] that sparse attention gathers
            (glm5_jax/inference/roofline.py).
fraction = floor / measured step. Each row is written to the JSON when it is done.
"""

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import rows as rows_lib
from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.inference import roofline
from glm5_jax.nn import layer_stack

_BATCHES = flags.DEFINE_list("batches", ["1", "16", "64"], "engine slots (batch sizes)")
_PROMPT = flags.DEFINE_integer("prompt_len", 3000, "prompt tokens per request (> top-k)")
_NEW = flags.DEFINE_integer("new_tokens", 64, "generated tokens per request")
_STEPS = flags.DEFINE_integer("steps_per_sync", 8, "decode steps per engine device call")
_INVARIANT = flags.DEFINE_bool("batch_invariant", False,
                               "the engine's batch-invariant padding (RL's exactness mode)")
_PEAK_GBS = flags.DEFINE_float("peak_gbs", 0.0, "memory bandwidth, GB/s (0: measure a copy)")
_SMOKE = flags.DEFINE_bool("smoke", False, "tiny model, float32, short prompts (a CPU check)")
_OUT = flags.DEFINE_string("out", "", "JSON output path (optional)")


def model_config(smoke: bool, max_len: int):
  if smoke:
    return config_lib.get_preset("tiny", attention_impl="pallas", mtp_num_steps=0,
                                 num_nextn_predict_layers=0)
  return config_lib.get_preset("mid", attention_impl="pallas", dtype="bfloat16",
                               param_dtype="bfloat16", max_position_embeddings=max(max_len, 4096))


def floor_bytes(cfg, params, batch: int, context: float) -> dict:
  """Bytes one decode step must read (glm5_jax/inference/roofline.py), the routed experts
  estimated as min(E, B K) per MoE layer (the routing is not recorded here)."""
  n_moe = layer_stack.num_moe_layers(cfg)
  used = n_moe * min(cfg.n_routed_experts, batch * cfg.num_experts_per_tok)
  need = roofline.decode_bytes(cfg, params, used, [int(context)] * batch)
  return dict(weight_bytes=need["weights"] + need["experts"], cache_bytes=need["kv"],
              bytes=need["total"])


def bench_batch(cfg, params, batch, prompt_len, new_tokens, steps_per_sync, invariant,
                peak_gbs):
  eng = Engine(cfg, params, max_batch=batch, max_len=prompt_len + new_tokens + 16,
               prefill_chunk=512, steps_per_sync=steps_per_sync, batch_invariant=invariant)
  sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
  rng = np.random.default_rng(batch)
  prompts = lambda: [rng.integers(3, cfg.vocab_size, prompt_len).tolist() for _ in range(batch)]
  eng.generate(prompts(), sp)                          # compiles prefill and decode
  eng.generate(prompts(), sp)
  st = eng.last_stats
  step_s = st["decode_s"] / max(st["decode_steps"], 1)
  need = floor_bytes(cfg, params, batch, prompt_len + new_tokens / 2)
  floor_s = need["bytes"] / (peak_gbs * 1e9)
  return dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
              decode_steps=st["decode_steps"], decode_s=st["decode_s"], step_s=step_s,
              tokens_per_s=batch / step_s, floor_s=floor_s, fraction=floor_s / step_s, **need)


def main(argv):
  del argv
  smoke = _SMOKE.value
  prompt_len, new_tokens = (40, 16) if smoke else (_PROMPT.value, _NEW.value)
  cfg = model_config(smoke, prompt_len + new_tokens + 16)
  peak_gbs = _PEAK_GBS.value
  if not peak_gbs:
    from experiments import kernel_ops  # pylint: disable=g-import-not-at-top
    peak_gbs = kernel_ops.measure_peaks(jnp.bfloat16)[1]
  params = gnn.init_params(cfg, 0, on_host=smoke)
  device = jax.devices()[0].device_kind
  print(f"device: {device}; {peak_gbs:.0f} GB/s; prompt {prompt_len} + {new_tokens} tokens; "
        f"{sum(x.size for x in jax.tree_util.tree_leaves(params)) / 1e9:.2f}B params "
        f"({cfg.dtype})", flush=True)
  describe = lambda r: (f"  batch {r['batch']:>3}: {r['step_s'] * 1e3:8.2f} ms/step  "
                        f"{r['tokens_per_s']:9.0f} tok/s  floor {r['floor_s'] * 1e3:7.3f} ms "
                        f"({r['bytes'] / 1e9:.2f} GB)  fraction {r['fraction']:.1%}")
  rows_lib.measure_rows(
      "batch", [int(b) for b in _BATCHES.value],
      lambda batch: bench_batch(cfg, params, batch, prompt_len, new_tokens, _STEPS.value,
                                _INVARIANT.value, peak_gbs),
      describe, _OUT.value, dict(device=device, peak_gbs=peak_gbs, dtype=cfg.dtype))

if __name__ == "__main__":
  app.run(main)
