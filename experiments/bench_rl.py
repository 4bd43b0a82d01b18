r"""Synchronous RL step benchmark: rollout and trainer throughput, and where a step's time goes.

  python -m experiments.bench_rl --presets=tiny,small --out=/tmp/bench_rl.json

For each preset (random weights; the arithmetic task's prompts; responses run to
`--max_new_tokens` unless a stop token comes first), builds the engine and the trainer's
jitted functions exactly as `glm5_jax.rl.grpo` does, runs one GRPO step to compile, then
times `--steps` steps and reports, per step: rollout (engine generate), reward, recompute
(the trainer's log-probs of theta_old, with the top-k for the consistency check) and update
(`--minibatches` Muon Split steps) seconds; rollout tokens/s (generated tokens over rollout
time) and trainer tokens/s (tokens of the batch, prompt included, times the forward passes
over them: 1 recompute + 1 per update, over recompute + update time).
"""

from glm5_jax import numerics

numerics.batch_invariant_cpu()   # as the RL entry points run

# pylint: disable=g-import-not-at-top,wrong-import-position
import json
import time

from absl import app
from absl import flags
import jax
import numpy as np

from configs import rl as rl_config
from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax.rl import grpo

_PRESETS = flags.DEFINE_list("presets", ["tiny", "small"], "model presets")
_GROUP = flags.DEFINE_integer("group_size", 8, "samples per prompt")
_PROMPTS = flags.DEFINE_integer("prompts_per_step", 8, "prompts per step")
_MINIBATCHES = flags.DEFINE_integer("minibatches", 2, "updates per step")
_NEW = flags.DEFINE_integer("max_new_tokens", 32, "generated tokens per response (cap)")
_STEPS = flags.DEFINE_integer("steps", 3, "timed steps")
_OUT = flags.DEFINE_string("out", "", "JSON output path (optional)")


def bench(preset: str) -> dict:
  c = rl_config.get_config("task=arith")
  c.rl.update(dict(group_size=_GROUP.value, prompts_per_step=_PROMPTS.value,
                   minibatches=_MINIBATCHES.value, max_new_tokens=_NEW.value, max_len=128,
                   prefill_chunk=64))
  r = c.rl
  cfg = config_lib.get_preset(preset).replace(attention_type="sparse")
  params = gnn.init_params(cfg, 0)
  setup, state = grpo.build(c, cfg, params)
  run = lambda s, st: grpo.rl_step(setup, st, s)
  t0 = time.perf_counter()
  state, _ = run(0, state)                                  # compile
  compile_s = time.perf_counter() - t0
  rows = []
  for s in range(1, _STEPS.value + 1):
    t0 = time.perf_counter()
    state, m = run(s, state)
    setup.engine.update_params(state.params, version=s)
    m["step_s"] = time.perf_counter() - t0
    rows.append(m)
  mean = lambda k: float(np.mean([m[k] for m in rows]))
  n_req = r.group_size * r.prompts_per_step
  gen_tokens = mean("response_len_mean") * n_req
  batch_tokens = mean("batch_tokens")
  passes = 1 + r.minibatches
  return {"preset": preset, "params": int(sum(x.size for x in jax.tree.leaves(params))),
          "requests": n_req, "compile_s": compile_s, "step_s": mean("step_s"),
          "rollout_s": mean("rollout_s"), "reward_s": mean("reward_s"),
          "recompute_s": mean("recompute_s"), "update_s": mean("update_s"),
          "rollout_tokens_per_s": gen_tokens / mean("rollout_s"),
          "trainer_tokens_per_s": batch_tokens * passes / (mean("recompute_s") +
                                                           mean("update_s"))}


def main(argv):
  del argv
  res = [bench(p) for p in _PRESETS.value]
  head = (f"{'preset':<8}{'params':>11}{'reqs':>6}{'step s':>9}{'rollout':>9}{'reward':>8}"
          f"{'recomp':>8}{'update':>8}{'rollout tok/s':>15}{'trainer tok/s':>15}")
  print(f"device: {jax.devices()[0].device_kind}")
  print(head)
  print("-" * len(head))
  for x in res:
    print(f"{x['preset']:<8}{x['params']:>11,}{x['requests']:>6}{x['step_s']:>9.2f}"
          f"{x['rollout_s']:>9.2f}{x['reward_s']:>8.3f}{x['recompute_s']:>8.2f}"
          f"{x['update_s']:>8.2f}{x['rollout_tokens_per_s']:>15.0f}"
          f"{x['trainer_tokens_per_s']:>15.0f}")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "rows": res}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
