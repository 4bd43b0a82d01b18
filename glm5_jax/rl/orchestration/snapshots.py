"""Sharded, versioned weight snapshots: every process writes and reads only its own shards.

  store = ShardedWeights(directory, keep=2)   # picklable: a directory and two numbers
  store.publish(params, version)              # every process holding params, every K updates
  version, params = store.latest(template)    # rollout processes, onto their own shardings

GLM-5 (arXiv 2602.15763, §3) decouples rollout from training: rollout engines keep sampling
and pick up the trainer's weights every K updates. `InProcessWeights` and `FileWeights`
(glm5_jax/rl/orchestration/weights.py) move the whole tree through one process; at 744B parameters
(1.5 TB in bfloat16) no process can hold it. Here the trainer's processes write the shards
their devices hold and each reader builds its arrays (`template`: a tree of
`jax.ShapeDtypeStruct(shape, dtype, sharding=...)`, any mesh, devices or processes) from
the slices its devices need, one leaf at a time.

On disk (one zarr v3 array per leaf, written through tensorstore, uncompressed, chunk = the
writer's shard shape, so a shard is one chunk file):

  directory/v{version:010d}/                 a committed version (renamed into place)
    COMMIT                                   written last: version, writers, manifest sha256s
    manifest.p{process:05d}.json             one per writer process: per leaf its key path,
                                             shape, dtype, chunk, and per shard it wrote the
                                             slice [[start, stop], ...], shape, sha256, bytes
    leaves/<key path>/zarr.json, c/i/j/...   the arrays (key components %-escaped)
  directory/.v{version:010d}.partial/        a publish in progress; readers never look here

Commit protocol. The writers are the processes owning devices of `params` (their
shardings); the primary is the lowest of them. Every writer checks the version, deletes its
own files of an earlier failed attempt, writes its replica-0 shards leaf by leaf into the
partial directory, then its manifest (temp file, fsync, rename) last. The primary waits
(`timeout_s`) for every writer's manifest, checks that they agree on the tree and that
their shards tile every leaf exactly once, writes COMMIT, and renames the directory to
`v{version:010d}` (atomic on POSIX): a reader sees a whole version or none. The other
writers return once the version is visible. A writer that fails writes `ABORT.p{process}`,
which stops the others waiting. The coordination is only through files, not a JAX
collective: reader processes of the same jax.distributed cluster take no part. After a
commit the primary prunes all but the newest `keep` versions (rename out of sight, then
delete) and abandoned partial directories of older versions.

Checksums. A reader opens COMMIT (refusing a version without it), checks each manifest's
sha256 against it, then each shard it reads against its manifest entry: shape, dtype and
sha256 of its bytes. Any mismatch, truncated or missing chunk file, or hole in the tiling
raises `weights.CorruptSnapshotError` naming the file, leaf and shard.

Memory per process. A writer holds its share of the tree plus host copies of one leaf's
local shards; a reader its new share plus the writer shards overlapping one leaf's local
slices (at most one leaf), plus the manifests (about 100 bytes per shard).

Not covered: object stores without atomic rename (GCS, S3) and filesystems without POSIX
rename semantics; writers that do not enter `publish` together (they are SPMD programs, so
they do) when a crashed attempt at the same version left a partial directory (each writer
deletes its own stale manifest first, so a writer still deleting after the primary has
finished its share could have an old manifest committed; bytes that do not match it are
still refused by the checksums); deleting versions a reader is still serving (readers copy
into device arrays, so a pruned version only fails reads in progress, which `latest`
retries on the newest version).
"""

import hashlib
import json
import os
import re
import shutil
import time
import uuid

import jax
import numpy as np
import tensorstore as ts

from glm5_jax.rl.orchestration import snapshot_layout as layout
from glm5_jax.rl.orchestration import weights as weights_lib
from glm5_jax.rl.orchestration.weights import CorruptSnapshotError
from glm5_jax.rl.orchestration.weights import _check_version
from glm5_jax.rl.orchestration.weights import _dtype
from glm5_jax.rl.orchestration.weights import _key_name
from glm5_jax.rl.orchestration.weights import _template_paths

COMMIT = "COMMIT"
_COMMITTED = re.compile(r"^v(\d{10})$")
_PARTIAL = re.compile(r"^\.v(\d{10})\.partial$")
_POLL_S = 0.02


class VersionNotFoundError(LookupError):
  """A version that is not on disk, or was pruned while it was being read."""


# ------------------------------------------------------------------ writer side
def _writer_processes(leaves) -> list[int]:
  procs = {d.process_index for x in leaves if isinstance(x, jax.Array)
           for d in x.sharding.device_set}
  return sorted(procs) or [jax.process_index()]


def _leaf_plan(leaf, primary: bool):
  """(shape, dtype, distinct boxes, [(box, shard getter)] this process writes)."""
  if isinstance(leaf, jax.Array):
    shape = tuple(leaf.shape)
    boxes = {layout.box(i, shape) for i in leaf.sharding.devices_indices_map(shape).values()}
    mine = [(layout.box(s.index, shape), s) for s in leaf.addressable_shards if s.replica_id == 0]
    return shape, np.dtype(leaf.dtype), boxes, [(b, lambda s=s: np.asarray(s.data))
                                                 for b, s in mine]
  a = np.asarray(leaf)                         # a host leaf: one shard, the primary's
  full = tuple((0, n) for n in a.shape)
  return a.shape, a.dtype, {full}, [(full, lambda: a)] if primary else []


def _check_manifests(manifests, own, partial):
  """The writers' manifests agree on the tree and their shards tile every leaf once."""
  want = [(m["path"], m["shape"], m["dtype"], m["chunk"]) for m in own]
  for pid, m in manifests.items():
    got = [(x["path"], x["shape"], x["dtype"], x["chunk"]) for x in m["leaves"]]
    if got != want:
      raise ValueError(f"ShardedWeights.publish: process {pid}'s manifest in {partial} "
                       "describes another tree (key paths, shapes, dtypes or shard grid) "
                       "than the primary's: every writer must publish the same params")
  for i, leaf in enumerate(own):
    boxes = [tuple(map(tuple, s["index"])) for m in manifests.values()
             for s in m["leaves"][i]["shards"]]
    if len(boxes) != len(set(boxes)) or set(boxes) != leaf["boxes"]:
      raise ValueError(f"ShardedWeights.publish: the writers' shards of "
                       f"{layout.name(leaf['path'])} do not tile it exactly once (written "
                       f"{sorted(boxes)}, expected {sorted(leaf['boxes'])})")


# ------------------------------------------------------------------ the store
class ShardedWeights:
  """Versioned, sharded, checksummed snapshots in `directory` (the module docstring).

  Any number of writer processes (those holding `params`) and reader processes. Picklable
  (a directory and two numbers): hand it to Ray actors like `FileWeights`. As in the other
  stores, `last_push` holds what this process wrote in its latest publish, {"push_bytes",
  "push_s", "push_shards"} (the trainer logs it as metrics), and `last_pull` what it read in
  its latest `get` / `latest`, {"pull_bytes", "pull_s", "pull_shards"}: shard bytes only,
  not the manifests.
  """

  def __init__(self, directory: str, keep: int = 2, timeout_s: float = 600.0):
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
      raise ValueError(f"ShardedWeights keep={keep!r}: expected an int >= 1")
    if not timeout_s > 0:
      raise ValueError(f"ShardedWeights timeout_s={timeout_s!r}: expected a number > 0")
    self.directory, self.keep, self.timeout_s = directory, keep, float(timeout_s)
    self.last_push = {"push_bytes": 0.0, "push_s": 0.0, "push_shards": 0.0}
    self.last_pull = {"pull_bytes": 0.0, "pull_s": 0.0, "pull_shards": 0.0}
    os.makedirs(directory, exist_ok=True)

  def path(self, version: int) -> str:
    return os.path.join(self.directory, f"v{version:010d}")

  def _partial(self, version: int) -> str:
    return os.path.join(self.directory, f".v{version:010d}.partial")

  def versions(self) -> list[int]:
    """The committed versions on disk, ascending."""
    return sorted(int(m.group(1)) for m in map(_COMMITTED.match, os.listdir(self.directory))
                  if m and os.path.exists(os.path.join(self.directory, m.group(0), COMMIT)))

  def version(self) -> int:
    """The latest committed version; -1 before the first publish."""
    return max(self.versions(), default=-1)

  # ---------------------------------------------------------------- publish
  def publish(self, params, version: int) -> dict:
    """Writes this process's replica-0 shards of `params` as `version`; the primary writer
    commits once every writer's manifest is in. Every writer process must call it; it
    returns (and records as `last_push`) what this process wrote, once `version` is
    visible to readers."""
    t0 = time.perf_counter()
    items, _ = jax.tree_util.tree_flatten_with_path(params)
    paths = [tuple(_key_name(k) for k in p) for p, _ in items]
    if len(set(paths)) != len(paths):
      raise ValueError("ShardedWeights.publish: two leaves of params have the same key path")
    writers, me = _writer_processes([x for _, x in items]), jax.process_index()
    if me not in writers:
      raise ValueError(f"ShardedWeights.publish: process {me} holds no device of params "
                       f"(held by processes {writers}); only those processes call publish")
    primary = me == writers[0]
    version = _check_version(version, self.version(), "ShardedWeights")
    if os.path.exists(self.path(version)):
      raise ValueError(f"ShardedWeights.publish: {self.path(version)} exists without a "
                       f"{COMMIT} file (not a committed version); remove it to publish "
                       f"version {version}")
    partial = self._partial(version)
    os.makedirs(partial, exist_ok=True)
    manifest = os.path.join(partial, f"manifest.p{me:05d}.json")
    for stale in (manifest, os.path.join(partial, f"ABORT.p{me:05d}")):
      layout.remove(stale)                            # of an earlier attempt at this version
    try:
      leaves, nbytes, nshards = self._write_leaves(items, paths, partial, primary)
      layout.write_json(manifest, {"version": version, "process": me, "writers": writers,
                                   "leaves": [{k: v for k, v in x.items() if k != "boxes"}
                                              for x in leaves]})
      if primary:
        self._commit(version, writers, leaves, partial)
        self._prune(version)
      else:
        self._await_commit(version, partial)
    except BaseException as e:
      if os.path.isdir(partial):
        layout.write_json(os.path.join(partial, f"ABORT.p{me:05d}"),
                          {"process": me, "error": f"{type(e).__name__}: {e}"})
      raise
    self.last_push = {"push_bytes": float(nbytes), "push_s": time.perf_counter() - t0,
                      "push_shards": float(nshards)}
    return self.last_push

  def _write_leaves(self, items, paths, partial, primary):
    """Streams leaf by leaf: host copies of one leaf's local shards, written, dropped."""
    ctx, out, nbytes, nshards = ts.Context(), [], 0, 0
    for path, (_, leaf) in zip(paths, items):
      shape, dtype, boxes, mine = _leaf_plan(leaf, primary)
      chunk = layout.chunk_shape(boxes, shape, layout.name(path))
      spec = layout.zarr_spec(os.path.join(partial, layout.leaf_dir(path)), shape, dtype, chunk)
      mode = dict(create=True, open=True) if primary else dict(open=True, assume_metadata=True)
      arr = ts.open(spec, context=ctx, **mode).result()
      host = [(box, get()) for box, get in mine]
      futures = [arr[layout.slices(box)].write(a, can_reference_source_data_indefinitely=True)
                 for box, a in host if a.size]         # no copy: `host` outlives the writes
      for f in futures:
        f.result()
      shards = [{"index": [list(b) for b in box], "shape": list(a.shape), "nbytes": a.nbytes,
                 "sha256": layout.sha256(a)} for box, a in host]
      nbytes, nshards = nbytes + sum(a.nbytes for _, a in host), nshards + len(host)
      del host, futures
      out.append({"path": list(path), "shape": list(shape), "dtype": dtype.name,
                  "chunk": list(chunk), "dir": layout.leaf_dir(path), "shards": shards,
                  "boxes": {tuple(map(tuple, b)) for b in boxes}})
    return out, nbytes, nshards

  def _wait(self, ready, partial, what):
    """Polls `ready()` until true; raises on a writer's ABORT file or, after timeout_s,
    a TimeoutError saying `what()`."""
    deadline = time.monotonic() + self.timeout_s
    while not ready():
      aborts = [f for f in os.listdir(partial) if f.startswith("ABORT.")] \
          if os.path.isdir(partial) else []
      if aborts:
        reasons = [json.load(open(os.path.join(partial, f)))["error"] for f in sorted(aborts)]
        raise RuntimeError(f"ShardedWeights.publish: a writer aborted {partial} "
                           f"({', '.join(sorted(aborts))}: {reasons})")
      if time.monotonic() > deadline:
        raise TimeoutError(f"ShardedWeights.publish: {what()} within timeout_s="
                           f"{self.timeout_s:g} s")
      time.sleep(_POLL_S)

  def _commit(self, version, writers, own, partial):
    names = {p: f"manifest.p{p:05d}.json" for p in writers}
    missing = lambda: [p for p, n in names.items()
                       if not os.path.exists(os.path.join(partial, n))]
    self._wait(lambda: not missing(), partial,
               lambda: f"processes {missing()} wrote no manifest in {partial} (every process "
               "holding devices of params must call publish)")
    blobs = {p: open(os.path.join(partial, n), "rb").read() for p, n in names.items()}
    manifests = {p: json.loads(b) for p, b in blobs.items()}
    _check_manifests(manifests, own, partial)
    layout.write_json(os.path.join(partial, COMMIT),
                      {"version": version, "writers": writers, "leaves": len(own),
                       "manifests": {names[p]: hashlib.sha256(b).hexdigest()
                                     for p, b in blobs.items()}})
    os.rename(partial, self.path(version))      # atomic: the version appears whole
    fd = os.open(self.directory, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)

  def _await_commit(self, version, partial):
    self._wait(lambda: os.path.exists(os.path.join(self.path(version), COMMIT)), partial,
               lambda: f"the primary writer did not commit version {version} ({partial})")

  def discard_from(self, version: int) -> list[int]:
    """Removes the committed versions `version` and later and every partial one (a resumed
    run's trainer publishes from its checkpoint's version again; what a killed run pushed
    after it is not that run's weights). Call it from the writers' primary process before
    any reader starts. Returns the versions removed."""
    gone = [v for v in self.versions() if v >= version]
    doomed = [self.path(v) for v in gone]
    doomed += [os.path.join(self.directory, n) for n in os.listdir(self.directory)
               if _PARTIAL.match(n)]
    for path in doomed:
      hidden = os.path.join(self.directory, f".pruned.{uuid.uuid4().hex}")
      try:
        os.rename(path, hidden)                 # out of readers' sight first
      except FileNotFoundError:
        continue
      shutil.rmtree(hidden, ignore_errors=True)
    return gone

  def _prune(self, version: int) -> None:
    """All but the newest `keep` versions, and abandoned partial directories, go."""
    doomed = [self.path(v) for v in self.versions()[:-self.keep]]
    doomed += [os.path.join(self.directory, n) for n in os.listdir(self.directory)
               if (m := _PARTIAL.match(n)) and int(m.group(1)) < version]
    for path in doomed:
      hidden = os.path.join(self.directory, f".pruned.{uuid.uuid4().hex}")
      try:
        os.rename(path, hidden)                 # out of readers' sight first
      except FileNotFoundError:
        continue                                # another process pruned it first
      shutil.rmtree(hidden, ignore_errors=True)
    for n in os.listdir(self.directory):       # left by a crash in the middle of a delete
      if n.startswith(".pruned."):
        shutil.rmtree(os.path.join(self.directory, n), ignore_errors=True)

  # ---------------------------------------------------------------- read
  def get(self, version: int, template=None):
    """The params of committed `version` in `template`'s shardings (verified shards).

    `template`: a tree of `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` (or arrays);
    key paths, shapes and dtypes must match the snapshot. Each process reads, once per leaf,
    the writer shards that overlap the slices its own devices hold: when the reader's slices
    are unions of writer shards that is exactly the bytes they hold; otherwise every
    overlapping writer shard is read whole (its checksum covers all of it), up to the whole
    leaf once per process however many local devices share it. A leaf without a sharding,
    or `template=None`, is returned whole as a host numpy array (nested dicts for None).
    Raises VersionNotFoundError when `version` is not on disk or is pruned while read.
    """
    t0 = time.perf_counter()
    root = self.path(version)
    leaves = None
    try:
      leaves = self._manifest(version, root)
      out, nbytes, nshards = self._read_leaves(leaves, template, root, version)
    except (CorruptSnapshotError, OSError, ValueError) as e:
      if os.path.exists(self._partial(version)) and leaves is None:
        raise                                    # never committed, not pruned
      if not os.path.isdir(root):
        raise VersionNotFoundError(f"ShardedWeights.get: version {version} was pruned from "
                                   f"{self.directory} while being read ({e}); keep="
                                   f"{self.keep} may be too small for the publish rate") from e
      raise
    self.last_pull = {"pull_bytes": float(nbytes), "pull_s": time.perf_counter() - t0,
                      "pull_shards": float(nshards)}
    return out

  def latest(self, template=None):
    """(version, params) of the newest committed version; LookupError when there is none.
    A version pruned while it is read is retried with the then newest."""
    for _ in range(10):
      versions = self.versions()
      # A listing can miss every version: the newest is pruned (`_prune`, after a newer one
      # committed) between `versions`' listdir and its check of the commit file. Only a
      # store that stays empty over a few listings has none.
      for _ in range(3):
        versions = versions or self.versions()
      if not versions:
        raise LookupError(f"ShardedWeights.latest: no committed version in {self.directory}")
      try:
        return versions[-1], self.get(versions[-1], template)
      except VersionNotFoundError:
        continue
    raise LookupError(f"ShardedWeights.latest: versions in {self.directory} kept vanishing "
                      f"while being read (keep={self.keep} too small for the publish rate?)")

  def _manifest(self, version, root) -> dict:
    """path -> leaf entry with its shards (each tagged with its manifest file), verified."""
    if not os.path.isdir(root):
      partial = self._partial(version)
      if os.path.isdir(partial):
        raise CorruptSnapshotError(f"ShardedWeights: version {version} is not committed "
                                   f"({partial} is a publish in progress or torn)")
      raise VersionNotFoundError(f"ShardedWeights.get: version {version} is not in "
                                 f"{self.directory}; committed versions: {self.versions()} "
                                 f"(keep={self.keep})")
    commit_file = os.path.join(root, COMMIT)
    if not os.path.exists(commit_file):
      raise CorruptSnapshotError(f"ShardedWeights: {root} has no {COMMIT} file: version "
                                 f"{version} is not committed (torn or copied by hand)")
    try:
      commit = json.loads(open(commit_file, "rb").read())
      names = commit["manifests"]
    except (ValueError, KeyError, TypeError) as e:
      raise CorruptSnapshotError(f"ShardedWeights: {commit_file} is unreadable ({e})") from None
    leaves = None
    for name, digest in sorted(names.items()):
      file = os.path.join(root, name)
      if not os.path.exists(file):
        raise CorruptSnapshotError(f"ShardedWeights: {file} is missing (listed in {COMMIT})")
      blob = open(file, "rb").read()
      if hashlib.sha256(blob).hexdigest() != digest:
        raise CorruptSnapshotError(f"ShardedWeights: {file} does not match its sha256 in "
                                   f"{COMMIT} (corrupted or replaced)")
      m = json.loads(blob)
      if leaves is None:
        leaves = {tuple(x["path"]): dict(x, shards=[]) for x in m["leaves"]}
      for x in m["leaves"]:
        leaves[tuple(x["path"])]["shards"] += [dict(s, manifest=name) for s in x["shards"]]
    return leaves

  def _read_leaves(self, leaves, template, root, version):
    if template is None:
      want = [(p, tuple(x["shape"]), _dtype(x["dtype"]), None) for p, x in leaves.items()]
    else:
      flat, _ = jax.tree_util.tree_flatten_with_path(template)
      want = [(p, shape, dtype, getattr(leaf, "sharding", None))
              for (p, shape, dtype), (_, leaf) in zip(_template_paths(template), flat)]
    _check_template(leaves, want, version)
    ctx, out, nbytes, nshards = ts.Context(), [], 0, 0
    for path, shape, dtype, sharding in want:
      leaf = _LeafReader(leaves[path], root, ctx)
      if sharding is None:
        out.append(leaf.read(tuple((0, n) for n in shape)))
      else:
        out.append(jax.make_array_from_callback(
            shape, sharding, lambda index, leaf=leaf: leaf.read(layout.box(index, shape))))
      nbytes, nshards = nbytes + leaf.nbytes, nshards + leaf.nshards
      del leaf                                   # its verified writer shards go with it
    if template is None:
      return weights_lib.unflatten([(p, a) for (p, *_), a in zip(want, out)]), nbytes, nshards
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), out), \
        nbytes, nshards


def _check_template(leaves, want, version):
  got = {p for p, *_ in want}
  if got != set(leaves):
    missing = sorted(set(leaves) - got)
    extra = sorted(got - set(leaves))
    raise ValueError(f"ShardedWeights: version {version}'s key paths differ from the "
                     f"template's (missing from the template "
                     f"{[layout.name(p) for p in missing[:5]]}, not in the snapshot "
                     f"{[layout.name(p) for p in extra[:5]]})")
  for path, shape, dtype, _ in want:
    x = leaves[path]
    if tuple(x["shape"]) != shape or _dtype(x["dtype"]) != dtype:
      raise ValueError(f"ShardedWeights: {layout.name(path)} is {x['dtype']}{x['shape']} in "
                       f"version {version}, the template's is {dtype}{list(shape)}")


class _LeafReader:
  """One leaf's reads: writer shards read once each, verified, then cut to device slices."""

  def __init__(self, entry, root, ctx):
    self.entry, self.root = entry, root
    self.name, self.shape = layout.name(entry["path"]), tuple(entry["shape"])
    self.dtype, self.chunk = _dtype(entry["dtype"]), tuple(entry["chunk"])
    self.dir = os.path.join(root, entry["dir"])
    self.arr = ts.open(layout.zarr_spec(self.dir, self.shape, self.dtype, self.chunk),
                       context=ctx, open=True, assume_metadata=True).result()
    self.cache, self.nbytes, self.nshards = {}, 0, 0

  def _corrupt(self, shard, why):
    box = tuple(map(tuple, shard["index"]))
    return CorruptSnapshotError(
        f"ShardedWeights: {layout.chunk_file(self.dir, box, self.chunk)} (leaf {self.name}, shard "
        f"{[list(b) for b in box]}, {shard['manifest']}): {why}")

  def _shard(self, shard) -> np.ndarray:
    box = tuple(map(tuple, shard["index"]))
    if box not in self.cache:
      if list(layout.extent(box)) != shard["shape"] or shard.get("nbytes") != \
          int(np.prod(shard["shape"])) * self.dtype.itemsize:
        raise self._corrupt(shard, f"the manifest's shape {shard['shape']} / bytes "
                            f"{shard.get('nbytes')} do not match the slice")
      try:
        a = self.arr[layout.slices(box)].read().result() if np.prod(layout.extent(box)) else \
            np.zeros(layout.extent(box), self.dtype)
      except ValueError as e:                    # tensorstore: missing or truncated chunk
        raise self._corrupt(shard, f"unreadable ({e})") from None
      if a.shape != layout.extent(box) or a.dtype != self.dtype:
        raise self._corrupt(shard, f"read {a.dtype}{list(a.shape)}, expected "
                            f"{self.dtype}{shard['shape']}")
      if layout.sha256(a) != shard["sha256"]:
        raise self._corrupt(shard, "sha256 mismatch (corrupted bytes)")
      self.cache[box] = a
      self.nbytes, self.nshards = self.nbytes + a.nbytes, self.nshards + 1
    return self.cache[box]

  def read(self, box) -> np.ndarray:
    """The slice `box` ((start, stop) per dim) of the leaf, from the shards it overlaps."""
    overlaps = []
    for s in self.entry["shards"]:
      cut = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, s["index"]))
      if all(a < b for a, b in cut) or (not box and not s["index"]):
        overlaps.append((s, cut))
    if len(overlaps) == 1 and tuple(map(tuple, overlaps[0][0]["index"])) == box:
      return self._shard(overlaps[0][0])         # aligned: the writer's shard itself
    out = np.empty(layout.extent(box), self.dtype)
    covered = 0
    for s, cut in overlaps:
      src = tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(cut, s["index"]))
      dst = tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(cut, box))
      out[dst] = self._shard(s)[src]
      covered += int(np.prod(layout.extent(cut)))
    if covered != out.size:
      raise CorruptSnapshotError(
          f"ShardedWeights: {self.dir} (leaf {self.name}): the manifests' shards cover "
          f"{covered} of the {out.size} elements of slice {[list(b) for b in box]} "
          "(a shard missing from the manifests)")
    return out
