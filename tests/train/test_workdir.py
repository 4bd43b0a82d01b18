"""One run per workdir (train/workdir.py): the lock, its stale take-over, and the stored run."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from configs import pretrain
from configs import rl as rl_config
from glm5_jax.train import loop
from glm5_jax.train import workdir as workdir_lib

_HOLD = textwrap.dedent("""
    import sys, time
    from glm5_jax.train import workdir
    workdir.acquire(sys.argv[1])
    print("held", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def holder(tmp_path):
  """A live process of another run holding tmp_path/run's lock."""
  wd = str(tmp_path / "run")
  p = subprocess.Popen([sys.executable, "-c", _HOLD, wd], stdout=subprocess.PIPE, text=True)
  assert p.stdout.readline().strip() == "held"
  yield wd, p
  p.kill()
  p.wait()


def test_a_second_run_is_refused_naming_the_holder_then_takes_over_a_dead_ones_lock(
    holder, caplog):
  wd, p = holder
  before = sorted(os.listdir(wd))
  with pytest.raises(workdir_lib.WorkdirInUse, match=rf"in use by pid {p.pid} on host"):
    workdir_lib.acquire(wd)
  assert sorted(os.listdir(wd)) == before == ["run.lock"]
  p.send_signal(signal.SIGKILL)                      # dies holding it: the kernel frees it
  p.wait()
  with caplog.at_level(logging.WARNING):
    with workdir_lib.lock(wd) as path:
      mine = json.load(open(path))
      assert mine["pid"] == os.getpid()
      with workdir_lib.lock(wd):                     # re-entrant within a process
        pass
      other = subprocess.run([sys.executable, "-c", "import sys; from glm5_jax.train import "
                              "workdir; workdir.acquire(sys.argv[1])", wd],
                             capture_output=True, text=True)   # still held after the inner
      assert other.returncode and f"in use by pid {os.getpid()}" in other.stderr  # release
  assert any(f"took over the lock of pid {p.pid}" in r.getMessage() for r in caplog.records)
  assert open(os.path.join(wd, "run.lock")).read() == ""       # released cleanly: empty


def test_the_runner_writes_nothing_into_a_workdir_another_run_holds(holder):
  wd, _ = holder
  c = pretrain.get_config("model=tiny,runlocal=True")
  c.data.dir = os.path.join(os.path.dirname(wd), "no_data")   # never reached
  with pytest.raises(workdir_lib.WorkdirInUse):
    loop.run(c, wd)
  assert os.listdir(wd) == ["run.lock"]
  assert not os.path.exists(c.data.dir)


def _rl(**fields):
  c = rl_config.get_config("task=arith,runlocal=True")
  c.init_from = "/sft"
  for k, v in fields.items():
    node = c
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  return c


def test_a_resume_that_changes_the_run_is_refused_naming_each_field(tmp_path, caplog):
  wd = str(tmp_path / "run")
  os.makedirs(wd)
  workdir_lib.check_run(wd, _rl())
  stored = json.load(open(os.path.join(wd, "run.json")))["fields"]
  assert stored["rl.task"] == "arith" and stored["seed"] == 0 and stored["init_from"] == "/sft"
  workdir_lib.check_run(wd, _rl(total_steps=999, log_every=7, **{"rl.eval_every": 3}))
  with pytest.raises(workdir_lib.ChangedRun) as e:
    workdir_lib.check_run(wd, _rl(seed=4, **{"rl.task": "strings", "rl.task_options.max_digits": 3}))
  msg = str(e.value)
  assert "config.seed: 0 in the workdir, 4 now" in msg
  assert "config.rl.task: 'arith' in the workdir, 'strings' now" in msg
  assert "config.rl.task_options:" in msg and "allow_changed_run=True" in msg
  with caplog.at_level(logging.WARNING):
    workdir_lib.check_run(wd, _rl(seed=4, allow_changed_run=True))
  assert any("config.seed: 0 in the workdir, 4 now" in r.getMessage() for r in caplog.records)
  saved = json.load(open(os.path.join(wd, "run.json")))
  assert saved["fields"]["seed"] == 4 and saved["changes"][0]["fields"] == {"seed": [0, 4]}
  workdir_lib.check_run(wd, _rl(seed=4))             # the changed run is now the run


def test_the_runner_refuses_a_changed_run_before_writing(tmp_path):
  wd = str(tmp_path / "run")
  c = pretrain.get_config("model=tiny,runlocal=True")
  os.makedirs(wd)
  workdir_lib.check_run(wd, c)
  c.seed = 5
  c.data.dir = str(tmp_path / "no_data")
  with pytest.raises(workdir_lib.ChangedRun, match="config.seed: 0 in the workdir, 5 now"):
    loop.run(c, wd)
  assert sorted(os.listdir(wd)) == ["run.json", "run.lock"]
