"""Model summary: `--config=configs/model_summary.py:model=glm5` (or tiny, small)."""

import ml_collections

from configs import common
from glm5_jax import config as config_lib


def get_config(arg=None):
  a = common.parse_arg(arg, model="glm5")
  config = ml_collections.ConfigDict()
  config.model = config_lib.preset_config_dict(a.model)
  return config
