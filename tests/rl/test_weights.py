"""Versioned weights (glm5_jax/rl/orchestration/weights.py): round trips, monotone versions,
corruption, a reader racing a writer, pruning."""

import os
import threading

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from glm5_jax.rl.orchestration import weights as W

STORES = ("in_process", "file")


def _store(kind, tmp_path, keep=2):
  return W.InProcessWeights(keep=keep) if kind == "in_process" else W.FileWeights(
      str(tmp_path / "weights"), keep=keep)


def _params(rng, fill=None):
  def leaf(shape, dtype):
    a = rng.standard_normal(shape).astype(np.float32) if fill is None else np.full(
        shape, fill, np.float32)
    return a.astype(dtype)
  return {"embed": {"embedding": leaf((5, 3), ml_dtypes.bfloat16)},
          "layers": {"w": leaf((2, 3, 4), np.float32), "bias": leaf((4,), ml_dtypes.bfloat16),
                     "scale": leaf((), np.float32)}}


def _assert_bit_equal(got, want):
  flat_got, flat_want = W.flatten(got), W.flatten(want)
  assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
  for (path, a), (_, b) in zip(flat_got, flat_want):
    assert a.dtype == b.dtype and a.shape == b.shape, path
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8),
                                  err_msg=str(path))


@pytest.mark.parametrize("kind", STORES)
def test_round_trip_is_bit_exact_for_bf16_and_f32(kind, tmp_path, rng):
  store, params = _store(kind, tmp_path), _params(rng)
  assert store.version() == -1
  store.publish(params, 3)
  version, got = store.latest()
  assert version == store.version() == 3
  _assert_bit_equal(got, params)
  assert W.checksum(got) == W.checksum(params)
  # Into a template's structure (device arrays), as a worker with an engine would.
  template = {"layers": {"scale": jnp.zeros(()), "w": jnp.zeros((2, 3, 4)),
                         "bias": jnp.zeros((4,), jnp.bfloat16)},
              "embed": {"embedding": jnp.zeros((5, 3), jnp.bfloat16)}}
  _assert_bit_equal(store.latest(template)[1], params)


@pytest.mark.parametrize("kind", STORES)
def test_template_mismatch_names_the_leaf(kind, tmp_path, rng):
  store = _store(kind, tmp_path)
  store.publish(_params(rng), 0)
  bad = {"embed": {"embedding": jnp.zeros((5, 3), jnp.float32)},
         "layers": {"w": jnp.zeros((2, 3, 4)), "bias": jnp.zeros((4,), jnp.bfloat16),
                    "scale": jnp.zeros(())}}
  with pytest.raises(ValueError, match="embed/embedding is bfloat16"):
    store.latest(bad)
  with pytest.raises(ValueError, match="missing"):
    store.latest({"embed": bad["embed"]})


def test_checksum_covers_paths_shapes_dtypes_and_bytes(rng):
  a = rng.standard_normal((2, 3)).astype(np.float32)
  base = W.checksum({"w": a})
  variants = [{"v": a}, {"w": a.reshape(3, 2)}, {"w": a.view(np.int32)},
              {"w": a.copy() + np.float32(1e-7) * (a == a.flat[0])}]
  assert len({base, *map(W.checksum, variants)}) == 5
  assert W.checksum({"w": a.copy()}) == base


@pytest.mark.parametrize("kind", STORES)
def test_versions_must_strictly_increase(kind, tmp_path, rng):
  store = _store(kind, tmp_path)
  store.publish(_params(rng), 5)
  for bad in (5, 4, -1, "6", True):
    with pytest.raises(ValueError, match="version"):
      store.publish(_params(rng), bad)
  store.publish(_params(rng), 7)
  assert store.version() == 7


@pytest.mark.parametrize("kind", STORES)
def test_pruning_keeps_the_newest_keep_versions(kind, tmp_path, rng):
  store = _store(kind, tmp_path, keep=2)
  for v in (0, 1, 4, 6):
    store.publish(_params(rng, fill=v), v)
  if kind == "file":
    assert store.versions() == [4, 6]
    assert sorted(os.listdir(store.directory)) == ["v0000000004.weights", "v0000000006.weights"]
  np.testing.assert_array_equal(store.get(4)["layers"]["w"], 4.0)
  with pytest.raises((KeyError, FileNotFoundError)):
    store.get(1)


def test_corrupt_and_torn_snapshots_are_refused_naming_the_file(tmp_path, rng):
  store = W.FileWeights(str(tmp_path), keep=3)
  store.publish(_params(rng), 0)
  path = store.path(0)
  blob = bytearray(open(path, "rb").read())
  blob[-3] ^= 0x10                                     # one flipped bit in the last leaf
  open(path, "wb").write(bytes(blob))
  with pytest.raises(W.CorruptSnapshotError, match=f"{path}: checksum mismatch"):
    store.latest()
  store.publish(_params(rng), 1)
  open(store.path(2), "wb").write(open(store.path(1), "rb").read()[:-7])   # a torn write
  with pytest.raises(W.CorruptSnapshotError, match=f"{store.path(2)}: .*truncated"):
    store.latest()
  open(store.path(3), "wb").write(b"not a snapshot")
  with pytest.raises(W.CorruptSnapshotError, match=f"{store.path(3)}: does not start"):
    store.latest()


def test_a_crashed_writers_temp_file_is_ignored(tmp_path, rng):
  store = W.FileWeights(str(tmp_path))
  params = _params(rng)
  store.publish(params, 0)
  open(os.path.join(store.directory, ".v0000000001.weights.dead.tmp"), "wb").write(b"GLM5")
  assert store.version() == 0
  _assert_bit_equal(store.latest()[1], params)


@pytest.mark.parametrize("kind", STORES)
def test_a_reader_racing_the_writer_never_sees_a_torn_snapshot(kind, tmp_path):
  """Version v's params are all v: a reader seeing mixed values saw a torn snapshot."""
  store = _store(kind, tmp_path, keep=1)
  store.publish(_params(None, fill=0), 0)
  n, errors = 60, []
  seen = [[], []]                                      # versions each reader got, in order

  def read(mine):
    try:
      while not mine or mine[-1] < n - 1:
        version, params = store.latest()
        for path, a in W.flatten(params):
          assert np.all(a.astype(np.float32) == version), (version, path)
        mine.append(version)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  readers = [threading.Thread(target=read, args=(mine,)) for mine in seen]
  for t in readers:
    t.start()
  for v in range(1, n):
    store.publish(_params(None, fill=v), v)
  for t in readers:
    t.join(timeout=30)
  assert not errors, errors
  for mine in seen:
    assert mine == sorted(mine) and mine[-1] == n - 1
  assert len(set(seen[0] + seen[1])) > 1
