"""Versioned weights: the trainer publishes, rollout workers pull (async RL).

  weights.publish(params, version)       # trainer, every K updates; versions strictly rise
  if weights.version() > engine.version:  # rollout worker, before each new batch of work
    engine.update_params(*reversed(weights.latest()))

GLM-5 (arXiv 2602.15763, §3) decouples rollout from training: workers keep sampling while the
trainer updates, and pick up new weights as they are pushed; every sampled token records the
version that produced it (`glm5_jax/inference/engine.py`). Stores with that interface, by
where the replicas run:

  DeviceWeights      replicas in this process on devices of their own (the local backend,
                     disaggregated): the published version stays on the trainer's devices
                     in its shardings, and each replica's engine copies it device to device,
                     leaf by leaf, into its own shardings (`Engine.update_params`): no host
                     copy, and a swap holds at most one leaf beyond the parameters.
  InProcessWeights   threads of one process: host (numpy) copies of the last `keep` versions,
                     each with its checksum (the host round trip `bench_rl` compares with).
  ShardedWeights(dir)  (rl/orchestration/snapshots.py) processes and hosts (the Ray backend's
  default,
                     `jax.distributed` pods): each writer process writes only the shards its
                     devices own, each reader reads only the slices its devices need, into
                     the `template`'s shardings; checksummed per shard, committed atomically
                     under the version. No process holds the whole tree.
  FileWeights(dir)   processes on one machine or a shared filesystem (config.rl.snapshots=
                     "file"): one file per version, written under a temporary name and
                     renamed into place, so a reader sees a whole snapshot or none; older
                     snapshots pruned.

(The colocated placement of synchronous GRPO needs no store: its engine serves the trainer's own
arrays on the trainer's mesh, rl/orchestration/grpo.py.) The host stores verify `checksum(params)`
on `latest()`, so a worker never serves weights that differ from what the trainer published; their
`params` must be fully addressable (for a multi-host mesh use ShardedWeights). Every store's
`last_push` holds the bytes and seconds of its latest publish ({"push_bytes", "push_s"}).

A snapshot file `v{version:010d}.weights` is: the 8 bytes `GLM5WTS1`, the manifest's length
(8 bytes, little-endian), the manifest (JSON: version, checksum, and per leaf its key path,
shape, dtype, byte offset and length), then the leaves' raw bytes in key-path order.
"""

import hashlib
import json
import os
import re
import threading
import time
import uuid

import jax
import ml_dtypes
import numpy as np

MAGIC = b"GLM5WTS1"
_NAME = re.compile(r"^v(\d{10})\.weights$")


class CorruptSnapshotError(ValueError):
  """A snapshot file whose bytes do not match its manifest or checksum."""


# ------------------------------------------------------------------ trees <-> leaves
def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):     # DictKey, GetAttrKey, SequenceKey
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def flatten(params) -> list[tuple[tuple[str, ...], np.ndarray]]:
  """[(key path, host array)] in `jax.tree_util.tree_flatten_with_path` order."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(params)
  return [(tuple(_key_name(k) for k in path), np.asarray(jax.device_get(leaf)))
          for path, leaf in leaves]


def _dtype(name: str) -> np.dtype:
  return np.dtype(getattr(ml_dtypes, name, name))     # bfloat16 & co. live in ml_dtypes


def _as_bytes(a: np.ndarray) -> memoryview:
  return np.ascontiguousarray(a).reshape(-1).view(np.uint8).data


def checksum(params) -> str:
  """sha256 over the leaves in key-path order: each leaf's path, dtype, shape, then bytes."""
  return _digest(flatten(params))


def _digest(items) -> str:
  h = hashlib.sha256()
  for path, a in items:
    h.update(json.dumps([list(path), a.dtype.name, list(a.shape)]).encode())
    h.update(_as_bytes(a))
  return h.hexdigest()


def unflatten(items, template=None):
  """Rebuilds a tree from [(key path, array)]: into `template`'s structure when given (paths,
  shapes and dtypes must match), otherwise as nested dicts keyed by the path components."""
  if template is None:
    if len(items) == 1 and not items[0][0]:
      return items[0][1]                       # the tree was a single array
    tree = {}
    for path, a in items:
      node = tree
      for k in path[:-1]:
        node = node.setdefault(k, {})
      node[path[-1]] = a
    return tree
  want, by_path = _template_paths(template), dict(items)
  if set(p for p, _, _ in want) != set(by_path):
    missing = sorted(set(p for p, _, _ in want) - set(by_path))
    extra = sorted(set(by_path) - set(p for p, _, _ in want))
    raise ValueError(f"weights: the snapshot's key paths differ from the template's "
                     f"(missing {['/'.join(p) for p in missing[:5]]}, "
                     f"extra {['/'.join(p) for p in extra[:5]]})")
  for path, shape, dtype in want:
    a = by_path[path]
    if tuple(a.shape) != shape or a.dtype != dtype:
      raise ValueError(f"weights: {'/'.join(path)} is {a.dtype}{list(a.shape)} in the "
                       f"snapshot, the template's is {dtype}{list(shape)}")
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template),
                                      [by_path[p] for p, _, _ in want])


def _template_paths(template):
  leaves, _ = jax.tree_util.tree_flatten_with_path(template)
  return [(tuple(_key_name(k) for k in path), tuple(leaf.shape), np.dtype(leaf.dtype))
          for path, leaf in leaves]


def _check_version(version, current: int, where: str) -> int:
  if not isinstance(version, (int, np.integer)) or isinstance(version, bool) or version < 0:
    raise ValueError(f"{where}.publish: version={version!r}; expected an int >= 0")
  if version <= current:
    raise ValueError(f"{where}.publish: version={version} is not newer than the latest "
                     f"published version {current}; versions must strictly increase")
  return int(version)


def _tree_bytes(params) -> int:
  return int(sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(params)))


# ------------------------------------------------------------------ on devices
class DeviceWeights:
  """The latest published version as device arrays, for replicas in this process.

  `publish` keeps a reference to `params` (the caller hands over arrays it will not donate or
  change: the async trainer publishes a copy it keeps for the consistency measurement);
  `latest` returns them as they are, on the trainer's devices: the replica's engine reshards
  each leaf into its own devices (`Engine.update_params`). jax.Arrays are immutable, so no
  checksum is needed. `last_push` counts the bytes a replica copies per pull.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._version, self._params = -1, None
    self.last_push = {"push_bytes": 0.0, "push_s": 0.0}

  def version(self) -> int:
    with self._lock:
      return self._version

  def publish(self, params, version: int) -> None:
    t0 = time.perf_counter()
    with self._lock:
      self._version = _check_version(version, self._version, "DeviceWeights")
      self._params = params
    self.last_push = {"push_bytes": float(_tree_bytes(params)),
                      "push_s": time.perf_counter() - t0}

  def latest(self, template=None):
    """(version, params) of the latest publish; LookupError before the first."""
    with self._lock:
      if self._params is None:
        raise LookupError("DeviceWeights.latest: nothing published yet")
      version, params = self._version, self._params
    if template is not None and (jax.tree_util.tree_structure(template)
                                 != jax.tree_util.tree_structure(params)):
      raise ValueError("DeviceWeights.latest: the template's tree differs from the published "
                       "params'")
    return version, params


# ------------------------------------------------------------------ in process
class InProcessWeights:
  """Host copies of the last `keep` published versions, for threads of one process.

  The stored arrays are read-only copies: a trainer that donates or updates its buffers in
  place cannot change what workers pull, and a worker cannot change what others pull.
  """

  def __init__(self, keep: int = 1):
    if not isinstance(keep, int) or keep < 1:
      raise ValueError(f"InProcessWeights keep={keep!r}: expected an int >= 1")
    self.keep = keep
    self._lock = threading.Lock()
    self._store = {}          # version -> (checksum, [(path, array)])
    self.last_push = {"push_bytes": 0.0, "push_s": 0.0}

  def version(self) -> int:
    """The latest published version; -1 before the first publish."""
    with self._lock:
      return max(self._store, default=-1)

  def publish(self, params, version: int) -> None:
    t0 = time.perf_counter()
    items = []
    for path, a in flatten(params):
      a = np.array(a, copy=True)
      a.flags.writeable = False
      items.append((path, a))
    digest = _digest(items)
    with self._lock:
      version = _check_version(version, max(self._store, default=-1), "InProcessWeights")
      self._store[version] = (digest, items)
      for old in sorted(self._store)[:-self.keep]:
        del self._store[old]
    self.last_push = {"push_bytes": float(sum(a.nbytes for _, a in items)),
                      "push_s": time.perf_counter() - t0}

  def get(self, version: int, template=None):
    """The params of a kept `version` (checksum verified)."""
    with self._lock:
      if version not in self._store:
        raise KeyError(f"InProcessWeights.get: version {version} is not kept; kept versions: "
                       f"{sorted(self._store)} (keep={self.keep})")
      entry = self._store[version]
    return self._verified(version, *entry, template)

  def latest(self, template=None):
    """(version, params) of the latest publish; LookupError before the first."""
    with self._lock:
      if not self._store:
        raise LookupError("InProcessWeights.latest: nothing published yet")
      version = max(self._store)
      entry = self._store[version]
    return version, self._verified(version, *entry, template)

  @staticmethod
  def _verified(version, digest, items, template):
    if _digest(items) != digest:
      raise CorruptSnapshotError(f"InProcessWeights: version {version}'s arrays no longer "
                                 "match their checksum")
    return unflatten(items, template)


# ------------------------------------------------------------------ on disk
class FileWeights:
  """Versioned, checksummed snapshots in `directory`, for processes sharing a filesystem.

  One writer (the trainer's process 0), any number of readers.
  Picklable (a path and a number): hand the same object to Ray actors. `publish` writes
  `v{version:010d}.weights` under a temporary name, fsyncs, renames it into place (atomic on
  POSIX), then deletes all but the newest `keep` snapshots. `latest` reads the newest file and
  verifies it; a file pruned between listing and opening is retried with the next newest.
  """

  def __init__(self, directory: str, keep: int = 2):
    if not isinstance(keep, int) or keep < 1:
      raise ValueError(f"FileWeights keep={keep!r}: expected an int >= 1")
    self.directory, self.keep = directory, keep
    os.makedirs(directory, exist_ok=True)
    self.last_push = {"push_bytes": 0.0, "push_s": 0.0}

  def path(self, version: int) -> str:
    return os.path.join(self.directory, f"v{version:010d}.weights")

  def versions(self) -> list[int]:
    """The versions on disk, ascending."""
    return sorted(int(m.group(1)) for m in map(_NAME.match, os.listdir(self.directory)) if m)

  def version(self) -> int:
    """The latest published version; -1 before the first publish."""
    return max(self.versions(), default=-1)

  def publish(self, params, version: int) -> None:
    t0 = time.perf_counter()
    version = _check_version(version, self.version(), "FileWeights")
    items = flatten(params)
    leaves, offset = [], 0
    for path, a in items:
      leaves.append({"path": list(path), "shape": list(a.shape), "dtype": a.dtype.name,
                     "offset": offset, "nbytes": a.nbytes})
      offset += a.nbytes
    manifest = json.dumps({"version": version, "checksum": _digest(items),
                           "nbytes": offset, "leaves": leaves}).encode()
    final = self.path(version)
    tmp = os.path.join(self.directory, f".{os.path.basename(final)}.{uuid.uuid4().hex}.tmp")
    try:
      with open(tmp, "wb") as f:
        f.write(MAGIC + len(manifest).to_bytes(8, "little") + manifest)
        for _, a in items:
          f.write(_as_bytes(a))
        f.flush()
        os.fsync(f.fileno())
      os.replace(tmp, final)
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)
    for old in self.versions()[:-self.keep]:
      try:
        os.remove(self.path(old))
      except FileNotFoundError:
        pass                                   # another process pruned it first
    self.last_push = {"push_bytes": float(offset), "push_s": time.perf_counter() - t0}

  def discard_from(self, version: int) -> list[int]:
    """Removes the snapshots of `version` and later (a resumed run's trainer publishes
    from its checkpoint's version again; what a killed run pushed after it is not that run's
    weights). Returns the versions removed."""
    gone = [v for v in self.versions() if v >= version]
    for v in gone:
      try:
        os.remove(self.path(v))
      except FileNotFoundError:
        pass
    return gone

  def get(self, version: int, template=None):
    """The params of `version` read from its file, checksum verified."""
    return read_snapshot(self.path(version), template)[1]

  def latest(self, template=None):
    """(version, params) of the newest snapshot, verified; LookupError when there is none."""
    for _ in range(10):
      versions = self.versions()
      if not versions:
        raise LookupError(f"FileWeights.latest: no snapshot in {self.directory}")
      try:
        return read_snapshot(self.path(versions[-1]), template)
      except FileNotFoundError:
        continue                               # pruned after listing: list again
    raise LookupError(f"FileWeights.latest: snapshots in {self.directory} kept vanishing "
                      f"while being read (keep={self.keep} too small for the publish rate?)")


def read_snapshot(path: str, template=None):
  """(version, params) from one snapshot file; CorruptSnapshotError naming the file when its
  bytes are truncated, malformed or do not match the checksum."""
  with open(path, "rb") as f:
    blob = f.read()

  def corrupt(why):
    return CorruptSnapshotError(f"weights snapshot {path}: {why}")

  if blob[:8] != MAGIC:
    raise corrupt(f"does not start with {MAGIC!r} (not a snapshot, or a torn write)")
  n = int.from_bytes(blob[8:16], "little")
  try:
    manifest = json.loads(blob[16:16 + n])
  except ValueError as e:
    raise corrupt(f"unreadable manifest ({e})") from None
  data = memoryview(blob)[16 + n:]
  try:
    if len(data) != manifest["nbytes"]:
      raise corrupt(f"holds {len(data)} data bytes, the manifest says {manifest['nbytes']} "
                    "(truncated or torn write)")
    items = []
    for leaf in manifest["leaves"]:
      dtype = _dtype(leaf["dtype"])
      a = np.frombuffer(data, dtype, leaf["nbytes"] // dtype.itemsize, leaf["offset"])
      items.append((tuple(leaf["path"]), a.reshape(leaf["shape"])))
  except (KeyError, TypeError, ValueError) as e:
    if isinstance(e, CorruptSnapshotError):
      raise
    raise corrupt(f"malformed manifest ({type(e).__name__}: {e})") from None
  if _digest(items) != manifest["checksum"]:
    raise corrupt(f"checksum mismatch for version {manifest['version']} (corrupted bytes)")
  return manifest["version"], unflatten(items, template)
