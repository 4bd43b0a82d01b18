r"""Greedy MTP acceptance: the engine's drafts vs drafts with training's per-step semantics.

  python -m experiments.eval_mtp_acceptance --checkpoint=workdir/main/dsa_sparse \
      --max_draft=5 --out=mtp_acceptance.json

For each prompt (64-byte windows of this package's source, `evals.mtp_acceptance.
code_prompts`): the greedy continuation from the plain engine, then for D = 1..max_draft
  - per-step: the acceptance length of drafts that follow training's per-step semantics
    (each MTP step attends to its own step's states), read off one trainer forward over the
    greedy sequence with D MTP steps (`evals.mtp_acceptance`);
  - engine: `Engine(speculative=True, num_draft=D)`'s measured acceptance length (its
    chained draft cache, inference/steps.py).
With D = 1 the two are the same computation. Prints a table and writes JSON.
"""

import json

from glm5_jax import numerics

numerics.batch_invariant_cpu()   # the trainer's forward then equals the engine's bitwise

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import convert
from glm5_jax import nn as gnn
from glm5_jax.evals import mtp_acceptance
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "workdir or HF directory (with MTP)",
                                  required=True)
_MAX_DRAFT = flags.DEFINE_integer("max_draft", 5, "largest D measured")
_PROMPTS = flags.DEFINE_integer("prompts", 8, "prompts")
_NEW = flags.DEFINE_integer("new_tokens", 96, "greedy tokens per prompt")
_OUT = flags.DEFINE_string("out", "mtp_acceptance.json", "JSON output path")


def main(argv):
  del argv
  cfg, params = convert.load_model(_CHECKPOINT.value)
  if not cfg.has_mtp:
    raise ValueError(f"--checkpoint={_CHECKPOINT.value}: the model has no MTP layer "
                     "(num_nextn_predict_layers=0)")
  if _MAX_DRAFT.value < 1:
    raise ValueError(f"--max_draft={_MAX_DRAFT.value}: expected >= 1")
  prompts = mtp_acceptance.code_prompts(_PROMPTS.value, 64, 0)
  sp = SamplingParams(max_new_tokens=_NEW.value, temperature=0.0)
  max_len = 64 + _NEW.value + 64
  plain = Engine(cfg, params, max_batch=1, max_len=max_len)
  seqs = [p + o.token_ids for p, o in zip(prompts, plain.generate(prompts, sp))]
  model = gnn.GLM5(cfg.replace(mtp_num_steps=_MAX_DRAFT.value))    # shared MTP weights
  fwd = jax.jit(lambda t: model.apply({"params": params}, t))
  per_step = {d: [] for d in range(1, _MAX_DRAFT.value + 1)}
  for p, seq in zip(prompts, seqs):
    out = fwd(jnp.asarray([seq], jnp.int32))
    greedy = np.asarray(jnp.argmax(out.logits[0], -1))[len(p) - 1:-1]
    if not np.array_equal(greedy, seq[len(p):]):
      raise RuntimeError("the trainer's forward does not reproduce the engine's greedy "
                         "tokens: the per-step numbers would not be comparable")
    draft_argmax_kt = np.asarray(jnp.argmax(out.mtp_logits[:, 0], -1))
    for d in per_step:
      per_step[d].append(mtp_acceptance.greedy_acceptance_length(seq, len(p), d,
                                                                  draft_argmax_kt))
  rows = []
  print(f"{'D':>3} {'per-step semantics':>19} {'engine (chained)':>17}")
  for d, values in per_step.items():
    eng = Engine(cfg, params, max_batch=1, max_len=max_len, speculative=True, num_draft=d,
                 rounds_per_sync=32)
    engine = [o.acceptance_length for o in (eng.generate([p], sp)[0] for p in prompts)]
    rows.append({"num_draft": d, "per_step": float(np.mean(values)),
                 "engine": float(np.mean(engine)), "per_step_per_prompt": values,
                 "engine_per_prompt": engine})
    print(f"{d:>3} {rows[-1]['per_step']:>19.3f} {rows[-1]['engine']:>17.3f}", flush=True)
  with open(_OUT.value, "w") as f:
    json.dump({"checkpoint": _CHECKPOINT.value, "prompts": len(prompts),
               "new_tokens": _NEW.value, "rows": rows}, f, indent=1)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
