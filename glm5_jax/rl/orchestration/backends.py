"""Where the rollout workers run: config.rl.backend -> (backend, weights store), and devices.

  "local"        threads of this process on devices of their own, pulling the trainer's
                 device arrays (`weights.DeviceWeights`, `local_backend.LocalBackend`);
  "ray"          Ray actors reading snapshots from WORKDIR/weights (`ray_backend`);
  "distributed"  processes 1.. of this run's jax.distributed cluster, reading the same
                 snapshots (`distributed_backend`).
"""

from __future__ import annotations

import os

import jax

from glm5_jax.rl.orchestration import rollout_worker as worker_lib
from glm5_jax.rl.orchestration import snapshots as snapshots_lib
from glm5_jax.rl.orchestration import weights as weights_lib

# config.rl.snapshots -> the store Ray actors read versions from (files in the workdir).
SNAPSHOT_STORES = {"sharded": snapshots_lib.ShardedWeights, "file": weights_lib.FileWeights}


def make_backend(c, workdir):
  """(backend, weights store) for config.rl.backend: threads of this process pulling device
  arrays (`DeviceWeights`), or Ray actors or the jax.distributed cluster's other processes
  reading snapshots (config.rl.snapshots)."""
  if c.rl.backend == "local":
    from glm5_jax.rl.orchestration import local_backend  # pylint: disable=g-import-not-at-top
    store = weights_lib.DeviceWeights()
    return local_backend.LocalBackend(worker_lib.RolloutWorker, store), store
  store = SNAPSHOT_STORES[c.rl.snapshots](os.path.join(workdir, "weights"), keep=c.rl.tau + 2)
  if c.rl.backend == "distributed":
    from glm5_jax.rl.orchestration import distributed_backend  # pylint: disable=g-import-not-at-top
    return distributed_backend.DistributedBackend(worker_lib.RolloutWorker, store), store
  from glm5_jax.rl.orchestration import ray_backend  # pylint: disable=g-import-not-at-top
  env = None
  if c.rl.rollout_devices > 1:            # the actor's own fake CPU devices
    env = {"XLA_FLAGS": ray_backend.worker_env()["XLA_FLAGS"] +
           f" --xla_force_host_platform_device_count={c.rl.rollout_devices}"}
  return ray_backend.RayBackend(worker_lib.RolloutWorker, store, env_vars=env,
                                num_cpus=c.rl.ray_cpus_per_worker), store


def rollout_devices(n_trainer: int, n_workers: int, per_worker: int) -> list[list[int]]:
  """Each worker's device indices: `per_worker` devices each from those after the trainer's
  first `n_trainer` (round robin over them; all devices when none is left)."""
  n = jax.device_count()
  pool = list(range(n_trainer, n)) or list(range(n))
  return [[pool[(w * per_worker + j) % len(pool)] for j in range(per_worker)]
          for w in range(n_workers)]
