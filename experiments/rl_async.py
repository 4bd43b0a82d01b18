r"""Asynchronous agentic RL entry point (GLM-5 §3; glm5_jax/rl/orchestration/async_loop.py).

  python -m experiments.rl_async --config=configs/rl_async.py:task=tool_calc,runlocal=True \
      --config.init_from=/tmp/tool_sft --workdir=/tmp/rl_async

On CPU the rollout workers and the trainer get separate devices: set
`--devices=N` (fake XLA:CPU devices, before JAX starts; default 1 + config.rl.workers).
SIGTERM checkpoints and exits 0; the same command resumes.

Trainer and rollout workers as processes of one jax.distributed cluster (process 0 trains,
process i + 1 serves worker i; glm5_jax/rl/orchestration/distributed_backend.py), here two local
ones:

  for I in 0 1; do python -m experiments.rl_async --devices=1 \
      --config=configs/rl_async.py:task=tool_calc,backend=distributed,runlocal=True \
      --config.rl.workers=1 --config.init_from=/tmp/tool_sft --workdir=/tmp/rl_dist \
      --config.distributed.coordinator_address=127.0.0.1:12355 \
      --config.distributed.num_processes=2 --config.distributed.process_id=$I \
      --config.distributed.cpu_collectives=True & done; wait
"""

import sys

from glm5_jax import numerics

numerics.batch_invariant_cpu()   # before JAX starts: engine and trainer agree bitwise on CPU


# --devices=N (default 3) as fake XLA:CPU devices, before JAX starts.
numerics.cpu_devices(int(next((a.split("=", 1)[1] for a in sys.argv
                               if a.startswith("--devices=")), "3")))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags

from experiments import cli

from glm5_jax.rl.orchestration import async_loop

_CONFIG = cli.define_config("configs/rl_async.py", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (checkpoints, metrics, ledger)",
                               required=True)
flags.DEFINE_integer("devices", 3, "XLA:CPU devices (trainer + workers); read before JAX "
                     "starts, ignored on accelerators")


def main(argv):
  del argv
  if _CONFIG.value.rl.backend == "ray":
    from glm5_jax.rl.orchestration import ray_backend
    ray_backend.init()             # before JAX's runtime starts (Ray forks)
  async_loop.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
