"""Coordinated preemption (train/preemption.py): SIGTERM on any process stops every process
at one step with one checkpoint and exit 0; the rerun continues exactly."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from glm5_jax.train import preemption
from tests.train import test_train as tt


def test_sigterm_sets_the_flag_and_close_restores_the_handler():
  before = signal.getsignal(signal.SIGTERM)
  with preemption.Preemption() as p:
    assert not p.should_stop(1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert p.should_stop(2)
  assert signal.getsignal(signal.SIGTERM) is before


def test_sigint_is_handled_as_sigterm_and_a_second_one_stops_at_once():
  before = signal.getsignal(signal.SIGINT)
  with preemption.Preemption() as p:
    os.kill(os.getpid(), signal.SIGINT)
    assert p.should_stop(1)                         # a checkpoint at the next step
    with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
      os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGINT) is before


def test_preempted_is_an_exit_zero_that_says_where_it_stopped():
  with pytest.raises(SystemExit) as e:
    raise preemption.Preempted(7, "/w")
  assert e.value.code == 0 and "step 7 in /w" in str(e.value)


def _two_process_cmds(cmd):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  return [cmd + [f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                 "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
                 "--config.distributed.cpu_collectives=True"] for i in range(2)]


def _logged(workdir, step) -> bool:
  try:
    return step in tt._losses(workdir)
  except (OSError, ValueError):                # not written yet, or a line half written
    return False


def _run_two(workdir, data_dir, *extra, sigterm_to=None, after_step=2, cmd=None):
  """Runs a 2-process job (pretraining, or `cmd`); with `sigterm_to`, sends SIGTERM to that
  process alone once step `after_step` is logged. Returns [(returncode, stderr)] per process."""
  cmd = tt._cmd(workdir, data_dir, *extra) if cmd is None else cmd
  procs = [subprocess.Popen(c, cwd=tt.ROOT, env=tt._env(1), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
           for c in _two_process_cmds(cmd)]
  if sigterm_to is not None:
    deadline = time.time() + 600
    while not _logged(workdir, after_step):
      assert all(p.poll() is None for p in procs) and time.time() < deadline
      time.sleep(0.05)
    procs[sigterm_to].send_signal(signal.SIGTERM)
  outs = [p.communicate(timeout=900)[1] for p in procs]
  return [(p.returncode, o) for p, o in zip(procs, outs)]


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_at_one_step(tmp_path, data_dir):
  steps = ["--config.total_steps=40", "--config.checkpoint_every=1000"]
  for rc, err in _run_two(tmp_path / "straight", data_dir, *steps):
    assert rc == 0, err[-3000:]
  want = tt._losses(tmp_path / "straight")
  wd = tmp_path / "stopped"
  res = _run_two(wd, data_dir, *steps, sigterm_to=1)
  assert [rc for rc, _ in res] == [0, 0], res[0][1][-2000:] + res[1][1][-2000:]
  saved = sorted(int(d) for d in os.listdir(wd / "checkpoints") if d.isdigit())
  assert len(saved) == 1 and 2 <= saved[0] < 40, saved
  assert max(tt._losses(wd)) == saved[0]                # both stopped at the saved step
  for rc, err in _run_two(wd, data_dir, *steps):
    assert rc == 0, err[-3000:]
  got = tt._losses(wd)
  assert sorted(got) == sorted(want)
  assert [got[s] for s in sorted(want)] == [want[s] for s in sorted(want)]   # exact


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  from glm5_jax.data import corpus  # pylint: disable=g-import-not-at-top
  out = str(tmp_path_factory.mktemp("stdlib"))
  corpus.prepare(corpus.default_source_dir(), out, max_files=120, num_shards=2)
  return out


@pytest.mark.slow
def test_sigterm_in_grpo_checkpoints_exits_zero_and_resumes_exactly(tmp_path, monkeypatch):
  from tests.rl import test_grpo as trl  # pylint: disable=g-import-not-at-top
  from glm5_jax.rl.orchestration import grpo  # pylint: disable=g-import-not-at-top
  cfg = trl.config_lib.get_preset("tiny")
  init_from = trl.orbax_io.save_params(str(tmp_path / "init"), cfg,
                                       trl.gnn.init_params(cfg, 0))
  c = trl._config(init_from, eval_every=1, checkpoint_every=3)
  c.total_steps = 4
  full, split = str(tmp_path / "full"), str(tmp_path / "split")
  grpo.run(c, full)
  real_batches = grpo.GRPO.batches

  def sigterm_in_step_2(self, state, step):
    if step == 1:
      os.kill(os.getpid(), signal.SIGTERM)
    return real_batches(self, state, step)
  monkeypatch.setattr(grpo.GRPO, "batches", sigterm_in_step_2)
  with pytest.raises(SystemExit) as e:
    grpo.run(c, split)
  assert e.value.code == 0
  assert sorted(int(d) for d in os.listdir(os.path.join(split, "checkpoints"))) == [2]
  assert max(m["step"] for m in trl._metrics(split)) == 2
  monkeypatch.setattr(grpo.GRPO, "batches", real_batches)
  grpo.run(c, split)
  strip = lambda rows: [{k: v for k, v in m.items() if not k.endswith(("_s", "est_mfu"))}
                        for m in rows]
  assert strip(trl._metrics(split)) == strip(trl._metrics(full))


def _grpo_cmd(workdir, init_from):
  """Sharded GRPO on 2 processes of one CPU device each: the trainer's and the engine's mesh
  is data=2 over both processes (colocated placement)."""
  return [sys.executable, "-m", "experiments.rl", "--config=configs/rl.py:task=arith,runlocal=True",
          f"--config.init_from={init_from}", f"--workdir={workdir}", "--config.total_steps=8",
          "--config.tensorboard=False", "--config.optimizer=adamw", "--config.mesh.data=2",
          "--config.rl.task_options.max_digits=2", "--config.rl.group_size=4",
          "--config.rl.prompts_per_step=2", "--config.rl.minibatches=2",
          "--config.rl.max_new_tokens=6", "--config.rl.max_len=48", "--config.rl.prefill_chunk=32",
          "--config.rl.eval_problems=8", "--config.rl.eval_every=4",
          "--config.rl.checkpoint_every=1000"]


@pytest.mark.slow
def test_sigterm_to_one_of_two_grpo_processes_stops_both_at_one_step(tmp_path):
  from glm5_jax import config as config_lib, nn as gnn  # pylint: disable=g-import-not-at-top
  from glm5_jax import orbax_io  # pylint: disable=g-import-not-at-top
  from tests.rl import test_grpo as trl  # pylint: disable=g-import-not-at-top
  cfg = config_lib.get_preset("tiny")
  init = orbax_io.save_params(str(tmp_path / "init"), cfg, gnn.init_params(cfg, 0))
  run = lambda wd, **kw: _run_two(wd, None, cmd=_grpo_cmd(wd, init), **kw)
  for rc, err in run(tmp_path / "straight"):
    assert rc == 0, err[-3000:]
  wd = tmp_path / "stopped"
  res = run(wd, sigterm_to=1)
  assert [rc for rc, _ in res] == [0, 0], res[0][1][-2000:] + res[1][1][-2000:]
  saved = sorted(int(d) for d in os.listdir(wd / "checkpoints") if d.isdigit())
  assert len(saved) == 1 and 2 <= saved[0] < 8, saved
  assert max(tt._losses(wd)) == saved[0]                # both stopped at the saved step
  for rc, err in run(wd):
    assert rc == 0, err[-3000:]
  strip = lambda rows: [{k: v for k, v in m.items() if not k.endswith(("_s", "est_mfu"))}
                        for m in rows]
  want, got = trl._metrics(tmp_path / "straight"), trl._metrics(wd)
  assert max(m["step"] for m in want) == 8
  assert strip(got) == strip(want)      # rollouts, rewards, losses, held-out accuracy: exact
