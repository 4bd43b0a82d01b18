"""The main job under preemption: SIGTERM stops it at a checkpoint (exit 0, no later stage),
the rerun continues and ends with the uninterrupted job's held-out metrics; a rerun of a
finished job writes the same summary.

The stages are shrunk to a few steps (SMALL) and post-training (SFT, GRPO) is off: the
full configs/main_job.py takes about an hour on CPU.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import test_preemption as tp
from tests import test_train as tt

pytestmark = pytest.mark.slow
data_dir = tp.data_dir

SMALL = ["--config.stages.pretrain_steps=6", "--config.stages.warmup_steps=30",
         "--config.stages.sparse_steps=3", "--config.post.enabled=False",
         "--config.model.mtp_num_steps=1", "--config.seq_len=64", "--config.batch_size=8",
         "--config.log_every=1", "--config.eval_every=3", "--config.eval_batches=1",
         "--config.tensorboard=False"]
HELD_OUT = ("eval_loss", "eval_bits_per_byte", "eval_indexer_kl")


def _cmd(workdir, data):
  return [sys.executable, "-m", "experiments.main_job", "--config=configs/main_job.py",
          f"--workdir={workdir}", f"--config.data.dir={data}", *SMALL]


def _run(workdir, data):
  p = subprocess.run(_cmd(workdir, data), cwd=tt.ROOT, env=tt._env(), capture_output=True,
                     text=True, timeout=1800)
  assert p.returncode == 0, p.stderr[-3000:]
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


def _held_out(summary):
  return {name: {k: row[k] for k in HELD_OUT} for name, row in summary["stages"].items()}


def test_sigterm_then_rerun_gives_the_uninterrupted_summary(tmp_path, data_dir):
  want = _run(tmp_path / "straight", data_dir)
  assert all(v is not None for row in _held_out(want).values()
             for k, v in row.items() if k != "eval_indexer_kl")
  assert _held_out(_run(tmp_path / "straight", data_dir)) == _held_out(want)   # rerun: same

  wd = tmp_path / "stopped"
  p = subprocess.Popen(_cmd(wd, data_dir), cwd=tt.ROOT, env=tt._env(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 1200
  while not tp._logged(wd / "dsa_warmup", 2):
    assert p.poll() is None and time.time() < deadline, "the job ended before dsa_warmup"
    time.sleep(0.05)
  p.send_signal(signal.SIGTERM)
  err = p.communicate(timeout=600)[1]
  assert p.returncode == 0, err[-3000:]
  saved = [int(d) for d in os.listdir(wd / "dsa_warmup" / "checkpoints") if d.isdigit()]
  assert saved and max(saved) < 30, "the stage finished before SIGTERM"
  assert not (wd / "dsa_sparse").exists() and not (wd / "summary.json").exists()
  assert _held_out(_run(wd, data_dir)) == _held_out(want)
