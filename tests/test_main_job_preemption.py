"""The main job under preemption: SIGTERM stops it at a checkpoint (exit 0, no later stage),
the rerun continues and ends with the uninterrupted job's held-out metrics; a rerun of a
finished job writes the same summary.

The stages are shrunk to a few steps (SMALL; the full configs/main_job.py takes 17 minutes
on CPU). The first test stops the job in a pretraining stage with post-training off; the
second stops it twice, in SFT and in GRPO, and compares the post-training results too. The
asynchronous stage is off there: which finished groups an update consumes depends on thread
timing, so its results are not reproducible between two runs, interrupted or not
(tests/rl/test_async.py checks its own SIGTERM and resume). After 8 SFT steps GRPO earns
no reward, so its updates are zero here: what this test checks in GRPO is that the resumed
run samples the same prompts and responses (cursor and RNG); tests/rl/test_grpo.py checks a
resume with non-zero updates.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.train import test_preemption as tp
from tests.train import test_train as tt

pytestmark = pytest.mark.slow
data_dir = tp.data_dir

SMALL = ["--config.stages.pretrain_steps=6", "--config.stages.warmup_steps=30",
         "--config.stages.sparse_steps=3", "--config.post.enabled=False",
         "--config.model.mtp_num_steps=1", "--config.seq_len=64", "--config.batch_size=8",
         "--config.log_every=1", "--config.eval_every=3", "--config.eval_batches=1",
         "--config.tensorboard=False"]
HELD_OUT = ("eval_loss", "eval_bits_per_byte", "eval_indexer_kl")


POST = ["--config.post.enabled=True", "--config.post.sft_conversations=300",
        "--config.post.sft_steps=8", "--config.post.sft_warmup_steps=2",
        "--config.post.rl.total_steps=4", "--config.post.rl.rl.prompts_per_step=8",
        "--config.post.rl.rl.eval_problems=32", "--config.post.rl.rl.eval_every=2",
        "--config.post.rl.rl.checkpoint_every=2", "--config.post.rl_async.total_steps=0"]


def _cmd(workdir, data, *extra):
  return [sys.executable, "-m", "experiments.main_job", "--config=configs/main_job.py",
          f"--workdir={workdir}", f"--config.data.dir={data}", *SMALL, *extra]


def _run(workdir, data, *extra):
  p = subprocess.run(_cmd(workdir, data, *extra), cwd=tt.ROOT, env=tt._env(),
                     capture_output=True, text=True, timeout=1800)
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


def _rows(workdir, key):
  """{step: row[key]} of a stage's metrics.jsonl, the last record per step."""
  out = {}
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      for line in f:
        m = json.loads(line)
        if key in m:
          out[m["step"]] = m[key]
  except (OSError, ValueError):                # not written yet, or a line half written
    pass
  return out


def _stop_when(wd, data, stage_dir, key, step):
  """Runs the job, SIGTERMs it once `stage_dir`'s metrics log `key` at `step`; exit 0."""
  p = subprocess.Popen(_cmd(wd, data, *POST), cwd=tt.ROOT, env=tt._env(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 1500
  while step not in _rows(stage_dir, key):
    assert p.poll() is None and time.time() < deadline, f"the job ended before {stage_dir}"
    time.sleep(0.05)
  p.send_signal(signal.SIGTERM)
  err = p.communicate(timeout=600)[1]
  assert p.returncode == 0, err[-3000:]


def test_sigterm_in_sft_and_in_grpo_then_rerun_gives_the_uninterrupted_results(tmp_path,
                                                                              data_dir):
  want = _run(tmp_path / "straight", data_dir, *POST)
  assert want["post_training"]["grpo_steps"] == 4

  wd = tmp_path / "stopped"
  _stop_when(wd, data_dir, wd / "sft", "loss", 2)
  saved = [int(d) for d in os.listdir(wd / "sft" / "checkpoints") if d.isdigit()]
  assert saved and max(saved) < 8, "SFT finished before SIGTERM"
  assert not (wd / "grpo").exists() and not (wd / "summary.json").exists()

  _stop_when(wd, data_dir, wd / "grpo", "reward_mean", 1)
  saved = [int(d) for d in os.listdir(wd / "grpo" / "checkpoints") if d.isdigit()]
  assert saved and max(saved) < 4, "GRPO finished before SIGTERM"
  assert not (wd / "summary.json").exists()

  got = _run(wd, data_dir, *POST)
  assert _held_out(got) == _held_out(want)
  assert got["post_training"] == want["post_training"]   # accuracies, |dlogp|, top-k
  for stage, key in [("sft", "loss"), ("sft", "eval_loss"), ("grpo", "reward_mean"),
                     ("grpo", "loss"), ("grpo", "heldout_accuracy")]:       # exact resume
    assert _rows(wd / stage, key) == _rows(tmp_path / "straight" / stage, key), (stage, key)
