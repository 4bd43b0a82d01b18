r"""Decode throughput of the inference engine on CPU: absorbed vs expanded MLA, KV bytes, MTP.

  python -m experiments.bench_decode --presets=tiny,small --contexts=1024,8192 \
      --out=/tmp/bench_decode.json

For each preset and context length: one request (batch 1) is prefilled to the
context in a session, then `--new_tokens` greedy tokens are decoded with the
absorbed form (MQA over the cached latent rows, spec §2.3) and with the
expanded form (per-head K/V up-projected from the gathered top-k latent rows,
spec §2.2), each timed after a warm-up call that compiles it. Both forms read
the same latent cache; "KV bytes/token" compares it with the cache an
expanded-form engine would hold (per-head K and V).

Speculative decoding (tiny preset, first context): plain vs MTP-speculative
greedy decoding, acceptance length and speed-up. On random weights the MTP
head is no better than chance, so the acceptance length is ~1 and the
"speed-up" is a slowdown: these numbers test the plumbing, not the method;
rerun with --checkpoint once a pretrained checkpoint exists.
"""

import json

from absl import app
from absl import flags
import numpy as np

from glm5_jax import config as config_lib
from glm5_jax.train import checkpoint as train_checkpoint
from glm5_jax import nn as gnn
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.inference import forward

_PRESETS = flags.DEFINE_list("presets", ["tiny", "small"], "model presets")
_CONTEXTS = flags.DEFINE_list("contexts", ["1024", "8192"], "context lengths")
_NEW = flags.DEFINE_integer("new_tokens", 32, "timed decode tokens per point")
_SPEC = flags.DEFINE_boolean("speculative", True, "also time MTP speculative decoding")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed calls per point (median)")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None,
                                  "HF dir or pretraining workdir for the speculative run")
_OUT = flags.DEFINE_string("out", "bench_decode.json", "JSON output path")

_STEPS = 8                                      # decode steps per device call


def _max_len(ctx, n):
  """Cache length for a ctx-token prompt and the timed decodes of n tokens (plus warm-up)."""
  return ctx + (_REPEATS.value + 2) * (n + 1) + 64


def _decode_rate(engine, sid, n, form):
  """Median decode tokens/s of n greedy tokens appended to the session, over _REPEATS
  calls after a warm-up call that compiles."""
  warm = SamplingParams(max_new_tokens=_STEPS + 1, temperature=0.0)
  engine.generate([[]], warm, session_id=sid, attention_form=form)
  rates = []
  for _ in range(_REPEATS.value):
    out = engine.generate([[]], SamplingParams(max_new_tokens=n + 1, temperature=0.0),
                          session_id=sid, attention_form=form)[0]
    rates.append((len(out.token_ids) - 1) / engine.last_stats["decode_s"])
  return float(np.median(rates)), out


def bench_preset(preset, contexts, n):
  rows = []
  for ctx in contexts:
    max_len = _max_len(ctx, n)
    cfg = config_lib.get_preset(preset, max_position_embeddings=max_len)
    params = gnn.init_params(cfg, 0)
    engine = Engine(cfg, params, max_batch=1, max_len=max_len, prefill_chunk=512,
                    steps_per_sync=_STEPS)
    sid = engine.new_session()
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, ctx).tolist()
    engine.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0.0), session_id=sid)
    prefill_s = engine.last_stats["prefill_s"]
    row = {"preset": preset, "context": ctx, "prefill_s_incl_compile": prefill_s,
           **{f"kv_bytes_per_token_{k}": v for k, v in forward.kv_bytes_per_token(cfg).items()}}
    for form in forward.ATTENTION_FORMS:
      row[f"{form}_tok_s"], _ = _decode_rate(engine, sid, n, form)
    rows.append(row)
    print(f"  {row}", flush=True)
  return rows


def bench_speculative(ctx, n, checkpoint):
  max_len = _max_len(ctx, n)
  if checkpoint:
    cfg, params = train_checkpoint.load_model(checkpoint)
    cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, max_len))
  else:
    cfg = config_lib.get_preset("tiny", max_position_embeddings=max_len)
    params = gnn.init_params(cfg, 0)
  prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, ctx).tolist()
  result = {"context": ctx, "weights": checkpoint or "random (tiny)"}
  for spec in (False, True):
    engine = Engine(cfg, params, max_batch=1, max_len=max_len, prefill_chunk=512,
                    steps_per_sync=_STEPS, speculative=spec)
    sid = engine.new_session()
    engine.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0.0), session_id=sid)
    rate, out = _decode_rate(engine, sid, n, "absorbed")
    result["speculative_tok_s" if spec else "plain_tok_s"] = rate
    if spec:
      result["acceptance_length"] = out.acceptance_length
  result["speed_up"] = result["speculative_tok_s"] / result["plain_tok_s"]
  return result


def table(rows) -> str:
  head = (f"{'preset':>6} {'context':>7} | {'absorbed tok/s':>14} {'expanded tok/s':>14} | "
          f"{'KV B/token latent':>17} {'expanded-cache':>14}")
  lines = [head, "-" * len(head)]
  for r in rows:
    lines.append(f"{r['preset']:>6} {r['context']:>7} | {r['absorbed_tok_s']:>14.1f} "
                 f"{r['expanded_tok_s']:>14.1f} | {r['kv_bytes_per_token_latent']:>17} "
                 f"{r['kv_bytes_per_token_expanded_per_head']:>14}")
  return "\n".join(lines)


def main(argv):
  del argv
  contexts = [int(c) for c in _CONTEXTS.value]
  rows = []
  for preset in _PRESETS.value:
    rows += bench_preset(preset, contexts, _NEW.value)
  print(table(rows))
  result = {"rows": rows, "new_tokens": _NEW.value, "batch": 1}
  if _SPEC.value:
    spec = bench_speculative(contexts[0], _NEW.value, _CHECKPOINT.value)
    print(f"speculative ({spec['weights']}, context {spec['context']}): plain "
          f"{spec['plain_tok_s']:.1f} tok/s, MTP speculative {spec['speculative_tok_s']:.1f} "
          f"tok/s (x{spec['speed_up']:.2f}), mean acceptance length "
          f"{spec['acceptance_length']:.2f} tokens/verify"
          + ("  [random weights: meaningless]" if not _CHECKPOINT.value else ""))
    result["speculative"] = spec
  with open(_OUT.value, "w") as f:
    json.dump(result, f, indent=2)


if __name__ == "__main__":
  app.run(main)
