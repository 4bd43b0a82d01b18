"""Pretraining system: sharded == single-device losses, exact resume, multi-process, bad input.

Runs go through `python -m experiments.pretrain` in subprocesses (each with its
own device count), on a small standard-library corpus prepared once.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from glm5_jax import train
from glm5_jax.data import corpus
from tests import paths

ROOT = paths.ROOT
FAST = ["--config.model.mtp_num_steps=1", "--config.seq_len=64", "--config.batch_size=8",
        "--config.log_every=1", "--config.eval_every=1000", "--config.eval_batches=1",
        "--config.tensorboard=False"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("stdlib"))
  corpus.prepare(corpus.default_source_dir(), out, max_files=120, num_shards=2)
  return out


def _cmd(workdir, data_dir, *extra):
  return [sys.executable, "-m", "experiments.pretrain",
          "--config=configs/pretrain.py:model=tiny,runlocal=True", f"--workdir={workdir}",
          f"--config.data.dir={data_dir}", *FAST, *extra]


def _env(devices=1):
  env = dict(os.environ, PYTHONPATH=ROOT)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  return env


def _run(workdir, data_dir, *extra, devices=1, check=True):
  p = subprocess.run(_cmd(workdir, data_dir, *extra), cwd=ROOT, env=_env(devices),
                     capture_output=True, text=True, timeout=900)
  if check and p.returncode:
    raise AssertionError(p.stderr[-3000:])
  return p


def _losses(workdir):
  """{step: loss}, the last record per step (a resumed run rewrites steps)."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      m = json.loads(line)
      if "loss" in m:
        out[m["step"]] = m["loss"]
  return out


def test_sharded_runs_match_one_device(tmp_path, data_dir):
  steps = ["--config.total_steps=5", "--config.checkpoint_every=5"]
  _run(tmp_path / "one", data_dir, *steps)
  _run(tmp_path / "dp8", data_dir, *steps, "--config.mesh.data=8", devices=8)
  _run(tmp_path / "mix", data_dir, *steps, "--config.mesh.data=1", "--config.mesh.fsdp=2",
       "--config.mesh.expert=2", "--config.mesh.tensor=2", devices=8)
  one = _losses(tmp_path / "one")
  assert sorted(one) == [1, 2, 3, 4, 5]
  for other in ("dp8", "mix"):
    got = _losses(tmp_path / other)
    np.testing.assert_allclose([got[s] for s in one], [one[s] for s in one], rtol=1e-5)


def test_sigkill_and_resume_reproduces_the_losses(tmp_path, data_dir):
  steps = ["--config.total_steps=30", "--config.checkpoint_every=3"]
  _run(tmp_path / "straight", data_dir, *steps)
  want = _losses(tmp_path / "straight")
  wd = tmp_path / "killed"
  p = subprocess.Popen(_cmd(wd, data_dir, *steps), cwd=ROOT, env=_env(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 600
  while not (wd / "checkpoints" / "3").exists():
    assert p.poll() is None and time.time() < deadline, "run ended before its first checkpoint"
    time.sleep(0.01)
  p.send_signal(signal.SIGKILL)
  p.wait()
  done = [int(d) for d in os.listdir(wd / "checkpoints") if d.isdigit()]
  assert max(done) < 30, "the run finished before it was killed"
  _run(wd, data_dir, *steps)
  got = _losses(wd)
  assert sorted(got) == sorted(want)
  assert [got[s] for s in sorted(want)] == [want[s] for s in sorted(want)]   # exact


def test_two_processes_match_one(tmp_path, data_dir):
  steps = ["--config.total_steps=3", "--config.checkpoint_every=3"]
  _run(tmp_path / "single", data_dir, *steps, "--config.mesh.data=2", devices=2)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = [subprocess.Popen(
      _cmd(tmp_path / "multi", data_dir, *steps, "--config.distributed.coordinator_address="
           f"127.0.0.1:{port}", "--config.distributed.num_processes=2",
           f"--config.distributed.process_id={i}", "--config.distributed.cpu_collectives=True"),
      cwd=ROOT, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=900) for p in procs]
  assert all(p.returncode == 0 for p in procs), outs[0][1][-3000:] + outs[1][1][-3000:]
  one, two = _losses(tmp_path / "single"), _losses(tmp_path / "multi")
  np.testing.assert_allclose([two[s] for s in one], [one[s] for s in one], rtol=1e-5)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, data_dir):
  p = _run(tmp_path / "nan", data_dir, "--config.total_steps=6", "--config.checkpoint_every=1",
           "--config.learning_rate=1e30", "--config.grad_clip=1e30", "--config.optimizer=adamw",
           check=False)
  assert p.returncode != 0 and "non-finite loss or gradient at step" in p.stderr
  saved = sorted(int(d) for d in os.listdir(tmp_path / "nan" / "checkpoints") if d.isdigit())
  bad = int(p.stderr.split("non-finite loss or gradient at step ")[1].split()[0])
  assert saved and max(saved) < bad


@pytest.mark.parametrize("extra,devices,match", [
    (["--config.seq_len=100000"], 1, "seq_len=100000 > model max_position_embeddings"),
    (["--config.mesh.data=3"], 1, "needs 3 devices, but 1 are available"),
    (["--config.mesh.data=3"], 8, "needs 3 devices, but 8 are available"),
    (["--config.mesh.data=-1", "--config.mesh.fsdp=3"], 8, "8 devices are not divisible"),
    (["--config.mesh.data=1", "--config.mesh.tensor=8"], 8, "does not divide num_attention_heads"),
    (["--config.mesh.data=1", "--config.mesh.expert=8", "--config.model.n_routed_experts=12"], 8,
     "does not divide n_routed_experts=12"),
    (["--config.not_a_field=1"], 1, "not_a_field"),
    (["--config.stage=rl"], 1, "config.stage='rl'"),
])
def test_bad_input_stops_at_once_with_a_clear_message(tmp_path, data_dir, extra, devices, match):
  p = _run(tmp_path / "bad", data_dir, "--config.total_steps=2", *extra, devices=devices,
           check=False)
  assert p.returncode != 0 and match in p.stderr, p.stderr[-2000:]


def test_missing_data_and_other_model_workdir(tmp_path, data_dir):
  p = _run(tmp_path / "w", str(tmp_path / "empty"), "--config.data.prepare_if_missing=False",
           check=False)
  assert p.returncode != 0 and "run `python -m experiments.prepare_data` first" in p.stderr
  _run(tmp_path / "w2", data_dir, "--config.total_steps=1", "--config.checkpoint_every=1")
  p = _run(tmp_path / "w2", data_dir, "--config.total_steps=2", "--config.model.hidden_size=32",
           check=False)
  assert p.returncode != 0 and "holds a run of a different model" in p.stderr


def test_train_package_exports_run():
  assert callable(train.run)
