r"""Held-out accuracy of a single-turn task's model, split by thinking mode, greedy and sampled.

  python -m experiments.eval_thinking --checkpoint=workdir/main/sft --task=arith \
      --options=min_digits=1,max_digits=2,ops=+ --problems=500 --samples=4

The prompt ends at `<|assistant|>` (thinking on): the model writes an empty reasoning block
or a non-empty one, then its answer, which the task's reward scores. Prints, for greedy
decoding and for `--samples` samples per problem at `--temperature`, the accuracy, the
fraction of responses that think, and the accuracy of each mode: what RL can select between
(docs/post_training.md, "GRPO learns when to think").
"""

import dataclasses

from glm5_jax import numerics

numerics.batch_invariant_cpu()   # before JAX starts: the same numerics as the RL runs

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import numpy as np

from configs import common
from glm5_jax import convert
from glm5_jax.data import chat
from glm5_jax.data import tokenizers
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.rl.envs import rewards
from glm5_jax.rl.envs import rollout
from glm5_jax.rl.envs import tasks

_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "workdir or HF directory", required=True)
_TASK = flags.DEFINE_string("task", "arith", f"one of {tasks.names()}")
_OPTIONS = flags.DEFINE_string("options", "", "task options, k=v,k=v (the task's Config fields)")
_PROBLEMS = flags.DEFINE_integer("problems", 500, "held-out problems")
_SEED = flags.DEFINE_integer("seed", 0, "held-out draw seed (the RL run's config.seed)")
_SAMPLES = flags.DEFINE_integer("samples", 4, "samples per problem in the sampled row")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "the sampled row's temperature")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "tokens per response")
_BATCH = flags.DEFINE_integer("batch", 128, "engine slots")


def _row(engine, task, problems, tok, sampling, k) -> dict:
  rows = rollout.scored_responses(engine, task, rewards.get(task.name), problems, tok, sampling,
                                  samples=k, enable_thinking=True)
  ok = np.asarray([reward >= 1.0 for reward, _ in rows])
  think = np.asarray([turn.reasoning is not None for _, turn in rows])
  mean = lambda x: float(np.mean(x)) if x.size else float("nan")
  return {"responses": len(rows), "accuracy": mean(ok), "thinking_rate": mean(think),
          "accuracy_thinking": mean(ok[think]), "accuracy_direct": mean(ok[~think])}


def main(argv):
  del argv
  if _TASK.value not in tasks.names():
    raise SystemExit(f"error: --task={_TASK.value!r}: expected a single-turn task, one of "
                     f"{tasks.names()}")
  defaults = dataclasses.asdict(tasks.get(_TASK.value).config)
  task = tasks.get(_TASK.value, **common.parse_arg(_OPTIONS.value, **defaults).to_dict())
  try:
    cfg, params = convert.load_model(_CHECKPOINT.value, what="checkpoint")
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: {e}") from None
  tok = tokenizers.ByteTokenizer()
  engine = Engine(cfg, params, max_batch=_BATCH.value, max_len=128, prefill_chunk=64)
  problems = task.problems("heldout", _PROBLEMS.value, _SEED.value)
  stop = chat.stop_ids(tok)
  print("| decoding | responses | accuracy | thinking rate | accuracy when thinking "
        "| accuracy when direct |\n|---|---|---|---|---|---|")
  for name, temperature, k in (("greedy", 0.0, 1),
                               (f"sampled, T = {_TEMPERATURE.value:g}", _TEMPERATURE.value,
                                _SAMPLES.value)):
    sp = SamplingParams(max_new_tokens=_MAX_NEW.value, temperature=temperature,
                        stop_token_ids=stop, seed=_SEED.value)
    r = _row(engine, task, problems, tok, sp, k)
    print(f"| {name} | {r['responses']} | {r['accuracy']:.3f} | {r['thinking_rate']:.3f} | "
          f"{r['accuracy_thinking']:.3f} | {r['accuracy_direct']:.3f} |")


if __name__ == "__main__":
  app.run(main)
