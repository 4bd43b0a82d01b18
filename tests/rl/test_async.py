"""The asynchronous agentic-RL loop end to end (glm5_jax/rl/orchestration/async_loop.py), local and
Ray.

One tiny model from scratch on the calculator task: rewards are mostly 0, which is all the
machinery needs. Checked on the run's own outputs: the ledger audits clean (every admitted id
consumed or dropped with a reason, none twice, copies with their own ids), each token's
rollout log-prob equals the trainer's under the version that sampled it, top-k sets agree,
versions advance, and with faults injected a killed worker is found, restarted and re-synced.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import pytest

from configs import rl_async
from glm5_jax import config as config_lib
from glm5_jax import nn as gnn
from glm5_jax import orbax_io
from glm5_jax.rl.orchestration import async_loop
from glm5_jax.rl.orchestration import control
from glm5_jax.rl.orchestration import ledger as ledger_lib
from glm5_jax.train import metrics as metrics_lib
from glm5_jax.train import preemption
from tests import paths

ROOT = paths.ROOT


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory):
  cfg = config_lib.get_preset("tiny")
  path = str(tmp_path_factory.mktemp("async_init"))
  orbax_io.save_params(path, cfg, gnn.init_params(cfg, jax.random.PRNGKey(0)))
  return path


def small_config(init_dir, **rl):
  c = rl_async.get_config("task=tool_calc,runlocal=True")
  c.init_from = init_dir
  c.tensorboard = False
  c.total_steps = 3
  c.optimizer = "adamw"        # compiles in a third of Muon Split's time; the loop is the same
  r = c.rl
  r.group_size, r.groups_per_update, r.workers = 4, 2, 2
  r.engine_batch, r.episodes_per_worker, r.max_groups_in_flight = 8, 8, 6
  r.max_new_tokens, r.max_len, r.max_turns = 12, 96, 2
  r.eval_problems, r.eval_every, r.checkpoint_every = 1, 100, 100
  r.heartbeat_s, r.heartbeat_timeout_s, r.max_wait_s = 0.2, 4.0, 600.0
  for k, v in rl.items():
    if isinstance(v, dict):
      r[k].update(v)
    else:
      r[k] = v
  return c


def _check_run(workdir, c):
  problems = ledger_lib.audit(os.path.join(workdir, "rollouts.jsonl"))
  assert not problems, problems[:10]
  rows = [r for r in metrics_lib.read_rows(workdir) if "loss" in r]
  assert [r["step"] for r in rows] == list(range(1, c.total_steps + 1))
  for r in rows:
    assert r["logp_abs_diff_max"] == 0.0, r          # bitwise: batch-invariant engine
    assert r["topk_mismatches"] == 0 and r["topk_positions"] > 0, r
    assert r["logp_unmeasured_tokens"] == 0, r
    assert r["staleness_max"] <= c.rl.tau
  assert rows[-1]["version"] == c.total_steps // c.rl.updates_per_publish
  return rows


def test_local_loop_with_faults(init_dir, tmp_path):
  """Worker 0 killed after 0.5 s and environments crashing 30% of the time: the run finishes,
  the worker is restarted, crashed rollouts are filtered and refilled, the ledger is clean."""
  # Killed at 0.5 s and found silent 2 s later: before the first update can be ready (the
  # workers' engines compile first), even on a fast machine (a 4 s timeout once let all 3
  # updates finish before the kill was noticed).
  c = small_config(init_dir, faults={"kill_worker_after_s": 0.5, "env_crash_rate": 0.3},
                   heartbeat_timeout_s=2.0)
  workdir = str(tmp_path / "run")
  async_loop.run(c, workdir)
  rows = _check_run(workdir, c)
  last = rows[-1]
  assert last["worker_restarts"] >= 1
  events = ledger_lib.read(os.path.join(workdir, "rollouts.jsonl"))
  drops = [e for e in events if e["event"] == "dropped"]
  assert any(e["reason"] == "worker_dead" for e in drops)
  copies = [e for e in events if e.get("copy_of")]
  crashed = [e for e in events if e["event"] == "finished" and e.get("status") == "env_error"]
  assert crashed, "env_crash_rate=0.3 crashed nothing"
  assert copies and all(e["id"] != e["copy_of"] for e in copies)
  ctl = control.read_control(workdir, c.total_steps)
  assert ctl["update"] == c.total_steps and ctl["consumed"] == c.total_steps * 2


@pytest.mark.slow
def test_fp8_workers_with_routing_replay(init_dir, tmp_path):
  """FP8 rollout workers: a measured |dlogp|, the routing replayed (0 routing mismatches of
  every pair compared), the records' storage in the ledger; the ledger audits clean."""
  c = small_config(init_dir, rollout_weight_dtype="float8_e4m3fn", routing_replay=True)
  workdir = str(tmp_path / "run")
  async_loop.run(c, workdir)
  assert not ledger_lib.audit(os.path.join(workdir, "rollouts.jsonl"))
  rows = [r for r in metrics_lib.read_rows(workdir) if "loss" in r]
  assert len(rows) == c.total_steps
  for r in rows:
    assert r["logp_abs_diff_max"] > 0 and r["routing_pairs"] > 0, r
    assert r["routing_mismatches"] == 0 and r["routing_mismatch_rate"] == 0.0, r
    assert r["routing_bytes_per_token"] > 0 and "topk_mismatch_rate" in r
  finished = [e for e in ledger_lib.read(os.path.join(workdir, "rollouts.jsonl"))
              if e["kind"] == "trajectory" and e["event"] == "finished" and "tokens" in e]
  assert finished and all(e["routing_bytes"] > 0 for e in finished)


@pytest.mark.slow
def test_resume_continues_the_ledger(init_dir, tmp_path):
  """A finished run extended by 2 updates resumes from its checkpoint: versions continue,
  group ids continue after the ledger's, and the whole ledger still audits clean."""
  c = small_config(init_dir)
  workdir = str(tmp_path / "run")
  async_loop.run(c, workdir)
  c.total_steps = 5
  async_loop.run(c, workdir)
  rows = _check_run(workdir, c)
  assert rows[-1]["version"] == 5


@pytest.mark.slow
def test_sigterm_checkpoints_stops_and_the_rerun_finishes(init_dir, tmp_path):
  """SIGTERM mid-run: the loop checkpoints after the update in progress and exits 0
  (`Preempted`), ledgering its in-flight work as dropped ("shutdown"); the same call again
  resumes from that checkpoint, re-admits those prompts and finishes with a clean ledger."""
  c = small_config(init_dir)
  c.total_steps = 4
  workdir = str(tmp_path / "run")
  killer = threading.Thread(target=_sigterm_after_first_update, args=(workdir,), daemon=True)
  killer.start()
  with pytest.raises(preemption.Preempted) as stopped:
    async_loop.run(c, workdir)
  assert stopped.value.code == 0 and 1 <= stopped.value.step < c.total_steps
  events = ledger_lib.read(os.path.join(workdir, "rollouts.jsonl"))
  assert any(e.get("reason") == "shutdown" for e in events)
  assert control.read_control(workdir, stopped.value.step)["requeue"], (
      "the stopped run's in-flight prompts were not saved")
  async_loop.run(c, workdir)
  rows = _check_run(workdir, c)
  assert rows[-1]["version"] == c.total_steps


def _sigterm_after_first_update(workdir):
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.monotonic() + 600
  while time.monotonic() < deadline:
    if os.path.exists(path) and any('"loss"' in line for line in open(path)):
      os.kill(os.getpid(), signal.SIGTERM)
      return
    time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")   # Ray's exec'd subprocesses
def test_ray_loop_with_a_killed_worker(init_dir, tmp_path):
  """The same loop with Ray actors: worker 0 is ray.kill-ed, found silent, restarted."""
  pytest.importorskip("ray")
  import ray  # pylint: disable=g-import-not-at-top
  ray.init(num_cpus=2, include_dashboard=False)
  try:
    c = small_config(init_dir, backend="ray",
                     faults={"kill_worker_after_s": 20.0}, heartbeat_timeout_s=6.0)
    c.total_steps = 4
    workdir = str(tmp_path / "run")
    async_loop.run(c, workdir)
    rows = _check_run(workdir, c)
    assert rows[-1]["worker_restarts"] >= 1
  finally:
    ray.shutdown()


@pytest.mark.parametrize("field,value,message", [
    ("backend", "slurm", "config.rl.backend='slurm'"),
    ("tau", -1, "config.rl.tau=-1"),
    ("group_size", 1, "config.rl.group_size=1"),
    ("episodes_per_worker", 2, "config.rl.episodes_per_worker=2"),
    ("temperature", 0.7, "config.rl.temperature=0.7"),
    ("eps_low", -0.1, "config.rl.eps_low"),
    ("context", {"kind": "summarize"}, "config.rl.context="),
    ("faults", {"env_crash_rate": 2.0}, "config.rl.faults.env_crash_rate=2.0"),
    ("task", "tool_nope", "config.rl.task='tool_nope'"),
    ("warmup_lengths", (64, 100000), r"config.rl.warmup_lengths=(64, 100000)"),
    ("max_turns", 0, "config.rl.max_turns=0: expected an integer in [1, 1024]"),
    ("groups_per_update", 7, "config.rl.groups_per_update=7: expected <= "
     "config.rl.max_groups_in_flight"),
    ("eval_problems", 10**9, "config.rl.eval_problems=1000000000: expected an integer in "
     "[1, 100000] (held-out problems)"),
    ("max_new_tokens", 96, "config.rl.max_new_tokens=96: expected an integer in [1, "
     "config.rl.max_len - 1]"),
    ("workers", 10**6, "config.rl.workers=1000000"),
])
def test_bad_config_names_the_field(field, value, message):
  c = small_config("/nonexistent")
  if isinstance(value, dict):
    c.rl[field].update(value)
  else:
    c.rl[field] = value
  with pytest.raises(ValueError, match=re.escape(message)):
    async_loop.validate(c)


def test_a_context_no_prompt_fits_is_refused_by_both_entry_points(init_dir, tmp_path):
  """rl.max_len below the prompts: the async loop (which would truncate every episode and
  train on 0 tokens) and sync GRPO (whose engine would refuse them) both refuse it, before
  anything compiles, naming config.rl.max_len."""
  from configs import rl as rl_config  # pylint: disable=g-import-not-at-top
  from glm5_jax.rl.orchestration import grpo  # pylint: disable=g-import-not-at-top
  c = small_config(init_dir, max_len=12, max_new_tokens=4, warmup_lengths=(16,))
  with pytest.raises(ValueError, match=r"config.rl.max_len=12: the task's prompts take up "
                     r"to \d+ tokens \(held-out problems and a sample"):
    async_loop.run(c, str(tmp_path / "async"))
  g = rl_config.get_config("task=arith,runlocal=True")
  g.init_from, g.tensorboard = init_dir, False
  g.rl.max_len, g.rl.max_new_tokens = 12, 4
  with pytest.raises(ValueError, match=r"config.rl.max_len=12: the task's prompts take up "
                     r"to \d+ tokens \(held-out problems and the first step's\)"):
    grpo.run(g, str(tmp_path / "sync"))
  c = small_config(init_dir, context={"kind": "discard_all", "max_tokens": 8})
  with pytest.raises(ValueError, match=r"config.rl.context.max_tokens=8: below the task's "
                     r"prompts"):
    async_loop.run(c, str(tmp_path / "async2"))


def _ledger_state(workdir):
  """(consumed updates of the ledger's last run, finished checkpoint steps, unfinished
  checkpoint dirs), read while a run writes them."""
  path, ckpts = os.path.join(workdir, "rollouts.jsonl"), os.path.join(workdir, "checkpoints")
  updates = set()
  if os.path.exists(path):
    for e in ledger_lib.events(path):
      if e.get("kind") == "run":
        updates = set()
      elif e.get("kind") == "group" and e.get("event") == "consumed":
        updates.add(e["update"])
  names = os.listdir(ckpts) if os.path.isdir(ckpts) else []
  return updates, {int(d) for d in names if d.isdigit()}, [d for d in names if "tmp" in d]


def _async_proc(init_dir, workdir, total, every, **popen):
  return subprocess.Popen([sys.executable, "-m", "tests.rl.test_async", init_dir, workdir,
                           str(total), str(every)], cwd=ROOT, env=dict(os.environ,
                                                                       PYTHONPATH=ROOT),
                          text=True, **popen)


def _sigkill_when(init_dir, workdir, total, every, when, what):
  p = _async_proc(init_dir, workdir, total, every, stdout=subprocess.DEVNULL,
                  stderr=subprocess.DEVNULL)
  try:
    while p.poll() is None:
      state = _ledger_state(workdir)
      if when(*state):
        p.send_signal(signal.SIGKILL)
        p.wait()
        return state
      time.sleep(0.002)
    raise AssertionError(f"the run ended (rc {p.returncode}) before the kill point: {what}")
  finally:
    p.kill()


def _check_resumed_run(workdir, total):
  """Audit clean (no prompt consumed twice, nothing of a rolled-back run counted), one
  metrics row per update, running totals never going back."""
  problems = ledger_lib.audit(os.path.join(workdir, "rollouts.jsonl"))
  assert not problems, problems[:10]
  rows = [r for r in metrics_lib.read_rows(workdir) if "loss" in r]
  assert [r["step"] for r in rows] == list(range(1, total + 1))
  for a, b in zip(rows, rows[1:]):
    for k in a:
      if k == "wall_s" or k == "compiles" or k.startswith(("status_", "dropped_",
                                                            "staleness_hist_")):
        assert b.get(k, 0.0) >= a[k], (k, a["step"], a[k], b.get(k))
  return rows


@pytest.mark.slow
def test_sigkill_before_during_and_between_saves_then_no_prompt_counts_twice(init_dir,
                                                                             tmp_path):
  """SIGKILL before the first checkpoint finished, during a save, and between saves, each
  followed by the same command: the ledger keeps every line (rolled back, never truncated),
  the last run finishes, the live ledger audits clean and the totals continue."""
  wd, total, every = str(tmp_path / "run"), 6, 2
  killed = _sigkill_when(init_dir, wd, total, every, lambda u, done, tmp: u and not done and
                         not tmp, "an update consumed, no checkpoint yet")
  assert not killed[1]
  lines = sum(1 for _ in open(os.path.join(wd, "rollouts.jsonl")))
  killed = _sigkill_when(init_dir, wd, total, every, lambda u, done, tmp: bool(tmp),
                         "a checkpoint being written")
  assert killed[2] and not killed[1]
  events = ledger_lib.events(os.path.join(wd, "rollouts.jsonl"))
  assert len(events) >= lines and [e for e in events if e.get("kind") == "run"][1][
      "keep"] == 0                          # the rerun found no finished checkpoint: kept all
  killed = _sigkill_when(init_dir, wd, total, every, lambda u, done, tmp: done and u and
                         max(u) >= max(done) + 1, "an update consumed after a checkpoint")
  p = _async_proc(init_dir, wd, total, every, stdout=subprocess.DEVNULL,
                  stderr=subprocess.PIPE)
  err = p.communicate(timeout=900)[1]
  assert p.returncode == 0, err[-3000:]
  assert "rolled back" in err
  _check_resumed_run(wd, total)
  summary = ledger_lib.summary(os.path.join(wd, "rollouts.jsonl"))
  assert summary["runs"] == 4 and summary["rolled_back"] > 0


@pytest.mark.slow
def test_disk_full_stops_with_one_line_and_the_rerun_continues_cleanly(init_dir, tmp_path):
  """The workdir on a 64 MiB tmpfs filled up after the first checkpoint: the run stops
  (the save's one line, or an earlier write's error), the checkpoint stays intact; with
  space freed the same command finishes with a clean ledger."""
  wd = str(tmp_path / "run")
  os.makedirs(wd)
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", wd],
                    capture_output=True).returncode:
    pytest.skip("needs root to mount a tmpfs (a disk that can be filled)")
  try:
    total, every = 6, 2
    p = _async_proc(init_dir, wd, total, every, stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE)
    while p.poll() is None and not _ledger_state(wd)[1]:
      time.sleep(0.01)
    filler = os.path.join(wd, "filler")
    with open(filler, "wb") as f:              # every byte left on the device
      try:
        while True:
          f.write(b"\0" * (1 << 20))
          f.flush()
      except OSError:
        pass
    err = p.communicate(timeout=900)[1]
    assert p.returncode != 0 and "No space left on device" in err, err[-3000:]
    if "saving a checkpoint in" in err:        # the save hit it: one line, no traceback
      assert "Traceback" not in err, err[-3000:]
    assert 2 in _ledger_state(wd)[1]
    os.remove(filler)
    p = _async_proc(init_dir, wd, total, every, stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE)
    err = p.communicate(timeout=900)[1]
    assert p.returncode == 0, err[-3000:]
    _check_resumed_run(wd, total)
  finally:
    subprocess.run(["umount", "-l", wd], check=False)


# One group per update from one worker: every update pushes, and the worker swaps it in.
ONE_GROUP_PUSHES = dict(snapshots="sharded", workers=1, group_size=2, groups_per_update=1,
                        tau=0, episodes_per_worker=2, engine_batch=2, max_groups_in_flight=1,
                        max_new_tokens=6, max_len=48, max_turns=1, heartbeat_timeout_s=120.0)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")   # Ray's exec'd subprocesses
def test_ray_pushes_of_a_1gib_model_stay_within_each_processs_share(tmp_path):
  """Trainer (this process) and a Ray rollout worker (its own process) exchange sharded
  snapshots (rl/orchestration/snapshots.py) of a 1.3 GiB model: each process's peak RSS growth over
  a push is at most its share of the tree (here each holds a whole replica) plus the largest leaf
  plus 10%, the worker reads exactly its share, and the ledger audits clean."""
  pytest.importorskip("ray")
  import ray  # pylint: disable=g-import-not-at-top
  init, tree, largest = _big_model(tmp_path)
  ray.init(num_cpus=2, include_dashboard=False)
  try:
    c = small_config(init, backend="ray", **ONE_GROUP_PUSHES)
    c.total_steps = 2
    workdir = str(tmp_path / "run")
    async_loop.run(c, workdir)
  finally:
    ray.shutdown()
  _check_pushes(workdir, tree, largest)


def _big_model(tmp_path):
  """A 1.3 GiB model (16 wide experts per MoE layer), saved: (init dir, tree bytes, largest
  leaf bytes)."""
  cfg = config_lib.get_preset("tiny", n_routed_experts=16, moe_intermediate_size=32768)
  shapes, _ = gnn.abstract_params(cfg)
  sizes = [x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)]
  assert sum(sizes) >= 2**30, sum(sizes)
  init = str(tmp_path / "init")
  orbax_io.save_params(init, cfg, gnn.init_params(cfg, jax.random.PRNGKey(0)))
  return init, sum(sizes), max(sizes)


def _check_pushes(workdir, tree, largest):
  """The ledger audits clean; each process's peak RSS growth over a push is at most its
  share of the tree (each holds a whole replica) plus the largest leaf plus 10%, and the
  worker read exactly its share."""
  assert not ledger_lib.audit(os.path.join(workdir, "rollouts.jsonl"))
  rows = [r for r in metrics_lib.read_rows(workdir) if "loss" in r]
  bound = 1.1 * (tree + largest)
  pulls = [r for r in rows if r["pull_rss_growth_bytes_max"] > 0]
  assert pulls, rows                                   # a push after the first was read
  for r in rows:
    print(f"update {r['step']}: push {r['push_bytes'] / 2**20:.0f} MiB in {r['push_s']:.2f} s, "
          f"trainer RSS growth {r['push_rss_growth_bytes'] / 2**20:.0f} MiB; worker read "
          f"{r['pull_bytes_max'] / 2**20:.0f} MiB in {r['pull_s_max']:.2f} s, RSS growth "
          f"{r['pull_rss_growth_bytes_max'] / 2**20:.0f} MiB; bound {bound / 2**20:.0f} MiB")
    assert r["push_bytes"] == tree and r["push_rss_growth_bytes"] <= bound, r
    assert r["logp_abs_diff_max"] <= 1e-6 and r["topk_mismatches"] == 0, r
  for r in pulls:
    assert r["pull_bytes_max"] == tree, r
    # The new version is read while the engine still serves the old one: a tree of growth.
    assert tree / 2 <= r["pull_rss_growth_bytes_max"] <= bound, r


DISTRIBUTED = "task=tool_calc,backend=distributed,runlocal=True"


def _distributed_cmds(init, workdir, total_steps, **rl):
  """The two processes of a jax.distributed run (process 0 trains, process 1 serves worker
  0), each with one CPU device, with `small_config`'s settings plus `rl` as flags."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  c, default = small_config(init, backend="distributed", **rl), rl_async.get_config(DISTRIBUTED)
  flags = [f"--config.rl.{k}={v}" for k, v in c.rl.items()
           if isinstance(v, (int, float)) and v != default.rl[k]]
  base = [sys.executable, "-m", "experiments.rl_async", "--devices=1",
          f"--config=configs/rl_async.py:{DISTRIBUTED}",
          f"--config.init_from={init}", f"--workdir={workdir}", "--config.tensorboard=False",
          f"--config.total_steps={total_steps}", f"--config.optimizer={c.optimizer}", *flags,
          f"--config.distributed.coordinator_address=127.0.0.1:{port}",
          "--config.distributed.num_processes=2", "--config.distributed.cpu_collectives=True"]
  return [base + [f"--config.distributed.process_id={i}"] for i in range(2)]


def _run_processes(cmds, timeout=900):
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True) for cmd in cmds]
  errs = [p.communicate(timeout=timeout)[1] for p in procs]
  for p, err in zip(procs, errs):
    assert p.returncode == 0, err[-4000:]


@pytest.mark.slow
def test_distributed_pushes_of_a_1gib_model_stay_within_each_processs_share(tmp_path):
  """Trainer (process 0) and rollout worker (process 1) of one jax.distributed cluster
  exchange sharded snapshots of a 1.3 GiB model (WORKDIR/weights): the bounds of the Ray
  test above, and the trainer's checkpoint written by process 0 alone."""
  init, tree, largest = _big_model(tmp_path)
  workdir = str(tmp_path / "run")
  _run_processes(_distributed_cmds(init, workdir, 2, **ONE_GROUP_PUSHES))
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "2"))
  assert not os.path.exists(os.path.join(workdir, "checkpoints", "1"))
  _check_pushes(workdir, tree, largest)


if __name__ == "__main__":   # python -m tests.rl.test_async INIT_DIR WORKDIR TOTAL CKPT_EVERY
  from glm5_jax import numerics  # pylint: disable=g-import-not-at-top
  numerics.batch_invariant_cpu()
  _c = small_config(sys.argv[1], checkpoint_every=int(sys.argv[4]))
  _c.total_steps = int(sys.argv[3])
  async_loop.run(_c, sys.argv[2])
