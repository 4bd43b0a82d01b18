"""Rollout workers as processes of the run's jax.distributed cluster (backend="distributed").

Every process runs the same command (a pod's hosts, or local processes):

  python -m experiments.rl_async --config=configs/rl_async.py:backend=distributed \
      --config.rl.workers=1 --config.distributed.num_processes=2 \
      --config.distributed.process_id=$I --config.distributed.coordinator_address=HOST:PORT

Process 0 trains on its own devices (the trainer's mesh is process 0's local devices:
`train.loop` runs with `Source.solo`, so its collectives, checkpoints and preemption involve
process 0 alone); process i >= 1 calls `serve()` and hosts rollout worker i - 1 on its own
devices. No JAX program spans both sides: each side compiles and runs its own.

  backend = DistributedBackend(RolloutWorker, ShardedWeights(workdir + "/weights"))
  backend.start([{"worker_id": 0, "epoch": 0, ...}])   # same specs as LocalBackend
  backend.inbox(0).put(request); item = backend.outbox.get(timeout=1.0)
  backend.kill(0); backend.restart(0, epoch=1); backend.shutdown()

Messages travel through the key-value store of jax.distributed's coordination service (the
one orbax's multi-host barriers use): each inbox, each worker's outbox and each worker
process's control channel is a `KeyStream`, one producer's pickled items under keys
PREFIX/000000000000, PREFIX/000000000001, ..., deleted once read. Weights travel as sharded
snapshots in WORKDIR/weights (`snapshots.ShardedWeights`, a directory every process sees:
one machine, or a filesystem the pod shares): process 0 writes the shards its devices own,
each worker reads the slices its devices need.

A process cannot leave a jax.distributed cluster (the coordination service ends the job when
one dies), so `kill` stops the worker inside its process (its loop ends, its heartbeats
stop: the trainer fences it as silent) and `restart` starts a new one from the same spec at
the new epoch, with a fresh inbox, in the same process.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
import traceback

from absl import logging
import jax

from glm5_jax.rl.orchestration import snapshots as snapshots_lib
from glm5_jax.rl.orchestration import weights as weights_lib
from glm5_jax.rl.orchestration.local_backend import worker_ids

NAMESPACE = "glm5_rl"
_POLL_S = 0.002


def _client():
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError('backend="distributed" needs jax.distributed: set config.distributed '
                       "(coordinator_address, num_processes, process_id) on every process")
  return client


class KeyStream:
  """One producer's ordered items in the coordination service's key-value store.

  `put` (any thread of the producer's process) writes PREFIX/<n>; `get` (the consumer's
  process) waits for the next key, returns its item and deletes it. `get` raises
  `queue.Empty` after `timeout` seconds (0: look once; None: wait for ever), as `queue.Queue`
  does, so worker code catches the same exception under every backend."""

  def __init__(self, prefix: str, client=None):
    self.prefix = prefix
    self._client = client
    self._put = self._get = 0
    self._lock = threading.Lock()

  def __getstate__(self):
    return {"prefix": self.prefix}

  def __setstate__(self, d):
    self.__init__(d["prefix"])

  @property
  def client(self):
    if self._client is None:
      self._client = _client()
    return self._client

  def _key(self, n: int) -> str:
    return f"{self.prefix}/{n:012d}"

  def put(self, item, block: bool = True, timeout: float | None = None) -> None:
    del block, timeout                   # the store is unbounded
    blob = pickle.dumps(item)
    with self._lock:
      self.client.key_value_set_bytes(self._key(self._put), blob)
      self._put += 1

  def try_get(self):
    """The next item, or raises queue.Empty at once."""
    key = self._key(self._get)
    try:
      blob = self.client.key_value_try_get_bytes(key)
    except jax.errors.JaxRuntimeError as e:
      if "NOT_FOUND" in str(e):
        raise queue.Empty from None
      raise
    self.client.key_value_delete(key)
    self._get += 1
    return pickle.loads(blob)

  def get(self, block: bool = True, timeout: float | None = None):
    if not block or timeout == 0:
      return self.try_get()
    key = self._key(self._get)
    wait_ms = 3_600_000 if timeout is None else max(1, int(timeout * 1000))
    while True:
      try:
        blob = self.client.blocking_key_value_get_bytes(key, wait_ms)
        break
      except jax.errors.JaxRuntimeError as e:
        if "DEADLINE_EXCEEDED" not in str(e):
          raise
        if timeout is not None:
          raise queue.Empty from None
    self.client.key_value_delete(key)
    self._get += 1
    return pickle.loads(blob)


class MergedOutbox:
  """The trainer's view of every worker's outbox stream: `get` returns the next item of any
  (round robin), or raises queue.Empty after `timeout` seconds."""

  def __init__(self, streams: dict):
    self.streams = streams
    self._next = 0

  def get(self, block: bool = True, timeout: float | None = None):
    deadline = None if timeout is None or not block else time.monotonic() + timeout
    order = sorted(self.streams)
    while True:
      for i in range(len(order)):
        wid = order[(self._next + i) % len(order)]
        try:
          item = self.streams[wid].try_get()
        except queue.Empty:
          continue
        self._next = (self._next + i + 1) % len(order)
        return item
      if not block or (deadline is not None and time.monotonic() >= deadline):
        raise queue.Empty
      time.sleep(_POLL_S)


def _streams(worker_id):
  """(control, outbox) of worker `worker_id`'s process."""
  return (KeyStream(f"{NAMESPACE}/ctl/{worker_id}"), KeyStream(f"{NAMESPACE}/out/{worker_id}"))


def _inbox(worker_id, epoch: int) -> KeyStream:
  return KeyStream(f"{NAMESPACE}/in/{worker_id}/{epoch}")


class DistributedBackend:
  """Worker i in process i + 1 of the cluster (module docstring); `LocalBackend`'s methods."""

  STORES = (snapshots_lib.ShardedWeights, weights_lib.FileWeights)

  def __init__(self, worker_cls, weights):
    if not isinstance(weights, self.STORES):
      raise TypeError(f"DistributedBackend weights={type(weights).__name__}: expected one of "
                      f"{[t.__name__ for t in self.STORES]} (workers live in other processes)")
    self.worker_cls, self.weights = worker_cls, weights
    self._workers: dict = {}     # worker_id -> {"spec", "ctl", "inbox"}
    self.outbox = MergedOutbox({})

  def start(self, specs) -> None:
    ids = worker_ids(specs)
    n = jax.process_count() - 1
    if sorted(ids) != list(range(n)):
      raise ValueError(f"config.rl.workers={len(ids)}: backend='distributed' runs worker i "
                       f"in process i + 1; this cluster has {n} worker processes "
                       f"(config.distributed.num_processes={n + 1}): expected "
                       f"config.rl.workers={n}")
    for spec in specs:
      ctl, out = _streams(spec["worker_id"])
      self._workers[spec["worker_id"]] = {"spec": dict(spec), "ctl": ctl}
      self.outbox.streams[spec["worker_id"]] = out
      self._launch(dict(spec))

  def inbox(self, worker_id):
    return self._get(worker_id)["inbox"]

  def alive(self, worker_id) -> bool:
    """Started, not killed or shut down since, and its process's serving loop running."""
    return self._get(worker_id)["running"] and worker_id not in self.errors()

  def errors(self) -> dict:
    """{worker_id: error} of worker processes whose serving loop failed."""
    out = {}
    for worker_id in self._workers:
      try:
        out[worker_id] = _client().key_value_try_get(f"{NAMESPACE}/failed/{worker_id}")
      except jax.errors.JaxRuntimeError:
        pass
    return out

  def pid(self, worker_id) -> int:
    return int(_client().blocking_key_value_get(f"{NAMESPACE}/pid/{worker_id}", 60_000))

  def kill(self, worker_id) -> None:
    w = self._get(worker_id)
    w["ctl"].put(("stop",))
    w["running"] = False

  def restart(self, worker_id, epoch: int) -> None:
    w = self._get(worker_id)
    w["ctl"].put(("stop",))
    self._launch({**w["spec"], "epoch": epoch})

  def shutdown(self, timeout_s: float = 10.0) -> None:
    """Ends every worker's serving loop; waits up to `timeout_s` for each to say so."""
    for w in self._workers.values():
      w["ctl"].put(("exit",))
      w["running"] = False
    left, deadline = set(self._workers), time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
      left = {i for i in left if not _has(_client(), f"{NAMESPACE}/exited/{i}")}
      time.sleep(0.05)
    if left:
      logging.warning("DistributedBackend.shutdown: workers %s did not stop within %.0f s",
                      sorted(left), timeout_s)

  def _get(self, worker_id) -> dict:
    if worker_id not in self._workers:
      raise KeyError(f"DistributedBackend: no worker {worker_id!r}; workers: "
                     f"{sorted(self._workers)}")
    return self._workers[worker_id]

  def _launch(self, spec: dict) -> None:
    w = self._workers[spec["worker_id"]]
    w["spec"], w["inbox"], w["running"] = spec, _inbox(spec["worker_id"], spec["epoch"]), True
    w["ctl"].put(("start", self.worker_cls, spec, self.weights))


def finish() -> None:
  """The trainer's last word (process 0, however its run ended): every worker process's
  `serve` returns, so all processes reach jax.distributed's shutdown."""
  _client().key_value_set(f"{NAMESPACE}/finished", "1", allow_overwrite=True)


def _has(client, key: str) -> bool:
  try:
    client.key_value_try_get(key)
    return True
  except jax.errors.JaxRuntimeError:
    return False


def serve() -> None:
  """A worker process's life (process i >= 1 hosts worker i - 1): runs each worker the
  trainer starts until the trainer stops it, until the trainer says exit."""
  worker_id = jax.process_index() - 1
  client = _client()
  client.key_value_set(f"{NAMESPACE}/pid/{worker_id}", str(os.getpid()))
  ctl, outbox = _streams(worker_id)
  logging.info("rollout worker %d serving in process %d", worker_id, jax.process_index())
  pending, stop, lock = queue.Queue(), threading.Event(), threading.Lock()

  def watch():                  # control messages, read while a worker runs
    while True:
      try:
        msg = ctl.get(timeout=0.5)
      except queue.Empty:
        if not _has(client, f"{NAMESPACE}/finished"):
          continue
        msg = ("exit",)             # the trainer ended before it could say so
      with lock:
        if msg[0] in ("stop", "exit"):
          stop.set()
        pending.put(msg)
      if msg[0] == "exit":
        return

  threading.Thread(target=watch, daemon=True, name=f"ctl-{worker_id}").start()
  try:
    while True:
      msg = pending.get()
      if msg[0] == "exit":
        break
      if msg[0] == "stop":
        continue
      _, worker_cls, spec, weights = msg
      with lock:
        if not pending.empty():   # stopped (or superseded) before it began
          continue
        stop.clear()
      worker_cls(spec).run(_inbox(worker_id, spec["epoch"]), outbox, weights, stop.is_set)
  except BaseException:
    client.key_value_set(f"{NAMESPACE}/failed/{worker_id}", traceback.format_exc())
    raise
  finally:
    client.key_value_set(f"{NAMESPACE}/exited/{worker_id}", "1", allow_overwrite=True)
