"""Sweeps: product / zip_ of config fields, point names, overrides checked by name, and a
2 x 2 sweep of the tiny pretraining config end to end (table, JSON, PNG; a re-run skips the
finished points)."""

import json
import os
import shlex
import subprocess
import sys

import pytest

from configs import common
from configs import pretrain
from glm5_jax.data import corpus
from glm5_jax.train import sweep
from tests import paths

ROOT = paths.ROOT
TINY = "model=tiny,runlocal=True"


def test_product_gives_every_combination_the_last_field_fastest():
  got = common.product({"total_steps": 5}, optimizer=["adamw", "muon"], seed=[0, 1])
  assert got == [{"total_steps": 5, "optimizer": o, "seed": s}
                 for o in ("adamw", "muon") for s in (0, 1)]
  assert common.product(**{"model.mtp_num_steps": [1, 3]}) == [{"model.mtp_num_steps": 1},
                                                               {"model.mtp_num_steps": 3}]


def test_zip_pairs_the_ith_points_and_a_single_dict_joins_all():
  got = common.zip_({"total_steps": 5}, optimizer=["adamw", "muon"], learning_rate=[1e-2, 3e-2])
  assert got == [{"total_steps": 5, "optimizer": "adamw", "learning_rate": 1e-2},
                 {"total_steps": 5, "optimizer": "muon", "learning_rate": 3e-2}]
  nested = common.product(common.zip_(optimizer=["a", "b"], learning_rate=[1, 2]), seed=[0, 1])
  assert [(p["optimizer"], p["learning_rate"], p["seed"]) for p in nested] == [
      ("a", 1, 0), ("a", 1, 1), ("b", 2, 0), ("b", 2, 1)]


@pytest.mark.parametrize("call,match", [
    (lambda: common.zip_(optimizer=["a", "b"], seed=[0, 1, 2]), r"have \[2, 3\] points"),
    (lambda: common.product({"seed": 1}, seed=[0, 1]), "config.seed is set by two"),
    (lambda: common.product(optimizer="adamw"), r"optimizer='adamw'.*expected a list"),
    (lambda: common.product(3), "expected a sweep"),
])
def test_malformed_sweeps_are_refused(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_point_names_show_the_fields_that_vary():
  points = common.product({"total_steps": 5}, optimizer=["adamw", "muon"],
                          learning_rate=[1e-2, 3e-2])
  assert sweep.point_names(points) == [
      "optimizer=adamw,learning_rate=0.01", "optimizer=adamw,learning_rate=0.03",
      "optimizer=muon,learning_rate=0.01", "optimizer=muon,learning_rate=0.03"]
  assert sweep.point_names([{"seed": 3, "data.dir": "/a b"}]) == ["seed=3,data.dir=_a_b"]
  with pytest.raises(ValueError, match="more than once"):
    sweep.point_names([{"seed": 1}, {"seed": 1}])


@pytest.mark.parametrize("key,match", [
    ("learning_rat", r"no field config.learning_rat \(config has \[.*'learning_rate'"),
    ("model.hidden_sise",
     r"no field config.model.hidden_sise \(config.model has \[.*'hidden_size'"),
    ("seed.x", r"no field config.seed.x \(config.seed is a value, not a section\)"),
])
def test_an_unknown_override_key_is_an_error_naming_it(key, match):
  with pytest.raises(ValueError, match=match):
    sweep.with_overrides(pretrain.get_config(TINY), {key: 1})


def test_overrides_set_nested_fields_on_a_copy():
  c = pretrain.get_config(TINY)
  got = sweep.with_overrides(c, {"model.mtp_num_steps": 1, "learning_rate": 3e-2})
  assert (got.model.mtp_num_steps, got.learning_rate) == (1, 3e-2)
  assert (c.model.mtp_num_steps, c.learning_rate) != (1, 3e-2)
  with pytest.raises(ValueError, match="sweep override seed=0.5"):
    sweep.with_overrides(c, {"seed": 0.5})


def test_a_bad_optimizer_is_refused_before_anything_runs():
  with pytest.raises(ValueError, match=r"config.optimizer='sgd': expected one of "
                                       r"\('muon_split', 'muon', 'adamw'\)"):
    sweep.point_configs(pretrain.get_config(TINY), [{"optimizer": "sgd"}])


def test_every_sweep_of_the_pretraining_config_is_valid():
  for name in pretrain.SWEEPS:
    points = sweep.load_sweep(f"configs/pretrain.py:{TINY}", name)
    assert len(sweep.point_configs(pretrain.get_config(TINY), points)) == len(points)
    assert len(set(sweep.point_names(points))) == len(points)
  ablation = sweep.point_configs(pretrain.get_config(TINY), pretrain.SWEEPS["muon_ablation"])
  assert {(c.optimizer, c.learning_rate) for c in ablation} == {
      ("adamw", 1e-2), ("muon", 3e-2), ("muon_split", 3e-2)}
  with pytest.raises(ValueError, match=r"--sweep='nope': .* defines the sweeps \["):
    sweep.load_sweep("configs/pretrain.py", "nope")


def test_flags_apply_to_every_point_but_not_to_a_swept_field():
  points = common.product({"total_steps": 240}, seed=[0, 1])
  assert sweep.with_flags(points, {"total_steps": 20}) == [{"total_steps": 20, "seed": 0},
                                                          {"total_steps": 20, "seed": 1}]
  with pytest.raises(ValueError, match="--config.seed: the sweep varies config.seed"):
    sweep.with_flags(points, {"seed": 3})


def test_launch_prints_one_tpu_vm_command_per_point():
  points = sweep.with_flags(common.product(optimizer=["adamw", "muon"]),
                            {"profile_steps": (10, 13)})
  cmds = sweep.launch_commands("configs/pretrain.py:model=glm5", points, "gs://b/s", "tpu z")
  assert len(cmds) == 2
  words = shlex.split(cmds[1])
  assert words[:4] == ["launch/tpu_vm.sh", "tpu", "z", "--"] and len(words) == 5
  remote = shlex.split(words[4])              # what the TPU VM's shell runs
  assert remote == ["python", "-m", "experiments.pretrain",
                    "--config=configs/pretrain.py:model=glm5", "--workdir=gs://b/s/optimizer=muon",
                    "--config.optimizer=muon", "--config.profile_steps=(10, 13)"]


def _corpus(rng, tmp_path) -> dict:
  """A small byte corpus of Python-like lines, prepared in tmp_path/data: its config fields."""
  src = tmp_path / "src"
  src.mkdir()
  for i in range(16):
    (src / f"m{i:02d}.py").write_text("".join(
        f"v{i}_{j} = f({int(rng.integers(0, 10 ** 5))})\n" for j in range(60)))
  corpus.prepare(str(src), str(tmp_path / "data"), val_fraction=0.25, num_shards=1)
  return {"data.dir": str(tmp_path / "data"), "data.source_dir": str(src),
          "data.val_fraction": 0.25, "data.num_shards": 1}


# A config file with a sweep of its own next to get_config, as glm5_jax.train.sweep loads it.
_CONFIG_FILE = """
from configs import common
from configs import pretrain

get_config = pretrain.get_config
SWEEPS = {"lr_x_seed": common.product(learning_rate=[1e-3, 1e-2], seed=[0, 1])}
"""
# The tiny pretraining config, smaller still: 5 steps, one dense layer, no MTP.
_SMALL = {"total_steps": 5, "seq_len": 32, "batch_size": 2, "loss_chunk": 32, "log_every": 1,
          "eval_every": 5, "eval_batches": 1, "checkpoint_every": 5, "tensorboard": False,
          "async_checkpoints": False, "optimizer": "adamw", "model.num_hidden_layers": 1,
          "model.mtp_num_steps": 0}
# Compile time is most of a point's (~12 s a train step here, ~5 s with LLVM's optimizations
# off); the two seeds of a learning rate compile the same step and share it through JAX's cache.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def test_sweep_trains_each_point_writes_the_report_and_skips_finished_points(tmp_path, rng):
  config_file = tmp_path / "sweep_config.py"
  config_file.write_text(_CONFIG_FILE)
  fields = {**_SMALL, **_corpus(rng, tmp_path)}
  out = tmp_path / "sweep"
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
             XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}")
  p = subprocess.run([sys.executable, "-m", "experiments.sweep", f"--config={config_file}:{TINY}",
                      "--sweep=lr_x_seed", f"--workdir={out}",
                      *[f"--config.{k}={v}" for k, v in fields.items()]],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  names = ["learning_rate=0.001,seed=0", "learning_rate=0.001,seed=1",
           "learning_rate=0.01,seed=0", "learning_rate=0.01,seed=1"]
  points = json.loads((out / "sweep.json").read_text())["points"]
  assert [p["name"] for p in points] == names
  for p in points:
    assert p["overrides"]["total_steps"] == 5 and p["steps"] == 5     # flags reach every point
    assert p["final_eval_loss"] > 0 and p["final_eval_bits_per_byte"] > 0
    assert len(p["curves"]["train_ce"]) == 5 and p["curves"]["eval"][-1][0] == 5
  md = (out / "sweep.md").read_text()
  assert all(f"| {n} | 5 |" in md for n in names) and "| learning_rate=0.01 | 2 |" in md
  assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"

  # The same sweep again (here in this process): every point is finished, none trains.
  metrics = {n: (out / n / "metrics.jsonl").read_bytes() for n in names}
  mtimes = {n: os.stat(out / n / "metrics.jsonl").st_mtime_ns for n in names}
  calls = []
  again = sweep.run_sweep(
      pretrain.get_config(TINY),
      sweep.with_flags(sweep.load_sweep(str(config_file), "lr_x_seed"), fields), str(out),
      run=lambda c, workdir: calls.append(workdir))
  assert calls == []
  assert {n: (out / n / "metrics.jsonl").read_bytes() for n in names} == metrics
  assert {n: os.stat(out / n / "metrics.jsonl").st_mtime_ns for n in names} == mtimes
  assert json.loads(json.dumps(again)) == points


def test_a_workdir_of_another_config_is_refused(tmp_path):
  c = pretrain.get_config(TINY)
  [point] = sweep.point_configs(c, [{"learning_rate": 1e-2}])
  sweep._record(str(tmp_path), point, {"learning_rate": 1e-2}, 1.0)
  [other] = sweep.point_configs(c, [{"learning_rate": 3e-2}])
  with pytest.raises(ValueError, match=r"holds a run of another config \(config.learning_rate: "
                                       r"0.01 there, 0.03 now"):
    sweep._check_same_config(str(tmp_path), other)
