r"""A weight push between two processes through ShardedWeights: bytes, seconds, memory.

  python -m experiments.bench_weight_push --out=/tmp/bench_weight_push.json

Two local processes under jax.distributed (gloo), 4 fake CPU devices each. Process 0 holds
a float32 tree (`--leaf_mib`, 1 GiB by default, the largest leaf 256 MiB) sharded over its
4 devices (rows or columns) and publishes it (glm5_jax/rl/orchestration/snapshots.py); process 1,
which takes no part in the publish, reads it onto its own 4 devices as a 2 x 2 mesh, so every
device slice cuts across the writer's shards, and checks every value. Each process's peak
resident memory over its operation is measured against its RSS just before it (freed
memory trimmed first; glm5_jax/memory.py: the kernel's high-water mark, reset through
/proc/self/clear_refs). On fake CPU devices device memory is host memory,
so the reader necessarily grows by the tree it now holds. The bound asserted by
tests/rl/test_snapshots.py is 1.1 x (tree bytes the process's devices hold + the largest
leaf). Prints a table and writes JSON (`--out`).
"""

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

_OUT = flags.DEFINE_string("out", None, "where the JSON report goes")
_DIR = flags.DEFINE_string("dir", None, "snapshot directory (default: a fresh temp dir)")
_LEAF_MIB = flags.DEFINE_list("leaf_mib", ["256", "256", "192", "128", "96", "64", "32"],
                              "float32 leaf sizes in MiB (each a multiple of 1/16 MiB)")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 900, "per process")
_PROCESS = flags.DEFINE_integer("process_id", -1, "internal: the child's process id")
_PORT = flags.DEFINE_integer("port", 0, "internal: the coordinator's port")

_COLS = 4096
MIB = 2**20


# ------------------------------------------------------------------ deterministic values
def fill(k: int, box, cols: int = _COLS) -> np.ndarray:
  """Leaf k's values on `box` ((row0, row1), (col0, col1)): a hash of the global element
  index, as float32 bits with the exponent's top bit cleared (finite, random bytes)."""
  (r0, r1), (c0, c1) = box
  i = (np.arange(r0, r1, dtype=np.uint32)[:, None] * np.uint32(cols)
       + np.arange(c0, c1, dtype=np.uint32)[None, :])
  h = i * np.uint32(0x9E3779B1) + np.uint32(((k + 1) * 0x85EBCA77) & 0xFFFFFFFF)
  h ^= h >> np.uint32(15)
  h *= np.uint32(0x2C1B3C6D)
  h ^= h >> np.uint32(12)
  return (h & np.uint32(0xBFFFFFFF)).view(np.float32)


# ------------------------------------------------------------------ the two processes
def _child(pid: int, port: int, directory: str, leaf_mib) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from glm5_jax import memory  # pylint: disable=g-import-not-at-top
  from glm5_jax.rl.orchestration import snapshots  # pylint: disable=g-import-not-at-top

  shapes = {f"layer_{k}/w": (int(float(m) * MIB) // 4 // _COLS, _COLS)
            for k, m in enumerate(leaf_mib)}
  largest = max(r * c * 4 for r, c in shapes.values())
  box_of = lambda index, shape: tuple(s.indices(n)[:2] for s, n in zip(index, shape))
  store = snapshots.ShardedWeights(directory, keep=2, timeout_s=_TIMEOUT.value)
  report = os.path.join(directory, f"report.p{pid}.json")
  local = np.array(jax.local_devices())
  if pid == 0:
    mesh = Mesh(local, ("x",))
    params = {}
    for k, (name, shape) in enumerate(shapes.items()):
      spec = P("x") if k % 2 == 0 else P(None, "x")
      params[name] = jax.make_array_from_callback(
          shape, NamedSharding(mesh, spec), lambda i, k=k, shape=shape: fill(k, box_of(i, shape)))
    jax.block_until_ready(params)
    held = sum(s.data.nbytes for x in params.values() for s in x.addressable_shards)
    with memory.Peak() as m:
      stats = store.publish(params, 1)
    out = dict(role="publish", held=held, moved=stats["push_bytes"], seconds=stats["push_s"],
               shards=stats["push_shards"], exact=True)
  else:
    mesh = Mesh(local.reshape(2, 2), ("a", "b"))
    template = {name: jax.ShapeDtypeStruct(shape, jnp.float32,
                                           sharding=NamedSharding(mesh, P("a", "b")))
                for name, shape in shapes.items()}
    deadline = time.monotonic() + _TIMEOUT.value
    while store.version() < 1:
      if time.monotonic() > deadline:
        raise TimeoutError(f"no version 1 in {directory} within {_TIMEOUT.value} s")
      time.sleep(0.05)
    with memory.Peak() as m:
      version, params = store.latest(template)
      jax.block_until_ready(params)
    stats = store.last_pull
    held = sum(s.data.nbytes for x in params.values() for s in x.addressable_shards)
    exact = version == 1 and all(
        np.array_equal(np.asarray(s.data).view(np.uint32),
                       fill(k, box_of(s.index, x.shape)).view(np.uint32))
        for k, x in enumerate(params.values()) for s in x.addressable_shards)
    out = dict(role="read", held=held, moved=stats["pull_bytes"], seconds=stats["pull_s"],
               shards=stats["pull_shards"], exact=bool(exact))
  bound = 1.1 * (held + largest)
  out.update(process=pid, largest_leaf=largest, rss_growth=m.growth,
             rss_growth_at_end=m.end_growth, hwm_reset=m.exact, bound=bound,
             ratio=m.growth / bound)
  with open(report + ".tmp", "w") as f:
    json.dump(out, f)
  os.replace(report + ".tmp", report)
  if pid == 0:                                     # keep the coordinator up for the reader
    other = os.path.join(directory, "report.p1.json")
    deadline = time.monotonic() + _TIMEOUT.value
    while not os.path.exists(other) and time.monotonic() < deadline:
      time.sleep(0.05)


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run(directory: str, leaf_mib, timeout_s: int) -> dict:
  """Launches the two processes; returns the report (machine, tree, per process)."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  port = _port()
  cmd = lambda i: [sys.executable, "-m", "experiments.bench_weight_push", f"--process_id={i}",
                   f"--port={port}", f"--dir={directory}", f"--timeout_s={timeout_s}",
                   f"--leaf_mib={','.join(leaf_mib)}"]
  logs = [tempfile.TemporaryFile("w+") for _ in range(2)]     # no pipe to fill up
  procs = [subprocess.Popen(cmd(i), cwd=env["PYTHONPATH"], env=env, stdout=logs[i],
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  deadline = time.monotonic() + timeout_s + 60
  while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
    if any(p.poll() for p in procs):               # one failed: the other would wait for it
      break
    time.sleep(0.1)
  for p in procs:
    if p.poll() is None:
      p.kill()
  for p in procs:
    p.wait()
  if any(p.returncode for p in procs):
    tails = []
    for i, log in enumerate(logs):
      log.seek(0)
      tails.append(f"process {i} (exit {procs[i].returncode}): {log.read()[-3000:]}")
    raise RuntimeError("bench_weight_push: a process failed:\n" + "\n".join(tails))
  per = [json.load(open(os.path.join(directory, f"report.p{i}.json"))) for i in range(2)]
  return {"machine": {"processor": platform.processor() or platform.machine(),
                      "cpus": os.cpu_count(), "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
                      "platform": platform.platform()},
          "tree_bytes": sum(int(float(m) * MIB) // 4 // _COLS * _COLS * 4 for m in leaf_mib),
          "leaf_mib": [float(m) for m in leaf_mib], "processes": per}


def table(report: dict) -> str:
  m = report["machine"]
  rows = [f"machine: {m['processor']}, {m['cpus']} CPUs, {m['ram_bytes'] / 2**30:.0f} GiB RAM "
          f"({m['platform']}); tree {report['tree_bytes'] / MIB:.0f} MiB float32, leaves "
          f"{report['leaf_mib']} MiB",
          "| process | op | tree bytes held (MiB) | moved (MiB) | shards | seconds | MiB/s | "
          "RSS growth (MiB) | bound (MiB) | ratio | bit-exact |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
  for p in report["processes"]:
    rows.append(f"| {p['process']} | {p['role']} | {p['held'] / MIB:.0f} | "
                f"{p['moved'] / MIB:.0f} | {p['shards']:.0f} | {p['seconds']:.2f} | "
                f"{p['moved'] / MIB / p['seconds']:.0f} | {p['rss_growth'] / MIB:.0f} | "
                f"{p['bound'] / MIB:.0f} | {p['ratio']:.2f} | {p['exact']} |")
  return "\n".join(rows)


def main(argv):
  del argv
  if _PROCESS.value >= 0:
    _child(_PROCESS.value, _PORT.value, _DIR.value, _LEAF_MIB.value)
    return
  directory = _DIR.value or tempfile.mkdtemp(prefix="bench_weight_push_")
  try:
    report = run(directory, _LEAF_MIB.value, _TIMEOUT.value)
  finally:
    if _DIR.value is None:
      shutil.rmtree(directory, ignore_errors=True)
  print(table(report))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  app.run(main)
