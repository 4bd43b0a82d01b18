r"""Prints parameter counts and KV-cache sizes of a GLM-5 config; last line is JSON.

  python -m experiments.model_summary --config=configs/model_summary.py:model=glm5
"""

import json

from absl import app
from ml_collections import config_flags

from glm5_jax import config as config_lib
from glm5_jax import summary

_CONFIG = config_flags.DEFINE_config_file("config", "configs/model_summary.py")


def main(argv):
  del argv
  cfg = config_lib.from_config_dict(_CONFIG.value.model)
  table, result = summary.report(cfg, _CONFIG.value.model.preset)
  print(table)
  print(json.dumps({k: result[k] for k in ("total_params", "total_params_with_mtp",
                                           "active_params")}))


if __name__ == "__main__":
  app.run(main)
