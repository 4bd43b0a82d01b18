"""Sharded weight snapshots (glm5_jax/rl/orchestration/snapshots.py): round trips across shardings,
bytes read per process, corruption, torn versions, monotone versions, pruning, two processes.

Multi-device cases run in a subprocess with 8 fake CPU devices (tests/fake_devices.py); the
rest use the pytest process's one device. Random inputs are seeded from the test's name.
"""

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from glm5_jax.rl.orchestration import snapshots as S
from glm5_jax.rl.orchestration import weights as W
from tests import fake_devices

ROOT = fake_devices.ROOT


def _params(rng, fill=None):
  def leaf(shape, dtype):
    a = rng.standard_normal(shape).astype(np.float32) if fill is None else np.full(
        shape, fill, np.float32)
    return jax.device_put(a.astype(dtype))
  return {"embed": {"embedding": leaf((6, 4), ml_dtypes.bfloat16)},
          "layers": {"w": leaf((2, 3, 4), np.float32), "scale": leaf((), np.float32)}}


def _template(params):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      params)


def _assert_bit_equal(got, want):
  flat_got, flat_want = W.flatten(got), W.flatten(want)
  assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
  for (path, a), (_, b) in zip(flat_got, flat_want):
    assert a.dtype == b.dtype and a.shape == b.shape, path
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8),
                                  err_msg=str(path))


def _chunk_files(store, version, leaf):
  base = os.path.join(store.path(version), "leaves", *leaf.split("/"), "c")
  return sorted(os.path.join(r, f) for r, _, fs in os.walk(base) for f in fs)


# ---- eight fake devices (subprocess) -----------------------------------------------------

_MESHES = r"""
import json, sys, numpy as np, jax, jax.numpy as jnp, ml_dtypes
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from glm5_jax.rl.orchestration import snapshots
seed, directory = int(sys.argv[1]), sys.argv[2]
rng = np.random.default_rng(seed)
devs = jax.devices()
writer = Mesh(np.array(devs[:4]), ("x",))             # devices 0-3, sharded over axis 0
reader = Mesh(np.array(devs[6:8]), ("y",))            # devices 6, 7: none of the writer's
want = {"f32": rng.standard_normal((8, 6)).astype(np.float32),
        "bf16": rng.standard_normal((8, 6)).astype(ml_dtypes.bfloat16)}
def put(a, mesh, spec):
  return jax.device_put(a, NamedSharding(mesh, spec))
def held(tree):                                       # bytes on this process's devices
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)
def distinct(tree):                                   # ... counting each slice once
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.replica_id == 0)
def check(got, sharding):
  for k, x in got.items():
    assert x.sharding == sharding, (k, x.sharding)
    for s in x.addressable_shards:
      assert np.array_equal(np.asarray(s.data).view(np.uint8), want[k][s.index].view(np.uint8)), k
"""

_ROUND_TRIP = _MESHES + r"""
store = snapshots.ShardedWeights(directory)
store.publish({k: put(a, writer, P("x")) for k, a in want.items()}, 1)
for spec in (P(None, "y"), P()):                      # axis 1 over 2 other devices; replicated
  sharding = NamedSharding(reader, spec)
  template = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for k, a in want.items()}
  version, got = store.latest(template)
  assert version == 1
  check(got, sharding)
print("OK")
"""

_BYTES = _MESHES + r"""
store = snapshots.ShardedWeights(directory)
stats = store.publish({k: put(a, writer, P("x")) for k, a in want.items()}, 1)
report = {"written": [stats["push_bytes"], stats["push_shards"]]}
for name, mesh, spec in [("halves", reader, P("y")),                    # 2 writer shards each
                         ("same", Mesh(np.array(devs[4:8]), ("y",)), P("y")),  # 1 each
                         ("replicated", reader, P())]:
  sharding = NamedSharding(mesh, spec)
  template = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for k, a in want.items()}
  got = store.get(1, template)
  check(got, sharding)
  report[name] = [store.last_pull["pull_bytes"], distinct(got), held(got)]
# Not aligned: a (12, 2) leaf written as 2 blocks of 6 rows, read as 3 blocks of 4 rows.
odd = rng.standard_normal((12, 2)).astype(np.float32)
store.publish({"odd": put(odd, Mesh(np.array(devs[:2]), ("x",)), P("x"))}, 2)
three = NamedSharding(Mesh(np.array(devs[5:8]), ("t",)), P("t"))
got = store.get(2, {"odd": jax.ShapeDtypeStruct(odd.shape, odd.dtype, sharding=three)})
assert all(np.array_equal(np.asarray(s.data), odd[s.index]) for s in got["odd"].addressable_shards)
report["unaligned"] = [store.last_pull["pull_bytes"], distinct(got), held(got)]
print(json.dumps(report))
print("OK")
"""


def _run8(script, *args):
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  p = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stderr[-3000:]
  return p.stdout.strip().splitlines()


def test_round_trip_is_bit_exact_across_meshes_and_shardings(tmp_path, rng):
  """Written on devices 0-3 sharded over axis 0; read on devices 6-7 over axis 1 and
  replicated; float32 and bfloat16 bit-exact."""
  _run8(_ROUND_TRIP, rng.integers(2**31), tmp_path)


def test_a_reader_reads_each_slice_its_devices_hold_once(tmp_path, rng):
  """Bytes read == the distinct bytes the process's devices hold when the reader's slices
  are unions of writer shards; replicated devices share one read; an unaligned slice reads
  the writer shards it overlaps whole, each once. (One process holds every slice here; the
  two-process test below shows a process reading only its part.)"""
  out = json.loads(_run8(_BYTES, rng.integers(2**31), tmp_path)[-2])
  total = 8 * 6 * (4 + 2)                            # float32 + bfloat16 leaves
  assert out["written"] == [total, 8]               # 4 shards of each leaf
  assert out["halves"] == out["same"] == [total, total, total]
  assert out["replicated"] == [total, total, 2 * total]
  assert out["unaligned"] == [12 * 2 * 4] * 3


# ---- one device (in process) -------------------------------------------------------------

def test_template_none_gives_host_arrays_and_the_store_pickles(tmp_path, rng):
  store, params = S.ShardedWeights(str(tmp_path)), _params(rng)
  assert store.version() == -1 and store.versions() == []
  stats = store.publish(params, 3)
  assert stats == store.last_push and stats["push_bytes"] == 6 * 4 * 2 + 2 * 3 * 4 * 4 + 4
  assert stats["push_shards"] == 3 and stats["push_s"] > 0
  clone = pickle.loads(pickle.dumps(store))
  version, got = clone.latest()
  assert version == clone.version() == 3
  _assert_bit_equal(got, params)
  assert isinstance(got["layers"]["w"], np.ndarray)
  assert clone.last_pull["pull_bytes"] == stats["push_bytes"]
  assert clone.last_pull["pull_shards"] == 3


def test_read_into_a_template_keeps_its_shardings(tmp_path, rng):
  store, params = S.ShardedWeights(str(tmp_path)), _params(rng)
  store.publish(params, 0)
  got = store.get(0, _template(params))
  assert all(isinstance(x, jax.Array) and x.sharding == y.sharding
             for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(params)))
  _assert_bit_equal(got, params)


def test_template_mismatch_names_the_leaf(tmp_path, rng):
  store, params = S.ShardedWeights(str(tmp_path)), _params(rng)
  store.publish(params, 0)
  bad = _template(params)
  bad["embed"]["embedding"] = jax.ShapeDtypeStruct((6, 4), jnp.float32)
  with pytest.raises(ValueError, match=r"embed/embedding is bfloat16\[6, 4\] in version 0, "
                     r"the template's is float32\[6, 4\]"):
    store.latest(bad)
  bad["embed"]["embedding"] = jax.ShapeDtypeStruct((4, 6), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"embed/embedding is bfloat16\[6, 4\]"):
    store.latest(bad)
  with pytest.raises(ValueError, match=r"missing from the template \['layers/scale', "
                     r"'layers/w'\]"):
    store.latest({"embed": _template(params)["embed"]})


def test_versions_must_strictly_increase(tmp_path, rng):
  store = S.ShardedWeights(str(tmp_path))
  store.publish(_params(rng), 5)
  for bad in (5, 4, -1, "6", True):
    with pytest.raises(ValueError, match="version"):
      store.publish(_params(rng), bad)
  store.publish(_params(rng), 7)
  assert store.versions() == [5, 7]


def test_pruning_keeps_the_newest_keep_versions(tmp_path, rng):
  store = S.ShardedWeights(str(tmp_path), keep=2)
  for v in (0, 1, 4, 6):
    store.publish(_params(rng, fill=v), v)
  assert store.versions() == [4, 6]
  assert sorted(os.listdir(tmp_path)) == ["v0000000004", "v0000000006"]
  np.testing.assert_array_equal(store.get(4)["layers"]["w"], 4.0)
  with pytest.raises(S.VersionNotFoundError, match="version 1 is not in"):
    store.get(1)


def test_flipped_bytes_are_refused_naming_the_file_leaf_and_shard(tmp_path, rng):
  store = S.ShardedWeights(str(tmp_path))
  store.publish(_params(rng), 0)
  (chunk,) = _chunk_files(store, 0, "layers/w")
  blob = bytearray(open(chunk, "rb").read())
  blob[int(rng.integers(len(blob)))] ^= 0x10
  open(chunk, "wb").write(bytes(blob))
  with pytest.raises(W.CorruptSnapshotError, match=rf"{chunk} \(leaf layers/w, shard "
                     r"\[\[0, 2\], \[0, 3\], \[0, 4\]\], manifest.p00000.json\): sha256 mismatch"):
    store.latest()


def test_truncated_and_missing_chunks_are_refused_naming_the_file(tmp_path, rng):
  store = S.ShardedWeights(str(tmp_path))
  store.publish(_params(rng), 0)
  (chunk,) = _chunk_files(store, 0, "embed/embedding")
  os.truncate(chunk, os.path.getsize(chunk) - 3)
  with pytest.raises(W.CorruptSnapshotError, match=rf"{chunk} \(leaf embed/embedding.*"
                     "unreadable"):
    store.get(0)
  os.remove(chunk)
  with pytest.raises(W.CorruptSnapshotError, match=rf"{chunk} \(leaf embed/embedding.*"
                     "missing"):
    store.get(0)


def test_an_edited_or_missing_manifest_is_refused(tmp_path, rng):
  store = S.ShardedWeights(str(tmp_path))
  store.publish(_params(rng), 0)
  manifest = os.path.join(store.path(0), "manifest.p00000.json")
  m = json.load(open(manifest))
  m["leaves"][0]["shards"][0]["sha256"] = "0" * 64     # bytes and manifest would now disagree
  json.dump(m, open(manifest, "w"))
  with pytest.raises(W.CorruptSnapshotError, match=rf"{manifest} does not match its sha256"):
    store.latest()
  os.remove(manifest)
  with pytest.raises(W.CorruptSnapshotError, match=rf"{manifest} is missing"):
    store.latest()


def test_a_torn_publish_is_invisible_and_refused(tmp_path, rng):
  """A publish that fails after writing some leaves (an unwritable dtype) leaves a partial
  directory with an ABORT file: not a version; `get` refuses it; the next version commits."""
  store, params = S.ShardedWeights(str(tmp_path)), _params(rng)
  store.publish(params, 0)
  torn = dict(params, zzz=np.array(["not", "weights"]))   # last in key order: fails last
  with pytest.raises(ValueError):
    store.publish(torn, 1)
  partial = os.path.join(tmp_path, ".v0000000001.partial")
  assert os.path.exists(os.path.join(partial, "ABORT.p00000"))
  assert os.path.isdir(os.path.join(partial, "leaves", "layers", "w"))
  assert store.versions() == [0] and store.latest()[0] == 0
  with pytest.raises(W.CorruptSnapshotError, match=rf"version 1 is not committed \({partial}"):
    store.get(1)
  store.publish(params, 2)                             # and the abandoned attempt is pruned
  assert sorted(os.listdir(tmp_path)) == ["v0000000000", "v0000000002"]


def test_a_version_directory_without_commit_is_refused(tmp_path, rng):
  store = S.ShardedWeights(str(tmp_path))
  store.publish(_params(rng), 0)
  shutil.copytree(store.path(0), store.path(1))
  os.remove(os.path.join(store.path(1), S.COMMIT))     # e.g. copied by hand, or a torn copy
  assert store.versions() == [0]
  with pytest.raises(W.CorruptSnapshotError, match=rf"{store.path(1)} has no COMMIT file"):
    store.get(1)
  with pytest.raises(ValueError, match="exists without a COMMIT file"):
    store.publish(_params(rng), 1)


def test_a_reader_racing_the_writer_never_sees_a_torn_or_pruned_version(tmp_path):
  """keep=1: every publish prunes what a reader may be reading; version v's leaves are all
  v, so a mixed read would show; a pruned read is retried on the newest version."""
  store = S.ShardedWeights(str(tmp_path), keep=1)
  store.publish(_params(None, fill=0), 0)
  n, seen, errors = 25, [], []

  def read():
    try:
      while not seen or seen[-1] < n - 1:
        version, params = store.latest()
        for path, a in W.flatten(params):
          assert np.all(a.astype(np.float32) == version), (version, path)
        seen.append(version)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  reader = threading.Thread(target=read)
  reader.start()
  for v in range(1, n):
    store.publish(_params(None, fill=v), v)
  reader.join(timeout=60)
  assert not errors, errors
  assert seen == sorted(seen) and seen[-1] == n - 1


def test_an_all_zero_shard_is_written_and_read_back(tmp_path):
  """zarr stores skip chunks equal to the fill value by default; a missing chunk is an error
  here, so zero shards (fresh biases) must still be written."""
  store = S.ShardedWeights(str(tmp_path))
  store.publish({"bias": jax.device_put(np.zeros((3, 2), np.float32))}, 0)
  assert len(_chunk_files(store, 0, "bias")) == 1
  np.testing.assert_array_equal(store.get(0)["bias"], np.zeros((3, 2), np.float32))


# ---- two processes (slow) -----------------------------------------------------------------

_TWO = r"""
import json, os, sys, numpy as np, jax, jax.numpy as jnp, ml_dtypes
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, seed, directory = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from glm5_jax.rl.orchestration import snapshots
rng = np.random.default_rng(seed)                     # the same draws in both processes
devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
assert [d.process_index for d in devs] == [0] * 4 + [1] * 4
want = {"w": rng.standard_normal((16, 6)).astype(np.float32),
        "b": rng.standard_normal((8, 16)).astype(ml_dtypes.bfloat16),
        "r": rng.standard_normal((5,)).astype(np.float32),
        "odd": rng.standard_normal((24, 2)).astype(np.float32)}
all8 = Mesh(np.array(devs), ("x",))
three = Mesh(np.array([devs[0], devs[1], devs[4]]), ("x",))   # 2 blocks on p0, 1 on p1
writer = {"w": NamedSharding(all8, P("x")), "b": NamedSharding(all8, P(None, "x")),
          "r": NamedSharding(all8, P()), "odd": NamedSharding(three, P("x"))}
rev = Mesh(np.array(devs[::-1]).reshape(2, 4), ("a", "b"))    # process 1's devices first
reader = {"w": NamedSharding(rev, P("b", "a")),               # cuts the writer's rows
          "b": NamedSharding(rev, P(None, ("a", "b"))),       # aligned, other process's half
          "r": NamedSharding(rev, P()),
          "odd": NamedSharding(Mesh(np.array(devs), ("t",)), P("t"))}   # 8 x 3 rows
params = {k: jax.make_array_from_callback(a.shape, writer[k], lambda i, a=a: a[i])
          for k, a in want.items()}
store = snapshots.ShardedWeights(directory, timeout_s=120)
stats = store.publish(params, 1)
mine = sum(s.data.nbytes for x in params.values() for s in x.addressable_shards
           if s.replica_id == 0)
assert stats["push_bytes"] == mine > 0, (stats, mine)
assert sorted(f for f in os.listdir(store.path(1)) if f.startswith("manifest")) == [
    "manifest.p00000.json", "manifest.p00001.json"]
template = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=reader[k]) for k, a in want.items()}
version, got = store.latest(template)
assert version == 1
for k, x in got.items():
  assert x.sharding == reader[k]
  for s in x.addressable_shards:
    assert np.array_equal(np.asarray(s.data).view(np.uint8), want[k][s.index].view(np.uint8)), k
def boxes(sharding, shape, local):
  return {tuple(i.indices(n)[:2] for i, n in zip(idx, shape))
          for d, idx in sharding.devices_indices_map(shape).items()
          if not local or d.process_index == pid}
def meets(u, v):
  return all(max(a, c) < min(b, d) for (a, b), (c, d) in zip(u, v))
need = 0                                              # writer shards meeting a local slice
for k, a in want.items():
  local = boxes(reader[k], a.shape, True)
  for w in boxes(writer[k], a.shape, False):
    if any(meets(w, l) for l in local):
      need += int(np.prod([b - a0 for a0, b in w])) * a.dtype.itemsize
held = sum(s.data.nbytes for x in got.values() for s in x.addressable_shards if s.replica_id == 0)
total = sum(a.nbytes for a in want.values())
assert store.last_pull["pull_bytes"] == need < total, (store.last_pull, need, total)
# A publish that process 1 skips: process 0's part is written, never committed.
if pid == 0:
  impatient = snapshots.ShardedWeights(directory, timeout_s=1)
  try:
    impatient.publish(params, 2)
    raise AssertionError("committed without process 1's manifest")
  except TimeoutError as e:
    assert "processes [1] wrote no manifest" in str(e), e
  assert store.versions() == [1]
  assert os.path.exists(os.path.join(directory, ".v0000000002.partial", "ABORT.p00000"))
print(json.dumps({"process": pid, "written": stats["push_bytes"], "read": need, "held": held}))
jax.distributed.shutdown()
print("OK")
"""


def _port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_publish_their_shards_and_read_another_sharding(tmp_path, rng):
  """Both processes write their shards of a tree sharded over all 8 devices; the primary
  commits after both manifests; both read it back in other shardings, bit-exact, each
  reading only the writer shards its own slices overlap. Then process 0 publishes alone:
  it times out naming process 1, and nothing is committed."""
  env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  port, seed = _port(), int(rng.integers(2**31))
  procs = [subprocess.Popen([sys.executable, "-c", _TWO, str(port), str(i), str(seed),
                             str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  outs = [p.communicate(timeout=300) for p in procs]
  assert all(p.returncode == 0 and o[0].strip().endswith("OK") for p, o in zip(procs, outs)), \
      outs[0][1][-3000:] + outs[1][1][-3000:]
  reports = [json.loads(o[0].strip().splitlines()[-2]) for o in outs]
  assert all(r["written"] > 0 for r in reports)
  assert sum(r["written"] for r in reports) == 16 * 6 * 4 + 8 * 16 * 2 + 5 * 4 + 24 * 2 * 4


@pytest.mark.slow
def test_a_1gib_push_stays_within_each_processs_share_plus_one_leaf(tmp_path):
  """experiments/bench_weight_push.py: process 0 publishes 1 GiB of float32 (largest leaf
  256 MiB) from its 4 devices, process 1 reads it onto its 4; each one's peak RSS growth
  over its operation <= 1.1 x (the tree bytes its devices hold + the largest leaf)."""
  out = tmp_path / "bench.json"
  subprocess.run([sys.executable, "-m", "experiments.bench_weight_push", f"--out={out}",
                  f"--dir={tmp_path / 'weights'}"], cwd=ROOT, check=True, timeout=900,
                 env=dict(os.environ, PYTHONPATH=ROOT))
  report = json.loads(out.read_text())
  assert report["tree_bytes"] >= 2**30
  writer, reader = report["processes"]
  assert writer["role"] == "publish" and reader["role"] == "read" and reader["exact"]
  assert writer["held"] == reader["held"] == writer["moved"] == report["tree_bytes"]
  assert reader["moved"] == report["tree_bytes"]   # every writer shard meets a local slice
  for p in (writer, reader):
    assert p["largest_leaf"] == 256 * 2**20
    assert p["rss_growth"] <= p["bound"], report
  assert reader["rss_growth"] >= reader["held"]      # it really built the tree it holds
  print(json.dumps(report))
