r"""Pretraining entry point (every stage).

  python -m experiments.pretrain --config=configs/pretrain.py:model=tiny,runlocal=True --workdir=/tmp/glm5

SIGTERM (on any process) checkpoints and exits 0; the same command resumes exactly.
"""

from absl import app
from absl import flags

from experiments import cli

from glm5_jax import train

_CONFIG = cli.define_config("configs/pretrain.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (checkpoints, metrics)",
                               required=True)


def main(argv):
  del argv
  train.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
