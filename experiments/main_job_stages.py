"""The paper's stage sequence, small: pretrain -> DSA dense warm-up -> DSA sparse adaptation
-> SFT -> reasoning RL (GRPO + IcePop) -> asynchronous RL.

Each stage runs in its own sub-workdir and starts from the previous stage's parameters
(`init_from`). A dense continuation of the pretrained model for as many steps as the sparse
adaptation is the baseline of our small-scale "DSA ~ MLA" comparison (GLM-5 paper §2, DSA
table). Post-training (§3) writes SFT conversations for `post.task`, fine-tunes on them
(`stage="sft"`) and runs synchronous GRPO on the same task (`glm5_jax.rl.orchestration.grpo`),
measuring held-out accuracy (greedy) after SFT and after GRPO; then `post.rl_async` continues from
GRPO's weights on the fully asynchronous loop (`glm5_jax.rl.orchestration.async_loop`, a rollout
worker on its own device). A stage already finished is read back, not run again.

Preemption (train/preemption.py): SIGTERM (or Ctrl-C) stops the running stage at a checkpoint and ends
the job (exit 0) before any later stage; the rerun resumes that stage and continues, so the
summary is the uninterrupted job's.
"""

from __future__ import annotations

import json
import os
import time

from absl import logging

from experiments import main_job_report as report
from glm5_jax.data import corpus
from glm5_jax.rl.envs import tasks
from glm5_jax.rl.orchestration import async_loop
from glm5_jax.rl.orchestration import grpo
from glm5_jax.train import loop
from glm5_jax.train import metrics as metrics_lib
from glm5_jax.train import workdir as workdir_lib


def _stage_config(base, stage: str, steps: int, init_from: str, lr: float, warmup: int):
  c = base.copy_and_resolve_references()
  with c.unlocked():
    c.stage = stage
    c.total_steps = steps
    c.init_from = init_from
    c.learning_rate = lr
    c.warmup_steps = warmup
    c.eval_every = min(c.eval_every, steps)
    c.checkpoint_every = steps
  return c


def sft_config(c, workdir: str):
  p = c.post
  sc = _stage_config(c, "sft", p.sft_steps, os.path.join(workdir, "dsa_sparse"),
                     p.sft_learning_rate, p.sft_warmup_steps)
  with sc.unlocked():
    sc.eval_every = p.sft_steps                     # held-out loss once, at the end
    sc.data.sources = os.path.join(workdir, "sft_data", f"{p.task}.jsonl")
    sc.data.dir = os.path.join(workdir, "sft_data", "prepared")
    sc.data.val_fraction = 0.02
  return sc


def rl_config(c, section, init_from: str):
  """The RL stage config `section` (c.post.rl, c.post.rl_async) on the job's task, from
  `init_from`."""
  rc = section.copy_and_resolve_references()
  with rc.unlocked():
    rc.init_from = init_from
    rc.seed = c.seed
    rc.allow_changed_run = c.allow_changed_run
    rc.data.tokenizer = c.data.tokenizer
    rc.rl.task = c.post.task
    rc.rl.task_options = c.post.task_options
  return rc


def _write_sft_data(c, workdir: str) -> str:
  path = os.path.join(workdir, "sft_data", f"{c.post.task}.jsonl")
  if not os.path.exists(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    task = tasks.get(c.post.task, **dict(c.post.task_options))
    task.write_sft(path + ".tmp", c.post.sft_conversations, c.seed,
                   think_fraction=c.post.think_fraction)
    os.replace(path + ".tmp", path)
  return path


def run_all(c, workdir: str) -> dict:
  """Runs every stage in `workdir/{pretrain,dense_baseline,dsa_warmup,dsa_sparse,sft,grpo,
  rl_async}`, holding the workdir's lock (train/workdir.py; each stage locks its own)."""
  with workdir_lib.lock(workdir):
    return _run_all(c, workdir)


def _run_all(c, workdir: str) -> dict:
  s = c.stages
  plan = [
      ("pretrain", "pretrain", s.pretrain_steps, "", c.learning_rate, c.warmup_steps),
      ("dense_baseline", "pretrain", s.sparse_steps, "pretrain", s.adapt_learning_rate, 0),
      ("dsa_warmup", "dsa_warmup", s.warmup_steps, "pretrain", s.warmup_learning_rate, 5),
      ("dsa_sparse", "dsa_sparse", s.sparse_steps, "dsa_warmup", s.adapt_learning_rate, 0),
  ]
  if c.post.enabled:
    _write_sft_data(c, workdir)    # first: a bad post-training option fails before pretraining
  results, timings = {}, {}
  for name, stage, steps, parent, lr, warm in plan:
    sub = os.path.join(workdir, name)
    init = os.path.join(workdir, parent) if parent else ""
    t0 = time.perf_counter()
    logging.info("=== %s: %s for %d steps%s", name, stage, steps, f" from {parent}" if parent else "")
    results[name] = loop.run(_stage_config(c, stage, steps, init, lr, warm), sub)
    timings[name] = time.perf_counter() - t0
  if c.post.enabled:
    t0 = time.perf_counter()
    logging.info("=== sft: %d steps on %s conversations from dsa_sparse", c.post.sft_steps,
                 c.post.task)
    results["sft"] = loop.run(sft_config(c, workdir), os.path.join(workdir, "sft"))
    timings["sft"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    logging.info("=== grpo: %d steps on %s from sft", c.post.rl.total_steps, c.post.task)
    results["grpo"] = grpo.run(rl_config(c, c.post.rl, os.path.join(workdir, "sft")),
                               os.path.join(workdir, "grpo"))
    timings["grpo"] = time.perf_counter() - t0
  if c.post.enabled and c.post.get("rl_async") and c.post.rl_async.total_steps > 0:
    t0 = time.perf_counter()
    logging.info("=== rl_async: %d updates on %s from grpo", c.post.rl_async.total_steps,
                 c.post.task)
    results["rl_async"] = async_loop.run(
        rl_config(c, c.post.rl_async, os.path.join(workdir, "grpo")),
        os.path.join(workdir, "rl_async"))
    timings["rl_async"] = time.perf_counter() - t0
  summary = report.summarize(results, timings, corpus.load_meta(c.data.dir), workdir)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(report.table(summary))
  report.plot({name: metrics_lib.read_rows(os.path.join(workdir, name)) for name in results},
              os.path.join(workdir, "loss_curves.png"))
  return summary
