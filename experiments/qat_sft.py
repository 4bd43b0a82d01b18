r"""INT4 quantization-aware SFT against quantizing after the fact, on the main job's SFT task.

  python -m experiments.qat_sft --base=workdir/main --workdir=/tmp/qat --seeds=0,1,2

For each seed, the main job's SFT stage (`configs/main_job.py`: 600 steps of the arith
conversations from `BASE/dsa_sparse`, data in `BASE/sft_data`) runs twice: in float32, and
with INT4 QAT (`config.qat`: the routed experts, groups of 32, straight-through gradients).
Each model is then served by the inference engine and scored on the same 500 held-out
problems (greedy, thinking on, as the GRPO stage's evaluation):

  float          the float model, float32 weights
  float -> int4  the same model quantized to INT4 after training (post-training quantization)
  qat -> int4    the QAT model in INT4, the weights its training forward used (bitwise)
  qat (float)    the QAT model's float32 master weights, for reference

and a second protocol, QAT as the end of SFT: the float model continued for
`--finetune_steps` more steps at SFT's final learning rate, in float32 (the control) and with
INT4 QAT, then served:

  float+ft -> int4   the float continuation quantized after the fact
  qat ft -> int4     the QAT continuation in INT4

with each one's SFT held-out loss (the stage's validation conversations; INT4 ones through
the straight-through quantized forward, which is what the INT4 engine computes),

and the engine's weight memory and decode throughput, INT4 against float32, are measured on
the tiny model (greedy, batch 1 and 16). Writes WORKDIR/qat_sft.md and .json.
"""

from __future__ import annotations

from glm5_jax import numerics

numerics.batch_invariant_cpu()   # before JAX starts: engine and trainer agree bitwise on CPU
numerics.cpu_devices(2)          # as the main job, whose stages these runs repeat

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools
import json
import os
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from configs import main_job as main_job_config
from experiments import main_job_stages
from glm5_jax import convert
from glm5_jax import quant
from glm5_jax.data import chat
from glm5_jax.inference import Engine
from glm5_jax.inference import SamplingParams
from glm5_jax.rl.envs import rewards as rewards_lib
from glm5_jax.rl.envs import rollout as rollout_lib
from glm5_jax.rl.envs import tasks as tasks_lib
from glm5_jax.train import loop
from glm5_jax.train import step as step_lib

_BASE = flags.DEFINE_string("base", None, "a main job workdir (dsa_sparse, sft_data)",
                            required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory", required=True)
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "SFT seeds (data order, initialisation "
                           "of nothing else: every run starts from BASE/dsa_sparse)")
_GROUP = flags.DEFINE_integer("group_size", 32, "INT4 group size")
_TARGETS = flags.DEFINE_string("targets", "experts", "quantized weights: experts | attention | "
                               "all_linear")

_FINETUNE = flags.DEFINE_integer("finetune_steps", 100, "steps of the QAT-at-the-end protocol "
                                 "(0: not run)")

# variant -> (run, engine weight dtype); runs: "float", "qat" (600 SFT steps each), "ft_float",
# "ft_qat" (the float run continued for --finetune_steps)
VARIANTS = ("float", "float -> int4", "qat -> int4", "qat (float)", "float+ft -> int4",
            "qat ft -> int4")
_SERVED = {"float": ("float", "float32"), "float -> int4": ("float", "int4"),
           "qat -> int4": ("qat", "int4"), "qat (float)": ("qat", "float32"),
           "float+ft -> int4": ("ft_float", "int4"), "qat ft -> int4": ("ft_qat", "int4")}


def sft(seed: int, qat: bool, workdir: str, finetune_from: str = ""):
  """Runs (or finds finished) one SFT, or a `--finetune_steps` continuation of the SFT in
  `finetune_from` at SFT's final learning rate; returns (main job config, SFT config)."""
  c = main_job_config.get_config()
  with c.unlocked():
    c.seed = seed
  sc = main_job_stages.sft_config(c, _BASE.value)
  with sc.unlocked():
    if qat:
      sc.qat.update(bits=4, group_size=_GROUP.value, targets=_TARGETS.value)
    if finetune_from:
      sc.init_from = finetune_from
      sc.total_steps = sc.eval_every = sc.checkpoint_every = _FINETUNE.value
      sc.learning_rate = c.post.sft_learning_rate * sc.final_lr_fraction
      sc.final_lr_fraction, sc.warmup_steps = 1.0, 0
  loop.run(sc, workdir)
  return c, sc


def heldout_loss(sc, cfg, params, scheme) -> float:
  """The SFT stage's held-out loss (nats per assistant token) of params, through the
  quantized forward when `scheme` is given."""
  fn = jax.jit(functools.partial(step_lib.eval_step, cfg=cfg, stage="sft",
                                 loss_chunk=sc.loss_chunk, qat=scheme))
  it = iter(loop.make_dataset(sc, "validation", seed=0, shuffle=False))
  nll = tok = 0.0
  for _ in range(sc.eval_batches):
    out = jax.device_get(fn(params, {k: jnp.asarray(v) for k, v in next(it).items()}))
    nll, tok = nll + float(out["nll_sum"]), tok + float(out["tokens"])
  return nll / max(tok, 1.0)


def heldout(engine, c) -> dict:
  r = main_job_stages.rl_config(c, c.post.rl, "").rl          # the GRPO stage's task
  task, reward_fn = rewards_lib.task_and_reward(r)
  tok = chat.get_chat_tokenizer(c.data.tokenizer)
  problems = tasks_lib.heldout_problems(task, r, 0)          # one held-out set for every run
  return rollout_lib.heldout_accuracy(engine, task, reward_fn, problems, tok,
                                      max_new_tokens=r.max_new_tokens,
                                      enable_thinking=r.enable_thinking)


def engine_for(cfg, params, c, weight_dtype: str) -> Engine:
  r = c.post.rl.rl
  kw = ({} if weight_dtype == "float32" else
        dict(quant_block=_GROUP.value, quant_targets=_TARGETS.value))
  return Engine(cfg, params, max_batch=64, max_len=r.max_len, prefill_chunk=r.prefill_chunk,
                weight_dtype=weight_dtype, **kw)


def decode_speed(engine: Engine, batch: int, new_tokens: int = 64) -> float:
  """Generated tokens per second of greedy decoding (one warm-up call first)."""
  prompts = [[1 + (i % 50), 2, 3] for i in range(batch)]
  sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
  engine.generate(prompts, sp)
  t0 = time.perf_counter()
  outs = engine.generate(prompts, sp)
  return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def _mean_std(xs):
  return f"{100 * np.mean(xs):.1f}% +- {100 * np.std(xs):.1f}"


def main(argv):
  del argv
  seeds = [int(s) for s in _SEEDS.value]
  scheme = quant.Scheme("int4", _GROUP.value, _TARGETS.value)
  runs = {}
  variants = [v for v in VARIANTS if _FINETUNE.value or not _SERVED[v][0].startswith("ft")]
  for seed in seeds:
    row = {"accuracy": {}, "loss": {}}
    for run in ("float", "qat", "ft_float", "ft_qat"):
      if not any(_SERVED[v][0] == run for v in variants):
        continue
      qat = run.endswith("qat")
      wd = os.path.join(_WORKDIR.value, run, f"seed{seed}")
      logging.info("=== SFT seed %d, %s -> %s", seed, run, wd)
      c, sc = sft(seed, qat, wd, os.path.join(_WORKDIR.value, "float", f"seed{seed}")
                  if run.startswith("ft") else "")
      cfg, params = convert.load_model(wd)
      cfg = cfg.replace(attention_type="sparse")
      cache_path = os.path.join(wd, "qat_sft_evals.json")    # a rerun reads them back
      cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
      for name in (v for v in variants if _SERVED[v][0] == run):
        dtype = _SERVED[name][1]
        key = f"{name}|{scheme}"
        if key not in cache:
          cache[key] = {"accuracy": heldout(engine_for(cfg, params, c, dtype), c)["accuracy"],
                        "loss": heldout_loss(sc, cfg, params,
                                             scheme if dtype == "int4" else None)}
          with open(cache_path, "w") as f:
            json.dump(cache, f)
        row["accuracy"][name], row["loss"][name] = cache[key]["accuracy"], cache[key]["loss"]
        logging.info("seed %d %s: held-out accuracy %.3f, loss %.4f", seed, name,
                     row["accuracy"][name], row["loss"][name])
    runs[seed] = row
  lines = ["| seed | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
  for seed, row in runs.items():
    lines.append(f"| {seed} | " + " | ".join(
        f"{100 * row['accuracy'][v]:.1f}% ({row['loss'][v]:.4f})" for v in variants) + " |")
  lines.append("| mean +- std | " + " | ".join(
      _mean_std([r["accuracy"][v] for r in runs.values()]) for v in variants) + " |")
  lines.append("| held-out loss, mean | " + " | ".join(
      f"{np.mean([r['loss'][v] for r in runs.values()]):.4f}" for v in variants) + " |")
  # Memory and decode speed of the last seed's QAT model, INT4 against float32.
  speed = {}
  for dtype in ("float32", "int4"):
    e = engine_for(cfg, params, c, dtype)
    speed[dtype] = {"weight_bytes": quant.tree_nbytes(e.params),
                    **{f"decode_tok_s_batch{b}": decode_speed(e, b) for b in (1, 16)}}
  lines += ["", "| engine weights | bytes | decode tok/s, batch 1 | batch 16 |",
            "|---|---|---|---|"]
  for dtype, s in speed.items():
    lines.append(f"| {dtype} | {s['weight_bytes']:,} | {s['decode_tok_s_batch1']:.0f} | "
                 f"{s['decode_tok_s_batch16']:.0f} |")
  text = "\n".join(lines)
  print(text)
  out = os.path.join(_WORKDIR.value, "qat_sft")
  with open(out + ".md", "w") as f:
    f.write(text + "\n")
  with open(out + ".json", "w") as f:
    json.dump({"seeds": seeds, "group_size": _GROUP.value, "targets": _TARGETS.value,
               "runs": runs, "engine": speed}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
