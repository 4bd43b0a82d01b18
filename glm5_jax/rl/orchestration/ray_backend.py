"""Rollout workers as Ray actors, each its own process and JAX runtime (backend="ray").

  backend = RayBackend(RolloutWorker, ShardedWeights(workdir + "/weights"))
  backend.start([{"worker_id": 0, "epoch": 0, ...}, ...])   # same specs as LocalBackend
  backend.inbox(0).put(request); item = backend.outbox.get(timeout=1.0)
  backend.weights.publish(params, version)                    # the trainer, every K updates
  backend.kill(0)            # ray.kill: the process dies mid-run (fault injection)
  backend.restart(0, epoch=1); backend.shutdown()

The methods are `LocalBackend`'s (`glm5_jax/rl/orchestration/local_backend.py`) and the worker class
is the same: an actor wraps it and calls `worker.run(inbox, outbox, weights, should_stop)` as one
long-running method. The actor is threaded (`max_concurrency=2`) so that `stop()` can set
`should_stop` while `run` is busy. Queues are `ray.util.queue.Queue` (an actor each; its
`Empty` / `Full` subclass `queue.Empty` / `queue.Full`, so worker code catches the same
exceptions under both backends). Weights travel as snapshots on disk (`snapshots.ShardedWeights`:
each process writes its own shards and reads its own slices, or `weights.FileWeights`: one
file): the object is a directory path, so every process on the machine (or on a shared
filesystem) pulls the same checksummed files.

Each actor gets `num_cpus` CPUs of the cluster and an environment of its own (runtime_env
`env_vars`): `JAX_PLATFORMS=cpu` and one thread per op unless `env_vars` says otherwise, and
the driver's XLA_FLAGS without `--xla_force_host_platform_device_count` (that is the
trainer's device split, not the worker's). Ray is optional: `pip install -e ".[ray]"`.
"""

import os
import threading

from glm5_jax.rl.orchestration import snapshots as snapshots_lib
from glm5_jax.rl.orchestration import weights as weights_lib
from glm5_jax.rl.orchestration.local_backend import worker_ids

THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _ray():
  try:
    import ray  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError('backend="ray" needs Ray, an optional extra: pip install -e ".[ray]"'
                      ) from None
  return ray


def init(address: str | None = None) -> None:
  """Starts (or joins, `address`) a Ray instance unless one is up. Call it before JAX starts
  its runtime: Ray forks helper processes, which a multithreaded JAX process should not."""
  ray = _ray()
  if not ray.is_initialized():
    ray.init(address=address, include_dashboard=False)


def worker_env(env_vars: dict | None = None) -> dict:
  """The environment variables of a worker actor: CPU JAX, single-threaded ops, the driver's
  XLA_FLAGS minus the fake device count; `env_vars` entries override."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  flags.append("--xla_cpu_multi_thread_eigen=false")
  env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags), **THREAD_ENV}
  return {**env, **(env_vars or {})}


class WorkerActor:
  """Holds one worker; `run` blocks for the worker's life, `stop` ends it from outside."""

  def __init__(self, worker_cls, spec: dict):
    self._stop = threading.Event()
    self.worker = worker_cls(spec)

  def run(self, inbox, outbox, weights) -> None:
    self.worker.run(inbox, outbox, weights, self._stop.is_set)

  def stop(self) -> None:
    self._stop.set()

  def pid(self) -> int:
    return os.getpid()


class RayBackend:
  """N workers of `worker_cls` as Ray actors; starts a local Ray instance unless one is up."""

  # Stores other processes can read: a directory on disk.
  STORES = (snapshots_lib.ShardedWeights, weights_lib.FileWeights)

  def __init__(self, worker_cls, weights, *, num_cpus: float = 1,
               num_gpus: float = 0, env_vars: dict | None = None, address: str | None = None,
               inbox_size: int = 0, outbox_size: int = 0):
    ray = _ray()
    if not isinstance(weights, self.STORES):
      raise TypeError(f"RayBackend weights={type(weights).__name__}: expected one of "
                      f"{[t.__name__ for t in self.STORES]} (actors live in other processes; "
                      "an in-process store cannot reach them)")
    init(address)
    from ray.util import queue as ray_queue  # pylint: disable=g-import-not-at-top
    self._ray, self._queue = ray, ray_queue
    self.worker_cls, self.weights = worker_cls, weights
    self._options = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_concurrency": 2,
                     "runtime_env": {"env_vars": worker_env(env_vars)}}
    self._inbox_size = inbox_size
    self.outbox = self._new_queue(outbox_size)
    self._actor_cls = ray.remote(WorkerActor)
    self._workers: dict = {}      # worker_id -> {"spec", "actor", "inbox", "run"}

  def start(self, specs) -> None:
    for worker_id in worker_ids(specs):
      if worker_id in self._workers:
        raise ValueError(f"RayBackend.start: worker {worker_id!r} already started")
    for spec in specs:
      self._launch(dict(spec))

  def inbox(self, worker_id):
    return self._get(worker_id)["inbox"]

  def alive(self, worker_id) -> bool:
    ready, _ = self._ray.wait([self._get(worker_id)["run"]], timeout=0)
    return not ready

  def errors(self) -> dict:
    """{worker_id: error} of workers whose `run` raised or whose process died."""
    out = {}
    for worker_id, w in self._workers.items():
      ready, _ = self._ray.wait([w["run"]], timeout=0)
      if ready:
        try:
          self._ray.get(w["run"])
        except Exception as e:  # pylint: disable=broad-except
          out[worker_id] = f"{type(e).__name__}: {e}"
    return out

  def pid(self, worker_id) -> int:
    """The worker's process id (tests: each worker runs in its own process)."""
    return self._ray.get(self._get(worker_id)["actor"].pid.remote())

  def kill(self, worker_id) -> None:
    self._ray.kill(self._get(worker_id)["actor"], no_restart=True)

  def restart(self, worker_id, epoch: int) -> None:
    old = self._get(worker_id)
    self._ray.kill(old["actor"], no_restart=True)
    old["inbox"].shutdown()
    self._launch({**old["spec"], "epoch": epoch})

  def shutdown(self, timeout_s: float = 10.0) -> None:
    """Asks every worker to stop, waits up to `timeout_s`, then kills what is left."""
    live = [w for i, w in self._workers.items() if self.alive(i)]
    for w in live:
      w["actor"].stop.remote()
    self._ray.wait([w["run"] for w in live], num_returns=len(live), timeout=timeout_s)
    for w in self._workers.values():
      self._ray.kill(w["actor"], no_restart=True)
      w["inbox"].shutdown()
    self.outbox.shutdown()

  def _get(self, worker_id) -> dict:
    if worker_id not in self._workers:
      raise KeyError(f"RayBackend: no worker {worker_id!r}; workers: {sorted(self._workers)}")
    return self._workers[worker_id]

  def _new_queue(self, maxsize: int):
    return self._queue.Queue(maxsize, actor_options={"num_cpus": 0})

  def _launch(self, spec: dict) -> None:
    actor = self._actor_cls.options(**self._options).remote(self.worker_cls, spec)
    inbox = self._new_queue(self._inbox_size)
    run = actor.run.remote(inbox, self.outbox, self.weights)
    self._workers[spec["worker_id"]] = {"spec": spec, "actor": actor, "inbox": inbox,
                                        "run": run}
