"""Rollout workers as threads of the trainer's process: the async loop's default backend.

  backend = LocalBackend(RolloutWorker)                 # weights: an InProcessWeights
  backend.start([{"worker_id": 0, "epoch": 0, ...}, {"worker_id": 1, "epoch": 0, ...}])
  backend.inbox(0).put(request); item = backend.outbox.get(timeout=1.0)
  backend.weights.publish(params, version)
  backend.kill(0); backend.restart(0, epoch=1); backend.shutdown()

A worker class is constructed from a picklable spec dict and runs
`worker.run(inbox, outbox, weights, should_stop)` until `should_stop()` is true; the same
class runs unchanged as a Ray actor (`glm5_jax/rl/orchestration/ray_backend.py`, same methods). Each
worker has its own inbox (the orchestrator routes requests to a replica,
`glm5_jax/rl/orchestration/routing.py`); all share one outbox (results and heartbeats carry the
worker id and epoch).

`kill` makes `should_stop()` true: the loop ends at its next check and the heartbeats stop
(a local worker is "killed" by stopping both). A thread cannot be interrupted, so a worker
busy with a request may still put that result on the outbox; it carries the old epoch and
the orchestrator's heartbeat monitor refuses it (fencing).
`restart` builds a new worker from the same spec at the new epoch, with a fresh inbox: what
the old inbox held is the dead worker's in-flight work, which the orchestrator re-queues.
"""

import dataclasses
import queue
import threading
import traceback

from absl import logging

from glm5_jax.rl.orchestration import weights as weights_lib


@dataclasses.dataclass
class _Worker:
  spec: dict
  inbox: queue.Queue
  stop: threading.Event
  thread: threading.Thread
  error: str | None = None


def worker_ids(specs) -> list:
  """The specs' `worker_id`s; ValueError on a spec without one or on duplicates."""
  ids = []
  for i, spec in enumerate(specs):
    if "worker_id" not in spec:
      raise ValueError(f"worker spec {i} has no 'worker_id' (keys: {sorted(spec)})")
    ids.append(spec["worker_id"])
  if len(set(ids)) != len(ids):
    raise ValueError(f"worker specs: duplicate worker_id in {ids}")
  return ids


class LocalBackend:
  """N workers of `worker_cls`, each in a daemon thread with its own inbox."""

  def __init__(self, worker_cls, weights=None, *, inbox_size: int = 0, outbox_size: int = 0):
    self.worker_cls = worker_cls
    self.weights = weights_lib.InProcessWeights() if weights is None else weights
    self.outbox = queue.Queue(outbox_size)
    self._inbox_size = inbox_size
    self._workers: dict = {}

  def start(self, specs) -> None:
    for worker_id in worker_ids(specs):
      if worker_id in self._workers:
        raise ValueError(f"LocalBackend.start: worker {worker_id!r} already started")
    for spec in specs:
      self._launch(dict(spec))

  def inbox(self, worker_id) -> queue.Queue:
    return self._get(worker_id).inbox

  def alive(self, worker_id) -> bool:
    w = self._get(worker_id)
    return w.thread.is_alive() and not w.stop.is_set()

  def errors(self) -> dict:
    """{worker_id: traceback} of workers whose `run` raised."""
    return {i: w.error for i, w in self._workers.items() if w.error is not None}

  def kill(self, worker_id) -> None:
    self._get(worker_id).stop.set()

  def restart(self, worker_id, epoch: int) -> None:
    old = self._get(worker_id)
    old.stop.set()
    self._launch({**old.spec, "epoch": epoch})

  def shutdown(self, timeout_s: float = 10.0) -> None:
    for w in self._workers.values():
      w.stop.set()
    for w in self._workers.values():
      w.thread.join(timeout_s)
      if w.thread.is_alive():
        logging.warning("LocalBackend.shutdown: worker %r still running after %.0f s",
                        w.spec["worker_id"], timeout_s)

  def _get(self, worker_id) -> _Worker:
    if worker_id not in self._workers:
      raise KeyError(f"LocalBackend: no worker {worker_id!r}; workers: {sorted(self._workers)}")
    return self._workers[worker_id]

  def _launch(self, spec: dict) -> None:
    stop, inbox = threading.Event(), queue.Queue(self._inbox_size)
    w = _Worker(spec, inbox, stop, thread=None)

    def body():
      try:
        self.worker_cls(spec).run(inbox, self.outbox, self.weights, stop.is_set)
      except Exception:  # pylint: disable=broad-except
        w.error = traceback.format_exc()
        logging.error("rollout worker %r (epoch %s) failed:\n%s", spec["worker_id"],
                      spec.get("epoch"), w.error)

    w.thread = threading.Thread(target=body, daemon=True,
                                name=f"rollout-{spec['worker_id']}-e{spec.get('epoch')}")
    self._workers[spec["worker_id"]] = w
    w.thread.start()
