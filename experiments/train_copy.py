r"""Does a model learn in-context copying? Train it on synthetic copy rows, score both kinds.

  python -m experiments.train_copy --config.copy.train=position --config.total_steps=600 \
      --out=/tmp/copy_position
  python -m experiments.train_copy --config.total_steps=2000 --out=/tmp/copy_content
  python -m experiments.train_copy --config.model.hidden_size=128 --config.model.kv_lora_rank=64 ...

Rows and the two scores: glm5_jax/data/copy_task.py; the run: `train.loop.run` with the copy
task's batch source (glm5_jax/train/copy_source.py). `copy.train=position` trains on blocks
of a fixed segment length and gap (a copy sits a fixed distance after its source), `content`
on lengths drawn per block. Every `copy.eval_every` steps the held-out copy accuracy of both
kinds is logged. The model, loss, optimizer and update are the pretraining stage's (dense
attention, LM + MTP loss; `configs/copy_task.py` is `configs/pretrain.py` with the task's
batch, length and schedule, every field overridable); `--config.init_from` starts from a
workdir's parameters. --out is the run's workdir (checkpoints, metrics.jsonl: run again, it
resumes); writes copy_task.json and copy_task.png (accuracy against step) there.
"""

import json
import os

from absl import app
from absl import flags
from ml_collections import config_flags

from glm5_jax.train import copy_source
from glm5_jax.train import loop

_CONFIG = config_flags.DEFINE_config_file("config", "configs/copy_task.py", lock_config=True)
_OUT = flags.DEFINE_string("out", "/tmp/copy_task", "the run's workdir and output directory")


def _plot(result, path):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  for kind in copy_source.KINDS:
    ax.plot(result["steps"], result[f"{kind}_accuracy"], marker="o", label=f"{kind} copy")
  ax.set_xlabel("step")
  ax.set_ylabel("held-out copy accuracy")
  ax.set_ylim(0, 1)
  ax.set_title(f"{result['model']}, trained on {result['train']} rows")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv):
  del argv
  c = _CONFIG.value
  source = copy_source.CopySource(c)
  loop.run(c, _OUT.value, source)
  result = copy_source.curves(_OUT.value, c, source.model_name)
  with open(os.path.join(_OUT.value, "copy_task.json"), "w") as f:
    json.dump(result, f, indent=2)
  _plot(result, os.path.join(_OUT.value, "copy_task.png"))
  print(f"wrote {_OUT.value}/copy_task.json and copy_task.png")


if __name__ == "__main__":
  app.run(main)
