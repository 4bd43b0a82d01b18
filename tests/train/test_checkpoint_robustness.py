"""Checkpoints: a corrupt latest step falls back to the previous good one (one log line
naming the file), params-only restores into target shardings, keep_checkpoints >= 1."""

import os
import shutil
import subprocess
import sys

from absl import logging
import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import orbax_io
from glm5_jax.train import checkpoint as ckpt_lib
from tests.train import test_train as tt
from tests.train.test_preemption import data_dir  # pylint: disable=unused-import  (a fixture)


def _state(rng, step):
  return {"params": {"w": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32) + step},
          "opt_state": {"mu": jnp.full((5,), float(step))}}


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)


def _iter():
  return iter(grain.MapDataset.range(100).to_iter_dataset())


@pytest.fixture
def two_steps(tmp_path, rng):
  """A workdir with checkpoints 1 and 2 (the iterator advanced once per step)."""
  it, states = _iter(), {}
  with ckpt_lib.manager(str(tmp_path), keep=3, async_save=False) as m:
    for step in (1, 2):
      next(it)
      states[step] = _state(rng, step)
      ckpt_lib.save(m, step, states[step], it, force=True)
  return str(tmp_path), states


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _state_data_files(step_dir):
  return [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state"))
          for f in fs if "/d/" in os.path.join(r, f) and "ocdbt.process" in r]


def _biggest_state_file(step_dir):
  return max(_state_data_files(step_dir), key=os.path.getsize)


@pytest.mark.parametrize("damage", ["state_data", "state_metadata", "data_json", "no_state"])
def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(two_steps, damage,
                                                                  monkeypatch):
  workdir, states = two_steps
  step_dir = os.path.join(workdir, "checkpoints", "2")
  target = {"state_data": lambda: _biggest_state_file(step_dir),
            "state_metadata": lambda: os.path.join(step_dir, "state", "_METADATA"),
            "data_json": lambda: os.path.join(step_dir, "data", "process_0-of-1.json"),
            "no_state": lambda: os.path.join(step_dir, "state")}[damage]()
  if damage == "no_state":
    os.rename(target, target + ".gone")
  else:
    _truncate(target)
  errors = []
  monkeypatch.setattr(logging, "error", lambda msg, *a: errors.append(msg % a))
  it = _iter()
  with ckpt_lib.manager(workdir, keep=3, async_save=False) as m:
    step, state = ckpt_lib.restore_latest(m, _abstract(states[1]), it)
    assert m.all_steps() == [1]
  assert step == 1
  np.testing.assert_array_equal(state["params"]["w"], states[1]["params"]["w"])
  assert next(it) == 1                                  # the iterator of step 1
  assert len(errors) == 1 and "step 2" in errors[0] and "\n" not in errors[0]
  named = {"state_data": "state/", "state_metadata": "_METADATA",
           "data_json": "process_0-of-1.json", "no_state": "state"}[damage]
  assert named in errors[0], errors[0]
  assert os.path.isdir(os.path.join(workdir, "corrupt_checkpoints", "2"))


def test_other_optimizer_state_is_a_clear_error_not_corruption(two_steps):
  workdir, states = two_steps
  other = {"params": states[2]["params"], "opt_state": {"nu": states[2]["opt_state"]["mu"]}}
  with ckpt_lib.manager(workdir, keep=3, async_save=False) as m:
    with pytest.raises(ValueError, match="config.optimizer='adamw'.*another stage or optimizer"):
      ckpt_lib.restore_latest(m, _abstract(other), _iter(), what="config.optimizer='adamw'")
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "2"))     # nothing moved


def test_restore_params_reads_params_only_into_the_target_sharding(two_steps):
  workdir, states = two_steps
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev),
                        states[2]["params"])
  params = orbax_io.restore_params(workdir, target)
  assert set(params) == {"w"}
  np.testing.assert_array_equal(params["w"], states[2]["params"]["w"])
  assert params["w"].sharding == dev


def test_restore_params_of_a_corrupt_workdir_is_one_line_naming_it(two_steps):
  workdir, states = two_steps
  _truncate(_biggest_state_file(os.path.join(workdir, "checkpoints", "2")))
  with pytest.raises(ValueError, match=f"config.init_from='{workdir}': checkpoint unreadable") as e:
    orbax_io.restore_params(workdir, _abstract(states[2]["params"]))
  assert "\n" not in str(e.value)


def _all_state_files(step_dir):
  return [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state"))
          for f in fs if "/d/" in os.path.join(r, f) or r.endswith("/d")]


def test_every_state_file_truncated_is_one_line_not_a_crash(two_steps):
  """With the tree's own metadata unreadable too, orbax's checkpointer returned None (after
  two warnings) and restore_params died in an AttributeError."""
  workdir, states = two_steps
  for f in _all_state_files(os.path.join(workdir, "checkpoints", "2")):
    _truncate(f)
  with pytest.raises(ValueError, match=f"config.init_from='{workdir}': checkpoint unreadable") as e:
    orbax_io.restore_params(workdir, _abstract(states[2]["params"]))
  assert "\n" not in str(e.value) and "tensorstore_spec" not in str(e.value)


def test_a_failed_reads_aftermath_is_dropped_and_nothing_else(monkeypatch):
  """tensorstore calls back into the closed event loop of a failed read (an unraisable
  RuntimeError) and asyncio logs its sibling reads' errors at garbage collection; both
  come after the one-line report and are dropped, other messages are not."""
  import logging as std_logging  # pylint: disable=g-import-not-at-top
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(str(u.exc_value)))
  orbax_io.mute_aftermath()
  orbax_io.mute_aftermath()                         # idempotent: one filter, one hook

  class Unraisable:
    def __init__(self, exc):
      self.exc_value, self.exc_type, self.exc_traceback = exc, type(exc), None
      self.err_msg, self.object = None, None

  sys.unraisablehook(Unraisable(RuntimeError("Event loop is closed")))
  sys.unraisablehook(Unraisable(Exception("Encountered error while reading array index: "
                                          "(slice(0, 5, 1),). See full TensorStore details")))
  sys.unraisablehook(Unraisable(RuntimeError("something else")))
  sys.unraisablehook(Unraisable(KeyError("tensorstore")))       # not a read's error
  assert seen == ["something else", "'tensorstore'"]
  log = std_logging.getLogger("asyncio")
  assert sum(isinstance(f, orbax_io._DropAftermath) for f in log.filters) == 1
  def record(exc):
    return std_logging.LogRecord("asyncio", 40, __file__, 1, "Task exception was never "
                                 "retrieved", None, (type(exc), exc, None))
  assert not log.filter(record(ValueError("OUT_OF_RANGE: ... [tensorstore_spec='{}']")))
  assert log.filter(record(ValueError("an unrelated error")))


def test_a_corrupt_fallback_prints_one_line(tmp_path, two_steps):
  """End to end in a fresh interpreter: the log of a fallback is the one error line."""
  workdir, _ = two_steps
  for f in _all_state_files(os.path.join(workdir, "checkpoints", "2")):
    _truncate(f)
  code = f"""
import grain, jax, jax.numpy as jnp
from glm5_jax.train import checkpoint as c
abstract = {{"params": {{"w": jax.ShapeDtypeStruct((64, 8), jnp.float32)}},
            "opt_state": {{"mu": jax.ShapeDtypeStruct((5,), jnp.float32)}}}}
with c.manager({workdir!r}, keep=3, async_save=False) as m:
  step, _ = c.restore_latest(m, abstract, iter(grain.MapDataset.range(9).to_iter_dataset()))
print("restored", step)
"""
  p = subprocess.run([sys.executable, "-c", code], cwd=tt.ROOT, env=tt._env(),
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 0 and p.stdout.strip() == "restored 1", p.stderr[-2000:]
  lines = p.stderr.strip().splitlines()
  assert len(lines) == 1 and "checkpoint step 2 is unreadable" in lines[0], p.stderr[-3000:]


@pytest.mark.parametrize("keep", [0, -1, None])
def test_keep_checkpoints_below_one_is_rejected(tmp_path, keep):
  with pytest.raises(ValueError, match=f"config.keep_checkpoints={keep}: expected an integer"):
    ckpt_lib.manager(str(tmp_path), keep=keep)


# End to end, through `python -m experiments.pretrain` / `experiments.sample` (slow).

def _pretrain(workdir, data_dir, *extra, check=True, devices=1):
  return tt._run(workdir, data_dir, *extra, check=check, devices=devices)


@pytest.mark.slow
def test_runs_on_a_damaged_workdir(tmp_path, data_dir):
  """Another stage, fewer steps, a corrupt latest step: for resume, init_from and sample."""
  wd = tmp_path / "w"
  _pretrain(wd, data_dir, "--config.total_steps=2", "--config.checkpoint_every=1")
  p = _pretrain(wd, data_dir, "--config.total_steps=3", "--config.stage=dsa_sparse", check=False)
  assert p.returncode != 0 and "config.stage='dsa_sparse' with config.optimizer=" in p.stderr
  p = _pretrain(wd, data_dir, "--config.total_steps=1", check=False)
  assert p.returncode != 0 and "config.total_steps=1 is below the step 2" in p.stderr

  for f in _state_data_files(str(wd / "checkpoints" / "2")):   # params included (init_from
    _truncate(f)                                                # reads params only)
  p = _pretrain(tmp_path / "child", data_dir, "--config.total_steps=1",
                f"--config.init_from={wd}", check=False)
  line = f"config.init_from='{wd}': checkpoint unreadable"
  assert p.returncode != 0 and line in p.stderr, p.stderr[-2000:]
  s = subprocess.run([sys.executable, "-m", "experiments.sample", f"--checkpoint={wd}",
                      "--max_new_tokens=2"], cwd=tt.ROOT, env=tt._env(), capture_output=True,
                     text=True, timeout=600)
  assert s.returncode != 0 and f"checkpoint='{wd}': checkpoint unreadable" in s.stderr
  assert s.stderr.strip().splitlines()[-1].startswith("error: checkpoint="), s.stderr[-2000:]

  p = _pretrain(wd, data_dir, "--config.total_steps=3", "--config.checkpoint_every=1")
  assert p.stderr.count("checkpoint step 2 is unreadable, using the previous one") == 1
  assert sorted(tt._losses(wd)) == [1, 2, 3]
  assert (wd / "corrupt_checkpoints" / "2").is_dir()


@pytest.mark.slow
def test_failed_evaluation_keeps_the_checkpoint_of_its_step(tmp_path, data_dir):
  bad = tmp_path / "data"
  shutil.copytree(data_dir, bad)
  for f in os.listdir(bad):
    if f.startswith("validation-"):
      _truncate(str(bad / f))
  p = _pretrain(tmp_path / "w", str(bad), "--config.total_steps=2",
                "--config.checkpoint_every=1", "--config.eval_every=1", check=False)
  assert p.returncode != 0 and "held-out evaluation at step 1 failed" in p.stderr, (
      p.stderr[-2000:])
  assert os.listdir(tmp_path / "w" / "checkpoints") == ["1"]


@pytest.mark.slow
def test_jit_init_on_a_mesh_whose_batch_axes_do_not_divide_8(tmp_path, data_dir):
  """GLM5.init's dummy batch follows the mesh: data=3 x expert=2 (6 devices)."""
  _pretrain(tmp_path / "w", data_dir, "--config.total_steps=1", "--config.batch_size=6",
            "--config.param_init=jit", "--config.mesh.data=3", "--config.mesh.expert=2",
            "--config.checkpoint_every=1", devices=6)


def test_model_config_field_added_later_at_its_default_is_the_same_model(tmp_path):
  import dataclasses  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  from glm5_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  cfg = config_lib.get_preset("tiny")
  saved = config_lib.model_fields(cfg)
  field = next(f.name for f in dataclasses.fields(cfg) if f.name in saved
               and saved[f.name] == f.default)
  del saved[field]                                   # a workdir written before the field
  with open(tmp_path / "model_config.json", "w") as f:
    json.dump(saved, f)
  orbax_io.check_model_config(str(tmp_path), cfg)
  saved["hidden_size"] += 1
  with open(tmp_path / "model_config.json", "w") as f:
    json.dump(saved, f)
  with pytest.raises(ValueError, match="holds a run of a different model.*hidden_size"):
    orbax_io.check_model_config(str(tmp_path), cfg)
