r"""Sweeps: one training run per point of a config file's sweep, then one table.

  python -m experiments.sweep --config=configs/pretrain.py:model=tiny,runlocal=True \
      --sweep=lr_x_optimizer --workdir=/tmp/sweep [--config.total_steps=50]
  ... --launch=tpu_vm --tpu='my-tpu us-central2-b'   # print launch/tpu_vm.sh commands instead

The sweeps are the config file's `SWEEPS` (glm5_jax/train/sweep.py); `--config.X=...` applies
to every point. Runs the points here (the same command again resumes an unfinished point and
skips a finished one), then writes WORKDIR/sweep.md (each point's final metrics, and mean ± std
over seeds when the points differ in `seed`), WORKDIR/sweep.json and WORKDIR/sweep.png
(experiments/sweep_report.py).
"""

import time

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import sweep_report
from glm5_jax.train import sweep

_CONFIG = config_flags.DEFINE_config_file("config", "configs/pretrain.py", "config file[:arg]",
                                          lock_config=True)
_SWEEP = flags.DEFINE_string("sweep", None, "a name in the config file's SWEEPS", required=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "the sweep's directory (a workdir per point)",
                               required=True)
_LAUNCH = flags.DEFINE_enum("launch", "local", ["local", "tpu_vm"],
                            "local: run the points here; tpu_vm: print one launch/tpu_vm.sh "
                            "command per point")
_TPU = flags.DEFINE_string("tpu", "$TPU_NAME $ZONE", "--launch=tpu_vm: TPU_NAME ZONE [PROJECT]")


def main(argv):
  del argv
  flag = flags.FLAGS["config"]
  config_arg = config_flags.get_config_filename(flag)
  swept = sweep.load_sweep(config_arg, _SWEEP.value)
  names = sweep.point_names(swept)
  points = sweep.with_flags(swept, config_flags.get_override_values(flag))
  if _LAUNCH.value == "tpu_vm":
    sweep.point_configs(_CONFIG.value, points)           # bad overrides fail here, not there
    print("\n".join(sweep.launch_commands(config_arg, points, _WORKDIR.value, _TPU.value, names)))
    return
  t0 = time.time()
  results = sweep.run_sweep(_CONFIG.value, points, _WORKDIR.value, names=names)
  sweep_report.write_report(results, _WORKDIR.value, wall_s=time.time() - t0,
                            title=f"sweep `{_SWEEP.value}` of `{config_arg}`")


if __name__ == "__main__":
  app.run(main)
