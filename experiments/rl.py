r"""Reasoning RL entry point (synchronous GRPO + IcePop, optional on-policy distillation).

  python -m experiments.rl --config=configs/rl.py:task=arith,runlocal=True \
      --config.init_from=/tmp/sft --workdir=/tmp/rl

SIGTERM (on any process) checkpoints and exits 0; the same command resumes exactly.
"""

from glm5_jax import numerics

numerics.batch_invariant_cpu()   # before JAX starts: engine and trainer agree bitwise on CPU

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags

from experiments import cli

from glm5_jax.rl.orchestration import grpo

_CONFIG = cli.define_config("configs/rl.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (checkpoints, metrics)",
                               required=True)


def main(argv):
  del argv
  grpo.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
