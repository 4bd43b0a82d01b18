"""Rollout-worker backends (glm5_jax/rl/orchestration/local_backend.py, ray_backend.py,
distributed_backend.py): one test body, three backends. Two toy workers serve requests under the weights the test publishes; one is killed
mid-run, restarted at a new epoch, and catches up to the latest version."""

import os
import queue
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.rl.orchestration import local_backend
from glm5_jax.rl.orchestration import weights as weights_lib
from tests import seeding
from tests import paths


class ToyWorker:
  """A rollout worker in miniature: heartbeats, pulls newer weights before each request, and
  answers x -> sum(w * x) + sum(b) computed with jax on the pulled weights."""

  def __init__(self, spec: dict):
    self.worker_id, self.epoch = spec["worker_id"], spec["epoch"]
    self.version, self.params = -1, None
    self.f = jax.jit(lambda p, x: jnp.sum(p["layer"]["w"] * x)
                     + jnp.sum(p["layer"]["b"].astype(jnp.float32)))

  def run(self, inbox, outbox, weights, should_stop) -> None:
    tag = {"worker_id": self.worker_id, "epoch": self.epoch}
    while not should_stop():
      outbox.put({"kind": "heartbeat", "version": self.version, **tag})
      try:
        x = inbox.get(timeout=0.05)
      except queue.Empty:
        continue
      if weights.version() > self.version:
        self.version, self.params = weights.latest()
      outbox.put({"kind": "result", "version": self.version, "x": x, "pid": os.getpid(),
                  "value": float(self.f(self.params, jnp.asarray(x))), **tag})


def _params(rng, version):
  del version
  return {"layer": {"w": rng.standard_normal(4).astype(np.float32),
                    "b": rng.standard_normal(3).astype(jnp.bfloat16)}}


def _expected(params, x):
  return float(np.sum(params["layer"]["w"] * x, dtype=np.float32)
               + np.sum(params["layer"]["b"].astype(np.float32)))


class _Collector:
  """Drains the outbox into `items`, answering "which results arrived from whom"."""

  def __init__(self, outbox):
    self.outbox, self.items = outbox, []

  def drain(self, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
      try:
        self.items.append(self.outbox.get(timeout=0.02))
      except queue.Empty:
        pass

  def ask(self, backend, worker_id, epoch, x, timeout_s=60.0):
    backend.inbox(worker_id).put(x)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
      try:
        item = self.outbox.get(timeout=0.1)
      except queue.Empty:
        continue
      self.items.append(item)
      if (item["kind"], item["worker_id"], item["epoch"], item.get("x")) == (
          "result", worker_id, epoch, x):
        return item
    raise AssertionError(f"no result from worker {worker_id} epoch {epoch} in {timeout_s} s; "
                         f"errors: {backend.errors()}")


def _make_backend(name, tmp_path):
  if name == "local":
    return local_backend.LocalBackend(ToyWorker)
  from glm5_jax.rl.orchestration import ray_backend  # pylint: disable=g-import-not-at-top
  return ray_backend.RayBackend(ToyWorker, weights_lib.FileWeights(str(tmp_path / "w"), keep=2),
                                num_cpus=1)


@pytest.fixture
def ray_cluster(request):
  if request.node.callspec.params["name"] != "ray":
    yield
    return
  ray = pytest.importorskip("ray")
  t0 = time.monotonic()
  ray.init(num_cpus=2, include_dashboard=False)
  print(f"ray.init: {time.monotonic() - t0:.1f} s")
  yield
  ray.shutdown()


# ray.init forks-and-execs its daemons after this process started JAX: harmless (exec follows).
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
@pytest.mark.parametrize("name", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_killed_worker_restarts_and_catches_up(name, ray_cluster, tmp_path, rng):
  del ray_cluster
  exercise(name, _make_backend(name, tmp_path), rng)


def exercise(name, backend, rng):
  """The shared body: start two workers, kill one mid-run, publish, restart, catch up."""
  out = _Collector(backend.outbox)
  published = {}

  def publish(v):
    published[v] = _params(rng, v)
    backend.weights.publish(published[v], v)

  def check(item, version):
    assert item["version"] == version, item
    assert item["value"] == pytest.approx(_expected(published[version], item["x"]), rel=1e-5)

  try:
    t0 = time.monotonic()
    backend.start([{"worker_id": i, "epoch": 0} for i in (0, 1)])
    publish(0)
    first = [out.ask(backend, i, 0, x=float(i + 1)) for i in (0, 1)]
    print(f"{name}: start + 2 workers' first results: {time.monotonic() - t0:.1f} s")
    for item in first:
      check(item, 0)

    backend.kill(0)                                     # mid-run: its loop is waiting
    publish(1)
    check(out.ask(backend, 1, 0, x=3.0), 1)
    backend.inbox(0).put(4.0)                           # nobody will serve it
    out.drain(0.5)
    n_before = len(out.items)
    out.drain(0.5)
    assert not [it for it in out.items[n_before:] if it["worker_id"] == 0], (
        "the killed worker still heartbeats or answers")
    assert not backend.alive(0) and backend.alive(1)

    publish(2)
    publish(3)
    backend.restart(0, epoch=1)
    item = out.ask(backend, 0, 1, x=5.0)
    check(item, 3)                                       # caught up, skipping 1 and 2
    check(out.ask(backend, 1, 0, x=6.0), 3)
    assert backend.alive(0) and backend.alive(1) and backend.errors() == {}
    # The restarted worker has a fresh inbox: 4.0 was the dead worker's in-flight work (the
    # orchestrator re-queues it). A killed thread may still finish a request it had taken
    # (late, under the old epoch, which the orchestrator fences); a killed actor cannot.
    late = [it for it in out.items if it.get("x") == 4.0]
    assert all(it["epoch"] == 0 for it in late) and not (name == "ray" and late), late
    heartbeats = {(it["worker_id"], it["epoch"]) for it in out.items if it["kind"] == "heartbeat"}
    assert heartbeats == {(0, 0), (1, 0), (0, 1)}
    pids = {(it["worker_id"], it["epoch"]): it["pid"] for it in out.items
            if it["kind"] == "result"}
    if name == "ray":                                    # each worker its own process
      assert len(set(pids.values()) | {os.getpid()}) == 4, pids
    if name == "distributed":                            # worker i in process i + 1, for good
      assert pids[(0, 0)] == pids[(0, 1)] == backend.pid(0) != os.getpid(), pids
      assert len({pids[(0, 0)], pids[(1, 0)], os.getpid()}) == 3, pids
  finally:
    backend.shutdown()
  assert not backend.alive(0) and not backend.alive(1)


def test_local_worker_failure_is_reported(tmp_path):
  del tmp_path

  class Broken:
    def __init__(self, spec):
      del spec

    def run(self, inbox, outbox, weights, should_stop):
      raise RuntimeError("engine exploded")

  backend = local_backend.LocalBackend(Broken)
  backend.start([{"worker_id": "a", "epoch": 0}])
  backend.shutdown()
  assert "engine exploded" in backend.errors()["a"] and not backend.alive("a")
  with pytest.raises(ValueError, match="duplicate worker_id"):
    local_backend.LocalBackend(Broken).start([{"worker_id": 1}, {"worker_id": 1}])
  with pytest.raises(ValueError, match="no 'worker_id'"):
    local_backend.LocalBackend(Broken).start([{"epoch": 0}])
  with pytest.raises(KeyError, match="no worker 'b'"):
    backend.kill("b")


def test_ray_backend_without_ray_says_how_to_install(monkeypatch, tmp_path):
  from glm5_jax.rl.orchestration import ray_backend  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, "ray", None)             # `import ray` raises ImportError
  with pytest.raises(ImportError, match=r'pip install -e "\.\[ray\]"'):
    ray_backend.RayBackend(ToyWorker, weights_lib.FileWeights(str(tmp_path)))


def test_ray_workers_get_cpu_jax_without_the_trainers_device_split(monkeypatch):
  from glm5_jax.rl.orchestration import ray_backend  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_foo=1")
  env = ray_backend.worker_env({"OMP_NUM_THREADS": "2"})
  assert env["JAX_PLATFORMS"] == "cpu" and env["OMP_NUM_THREADS"] == "2"
  assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_cpu_multi_thread_eigen=false"


def test_distributed_workers_are_processes_of_the_cluster(tmp_path, request):
  """The same body with backend="distributed": this test's process starts a 3-process
  jax.distributed cluster (this file as its main: process 0 runs the body, processes 1 and 2
  serve the workers) and waits for all three to exit 0."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  root = paths.ROOT
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  seed = seeding.seed_of(request.node.nodeid)
  procs = [subprocess.Popen([sys.executable, "-m", "tests.rl.test_backends", str(port), str(i),
                             str(tmp_path / "w"), str(seed)], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(3)]
  outs = [p.communicate(timeout=300)[0] for p in procs]
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i}:\n{out[-4000:]}"
  assert "distributed: body passed" in outs[0], outs[0][-2000:]


def _distributed_main(port, process_id, weights_dir, seed):
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=3, process_id=int(process_id))
  from glm5_jax.rl.orchestration import distributed_backend  # pylint: disable=g-import-not-at-top
  if jax.process_index() > 0:
    distributed_backend.serve()
    return
  try:
    exercise("distributed", distributed_backend.DistributedBackend(
        ToyWorker, weights_lib.FileWeights(weights_dir, keep=2)),
        np.random.default_rng(int(seed)))
    print("distributed: body passed")
  finally:
    distributed_backend.finish()


if __name__ == "__main__":
  _distributed_main(*sys.argv[1:])
