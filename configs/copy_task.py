r"""The synthetic copy task (experiments/train_copy.py): the pretraining stage's model, loss and
optimizer on copy rows (glm5_jax/data/copy_task.py).

  python -m experiments.train_copy --config=configs/copy_task.py --config.copy.train=position \
      --config.total_steps=600
  python -m experiments.train_copy --config=configs/copy_task.py:model=small ...
  python -m experiments.train_copy --config.model.hidden_size=128 --config.batch_size=32 ...
"""

import ml_collections

from configs import pretrain


def get_config(arg=None):
  c = pretrain.get_config("runlocal=True" + (f",{arg}" if arg else ""))   # arg: model=NAME
  c.batch_size = 8
  c.seq_len = 256
  c.loss_chunk = 256
  c.total_steps = 1000
  c.learning_rate = 1e-2
  c.warmup_steps = 20
  c.copy = ml_collections.ConfigDict({
      "train": "content",        # kind of the training rows: position | content
      "eval_every": 100,         # steps between held-out evaluations
      "eval_rows": 32,           # held-out rows per kind
  })
  return c
