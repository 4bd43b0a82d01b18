"""Model summary: `--config=configs/model_summary.py:model=glm5` (or tiny, small)."""

import ml_collections

from configs import common


def get_config(arg=None):
  a = common.parse_arg(arg, model="glm5")
  config = ml_collections.ConfigDict()
  config.model = ml_collections.ConfigDict({"preset": a.model})
  return config
