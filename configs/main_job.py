"""The tiny CPU main job: `--config=configs/main_job.py:model=tiny`."""

import ml_collections

from configs import common


def get_config(arg=None):
  a = common.parse_arg(arg, model="tiny", batch_size=2, seq_len=128)
  config = ml_collections.ConfigDict()
  config.model = ml_collections.ConfigDict({"preset": a.model})
  config.batch_size = a.batch_size
  config.seq_len = a.seq_len
  config.seed = 0
  return config
