r"""The main job on CPU: tiny model, forward + backward, summary.

  python -m experiments.main_job --config=configs/main_job.py:model=tiny --workdir=/tmp/glm5
"""

import json
import os

from absl import app
from absl import flags
from ml_collections import config_flags

from glm5_jax import smoke

_CONFIG = config_flags.DEFINE_config_file("config", "configs/main_job.py")
_WORKDIR = flags.DEFINE_string("workdir", "workdir/main", "where the summary JSON goes")


def main(argv):
  del argv
  result = smoke.run(_CONFIG.value)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  with open(os.path.join(_WORKDIR.value, "summary.json"), "w") as f:
    json.dump(result, f, indent=2)


if __name__ == "__main__":
  app.run(main)
