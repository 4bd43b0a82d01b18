r"""The main job: prepare the corpus, pretrain, DSA warm-up, DSA sparse adaptation, SFT, GRPO
and asynchronous RL (tiny, CPU).

  python -m experiments.main_job --config=configs/main_job.py --workdir=workdir/main

Ends with a summary table (held-out bits per byte per stage, indexer KL,
tokens/s) and WORKDIR/loss_curves.png. SIGTERM checkpoints the running stage and exits 0
before any later stage; the same command again continues where it stopped.
"""

from glm5_jax import numerics

numerics.batch_invariant_cpu()   # before JAX starts: engine and trainer agree bitwise on CPU
numerics.cpu_devices(2)          # training on device 0 (config.num_devices=1), the async RL
                                 # stage's rollout worker on device 1

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags

from experiments import cli
from experiments import main_job_stages

_CONFIG = cli.define_config("configs/main_job.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "workdir/main", "run directory")


def main(argv):
  del argv
  main_job_stages.run_all(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
