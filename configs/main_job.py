r"""The main job: the tiny model through pretrain -> DSA warm-up -> DSA sparse -> SFT -> GRPO.

  python -m experiments.main_job --config=configs/main_job.py --workdir=workdir/main
"""

import ml_collections

from configs import pretrain
from configs import rl


def get_config(arg=None):
  c = pretrain.get_config("model=tiny,runlocal=True" + (f",{arg}" if arg else ""))
  c.batch_size = 8
  c.seq_len = 256
  c.learning_rate = 1e-2
  c.warmup_steps = 20
  c.log_every = 20
  c.eval_every = 100
  c.eval_batches = 8
  c.async_checkpoints = True
  c.stages = ml_collections.ConfigDict({
      "pretrain_steps": 300,
      "warmup_steps": 60,                  # DSA dense warm-up: only the indexer trains
      "warmup_learning_rate": 1e-2,
      "sparse_steps": 100,                 # sparse adaptation, and the dense baseline
      "adapt_learning_rate": 2e-3,
  })
  # Post-training (GLM-5 §3): SFT on a verifiable task, then synchronous GRPO + IcePop.
  task = "arith"
  c.post = ml_collections.ConfigDict({
      "enabled": True,
      "task": task,
      "task_options": ml_collections.ConfigDict(dict(min_digits=1, max_digits=2, ops="+")),
      "sft_conversations": 7000,
      "sft_steps": 600,                    # ~80% held-out accuracy (300 steps: ~4%)
      "sft_learning_rate": 2e-3,
      "sft_warmup_steps": 20,
      "rl": rl.get_config(f"task={task},runlocal=True"),
  })
  r = c.post.rl
  r.total_steps = 60
  r.learning_rate = 2e-5                   # Muon's updates have a fixed size: small for RL
  r.log_every = 20
  r.rl.group_size = 4                      # many prompts, few samples each: see
  r.rl.prompts_per_step = 64               # docs/post_training.md for the sweep
  r.rl.max_new_tokens = 8
  r.rl.eval_every = 50
  r.rl.checkpoint_every = 50
  return c
