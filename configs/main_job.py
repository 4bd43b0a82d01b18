r"""The main job: the tiny model through pretrain -> DSA warm-up -> DSA sparse, on CPU.

  python -m experiments.main_job --config=configs/main_job.py --workdir=workdir/main
"""

import ml_collections

from configs import pretrain


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
  return c
